"""Lesson 12, Muon under ZeRO-1 (part 1) and ZeRO-3 (part 2): every way equals single-process torch.optim.Muon
(+ AdamW), sends and holds what the lesson says, is reachable through prepare, and the typical wrong answers lose
their points."""

import math
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from graded_cells import assert_mutant_fails, assert_reference_full_and_learner_zero, graded_cell_with
import zero_lab
from zero_lab import launch
from zero_lab.course_tools import questions
from zero_lab.data import shard_batch, token_batches
from zero_lab.memory_ledger import model_state_bytes
from zero_lab.models import GPT, GPTConfig
from zero_lab.muon import (MuonZero1, OwnerLayout, assign_owners, muon_bytes_per_step, newton_schulz, ns_flops_per_rank,
                           split_params)
from zero_lab.muon_zero3 import MuonZero3, exchange_bytes, exchange_rounds, plan_matrices
from zero_lab.prepare import prepare
from zero_lab.zero1 import ShardLayout

LESSON = "12_muon"
TINY = GPTConfig(vocab_size=29, n_layer=2, n_head=2, n_embd=8, block_size=8)
MUON, ADAMW = dict(lr=0.02, weight_decay=0.01), dict(lr=3e-3, weight_decay=0.0)
STEPS = 6


def _batches():
    return list(token_batches(STEPS, 12, TINY.block_size, TINY.vocab_size, seed=2))


def _on_a_grid(model):
    """Round every gradient to a multiple of 2^-21 in [-1, 1] (both runs alike): a sum of 3 such numbers needs
    at most 23 bits, so fp32 adds them exactly in any order, and the ring's order of the sum (gloo's, not
    ours) cannot change a bit that Muon's bf16 Newton-Schulz would amplify."""
    for p in model.parameters():
        p.register_hook(lambda grad: grad.clamp(-1, 1).mul(2.0 ** 21).round().div(2.0 ** 21))
    return model


