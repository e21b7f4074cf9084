"""Lesson 00's module: the ring collectives match torch.distributed, and send what the formula says.

Every check runs on real ranks (`zero_lab.launch`, gloo on CPU) for world sizes 1-4, with
sizes that N does not divide and sizes smaller than N. Inputs are integer-valued so that
float sums are exact in any order and results can be compared with `torch.equal`.
"""

from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

import zero_lab
from zero_lab.collectives import (
    chunk_bounds,
    fit_alpha_beta,
    ring_all_gather,
    ring_all_reduce,
    ring_exchange,
    ring_reduce_scatter,
    ring_time,
)

TIMEOUT = 30
WORLD_SIZES = [1, 2, 3, 4]
SIZES = [1, 2, 3, 5, 10, 1001]  # includes M < N and M not divisible by N


def _integer_tensor(shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-50, 50, shape, generator=generator).to(dtype)


def _other_kinds(ledger):
    return sorted(kind for kind in ledger.totals if kind not in ("send", "recv"))


# ---------------------------------------------------------------------------- chunk_bounds

@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("numel", [0, 1, 2, 3, 7, 10, 64, 1001])
def test_chunk_bounds_matches_tensor_split(numel, world_size):
    sizes = [len(chunk) for chunk in torch.arange(numel).tensor_split(world_size)]
    starts = [sum(sizes[:rank]) for rank in range(world_size)]
    assert chunk_bounds(numel, world_size) == [(s, s + n) for s, n in zip(starts, sizes)]


def test_chunk_bounds_allows_empty_chunks():
    assert chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]


# ---------------------------------------------------------------------------- ring_exchange

def _exchange(numel):
    rank = dist.get_rank()
    send, recv = torch.full((numel,), float(rank)), torch.full((numel,), -1.0)
    ring_exchange(send, recv)
    return send, recv


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("numel", [0, 3, 200_000])
def test_ring_exchange_passes_to_the_right(world_size, numel):
    for rank, (send, recv) in enumerate(zero_lab.launch(_exchange, world_size, numel, timeout=TIMEOUT)):
        assert torch.equal(send, torch.full((numel,), float(rank)))
        assert torch.equal(recv, torch.full((numel,), float((rank - 1) % world_size)))


# ---------------------------------------------------------------------------- reduce-scatter

def _reduce_scatter(shape, dtype):
    rank, world = dist.get_rank(), dist.get_world_size()
    x = _integer_tensor(shape, dtype, seed=rank)
    total = x.clone()
    dist.all_reduce(total)
    start, stop = chunk_bounds(x.numel(), world)[rank]
    with zero_lab.CommLedger() as ledger:
        mine = ring_reduce_scatter(x)
    expected = total.reshape(-1)[start:stop]
    return (
        torch.equal(mine, expected),
        torch.equal(x.reshape(-1)[start:stop], expected),
        mine.numel() == 0 or mine.data_ptr() == x.reshape(-1)[start:stop].data_ptr(),
        _other_kinds(ledger),
    )


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("numel", SIZES)
def test_ring_reduce_scatter_sums_my_chunk(world_size, numel):
    for returned, in_place, is_view, kinds in zero_lab.launch(
        _reduce_scatter, world_size, (numel,), torch.float32, timeout=TIMEOUT
    ):
        assert returned and in_place and is_view
        assert kinds == []


def test_ring_reduce_scatter_2d_float64():
    for returned, in_place, is_view, kinds in zero_lab.launch(
        _reduce_scatter, 3, (4, 5), torch.float64, timeout=TIMEOUT
    ):
        assert returned and in_place and is_view and kinds == []


