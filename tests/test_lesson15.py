"""Lesson 15, Flight Recorder: the real recorder's dumps of hangs on gloo, read by calls_of and lined up by
first_mismatch (a rank missing, another op, other sizes, another group, all agree, ring buffers that rolled
over); the canary flags eight silent runs and none of the correct ones over 20 steps at 2 and 3 ranks, its
ledger naming the three that lose a micro-batch or a gradient; typical wrong answers fail their graded cells."""

LESSON = "15_flight_recorder"

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from graded_cells import assert_mutant_fails, assert_reference_full_and_learner_zero, graded_cell_with
from zero_lab import RanksHung, launch
from zero_lab.flight_recorder import Call, calls_of, fake_dump, first_mismatch, load_dumps


def recorded_hang(fn, world_size, *args, buffer_size=None):
    if buffer_size:  # the launcher sets TORCH_FR_BUFFER_SIZE only where it is unset
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(buffer_size)
    with tempfile.TemporaryDirectory() as folder:  # removed also when a rank fails instead of hanging
        try:
            with pytest.raises(RanksHung):
                launch(fn, world_size, *args, timeout=2, flight_recorder=folder)
        finally:
            os.environ.pop("TORCH_FR_BUFFER_SIZE", None)
        return load_dumps(folder)


def _barrier_first_on_last_rank():
    """Every rank issues an all-reduce and a barrier; the last rank in the other order."""
    t = torch.ones(3)
    if dist.get_rank() == dist.get_world_size() - 1:
        dist.barrier()
        dist.all_reduce(t)
    else:
        dist.all_reduce(t)
        dist.barrier()


def _all_reduce_in_the_wrong_group():
    """Ranks 0 and 1 make a group; rank 1 sends its all-reduce there while the others use the default group."""
    pair = dist.new_group([0, 1])
    t = torch.ones(5)
    dist.all_reduce(t)
    dist.all_reduce(t, group=pair if dist.get_rank() == 1 else None)


@pytest.mark.parametrize("world_size", [2, 3])
def test_real_dumps_of_an_order_mismatch(world_size):
    dumps = recorded_hang(_barrier_first_on_last_rank, world_size)
    last = world_size - 1
    assert [c.op for c in calls_of(dumps[last])] == ["barrier"]
    found = first_mismatch(dumps)
    assert (found.kind, found.group, found.seq, found.missing) == ("op", "0", 1, ())
    assert found.calls[last].op == "barrier" and found.calls[0].op == "all_reduce"
    assert found.waiting == tuple(range(world_size))
    assert "_barrier_first_on_last_rank" in found.calls[last].stack[0]


def test_real_dumps_of_a_collective_in_the_wrong_group():
    dumps = recorded_hang(_all_reduce_in_the_wrong_group, 3)
    found = first_mismatch(dumps)
    assert (found.kind, found.group, found.seq, found.waiting, found.missing) == ("group", "0", 2, (0, 2), (1,))
    assert [(c.group, c.seq, c.done) for c in calls_of(dumps[1])] == [("0", 1, True), ("1", 1, False)]


def _many_calls_then_rank_1_stops(calls):
    """Every rank all-reduces `calls` times, ranks 0 and 1 also in a pair group every other time; then all but rank 1
    all-reduce once more."""
    pair, t = dist.new_group([0, 1]), torch.ones(3)
    for i in range(calls):
        dist.all_reduce(t)
        if dist.get_rank() < 2 and i % 2 == 0:
            dist.all_reduce(t, group=pair)
    if dist.get_rank() != 1:
        dist.all_reduce(t)


def test_real_dumps_whose_ring_buffers_rolled_over():
    dumps = recorded_hang(_many_calls_then_rank_1_stops, 3, 6, buffer_size=5)
    # each rank kept its last 5 entries, numbered by all it recorded: their windows start at other seqs
    assert all(len(d["entries"]) == 5 and d["entries"][0]["record_id"] > 0 for d in dumps.values())
    assert len({min(c.seq for c in calls_of(d) if c.group == "0") for d in dumps.values()}) > 1
    found = first_mismatch(dumps)
    assert (found.kind, found.group, found.seq, found.waiting, found.missing) == ("missing", "0", 7, (0, 2), (1,))


def test_fake_dump_reads_back_as_its_calls():
    calls = [Call("0", 1, "all_reduce", ((4, 2),), True, 10, ("train.py:3 in step", "train.py:9 in main")),
             Call("2", 1, "barrier", (), False, 20, ())]
    assert calls_of(fake_dump(calls)) == calls
    assert first_mismatch({0: fake_dump(calls), 1: fake_dump(calls)}) is None
    assert calls_of(fake_dump(calls, keep=1)) == calls[1:]
    assert fake_dump(calls, keep=1)["entries"][0]["record_id"] == 1


