"""Lesson 14, ZeRO-R: partitioned activation checkpoints (P_a) equal the single-process MLP at Nm = 2 and 3, a
constant-size bucket (C_B) averages like the fused buffer with its bytes flat in Ψ, a contiguous buffer (M_D)
fits the request that fragmentation refuses; typical wrong answers fail their graded cells."""

LESSON = "14_zero_r"

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from graded_cells import assert_mutant_fails, assert_reference_full_and_learner_zero, graded_cell_with
from zero_lab import launch
from zero_lab.comm_ledger import CommLedger
from zero_lab.zero_r import (ContiguousBuffer, FirstFitAllocator, TensorParallelMLP, bucketed_all_reduce, bytes_during,
                             checkpointed, fused_all_reduce, keep_gradients_contiguous, residual_trace, saved_bytes)


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
        # the tensor-parallel halves add their partial products in another order than one matmul: a few ulps
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
            # partial sums over the tensor-parallel ranks in another order, through 3 SGD steps: a few ulps each
            torch.testing.assert_close(got, want if dim is None else want.tensor_split(world_size, dim)[rank],
                                       atol=1e-5, rtol=1e-4)


def bucket_vs_fused(width, bucket_numel):
    model = mlp(width, 3 * width)
    model(torch.randn(4, width, generator=torch.Generator().manual_seed(dist.get_rank()))).sum().backward()
    local = [p.grad.clone() for p in model.parameters()]
    _, fused_peak, _ = bytes_during(fused_all_reduce, model.parameters())
    fused = [p.grad.clone() for p in model.parameters()]
    for p, grad in zip(model.parameters(), local):
        p.grad = grad
    with CommLedger() as ledger:
        _, bucket_peak, bucket_allocated = bytes_during(bucketed_all_reduce, model.parameters(), bucket_numel)
    return fused_peak, bucket_peak, bucket_allocated, all(torch.equal(a, p.grad) for a, p in zip(fused, model.parameters())), \
        ledger.summary()["all_reduce"]


