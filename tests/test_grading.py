"""`zero-lab grade`: every lesson's reference earns full marks and its learner edition none, with
reasons; on a fixture lesson, one autograde run of four notebooks shows that hidden tests
count, a deadlock costs only its points, a cell that kills the kernel is reported and the rest
scored, and that learner code runs confined (its folder, scratch HOME/TMPDIR, no survivors)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from zero_lab.course_tools import build, grading
from zero_lab.course_tools.implementation import REPO

FIXTURE = Path(__file__).parent / "fixtures" / "99_fixture"
# Setting up `fixture_reports` autogrades four notebooks (and one again): minutes on a busy machine.
pytestmark = pytest.mark.timeout(1200)
LESSONS = build.find_lessons(REPO) or [pytest.param(None, marks=pytest.mark.skip(reason="no lesson in solutions/ yet"))]


@pytest.mark.parametrize("lesson", LESSONS)
def test_reference_solution_earns_full_marks(lesson, graded):
    report = graded(lesson, "solution")
    earned, possible = report.total
    assert possible > 0 and earned == possible, grading.score_table(report)


@pytest.mark.parametrize("lesson", LESSONS)
def test_learner_edition_earns_nothing_and_says_why(lesson, graded):
    report = graded(lesson, "learner")
    earned, possible = report.total
    assert possible > 0 and earned == 0, grading.score_table(report)
    assert all(score.reason for score in report.scores), grading.score_table(report)


@pytest.fixture(scope="module")
def fixture_repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    shutil.copytree(FIXTURE, repo / "solutions" / "99_fixture")
    build.build(repo)
    return repo


def answered(nb, grade_id, code):
    cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)
    cell.source = cell.source.replace("raise NotImplementedError()", code)
    return nb


WITNESS = """\
import json, os, subprocess
from ipykernel.connect import get_connection_file
child = subprocess.Popen(["sleep", "600"], start_new_session=True)  # escapes the process group
json.dump({{"cwd": os.getcwd(), "home": os.environ["HOME"], "tmp": os.environ["TMPDIR"], "child": child.pid,
           "connection": json.load(open(get_connection_file()))}},
          open({path!r}, "w"))"""


@pytest.fixture(scope="module")
def fixture_reports(fixture_repo, tmp_path_factory):
    """One autograde run: reference, untouched learner edition, wrong answers, a kernel killer."""
    folder = tmp_path_factory.mktemp("submissions")
    learner = fixture_repo / "course/99_fixture/99_fixture.ipynb"
    # Only rank 0 enters the all-reduce: the launcher's 10 s timeout must end the test cell;
    # `return 4` passes the visible test of `double` and fails the hidden one.
    wrong = answered(build.read_notebook(learner), "fixture_ops-all_sum", "if dist.get_rank() == 0: dist.all_reduce(tensor)")
    wrong = answered(wrong, "double", "return 4")
    # Right answers, then a cell that leaves a setsid child and a cell that kills the kernel.
    killer = answered(build.read_notebook(learner), "fixture_ops-all_sum", "dist.all_reduce(tensor)")
    killer = answered(killer, "double", "return 2 * x")
    witness = folder / "witness.json"
    killer.cells[2:2] = [nbformat.v4.new_code_cell(WITNESS.format(path=str(witness))),
                         nbformat.v4.new_code_cell("import os\nos._exit(0)  # kills the kernel")]
    notebooks = {"reference": fixture_repo / "solutions/99_fixture/99_fixture.ipynb", "learner": learner}
    for student, nb in {"wrong": wrong, "killer": killer}.items():
        (folder / student).mkdir()
        nbformat.write(nb, folder / student / "99_fixture.ipynb")
        notebooks[student] = folder / student / "99_fixture.ipynb"
    lines = []
    reports = grading.grade_many("99_fixture", notebooks, repo=fixture_repo, progress=lines.append)
    return reports, json.loads(witness.read_text()), lines


GRADING_SPY = """
import zero_lab.course_tools.grading as grading
queued = []
grading.grade_many = lambda lesson, notebooks: queued.append(lesson) or {}


