"""Lesson 07, benchmarks/memory_vs_formula.py: every stage's measured model states against the
formula, the residual's bookkeeping, the rows this build refuses, the JSON files, and the CUDA
probe's bookkeeping against a stand-in for torch.cuda (a plumbing test, not a GPU result), and
the lesson's graded tests against typical wrong answers.

Lean on purpose: one launch per world size (2 and 3: uneven padding) of a tiny GPT; the fit
search (the same code on any world size, two thirds of the steps) on 3 ranks only.
"""

import importlib.util
import math
import sys
from fractions import Fraction
from unittest import mock

import matplotlib
import pytest

from zero_lab import RankFailed, launch, memory
from zero_lab.benchmark import RESIDUAL_PARTS, decompose_residual, largest_that_fits
from zero_lab.course_tools import build
from zero_lab.memory_ledger import CATEGORIES
from zero_lab.course_tools.implementation import REPO
from zero_lab.models import GPT, GPTConfig
from zero_lab.zero1 import ShardLayout

matplotlib.use("Agg")
spec = importlib.util.spec_from_file_location("memory_vs_formula", REPO / "benchmarks" / "memory_vs_formula.py")
bench = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

TINY = GPTConfig(vocab_size=29, n_layer=2, n_head=2, n_embd=8, block_size=8)
FAMILY = ((1, 2), (8, 16))
BUDGET = 64 * 2**20
ROWS = {**bench.ROWS, "no such stage": dict(stage=9)}


@pytest.fixture(scope="module")
def runs():
    with mock.patch.dict(bench.SIZES, T=TINY), mock.patch.dict(bench.ROWS, ROWS):
        results = {nd: launch(bench.run_rank, nd, tuple(ROWS), ("T",), BUDGET if nd == 3 else None, 1, FAMILY,
                              timeout=120)[0]
                   for nd in (2, 3)}
        return bench._run(results, tuple(ROWS), ("T",), BUDGET, 1, FAMILY)


def built_rows(rows):
    return {row: result["sizes"]["T"] for row, result in rows.items() if "sizes" in result}


def test_model_states_are_the_formula_up_to_padding(runs):
    psi = GPT(TINY).num_params()
    for nd, rows in runs.results.items():
        measured = built_rows(rows)
        assert {"DP", "P_os", "P_os+g"} <= set(measured), "stages 0-2 exist in every build"
        padded = ShardLayout(psi, nd).padded_numel
        assert measured["DP"]["model_states"] == {k: int(v) for k, v in memory.model_states_per_device(psi, nd, 0).items()}
        for row in ("P_os", "P_os+g"):  # one flat buffer padded to a multiple of nd: the formula at padded Psi
            by_category = memory.model_states_per_device(padded, nd, bench.ROWS[row]["stage"])
            assert measured[row]["model_states"] == by_category, (row, nd)
        for row, f in measured.items():
            excess = sum(f["model_states"].values()) - sum(f["formula"].values())
            assert 0 <= excess <= 16 * nd * len(list(GPT(TINY).parameters())), (row, nd, excess)


def test_residual_parts_add_up_and_bytes_match_the_ring_formula(runs):
    for nd, rows in runs.results.items():
        for row, f in built_rows(rows).items():
            residual = f["residual"]
            assert list(residual) == list(RESIDUAL_PARTS)
            assert sum(residual.values()) == pytest.approx(f["peak"] - sum(f["formula"].values()))
            assert residual["activations"] > 0 and f["peak"] >= sum(f["model_states"].values()), (row, nd, f["model_states"], f["formula"])
            psi = GPT(TINY).num_params()
            assert f["comm_formula"] == float(2 * memory.communication_volume(psi, bench.ROWS[row]["stage"], nd))
            assert f["sent_bytes"] >= f["comm_formula"], (row, nd)  # padding only adds
            if row in ("DP", "P_os", "P_os+g"):  # one flat buffer, padded to a multiple of nd (DDP: none)
                volume = psi if row == "DP" else ShardLayout(psi, nd).padded_numel
                assert f["sent_bytes"] == pytest.approx(float(2 * 2 * Fraction(nd - 1, nd) * volume)), (row, nd)


def test_rows_this_build_refuses_say_so(runs):
    for rows in runs.results.values():
        assert rows["no such stage"]["unavailable"].startswith(f"{bench.NOT_AVAILABLE}: stage must be one of")
        for row in ("P_os+g+p", "P_os+g, offload"):  # lessons 05 and 06: measured once prepare takes them
            assert "sizes" in rows[row] or rows[row]["unavailable"].startswith(bench.NOT_AVAILABLE)
    assert "not available in this build" in bench.memory_table(runs)


