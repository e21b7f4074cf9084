"""`zero-lab grade`: every lesson's reference earns full marks and its learner edition none;
a fixture lesson shows that hidden tests count and that a deadlock only costs its points."""

import shutil
import time
from pathlib import Path

import nbformat
import pytest

from zero_lab.course_tools import build, grading
from zero_lab.course_tools.implementation import REPO

FIXTURE = Path(__file__).parent / "fixtures" / "99_fixture"
LESSONS = build.find_lessons(REPO) or [pytest.param(None, marks=pytest.mark.skip(reason="no lesson in solutions/ yet"))]
LESSON_TIMEOUT = 1200  # a real lesson starts many ranks; two autogrades on 2 cores


def points(scores):
    return sum(s.earned for s in scores), sum(s.possible for s in scores)


@pytest.mark.timeout(LESSON_TIMEOUT)
@pytest.mark.parametrize("lesson", LESSONS)
def test_reference_solution_earns_full_marks(lesson):
    earned, possible = points(grading.grade(build.source_notebook(REPO, lesson)))
    assert possible > 0 and earned == possible


@pytest.mark.timeout(LESSON_TIMEOUT)
@pytest.mark.parametrize("lesson", LESSONS)
def test_learner_edition_earns_nothing_and_finishes(lesson):
    earned, possible = points(grading.grade(REPO / build.COURSE_DIR / lesson))
    assert possible > 0 and earned == 0


@pytest.fixture(scope="module")
def fixture_repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    shutil.copytree(FIXTURE, repo / "solutions" / "99_fixture")
    build.build(repo)
    return repo


def test_fixture_reference_and_learner_edition(fixture_repo):
    reference = grading.grade(fixture_repo / "solutions/99_fixture/99_fixture.ipynb", repo=fixture_repo)
    assert [(s.test_id, s.earned, s.possible) for s in reference] == [("test_all_sum", 2, 2), ("test_double", 1, 1)]
    assert points(grading.grade(fixture_repo / "course/99_fixture", repo=fixture_repo)) == (0, 3)


def answered(nb, grade_id, code):
    cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)
    cell.source = cell.source.replace("raise NotImplementedError()", code)


def test_deadlock_and_hidden_tests_cost_their_points(fixture_repo, tmp_path):
    learner = build.read_notebook(fixture_repo / "course/99_fixture/99_fixture.ipynb")
    # Only rank 0 enters the all-reduce: the launcher's 10 s timeout must end the test cell.
    answered(learner, "fixture_ops-all_sum", "if dist.get_rank() == 0: dist.all_reduce(tensor)")
    # Passes the visible test, fails the hidden one.
    answered(learner, "double", "return 4")
    nbformat.write(learner, tmp_path / "99_fixture.ipynb")

    started = time.monotonic()
    scores = grading.grade(tmp_path / "99_fixture.ipynb", repo=fixture_repo)
    elapsed = time.monotonic() - started

    assert [(s.test_id, s.earned) for s in scores] == [("test_all_sum", 0), ("test_double", 0)]
    # Far below nbgrader's 300 s cell timeout: the launcher stopped the hung ranks.
    assert elapsed < 150, f"grading took {elapsed:.0f} s"
