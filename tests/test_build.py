"""`zero-lab build` and `zero-lab mine` on a tiny fixture lesson, in a temporary repo."""

import ast
import os
import shutil
import subprocess
import sys

import nbformat
import pytest

from zero_lab.course_tools import build, export

LESSON = "99_fixture"
SOURCE = f"solutions/{LESSON}/{LESSON}.ipynb"
COURSE = f"course/{LESSON}/{LESSON}.ipynb"
MODULE = "zero_lab/fixture_ops.py"



def cell_by_id(nb, grade_id):
    return next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)


def test_export_keeps_solution_code_without_markers(built_repo):
    assert (built_repo / MODULE).read_text() == (
        f"# Generated from {SOURCE} by `zero-lab build`: edit the notebook, not this file.\n"
        "\n"
        "import torch.distributed as dist\n"
        "\n"
        "\n"
        "def all_sum(tensor):\n"
        '    """Sum `tensor` over all ranks, in place, and return it."""\n'
        "    dist.all_reduce(tensor)\n"
        "    return tensor\n"
    )


def test_metadata_follows_directives(built_repo):
    nb = build.read_notebook(built_repo / SOURCE)
    kinds = [c.metadata.get("nbgrader") for c in nb.cells]
    # markdown, "where this lives", plain code, export without a solution region
    assert kinds[:4] == [None, None, None, None]
    assert kinds[4] == {"grade": False, "grade_id": "fixture_ops-all_sum", "locked": False,
                        "schema_version": 3, "solution": True, "task": False}
    assert kinds[5] == {"grade": True, "grade_id": "test_all_sum", "locked": True, "points": 2,
                        "schema_version": 3, "solution": False, "task": False}
    assert kinds[6]["grade_id"] == "double" and kinds[6]["solution"]
    assert kinds[7]["grade_id"] == "test_double" and kinds[7]["points"] == 1


def test_learner_edition_has_stubs_and_no_hidden_tests(built_repo):
    nb = build.read_notebook(built_repo / COURSE)
    answer = cell_by_id(nb, "fixture_ops-all_sum").source
    assert answer.startswith("#| export fixture_ops\n")  # `zero-lab mine` needs the directive
    assert "raise NotImplementedError()" in answer and "dist.all_reduce" not in answer
    test = cell_by_id(nb, "test_all_sum")
    assert "launch(summed_on_every_rank, 2" in test.source and "HIDDEN" not in test.source
    assert test.metadata.editable is False


def test_check_passes_right_after_a_build(built_repo):
    # check regenerates everything and compares bytes: this also shows the build is deterministic
    assert build.check(built_repo) == []


def test_check_names_each_kind_of_drift(repo):
    module = repo / MODULE
    module.write_text(module.read_text().replace("dist.all_reduce(tensor)", "pass"))
    source = build.read_notebook(repo / SOURCE)
    source.cells[1].execution_count = 3
    del source.cells[7].metadata["nbgrader"]
    nbformat.write(source, repo / SOURCE)
    course = build.read_notebook(repo / COURSE)
    course.cells[1].outputs = [nbformat.v4.new_output("stream", text="hi")]
    answer = cell_by_id(course, "fixture_ops-all_sum")
    answer.source = answer.source.replace("raise NotImplementedError()", "dist.all_reduce(tensor)\n    ### END SOLUTION")
    nbformat.write(course, repo / COURSE)

    problems = "\n".join(build.check(repo))

    assert f"{MODULE}: differs from what the notebooks give; run `zero-lab build`" in problems
    assert f"{SOURCE}: has outputs or execution counts" in problems
    assert f"{SOURCE}, cell 7: nbgrader metadata does not match its directive" in problems
    assert f"{COURSE}: has outputs or execution counts" in problems
    assert f"{COURSE}: contains 'END SOLUTION'" in problems
    assert f"{COURSE}: contains reference solution or hidden test code 'dist.all_reduce(tensor)'" in problems
    # ... and the build repairs all of it (the source notebook's outputs are cleared), once the
    # hand-edited learner edition is out of its way.
    with pytest.raises(build.BuildError, match=f"{COURSE}: not overwritten"):
        build.build(repo)
    (repo / COURSE).unlink()
    build.build(repo)
    assert build.check(repo) == []


