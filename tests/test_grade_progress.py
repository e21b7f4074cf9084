"""What `zero-lab grade` prints while it grades: plain lines off a terminal, one erased line on it."""

import io
import shutil

import pytest

from zero_lab.course_tools import build, cli, grading
from zero_lab.course_tools.cli import GradingProgress

LESSON = build.REPO / "course" / "00_collectives" / "00_collectives.ipynb"


class Terminal(io.StringIO):
    def isatty(self):
        return True


def feed(progress, lines):
    for line in lines:
        progress(line)
    progress.done()


def test_off_a_terminal_one_plain_line_per_test_with_its_number():
    out = io.StringIO()
    progress = GradingProgress(LESSON, out)
    first, second, third = progress.tests[:3]
    feed(progress, ["grading 00_collectives: starting, 0 s", "grading 00_collectives: cell 3 of 40, 2 s",
                    f"grading 00_collectives: test {second}, 5 s", f"grading 00_collectives: test {second}, 6 s",
                    f"grading 00_collectives: test {third}, 9 s"])
    n = len(progress.tests)
    # the first test ran between two polls: it is announced all the same, in order
    assert out.getvalue().splitlines()[:3] == [f"grading test 1/{n}: {first} ...",
                                               f"grading test 2/{n}: {second} ...",
                                               f"grading test 3/{n}: {third} ..."]


@pytest.mark.parametrize("last_seen", [0, 1, 3])
def test_off_a_terminal_every_test_is_announced_though_the_last_ran_after_the_final_poll(last_seen):
    """nbgrader often ends between two polls: lesson 12's grade used to stop at "grading test 6/7"."""
    out = io.StringIO()
    progress = GradingProgress(LESSON, out)
    seen = progress.tests[:last_seen]
    feed(progress, ["grading 00_collectives: starting, 0 s",
                    *(f"grading 00_collectives: test {test}, {i} s" for i, test in enumerate(seen, 1))])
    n = len(progress.tests)
    assert out.getvalue().splitlines() == [f"grading test {i}/{n}: {test} ..." for i, test in enumerate(progress.tests, 1)]


def test_on_a_terminal_the_line_is_erased_so_the_table_starts_at_column_1():
    out = Terminal()
    feed(GradingProgress(LESSON, out), ["grading 00_collectives: starting, 0 s"])
    text = out.getvalue()
    assert "\n" not in text and text.endswith("\r") and text.rsplit("\r", 2)[1].strip() == ""


@pytest.mark.parametrize("given", ["folder", "notebook"])
def test_zero_lab_grade_takes_a_lesson_folder_or_its_notebook(tmp_path, monkeypatch, capsys, given):
    folder = tmp_path / LESSON.parent.name
    shutil.copytree(LESSON.parent, folder)
    graded = []

    def grade(notebook, progress):  # what the command hands the grader, without a grading run
        graded.append(notebook)
        progress(f"grading {folder.name}: starting, 0 s")
        return "report"

    monkeypatch.setattr(grading, "grade", grade)
    monkeypatch.setattr(grading, "score_table", lambda report: f"table of the {report}")
    assert cli.main(["grade", str(folder if given == "folder" else folder / LESSON.name)]) == 0
    assert graded == [folder / LESSON.name] and "table of the report" in capsys.readouterr().out
