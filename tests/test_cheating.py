"""Graded test cells cannot be fooled by what a notebook patches before they run.

The cheats of issue 10, against lesson 00's ring_all_reduce test cell (hidden checks included),
run as nbgrader runs it: the cell's code in the namespace the notebook built.
"""

import ast
import json
import os
import re
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zero_lab
import zero_lab.launcher  # noqa: F401 (its snapshot of the originals, restored in ranks, must predate
# the monkeypatched cheats below, as the grading kernel's does; imported later it would keep the cheat)
from zero_lab import collectives

NOTEBOOK = Path(__file__).resolve().parents[1] / "solutions" / "00_collectives" / "00_collectives.ipynb"


def _test_cell(test_id):
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    return next("".join(c["source"]) for c in cells if "".join(c["source"]).startswith(f"#| test {test_id} "))


def _notebook_namespace():
    namespace = {"torch": torch, "dist": dist, "zero_lab": zero_lab, "os": os, "Fraction": Fraction,
                 **{name: getattr(collectives, name) for name in ("chunk_bounds", "ring_exchange")}}
    helpers = ast.parse(_test_cell("ring_exchange"))  # defines _random_tensors and _fresh_seed
    helpers.body = [node for node in helpers.body if isinstance(node, ast.FunctionDef)]
    exec(compile(helpers, "ring_exchange test cell", "exec"), namespace)
    return namespace


def _identity_ring(tensor, average=False):
    return tensor


def _torch_all_reduce(tensor, average=False):
    dist.all_reduce(tensor)
    return tensor.div_(dist.get_world_size()) if average else tensor


@pytest.mark.parametrize("cheat", ["no-op all_reduce + identity ring", "stubbed ledger + torch's all_reduce"])
def test_cheats_fail_the_ring_all_reduce_cell(cheat, monkeypatch):
    namespace = _notebook_namespace()
    if cheat == "no-op all_reduce + identity ring":
        monkeypatch.setattr(dist, "all_reduce", lambda *args, **kwargs: None)
        namespace["ring_all_reduce"], message = _identity_ring, "expected"
    else:
        monkeypatch.setattr(zero_lab.CommLedger, "record", lambda self, *args: None)
        namespace["ring_all_reduce"], message = _torch_all_reduce, "use send/recv only"
    with pytest.raises(AssertionError, match=message):
        exec(compile(_test_cell("ring_all_reduce"), "ring_all_reduce test cell", "exec"), namespace)


# --- Cheats graded the way learners grade (issue 19 §1) --------------------------------------
# Each notebook is the learner edition with honest answers (the reference solution's cells) but
# for the cheated exercises. A test that uses a cheated exercise earns nothing; every other test
# keeps its points. Lesson 05 (three notebooks) and lesson 00 (two) are graded in parallel.

REPO = Path(__file__).resolve().parents[1]
REFERENCE = """import importlib.util, pathlib, zero_lab
_spec = importlib.util.spec_from_file_location("_reference", pathlib.Path(zero_lab.__file__).parent / "{module}.py")
_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_reference)  # the course's module, loaded by path: no `import zero_lab.{module}`
"""
FROM_SOLUTIONS = """import json, pathlib, zero_lab
_source = pathlib.Path(zero_lab.__file__).parents[1] / "solutions" / "{lesson}" / "{lesson}.ipynb"
_cells = ["".join(cell["source"]) for cell in json.load(open(_source))["cells"]]
exec(next(cell for cell in _cells if "{definition}" in cell))
"""