def test_the_first_code_cell_says_where_the_lesson_lives_and_check_keeps_it_current(repo):
    source = build.read_notebook(repo / SOURCE)
    first_code = next(c for c in source.cells if c.cell_type == "code")
    lines = first_code.source.splitlines()
    assert lines[1:5] == [
        "# exports          zero_lab.fixture_ops (your `#| export` cells; ZERO_LAB_IMPL=mine imports yours)",
        "# uses, earlier    no earlier lesson's module",
        "# uses, lab bench  nothing",  # this repository has no hand-written zero_lab/launcher.py
        "# prepare reaches  nothing here: no stage of zero_lab.prepare is built from this lesson"]
    # the world size the lesson launches most, and where such ranks run (the CPU, or shared GPUs)
    assert lines[5].startswith("# ranks            zero_lab.launch(fn, 3) runs 3 processes: on the CPU, or on")
    assert lines[-3:] == ["import zero_lab", "", "print(zero_lab.placement(3))"]
    assert first_code.source in build.read_notebook(repo / COURSE).cells[1].source  # the learner sees it too
    del source.cells[1]  # a new lesson, or one whose cell was deleted
    nbformat.write(source, repo / SOURCE)
    assert f"{SOURCE}: its first code cell, \"where this lesson's code lives\", is missing or out of date" in (
        "\n".join(build.check(repo)))
    build.build(repo)
    assert build.read_notebook(repo / SOURCE).cells[1].source == first_code.source
    assert build.check(repo) == []


def notebook(*sources):
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])


@pytest.mark.parametrize("sources, error", [
    (["x = 1\n### BEGIN SOLUTION\nx = 2\n### END SOLUTION"], "needs a `#| export <module>` or `#| solution <id>`"),
    (["#| exprot m\nx = 1"], "unknown directive '#| exprot m'"),
    (["#| test t\nassert True"], "malformed directive '#| test t'"),
    (["#| solution a\nx = 1"], "needs a ### BEGIN SOLUTION"),
    (["#| test a points=1\nassert 1", "#| test a points=2\nassert 2"], "id 'a' is already used by cell 0"),
    (["#| solution s\n### BEGIN HIDDEN TESTS\n### END HIDDEN TESTS"], "BEGIN HIDDEN TESTS belongs in"),
])
def test_directive_errors(sources, error):
    with pytest.raises(build.BuildError, match="nb.ipynb, cell") as raised:
        build.annotate(notebook(*sources), "nb.ipynb")
    assert error in str(raised.value)


def test_a_module_comes_from_one_notebook(repo):
    other = repo / "solutions" / "98_other"
    other.mkdir()
    shutil.copy(repo / SOURCE, other / "98_other.ipynb")
    with pytest.raises(build.BuildError, match="'fixture_ops' is exported by both solutions/98_other"):
        build.build(repo)


def test_a_lesson_cannot_overwrite_a_hand_written_module(repo):
    (repo / MODULE).write_text('"""Hand-written."""\n')
    with pytest.raises(build.BuildError, match="zero_lab/fixture_ops.py is hand-written"):
        build.build(repo)


def test_mine_switch_imports_the_learners_module(built_repo, tmp_path):
    learner = build.read_notebook(built_repo / COURSE)
    answer = cell_by_id(learner, "fixture_ops-all_sum")
    answer.source = answer.source.replace("raise NotImplementedError()", "tensor.mul_(2)  # mine")
    nbformat.write(learner, tmp_path / f"{LESSON}.ipynb")
    mine = tmp_path / "mine"
    assert export.export_mine(tmp_path / f"{LESSON}.ipynb", mine) == [mine / "fixture_ops.py"]

    def python(impl, code):
        env = dict(os.environ, ZERO_LAB_IMPL=impl, ZERO_LAB_MINE_DIR=str(mine))
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)

    run = python("mine", "import inspect, zero_lab.fixture_ops as m; print(inspect.getsource(m.all_sum))")
    assert run.returncode == 0, run.stderr
    assert "tensor.mul_(2)  # mine" in run.stdout
    assert f"zero_lab.fixture_ops from {mine}" in run.stderr
    run = python("reference", "import zero_lab, sys; print('zero_lab.fixture_ops' in sys.modules)")
    assert run.returncode == 0 and run.stderr == ""
    run = python("theirs", "import zero_lab")
    assert run.returncode != 0 and "ZERO_LAB_IMPL='theirs' is not one of ('reference', 'mine')" in run.stderr


