"""Lesson 11, debugging bank: each repro fails as the lesson says, each fix matches one process, typical wrong fixes lose points."""

import math
import os
import pickle
import shutil
from fractions import Fraction

import nbformat
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zero_lab
from graded_cells import define_helpers
from zero_lab import launch
from zero_lab.course_tools import questions
from zero_lab.course_tools.implementation import REPO
from zero_lab.debugging import (SHAPES, WIDTH, Diagnosis, DynamicLossScaler, OpCounter, accumulate_then_sync, adam_state, adamw_foreach_,
                                broadcast_model_, clip_sharded_grads_, device_grads, forward_every_rank_gathers, full_state_on_rank0, gather_full,
                                gathered_params, is_hard, layer_weights, micro_batches, model_grads, offload_adamw_step_, overflow_anywhere,
                                partition_, placement, rank_batch_indices, shard_of, small_mlp, sync_batch_norm, sync_grads_, train_fp16,
                                two_head_loss, two_head_model)

NOTEBOOK = REPO / "solutions" / "11_debugging" / "11_debugging.ipynb"


def test_diagnosis_takes_words_from_the_vocabulary_only():
    Diagnosis("unused-parameter", "all_reduce", rank=1)
    with pytest.raises(ValueError, match="not in the vocabulary"):
        Diagnosis("it-hangs")
    with pytest.raises(ValueError, match="all_gather"):
        Diagnosis("divergent-control-flow", collective="allgather")


# The fixes, on world sizes the notebook's visible tests do not use.

def _branches(easy_ranks):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shards = [shard_of(w, rank, world_size) for w in layer_weights([WIDTH] * 4, seed=3)]
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(rank)) * (0.1 if rank in easy_ranks else 2.0)
    return x, forward_every_rank_gathers(shards, SHAPES, x)


@pytest.mark.parametrize("world_size, easy_ranks", [(3, {2}), (4, {0, 3})])
def test_divergent_branches_no_longer_hang_and_keep_each_ranks_branch(world_size, easy_ranks):
    weights = layer_weights([WIDTH] * 4, seed=3)
    for x, out in launch(_branches, world_size, easy_ranks, timeout=30):
        h = torch.relu(x @ weights[0].T)
        if is_hard(x):
            h = torch.relu(h @ weights[1].T)
        torch.testing.assert_close(out, h @ weights[2].T)


def _consolidate(sizes):
    weights = layer_weights(sizes, seed=1)
    return full_state_on_rank0([shard_of(w, dist.get_rank(), dist.get_world_size()) for w in weights], [w.shape for w in weights])


def test_full_state_reaches_rank0_only():
    sizes = [3, 5, 2]
    results = launch(_consolidate, 4, sizes, timeout=30)
    assert [w.tolist() for w in results[0]] == [w.tolist() for w in layer_weights(sizes, seed=1)]
    assert results[1:] == [None, None, None]


def _clip(max_norm):
    matrices, vectors = model_grads(seed=2, scale=2.0)
    shards = [shard_of(g, dist.get_rank(), dist.get_world_size()) for g in matrices]
    return clip_sharded_grads_(shards, vectors, max_norm), shards, vectors


@pytest.mark.parametrize("max_norm", [0.3, 1e3])
def test_clipping_uses_the_whole_gradients_norm_on_every_rank(max_norm):
    matrices, vectors = model_grads(seed=2, scale=2.0)
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in matrices + vectors))
    factor = min(1.0, max_norm / (norm + 1e-6))
    for rank, (got_norm, shards, got_vectors) in enumerate(launch(_clip, 3, max_norm, timeout=30)):
        assert got_norm.item() == pytest.approx(norm, rel=1e-6)
        for shard, full in zip(shards, matrices):
            torch.testing.assert_close(shard, shard_of(full * factor, rank, 3))
        for got, full in zip(got_vectors, vectors):
            torch.testing.assert_close(got, full * factor)


def _accumulate(micro_steps):
    model = small_mlp(seed=4)
    with zero_lab.CommLedger() as ledger:
        accumulate_then_sync(model, micro_batches(4, dist.get_rank(), micro_steps))
    return [p.grad for p in model.parameters()], ledger.sent_bytes()