def _reduce_scatter_vs_torch(numel):
    world = dist.get_world_size()
    x = _integer_tensor((numel,), torch.float32, seed=dist.get_rank())
    out = torch.empty(numel // world)
    dist.reduce_scatter_single(out, x.clone())
    return torch.equal(ring_reduce_scatter(x), out)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_reduce_scatter_matches_torch_when_divisible(world_size):
    assert all(zero_lab.launch(_reduce_scatter_vs_torch, world_size, 12 * world_size, timeout=TIMEOUT))


# ---------------------------------------------------------------------------- all-gather

def _all_gather(numel, dtype):
    rank, world = dist.get_rank(), dist.get_world_size()
    full = (torch.arange(numel) * 3 + 1).to(dtype)
    x = torch.full((numel,), -7, dtype=dtype)
    start, stop = chunk_bounds(numel, world)[rank]
    x[start:stop] = full[start:stop]
    with zero_lab.CommLedger() as ledger:
        out = ring_all_gather(x)
    return torch.equal(x, full), out is x, _other_kinds(ledger)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("numel", SIZES)
def test_ring_all_gather_fills_every_chunk(world_size, numel):
    for gathered, returned_self, kinds in zero_lab.launch(
        _all_gather, world_size, numel, torch.float32, timeout=TIMEOUT
    ):
        assert gathered and returned_self and kinds == []


def _all_gather_vs_torch(shard_numel):
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = _integer_tensor((shard_numel,), torch.float64, seed=rank)
    expected = torch.empty(shard_numel * world, dtype=torch.float64)
    dist.all_gather_single(expected, shard)
    x = torch.zeros(shard_numel * world, dtype=torch.float64)
    x[rank * shard_numel:(rank + 1) * shard_numel] = shard
    return torch.equal(ring_all_gather(x), expected)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_all_gather_matches_torch_when_divisible(world_size):
    assert all(zero_lab.launch(_all_gather_vs_torch, world_size, 7, timeout=TIMEOUT))


# ---------------------------------------------------------------------------- all-reduce

def _all_reduce(shape, dtype, average):
    rank, world = dist.get_rank(), dist.get_world_size()
    x = _integer_tensor(shape, dtype, seed=rank)
    expected = x.clone()
    dist.all_reduce(expected)
    if average:
        expected /= world
    with zero_lab.CommLedger() as ledger:
        out = ring_all_reduce(x, average=average)

    noisy = torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(100 + rank))
    noisy_expected = noisy.clone()
    dist.all_reduce(noisy_expected)
    ring_all_reduce(noisy)
    return (
        torch.equal(x, expected),
        out is x,
        torch.allclose(noisy, noisy_expected, atol=1e-5),  # <= 3 roundings of sums of 4 normals (|s| < 10): 3 * 10 * 2^-23 = 4e-6
        _other_kinds(ledger),
    )


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("numel", SIZES)
def test_ring_all_reduce_matches_torch(world_size, numel):
    for exact, returned_self, close, kinds in zero_lab.launch(
        _all_reduce, world_size, (numel,), torch.float32, False, timeout=TIMEOUT
    ):
        assert exact and returned_self and close
        assert kinds == []


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_all_reduce_average_float64_2d(world_size):
    for exact, returned_self, close, kinds in zero_lab.launch(
        _all_reduce, world_size, (3, 7), torch.float64, True, timeout=TIMEOUT
    ):
        assert exact and returned_self and close and kinds == []


def _all_reduce_int(numel):
    x = torch.arange(numel, dtype=torch.int64) * (dist.get_rank() + 1)
    ring_all_reduce(x)
    return x


def test_ring_all_reduce_integer_dtype():
    world = 3
    triangle = world * (world + 1) // 2
    for x in zero_lab.launch(_all_reduce_int, world, 11, timeout=TIMEOUT):
        assert torch.equal(x, torch.arange(11, dtype=torch.int64) * triangle)


# ---------------------------------------------------------------------------- bytes sent

def _sent_bytes(numel, dtype):
    x = torch.ones(numel, dtype=dtype)
    with zero_lab.CommLedger() as ledger:
        ring_all_reduce(x)
    return ledger.sent_bytes(), ledger.sent_bytes("send"), ledger.calls("send")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("numel", [2, 10, 1001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_ring_all_reduce_sends_2_n_minus_1_over_n_m(world_size, numel, dtype):
    size = torch.empty(0, dtype=dtype).element_size()
    results = zero_lab.launch(_sent_bytes, world_size, numel, dtype, timeout=TIMEOUT)
    sent = [total for total, _, _ in results]
    assert all(total == only_sends for total, only_sends, _ in results)
    # Mean over ranks: exactly 2 (N-1)/N * M * element size; total: 2 (N-1) * M * element size.
    assert sum(sent, Fraction()) / world_size == Fraction(2 * (world_size - 1), world_size) * numel * size
    # Per rank: everything twice, minus my own chunk (reduce-scatter) and my right neighbour's (all-gather).
    chunks = [stop - start for start, stop in chunk_bounds(numel, world_size)]
    for rank, (total, _, calls) in enumerate(results):
        expected = 0 if world_size == 1 else (2 * numel - chunks[rank] - chunks[(rank + 1) % world_size]) * size
        assert total == expected
        assert calls == 2 * (world_size - 1)


# ---------------------------------------------------------------------------- alpha-beta model

def test_ring_time_has_2_n_minus_1_latencies_and_sends_2_n_minus_1_over_n_m():
    assert ring_time(1e6, 1, 1e-4, 1e9) == 0
    assert ring_time(3e6, 3, 1e-4, 2e9) == pytest.approx(4 * 1e-4 + 4 / 3 * 3e6 / 2e9)


@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_fit_alpha_beta_recovers_the_model(world_size):
    sizes = [1e3, 1e5, 1e6, 4e6]
    alpha, beta = fit_alpha_beta(sizes, [ring_time(m, world_size, 2e-5, 5e8) for m in sizes], world_size)
    assert alpha == pytest.approx(2e-5) and beta == pytest.approx(5e8)