@pytest.mark.parametrize("width", [4, 9])
def test_constant_bucket_averages_like_the_fused_buffer_in_constant_bytes(width):
    psi = 2 * 3 * width * width + 4 * width
    for fused_peak, bucket_peak, bucket_allocated, same, all_reduce in launch(bucket_vs_fused, 2, width, 37, timeout=60):
        assert (fused_peak, bucket_peak, bucket_allocated, same) == (psi * 4, 37 * 4, 37 * 4, True)
        assert all_reduce["elements"] == psi and all_reduce["calls"] == -(-psi // 37)  # pieces of big gradients too


def test_bytes_during_counts_what_a_function_creates_while_it_lives():
    existing = torch.ones(100)

    def make():
        a = torch.empty(10)  # 40 bytes, alive to the end
        b = existing * 2  # 400 bytes, freed before c is made
        del b
        c = torch.empty(20)  # 80 bytes
        existing.add_(1)  # in place: nothing new
        return a, c

    _, peak, allocated = bytes_during(make)
    assert (peak, allocated) == (440, 520)


def test_fragmentation_fails_a_request_the_contiguous_buffer_fits():
    plain, checkpoints, buffer = residual_trace(232, 4)
    assert buffer is None and plain.free_bytes() == 104 and plain.largest_hole() < 64 and plain.allocate(64) is None
    assert len({c.untyped_storage().data_ptr() for c in checkpoints}) == 8  # each its own tensor
    packed, checkpoints, buffer = residual_trace(232, 4, contiguous=True)
    assert packed.free_bytes() == 104 and packed.largest_hole() == 104 and packed.allocate(64) == buffer.flat.nbytes
    assert {c.untyped_storage().data_ptr() for c in checkpoints} == {buffer.flat.untyped_storage().data_ptr()}
    assert [c[0].item() for c in checkpoints] == [layer for layer in range(4) for _ in range(2)]
    with pytest.raises(MemoryError, match="reserve more"):
        buffer.keep(torch.ones(1))


def test_allocator_and_buffer_refuse_bad_input_with_the_fix():
    allocator = FirstFitAllocator(8)
    with pytest.raises(ValueError, match="positive"):
        allocator.allocate(0)
    start = allocator.allocate(3)
    allocator.free(start)
    with pytest.raises(ValueError, match="once"):
        allocator.free(start)
    assert allocator.holes == [(0, 8)]
    allocator.allocate(1)
    with pytest.raises(MemoryError, match="reserve it before"):
        ContiguousBuffer(2, allocator=allocator)  # 8 bytes, 7 left


def test_contiguous_gradients_train_like_plain_gradients():
    def train(contiguous):
        model = mlp(5, 7)
        buffer = ContiguousBuffer(sum(p.numel() for p in model.parameters()))
        if contiguous:
            keep_gradients_contiguous(model.parameters(), buffer)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            model(torch.randn(4, 5, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
            if contiguous:
                assert all(p.grad.untyped_storage().data_ptr() == buffer.flat.untyped_storage().data_ptr()
                           for p in model.parameters())
            optimizer.step()
            optimizer.zero_grad()
            buffer.reset()
        return [p.detach() for p in model.parameters()]

    for got, want in zip(train(True), train(False)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


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
    "the whole input kept on ctx besides its slice": ("        return block(x)\n",
                                                      "        ctx.x = x\n        return block(x)\n", "zero_r_checkpoint"),
    "partitioned over the whole world, not the model-parallel group": (
        "        shard = partition_checkpoint(x, dist.get_rank(group), dist.get_world_size(group))\n",
        "        shard = partition_checkpoint(x, dist.get_rank(), dist.get_world_size())\n", "zero_r_checkpoint"),
    "parameter gradients overwritten, not accumulated": (
        "        torch.autograd.backward(out, grad_out)\n        return x.grad, None, None, None\n",
        "        params = list(ctx.block.parameters())\n"
        "        grads = torch.autograd.grad(out, [x, *params], grad_out)\n"
        "        for p, g in zip(params, grads[1:]):\n            p.grad = g\n"
        "        return grads[0], None, None, None\n", "zero_r_checkpoint"),
    "recomputed without enable_grad": ("        with torch.enable_grad():\n            out = ctx.block(x)\n",
                                       "        out = ctx.block(x)\n", "zero_r_checkpoint"),
    "slices of floor(numel / Nm)": ("    per_rank = -(-x.numel() // world_size)\n", "    per_rank = x.numel() // world_size\n",
                                    "zero_r_partition_gather"),
    "backward hands back the output's gradient as the input's": ("        return x.grad, None, None, None\n",
                                                                 "        return grad_out, None, None, None\n",
                                                                 "zero_r_checkpoint"),
    "a frozen parameter's missing gradient not skipped in the bucket": (
        "    grads = [p.grad.view(-1) for p in params if p.grad is not None]\n",
        "    grads = [p.grad.view(-1) for p in params]\n", "zero_r_bucketed"),
    "fused: sums, not averages": ("    fused /= dist.get_world_size(group)\n", "", "zero_r_bucketed"),
    "fused: one all-reduce per gradient (nothing fused)": (
        "    dist.all_reduce(fused, group=group)\n    fused /= dist.get_world_size(group)\n",
        "    for grad in grads:\n        dist.all_reduce(grad, group=group)\n        grad /= dist.get_world_size(group)\n"
        "    return\n", "zero_r_bucketed"),
    "bucket all-reduced over the whole world, not the group": (
        "        dist.all_reduce(bucket[:fill], group=group)\n", "        dist.all_reduce(bucket[:fill])\n",
        "zero_r_bucketed"),
    "fused all-reduced over the whole world, not the group": (
        "    dist.all_reduce(fused, group=group)\n    fused /= dist.get_world_size(group)\n",
        "    dist.all_reduce(fused)\n    fused /= dist.get_world_size()\n", "zero_r_bucketed"),
    "an fp32 bucket whatever the gradients' dtype": ("    bucket = grads[0].new_empty(bucket_numel)\n",
                                                     "    bucket = torch.empty(bucket_numel)\n", "zero_r_bucketed"),
    "the last, partly filled bucket never reduced": ("    if fill:\n        flush()\n", "", "zero_r_bucketed"),
    "bucket: sums, not averages": ("        bucket[:fill] /= dist.get_world_size(group)\n", "", "zero_r_bucketed"),
    "one all-reduce per piece (no fusing)": ("            if fill == bucket_numel:\n", "            if True:\n",
                                             "zero_r_bucketed"),
    "a bucket as large as the model (grows with Ψ), flushed every bucket_numel": (
        "    bucket = grads[0].new_empty(bucket_numel)\n",
        "    bucket = grads[0].new_empty(sum(g.numel() for g in grads))\n", "zero_r_bucketed"),
    "a new bucket allocated at every flush": ("                flush()\n                fill = 0\n",
                                              "                flush()\n                fill = 0\n"
                                              "                bucket = torch.empty_like(bucket)\n", "zero_r_bucketed"),
    "the average made out of place (a second bucket per flush)": (
        "        bucket[:fill] /= dist.get_world_size(group)\n",
        "        bucket[:fill] = bucket[:fill] / dist.get_world_size(group)\n", "zero_r_bucketed"),
    "each kept tensor its own copy, not a view of the buffer": (
        "        view = self.flat[self.used:self.used + tensor.numel()].view(tensor.shape)\n        view.copy_(tensor)\n",
        "        view = tensor.clone()\n", "zero_r_contiguous_buffer"),
    "the view is the source itself (no copy)": (
        "        view = self.flat[self.used:self.used + tensor.numel()].view(tensor.shape)\n        view.copy_(tensor)\n",
        "        view = tensor\n", "zero_r_contiguous_buffer"),
    "every view at the buffer's start (used never advanced)": ("        self.used += tensor.numel()\n", "",
                                                               "zero_r_contiguous_buffer"),
    "the buffer never reserved in the allocator model": (
        "            self.start = allocator.allocate(self.flat.nbytes, \"contiguous buffer\")\n",
        "            self.start = allocator.holes[0][0]\n", "zero_r_contiguous_buffer"),
    "overflow not checked": ("        if self.used + tensor.numel() > self.flat.numel():\n", "        if False:\n",
                             "zero_r_contiguous_buffer"),
    "the buffer always fp32, whatever dtype is asked": ("        self.flat = torch.empty(numel, dtype=dtype)\n",
                                                         "        self.flat = torch.empty(numel)\n", "zero_r_contiguous_buffer"),
    "a buffer filled exactly refused (off by one)": ("        if self.used + tensor.numel() > self.flat.numel():\n",
                                                     "        if self.used + tensor.numel() >= self.flat.numel():\n",
                                                     "zero_r_contiguous_buffer"),
    "reset does not rewind": ("        self.used = 0\n        ### END SOLUTION\n\n    def address",
                              "        pass\n        ### END SOLUTION\n\n    def address", "zero_r_contiguous_buffer"),
    "reset allocates a fresh buffer every step": (
        "        self.used = 0\n        ### END SOLUTION\n\n    def address",
        "        self.flat = torch.empty_like(self.flat)\n        self.used = 0\n        ### END SOLUTION\n\n    def address",
        "zero_r_contiguous_buffer"),
    "each gradient kept again at every accumulation": (
        "        if param.grad.untyped_storage().data_ptr() != buffer.flat.untyped_storage().data_ptr():\n"
        "            param.grad = buffer.keep(param.grad)\n",
        "        param.grad = buffer.keep(param.grad)\n", "zero_r_contiguous_grads"),
    "the gradient copied in but .grad not replaced": ("            param.grad = buffer.keep(param.grad)\n",
                                                      "            buffer.keep(param.grad)\n", "zero_r_contiguous_grads"),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_typical_mistakes_fail_their_graded_cell(mutant):
    assert_mutant_fails(LESSON, *MUTANTS[mutant])


REVERSED_SLICES = ("    return padded[rank * per_rank:(rank + 1) * per_rank].clone()\n",
                   "    return padded[(world_size - 1 - rank) * per_rank:(world_size - rank) * per_rank].clone()\n")


def test_exercise_2_names_exercise_1_when_exercise_1_is_wrong():
    assert_mutant_fails(LESSON, *REVERSED_SLICES, "zero_r_checkpoint")
    namespace, source = graded_cell_with(LESSON, "zero_r_checkpoint", *REVERSED_SLICES)
    with pytest.raises(AssertionError, match=r"exercise 1\) do not give the input back"):
        exec(compile(source, "zero_r_checkpoint", "exec"), namespace)


def test_a_test_reports_every_failed_check_not_only_the_first():
    namespace, source = graded_cell_with(LESSON, "zero_r_bucketed", "        bucket[:fill] /= dist.get_world_size(group)\n", "")
    with pytest.raises(AssertionError) as failed:
        exec(compile(source, "zero_r_bucketed", "exec"), namespace)
    message = str(failed.value)
    assert "rank 0 " in message and "rank 1 " in message and message.count("\n- ") > 2, message


def test_hidden_tests_are_worth_points(graded):
    assert_reference_full_and_learner_zero(graded, LESSON, 17)
