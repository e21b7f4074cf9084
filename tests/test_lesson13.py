"""Lesson 13, memory at the paper's scale: one rank of up to 1024 counted under torch's fake process group and
FakeTensorMode equals the formulas up to padding, sends 2Ψ / 3Ψ, costs little real memory, refuses what it
cannot count, and the typical wrong answers lose their points."""

import time
from fractions import Fraction

import nbformat
import pytest

from graded_cells import REPO, assert_mutant_fails, assert_reference_full_and_learner_zero, graded_cell_with
import zero_lab
from zero_lab.memory import GB, model_states_per_device, paper_round
from zero_lab.memory_drop import dominant_cause, gpt_config, measure_runs, one_unit, peak_parts, tracked_step, tracker_vs_ledger
from zero_lab.models import GPT
from zero_lab.unfinished import needs_exercises
from zero_lab.scale import (PAPER_ND, PAPER_PSI, PAPER_TABLE1, PAPER_TABLE2, check_countable, count_rank, count_ranks, in_fake_world,
                            largest_model, predicted_bytes, unit_numels)

LESSON = "13_scale"
PSI, N = PAPER_PSI["1T"], 1024


@pytest.fixture(scope="module")
def counted_1t():
    jobs = [dict(psi=PSI, n=N, rank=rank, stage=stage) for stage in (1, 2, 3) for rank in (0, N - 1)]
    return list(zip(jobs, count_ranks(jobs)))


def test_a_1t_count_at_1024_equals_the_formula_up_to_padding(counted_1t):
    for job, result in counted_1t:
        assert result["bytes"] == predicted_bytes(unit_numels(PSI), N, job["rank"], job["stage"])
        formula = sum(model_states_per_device(PSI, N, job["stage"]).values())
        buffers = len(unit_numels(PSI)) if job["stage"] == 3 else 1
        assert abs(sum(result["bytes"].values()) - formula) <= 16 * buffers * (N - 1), job


def test_bytes_per_step_are_2psi_and_3psi_times_n_minus_1_over_n(counted_1t):
    for job, result in counted_1t:
        psis = 3 if job["stage"] == 3 else 2
        assert sum(result["sent"].values()) == pytest.approx(psis * 2 * PSI * (N - 1) / N, rel=1e-12), job


def test_a_1t_count_at_1024_allocates_a_few_hundred_mb_at_most(counted_1t):
    for job, result in counted_1t:
        assert 0 <= result["rss_grown_bytes"] < 300 * 2**20, (job, result["rss_grown_bytes"])


def test_offload_counts_2psi_on_the_device_and_16psi_over_n_on_the_host():
    psi, n = 10**8, 64
    result = count_rank(psi, n, n - 1, 2, offload=True)
    assert result["device"] == 2 * psi
    assert sum(result["bytes"].values()) - result["device"] == 16 * psi // n


