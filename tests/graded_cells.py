"""A lesson's graded cell run against its notebook with one exported cell broken as a learner might
(a mutant), as grading runs it but without nbgrader."""

import ast

import nbformat
import pytest

import zero_lab
from zero_lab.course_tools import where
from zero_lab.course_tools.implementation import REPO

DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)


def assert_mutant_fails(lesson: str, old: str, new: str, test_id: str) -> None:
    """The notebook's untagged code cells with `old` replaced by `new`; the cell `#| test test_id` must fail.
    Earlier test cells only define their helpers (as grading keeps them for later test cells)."""
    cells = nbformat.read(REPO / "solutions" / lesson / f"{lesson}.ipynb", as_version=4).cells
    namespace, applied = {"__name__": f"lesson_{lesson}"}, False
    for cell in cells:
        source = cell.source
        if cell.cell_type != "code" or cell.metadata.get("tags"):
            continue
        if source.startswith("#| test "):
            if source.split()[2] != test_id:
                define_helpers(source, namespace)
                continue
            with pytest.raises((AssertionError, ValueError, RuntimeError, zero_lab.RankFailed, zero_lab.RanksHung)):
                exec(compile(source, test_id, "exec"), namespace)
            break
        if old in source:
            source, applied = source.replace(old, new), True
        exec(compile(source, "cell", "exec"), namespace)
    assert applied, f"the mutant {new.strip()!r} no longer applies to the notebook"


def define_helpers(source: str, namespace: dict) -> None:
    tree = ast.parse(source)
    tree.body = [node for node in tree.body if _is_helper(node)]
    exec(compile(tree, "test helpers", "exec"), namespace)


def _is_helper(node: ast.stmt) -> bool:
    """Definitions, imports and constants other cells may share: an assignment that calls something runs a
    check (`results = launch(...)`) unless it names a constant (`ADAMW = dict(...)`, `_TINY = GPTConfig(...)`)."""
    if isinstance(node, DEFINITIONS):
        return True
    if not isinstance(node, (ast.Assign, ast.AnnAssign)):
        return False
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    constant = all(isinstance(t, ast.Name) and t.id.lstrip("_").isupper() for t in targets)
    return constant or not any(isinstance(n, ast.Call) for n in _evaluated(node.value))


def _evaluated(node: ast.AST):
    """The nodes evaluated when `node` is: a lambda's body waits for its call."""
    yield node
    for child in ast.iter_child_nodes(node):
        if not isinstance(node, ast.Lambda):
            yield from _evaluated(child)


def graded_cell_with(lesson: str, test_id: str, old: str, new: str) -> tuple[dict, str]:
    """The namespace nbgrader would have (the imports, the exported cells with `old` replaced by `new`
    in exactly one of them, the test cells' helpers without their checks) and the source of `#| test test_id`."""
    cells = [c.source for c in nbformat.read(REPO / "solutions" / lesson / f"{lesson}.ipynb", as_version=4).cells
             if c.cell_type == "code" and not where.is_where_cell(c)]
    assert sum(s.count(old) for s in cells if s.startswith("#| export")) == 1, "the mutant must replace one solution"
    namespace = {"__name__": "__main__"}  # as in the kernel: `if __name__ != "__main__":` imports keep the cells' names
    exec(cells[0], namespace)  # the notebook's imports
    for source in cells:
        if source.startswith("#| export"):
            exec(source.replace(old, new), namespace)
        elif source.startswith("#| test"):  # helpers other cells share, without running their checks
            define_helpers(source, namespace)
    return namespace, next(s for s in cells if s.startswith(f"#| test {test_id} "))


def assert_reference_full_and_learner_zero(graded, lesson: str, points: int) -> None:
    """The reference earns all `points`, hidden tests included; the untouched learner edition nothing, with a reason."""
    report = graded(lesson, "solution")
    assert report.total == (points, points), report.scores
    learner = graded(lesson, "learner")
    assert all(s.earned == 0 and s.reason for s in learner.scores), learner.scores
