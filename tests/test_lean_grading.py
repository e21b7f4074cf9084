"""Grading runs a lesson's cells but its demo cells (docs/authoring.md), twice per lesson in every test run: a cell
that no test cell needs, neither directly nor through the names it defines for the cells a test needs, only costs
time there, and must be tagged `demo`. Names are read statically: what a cell defines at its top level (functions,
classes, imports, assigned names) and every name it mentions, inside its functions too."""

import ast

import pytest

from zero_lab.course_tools import build, export
from zero_lab.course_tools.implementation import REPO

LESSONS = build.find_lessons(REPO)


def defined_and_mentioned(source: str) -> tuple[set[str], set[str]]:
    tree = ast.parse(source)
    defined, mentioned = set(), set()
    for statement in tree.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(statement.name)
        elif isinstance(statement, (ast.Import, ast.ImportFrom)):
            defined.update((alias.asname or alias.name).split(".")[0] for alias in statement.names)
        elif isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.With)):
            targets = ([item.optional_vars for item in statement.items] if isinstance(statement, ast.With) else
                       statement.targets if isinstance(statement, ast.Assign) else [statement.target])
            defined.update(node.id for target in targets if target is not None
                           for node in ast.walk(target) if isinstance(node, ast.Name))
    mentioned.update(node.id for node in ast.walk(tree) if isinstance(node, ast.Name))
    return defined, mentioned


def cells_no_test_needs(lesson: str) -> list[str]:
    """First lines of the untagged code cells that are neither graded, exported nor a test, and whose names no needed
    cell mentions."""
    cells = [c for c in build.read_notebook(export.source_notebook(REPO, lesson)).cells
             if c.cell_type == "code" and not export.is_demo(c)]
    names = [defined_and_mentioned(c.source) for c in cells]
    needed = {i for i, c in enumerate(cells) if c.source.startswith(("#| test", "#| export")) or
              c.metadata.get("nbgrader", {}).get("solution") or c.metadata.get("nbgrader", {}).get("grade")}
    grown = True
    while grown:
        grown = False
        for i in sorted(needed):
            for earlier in range(i):
                if earlier not in needed and names[earlier][0] & names[i][1]:
                    needed.add(earlier)
                    grown = True
    return [c.source.strip().splitlines()[0][:80] for i, c in enumerate(cells) if i not in needed and c.source.strip()]


@pytest.mark.parametrize("lesson", LESSONS)
def test_a_cell_no_test_needs_is_tagged_demo(lesson):
    idle = cells_no_test_needs(lesson)
    assert not idle, f"{lesson}: grading runs {len(idle)} cell(s) no test needs; tag them `demo`: {idle}"
