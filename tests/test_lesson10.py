"""Lesson 10: ZeRO-Infinity: the simulated NVMe tier, AdamW streamed from it, memory-centric tiling;
typical wrong answers fail their graded cells."""

LESSON = "10_infinity"

import errno
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from graded_cells import assert_mutant_fails, assert_reference_full_and_learner_zero
from zero_lab import launch
from zero_lab.infinity import put_states, tier_adamw_step
from zero_lab.nvme_tier import NvmeTier, TokenBucket
from zero_lab.tiled_linear import TiledLinear


SUBMIT_NEXT = ("            if prefetch and i + prefetch < len(chunks):\n"
               "                pending.append(reader.submit(fetch, chunks[i + prefetch]))\n")
UPDATE_CHUNK = ("            name, grad, start, numel = chunk\n"
                "            cpu_adam_(master, grad[start:start + numel], exp_avg, exp_avg_sq, step, lr=lr, betas=betas, eps=eps,\n"
                "                      weight_decay=weight_decay)\n"
                "            for state, value in zip(STATES, (master, exp_avg, exp_avg_sq)):\n"
                "                tier.write(f\"{name}.{state}\", value, start)\n")

PUT_SLICE = "    tier.write(name, flat[rank * shard:(rank + 1) * shard])\n"
PARTITIONED_BETWEEN = (
    "    ### END SOLUTION\n\n\n"
    "def read_partitioned(tier: NvmeTier, name: str, shape, group=None) -> torch.Tensor:\n"
    '    """The whole parameter of `shape`: this rank reads only its slice from its own tier, then one all-gather."""\n'
    "    ### BEGIN SOLUTION\n")
READ_SLICE_AND_GATHER = ("    shard = tier.read(name)\n    whole = torch.empty(dist.get_world_size(group) * shard.numel())\n"
                         "    dist.all_gather_single(whole, shard, group=group)\n"
                         "    return whole[:math.prod(shape)].view(shape)\n")

