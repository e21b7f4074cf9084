"""`zero-lab grade`: score a learner's notebook with the lesson's visible and hidden tests.

nbgrader keeps the hidden tests in its gradebook, so grading builds a throwaway course in a
temporary folder: the lesson's source from solutions/ goes through `generate_assignment`
(which records every test cell, hidden parts included), each notebook to grade becomes the
submission of one student, and `nbgrader autograde` runs them with the test cells restored
from the gradebook (confined as sandbox.py says; a test earns points only for the notebook's
own code, as grading_guard.py says). Demo cells (tagged `demo`, `seed:<id>` or
`q:<id>`) are dropped from the graded copy: they must define nothing a test needs. A cell that hangs is interrupted after
`Execute.timeout` (nbgrader_config.py); test cells also give `zero_lab.launch` a short
timeout of their own. If a cell kills the kernel, that cell is skipped and the notebook graded
again. Each lost point comes with a one-line reason taken from the test cell's error (its
type and message, never the hidden code).
"""

from __future__ import annotations

import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from nbgrader.api import Gradebook
from traitlets.config.loader import PyFileConfigLoader

from zero_lab.course_tools import build, grading_kernel
from zero_lab.course_tools.export import is_demo
from zero_lab.course_tools.implementation import REPO

STUDENT = "learner"
# Backstop for the whole autograde run: well above the sum of the lessons' cell timeouts.
AUTOGRADE_TIMEOUT = 3600
KERNEL_DEATHS = 3  # re-grades after a cell killed the kernel, per notebook
ANSI = re.compile(r"\x1b\[[0-9;]*m")
FRAME = re.compile(r'File "[^"]*", line \d+, in (\S+)')
# A frame of a notebook cell: in a rank's traceback (Python's format, the cell named by the launcher or by its
# IPython file), and in IPython's own (its source line marked with an arrow).
RANK_CELL_FRAME = re.compile(r'File "(?:Cell In\[\d+\]|[^"]*ipykernel_\d+/[^"]+)", line (\d+), in (\S+)\n(?:[ \t]+(\S[^\n]*))?')
CELL_FRAME = re.compile(r"Cell In\[\d+\], line (\d+), in ([\w.<>]+)[^\n]*\n(?:.*\n)*?-+> *\d+ ?(.*)")


class GradingError(Exception):
    pass


@dataclass(frozen=True)
class TestScore:
    test_id: str
    earned: float
    possible: float
    reason: str = ""  # why points were lost, one line ("" for full marks)


@dataclass
class Report:
    scores: list[TestScore]
    notes: list[str] = field(default_factory=list)  # e.g. which cell killed the kernel

    @property
    def by_id(self) -> dict[str, TestScore]:
        return {score.test_id: score for score in self.scores}

    @property
    def total(self) -> tuple[float, float]:
        return sum(s.earned for s in self.scores), sum(s.possible for s in self.scores)


def learner_notebook(path: Path) -> Path:
    """A lesson folder (work/NN_name, course/NN_name) or a notebook -> the notebook."""
    path = Path(path)
    notebook = path / f"{path.name}.ipynb" if path.is_dir() else path
    if notebook.suffix != ".ipynb" or not notebook.is_file():
        raise GradingError(f"{path}: expected a lesson folder like work/00_collectives or its .ipynb")
    return notebook


# A message that lists what failed under a count: "24 check(s) failed:", "7 rank(s) with wrong pieces:".
LIST_HEADER = re.compile(r"(\d+) [^:]*\(s\)[^:]*:")
MAX_REASON = 200  # characters of a message kept in a reason: the score table stays one line per test


def first_line(text: str) -> str:
    """A message in one line: its first line; under a count header, the first listed item and how many more."""
    lines = [line.strip() for line in ANSI.sub("", text).strip().splitlines() if line.strip()]
    if not lines:
        return ""
    header = LIST_HEADER.fullmatch(lines[0])
    if not header or len(lines) < 2:
        return shorten(lines[0])
    more = int(header[1]) - 1
    return shorten(lines[1].removeprefix("- ")) + (f" (+{more} more)" if more > 0 else "")


def shorten(line: str) -> str:
    return line if len(line) <= MAX_REASON else line[:MAX_REASON - 1].rstrip() + "…"


def raised(traceback: str) -> str:
    """The exception a Python traceback ends with, its message's lines included (a rank's: RankFailed)."""
    lines = traceback.strip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    start = frames[-1] + 1 if frames else 0
    while start < len(lines) - 1 and lines[start][:1].isspace():  # the frame's source line and its ^^^ marks
        start += 1
    return "\n".join(lines[start:])


def where_in_notebook(text: str) -> str:
    """The innermost notebook frame of a traceback, as ' (in FUNCTION, line N of its cell: `SOURCE`)', or ''."""
    frames = RANK_CELL_FRAME.findall(text) or CELL_FRAME.findall(text)
    if not frames:
        return ""
    line, function, source = frames[-1]
    return f" (in {function}, line {line} of its cell" + (f": `{source.strip()}`)" if source.strip() else ")")