def pytest_unconfigure(config):
    print("queued:", sorted(queued))
"""


def test_a_run_whose_selection_needs_no_grading_queues_none(tmp_path):
    (tmp_path / "grading_spy.py").write_text(GRADING_SPY)  # records what the `graded` fixture queues, grades nothing
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "grading_spy", "-p", "no:cacheprovider", "-k", "no_test_has_this_name",
                          __file__], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert "queued: []" in run.stdout, run.stdout[-2000:]


def test_fixture_reference_and_learner_edition(fixture_reports):
    reports, _, progress = fixture_reports
    assert [(s.test_id, s.earned, s.possible, s.reason) for s in reports["reference"].scores] == [
        ("test_all_sum", 2, 2, ""), ("test_double", 1, 1, "")]
    # Both ranks raise; whichever the launcher heard from first is named.
    learner = [(s.earned, re.sub(r"rank [01] of", "rank R of", s.reason)) for s in reports["learner"].scores]
    assert learner == [(0, "not attempted: all_sum() raises NotImplementedError (rank R of 2 failed)"),
                       (0, "not attempted: double() raises NotImplementedError")]
    assert any(line.startswith("grading 99_fixture") and "test test_all_sum" in line for line in progress)


def test_deadlock_and_hidden_tests_cost_their_points_and_say_why(fixture_reports):
    scores = fixture_reports[0]["wrong"].by_id
    assert (scores["test_all_sum"].earned, scores["test_double"].earned) == (0, 0)
    # The launcher's timeout ended the deadlock (not nbgrader's 300 s cell timeout), and the
    # reason names the stuck rank.
    assert scores["test_all_sum"].reason.startswith("deadlock: 1 of 2 ranks still running after 10 s; rank 0")
    assert scores["test_double"].reason == "AssertionError (a check failed)"  # the hidden check, not its code


def test_a_cell_that_kills_the_kernel_is_reported_and_the_rest_scored(fixture_reports):
    report = fixture_reports[0]["killer"]
    assert report.total == (3, 3)
    assert report.notes == ["a cell killed the kernel; graded again without it: import os"]
    assert "note: a cell killed the kernel" in grading.score_table(report)


def test_learner_code_runs_in_its_folder_with_scratch_home_and_leaves_no_process(fixture_reports):
    witness = fixture_reports[1]
    assert Path(witness["cwd"]).parts[-3:] == ("autograded", "killer", "99_fixture")
    for scratch in witness["home"], witness["tmp"]:
        assert Path(scratch).is_relative_to(Path(witness["cwd"]).parents[2]), scratch  # inside the grading course
        assert not Path(scratch).exists()  # removed after grading
    assert witness["home"] != os.environ.get("HOME")
    # The kernel listens on Unix sockets, so no rank's gloo socket can take its port first.
    connection = witness["connection"]
    assert connection["transport"] == "ipc" and not Path(connection["ip"]).parent.exists(), connection
    with pytest.raises(ProcessLookupError):
        os.kill(witness["child"], 0)


def test_score_table_gives_points_and_reasons():
    report = grading.Report([grading.TestScore("test_a", 2, 2), grading.TestScore("test_b", 0, 1, "not attempted")])
    assert grading.score_table(report).splitlines() == [
        "test    points  why points were lost",
        "test_a   2 / 2",
        "test_b   0 / 1  not attempted",
        "------  ------",
        "total    2 / 3",
    ]


def test_demo_cells_are_dropped_from_the_graded_copy(tmp_path):
    tagged = {"demo": ["demo"], "answer": ["seed:zero-stages"], "question": ["q:why"], "kept": ["raises-exception"]}
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(name, metadata={"tags": tags})
                                         for name, tags in tagged.items()])
    nbformat.write(nb, tmp_path / "nb.ipynb")
    grading.drop_demo_cells(tmp_path / "nb.ipynb")
    assert [c.source for c in build.read_notebook(tmp_path / "nb.ipynb").cells] == ["kept"]


RANK_TRACEBACK = '''rank 1 of 2 failed:
Traceback (most recent call last):
  File "/repo/zero_lab/launcher.py", line 182, in _rank_main
    message = ("ok", _on_host(fn(*args, **kwargs)))
  File "Cell In[2]", line 6, in fn
    return charge(dist.get_rank())
           ^^^^^^^^^^^^^^^^^^^^^^^
  File "Cell In[2]", line 3, in charge
    return x.nope
           ^^^^^^
AttributeError: 'int' object has no attribute 'nope'
then rank 0 failed: AttributeError: 'int' object has no attribute 'nope\''''
IPYTHON_TRACEBACK = ["\x1b[31m---------\x1b[39m", "AttributeError  Traceback (most recent call last)",
                     "Cell In[4], line 1\n----> 1 charge(3)\n", "Cell In[2], line 3, in charge(x)\n      1 def charge(x):\n"
                     "      2     y = 1\n\x1b[32m----> 3\x1b[39m     return x.nope\n",
                     "AttributeError: 'int' object has no attribute 'nope'"]


def test_a_reason_names_the_learners_function_line_and_code():
    """An exception in the learner's code, in a rank or in the kernel, is reported with where it was raised."""
    where = " (in charge, line 3 of its cell: `return x.nope`)"
    assert grading.reason(dict(ename="RankFailed", evalue=RANK_TRACEBACK), 0, 2) == \
        "rank 1 of 2 failed: AttributeError: 'int' object has no attribute 'nope'" + where
    assert grading.reason(dict(ename="AttributeError", evalue="'int' object has no attribute 'nope'",
                               traceback=IPYTHON_TRACEBACK), 0, 2) == "AttributeError: 'int' object has no attribute 'nope'" + where