@pytest.mark.parametrize("arguments, words", [
    (dict(psi=3, n=4), "smaller than one element per rank"),
    (dict(psi=10, n=0), "n (ranks) must be an int >= 1"),
    (dict(psi=10, n=4, rank=4), "rank must be in 0..3"),
    (dict(psi=10, n=4, stage=0), "stage must be 1, 2 or 3"),
    (dict(psi=10, n=4, stage=3, offload=True), "offload with stage 3"),
])
def test_what_cannot_be_counted_is_refused_with_its_limit(arguments, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        check_countable(**arguments)
    with pytest.raises(ValueError):
        count_rank(**{"rank": 0, "stage": 1, **arguments})


def test_the_paper_s_table_1_is_rank_0_s_bytes_as_the_paper_rounds_them():
    for (name, nd), printed in PAPER_TABLE1.items():
        ours = tuple(paper_round(sum(predicted_bytes(unit_numels(PAPER_PSI[name]), nd, 0, stage).values()) / GB)
                     for stage in (1, 2, 3))
        assert ours == printed, (name, nd)
    assert {nd for _, nd in PAPER_TABLE1} == set(PAPER_ND)


def test_table_2_from_a_search_over_counts():
    for stage, paper in zip((1, 2, 3), PAPER_TABLE2[1]):
        psi = largest_model(lambda p: sum(predicted_bytes(unit_numels(p), 64, 0, stage).values()), 32e9, low=64)
        assert sum(predicted_bytes(unit_numels(psi), 64, 0, stage).values()) <= 32e9
        assert round(psi / 1e8) / 10 == paper, (stage, psi)


def test_stage_3_with_one_unit_gathers_the_whole_model_while_the_counted_states_stay():
    layered, whole = measure_runs([(gpt_config(1, 32, 16), 3, 1), (gpt_config(1, 32, 16), 3, 1, dict(units=one_unit))], 2)
    assert whole["counted"] == layered["counted"] and abs(whole["counted"] - whole["formula"]) <= 128
    assert whole["residual"]["gathered parameters"] == 2 * whole["psi"]
    assert layered["residual"]["gathered parameters"] < whole["residual"]["gathered parameters"]


@pytest.fixture(scope="module")
def drop_runs():
    """Section 7's buffer, small-model and one-unit reproductions: rank 0's measure_step by run name and Nd."""
    wide, tiny = gpt_config(2, 128, 16), gpt_config(1, 32, 16)
    runs = {"one unit": (wide, 3, 1, dict(units=one_unit)), "units per layer": (wide, 3, 1), "tiny": (tiny, 3, 1),
            "bucket of the whole model": (wide, 2, 1), "bucket of 2**14": (wide, 2, 1, dict(bucket_numel=2**14))}
    plan = {1: ["tiny"], 2: ["bucket of the whole model", "tiny"],
            4: ["one unit", "units per layer", "tiny", "bucket of the whole model", "bucket of 2**14"]}
    return {nd: dict(zip(names, measure_runs([runs[name] for name in names], nd))) for nd, names in plan.items()}


def test_a_stage_2_bucket_does_not_drop_with_nd_while_the_states_do(drop_runs):
    two, four = drop_runs[2]["bucket of the whole model"], drop_runs[4]["bucket of the whole model"]
    psi = four["psi"]
    assert four["counted"] / two["counted"] == pytest.approx((2 + 14 / 4) / (2 + 14 / 2), abs=0.02)
    for nd, run in ((2, two), (4, four)):  # the bucket's flat copy (2Ψ) and this rank's received slice (2Ψ/Nd)
        assert run["residual"]["gradient buckets"] == pytest.approx(2 * psi + 2 * psi / nd, rel=0.02), (nd, run["residual"])
    small = drop_runs[4]["bucket of 2**14"]
    assert small["counted"] == four["counted"]
    assert small["residual"]["gradient buckets"] < 0.3 * four["residual"]["gradient buckets"], small["residual"]


def test_a_small_model_leaves_what_the_process_holds_where_it_was(drop_runs):
    runs = [drop_runs[nd]["tiny"] for nd in (1, 2, 4)]
    assert runs[2]["counted"] / runs[0]["counted"] == pytest.approx(0.25, abs=0.02)
    rss = [r["rss"]["VmRSS"] for r in runs]
    assert all(abs(x / rss[0] - 1) < 0.15 for x in rss), rss
    assert all(r["rss"]["VmRSS"] > 100 * r["counted"] for r in runs), rss


def test_one_unit_keeps_the_whole_model_gathered_at_every_nd_where_units_per_layer_do_not(drop_runs):
    whole, layered = drop_runs[4]["one unit"], drop_runs[4]["units per layer"]
    assert whole["counted"] == layered["counted"]
    assert layered["residual"]["gathered parameters"] < whole["residual"]["gathered parameters"] == 2 * whole["psi"]
    assert whole["peak"] >= whole["counted"] + 2 * whole["psi"] and whole["peak"] > layered["peak"], (whole, layered)


def test_activations_dominate_a_large_batch_and_fixed_overheads_a_tiny_model():
    assert dominant_cause(peak_parts(121_000, 2, 3, [17_000] * 7, activations=24 * 2**20)) == "activations"
    assert dominant_cause(peak_parts(10**4, 8, 1, [10**4], activations=0, fixed=300 * 2**20)) == "fixed overheads"
    assert dominant_cause(peak_parts(10**9, 8, 2, [10**9], activations=2**20)) == "model states"


def _tracked(stage):
    import warnings
    warnings.simplefilter("ignore")
    return tracked_step(gpt_config(1, 32, 16), stage, rows=2)


@pytest.mark.parametrize("stage", [0, 3])
def test_memtracker_agrees_with_the_ledger_where_both_count_the_same_tensors(stage):
    result = zero_lab.launch(_tracked, 1, stage, timeout=60)[0]
    rows = {name: (mine, theirs) for name, mine, theirs, _ in tracker_vs_ledger(result["tracker"], result["ledger"])}
    mine, theirs = rows["total"]
    assert 0 <= theirs - mine <= 8 * 2**10 + 2**12, rows  # the causal mask, the int64 token/target batch, AdamW's step counters
    if stage == 0:
        assert rows["parameters"][0] == rows["parameters"][1] and rows["gradients"][0] == rows["gradients"][1], rows
    else:  # stage 3's flat bf16 shards are no module's parameters: MemTracker does not call them parameters
        assert rows["parameters"][1] == 0 < rows["parameters"][0], rows


def _fsdp2_beside_stage3():
    import warnings
    import torch
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import fully_shard
    from zero_lab.memory_ledger import model_state_bytes
    warnings.simplefilter("ignore")
    config = gpt_config(1, 32, 16)
    tokens = torch.randint(0, config.vocab_size, (2, 2, config.block_size), generator=torch.Generator().manual_seed(0))
    fsdp = GPT(config, seed=0)
    for block in fsdp.transformer.h:
        fully_shard(block)
    fully_shard(fsdp)
    fsdp_optimizer = torch.optim.AdamW(fsdp.parameters(), lr=1e-3)
    tracker = FSDPMemTracker(fsdp, fsdp_optimizer)
    with tracker:
        fsdp(*tokens)[1].backward()
        fsdp_optimizer.step()
    ((_, by_kind),) = tracker.get_tracker_snapshot().items()
    model, optimizer = zero_lab.prepare(GPT(config, seed=0), torch.optim.AdamW, stage=3, lr=1e-3)
    model(*tokens)[1].backward()
    optimizer.step()
    return {str(kind).split(".")[-1]: nbytes for kind, nbytes in by_kind.items()}, dict(model_state_bytes(model, optimizer).bytes)


def test_fsdp2_per_block_shards_as_our_stage_3_does_but_for_adamw_s_step_counters():
    for fsdp2, ours in zero_lab.launch(_fsdp2_beside_stage3, 2, timeout=60):
        assert fsdp2["SHARDED_PARAM"] == ours["parameters"] and fsdp2["SHARDED_GRAD"] == ours["gradients"], (fsdp2, ours)
        steps = 4 * len(list(GPT(gpt_config(1, 32, 16)).parameters()))  # one fp32 step counter per parameter
        assert fsdp2["OPT"] - ours["optimizer_states"] - ours["master_params"] == steps, (fsdp2, ours)


MUTANTS = {  # name: (text of the reference, the mistake, the graded cell that must fail)
    "real tensors, not FakeTensors": ("        with FakeTensorMode():\n            return fn(*args)\n",
                                      "        return fn(*args)\n", "as_fake_rank"),
    "torch's own fake backend, which no CommLedger charges": ("comm_ledger.BACKEND, store=FakeStore(), rank=rank",
                                                              '"fake", store=FakeStore(), rank=rank', "as_fake_rank"),
    "every run as rank 0": ("store=FakeStore(), rank=rank, world_size=n)", "store=FakeStore(), rank=0, world_size=n)",
                            "as_fake_rank"),
    "the group kept after fn": ("    finally:\n        dist.destroy_process_group()\n", "    finally:\n        pass\n",
                                "as_fake_rank"),
    "the group destroyed only when fn succeeds": (
        "    try:\n        with FakeTensorMode():\n            return fn(*args)\n    finally:\n        dist.destroy_process_group()\n",
        "    with FakeTensorMode():\n        value = fn(*args)\n    dist.destroy_process_group()\n    return value\n",
        "as_fake_rank"),
    "no padding": ("    whole = shard * n  # the padded buffers", "    whole = sum(buffers)", "predicted_bytes"),
    "stage 2 keeps whole gradients": ('({"gradients"} if stage >= 2 else set())', "set()", "predicted_bytes"),
    "stage 1 with offload leaves out the whole bf16 gradient": ('4 * shard + (counted["gradients"] if stage == 1 else 0)',
                                                                 "4 * shard", "predicted_bytes"),
    "offload's device bytes are all of them": (
        'device = model_state_bytes(model, optimizer, placement="device").total if offload else report.total',
        "device = report.total", "count_step"),
    "stage 3 moments on the padding too": ('counted["optimizer_states"] = BYTES_PER_ELEMENT["optimizer_states"] * real',
                                            'counted["optimizer_states"] = BYTES_PER_ELEMENT["optimizer_states"] * shard',
                                            "predicted_bytes"),
    "counted before the step": ("        optimizer.step()\n", "        pass\n", "count_step"),
    "activations left out": ('activations=figures["activations"],', "activations=0,", "measure_step"),
    "stage 2 keeps whole gradients in the peak": ("gradients = 2 * psi / (n if stage >= 2 else 1)",
                                                  "gradients = 2 * psi / (n if stage >= 3 else 1)", "peak_parts"),
    "stage 0 divides the optimizer states by N": ("optimizer = 12 * psi / (n if stage >= 1 else 1)",
                                                  "optimizer = 12 * psi / n", "peak_parts"),
    "stage 1 divides the gradients too": ("gradients = 2 * psi / (n if stage >= 2 else 1)",
                                          "gradients = 2 * psi / (n if stage >= 1 else 1)", "peak_parts"),
    "a bucket larger than the model": ("2 * min(bucket_numel, psi) if stage == 2", "2 * bucket_numel if stage == 2",
                                       "peak_parts"),
    "a tie goes to the other part": ('return cause if others[cause] > parts["model states"]',
                                     'return cause if others[cause] >= parts["model states"]', "peak_parts"),
    "shards of floor(m / n)": ("    shard = sum(-(-m // n) for m in buffers)\n", "    shard = sum(m // n for m in buffers)\n",
                               "predicted_bytes"),
    "a gathered unit as its shard": ("2 * max(units) if stage == 3", "2 * max(units) / n if stage == 3", "peak_parts"),
    "the largest residual part always dominates": ('return cause if others[cause] > parts["model states"] else "model states"',
                                                   "return cause", "peak_parts"),
    "masters left out of MemTracker's optimizer row": ('for category in name.split(" + "))', 'for category in name.split(" + ")[-1:])',
                                                       "tracker_vs_ledger"),
    "the first size that does not fit": ("    return fits\n", "    return too_big\n", "largest_model"),
    "a size that fits exactly refused": ("        if bytes_of(middle) <= budget_bytes:", "        if bytes_of(middle) < budget_bytes:",
                                         "largest_model"),
    "no error when nothing fits": ("    if (needed := bytes_of(low)) > budget_bytes:", "    if False:",
                                  "largest_model"),
    "the linear guess, padding left out": ("    fits, step = low, 1\n",
                                           "    return int(budget_bytes / (bytes_of(low) / low))\n    fits, step = low, 1\n",
                                           "largest_model"),
    "steps that do not grow: a linear scan": ("        fits, step = fits + step, 2 * step", "        fits, step = fits + step, step",
                                              "largest_model"),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_typical_mistakes_fail_their_graded_cell(mutant):
    assert_mutant_fails(LESSON, *MUTANTS[mutant])


def test_a_wrong_predicted_bytes_is_named_when_count_step_is_graded():
    namespace, source = graded_cell_with(LESSON, "count_step", '({"gradients"} if stage >= 2 else set())', "set()")
    with pytest.raises(AssertionError, match=r"predicted_bytes \(exercise 1\) gives .* exercise 1 is wrong here"):
        exec(compile(source, "count_step", "exec"), namespace)


def _blocked():
    time.sleep(600)


def _busy(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
    return "done"


def test_the_fake_world_s_timeout_guards_against_a_hang_not_a_slow_machine():
    # working for longer than `timeout` in wall time (a busy machine) is no hang: only CPU-seconds of one run count
    start = time.monotonic()
    assert [run.value for run in in_fake_world([(2, rank, _busy, (0.8,)) for rank in (0, 1, 0)], timeout=2)] == ["done"] * 3
    assert time.monotonic() - start > 2  # three runs of 0.8 CPU-seconds each: more than the timeout in all
    with pytest.raises(TimeoutError, match=r"timeout, a guard against a hang: run 1 of 1 .* used no CPU over the last second \(blocked\)"):
        in_fake_world([(2, 0, _blocked, ())], timeout=3)
    with pytest.raises(TimeoutError, match=r"timeout, a guard against a hang: run 1 of 1 .* CPU-seconds \(a runaway loop\)"):
        in_fake_world([(2, 0, _busy, (600,))], timeout=3)


def test_the_demos_print_a_peak_parts_of_fractions():
    """peak_parts may return Fractions (its contract): the cells that print it format them on Python 3.10-3.13."""
    def fractions(*args, **kwargs):
        return {name: Fraction(value) for name, value in peak_parts(*args, **kwargs).items()}
    cells = [c.source for c in nbformat.read(REPO / "solutions" / LESSON / f"{LESSON}.ipynb", as_version=4).cells
             if c.cell_type == "code" and "peak_parts(" in c.source and not c.source.startswith("#|")]
    assert cells
    for source in cells:
        exec(source, dict(peak_parts=fractions, dominant_cause=dominant_cause, needs_exercises=needs_exercises))


def test_hidden_tests_are_worth_points(graded):
    assert_reference_full_and_learner_zero(graded, LESSON, 21)
