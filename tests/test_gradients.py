"""Per-parameter gradients under sharding (zero_lab.gradients): each rank's piece and the gathered
whole equal one process's gradient of the global batch, at 2 and 3 ranks with uneven shards."""

import pytest
import torch
import torch.distributed as dist

from sharded_training import ADAMW, SIZES, mlp_batches, mlp_loss

import zero_lab
from zero_lab import launch
from zero_lab.data import shard_batch
from zero_lab.gradients import full_grad, local_grad
from zero_lab.models import MLP


def _gradients(stage):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batch = mlp_batches(1)[0]
    reference = MLP(SIZES, seed=0)
    mlp_loss(reference, batch).backward()  # one process, the global batch
    expected = {name: p.grad for name, p in reference.named_parameters()}
    model, optimizer = zero_lab.prepare(MLP(SIZES, seed=0), torch.optim.AdamW, stage=stage, **ADAMW)
    mlp_loss(model, shard_batch(batch, rank, world_size)).backward()
    named = list(getattr(model, "module", model).named_parameters())
    worst, covered = 0.0, {}
    for name, p in named:
        whole = full_grad(optimizer, p)
        worst = max(worst, (whole - expected[name]).abs().max().item())
        piece = local_grad(optimizer, p)
        mine = expected[name].reshape(-1)[piece.start:piece.stop]
        worst = max(worst, (piece.values - mine).abs().max().item() if piece.values.numel() else 0.0)
        covered[name] = (piece.start, piece.stop)
    optimizer.step()  # the views read nothing the step needs: it still trains
    return worst, covered, {name: g.numel() for name, g in expected.items()}


@pytest.mark.parametrize("stage, world_size", [(0, 2), (1, 3), (2, 2), (2, 3), (3, 2), (3, 3)])
def test_each_rank_s_piece_and_the_whole_equal_one_process_s_gradient(stage, world_size):
    results = launch(_gradients, world_size, stage)
    assert max(worst for worst, _, _ in results) < 1e-6
    numels = results[0][2]
    for name, numel in numels.items():
        pieces = sorted(covered[name] for _, covered, _ in results)
        if stage >= 2:  # the pieces tile the parameter, each element on one rank (uneven: 113 elements)
            pieces = [(lo, hi) for lo, hi in pieces if hi > lo]
            assert [lo for lo, _ in pieces] == [0] + [hi for _, hi in pieces[:-1]] and pieces[-1][1] == numel, name
        else:
            assert all(piece == (0, numel) for piece in pieces), name


def _offloaded():
    model, optimizer = zero_lab.prepare(MLP(SIZES, seed=0), torch.optim.AdamW, stage=2, offload="cpu", **ADAMW)
    local_grad(optimizer, next(model.parameters()))


def test_offloaded_gradients_are_refused_with_where_to_look():
    with pytest.raises(zero_lab.RankFailed, match="keeps its gradient shards on the host"):
        launch(_offloaded, 2)