def test_accumulation_matches_one_process_and_syncs_once():
    world_size, micro_steps = 3, 4
    model = small_mlp(seed=4)
    batches = [b for rank in range(world_size) for b in micro_batches(4, rank, micro_steps)]
    (sum(F.mse_loss(model(x), y) for x, y in batches) / len(batches)).backward()
    psi = sum(p.numel() for p in model.parameters())
    for grads, sent in launch(_accumulate, world_size, micro_steps, timeout=30):
        for got, p in zip(grads, model.parameters()):
            torch.testing.assert_close(got, p.grad)
        assert sent == Fraction(2 * (world_size - 1) * psi * 4, world_size)


def _broadcast():
    torch.manual_seed(dist.get_rank())
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model[1].running_var.mul_(dist.get_rank() + 2)
    broadcast_model_(model, src=1)
    return model.state_dict()


def test_every_rank_starts_from_the_source_ranks_parameters_and_buffers():
    states = launch(_broadcast, 3, timeout=30)
    for state in states:
        assert all(torch.equal(state[name], states[1][name]) for name in state)
    assert torch.equal(states[0]["1.running_var"], torch.full((4,), 3.0))


def test_ranks_cut_one_shared_shuffle_into_disjoint_blocks():
    for world_size in (1, 2, 3, 6):
        rows = [rank_batch_indices(30, 12, step=5, seed=7, rank=r, world_size=world_size) for r in range(world_size)]
        assert torch.cat(rows).tolist() == torch.randperm(30, generator=torch.Generator().manual_seed(12))[:12].tolist()


def _overflow(bad_rank):
    shard = torch.ones(5, dtype=torch.float16)
    if dist.get_rank() == bad_rank:
        shard[2] = float("nan")
    return overflow_anywhere(shard)


@pytest.mark.parametrize("bad_rank, expected", [(None, False), (0, True), (2, True)])
def test_every_rank_learns_about_an_overflow_anywhere(bad_rank, expected):
    assert launch(_overflow, 3, bad_rank, timeout=30) == [expected] * 3


def _batch_norm(rows):
    rank = dist.get_rank()
    x = torch.randn(rows[rank], 3, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
    return sync_batch_norm(x, torch.ones(3), torch.zeros(3))


def test_sync_batch_norm_is_batch_norm_on_the_global_batch_with_uneven_ranks():
    rows = [1, 4, 7]
    everyone = torch.cat([torch.randn(n, 3, generator=torch.Generator().manual_seed(r)) * (r + 1) for r, n in enumerate(rows)])
    expected = F.batch_norm(everyone, None, None, torch.ones(3), torch.zeros(3), training=True)
    outputs = launch(_batch_norm, 3, rows, timeout=30)
    # mean and variance summed per rank, then across ranks: another order of ~30 terms, a few ulps of values below ~10
    torch.testing.assert_close(torch.cat([y for y, _, _ in outputs]), expected, atol=1e-5, rtol=1e-5)
    for _, mean, var in outputs:
        torch.testing.assert_close(mean, everyone.mean(0))
        torch.testing.assert_close(var, everyone.var(0), atol=1e-5, rtol=1e-5)


def _unused(aux_ranks):
    rank = dist.get_rank()
    model = two_head_model(seed=8)
    two_head_loss(model, *micro_batches(8, rank, 1)[0], rank in aux_ranks).backward()
    sync_grads_(list(model.parameters()))
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("aux_ranks", [{1}, set()])
def test_unused_parameters_average_with_zeros_or_stay_without_gradient(aux_ranks):
    model = two_head_model(seed=8)
    (sum(two_head_loss(model, *micro_batches(8, r, 1)[0], r in aux_ranks) for r in range(3)) / 3).backward()
    for grads in launch(_unused, 3, aux_ranks, timeout=30):
        for got, p in zip(grads, model.parameters()):
            assert (got is None) == (p.grad is None)
            if got is not None:
                torch.testing.assert_close(got, p.grad)


def _placeholders():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 1))
    shards = partition_(model)
    empty = [p.shape for p in model.parameters()]
    with gathered_params(model, shards):
        state = {name: p.detach().clone() for name, p in model.named_parameters()}
    return empty, state, [p.shape for p in model.parameters()]


def test_stage3_placeholders_are_full_inside_the_gathered_block_only():
    torch.manual_seed(0)
    expected = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 1)).state_dict()
    for empty, state, after in launch(_placeholders, 3, timeout=30):
        assert empty == after == [torch.Size([0])] * 4
        assert all(torch.equal(state[name], expected[name]) for name in expected)


