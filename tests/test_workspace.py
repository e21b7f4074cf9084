"""The learner's workspace never loses work: `zero-lab start` copies once, `--fresh` keeps a
backup, a new release comes side by side; `zero-lab build` refuses to overwrite edits; the
learner edition runs to the end with one line per unfinished exercise."""

import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client import KernelManager
from nbclient import NotebookClient

from zero_lab.course_tools import build, implementation, notebook, workspace
from zero_lab.launcher import RankFailed

LESSON = "99_fixture"
COURSE = f"course/{LESSON}/{LESSON}.ipynb"



def git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def answer(path: Path, text="return 2 * x  # mine"):
    nb = build.read_notebook(path)
    cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "double")
    cell.source = cell.source.replace("raise NotImplementedError()", text)
    nbformat.write(nb, path)


def test_start_copies_once_and_never_overwrites(repo):
    started = workspace.start("99", repo)
    assert started.notebook == repo / "work" / LESSON / f"{LESSON}.ipynb"
    answer(started.notebook)
    again = workspace.start(LESSON, repo)
    assert "exists: opening your copy (unchanged)" in again.messages[0]
    assert "# mine" in again.notebook.read_text()
    assert workspace.default_notebook("99", repo) == repo / "work" / LESSON


def test_fresh_start_keeps_a_backup(repo):
    answer(workspace.start(LESSON, repo).notebook)
    started = workspace.start(LESSON, repo, fresh=True)
    backups = list((repo / "work").glob(f"{LESSON}.backup-*"))
    assert len(backups) == 1 and "# mine" in (backups[0] / f"{LESSON}.ipynb").read_text()
    assert "# mine" not in started.notebook.read_text()


def test_a_new_release_is_announced_and_comes_side_by_side(repo):
    mine = workspace.start(LESSON, repo).notebook
    answer(mine)
    source = repo / "solutions" / LESSON / f"{LESSON}.ipynb"
    nb = build.read_notebook(source)
    nb.cells[0].source += "\n\nNew in this release."
    nbformat.write(nb, source)
    build.build(repo)  # what a `git pull` brings
    announced = workspace.start(LESSON, repo)
    assert "a newer release of 99_fixture" in announced.messages[1] and "--side-by-side" in announced.messages[1]
    beside = workspace.start(LESSON, repo, side_by_side=True)
    copies = list((repo / "work" / LESSON).glob(f"release-*/{LESSON}.ipynb"))
    assert len(copies) == 1 and "New in this release." in copies[0].read_text()
    assert "untouched" in beside.messages[1] and "# mine" in mine.read_text()
    assert len(workspace.start(LESSON, repo).messages) == 1  # announced once


def test_unknown_lesson_and_missing_copy_name_the_fix(repo):
    with pytest.raises(workspace.WorkspaceError, match="no lesson '42'"):
        workspace.start("42", repo)
    with pytest.raises(workspace.WorkspaceError, match="`zero-lab start 99_fixture` makes one"):
        workspace.default_notebook(LESSON, repo)


def test_build_refuses_to_overwrite_edits_and_never_touches_work(repo):
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "built")
    mine = workspace.start(LESSON, repo).notebook
    answer(mine)
    in_work = mine.read_bytes()
    answer(repo / COURSE)  # a learner who answered in course/
    source = repo / "solutions" / LESSON / f"{LESSON}.ipynb"
    nb = build.read_notebook(source)
    nb.cells[0].source += "\n\nChanged."
    nbformat.write(nb, source)
    with pytest.raises(build.BuildError, match=f"{COURSE}: not overwritten.*`git checkout -- {COURSE}`"):
        build.build(repo)
    assert "# mine" in (repo / COURSE).read_text()
    git(repo, "checkout", "--", COURSE)
    build.build(repo)
    # What the build wrote itself (not committed yet) it may replace again.
    nb.cells[0].source += " Again."
    nbformat.write(nb, source)
    build.build(repo)
    assert "Again." in (repo / COURSE).read_text()
    assert mine.read_bytes() == in_work


def test_build_outside_git_refuses_edits_it_did_not_make(repo):
    (repo / build.MANIFEST).unlink()
    answer(repo / COURSE)
    with pytest.raises(build.BuildError, match="not overwritten"):
        build.build(repo)


def test_mine_defaults_to_the_workspace(repo, monkeypatch):
    answer(workspace.start(LESSON, repo).notebook)
    monkeypatch.setattr(implementation, "REPO", repo)
    monkeypatch.delenv("ZERO_LAB_MINE_DIR", raising=False)
    directory, names = implementation.learner_modules()
    assert (directory, names) == (repo / "mine", {"fixture_ops"})


def test_unfinished_exercise_in_one_line():
    def ring_all_reduce():
        raise NotImplementedError()

    with pytest.raises(NotImplementedError) as raised:
        ring_all_reduce()
    assert notebook.one_line(raised.value) == (
        "NotImplementedError: ring_all_reduce() is not written yet: finish that exercise, then run this cell again.")
    rank_traceback = ('Traceback (most recent call last):\n  File "x.py", line 3, in run\n'
                      '  File "<cell>", line 2, in reduce_scatter\nNotImplementedError\n')
    assert notebook.one_line(RankFailed(1, 3, rank_traceback)).startswith(
        "NotImplementedError on rank 1: reduce_scatter() is not written yet")
    assert notebook.one_line(RankFailed(1, 3, "ValueError: no")) is None


def test_learner_edition_runs_to_the_end_with_one_line_per_unfinished_exercise(built_repo, tmp_path):
    nb = build.read_notebook(built_repo / COURSE)
    assert nb.metadata.kernelspec.name == "python3" and nb.metadata.language_info.name == "python"
    # Unix sockets: a TCP port the kernel was handed can be taken by a grading run's ranks first (sandbox.py).
    kernel = KernelManager(kernel_name="python3", transport="ipc", ip=str(tmp_path / "kernel"))
    # nbclient, like JupyterLab's Run All, goes on past an error only in cells tagged raises-exception.
    # cleanup_kc: a kernel handed in (km=) would outlive execute(), and its connection file in TMPDIR with it
    NotebookClient(nb, km=kernel, timeout=120, resources={"metadata": {"path": str(built_repo / "course" / LESSON)}}
                   ).execute(cleanup_kc=True)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code)
    errors = ["".join(o.traceback) for c in code for o in c.outputs if o.output_type == "error"]
    assert len(errors) == 2, errors
    assert re.fullmatch(r".*NotImplementedError on rank \d: all_sum\(\) is not written yet: .*", errors[0])
    assert "NotImplementedError: double() is not written yet: finish that exercise" in errors[1]


def test_zero_lab_ask_and_help_load_neither_torch_nor_nbgrader():
    script = ("import sys; from zero_lab.course_tools import cli; cli.main(['ask', 'stage', '3']); "
              "print(sorted({'torch', 'nbformat', 'nbgrader'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"
