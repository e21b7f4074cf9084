"""A lesson's graded cell run against its notebook with one exported cell broken as a learner might
(a mutant), as grading runs it but without nbgrader: the untagged cells in order, then the test cell."""

import nbformat
import pytest

import zero_lab
from zero_lab.course_tools.implementation import REPO


def assert_mutant_fails(lesson: str, old: str, new: str, test_id: str) -> None:
    """The notebook's untagged code cells with `old` replaced by `new`; the cell `#| test test_id` must fail."""
    cells = nbformat.read(REPO / "solutions" / lesson / f"{lesson}.ipynb", as_version=4).cells
    namespace, applied = {"__name__": f"lesson_{lesson}"}, False
    for cell in cells:
        source = cell.source
        if cell.cell_type != "code" or cell.metadata.get("tags"):
            continue
        if source.startswith("#| test "):
            if source.split()[2] != test_id:
                continue
            with pytest.raises((AssertionError, ValueError, RuntimeError, zero_lab.RankFailed, zero_lab.RanksHung)):
                exec(compile(source, test_id, "exec"), namespace)
            break
        if old in source:
            source, applied = source.replace(old, new), True
        exec(compile(source, "cell", "exec"), namespace)
    assert applied, f"the mutant {new.strip()!r} no longer applies to the notebook"
