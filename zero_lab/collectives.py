# Generated from solutions/00_collectives/00_collectives.ipynb by `zero-lab build`: edit the notebook, not this file.

"""Collectives built from point-to-point messages: the ring algorithm behind all-reduce.

chunk_bounds         how N ranks split M elements into N contiguous chunks
ring_exchange        send to the right neighbour while receiving from the left one
ring_reduce_scatter  rank r ends up with the sum over ranks of chunk r
ring_all_gather      every rank ends up with every rank's chunk
ring_all_reduce      the two composed: the sum (or mean) over ranks, in place
"""

import torch
import torch.distributed as dist


def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """Split `numel` elements into `world_size` contiguous (start, stop) chunks.

    Sizes differ by at most one; the first `numel % world_size` chunks are the longer ones
    (like `torch.tensor_split`). Chunks may be empty when numel < world_size.
    """
    base, extra = divmod(numel, world_size)
    bounds, start = [], 0
    for rank in range(world_size):
        stop = start + base + (1 if rank < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def ring_exchange(send: torch.Tensor, recv: torch.Tensor) -> None:
    """Send `send` to rank (r + 1) % N while receiving rank (r - 1) % N's message into `recv`."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    request = dist.isend(send, dst=(rank + 1) % world_size)
    dist.recv(recv, src=(rank - 1) % world_size)
    request.wait()


def ring_reduce_scatter(tensor: torch.Tensor) -> torch.Tensor:
    """Ring reduce-scatter (sum), in place; returns this rank's chunk (a view of `tensor`).

    Afterwards chunk `rank` of `tensor.view(-1)` (see `chunk_bounds`) holds the sum over
    ranks of that chunk; the other chunks hold partial sums.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    flat = tensor.view(-1)
    bounds = chunk_bounds(flat.numel(), world_size)

    def chunk(index):
        start, stop = bounds[index % world_size]
        return flat[start:stop]

    for step in range(world_size - 1):
        outgoing = chunk(rank - step - 1)   # the partial sum I pass on
        incoming = chunk(rank - step - 2)   # the chunk my left neighbour passes to me
        buffer = torch.empty_like(incoming)
        ring_exchange(outgoing, buffer)
        incoming += buffer
    return chunk(rank)


def ring_all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Ring all-gather, in place: chunk r of every rank's `tensor` becomes rank r's chunk r."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    flat = tensor.view(-1)
    bounds = chunk_bounds(flat.numel(), world_size)

    def chunk(index):
        start, stop = bounds[index % world_size]
        return flat[start:stop]

    for step in range(world_size - 1):
        ring_exchange(chunk(rank - step), chunk(rank - step - 1))
    return tensor


def ring_all_reduce(tensor: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Ring all-reduce, in place: every rank's `tensor` becomes the sum (or mean) over ranks."""
    mine = ring_reduce_scatter(tensor)
    if average:
        mine /= dist.get_world_size()
    return ring_all_gather(tensor)


def ring_time(nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """α–β model of ring_all_reduce: 2(N-1) messages of nbytes/N bytes each (seconds)."""
    steps = 2 * (world_size - 1)
    return steps * alpha + steps * nbytes / world_size / beta


def fit_alpha_beta(nbytes: list[float], seconds: list[float], world_size: int) -> tuple[float, float]:
    """Least-squares (alpha, beta) of ring_time from all-reduces of several sizes on world_size ranks."""
    steps = 2 * (world_size - 1)
    sent = [steps * n / world_size for n in nbytes]        # bytes one rank sends
    mean_x, mean_t = sum(sent) / len(sent), sum(seconds) / len(seconds)
    covariance = sum((x - mean_x) * (t - mean_t) for x, t in zip(sent, seconds))
    variance = sum((x - mean_x) ** 2 for x in sent)
    slope = covariance / variance                           # seconds per byte = 1 / beta
    intercept = mean_t - slope * mean_x                     # the 2(N-1) latencies
    return intercept / steps, 1 / slope