MUTANTS = {
    "done read from 'state', which gloo leaves 'scheduled'": (
        'done=entry["retired"]', 'done=entry["state"] == "completed"', "calls_of"),
    "sizes from the outputs": (
        'for size in entry["input_sizes"]', 'for size in entry["output_sizes"]', "calls_of"),
    "the whole stack, torch's frames first": (
        'stack=rank_stack(entry["frames"])',
        'stack=tuple(f"{f[\'filename\']}:{f[\'line\']} in {f[\'name\']}" for f in entry["frames"])', "calls_of"),
    "the backend left in op": ('op=entry["profiling_name"].split(":", 1)[-1]', 'op=entry["profiling_name"]', "calls_of"),
    "sizes not compared": ("len({(c.op, c.sizes) for c in present}) > 1", "len({c.op for c in present}) > 1",
                           "first_mismatch"),
    "the last mismatch of a group": ("for seq in sorted({s for g, s, _ in at if g == group and s >= first_covered}):",
                                     "for seq in sorted({s for g, s, _ in at if g == group and s >= first_covered}, "
                                     "reverse=True):",
                                     "first_mismatch"),
    "the latest group's mismatch": ("min(found, key=lambda item: item[0])", "max(found, key=lambda item: item[0])",
                                    "first_mismatch"),
    "a wrong group called missing": ('kind = "group" if elsewhere else "missing"', 'kind = "missing"', "first_mismatch"),
    "waiting and missing swapped": ("return Mismatch(kind, group, seq, here, waiting, missing)",
                                    "return Mismatch(kind, group, seq, here, missing, waiting)", "first_mismatch"),
    "a rank with no call at all is not in the default group": (
        "members = {DEFAULT_GROUP: set(dumps)}", "members = {}", "first_mismatch"),
    "calls that fell out of a buffer called never issued": ("and s >= first_covered}", "}", "first_mismatch"),
}


MUTANTS.update({
    "checksums compared with a tolerance": ("    keys = [tuple(s.tolist()) for s in every]\n",
                                            "    keys = [tuple(round(v, 3) for v in s.tolist()) for s in every]\n",
                                            "replicas_agree"),
    "a plain sum, blind to values that move": ("torch.stack([flat.sum(), (flat * position).sum()])",
                                               "torch.stack([flat.sum(), flat.abs().sum()])", "replicas_agree"),
    "rank 0 always taken for the usual value": ("    usual = max(counts, key=lambda key: (counts[key], key == keys[0]))\n",
                                                "    usual = keys[0]\n", "replicas_agree"),
    "the weights compared, not the updates": ("made, expected = after[name] - start, shadow_after[name] - start",
                                              "made, expected = after[name], shadow_after[name]", "update_error"),
    "an update the shadow did not make counted 0": ("worst = max(worst, error / size if size else math.inf)",
                                                    "worst = max(worst, error / size if size else 0.0)", "update_error"),
    "the mean over parameters": ("            worst = max(worst, error / size if size else math.inf)\n    return worst",
                                 "            worst += (error / size if size else math.inf) / len(before)\n    return worst",
                                 "update_error"),
    "the hook never starts again on a new p.grad": (
        "self.held[name] = self.held.get(name, 0) + 1 if same_tensor else 1", "self.held[name] = self.held.get(name, 0) + 1",
        "ledger"),
    "only gradients short of micro-batches, not those with one too many": (
        "if ledger.get(name, 0) != expected}", "if ledger.get(name, 0) < expected}", "ledger"),
    "a rank that never entered a reduce not counted": (
        "if ledger.get(name, 0) != expected}", "if name in ledger and ledger[name] != expected}", "ledger"),
    "only the gradients this rank reduced": ("for name in sorted({name for ledger in every for name in ledger}):",
                                             "for name in sorted(entries):", "ledger"),
    "replicas that drift not told from those that agree": (
        'return "reduced-before-last-micro-batch" if drifted else "accumulator-reset"', 'return "accumulator-reset"',
        "diagnosis_silent"),
    "every flagged Muon run taken for a skipped orthogonalisation": (
        'return "orthogonalisation-skipped" if evidence["optimizers"].get("Muon") else "optimizer-chosen-by-shard-shape"',
        'return "orthogonalisation-skipped"', "diagnosis_silent"),
    "uneven valid rows blamed without a flag": ("    if not any(step[\"flagged\"] for step in steps):\n        return None\n", "",
                                                "diagnosis_silent"),
})


@pytest.mark.parametrize("mutant", MUTANTS)
def test_typical_mistakes_fail_their_graded_cell(mutant):
    assert_mutant_fails(LESSON, *MUTANTS[mutant])


@pytest.mark.parametrize("mutant", ["the backend left in op", "done read from 'state', which gloo leaves 'scheduled'"])
def test_first_mismatch_names_exercise_1_when_calls_of_is_wrong(mutant):
    namespace, source = graded_cell_with(LESSON, "first_mismatch", *MUTANTS[mutant][:2])
    with pytest.raises(AssertionError, match=r"exercise 1 \(`calls_of`\) is wrong"):
        exec(compile(source, "first_mismatch", "exec"), namespace)


def test_hidden_tests_are_worth_points(graded):
    assert_reference_full_and_learner_zero(graded, LESSON, 16)


def _flags_and_losses(steps):
    from zero_lab.canary import BASELINES, run_with_canary
    from zero_lab.silent_runs import SILENT
    return {setup.name: [(report["flagged"], report["loss"], bool(report["ledger_gaps"]))
                         for report in run_with_canary(setup, steps)]
            for setup in BASELINES + SILENT}


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_canary_flags_every_silent_run_and_no_correct_one_over_20_steps(world_size):
    from zero_lab.canary import BASELINES
    from zero_lab.silent_runs import SILENT
    for rank, runs in enumerate(launch(_flags_and_losses, world_size, 20, timeout=300)):
        for setup in BASELINES:
            assert not any(flagged for flagged, _, _ in runs[setup.name]), (rank, setup.name)
        for setup in SILENT:
            flags, losses, gaps = zip(*runs[setup.name])
            assert any(flags), (rank, setup.name)
            assert sum(losses[-5:]) < 0.8 * sum(losses[:5]), f"{setup.name} should train: its loss falls"
            # the ledger names the runs that reduced before every micro-batch was in at every step, the stale
            # experts at some steps, and only them
            if setup.name in ("accumulator-reset", "reduced-before-last-micro-batch"):
                assert all(gaps), (rank, setup.name, gaps)
            else:
                assert any(gaps) == (setup.name == "update-skipped-without-local-gradient"), (rank, setup.name, gaps)