def reason(error: dict | None, earned: float, possible: float) -> str:
    """One line saying why a test cell lost points, from its error output."""
    if earned >= possible:
        return ""
    if error is None:
        return "no error, but not full points (partial credit)"
    name, value = error["ename"], ANSI.sub("", error["evalue"])
    if name == "RuntimeError" and value == grading_kernel.KILLED:
        return "the kernel died in this cell (os._exit, a crash or out of memory)"
    if name == "NotImplementedError":
        # The notebook's one-line message (course_tools/notebook.py) names the function, or
        # IPython's traceback, whose frames read "File ..., line N, in function".
        traceback = ANSI.sub("", "\n".join(error.get("traceback", [])))
        named = re.findall(r"(\w+)\(\) is not written yet", traceback) or re.findall(r", in (\w+)", traceback)
        return f"not attempted: {named[-1]}() raises NotImplementedError" if named else "not attempted (NotImplementedError)"
    if name == "RankFailed":
        # The first failed rank's traceback; RankFailed appends "then rank R failed: ..." for the others.
        rank_error = [line for line in value.strip().splitlines() if not line.startswith("then rank ")]
        name, _, message = raised("\n".join(rank_error[1:])).partition(": ")
        header, error = rank_error[0].rstrip(":"), f"{name}: {first_line(message)}" if message else first_line(name)
        if error.startswith("NotImplementedError"):
            function = (FRAME.findall(value) or [""])[-1]
            return f"not attempted: {function}() raises NotImplementedError ({header})"
        return f"{header}: {error}{where_in_notebook(value)}"
    if name == "RanksHung":
        lines = [line.strip().rstrip(":") for line in value.split("\n\n", 1)[0].splitlines()]
        return "deadlock: " + "; ".join(lines[:4]) + ("; ..." if len(lines) > 4 else "")
    if name == "CellTimeoutError":
        return "timed out: the cell did not finish within nbgrader's cell timeout"
    if name == "AssertionError":
        return f"AssertionError: {first_line(value)}" if first_line(value) else "AssertionError (a check failed)"
    traceback = ANSI.sub("", "\n".join(error.get("traceback", [])))
    return f"{name}: {first_line(value)}{where_in_notebook(traceback)}"


def drop_demo_cells(notebook: Path) -> None:
    nb = build.read_notebook(notebook)
    nb.cells = [cell for cell in nb.cells if not is_demo(cell)]
    notebook.write_text(build.notebook_text(nb))


def lesson_of(notebook: Path, repo: Path) -> str:
    lesson = notebook.stem
    if not build.source_notebook(repo, lesson).is_file():
        raise GradingError(f"{notebook}: no lesson {lesson!r} in {repo / build.SOURCE_DIR} (keep the notebook's name)")
    return lesson