def _nbgrader_cells(nb):
    return {c.metadata.nbgrader["grade_id"]: c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id")}


def _defines(source):
    return [n.name for n in ast.parse(source).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]


class Cheater:
    """Writes notebooks of one lesson: honest answers, except the cells a cheat replaces."""

    def __init__(self, lesson):
        import nbformat
        self.lesson, self.nbformat = lesson, nbformat
        self.source = _nbgrader_cells(nbformat.read(REPO / "solutions" / lesson / f"{lesson}.ipynb", as_version=4))
        self.tests = {g: c.source for g, c in self.source.items() if c.metadata.nbgrader.get("grade")}
        self.answers = {g: c for g, c in self.source.items() if c.metadata.nbgrader.get("solution")}

    def module(self, grade_id):
        return self.answers[grade_id].source.split("\n", 1)[0].split()[-1]

    def imports(self, grade_id):  # cheat 1: the answer is the course's own code
        return f"from zero_lab.{self.module(grade_id)} import {', '.join(_defines(self.answers[grade_id].source))}"

    def wrappers(self, grade_id, via="_reference"):  # cheat 2: thin wrappers, subclasses that add nothing
        lines = [REFERENCE.format(module=self.module(grade_id))] if via == "_reference" else [f"import {via}"]
        for node in ast.parse(self.answers[grade_id].source).body:
            if isinstance(node, ast.ClassDef):
                lines.append(f"class {node.name}({via}.{node.name}):\n    pass\n")
            elif isinstance(node, ast.FunctionDef):
                lines.append(f"def {node.name}(*args, **kwargs):\n    return {via}.{node.name}(*args, **kwargs)\n")
        return "\n".join(lines)

    def from_solutions(self, grade_id):  # cheat 3: the solution's text, run with exec
        node = ast.parse(self.answers[grade_id].source).body[0]
        definition = f"{'class' if isinstance(node, ast.ClassDef) else 'def'} {node.name}("
        return FROM_SOLUTIONS.format(lesson=self.lesson, definition=definition)

    def notebook(self, folder, name, cheats):
        """cheats: grade id -> the cell's new source. Returns (path, the names the cheats replaced)."""
        nb = self.nbformat.read(REPO / "course" / self.lesson / f"{self.lesson}.ipynb", as_version=4)
        for grade_id, cell in _nbgrader_cells(nb).items():
            if grade_id in self.answers:
                cell.source = cheats.get(grade_id, self.answers[grade_id].source)
        path = folder / name / f"{self.lesson}.ipynb"
        path.parent.mkdir()
        self.nbformat.write(nb, path)
        return path, {n for grade_id in cheats for n in _defines(self.answers[grade_id].source)}

    def expected(self, cheated_names):
        """Test id -> points: nothing for a test that uses a cheated exercise, all the others."""
        points = {g: c.metadata.nbgrader["points"] for g, c in self.source.items() if g in self.tests}
        return {g: 0 if any(re.search(rf"\b{n}\b", self.tests[g]) for n in cheated_names) else p
                for g, p in points.items()}


# Cheat 4 of the issue: 2x the bytes (all_reduce), then the notebook hides it from the ledger
# and from torch.distributed's all-gather.
HIDE_FROM_THE_LEDGER = """import torch.distributed as dist
import zero_lab
_summary = zero_lab.CommLedger.summary
def _as_if_all_gather(self):
    summary = _summary(self)
    if "all_reduce" in summary:
        summary["all_gather"] = summary.pop("all_reduce")
        summary["all_gather"]["sent_bytes"] /= 2
    return summary
zero_lab.CommLedger.summary = _as_if_all_gather
dist.all_gather_into_tensor = lambda output, input, *args, **kwargs: None
"""
GATHER_WITH_ALL_REDUCE = """#| export zero3_units
def gather_unit(unit, async_op=False):
    unit.flat.untyped_storage().resize_(unit.flat.numel() * unit.flat.element_size())
    start, stop = unit.layout.shard(dist.get_rank())
    with torch.no_grad():
        unit.flat.zero_()
        unit.flat[start:stop] = unit.shard
        return dist.all_reduce(unit.flat, async_op=async_op)


def free_unit(unit):
    unit.flat.untyped_storage().resize_(0)
"""
NAIVE_WITH_ALL_REDUCE = """#| solution naive_all_reduce
def naive_all_reduce(tensor):
    dist.all_reduce(tensor)
    return tensor
"""
HIDE_ALL_REDUCE = """import torch.distributed as dist
import zero_lab
_record = zero_lab.CommLedger.record
def _hidden(self, kind, elements, element_size, group_size):
    if kind == "all_reduce":  # not recorded: its bytes are reported as those of the naive algorithm
        self.hidden = getattr(self, "hidden", 0) + elements * element_size
    else:
        _record(self, kind, elements, element_size, group_size)
zero_lab.CommLedger.record = _hidden
zero_lab.CommLedger.sent_bytes = lambda self, kind=None: getattr(self, "hidden", 0) * (
    dist.get_world_size() - 1 if dist.get_rank() == 0 else 1)
"""


@pytest.fixture(scope="module")
def cheats(tmp_path_factory):
    """{(lesson, notebook): (report, expected points per test)}, from two grade_many runs in parallel."""
    from concurrent.futures import ThreadPoolExecutor

    from zero_lab.course_tools import grading

    folder = tmp_path_factory.mktemp("cheats")
    zero3, collectives = Cheater("05_zero3"), Cheater("00_collectives")
    notebooks = {
        ("05_zero3", "imports"): zero3.notebook(folder, "imports05", {g: zero3.imports(g) for g in zero3.answers}),
        ("05_zero3", "reference code"): zero3.notebook(folder, "reference05", {
            "zero3_units-gather_unit": zero3.wrappers("zero3_units-gather_unit"),
            "zero3_units-RegatherForBackward": zero3.wrappers("zero3_units-RegatherForBackward"),
            "zero3_units-reduce_scatter_unit": zero3.from_solutions("zero3_units-reduce_scatter_unit"),
            "zero3_schedule-prefetch_plan":  # a name of its own: `_reference` is zero3_units, the wrappers' above
                REFERENCE.format(module="zero3_schedule").replace("_reference", "_schedule") + "prefetch_plan = _schedule.prefetch_plan"}),
        ("05_zero3", "bytes"): zero3.notebook(folder, "bytes05", {
            "zero3_units-gather_unit": GATHER_WITH_ALL_REDUCE + HIDE_FROM_THE_LEDGER,
            "zero3_units-reduce_scatter_unit": zero3.wrappers("zero3_units-reduce_scatter_unit", via="zero_lab.zero3"),
            "zero3-Zero3Optimizer": zero3.wrappers("zero3-Zero3Optimizer", via="zero_lab.zero3")}),
        ("00_collectives", "imports and text"): collectives.notebook(folder, "text00", {
            "collectives-ring_time": collectives.imports("collectives-ring_time"),
            "ring_bytes": collectives.from_solutions("ring_bytes"),
            "naive_all_reduce": NAIVE_WITH_ALL_REDUCE + HIDE_ALL_REDUCE}),
        ("00_collectives", "wrappers"): collectives.notebook(folder, "wrappers00", {
            "collectives-ring_time": collectives.wrappers("collectives-ring_time")}),
    }
    cheaters = {"05_zero3": zero3, "00_collectives": collectives}
    with ThreadPoolExecutor(2) as pool:
        runs = {lesson: pool.submit(grading.grade_many, lesson, {name: path for (l, name), (path, _) in notebooks.items()
                                                                  if l == lesson})
                for lesson in cheaters}
        reports = {lesson: run.result() for lesson, run in runs.items()}
    return {(lesson, name): (reports[lesson][name], cheaters[lesson].expected(names))
            for (lesson, name), (_, names) in notebooks.items()}


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("lesson, notebook", [("05_zero3", "imports"), ("05_zero3", "reference code"), ("05_zero3", "bytes"),
                                              ("00_collectives", "imports and text"), ("00_collectives", "wrappers")])
def test_cheated_exercises_earn_nothing_and_honest_ones_keep_their_points(cheats, lesson, notebook):
    from zero_lab.course_tools import grading

    report, expected = cheats[lesson, notebook]
    table = grading.score_table(report)
    assert {s.test_id: s.earned for s in report.scores} == expected, table
    for score in report.scores:
        assert "\n" not in score.reason, table
        if expected[score.test_id] == 0 and not score.reason.startswith("AssertionError"):  # the bytes cheats fail a check
            assert score.reason.startswith("NotWrittenHere: "), table


def test_importing_the_lessons_own_module_names_what_to_write(cheats):
    reasons = {s.test_id: s.reason for s in cheats["05_zero3", "imports"][0].scores}
    assert reasons["gather_free"] == "NotWrittenHere: free_unit is not defined in this notebook: write it here", reasons


def test_student_release_has_no_solutions_tests_or_reference_modules(tmp_path):
    from zero_lab.course_tools import release

    release.student_release(REPO, tmp_path / "release", keep_modules_before="05_zero3")
    files = {p.relative_to(tmp_path / "release").as_posix() for p in (tmp_path / "release").rglob("*") if p.is_file()}
    assert not [f for f in files if f.startswith(("solutions/", "tests/"))]
    assert {"zero_lab/zero1.py", "zero_lab/launcher.py", "course/05_zero3/05_zero3.ipynb"} <= files
    assert not {"zero_lab/zero3.py", "zero_lab/offload.py", "zero_lab/cpu_adam.py"} & files
    with pytest.raises(release.ReleaseError, match="not empty"):
        release.student_release(REPO, tmp_path / "release")
