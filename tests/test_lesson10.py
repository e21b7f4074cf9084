"""Lesson 10, ZeRO-R (lesson 10_infinity, part 2): partitioned activation checkpoints, constant-size buffers,
the allocator model of fragmentation; typical wrong answers fail their graded cells."""

LESSON = "10_infinity"

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from graded_cells import assert_mutant_fails
from zero_lab import launch
from zero_lab.comm_ledger import CommLedger
from zero_lab.zero_r import (FirstFitAllocator, TensorParallelMLP, bucketed_all_reduce, checkpointed, fused_all_reduce,
                             residual_trace, saved_bytes)


def mlp(h, f, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(h, f), nn.GELU(), nn.Linear(f, h))


def run_block(shape, f, partitioned, offload):
    block = TensorParallelMLP(mlp(shape[-1], f))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with CommLedger() as ledger:
        if partitioned:
            out, kept = saved_bytes(checkpointed, block, x, None, "cpu" if offload else None)
        else:
            out, kept = saved_bytes(block, x)
        out.pow(2).sum().backward()
    return out.tolist(), x.grad.tolist(), block.w1.grad.tolist(), block.w2.grad.tolist(), kept, ledger.summary()


@pytest.mark.parametrize("world_size, shape, f, offload", [(2, (2, 3, 5), 8, False), (3, (2, 3, 5), 7, True)])
def test_partitioned_checkpoint_matches_the_single_process_mlp(world_size, shape, f, offload):
    reference = mlp(shape[-1], f)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = reference(x)
    out.pow(2).sum().backward()
    per_rank = -(-x.numel() // world_size)
    plain = launch(run_block, world_size, shape, f, False, False, timeout=60)
    for rank, (got, x_grad, w1, w2, kept, ledger) in enumerate(launch(run_block, world_size, shape, f, True, offload,
                                                                      timeout=60)):
        torch.testing.assert_close(torch.tensor(got), out.detach(), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(plain[rank][0]), out.detach(), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(plain[rank][1]), x.grad, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(x_grad), x.grad, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(w1), reference[0].weight.grad.tensor_split(world_size, 0)[rank])
        torch.testing.assert_close(torch.tensor(w2), reference[2].weight.grad.tensor_split(world_size, 1)[rank])
        assert kept == per_rank * 4  # 1/Nm of the checkpoint, padded
        assert ledger["all_gather"] == {"calls": 1, "elements": per_rank * world_size,
                                        "bytes": per_rank * world_size * 4,
                                        "sent_bytes": (world_size - 1) / world_size * per_rank * world_size * 4}
        # forward + recomputed forward + input-gradient all-reduces; the unpartitioned block has two
        assert ledger["all_reduce"]["calls"] == 3 and plain[rank][5]["all_reduce"]["calls"] == 2
        assert plain[rank][4] > kept * world_size  # the block's own activations: far more than a checkpoint


def bucket_vs_fused(width, bucket_numel):
    model = mlp(width, 3 * width)
    model(torch.randn(4, width, generator=torch.Generator().manual_seed(dist.get_rank()))).sum().backward()
    local = [p.grad.clone() for p in model.parameters()]
    fused_bytes = fused_all_reduce(model.parameters())
    fused = [p.grad.clone() for p in model.parameters()]
    for p, grad in zip(model.parameters(), local):
        p.grad = grad
    with CommLedger() as ledger:
        bucket_bytes = bucketed_all_reduce(model.parameters(), bucket_numel)
    return fused_bytes, bucket_bytes, all(torch.equal(a, p.grad) for a, p in zip(fused, model.parameters())), \
        ledger.summary()["all_reduce"]


@pytest.mark.parametrize("width", [4, 9])
def test_constant_bucket_averages_like_the_fused_buffer(width):
    psi = 2 * 3 * width * width + 4 * width
    for fused_bytes, bucket_bytes, same, all_reduce in launch(bucket_vs_fused, 2, width, 37, timeout=60):
        assert (fused_bytes, bucket_bytes, same) == (psi * 4, 37 * 4, True)
        assert all_reduce["elements"] == psi and all_reduce["calls"] == -(-psi // 37)  # pieces of big gradients too


def test_fragmentation_fails_a_request_the_arena_fits():
    plain, _ = residual_trace(58, 4)
    assert plain.free_bytes() == 26 and plain.largest_hole() < 16 and plain.allocate(16) is None
    packed, arena = residual_trace(58, 4, use_arena=True)
    assert packed.free_bytes() == 26 and packed.largest_hole() == 26 and packed.allocate(16) == arena.size
    with pytest.raises(MemoryError, match="reserve more"):
        arena.allocate(1)


def test_allocator_refuses_bad_input_with_the_fix():
    allocator = FirstFitAllocator(8)
    with pytest.raises(ValueError, match="positive"):
        allocator.allocate(0)
    start = allocator.allocate(3)
    allocator.free(start)
    with pytest.raises(ValueError, match="once"):
        allocator.free(start)
    assert allocator.holes == [(0, 8)]


# Typical wrong answers: each must fail the graded cell named with it (points lost = that cell's points).
MUTANTS = {
    "no padding": ("    per_rank = -(-x.numel() // world_size)\n", "    per_rank = x.numel() // world_size\n",
                   "zero_r_partition_gather"),
    "the slice is a view of the padded buffer": (
        "    return padded[rank * per_rank:(rank + 1) * per_rank].clone()\n",
        "    return padded[rank * per_rank:(rank + 1) * per_rank]\n", "zero_r_partition_gather"),
    "gathered slices in reverse rank order": (
        "    return gathered[:math.prod(shape)].view(shape)\n",
        "    return gathered.view(-1, shard.numel()).flip(0).reshape(-1)[:math.prod(shape)].view(shape)\n",
        "zero_r_partition_gather"),
    "padding not dropped after the gather": ("    return gathered[:math.prod(shape)].view(shape)\n",
                                             "    return gathered[-math.prod(shape):].view(shape)\n",
                                             "zero_r_partition_gather"),
    "the whole input kept (no partition)": (
        "        shard = partition_checkpoint(x, dist.get_rank(group), dist.get_world_size(group))\n",
        "        shard = partition_checkpoint(x, 0, 1)\n", "zero_r_checkpoint"),
    "parameter gradients never computed": (
        "        torch.autograd.backward(out, grad_out)\n        return x.grad, None, None, None\n",
        "        return torch.autograd.grad(out, x, grad_out)[0], None, None, None\n", "zero_r_checkpoint"),
    "recomputed without enable_grad": ("        with torch.enable_grad():\n            out = ctx.block(x)\n",
                                       "        out = ctx.block(x)\n", "zero_r_checkpoint"),
    "the last, partly filled bucket never reduced": ("    if fill:\n        flush()\n", "", "zero_r_bucketed"),
    "sums, not averages": ("        bucket[:fill] /= dist.get_world_size(group)\n", "", "zero_r_bucketed"),
    "one all-reduce per piece (no fusing)": ("            if fill == bucket_numel:\n", "            if True:\n",
                                             "zero_r_bucketed"),
    "best fit instead of first fit": (
        "        for index, (start, hole) in enumerate(self.holes):\n",
        "        for index, (start, hole) in sorted(enumerate(self.holes), key=lambda item: item[1][1]):\n",
        "zero_r_first_fit"),
    "no merging on free": ("            if merged and merged[-1][0] + merged[-1][1] == hole_start:\n",
                           "            if False:\n", "zero_r_first_fit"),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_typical_mistakes_fail_their_graded_cell(mutant):
    assert_mutant_fails(LESSON, *MUTANTS[mutant])


def test_hidden_tests_are_worth_points(graded):
    report = graded(LESSON, "solution")
    assert report.total == (14, 14), report.scores
    learner = graded(LESSON, "learner")
    assert all(s.earned == 0 and s.reason for s in learner.scores), learner.scores


def train_two_blocks(steps, partitioned):
    """Two residual MLP blocks, each checkpointed with P_a (or one process, unpartitioned), SGD for a few steps."""
    reference = [mlp(6, 10, seed=0), mlp(6, 10, seed=1)]
    blocks = [TensorParallelMLP(m) for m in reference] if partitioned else reference
    params = [p for block in blocks for p in block.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    for step in range(steps):
        x = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(step), requires_grad=True)
        for block in blocks:
            x = x + (checkpointed(block, x) if partitioned else block(x))
        x.pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("world_size", [2, 3])
def test_checkpointed_blocks_train_like_one_process(world_size):
    expected = train_two_blocks(3, False)
    for rank, params in enumerate(launch(train_two_blocks, world_size, 3, True, timeout=60)):
        for got, want, dim in zip(params, expected, [0, 0, 1, None] * 2):  # w1, b1, w2 sliced; b2 whole
            torch.testing.assert_close(got, want if dim is None else want.tensor_split(world_size, dim)[rank],
                                       atol=1e-5, rtol=1e-4)
