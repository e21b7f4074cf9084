"""The communication ledger counts what really crosses the wire, whoever calls it."""

from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from zero_lab import CommLedger, launch


def _each_collective(numel):
    n = dist.get_world_size()
    full = torch.ones(numel * n)
    shard = torch.ones(numel)
    with CommLedger() as ledger:
        dist.all_reduce(full)
        dist.reduce_scatter_tensor(shard, full)
        dist.all_gather_into_tensor(full, shard)
        dist.broadcast(full, src=0)
        dist.all_gather(list(full.chunk(n)), shard)
        dist.barrier()
        if n > 1:
            if dist.get_rank() == 0:
                dist.send(shard, dst=1)
            elif dist.get_rank() == 1:
                dist.recv(shard, src=0)
    return ledger.totals


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_bytes_follow_the_ring_convention(world_size):
    numel = 5
    m_bytes = numel * world_size * 4  # M: the full message, fp32
    ring = Fraction(world_size - 1, world_size) * m_bytes
    totals = launch(_each_collective, world_size, numel)
    for rank, t in enumerate(totals):
        assert t["all_reduce"].sent_bytes == 2 * ring
        assert t["reduce_scatter"].sent_bytes == ring
        assert t["all_gather"].calls == 2 and t["all_gather"].sent_bytes == 2 * ring
        assert t["broadcast"].sent_bytes == ring
        assert t["barrier"].calls == 1 and t["barrier"].sent_bytes == 0
        if world_size > 1 and rank == 0:
            assert t["send"].sent_bytes == numel * 4
        if world_size > 1 and rank == 1:
            assert t["recv"].elements == numel and t["recv"].sent_bytes == 0


def _nested_and_outside():
    t = torch.ones(8)
    dist.all_reduce(t)  # outside any ledger: not counted
    with CommLedger() as outer:
        dist.all_reduce(t)
        with CommLedger() as inner:
            dist.all_reduce(t, async_op=True).wait()
    return outer.calls(), inner.calls(), outer.summary()


def test_ledgers_nest_and_count_only_inside():
    outer_calls, inner_calls, summary = launch(_nested_and_outside, 2)[0]
    assert (outer_calls, inner_calls) == (2, 1)
    assert summary == {"all_reduce": {"calls": 2, "elements": 16, "bytes": 64, "sent_bytes": 64.0}}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _torch_ddp_step():
    model = torch.nn.parallel.DistributedDataParallel(_model())
    with CommLedger() as ledger:
        model(torch.randn(8, 16)).sum().backward()
    return ledger.sent_bytes("all_reduce"), sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("world_size", [2, 3])
def test_counts_pytorch_ddp_allreduce_issued_from_cpp(world_size):
    sent, psi = launch(_torch_ddp_step, world_size)[0]
    assert sent == Fraction(2 * (world_size - 1), world_size) * psi * 4


def _fsdp2_step():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    with CommLedger() as ledger:
        model(torch.randn(8, 16)).sum().backward()
    return ledger.summary()


def test_counts_fsdp2_all_gathers_and_reduce_scatters():
    summary = launch(_fsdp2_step, 2)[0]
    # ZeRO-3's pattern: gather params for forward, again for backward, reduce-scatter grads.
    assert summary["all_gather"]["calls"] == 2
    assert summary["reduce_scatter"]["calls"] == 1


def test_needs_the_counting_process_group():
    with pytest.raises(RuntimeError, match="counted"):
        with CommLedger():
            pass


def _all_reduce_on_subgroup():
    pair = dist.new_group([0, 1])
    with CommLedger() as ledger:
        if dist.get_rank() in (0, 1):
            dist.all_reduce(torch.ones(6), group=pair)
    return ledger.sent_bytes()


def test_subgroups_are_counted_with_their_own_size():
    # A group of 2 inside a world of 3: 2 (2-1)/2 * 6 elements * 4 bytes.
    assert launch(_all_reduce_on_subgroup, 3) == [24, 24, 0]