def test_fit_search_and_json_files(runs, tmp_path):
    assert all("fit" in result for result in runs.results[3].values() if "sizes" in result), "searched on 3 ranks"
    for nd, rows in runs.results.items():
        for row, result in rows.items():
            if "fit" in result and result["fit"] is not None:
                fit = result["fit"]
                assert fit["depth"] in FAMILY[0] and fit["width"] in FAMILY[1]
                assert fit["psi"] == GPT(bench.fit_config(fit["depth"], fit["width"])).num_params()
    path = bench.save(runs, tmp_path / "run.json")
    loaded = bench.load(path)
    assert loaded.results.keys() == runs.results.keys() and loaded.machine["cores"] >= 1
    assert loaded.measurement == bench.CPU_MEASUREMENT and "budget" in bench.report(loaded)
    bench.plot_runs([path, path], size="T")


class StandInCuda:
    """Stand-in for the torch.cuda memory API: phases allocate and free bytes by hand."""

    def __init__(self):
        self.allocated, self.peak, self.calls = 1000, 5000, []

    def synchronize(self, device):
        self.calls.append("synchronize")

    def reset_peak_memory_stats(self, device):
        self.calls.append("reset")
        self.peak = self.allocated

    def alloc(self, nbytes):
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def memory_allocated(self, device):
        return self.allocated

    def max_memory_allocated(self, device):
        return self.peak

    def max_memory_reserved(self, device):
        return 8192

    def memory_reserved(self, device):
        return 6144

    def memory_stats(self, device):
        return {"inactive_split_bytes.all.current": 512}

    def mem_get_info(self, device):
        return 100_000 - 6144 - 300, 100_000  # 300 bytes in use outside the allocator


def test_cuda_probe_bookkeeping_with_a_stand_in():
    """Plumbing only: no GPU figure is produced or checked here."""
    cuda = StandInCuda()
    phases = [("forward", lambda: cuda.alloc(400)), ("backward", lambda: (cuda.alloc(700), cuda.alloc(-1000))),
              ("step", lambda: cuda.alloc(-50))]
    figures = bench.cuda_step_memory(phases, "cuda:0", cuda)
    assert cuda.calls[:2] == ["synchronize", "reset"], "the peak is reset before the step"
    assert figures["allocated"] == {"init": 1000, "forward": 1400, "backward": 1100, "step": 1050}
    assert figures["peak"] == 2100, "the step's own peak, not the one before the reset"
    assert figures["max_reserved"] == 8192 and figures["inactive_split"] == 512
    assert figures["device_total"] == 100_000 and figures["outside_allocator"] == 300


# --- the graded tests catch typical wrong answers (run without a kernel: the cells are exec'd) ----

def _test_cell(test_id: str) -> str:
    """The full test cell, hidden tests included, of the lesson's source notebook."""
    notebook = build.read_notebook(build.source_notebook(REPO, "07_benchmarks"))
    source = next(c.source for c in notebook.cells if c.source.startswith(f"#| test {test_id} "))
    return source.replace("### BEGIN HIDDEN TESTS", "").replace("### END HIDDEN TESTS", "")


def _passes(test_id: str, **answers) -> bool:
    try:
        exec(_test_cell(test_id), {"math": math, "Fraction": Fraction, "RESIDUAL_PARTS": RESIDUAL_PARTS, **answers})
    except AssertionError:
        return False
    return True


def _read_at(pick):
    """decompose_residual reading its parts at the sample `pick(samples)` chooses."""
    def decompose(samples, formula, peak):
        at, total = pick(samples), lambda s: sum(s[c] for c in CATEGORIES) + s["activations"]
        return {"activations": at["activations"], "gathered parameters": at["parameters"] - formula["parameters"],
                "gradient buckets": at["gradients"] - formula["gradients"],
                "optimizer states": sum(at[c] - formula[c] for c in ("master_params", "optimizer_states")),
                "temporaries": peak - total(at)}
    return decompose


def _each_part_at_its_own_maximum(samples, formula, peak):
    return _read_at(lambda ss: {k: max(s[k] for s in ss) for k in [*CATEGORIES, "activations"]})(samples, formula, peak)


def _search(keep):
    """largest_that_fits with `keep(depth, widths, fits)` -> the width kept for one depth (or None)."""
    def search(depths, widths, fits, num_params):
        best = None
        for depth in depths:
            width = keep(depth, widths, fits)
            if width is not None and (best is None or num_params(depth, width) > num_params(*best)):
                best = (depth, width)
        return best
    return search


def _linear_scan(depth, widths, fits):
    return next((w for w in reversed(widths) if fits(depth, w)), None)


def _binary_search_missing_the_last_width(depth, widths, fits):
    lo, hi = 0, len(widths) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if fits(depth, widths[mid]) else (lo, mid)
    return widths[lo] if fits(depth, widths[lo]) else None