def test_the_course_as_committed_is_built():
    # What CI checks out: notebooks, package modules and learner edition must agree, with no
    # outputs and no solution text in course/.
    assert build.check() == []


@pytest.mark.parametrize("lesson", sorted(p.name for p in (build.REPO / build.SOURCE_DIR).iterdir() if p.is_dir()))
def test_learner_edition_ends_by_naming_the_grade_of_the_learners_copy(lesson):
    # Every lesson in solutions/, those added later included: `zero-lab grade course/NN_...` grades
    # the untouched release (0 points), `zero-lab grade NN` the learner's copy in work/.
    nb = build.read_notebook(build.REPO / build.COURSE_DIR / lesson / f"{lesson}.ipynb")
    assert f"zero-lab grade {lesson.split('_')[0]}`" in nb.cells[-1].source
    naming_the_release = [i for i, c in enumerate(nb.cells) if "zero-lab grade course/" in c.source]
    assert not naming_the_release, f"{lesson}: cells {naming_the_release} tell the learner to grade course/"


MAX_CELL_LINES, MAX_CLASS_LINES = 200, 250  # the course's size rules (docs/authoring.md)


def test_no_cell_over_200_lines_and_no_class_over_250():
    # Small cells and small classes keep each idea readable on one screen or two; the learner
    # edition's cells come from the sources, and the notebooks' classes are exported to zero_lab/.
    too_long = [f"{notebook.relative_to(build.REPO)}, cell {index}: {len(cell.source.splitlines())} lines"
                for notebook in sorted((build.REPO / build.SOURCE_DIR).glob("*/*.ipynb"))
                for index, cell in enumerate(build.read_notebook(notebook).cells)
                if len(cell.source.splitlines()) > MAX_CELL_LINES]
    for folder in ("zero_lab", "benchmarks", "tests"):
        for path in sorted((build.REPO / folder).rglob("*.py")):
            too_long += [f"{path.relative_to(build.REPO)}: class {node.name}, {node.end_lineno - node.lineno + 1} lines"
                         for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
                         and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES]
    assert not too_long, "split these by idea:\n" + "\n".join(too_long)


def imports_of(path, modules: set[str]) -> set[str]:
    """The zero_lab modules a file imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from zero_lab import prepare` imports the submodule; `from zero_lab.zero1 import X`, the module
            found.update(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                         for alias in node.names)
    return found & modules


def test_no_import_circle_among_zero_labs_modules():
    # A circle makes the import order matter and hides which idea rests on which (docs/authoring.md).
    package = build.REPO / "zero_lab"
    paths = {".".join(p.relative_to(build.REPO).with_suffix("").parts).removesuffix(".__init__"): p
             for p in package.rglob("*.py")}
    imports = {module: imports_of(path, set(paths)) - {module} for module, path in paths.items()}
    circles, done = [], set()

    def walk(module, trail):
        if module in trail:
            circles.append(" -> ".join(trail[trail.index(module):] + [module]))
            return
        if module in done:
            return
        for imported in sorted(imports[module]):
            walk(imported, trail + [module])
        done.add(module)

    for module in sorted(imports):
        walk(module, [])
    assert not circles, "import circles:\n" + "\n".join(circles)


MAX_MODULE_LINES = 600  # the course's size rule for a module (docs/authoring.md): split by idea past it


def test_no_module_over_600_lines():
    too_long = [f"{path.relative_to(build.REPO)}: {lines} lines" for path in sorted((build.REPO / "zero_lab").rglob("*.py"))
                if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not too_long, "split these by idea:\n" + "\n".join(too_long)
