"""Lesson 05, ZeRO stage 3: parameters sharded, gathered unit by unit, 3 Psi per step, 16 Psi / Nd."""

import io
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from graded_cells import graded_cell_with
from sharded_training import (SIZES, TINY_GPT, assert_close, gpt_batches, gpt_groups, gpt_groups_noise, gpt_loss,
                              gpt_with_groups_single_process, mlp_batches, train, weights)
from zero_lab import CommLedger, RankFailed, launch
from zero_lab.data import shard_batch, token_batches
from zero_lab.memory_ledger import model_state_bytes
from zero_lab.models import GPT, MLP
from zero_lab.prepare import prepare
from zero_lab.train import train as train_gpt
from zero_lab.zero1 import ShardLayout
from zero_lab.zero3 import init_model, meta_parameters, seeded_init

ADAMW = dict(lr=1e-2, weight_decay=0.1)


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return x * self.weight


class Corners(nn.Module):
    """Every corner case in one small model: a Linear called twice, a one-element unit (fewer
    elements than ranks), a frozen Linear, a head tied to the twice-called weight, uneven units."""

    def __init__(self, seed=0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.first, self.twice = nn.Linear(6, 9), nn.Linear(9, 9)
            self.scale = Scale()
            self.frozen = nn.Linear(9, 9).requires_grad_(False)
            self.tied = nn.Linear(9, 9, bias=False)
            self.tied.weight = self.twice.weight
            self.last = nn.Linear(9, 5)

    def forward(self, x):
        x = torch.tanh(self.twice(torch.tanh(self.first(x))))
        x = torch.tanh(self.twice(self.scale(x)))
        return self.last(self.frozen(x) + self.tied(x))


def corners_loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)


def single_process(max_grad_norm=None):
    model = Corners()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **ADAMW)
    for batch in mlp_batches():
        corners_loss(model, batch).backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
    return weights(model)


def _train_corners(variants):
    """Runs on every rank: one fresh model per variant of prepare's options; their weights."""
    results = []
    for options in variants:
        options = dict(options)
        micro_steps = options.pop("micro_steps", 1)
        model, optimizer = prepare(Corners(), torch.optim.AdamW, stage=3, **ADAMW, **options)
        train(model, optimizer, mlp_batches(), corners_loss, micro_steps)
        with optimizer.gathered_parameters():
            results.append((weights(model), model.tied.weight is model.twice.weight))
    return results


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_matches_single_process_adamw(world_size):
    variants = [dict(prefetch=0), dict(prefetch=1), dict(prefetch=2, max_live_numel=100),
                dict(micro_steps=3 if world_size < 4 else 1, prefetch=1, reshard_last=False)]
    expected = single_process()
    for rank_results in launch(_train_corners, world_size, variants, timeout=60):
        for variant, (got, tied) in zip(variants, rank_results):
            assert tied, "the tied weight must stay one tensor"
            assert_close([got], expected, atol=1e-5, rtol=1e-5)  # Adam scales rounding noise up to lr
            assert torch.equal(got["frozen.weight"], weights(Corners())["frozen.weight"]), variant


def test_clipping_and_prefetch_depths_are_bit_identical():
    expected = single_process(max_grad_norm=0.5)
    results = launch(_train_corners, 3, [dict(prefetch=d, max_grad_norm=0.5) for d in (0, 1, 2)], timeout=60)
    for rank_results in results:
        assert_close([w for w, _ in rank_results], expected, atol=1e-5, rtol=1e-5)  # as above
        for w, _ in rank_results[1:]:
            assert all(torch.equal(w[k], rank_results[0][0][k]) for k in w), "prefetch changes nothing but timing"