def _weights(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _prepared(way, **options):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer = prepare(_on_a_grid(GPT(TINY, seed=0)), torch.optim.Muon, stage=1, muon_sharding=way,
                               adamw=ADAMW, **MUON, **options)
    for batch in _batches():
        model(*shard_batch(batch, rank, world_size))[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    return _weights(model)


def _one_process(shards):
    """torch.optim.Muon + AdamW, one thread (as each rank), the global batch's gradient as the mean of `shards` shards'
    (a list: the number of shards of each step)."""
    shards = shards if isinstance(shards, list) else [shards] * STEPS
    model = _on_a_grid(GPT(TINY, seed=0))
    matrices, others = split_params(model)
    optimizers = [torch.optim.Muon(matrices, **MUON), torch.optim.AdamW(others, **ADAMW)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for batch, world_size in zip(_batches(), shards):
            grads = []
            for rank in range(world_size):
                model(*shard_batch(batch, rank, world_size))[1].backward()
                grads.append([p.grad for p in model.parameters()])
                model.zero_grad(set_to_none=True)
            for i, p in enumerate(model.parameters()):
                total = grads[0][i]
                for more in grads[1:]:
                    total = total + more[i]
                p.grad = total / world_size
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    return _weights(model)


@pytest.mark.parametrize("way", ["gather", "own"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_gpt_through_prepare_trains_like_one_process(way, world_size):
    # Gradients on a grid (_on_a_grid): every sum is exact, so the same kernels give the same bits, on any CPU.
    expected = _one_process(world_size)
    for rank, got in enumerate(launch(_prepared, world_size, way, timeout=60)):
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, atol=0, rtol=0, msg=lambda m: f"{way}, rank {rank}, {name}: {m}")


def test_one_last_bit_can_move_a_muon_update_by_a_bf16_step():
    # Why the baseline above puts gradients on a grid: two sums in another order may differ in the last fp32 bit
    # (2^-23 relative), and Muon casts to bf16 (8 significant bits) before Newton-Schulz. Two gradients one
    # fp32 step either side of a bf16 rounding boundary (1 + 2^-8) become bf16 values 2^-7 apart, so the updates
    # differ by a bf16 step, not an fp32 one: the ratio is ~2^15 whatever the CPU's kernels.
    grad = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)) / 8
    below, above = grad.clone(), grad.clone()
    below[0, 0], above[0, 0] = 1 + 2 ** -8 - 2 ** -23, 1 + 2 ** -8 + 2 ** -23
    updates = []
    for g in (below, above):
        weight = torch.nn.Parameter(torch.zeros(8, 8))
        weight.grad = g
        torch.optim.Muon([weight], lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False).step()  # NS of the gradient itself
        updates.append(weight.detach())
    grad_change = ((above - below).abs().max() / below.abs().max()).item()
    update_change = ((updates[1] - updates[0]).abs().max() / updates[0].abs().max()).item()
    assert grad_change < 2 ** -22 and update_change > 2 ** 10 * grad_change, (grad_change, update_change)


def _traffic_and_memory(way, config):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer = prepare(GPT(config, seed=0), torch.optim.Muon, stage=1, muon_sharding=way, adamw=ADAMW, **MUON)
    for batch in token_batches(2, 12, config.block_size, config.vocab_size, seed=0):
        model(*shard_batch(batch, rank, world_size))[1].backward()
        with zero_lab.CommLedger() as ledger:
            optimizer.muon.step()
        optimizer.adamw.step()
        optimizer.zero_grad()
    momentum = model_state_bytes(model, optimizer.muon).bytes["optimizer_states"]
    return float(ledger.sent_bytes()), momentum, model_state_bytes(model, optimizer).bytes


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_bytes_and_momentum_per_rank_are_the_lessons(world_size):
    config = GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=32, block_size=32)
    numels = [p.numel() for p in split_params(GPT(config))[0]]
    psi, zero1 = sum(numels), 2 * (world_size - 1) * ShardLayout(sum(numels), world_size).shard_numel * 4
    for way in ("gather", "own"):
        results = launch(_traffic_and_memory, world_size, way, config, timeout=60)
        sent = muon_bytes_per_step(way, numels, world_size)
        assert [s for s, _, _ in results] == [sent] * world_size
        if way == "gather":
            assert sent == 3 * zero1 // 2  # 3 Psi against ZeRO-1 AdamW's 2 Psi
            assert [m for _, m, _ in results] == [4 * ShardLayout(psi, world_size).shard_numel] * world_size
        else:
            layout = OwnerLayout(tuple(numels), tuple(assign_owners(numels, world_size)), world_size)
            assert sent == 2 * (world_size - 1) * layout.segment_numel * 4 >= zero1
            assert [m for _, m, _ in results] == [4 * layout.load(r) for r in range(world_size)]
            assert sum(m for _, m, _ in results) == 4 * psi  # each matrix's momentum once, whole
        for _, _, held in results:  # AdamW's moments (lesson 03) ride along; the model is whole on every rank
            assert held["parameters"] >= 4 * sum(p.numel() for p in GPT(config).parameters())


def test_flops_per_rank_redundancy_and_imbalance():
    shapes = [(96, 32), (32, 32), (128, 32), (32, 128)] * 2
    total = sum(5 * (4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3) for s in shapes)
    for world_size in (2, 3, 4):
        own, gather = ns_flops_per_rank("own", shapes, world_size), ns_flops_per_rank("gather", shapes, world_size)
        assert sum(own) == total  # each matrix once
        # matrices cut by a shard boundary, twice: at 2 and 3 ranks this GPT's boundaries fall between matrices
        assert sum(gather) > total if world_size == 4 else sum(gather) == total
        assert max(own) > total / world_size if world_size == 4 else max(own) < 1.03 * total / world_size


def test_refusals_name_what_is_supported():
    def attempts():
        model = GPT(TINY)
        messages = {}
        for what, (optimizer_class, stage, options) in {
                "muon at stage 2": (torch.optim.Muon, 2, {}), "muon_sharding at stage 3": (torch.optim.Muon, 3, {"muon_sharding": "own"}),
                "bf16 at stage 3": (torch.optim.Muon, 3, {"param_dtype": torch.bfloat16}),
                "adafactor": (torch.optim.Adafactor, 1, {}), "sharding with adamw": (torch.optim.AdamW, 1, {"muon_sharding": "own"}),
                "typo": (torch.optim.Muon, 1, {"muon_sharding": "owner"}), "bf16": (torch.optim.Muon, 1, {"param_dtype": torch.bfloat16}),
                "offload": (torch.optim.Muon, 1, {"offload": "cpu"})}.items():
            try:
                prepare(model, optimizer_class, stage=stage, **options)
                messages[what] = None
            except (ValueError, TypeError) as error:
                messages[what] = str(error)
        return messages

    messages = launch(attempts, 1, timeout=60)[0]
    assert 'muon_sharding="gather" or "own"' in messages["muon at stage 2"] and "stage 1 and 3" in messages["muon at stage 2"]
    assert "'muon_sharding' works with stages [1]" in messages["muon_sharding at stage 3"]
    assert "not built for Muon at stage 3" in messages["bf16 at stage 3"]
    assert "whole" not in messages["adafactor"] or "Muon is built for stage 1" in messages["adafactor"]
    assert "row and column" in messages["adafactor"]
    assert "apply to torch.optim.Muon only" in messages["sharding with adamw"]
    assert "'gather', 'own'" in messages["typo"]
    assert "not built for Muon" in messages["bf16"] and "not built for torch.optim.Muon" in messages["offload"]


def test_a_scheduler_reaches_both_optimizers_and_state_dict_says_it_is_not_built():
    def run():
        model = GPT(TINY, seed=0)
        optimizer = MuonZero1(model, torch.optim.Muon, muon_sharding="own", adamw=ADAMW, **MUON)
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5).step()
        with pytest.raises(NotImplementedError, match="not built"):
            optimizer.state_dict()
        return [g["lr"] for g in optimizer.param_groups]

    lrs = launch(run, 2, timeout=60)[0]
    assert lrs[0] == pytest.approx(MUON["lr"] / 2) and lrs[1] == pytest.approx(ADAMW["lr"] / 2)