@pytest.mark.parametrize("num_tensors", [1, 40])
def test_multi_tensor_adamw_is_torchs_adamw_in_a_constant_number_of_calls(num_tensors):
    params, grads, exp_avgs, exp_avg_sqs = adam_state(num_tensors, 6, seed=num_tensors)
    reference = [torch.nn.Parameter(p.clone()) for p in params]
    optimizer = torch.optim.AdamW(reference, lr=0.05, betas=(0.8, 0.99), weight_decay=0.2)
    for step in (1, 2):
        for p, g in zip(reference, grads):
            p.grad = g
        optimizer.step()
        counter = OpCounter()
        with counter:
            adamw_foreach_(params, grads, exp_avgs, exp_avg_sqs, step, lr=0.05, betas=(0.8, 0.99), weight_decay=0.2)
        assert counter.calls == 8
    for mine, theirs in zip(params, reference):
        torch.testing.assert_close(mine, theirs.detach())


def _scaler(growth_interval, spikes):
    scaler = DynamicLossScaler(scale=2.0 ** 20, growth_interval=growth_interval)
    history, weights = train_fp16(scaler, 10, 3, spikes)
    return [(scale, stepped) for scale, stepped, _ in history], scaler.skipped


def test_loss_scaler_skips_only_overflowing_steps_and_grows_back():
    world_size, spikes = 3, frozenset({(2, 6)})
    for history, skipped in launch(_scaler, world_size, 2, spikes, timeout=30):
        scales, stepped = [scale for scale, _ in history], [stepped for _, stepped in history]
        assert not stepped[0] and not stepped[6] and skipped == stepped.count(False), history  # 2^20 overflows; so does the spike
        assert all(after == before / 2 for before, after, ok in zip(scales, scales[1:], stepped) if not ok), scales
        assert any(after == 2 * before for before, after in zip(scales, scales[1:])), f"clean steps in a row double the scale: {scales}"


def _offload(sizes):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    weights = layer_weights(sizes, seed=9)
    masters, state = [shard_of(w, rank, world_size) for w in weights], {}
    for step in (1, 2):
        offload_adamw_step_(masters, [shard_of(g, rank, world_size) for g in device_grads(weights, 9, step)], state, lr=0.02)
    return [gather_full(m, w.shape) for m, w in zip(masters, weights)], placement(state["exp_avg"] + state["exp_avg_sq"])


def test_offloaded_step_keeps_its_state_with_the_masters_and_matches_adamw():
    sizes = [6, 1, 4]
    weights = [torch.nn.Parameter(w) for w in layer_weights(sizes, seed=9)]
    optimizer = torch.optim.AdamW(weights, lr=0.02, weight_decay=0.01)
    for step in (1, 2):
        for w, g in zip(weights, device_grads(weights, 9, step)):
            w.grad = g.float()
        optimizer.step()
    for full, state_at in launch(_offload, 4, sizes, timeout=30):
        assert state_at == ["cpu/float32"] * 4
        for got, want in zip(full, weights):
            torch.testing.assert_close(got, want.detach())


# The notebook's own repros fail as its prose says (definitions run, demo cells not).