def _widest(depths, widths, fits, num_params):
    return largest_that_fits(depths, widths, fits, lambda depth, width: width)


def test_graded_tests_catch_typical_wrong_answers():
    total = lambda s: sum(s[c] for c in CATEGORIES) + s["activations"]  # noqa: E731
    assert _passes("residual", decompose_residual=decompose_residual)
    for wrong in (_each_part_at_its_own_maximum, _read_at(lambda ss: ss[-1]),
                  _read_at(lambda ss: max(ss, key=lambda s: sum(s[c] for c in CATEGORIES)))):
        assert not _passes("residual", decompose_residual=wrong), wrong
    assert _passes("residual", decompose_residual=_read_at(lambda ss: max(ss, key=total))), "the harness itself"
    assert _passes("fit_search", largest_that_fits=largest_that_fits)
    for wrong in (_search(_linear_scan), _search(_binary_search_missing_the_last_width), _widest):
        assert not _passes("fit_search", largest_that_fits=wrong), wrong


# --- exercises 1-3 (the learner's probe, per-phase peaks, every stage): the lesson's own cells are
# exec'd in order up to the test cell, with one solution cell replaced by a wrong answer.

def _lesson_until(test_id: str, **replacements) -> tuple[dict, str]:
    """Namespace after the non-demo cells before test `test_id` (solution cells in `replacements`
    replaced by that source), and the test cell with its hidden tests."""
    namespace = {}
    for cell in build.read_notebook(build.source_notebook(REPO, "07_benchmarks")).cells:
        if cell.cell_type != "code" or "demo" in cell.metadata.get("tags", []):
            continue
        first = cell.source.split("\n", 1)[0]
        if first.startswith(f"#| test {test_id} "):
            return namespace, cell.source
        if not first.startswith("#| test "):
            solution = first[len("#| solution "):] if first.startswith("#| solution ") else None
            exec(replacements.get(solution, cell.source), namespace)
    raise KeyError(test_id)


def _passes_exercise(test_id: str, **replacements) -> bool:
    namespace, test = _lesson_until(test_id, **replacements)
    try:
        exec(test, namespace)
    except (AssertionError, RankFailed):
        return False
    return True


RECORD_WITHOUT = {  # record_step with one line of the reference dropped or changed
    "no saved-tensor hooks": ("        with saved.hooks():\n            loss = loss_fn()", "        loss = loss_fn()"),
    "no gradient hooks": ("    handles += [p.register_post_accumulate_grad_hook(read) for p in model.parameters() if p.requires_grad]\n", ""),
    "hooks left on error": ("    finally:\n        for handle in handles:\n            handle.remove()",
                            "    finally:\n        pass\n    for handle in handles:\n        handle.remove()"),
}
PEAKS_WITH = {  # phase_peaks with one line of the reference changed
    "model states pick the reading": ('total = sum(reading[c] for c in CATEGORIES) + reading["activations"]',
                                      'total = sum(reading[c] for c in CATEGORIES)'),
    "no gather buffers": ('gathered = max(0, r["parameters"] - formula["parameters"])', 'gathered = 0'),
    "negative gather buffers": ('gathered = max(0, r["parameters"] - formula["parameters"])',
                                'gathered = r["parameters"] - formula["parameters"]'),
    "last reading of a phase": ("total > largest[reading[\"phase\"]][0]", "total >= 0"),
}


def _mutant(solution_id: str, old: str, new: str) -> str:
    nb = build.read_notebook(build.source_notebook(REPO, "07_benchmarks"))
    source = next(c.source for c in nb.cells if c.source.startswith(f"#| solution {solution_id}\n"))
    assert old in source, (solution_id, old)
    return source.replace(old, new)


@pytest.mark.parametrize("name", PEAKS_WITH)
def test_phase_peaks_tests_catch_wrong_answers(name):
    assert not _passes_exercise("test_phase_peaks", phase_peaks=_mutant("phase_peaks", *PEAKS_WITH[name]))


@pytest.mark.parametrize("name", RECORD_WITHOUT)
def test_record_step_tests_catch_wrong_answers(name):
    assert not _passes_exercise("test_record_step", record_step=_mutant("record_step", *RECORD_WITHOUT[name]))


def test_measure_stages_tests_catch_a_missing_warm_up_step():
    no_warm_up = _mutant("measure_stages", "        model(tokens, targets)[1].backward()\n        optimizer.step()\n"
                         "        optimizer.zero_grad()\n", "")
    assert not _passes_exercise("test_measure_stages", measure_stages=no_warm_up)


def test_the_harness_passes_the_reference():
    assert _passes_exercise("test_phase_peaks") and _passes_exercise("test_record_step")
