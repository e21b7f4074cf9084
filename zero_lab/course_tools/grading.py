"""`zero-lab grade`: score a learner's notebook with the lesson's visible and hidden tests.

nbgrader keeps the hidden tests in its gradebook, so grading builds a throwaway course in a
temporary folder: the lesson's source from solutions/ goes through `generate_assignment`
(which records every test cell, hidden parts included), the learner's notebook becomes the
submission of one student, and `nbgrader autograde` runs it with the test cells restored
from the gradebook. A cell that hangs is interrupted after `Execute.timeout`
(nbgrader_config.py); test cells also give `zero_lab.launch` a short timeout of their own.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from nbgrader.api import Gradebook
from traitlets.config.loader import PyFileConfigLoader

from zero_lab.course_tools import build
from zero_lab.course_tools.implementation import REPO

STUDENT = "learner"
# Backstop for the whole autograde run: well above the sum of the lessons' cell timeouts.
AUTOGRADE_TIMEOUT = 3600


class GradingError(Exception):
    pass


@dataclass(frozen=True)
class TestScore:
    test_id: str
    earned: float
    possible: float


def learner_notebook(path: Path) -> Path:
    """A lesson folder (course/NN_name) or a notebook -> the notebook."""
    path = Path(path)
    notebook = path / f"{path.name}.ipynb" if path.is_dir() else path
    if notebook.suffix != ".ipynb" or not notebook.is_file():
        raise GradingError(f"{path}: expected a lesson folder like course/00_collectives or its .ipynb")
    return notebook


def grade(notebook_path: Path, repo: Path = REPO) -> list[TestScore]:
    """Autograde a notebook against solutions/<lesson> (the lesson is the notebook's name)."""
    notebook = learner_notebook(notebook_path)
    lesson = notebook.stem
    if not build.source_notebook(repo, lesson).is_file():
        raise GradingError(f"{notebook}: no lesson {lesson!r} in {repo / build.SOURCE_DIR} (keep the notebook's name)")
    source = build.annotated_sources(repo, [lesson])
    with tempfile.TemporaryDirectory(prefix="zero-lab-grade-") as tmp:
        root = Path(tmp)
        build.make_course(root, repo, source)
        build.run_nbgrader(root, "generate_assignment", lesson, "--force")
        submission = root / "submitted" / STUDENT / lesson
        submission.mkdir(parents=True)
        shutil.copy(notebook, submission / notebook.name)
        build.run_nbgrader(root, "autograde", lesson, "--student", STUDENT, "--force", timeout=AUTOGRADE_TIMEOUT)
        scores = read_scores(root, lesson)
    order = [c.metadata.nbgrader["grade_id"] for c in source[lesson].cells if c.metadata.get("nbgrader", {}).get("grade")]
    return sorted(scores, key=lambda s: order.index(s.test_id))


def read_scores(root: Path, lesson: str) -> list[TestScore]:
    config = PyFileConfigLoader(build.CONFIG_NAME, path=str(root)).load_config()
    db_url = f"sqlite:///{root / 'gradebook.db'}"
    with Gradebook(db_url, config.CourseDirectory.course_id) as gradebook:
        submission = gradebook.find_submission(lesson, STUDENT)
        return [
            TestScore(grade.name, grade.score, grade.max_score)
            for notebook in submission.notebooks
            for grade in notebook.grades
        ]


def score_table(scores: list[TestScore]) -> str:
    total = TestScore("total", sum(s.earned for s in scores), sum(s.possible for s in scores))
    cells = [(s.test_id, f"{s.earned:g} / {s.possible:g}") for s in [*scores, total]]
    width = max(len(name) for name, _ in cells + [("test", "")])
    points = max(len(p) for _, p in cells + [("", "points")])
    rows = [("test", "points"), *cells[:-1], ("-" * width, "-" * points), cells[-1]]
    return "\n".join(f"{name:<{width}}  {p:>{points}}" for name, p in rows)
