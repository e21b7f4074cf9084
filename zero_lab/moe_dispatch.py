# Generated from solutions/19_moe/19_moe.ipynb by `zero-lab build`: edit the notebook, not this file.

"""Expert parallelism (lesson 19): the experts of an MoE layer spread over the ranks of a group, tokens sent to them
and back with all-to-all.

AllToAll          all_to_all_single with split sizes as an autograd function: its backward is the reverse exchange
exchange_counts   every rank learns how many rows each rank will send it, per local expert
dispatch_combine  rows to their experts' ranks, each local expert once, results back, weighted, summed per token
Expert, MoELayer  a GELU FFN expert; the router and this rank's experts of one layer
moe_gpt           the course GPT with every block's FFN an MoELayer; moe_balance_loss sums the layers' losses
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

if __name__ != "__main__":
    from zero_lab.moe_router import route, switch_balance_loss


class AllToAll(torch.autograd.Function):
    """Rows of x: send_counts[r] of them (in order) to rank r of `group`; returns what arrives, recv_counts[r] from
    rank r. The gradient goes back the same way, the counts swapped. gloo's all_to_all_single takes uneven splits."""

    @staticmethod
    def forward(ctx, x, send_counts: list[int], recv_counts: list[int], group):
        ctx.counts, ctx.group = (send_counts, recv_counts), group
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts = ctx.counts
        back = grad.new_empty((sum(send_counts), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), send_counts, recv_counts, group=ctx.group)
        return back, None, None, None


def exchange_counts(send_counts: torch.Tensor, group) -> torch.Tensor:
    """send_counts (E,) long: rows this rank sends to each global expert, experts grouped by rank (rank r of the
    group holds experts r*L ... r*L + L - 1, L = E / group size). Returns (E,): entry s*L + j is how many rows
    rank s sends to this rank's local expert j. group None: one process with every expert, nothing to exchange."""
    if group is None:
        return send_counts.clone()
    received = torch.empty_like(send_counts)
    dist.all_to_all_single(received, send_counts, group=group)
    return received


def dispatch_combine(x: torch.Tensor, routing, experts: nn.ModuleList, group, skip_idle: bool = False) -> torch.Tensor:
    """The MoE layer's output (T, d) for tokens x (T, d): sum over each token's kept assignments of
    weight * expert(x_token). `experts` are this rank's L local experts; group None: all E are here."""
    num_experts, local = routing.probs.shape[1], len(experts)
    ep = num_experts // local
    token, slot = routing.kept.nonzero(as_tuple=True)
    expert = routing.experts[token, slot]
    order = torch.argsort(expert, stable=True)  # rows grouped by expert, so by the rank that holds it
    token, slot, expert = token[order], slot[order], expert[order]
    send = torch.bincount(expert, minlength=num_experts)
    received = exchange_counts(send, group)
    per_rank = lambda counts: counts.view(ep, local).sum(1).tolist()
    rows = x[token] if group is None else AllToAll.apply(x[token], per_rank(send), per_rank(received), group)
    pieces = list(rows.split(received.tolist()))  # (source rank, local expert), source-major
    for j, expert_module in enumerate(experts):
        mine = pieces[j::local]  # from every source rank, for local expert j
        sizes = [p.shape[0] for p in mine]
        if skip_idle and sum(sizes) == 0:  # as a loop over experts with tokens does (the stage-3 hang)
            continue
        pieces[j::local] = expert_module(torch.cat(mine)).split(sizes)
    out = torch.cat(pieces)
    if group is not None:
        out = AllToAll.apply(out, per_rank(received), per_rank(send), group)
    weighted = out * routing.weights[token, slot, None]
    return torch.zeros_like(x).index_add(0, token, weighted)


class Expert(nn.Module):
    """One expert: the course GPT's FFN, Linear(d, h) -> GELU -> Linear(h, d)."""

    def __init__(self, d: int, h: int):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


def expert_size(group) -> tuple[int, int]:
    """(this rank's place in the expert-parallel group, its size); group None: (0, 1), one process with every expert."""
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


class MoELayer(nn.Module):
    """A router over num_experts experts, k per token, of which this rank holds num_experts / |group|: those of its
    place in the expert-parallel `group` (None: all of them, no communication). Every rank makes every expert from
    `seed` and keeps its own, so the layer equals its one-process self. The balancing bias (a buffer, zeros) shifts
    the choice only; .routing and .balance_loss are the last forward's."""

    def __init__(self, d: int, h: int, num_experts: int, k: int = 1, capacity_factor: float | None = None,
                 group=None, seed: int = 0, skip_idle: bool = False):
        super().__init__()
        place, size = expert_size(group)
        if num_experts % size:
            raise ValueError(f"{num_experts} experts do not split over {size} expert-parallel ranks")
        self.num_experts, self.k, self.capacity_factor, self.group, self.skip_idle = (num_experts, k, capacity_factor,
                                                                                      group, skip_idle)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.router = nn.Linear(d, num_experts, bias=False)
            every = [Expert(d, h) for _ in range(num_experts)]
        local = num_experts // size
        self.first_expert = place * local
        self.experts = nn.ModuleList(every[self.first_expert:self.first_expert + local])
        self.register_buffer("balance_bias", torch.zeros(num_experts), persistent=False)
        self.routing = self.balance_loss = None

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        self.routing = route(self.router(flat), self.k, self.capacity_factor, self.balance_bias)
        self.balance_loss = switch_balance_loss(self.routing)
        return dispatch_combine(flat, self.routing, self.experts, self.group, self.skip_idle).view_as(x)


def moe_gpt(config, num_experts: int, k: int = 1, capacity_factor: float | None = None, group=None, seed: int = 0,
            skip_idle: bool = False) -> nn.Module:
    """The course GPT (zero_lab.models) with every block's FFN an MoELayer of experts as wide as that FFN."""
    from zero_lab.models import GPT

    model = GPT(config, seed=seed)
    for i, block in enumerate(model.transformer.h):
        block.mlp = MoELayer(config.n_embd, 4 * config.n_embd, num_experts, k, capacity_factor, group,
                             seed=1000 * seed + i, skip_idle=skip_idle)
    return model


def moe_balance_loss(model: nn.Module) -> torch.Tensor:
    """The sum of every MoE layer's balance loss from the last forward."""
    return sum(m.balance_loss for m in model.modules() if isinstance(m, MoELayer))