# Typical wrong answers: each must fail the graded cell named with it (points lost = that cell's points).
MUTANTS = {
    "charge never sleeps": ("        self.sleep(wait)\n", "", "inf_token_bucket"),
    "charge sleeps with time.sleep, not the bucket's sleep": ("self.sleep(wait)", "time.sleep(wait)", "inf_token_bucket"),
    "charge reads time.perf_counter, not the bucket's clock": ("now = self.clock()", "now = time.perf_counter()",
                                                              "inf_token_bucket"),
    "charge sleeps while it holds the lock": ("            wait = self.free_at - now\n        self.sleep(wait)\n",
                                              "            wait = self.free_at - now\n            self.sleep(wait)\n",
                                              "inf_token_bucket"),
    "the bookkeeping outside the lock": ("        with self.lock:\n            now = self.clock()", "        if True:\n            now = self.clock()",
                                         "inf_token_bucket"),
    "charge returns nothing": ("        self.sleep(wait)\n        return wait\n", "        self.sleep(wait)\n", "inf_token_bucket"),
    "charge sleeps at least a millisecond": ("self.sleep(wait)", "self.sleep(max(wait, 1e-3))", "inf_token_bucket"),
    "charge polls the clock in small sleeps": (
        "        self.sleep(wait)\n", "        while self.clock() < self.free_at and wait > 0:\n            self.sleep(min(wait, 1e-3))\n"
        "            wait -= 1e-3\n", "inf_token_bucket"),
    "each transfer waits only its own bytes (no queue)": (
        "            self.free_at = max(now, self.free_at) + nbytes / self.bandwidth\n            wait = self.free_at - now\n",
        "            wait = nbytes / self.bandwidth\n", "inf_token_bucket"),
    "an idle device banks credit": ("max(now, self.free_at)", "self.free_at", "inf_token_bucket"),
    "exp_avg_sq never written back": ("zip(STATES, (master, exp_avg, exp_avg_sq)):\n                tier.write",
                                      "zip(STATES[:2], (master, exp_avg)):\n                tier.write", "inf_tier_adamw"),
    "every chunk read ahead at once": (
        "        pending = deque(reader.submit(fetch, chunk) for chunk in chunks[:prefetch])\n",
        "        pending = deque(reader.submit(fetch, chunk) for chunk in (chunks if prefetch else []))\n"
        "        prefetch = prefetch and len(chunks)\n", "inf_tier_adamw"),
    "the next read submitted after the write-back (no overlap)": (SUBMIT_NEXT + UPDATE_CHUNK, UPDATE_CHUNK + SUBMIT_NEXT,
                                                                   "inf_tier_adamw"),
    "on_update never called": ("                on_update(name, start, master)\n", "                pass\n", "inf_tier_adamw"),
    "each chunk updated with the tensor's first elements of the gradient": (
        "cpu_adam_(master, grad[start:start + numel], exp_avg", "cpu_adam_(master, grad[:numel], exp_avg", "inf_tier_adamw"),
    "the step count passed one short (bias correction of the step before)": (
        "exp_avg, exp_avg_sq, step, lr=lr", "exp_avg, exp_avg_sq, max(step - 1, 1), lr=lr", "inf_tier_adamw"),
    "a prefetch's wait() ends the read but never all-gathers": ("        self.read.result()\n        self.gather()\n",
                                                               "        self.read.result()\n", "inf_tier_schedule"),
    "the shard never dropped at release": ("        super().release(unit, phase)\n        unit.shard.untyped_storage().resize_(0)\n",
                                           "        super().release(unit, phase)\n", "inf_tier_schedule"),
    "a prefetched shard read on the main thread": ("self.reader.submit(self.load, unit)",
                                                   "(self.load(unit), self.reader.submit(int))[1]", "inf_tier_schedule"),
    "a prefetch that returns no handle": ("        if not async_op:\n            self.load(unit)\n",
                                          "        if True:\n            self.load(unit)\n", "inf_tier_schedule"),
    "the prefetch's all-gather started before its read finished": (
        "        self.read.result()\n        self.gather()\n", "        self.gather()\n        self.read.result()\n",
        "inf_tier_schedule"),
    "the shard read twice per gather": ("            self.load(unit)\n            return super().all_gather(unit, phase)\n",
                                        "            self.load(unit)\n            self.load(unit)\n"
                                        "            return super().all_gather(unit, phase)\n", "inf_tier_schedule"),
    "every piece stepped, gradient or not": ("            if piece.param in unit.had_grad:\n                state =",
                                             "            if True:\n                state =", "inf_stream_step"),
    "every step taken as the first (bias correction never advances)": (
        'state["step"] = state.get("step", torch.tensor(0.0)) + 1', 'state["step"] = torch.tensor(1.0)',
        "inf_stream_step"),
    "the step count kept as a Python int (state dicts read a tensor)": (
        'state["step"] = state.get("step", torch.tensor(0.0)) + 1', 'state["step"] = state.get("step", 0) + 1',
        "inf_stream_step"),
    "the step count kept in a throwaway dict": ("state = optimizer.optimizer.state[piece.master]", "state = {}",
                                                "inf_stream_step"),
    "one tier_adamw_step call per piece (the read-ahead drains at every parameter)": (
        "    for (index, step), (names, piece_grads) in batches.items():\n",
        "    for (index, step), (names, piece_grads) in [(key, ([name], [grad])) for key, (names, grads) in batches.items()\n"
        "                                                for name, grad in zip(names, grads)]:\n", "inf_stream_step"),
    "every piece stepped with the first param group's hyperparameters": (
        "group = optimizer.param_groups[index]", "group = optimizer.param_groups[0]", "inf_stream_step"),
    "the gradient sliced at the parameter's offset, not the shard's": (
        "piece_grads.append(grad[piece.shard_offset:piece.shard_offset + piece.master.numel()])",
        "piece_grads.append(grad[piece.param_offset:piece.param_offset + piece.master.numel()])", "inf_stream_step"),
    "a shard in memory left stale": ("prefetch=optimizer.read_ahead, on_update=refresh)",
                                     "prefetch=optimizer.read_ahead)", "inf_stream_step"),
    "a shard in memory refreshed only when it is not the fp32 master": (
        "for unit in grads if unit.shard.untyped_storage().nbytes()",
        "for unit in grads if unit.shard.untyped_storage().nbytes() and unit.shard is not unit.master",
        "inf_stream_step"),
    "the unit's own gradient shard, not the fp32 clipped one step() hands over": (
        "    for unit, grad in grads.items():\n", "    for unit, grad in ((unit, unit.grad_shard) for unit in grads):\n",
        "inf_stream_step"),
    "the step streamed without read-ahead": ("prefetch=optimizer.read_ahead, on_update", "prefetch=0, on_update",
                                             "inf_stream_step"),
    "rank 0 keeps and reads the whole parameter, then broadcasts it": (
        PUT_SLICE + PARTITIONED_BETWEEN + READ_SLICE_AND_GATHER,
        "    if rank == 0:\n        tier.write(name, tensor.detach().reshape(-1))\n" + PARTITIONED_BETWEEN +
        "    whole = tier.read(name) if dist.get_rank(group) == 0 else torch.empty(math.prod(shape))\n"
        "    dist.broadcast(whole, dist.get_global_rank(group, 0) if group is not None else 0, group=group)\n"
        "    return whole.view(shape)\n", "inf_partitioned"),
    "every rank keeps and reads the whole parameter": (
        PUT_SLICE, "    tier.write(name, tensor.detach().reshape(-1))\n",
        "inf_partitioned"),
    "shards of numel // N (the remainder lost, no padding)": ("    shard = -(-tensor.numel() // world_size)\n",
                                                              "    shard = tensor.numel() // world_size\n", "inf_partitioned"),
    "the world's rank and size, not the group's": ("    rank, world_size = dist.get_rank(group), dist.get_world_size(group)\n",
                                                   "    rank, world_size = dist.get_rank(), dist.get_world_size()\n",
                                                   "inf_partitioned"),
    "the padding never cut off": ("    return whole[:math.prod(shape)].view(shape)\n", "    return whole.view(-1, *shape[1:])\n",
                                  "inf_partitioned"),
    "rank r keeps every N-th element (r, r + N, ...)": (
        PUT_SLICE, "    tier.write(name, flat[rank::world_size].clone())\n",
        "inf_partitioned"),
    "the forward tile never freed (two alive at once)": (
        "            del flat, weight, bias  # freed before the next tile is gathered\n", "", "inf_tiled_linear"),
    "the backward tile never freed": ("            del flat, weight\n", "", "inf_tiled_linear"),
    "the tiles kept for backward (no regather)": (
        "            outputs.append(x @ weight.T + bias)\n",
        "            outputs.append(x @ weight.T + bias)\n            ctx.tiles = [*getattr(ctx, 'tiles', []), flat]\n",
        "inf_tiled_linear"),
    "tile gradients summed, not averaged": ("grad_shards.append(grad_shard / layer.world_size)",
                                            "grad_shards.append(grad_shard)", "inf_tiled_linear"),
    "tile offsets assume equal tiles": ("grad_out[..., start:start + rows]", "grad_out[..., t * rows:(t + 1) * rows]",
                                        "inf_tiled_linear"),
    "output tiles concatenated in the wrong order": ("torch.cat(outputs, dim=-1)", "torch.cat(outputs[::-1], dim=-1)",
                                                     "inf_tiled_linear"),
    "no bias gradient": ("grad_tile.sum(0)", "torch.zeros(rows)", "inf_tiled_linear"),
    "gradients reduced over the whole world, not the layer's group": (
        "dist.reduce_scatter_single(grad_shard, grad_flat, group=layer.group)",
        "dist.reduce_scatter_single(grad_shard, grad_flat)", "inf_tiled_linear"),
    "averaged over the world's size, not the group's": (
        "grad_shards.append(grad_shard / layer.world_size)",
        "grad_shards.append(grad_shard / dist.get_world_size())", "inf_tiled_linear"),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_typical_mistakes_fail_their_graded_cell(mutant):
    assert_mutant_fails(LESSON, *MUTANTS[mutant])


def test_hidden_tests_are_worth_points(graded):
    assert_reference_full_and_learner_zero(graded, LESSON, 19)


OPTIONS = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("sizes, chunk_numel, prefetch", [([10, 3], 4, 0), ([13, 1, 9], 4, 1), ([33], 8, 2)])
def test_tier_adamw_matches_torch_adamw_and_moves_12_bytes_each_way(tmp_path, sizes, chunk_numel, prefetch):
    g = torch.Generator().manual_seed(0)
    masters = [torch.randn(n, generator=g) for n in sizes]
    params = [nn.Parameter(m.clone()) for m in masters]
    expected = torch.optim.AdamW(params, foreach=False, **OPTIONS)
    names = [f"p{i}" for i in range(len(sizes))]
    with NvmeTier(tmp_path) as tier:
        put_states(tier, names, masters)
        for step in range(1, 4):
            grads = [torch.randn(n, generator=g) for n in sizes]
            for p, grad in zip(params, grads):
                p.grad = grad
            expected.step()
            read, written = tier.bytes_read, tier.bytes_written
            tier_adamw_step(tier, names, grads, step, chunk_numel=chunk_numel, prefetch=prefetch, **OPTIONS)
            assert tier.bytes_read - read == tier.bytes_written - written == 12 * sum(sizes)
        assert tier.held_bytes == 0 and tier.peak_held_bytes <= (prefetch + 1) * 12 * chunk_numel
        for name, p in zip(names, params):  # the same fp32 AdamW in another order: a few roundings (2^-23 each) apart
            torch.testing.assert_close(tier.read(f"{name}.master"), p.detach(), rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(tier.read(f"{name}.exp_avg_sq"), expected.state[p]["exp_avg_sq"], rtol=1e-6, atol=1e-9)


def test_a_write_over_the_quota_fails_and_leaves_the_old_contents(tmp_path):
    with NvmeTier(tmp_path, quota=40) as tier:
        tier.write("w", torch.arange(6.0))
        with pytest.raises(OSError, match="quota of 40 bytes") as error:
            tier.write("w", torch.arange(11.0))
        assert error.value.errno == errno.ENOSPC
        assert tier.read("w").tolist() == list(range(6)) and tier.bytes_written == 24
        assert list(tmp_path.iterdir()) == []  # the tier's files have no name, and no temporary is left behind
        tier.write("w", torch.ones(10))  # replacing within the quota is fine
        assert tier.read("w", 8, 2).tolist() == [1.0, 1.0]


def test_the_tiers_files_have_no_name_and_close_frees_them(tmp_path):
    mine = tmp_path / "keep.txt"
    mine.write_text("a user's file")
    with NvmeTier(tmp_path) as tier:
        tier.write("w", torch.ones(3))
        file = tier.files["w"]
        assert os.fstat(file.fileno()).st_nlink == 0 and os.fstat(file.fileno()).st_size == 12
        assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    assert file.closed and tier.files == {} and mine.read_text() == "a user's file"


def test_bad_directory_and_names_get_errors_with_the_fix(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(OSError, match="pass a directory you can write to"):
        NvmeTier(blocker / "tier")
    with NvmeTier(tmp_path) as tier:
        with pytest.raises(ValueError, match="plain file name"):
            tier.write("../escape", torch.ones(1))
        with pytest.raises(KeyError, match="no tensor 'missing'"):
            tier.read("missing")
    with pytest.raises(ValueError, match="pass None for no throttle"):
        TokenBucket(0)


def test_the_throttled_tier_charges_every_transfer_to_its_bucket(tmp_path):
    """What the tier asks its bucket for, on a clock that stands still: each transfer queues behind the last."""
    asked = []
    with NvmeTier(tmp_path, bandwidth=4e6) as tier:
        tier.bucket = TokenBucket(4e6, clock=lambda: 0.0, sleep=asked.append)
        tier.write("w", torch.zeros(50_000))  # 0.2 MB: 0.05 s at 4 MB/s
        tier.read("w", 10_000, 10_000)  # 40 kB: 0.01 s more
    assert asked == pytest.approx([0.05, 0.06], rel=1e-9)


def tiled_steps(tiles, steps):
    """SGD steps of a TiledLinear on this rank's half of each batch; returns the layer's shards and its peak."""
    torch.manual_seed(0)
    layer = TiledLinear(nn.Linear(6, 10), tiles)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    for step in range(steps):
        x = torch.randn(dist.get_world_size(), 3, 6, generator=torch.Generator().manual_seed(step))[dist.get_rank()]
        layer(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [shard.detach().clone() for shard in layer.shards], layer.gathered.peak


@pytest.mark.parametrize("world_size, tiles", [(2, 3), (3, 4)])
def test_tiled_linear_trains_like_the_untiled_layer_with_one_tile_gathered(world_size, tiles):
    torch.manual_seed(0)
    reference = nn.Linear(6, 10)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(world_size, 3, 6, generator=torch.Generator().manual_seed(step))
        reference(x).pow(2).mean(dim=(1, 2)).mean().backward()  # the mean over ranks of each rank's mean loss
        optimizer.step()
        optimizer.zero_grad()
    rows = torch.arange(10).tensor_split(tiles)
    for rank, (shards, peak) in enumerate(launch(tiled_steps, world_size, tiles, 3, timeout=60)):
        for tile, shard in zip(rows, shards):
            flat = torch.cat([reference.weight[tile].reshape(-1), reference.bias[tile]]).detach()
            padded = torch.cat([flat, torch.zeros(shard.numel() * world_size - flat.numel())])
            # fp32 matmuls summed in tiles and over ranks in another order than one Linear's: 3 SGD steps apart
            torch.testing.assert_close(shard, padded.view(world_size, -1)[rank], atol=1e-5, rtol=1e-4)
        assert peak == 4 * world_size * max(-(-len(tile) * 7 // world_size) for tile in rows)  # one tile, padded