def test_zero_lab_ask_finds_the_lessons_questions():
    bank = questions.read_bank()
    assert questions.rank(bank, "why can't ZeRO shard Muon".split())[0].id == "12-muon-elementwise"
    assert questions.rank(bank, "what does whole-matrix ownership cost".split())[0].id == "12-muon-ownership-cost"
    assert questions.rank(bank, "why is Muon hard to shard".split())[0].id == "12-muon-hard-to-shard"


def test_newton_schulz_of_a_slice_is_not_the_slice_of_newton_schulz():
    g = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    assert (newton_schulz(g)[:4].float() - newton_schulz(g[:4]).float()).abs().max() > 0.05


# ---- part 2: Muon at ZeRO stage 3 (zero_lab.muon_zero3)

def _spans(model, optimizer, matrices):
    """(unit numel, offset in the unit, shape) of each matrix, from lesson 05's units."""
    spans = []
    for p in matrices:
        unit = optimizer.schedule.unit_of[p]
        index = next(k for k, q in enumerate(unit.params) if q is p)
        spans.append((unit.layout.numel, sum(s.numel() for s in unit.shapes[:index]), tuple(unit.shapes[index])))
    return spans


def _stage3_run(batches=slice(None), state=None, **options):
    """Train TINY (gradients on the grid) at stage 3 with Muon through prepare on `batches` of _batches(), after loading
    a consolidated `state`: the weights, the spans, the last optimizer.step()'s traffic, the model state this rank
    holds, the consolidated state dict (rank 0)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _on_a_grid(GPT(TINY, seed=0))
    matrices = split_params(model)[0]
    model, optimizer = prepare(model, torch.optim.Muon, stage=3, adamw=ADAMW, **MUON, **options)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    for batch in _batches()[batches]:
        model(*shard_batch(batch, rank, world_size))[1].backward()
        with zero_lab.CommLedger() as ledger:
            optimizer.step()
        optimizer.zero_grad()
    held = sum(model_state_bytes(model, optimizer).bytes.values())
    consolidated = optimizer.consolidated_state_dict()
    return _weights_stage3(model), _spans(model, optimizer, matrices), ledger.summary(), held, consolidated


def _weights_stage3(model):
    names = {name for name, _ in model.named_parameters()}
    return {name: value.clone() for name, value in model.state_dict().items() if name in names}


def _one_process_state_bytes():
    """Model-state bytes of one process: fp32 weights and gradients, AdamW's two moments, Muon's momentum."""
    matrices, others = split_params(GPT(TINY))
    return 4 * 2 * sum(p.numel() for p in matrices + others) + 8 * sum(p.numel() for p in others) + \
        4 * sum(p.numel() for p in matrices)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_stage3_muon_through_prepare_trains_like_one_process_with_the_lessons_bytes_and_memory(world_size):
    # The bound is 0: gradients on the grid make every sum exact, every other operation is torch's on the same bits.
    expected = _one_process(world_size)
    results = launch(_stage3_run, world_size, timeout=60)
    largest = 4 * max(p.numel() for p in split_params(GPT(TINY))[0])
    plans = plan_matrices(results[0][1], world_size)
    for rank, (got, spans, traffic, held, _) in enumerate(results):
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, atol=0, rtol=0, msg=lambda m: f"rank {rank}, {name}: {m}")
        assert set(traffic) == {"all_to_all"} and traffic["all_to_all"]["calls"] == 2 * len(exchange_rounds(plans, world_size))
        assert Fraction(traffic["all_to_all"]["sent_bytes"]) == exchange_bytes(plans, world_size)[rank]
        assert abs(held - _one_process_state_bytes() / world_size) <= largest, (held, _one_process_state_bytes(), largest)


def test_a_consolidated_checkpoint_resumes_at_another_world_size_and_the_list_of_shards_is_refused():
    first = launch(_stage3_run, 2, slice(0, 3), timeout=60)[0][4]
    weights = launch(_stage3_run, 3, slice(3, None), first, timeout=60)[0][0]
    expected = _one_process([2, 2, 2, 3, 3, 3])
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")
    assert all(set(state) == {"momentum_buffer"} for state in first["optimizer"]["state"].values()
               if "exp_avg" not in state)  # torch.optim.Muon's name for its state

    def refused():
        model, optimizer = prepare(GPT(TINY, seed=0), torch.optim.Muon, stage=3, adamw=ADAMW, **MUON)
        with pytest.raises(ValueError, match="consolidated_state_dict"):
            optimizer.load_state_dict([optimizer.state_dict()])
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5).step()
        return [g["lr"] for g in optimizer.param_groups]

    lrs = launch(refused, 1, timeout=60)[0]
    assert lrs == [pytest.approx(MUON["lr"] / 2), pytest.approx(ADAMW["lr"] / 2)]  # a scheduler reaches both groups


class _NewtonSchulzOnAShard(MuonZero3):
    """The silent bug: every rank orthogonalises its own flat piece (as a 1 x n matrix) and never exchanges."""

    @torch.no_grad()
    def muon_step(self):
        g = self.param_groups[0]
        for i, plan in enumerate(self.plans):
            direction = zero_lab.muon.momentum_direction_(self.grads[i], self.momentum(i), g["momentum"], g["nesterov"])
            if direction.numel():
                ortho = newton_schulz(direction.view(1, -1), g["ns_coefficients"], g["ns_steps"], g["eps"]).view(-1)
                zero_lab.muon.apply_update_(self.slices[i].master, ortho, plan.shape, g["lr"], g["weight_decay"],
                                            g["adjust_lr_fn"])


def _canary_runs():
    from zero_lab import canary

    def on_a_shard(model):
        optimizer = _NewtonSchulzOnAShard(model, torch.optim.Muon, adamw=canary.ADAMW, **canary.MUON)
        return model, lambda micro_batches: canary.accumulate_and_step(model, [optimizer], micro_batches), [optimizer]

    setups = [canary.Setup("stage 3, Muon", canary.prepared(3, torch.optim.Muon, adamw=canary.ADAMW, **canary.MUON),
                           canary.muon_and_adamw, canary.MUON_TOLERANCE),
              canary.Setup("stage 3, Newton-Schulz on a shard", on_a_shard, canary.muon_and_adamw, canary.MUON_TOLERANCE)]
    return [[(r["loss"], r["update_error"], r["flagged"]) for r in canary.run_with_canary(setup, 16)] for setup in setups]


def test_lesson_15s_canary_flags_newton_schulz_on_a_shard_whose_loss_still_falls():
    correct, on_a_shard = launch(_canary_runs, 2, timeout=90)[0]
    assert not any(flagged for _, _, flagged in correct), correct
    assert all(flagged for _, _, flagged in on_a_shard), on_a_shard
    for run in (correct, on_a_shard):  # each batch is another draw: the loss falls on average over 8 steps
        losses = [loss for loss, _, _ in run]
        assert sum(losses[8:]) < sum(losses[:8]), losses


def test_ns_work_balances_newton_schulz_not_elements():
    spans = [(50, 5, (6, 6)), (40, 0, (1, 40)), (25, 0, (5, 5))]
    plans = plan_matrices(spans, 2)
    assert [p.owner for p in plans] == [0, 1, 1] != assign_owners([36, 40, 25], 2)
    assert [p.sizes for p in plans] == [(20, 16), (20, 20), (13, 12)]
    assert exchange_rounds(plans, 2) == [[0, 1], [None, 2]]


SOLUTION_STEP = "        grad = reduce_scatter_mean(self.flat_grad)  # my shard of the mean gradient\n"
GATHER_NS = ('            ortho = newton_schulz(whole[offset:offset + p.numel()].view_as(p), g["ns_coefficients"], g["ns_steps"],\n'
             '                                  g["eps"])\n')
OWN_NS = '            ortho = newton_schulz(direction, g["ns_coefficients"], g["ns_steps"], g["eps"])\n'
OWN_ALL_GATHER = "        all_gather_params(self.flat_param, self.flat_param[start:start + segment])  # from their owners to all\n"
LPT = ("    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):\n"
       "        owners[i] = min(range(world_size), key=lambda rank: loads[rank])\n")
ROUND_ROBIN = "    for i in range(len(numels)):\n        owners[i] = i % world_size\n"
MUTANTS = {  # name: (text of the reference, the mistake, the graded cell that must fail)
    # exercise 1: what must round as torch's does
    "no normalisation before Newton-Schulz": (
        "    x = x / x.norm().clamp(min=eps)", "    x = x", "ns_like_torch"),
    "the norm not clamped (the zero matrix gives NaN)": (
        "    x = x / x.norm().clamp(min=eps)", "    x = x / x.norm()", "ns_like_torch"),
    "the norm of the fp32 matrix, not of the bf16 one": (
        "    x = x / x.norm().clamp(min=eps)", "    x = x / matrix.float().norm().clamp(min=eps)", "ns_like_torch"),
    "Newton-Schulz in fp32": ("    x = matrix.bfloat16()", "    x = matrix.float()", "ns_like_torch"),
    "a tall matrix not transposed (the large Gram matrix)": (
        "    tall = matrix.size(0) > matrix.size(1)", "    tall = False", "ns_like_torch"),
    "a separate product for each term (more roundings)": (
        "        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)",
        "        x = a * x + b * gram @ x + c * gram @ (gram @ x)", "ns_like_torch"),
    # exercise 2
    "Nesterov direction from the old buffer (plain momentum)": (
        "    return grad.lerp(buffer, momentum) if nesterov else buffer\n", "    return buffer\n", "muon_like_torch"),
    "momentum as a multiply and an add (two roundings)": (
        "    buffer.lerp_(grad, 1 - momentum)", "    buffer.mul_(momentum).add_(grad, alpha=1 - momentum)",
        "muon_like_torch"),
    "weight decay applied twice": (
        "    param.mul_(1 - lr * weight_decay)\n",
        "    param.mul_(1 - lr * weight_decay)\n    param.mul_(1 - lr * weight_decay)\n", "muon_like_torch"),
    "weight decay with the adjusted lr": (
        "    param.mul_(1 - lr * weight_decay)\n",
        "    param.mul_(1 - adjust_lr(lr, adjust_lr_fn, shape) * weight_decay)\n", "muon_like_torch"),
    "the original lr rule without max(1, rows / columns)": (
        "        return lr * math.sqrt(max(1, rows / columns))", "        return lr * math.sqrt(rows / columns)",
        "muon_like_torch"),
    "match_rms_adamw with the shorter side": (
        "        return lr * 0.2 * math.sqrt(max(rows, columns))", "        return lr * 0.2 * math.sqrt(min(rows, columns))",
        "muon_like_torch"),
    # exercise 3
    "the embeddings given to Muon": (
        "            whole_matrix = p.ndim == 2 and id(p) not in embeddings | heads",
        "            whole_matrix = p.ndim == 2", "split_params"),
    "frozen parameters kept": ("        if p.requires_grad:\n", "        if True:\n", "split_params"),
    # exercise 4
    "Newton-Schulz on my shard of the direction, not the gathered matrix": (
        "        dist.all_gather_single(whole, direction)  # every matrix's direction, whole, on every rank\n",
        "        whole.zero_()[start:start + direction.numel()] = direction\n", "gather_matches_muon"),
    "the mean gradient gathered, not the momentum direction": (
        "        dist.all_gather_single(whole, direction)", "        dist.all_gather_single(whole, grad)",
        "gather_matches_muon"),
    "gradients summed, not averaged (gather)": (
        SOLUTION_STEP, "        grad = reduce_scatter_mean(self.flat_grad) * self.world_size\n", "gather_matches_muon"),
    "the parameters not all-gathered after the update (gather)": (
        "        all_gather_params(self.flat_param, self.master)  # everybody's updated shard\n", "", "gather_matches_muon"),
    "the group's Newton-Schulz settings ignored (gather)": (
        GATHER_NS, "            ortho = newton_schulz(whole[offset:offset + p.numel()].view_as(p))\n",
        "gather_matches_muon"),
    "the lr adjusted for my slice's shape, not the matrix's": (
        "ortho.reshape(-1)[lo - offset:hi - offset], p.shape,", "ortho.reshape(-1)[lo - offset:hi - offset], (hi - lo, 1),",
        "gather_matches_muon"),
    "pieces() misses a matrix that starts in the shard before mine": (
        "            if lo < hi:  # my shard", "            if first <= offset < last:  # my shard", "gather_matches_muon"),
    # exercise 5
    "ownership that ignores size (round robin)": (LPT, ROUND_ROBIN, "assign_owners"),
    "the smallest matrices first": (
        "key=lambda i: -numels[i]):", "key=lambda i: numels[i]):", "assign_owners"),
    "ties to the higher rank": (
        "        owners[i] = min(range(world_size), key=lambda rank: loads[rank])",
        "        owners[i] = min(reversed(range(world_size)), key=lambda rank: loads[rank])", "assign_owners"),
    "offsets one after another, ignoring the segments": (
        "        free = [rank * self.segment_numel for rank in range(self.world_size)]", "        free = [0] * self.world_size",
        "assign_owners"),
    # exercise 6
    "the updated matrices not all-gathered from their owners": (OWN_ALL_GATHER, "", "own_matches_muon"),
    "gradients summed, not averaged (own)": (
        "        grads = reduce_scatter_mean(self.flat_grad)  # segment r",
        "        grads = reduce_scatter_mean(self.flat_grad) * self.world_size  # segment r", "own_matches_muon"),
    "the group's Newton-Schulz settings ignored (own)": (
        OWN_NS, "            ortho = newton_schulz(direction)\n", "own_matches_muon"),
    # exercise 7
    "gather's bytes without the all-gather of the direction": (
        "        return 3 * (world_size - 1) * (padded // world_size) * element_size\n",
        "        return 2 * (world_size - 1) * (padded // world_size) * element_size\n", "bytes_and_flops"),
    "own's bytes as if the loads were equal": (
        "    return 2 * (world_size - 1) * layout.segment_numel * element_size",
        "    return 2 * (world_size - 1) * -(-sum(numels) // world_size) * element_size", "bytes_and_flops"),
    "gather's FLOPs only for the matrices that start in a shard": (
        "                if max(lo, layout.shard(rank)[0]) < min(lo + n, layout.shard(rank)[1])) for rank in range(world_size)]",
        "                if layout.shard(rank)[0] <= lo < layout.shard(rank)[1]) for rank in range(world_size)]",
        "bytes_and_flops"),
    # exercise 8
    "owners that balance elements, not Newton-Schulz work": (
        "    owners = assign_owners([ns_work(shape) for _, _, shape in spans], world_size)",
        "    owners = assign_owners([math.prod(shape) for _, _, shape in spans], world_size)", "plan_matrices"),
    "sizes as if every matrix began its unit": (
        "        layout, end = ShardLayout(unit_numel, world_size), offset + math.prod(shape)",
        "        layout, end, offset = ShardLayout(unit_numel, world_size), math.prod(shape), 0", "plan_matrices"),
    "the matrix cut into its own N shards, not its unit's": (
        "        layout, end = ShardLayout(unit_numel, world_size), offset + math.prod(shape)",
        "        layout, end, offset = ShardLayout(math.prod(shape), world_size), math.prod(shape), 0", "plan_matrices"),
    "a round per matrix": (
        "    return [[mine[k] if k < len(mine) else None for mine in owned] for k in range(max(map(len, owned)))]",
        "    return [[i if plan.owner == rank else None for rank in range(world_size)] for i, plan in enumerate(plans)]",
        "plan_matrices"),
    # exercise 9
    "the gradient orthogonalised, not the momentum's direction": (
        '            directions = [momentum_direction_(self.grads[i], self.momentum(i), g["momentum"], g["nesterov"])\n',
        "            directions = [self.grads[i]\n", "zero3_matches_muon"),
    "the updates never sent back": (
        "            dist.all_to_all_single(updates, ortho, out_sizes, in_sizes)", "            updates.zero_()",
        "zero3_matches_muon"),
    "the offset of a matrix in its unit counted in parameters, not elements": (
        "            spans.append((unit.layout.numel, sum(s.numel() for s in unit.shapes[:index]), tuple(unit.shapes[index])))",
        "            spans.append((unit.layout.numel, index, tuple(unit.shapes[index])))", "zero3_matches_muon"),
    # exercise 10
    "Newton-Schulz loads counted in elements": (
        "        loads[plan.owner] += ns_work(plan.shape)", "        loads[plan.owner] += math.prod(plan.shape)",
        "exchange_bytes"),
    "in flight without the matrix coming in": (
        "            peak[rank] = max(peak[rank], pieces + (math.prod(plans[mine].shape) if mine is not None else 0))",
        "            peak[rank] = max(peak[rank], pieces)", "exchange_bytes"),
    "the updates counted in fp32": (
        "            back = math.prod(plans[round_[rank]].shape) * 2 if", "            back = math.prod(plans[round_[rank]].shape) * 4 if",
        "exchange_bytes"),
    "an all-to-all charged its whole input": (
        "            sent[rank] += Fraction(world_size - 1, world_size) * (out + back)", "            sent[rank] += out + back",
        "exchange_bytes"),
    "a rank's pieces of its own matrices counted as leaving": (
        "            if rank != plan.owner:\n                sent[rank] += size * 4", "            if True:\n                sent[rank] += size * 4",
        "exchange_bytes"),
    "the updates sent back not counted as leaving": ("                sent[plan.owner] += size * 2\n", "", "exchange_bytes"),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_typical_mistakes_fail_their_graded_cell(mutant):
    assert_mutant_fails(LESSON, *MUTANTS[mutant])


def _failure(test_id, old, new):
    """The message of the graded cell `test_id` with one mistake in the reference."""
    namespace, source = graded_cell_with(LESSON, test_id, old, new)
    with pytest.raises(AssertionError) as failed:
        exec(compile(source, test_id, "exec"), namespace)
    return str(failed.value)


@pytest.mark.parametrize("old, new, test_id, says", [
    (OWN_ALL_GATHER, "", "own_matches_muon",
     "2 ranks, defaults, after 3 steps, rank 0, matrix 0 (6, 4): all its elements still hold their starting values: "
     "rank 1 updates them (it owns the matrix) and rank 0 never received them from it"),
    ("        all_gather_params(self.flat_param, self.master)  # everybody's updated shard\n", "", "gather_matches_muon",
     "rank 1, matrix 0 (6, 4): all its elements still hold their starting values: rank 0 updates them (they are in its "
     "shard) and rank 1 never received them from it"),
    (LPT, ROUND_ROBIN, "assign_owners", "That is round robin (matrix i to rank i mod N), which ignores the sizes. The rule "
     "takes the matrices largest first; when matrix 1 (30 elements) comes, the loads are [0, 0], so it goes to rank 0"),
    (LPT, ROUND_ROBIN, "bytes_and_flops", "exercise 5 is the cause"),
    (LPT, ROUND_ROBIN, "own_matches_muon", "exercise 5 first"),
    (*MUTANTS["owners that balance elements, not Newton-Schulz work"][:2], "plan_matrices",
     "owners [1, 0, 1], expected [0, 1, 1] (Newton–Schulz work [216, 40, 125], largest first to the least loaded rank); "
     "yours balance the elements, not the work"),
    (*MUTANTS["the updates counted in fp32"][:2], "exchange_bytes", "exchange_bytes gives [178.0, 226.0], expected [142.0, 161.0]"),
    (GATHER_NS, "            ortho = newton_schulz(whole[offset:offset + p.numel()].view_as(p))\n", "gather_matches_muon",
     "equals torch.optim.Muon with the default Newton–Schulz settings, so the group's ns_coefficients, ns_steps and "
     "eps are ignored"),
])
def test_failures_name_their_cause(old, new, test_id, says):
    assert says in _failure(test_id, old, new)


def test_a_failed_test_reports_every_failed_check():
    message = _failure("own_matches_muon", OWN_ALL_GATHER, "")
    assert "rank 1, matrix 2 (7, 7)" in message and "3 ranks" in message and "all_gather 0 call(s)" in message


def test_hidden_tests_are_worth_points(graded):
    assert_reference_full_and_learner_zero(graded, LESSON, 30)