CHECKS_FAILED = "3 check(s) failed:\n- the plan's dp size is 2, expected 4\n- 2 collectives too many\n- bytes off by 12"


def test_a_reason_under_a_count_header_names_the_first_failed_check_and_how_many_more():
    """The header styles the lessons' tests use ("N check(s) failed:", "N rank(s) with wrong pieces:") say nothing
    by themselves: the line names the first listed item, in the kernel and in a rank."""
    first = "AssertionError: the plan's dp size is 2, expected 4 (+2 more)"
    assert grading.reason(dict(ename="AssertionError", evalue=CHECKS_FAILED), 0, 2) == first
    pieces = "7 rank(s) with wrong pieces:\n- rank 0: [Piece('w', (3,), 0, 3, 0)]\n- rank 1: []\n- rank 2: []"
    assert grading.reason(dict(ename="AssertionError", evalue=pieces), 0, 2) == \
        "AssertionError: rank 0: [Piece('w', (3,), 0, 3, 0)] (+6 more)"
    assert grading.reason(dict(ename="AssertionError", evalue="1 check(s) failed:\n- only this"), 0, 2) == \
        "AssertionError: only this"
    in_a_rank = RANK_TRACEBACK.replace("AttributeError: 'int' object has no attribute 'nope'\nthen",
                                       f"AssertionError: {CHECKS_FAILED}\nthen")
    assert grading.reason(dict(ename="RankFailed", evalue=in_a_rank), 0, 2) == \
        f"rank 1 of 2 failed: {first} (in charge, line 3 of its cell: `return x.nope`)"
    long = grading.reason(dict(ename="AssertionError", evalue="2 check(s) failed:\n- " + "x" * 500 + "\n- y"), 0, 2)
    assert len(long) < 250 and long.endswith("… (+1 more)"), long
    assert grading.reason(dict(ename="AssertionError", evalue="plain: one line\nand a second"), 0, 2) == \
        "AssertionError: plain: one line"