def _notebook_namespace(old=None, new=None):
    """The notebook's definitions, optionally one change made: every untagged code cell but tests, and the
    definitions of its demo cells (grading skips those, but the repros they define are tested here)."""
    cells = [c for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code"]
    definitions = [c for c in cells if c.metadata.get("tags", []) in ([], ["demo"]) and not c.source.startswith("#| test")]
    if old is not None:
        assert sum(c.source.count(old) for c in definitions) == 1, "a mutant replaces one solution"
    namespace = {}
    for cell in definitions:
        source = cell.source if old is None else cell.source.replace(old, new)
        if cell.metadata.get("tags"):
            define_helpers(source, namespace)
        else:
            exec(source, namespace)
    return namespace, {c.source.split()[2]: c.source for c in cells if c.source.startswith("#| test")}


def test_the_hangs_become_ranks_hung_within_seconds_naming_the_odd_rank_out():
    namespace, _ = _notebook_namespace()
    with pytest.raises(zero_lab.RanksHung) as hung:
        launch(namespace["branchy_case"], 3, namespace["forward_branchy"], {1}, timeout=4)
    assert sorted(hung.value.stuck) == [0, 2] and all("all_gather" in where for where in hung.value.stuck.values())
    # through the notebook's run_case, as its cells run it: the hang also leaves one Flight Recorder dump per rank
    assert namespace["run_case"]("2 save", namespace["save_checkpoint_case"], 3) is None
    assert namespace["HUNG"]["2 save"] == {0}
    folder = namespace["DUMPS"]["2 save"]
    try:
        assert sorted(os.listdir(folder)) == ["rank_0", "rank_1", "rank_2"]
        with open(os.path.join(folder, "rank_0"), "rb") as file:
            assert "all_gather" in pickle.load(file)["entries"][-1]["profiling_name"]
    finally:
        shutil.rmtree(folder)
    with pytest.raises(zero_lab.RanksHung) as hung:
        launch(namespace["unused_case"], 3, namespace["sync_after_backward"], {0, 2}, timeout=4)
    assert sorted(hung.value.stuck) == [0, 2] and all("all_reduce" in where for where in hung.value.stuck.values())


def test_the_sticky_scaler_skips_every_step_after_one_overflow_and_the_loss_stays_flat():
    namespace, _ = _notebook_namespace()
    for history in launch(namespace["loss_scale_case"], 2, namespace["ReproScaler"], 8, timeout=30):
        assert [scale for scale, _, _ in history] == [2.0 ** (16 - step) for step in range(8)]
        assert not any(stepped for _, stepped, _ in history) and len({loss for _, _, loss in history}) == 1


def test_offload_state_made_like_the_gradient_drifts_here_and_the_first_patch_fails():
    namespace, _ = _notebook_namespace()
    expected = namespace["one_process_adamw"]()
    full, masters_at, state_at = launch(namespace["offload_case"], 2, namespace["host_step_"], timeout=30)[0]
    assert set(masters_at) == {"cpu/float32"} and set(state_at) == {"cpu/bfloat16"}
    assert max((a - b).abs().max().item() for a, b in zip(full, expected)) > 1e-5, "bf16 moments drift far beyond fp32 rounding"
    with pytest.raises(zero_lab.RankFailed, match="expected dtype"):
        launch(namespace["offload_case"], 2, namespace["host_step_grads_cast_"], timeout=30)


def test_the_accumulation_repro_sends_k_times_one_sync():
    namespace, _ = _notebook_namespace()
    psi = sum(p.numel() for p in small_mlp(0).parameters())
    for sent, _ in launch(namespace["accumulation_case"], 4, namespace["ddp_like_accumulation"], 4, timeout=30):
        assert sent == namespace["sync_bytes_per_step"](psi, 4, 4, every_micro_step=True) == 4 * Fraction(2 * 3 * psi * 4, 4)


# Typical wrong answers lose points: the notebook's definitions with one solution replaced, then
# one graded cell, hidden checks included (grading the whole notebook is test_grading.py's job).

MUTANTS = {
    "agree on the branch": ("every_rank_gathers", "    if is_hard(x):\n        h = torch.relu(h @ middle.T)",
                            "    hard = torch.tensor([float(is_hard(x))])\n    dist.all_reduce(hard, op=dist.ReduceOp.MAX)\n"
                            "    if hard.item():\n        h = torch.relu(h @ middle.T)"),
    "gather on rank 0 only": ("full_state_on_rank0", "        dist.gather(shard, pieces, dst=0)\n        if rank == 0:\n",
                              "        if rank == 0:\n            dist.gather(shard, pieces, dst=0)\n"),
    "local norm": ("clip_sharded", "    dist.all_reduce(squares)  # the shards' part, summed over ranks\n", ""),
    "replicated counted N times": ("clip_sharded",
                                   "    dist.all_reduce(squares)  # the shards' part, summed over ranks\n"
                                   "    for g in replicated_grads:\n        squares += g.float().pow(2).sum()  # whole on every rank: count once\n",
                                   "    for g in replicated_grads:\n        squares += g.float().pow(2).sum()\n    dist.all_reduce(squares)\n"),
    "bytes without (N-1)/N": ("diagnosis_accumulation", "Fraction(2 * (world_size - 1) * numel * element_size, world_size)",
                              "Fraction(2 * numel * element_size)"),
    "sync every micro-step": ("accumulate_then_sync",
                              "        (torch.nn.functional.mse_loss(model(x), y) / len(batches)).backward()\n"
                              "    world_size = dist.get_world_size()\n    for p in model.parameters():\n"
                              "        dist.all_reduce(p.grad)\n        p.grad.div_(world_size)\n",
                              "        model.zero_grad()\n        (torch.nn.functional.mse_loss(model(x), y) / len(batches)).backward()\n"
                              "        for p in model.parameters():\n            dist.all_reduce(p.grad)\n"
                              "            p.grad.div_(dist.get_world_size())\n"),
    "loss not divided by k": ("accumulate_then_sync", "(torch.nn.functional.mse_loss(model(x), y) / len(batches)).backward()",
                              "torch.nn.functional.mse_loss(model(x), y).backward()"),
    "parameters but not buffers": ("broadcast_model", "list(model.parameters()) + list(model.buffers())", "list(model.parameters())"),
    "shuffle seeded per rank": ("rank_batch_indices", "manual_seed(seed + step)", "manual_seed(seed + step + rank)"),
    "overflow checked locally": ("overflow_anywhere", "    dist.all_reduce(flag, op=dist.ReduceOp.MAX)\n", ""),
    "mean of the ranks' means": ("sync_batch_norm", "torch.cat([x.sum(0), (x * x).sum(0), torch.tensor([float(x.shape[0])], dtype=x.dtype)])",
                                 "torch.cat([x.mean(0), (x * x).mean(0), torch.ones(1, dtype=x.dtype)])"),
    "zeros for parameters used nowhere": ("sync_grads", "        if users == 0:\n            continue\n", ""),
    "skip the reduction of unused parameters": ("sync_grads", "        if p.grad is None:\n            p.grad = torch.zeros_like(p)\n",
                                                "        if p.grad is None:\n            continue\n"),
    "placeholders not restored when the block raises": ("gathered_params", "    try:\n        yield module\n    finally:\n        for p",
                                                        "    if True:\n        yield module\n        for p"),
    "a loop over the tensors": ("adamw_foreach", "    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-lr / (1 - beta1 ** step))\n",
                                "    for p, m, d in zip(params, exp_avgs, denom):\n        p.addcdiv_(m, d, value=-lr / (1 - beta1 ** step))\n"),
    "overflow flag kept across steps": ("loss_scaler", "        if any(overflows_fp16(g) for g in scaled_grads):  # this step's gradients, nothing older\n",
                                        "        self.overflowed = getattr(self, 'overflowed', False) or any(overflows_fp16(g) for g in scaled_grads)\n"
                                        "        if self.overflowed:\n"),
    "scale never grows back": ("loss_scaler", "        if self.clean_steps == self.growth_interval:\n            self.scale *= 2\n            self.clean_steps = 0\n", ""),
    "clean steps not restarted after an overflow": ("loss_scaler", "            self.scale /= 2\n            self.clean_steps = 0\n",
                                                    "            self.scale /= 2\n"),
    "scale grown before unscaling": ("loss_scaler", "        grads = [g / self.scale for g in scaled_grads]  # the scale they were made with, before any growth\n"
                                                    "        self.clean_steps += 1\n        if self.clean_steps == self.growth_interval:\n"
                                                    "            self.scale *= 2\n            self.clean_steps = 0\n        return grads\n",
                                     "        self.clean_steps += 1\n        if self.clean_steps == self.growth_interval:\n"
                                     "            self.scale *= 2\n            self.clean_steps = 0\n        return [g / self.scale for g in scaled_grads]\n"),
    "overflowing step taken anyway": ("loss_scaler", "            self.clean_steps = 0\n            return None\n",
                                      "            self.clean_steps = 0\n            return [g / self.scale for g in scaled_grads]\n"),
    "skipped steps not counted": ("loss_scaler", "            self.skipped += 1\n", ""),
    "state made like the gradient, gradients cast": ("offload_adamw_step", "state.update(new_adam_state(masters))", "state.update(new_adam_state(grads_from_device))"),
    "gradients left in the device's dtype": ("offload_adamw_step",
                                             "    grads = [g.to(device=m.device, dtype=m.dtype) for g, m in zip(grads_from_device, masters)]\n",
                                             "    grads = grads_from_device\n"),
    "the repro's step (state like the gradient, nothing cast)": ("offload_adamw_step",
                                                                 "        state.update(new_adam_state(masters))\n"
                                                                 "    grads = [g.to(device=m.device, dtype=m.dtype) for g, m in zip(grads_from_device, masters)]\n",
                                                                 "        state.update(new_adam_state(grads_from_device))\n    grads = grads_from_device\n"),
    "state re-created every step": ("offload_adamw_step", "    if not state:  # the state lives where the master weights live, in their dtype\n",
                                    "    if True:\n"),
    "case 7's cause for a stale flag": ("diagnosis_loss_scale", 'Diagnosis(cause="stale-overflow-flag"', 'Diagnosis(cause="local-overflow-check"'),
    "the precision named, not where the state was made": ("diagnosis_offload_state", 'Diagnosis(cause="state-like-gradient"',
                                                          'Diagnosis(cause="wrong-dtype"'),
    "no bias correction": ("adamw_foreach", "_foreach_addcdiv_(params, exp_avgs, denom, value=-lr / (1 - beta1 ** step))",
                           "_foreach_addcdiv_(params, exp_avgs, denom, value=-lr)"),
    "the stuck rank named as the culprit": ("diagnosis_branches", 'collective="all_gather", rank=1)', 'collective="all_gather", rank=0)'),
    "order mismatch for an unused parameter": ("diagnosis_unused", 'Diagnosis(cause="unused-parameter"', 'Diagnosis(cause="collective-order-mismatch"'),
    # the fixes whose exercises state a contract rather than the calls
    "all-gather on every rank": ("full_state_on_rank0", "        pieces = [torch.empty_like(shard) for _ in range(world_size)] if rank == 0 else None\n"
                                 "        dist.gather(shard, pieces, dst=0)\n",
                                 "        pieces = [torch.empty_like(shard) for _ in range(world_size)]\n        dist.all_gather(pieces, shard)\n"),
    "gradients summed, not averaged": ("accumulate_then_sync", "    for p in model.parameters():\n        dist.all_reduce(p.grad)\n        p.grad.div_(world_size)\n",
                                       "    for p in model.parameters():\n        dist.all_reduce(p.grad)\n"),
    "the same shuffle every step": ("rank_batch_indices", "manual_seed(seed + step)", "manual_seed(seed)"),
    "rows drawn with replacement": ("rank_batch_indices", "order = torch.randperm(num_samples, generator=",
                                    "order = torch.randint(num_samples, (num_samples,), generator="),
    "a block of each rank's own shuffle": ("rank_batch_indices", "    return order[:global_batch][rank * per_rank:(rank + 1) * per_rank]\n",
                                           "    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + step + rank))[:per_rank]\n"),
    "the gradient all-reduced": ("overflow_anywhere",
                                 "    flag = torch.tensor([0.0 if bool(torch.isfinite(grad_shard).all()) else 1.0])\n"
                                 "    dist.all_reduce(flag, op=dist.ReduceOp.MAX)\n    return bool(flag.item())\n",
                                 "    total = grad_shard.float().abs()\n    dist.all_reduce(total)\n"
                                 "    return not bool(torch.isfinite(total).all())\n"),
    "scale grown one clean step late": ("loss_scaler", "        if self.clean_steps == self.growth_interval:\n            self.scale *= 2\n",
                                        "        if self.clean_steps > self.growth_interval:\n            self.scale *= 2\n"),
}


# A mutant that deadlocks fails at the launcher's timeout: the cells give 20 s, the ranks of a
# right answer finish within a second or two, so the mutants get a shorter one.
MUTANT_LAUNCH_TIMEOUT = 8


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_typical_wrong_answers_lose_points(mutant, monkeypatch):
    test_id, old, new = MUTANTS[mutant]
    namespace, tests = _notebook_namespace(old, new)
    launch_restored = zero_lab.launch_restored
    monkeypatch.setattr(zero_lab, "launch_restored", lambda *args, timeout, **kwargs: launch_restored(
        *args, timeout=min(timeout, MUTANT_LAUNCH_TIMEOUT), **kwargs))
    with pytest.raises((AssertionError, zero_lab.RankFailed, zero_lab.RanksHung)):
        exec(tests[test_id], namespace)


def test_the_reference_passes_the_cells_the_mutants_fail():
    namespace, tests = _notebook_namespace()
    for test_id in {test_id for test_id, _, _ in MUTANTS.values()}:
        exec(tests[test_id], namespace)


@pytest.mark.parametrize("symptom, case", [("loss scale keeps dropping", "11-steps-skipped-loss-scale-drops"),
                                           ("steps skipped", "11-steps-skipped-loss-scale-drops"),
                                           ("Current loss scale already at minimum", "11-steps-skipped-loss-scale-drops"),
                                           ("expected all tensors to be on the same device", "11-offload-state-wrong-device")])
def test_zero_lab_ask_finds_the_case_by_its_symptom(symptom, case):
    ranked = questions.rank(questions.read_bank(), questions.WORD.findall(symptom.lower()))
    assert ranked[0].id == case, [q.id for q in ranked[:3]]


def test_hidden_tests_are_worth_points(graded):
    reference = graded("11_debugging", "solution")
    assert reference.total[0] == reference.total[1] >= 30, reference.total
    learner = graded("11_debugging", "learner")
    assert learner.total[0] == 0
    assert all(score.reason.startswith("not attempted") for score in learner.scores), [s.reason for s in learner.scores]