def hand_in(course_root: Path, lesson: str, student: str, notebook: Path) -> Path:
    """Place a notebook where `nbgrader collect` would: submitted/<student>/<lesson>/, with the
    timestamp.txt and submission_secret.txt that `release_feedback` needs."""
    folder = course_root / "submitted" / student / lesson
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(learner_notebook(notebook), folder / f"{lesson}.ipynb")
    (folder / "timestamp.txt").write_text(datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f %Z"))
    (folder / "submission_secret.txt").write_text(secrets.token_hex(16))
    return folder


def grade(notebook_path: Path, repo: Path = REPO, progress: Callable[[str], None] | None = None) -> Report:
    """Autograde one notebook against solutions/<lesson> (the lesson is the notebook's name)."""
    notebook = learner_notebook(notebook_path)
    return grade_many(lesson_of(notebook, repo), {STUDENT: notebook}, repo, progress)[STUDENT]


def grade_many(lesson: str, notebooks: dict[str, Path], repo: Path = REPO,
               progress: Callable[[str], None] | None = None) -> dict[str, Report]:
    """Autograde several notebooks of one lesson (student name -> notebook) in one course."""
    source = build.annotated_sources(repo, [lesson])
    order = [c.metadata.nbgrader["grade_id"] for c in source[lesson].cells if c.metadata.get("nbgrader", {}).get("grade")]
    with tempfile.TemporaryDirectory(prefix="zero-lab-grade-") as tmp:
        root = Path(tmp)
        build.make_course(root, repo, source)
        build.run_nbgrader(root, "generate_assignment", lesson, "--force")
        state = root / "state"
        state.mkdir()
        cells = {}
        for student, path in notebooks.items():
            submission = hand_in(root, lesson, student, path)
            drop_demo_cells(submission / f"{lesson}.ipynb")  # grading runs what tests need, quickly
            cells[student] = sum(c.cell_type == "code" for c in build.read_notebook(submission / f"{lesson}.ipynb").cells)
        notes = {student: [] for student in notebooks}
        killed = autograde(root, lesson, list(notebooks), state, cells, progress)
        for student, killer in killed.items():  # grade again without the killer cells
            for _ in range(KERNEL_DEATHS):
                with open(state / f"skip-{student}", "a") as skip:
                    skip.write(grading_kernel.cell_hash(killer) + "\n")
                notes[student].append(f"a cell killed the kernel; graded again without it: {first_line(killer)}")
                killer = autograde(root, lesson, [student], state, cells, progress).get(student)
                if killer is None:
                    break
            else:
                raise GradingError(f"{notebooks[student]}: the kernel kept dying ({'; '.join(notes[student])})")
        reports = {}
        for student in notebooks:
            scores = read_scores(root, lesson, student)
            reports[student] = Report(sorted(scores, key=lambda s: order.index(s.test_id)), notes[student])
    return reports


def autograde(root: Path, lesson: str, students: list[str], state: Path, cells: dict[str, int],
              progress: Callable[[str], None] | None) -> dict[str, str]:
    """Run `nbgrader autograde` for these students; return {student: source of the cell that
    killed the kernel} for those whose kernel died."""
    # Earlier lessons' modules are the reference: a lesson is graded on its own exercises.
    env = build.nbgrader_env(root, ZERO_LAB_GRADE_STATE=str(state), ZERO_LAB_IMPL="reference")
    args = ["autograde", lesson, "--force", *(["--student", students[0]] if len(students) == 1 else [])]
    log = root / "autograde.log"
    started, shown = time.monotonic(), None
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "nbgrader", *args], cwd=root, env=env,
                                   stdout=out, stderr=subprocess.STDOUT)
        while process.poll() is None:
            if time.monotonic() - started > AUTOGRADE_TIMEOUT:
                process.kill()
                process.wait()
                raise GradingError(f"`nbgrader autograde {lesson}` did not finish within {AUTOGRADE_TIMEOUT} s")
            if progress and (line := status_line(lesson, students, state, cells, time.monotonic() - started)) != shown:
                progress(line)
                shown = line
            time.sleep(0.5)
    log_text = log.read_text()
    kernel_died = "DeadKernelError" in log_text or "Kernel died" in log_text
    killed = {}
    for student in students:
        count, source = running_cell(state, student)
        graded = (root / "autograded" / student / lesson / f"{lesson}.ipynb").exists()
        if kernel_died and count and not graded:  # its kernel died in the middle of this cell
            killed[student] = source
    if process.returncode != 0 and not killed:
        raise GradingError(f"`nbgrader {' '.join(args)}` failed:\n{log_text}")
    return killed


def running_cell(state: Path, student: str) -> tuple[str, str]:
    """(count, source) of the cell the student's kernel is running, ('', '') between cells."""
    running = state / f"running-{student}"
    text = running.read_text() if running.exists() else ""
    count, _, source = text.partition("\n")
    return count, source


def status_line(lesson: str, students: list[str], state: Path, cells: dict[str, int], elapsed: float) -> str:
    for student in students:
        count, source = running_cell(state, student)
        if count:
            test = re.match(r"#\|\s*test\s+([\w-]+)", source.lstrip())
            doing = f"test {test[1]}" if test else f"cell {count} of {cells[student]}"
            who = f" ({student})" if len(students) > 1 else ""
            return f"grading {lesson}{who}: {doing}, {elapsed:.0f} s"
    return f"grading {lesson}: starting, {elapsed:.0f} s"


def read_scores(root: Path, lesson: str, student: str) -> list[TestScore]:
    config = PyFileConfigLoader(build.CONFIG_NAME, path=str(root)).load_config()
    graded = build.read_notebook(root / "autograded" / student / lesson / f"{lesson}.ipynb")
    errors = {}
    for cell in graded.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        error = next((o for o in cell.get("outputs", []) if o.output_type == "error"), None)
        errors[grade_id] = error
    db_url = f"sqlite:///{root / 'gradebook.db'}"
    with Gradebook(db_url, config.CourseDirectory.course_id) as gradebook:
        submission = gradebook.find_submission(lesson, student)
        return [
            TestScore(grade.name, grade.score, grade.max_score, reason(errors.get(grade.name), grade.score, grade.max_score))
            for notebook in submission.notebooks
            for grade in notebook.grades
        ]


def score_table(report: Report) -> str:
    scores = report.scores
    earned, possible = report.total
    cells = [(s.test_id, f"{s.earned:g} / {s.possible:g}", s.reason) for s in scores]
    width = max(len(name) for name, _, _ in cells + [("test", "", "")])
    points = max(len(p) for _, p, _ in cells + [("", "points", ""), ("", f"{earned:g} / {possible:g}", "")])
    rows = [("test", "points", "why points were lost"), *cells, ("-" * width, "-" * points, ""),
            ("total", f"{earned:g} / {possible:g}", "")]
    lines = [f"{name:<{width}}  {p:>{points}}  {why}".rstrip() for name, p, why in rows]
    return "\n".join([*lines, *[f"note: {note}" for note in report.notes]])