def test_param_groups_frozen_and_tied_gpt():
    expected, frozen_before = gpt_with_groups_single_process()

    def run():
        model = GPT(TINY_GPT, seed=0)
        model, optimizer = prepare(model, torch.optim.AdamW, stage=3, params=gpt_groups(model), lr=1e-2)
        train(model, optimizer, gpt_batches(), gpt_loss)
        with optimizer.gathered_parameters():
            return weights(model), model.lm_head.weight is model.transformer.wte.weight

    for w, tied in launch(run, 3, timeout=60):
        assert tied
        assert_close([w], expected, noise=gpt_groups_noise())  # the key biases within AdamW's drift: see test_lesson03
        assert torch.equal(w["transformer.wpe.weight"], frozen_before)


def _train_with_checkpoint(stop_after):
    batches = mlp_batches()

    def fresh(seed):
        return prepare(Corners(seed), torch.optim.AdamW, stage=3, param_dtype=torch.bfloat16, max_grad_norm=1.0, **ADAMW)

    model, optimizer = fresh(0)
    train(model, optimizer, batches[:stop_after], corners_loss)
    if stop_after < len(batches):
        buffer = io.BytesIO()
        torch.save(optimizer.state_dict(), buffer)  # the whole checkpoint of a rank
        model, optimizer = fresh(123)  # other weights: everything must come from the checkpoint
        buffer.seek(0)
        optimizer.load_state_dict(torch.load(buffer))
        train(model, optimizer, batches[stop_after:], corners_loss)
    with optimizer.gathered_parameters():
        return weights(model), [unit.master.clone() for unit in optimizer.units], optimizer.consolidated_state_dict(dst=0)


def test_bf16_resume_is_bit_identical_and_consolidates():
    straight = launch(_train_with_checkpoint, 3, 10, timeout=60)
    resumed = launch(_train_with_checkpoint, 3, 4, timeout=60)
    for (w_a, m_a, _), (w_b, m_b, _) in zip(straight, resumed):
        assert all(torch.equal(w_a[k], w_b[k]) for k in w_a)
        assert all(torch.equal(a, b) for a, b in zip(m_a, m_b)), "fp32 masters differ after resuming"
    full = resumed[0][2]
    assert all(r[2] is None for r in resumed[1:])
    model = Corners()
    model.load_state_dict(full["model"])  # an ordinary state dict: no padding, every name
    assert full["model"]["tied.weight"] is full["model"]["twice.weight"], "tied names share one tensor"
    assert torch.equal(full["model"]["frozen.weight"], Corners().frozen.weight)
    torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **ADAMW).load_state_dict(full["optimizer"])


def _bytes_per_step(sizes, options):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer = prepare(MLP(sizes, seed=0), torch.optim.AdamW, stage=3, lr=1e-3, **options)
    x = torch.randn(4 * world_size, sizes[0])
    for _ in range(2):  # the second step is measured: the order is recorded (and checked) in the first
        with CommLedger() as ledger:
            model(shard_batch(x, rank, world_size)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    return ledger.summary(), len(optimizer.units)


@pytest.mark.parametrize("world_size", [2, 4])
def test_communication_is_three_psi(world_size):
    sizes = [4, 8, 4]  # two units of 40 and 36 elements: no padding on 2 or 4 ranks
    psi = MLP(sizes).num_params()
    ring = Fraction(world_size - 1, world_size) * 4 * psi  # one collective over psi fp32 elements
    for options, gathers in [({}, 4), ({"prefetch": 2}, 4), ({"reshard_last": False}, 3)]:
        summary, units = launch(_bytes_per_step, world_size, sizes, options, timeout=60)[0]
        assert set(summary) == {"all_gather", "reduce_scatter"}
        assert summary["all_gather"]["calls"] == gathers and summary["reduce_scatter"]["calls"] == units == 2
        if not options:  # forward all-gather + backward all-gather + reduce-scatter
            assert summary["all_gather"]["sent_bytes"] == 2 * ring and summary["reduce_scatter"]["sent_bytes"] == ring


def _memory():
    model = GPT(TINY_GPT, seed=0)
    model, optimizer = prepare(model, torch.optim.AdamW, stage=3, param_dtype=torch.bfloat16, lr=1e-3)
    batch = shard_batch(gpt_batches(1)[0], dist.get_rank(), dist.get_world_size())
    gpt_loss(model, batch).backward()
    optimizer.step()
    return model_state_bytes(model, optimizer).bytes, sum(u.layout.padded_numel for u in optimizer.units)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_memory_is_16psi_over_nd(world_size):
    psi = GPT(TINY_GPT).num_params()
    results = launch(_memory, world_size, timeout=60)
    for at_rest, padded in results:
        shard = padded // world_size  # padded: every unit rounded up to a multiple of Nd
        assert padded - psi < 16 * world_size, "fewer than Nd elements of padding in each of the 16 units"
        assert {k: at_rest[k] for k in ("parameters", "gradients", "master_params")} == \
            {"parameters": 2 * shard, "gradients": 2 * shard, "master_params": 4 * shard}, "nothing gathered at rest"
        assert 16 * psi / world_size - 8 * (padded - psi) <= sum(at_rest.values()) <= 16 * shard
    assert sum(at_rest["optimizer_states"] for at_rest, _ in results) == 8 * psi, "Adam states for real elements only"


def _gathered_peak(depth):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer = prepare(MLP([32] * 9, seed=0), torch.optim.AdamW, stage=3, prefetch=depth, lr=1e-3)
    x = shard_batch(torch.randn(12, 32, generator=torch.Generator().manual_seed(0)), rank, world_size)
    peaks = []
    for _ in range(2):
        optimizer.trace = []
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        peaks.append(max(numel for *_, numel in optimizer.trace))
    return peaks, max(u.flat.numel() for u in optimizer.units)


def test_gathered_peak_is_bounded_by_the_prefetch_depth():
    for depth in (0, 1, 2):
        for (first, steady), largest in launch(_gathered_peak, 2, depth, timeout=60):
            assert first == largest, "nothing is prefetched before the order is known"
            assert steady == (depth + 1) * largest


def _divergent(skip_rank, skip_step):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer = prepare(MLP([6, 8, 8, 4], seed=0), torch.optim.AdamW, stage=3, lr=1e-3)
    x = shard_batch(torch.randn(6, 6), rank, world_size)
    for step in range(3):
        layers = list(model.layers)
        if step == skip_step and rank == skip_rank:  # this rank takes another branch: skips layers.2 (8 -> 8)
            layers = layers[:2] + layers[3:]
        h = x
        for layer in layers:
            h = layer(h)
        h.pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("skip_step", [0, 2])  # while the order is recorded, and after
def test_divergent_control_flow_names_the_rank_and_the_unit(skip_step):
    with pytest.raises(RankFailed) as failure:  # the rank's error, not the watchdog's RanksHung after 30 s
        launch(_divergent, 3, 1, skip_step, timeout=30)
    message = str(failure.value)
    assert "rank 1" in message and "'layers.4'" in message and "'layers.2'" in message


def gpt_like_init(name, tensor, generator):
    tensor.normal_(0.0, 0.02, generator=generator) if name.endswith("weight") else tensor.zero_()


def _meta_init(seed):
    with meta_parameters():
        model = GPT(TINY_GPT)
    assert all(p.is_meta for p in model.parameters()), "no weight was made before sharding"
    model, optimizer = prepare(model, torch.optim.AdamW, stage=3, init_fn=seeded_init(gpt_like_init, seed), lr=1e-3)
    with optimizer.gathered_parameters():
        return weights(model), model.lm_head.weight is model.transformer.wte.weight


def test_meta_device_construction_matches_one_process():
    results = launch(_meta_init, 3, 7, timeout=60)
    expected = weights(init_model(GPT(TINY_GPT), seeded_init(gpt_like_init, 7)))
    assert_close([w for w, _ in results], expected, atol=0, rtol=0)
    assert all(tied for _, tied in results)


def _gathered_parameters_edit():
    model, optimizer = prepare(MLP(SIZES, seed=0), torch.optim.AdamW, stage=3, lr=1e-3)
    first = model.layers[0]
    with optimizer.gathered_parameters([first.bias], modifier_rank=1):
        if dist.get_rank() == 1:
            first.bias.data.fill_(0.5)  # only rank 1 changes it; every rank keeps the change
    with optimizer.gathered_parameters():
        return weights(model)


def test_gathered_parameters_keeps_what_the_modifier_rank_wrote():
    for w in launch(_gathered_parameters_edit, 3, timeout=60):
        assert torch.equal(w["layers.0.bias"], torch.full((9,), 0.5))
        assert torch.equal(w["layers.2.weight"], weights(MLP(SIZES, seed=0))["layers.2.weight"])


def test_training_script_stage_3_matches_ddp():
    curves = {stage: launch(train_gpt, 2, stage, 4, 12, 3e-3, timeout=60)[0] for stage in (0, 3)}
    assert curves[3] == pytest.approx(curves[0], rel=1e-5)


def _drop_in(steps=6):
    """A scheduler, torch's clip_grad_norm_, and preparing the same model again (a re-run cell)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = Corners()
    for _ in range(2):  # the second prepare must start from whole, unsharded parameters
        model, optimizer = prepare(model, torch.optim.AdamW, stage=3, **ADAMW)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        for batch in mlp_batches(steps):
            corners_loss(model, shard_batch(batch, rank, world_size)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    with optimizer.gathered_parameters():
        return weights(model)


def test_schedulers_torch_clipping_and_preparing_again():
    model = Corners()
    expected = None
    for _ in range(2):  # the same two rounds in one process
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **ADAMW)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        for batch in mlp_batches(6):
            corners_loss(model, batch).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        expected = weights(model)
    assert_close(launch(_drop_in, 3, timeout=60), expected, atol=1e-5, rtol=1e-5)  # Adam scales rounding noise up to lr


# Typical wrong answers to exercises 3 and 6 lose points: the notebook's definitions with one
# solution line changed, then the graded cell run as nbgrader runs it (whole-notebook grading
# is test_grading.py's job).

ADDED = "    grad_shard += received.div_(dist.get_world_size(group))"
MUTANTS = {
    "overwrites the gradient shard": ("reduce_scatter", ADDED, "    grad_shard.copy_(received.div_(dist.get_world_size(group)))"),
    "the sum, not the mean": ("reduce_scatter", ADDED, "    grad_shard += received"),
    "keeps the full-size .grad": ("reduce_scatter", "    for p in unit.params:\n        p.grad = None\n", ""),
    "no padding": ("reduce_scatter", "torch.cat([*pieces, padding])", "torch.cat(pieces)"),
    "all-reduce and slice": ("reduce_scatter", "    dist.reduce_scatter_single(received, flat_grad, group=group)",
                             "    dist.all_reduce(flat_grad, group=group)\n"
                             "    received.copy_(flat_grad.chunk(dist.get_world_size(group))[dist.get_rank(group)])"),
    "steps parameters without a gradient": ("zero3_step", "if piece.param in unit.had_grad:", "if True:"),
    "shard not refreshed": ("zero3_step", "unit.shard.copy_(unit.master)  # the compute-dtype", "pass  #"),
}



@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_typical_wrong_answers_lose_points(mutant):
    test_id, old, new = MUTANTS[mutant]
    namespace, cell = graded_cell_with("05_zero3", test_id, old, old)
    exec(cell, namespace)  # the reference passes this harness
    namespace, cell = graded_cell_with("05_zero3", test_id, old, new)
    with pytest.raises(Exception):  # any failure of the cell loses its points (a missing ledger entry: KeyError)
        exec(cell, namespace)
