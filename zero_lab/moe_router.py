# Generated from solutions/19_moe/19_moe.ipynb by `zero-lab build`: edit the notebook, not this file.

"""The router of a mixture of experts (lesson 19): which experts each token goes to, and which are dropped.

Routing              probs, experts, weights and kept of one batch of tokens
route                softmax gating, top-k, a capacity per expert (None: dropless), a balancing bias
switch_balance_loss  the Switch Transformer's auxiliary loss: E * sum_i f_i * P_i
update_balance_bias  the auxiliary-loss-free rule: raise the bias of under-loaded experts, lower the others'
expert_loads         how many assignments each expert received (the picture's y axis)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F


class Routing(NamedTuple):
    probs: torch.Tensor  # (T, E) softmax of the router's logits
    experts: torch.Tensor  # (T, k) long: each token's k chosen experts, best first
    weights: torch.Tensor  # (T, k) the gate values: probs at the chosen experts (differentiable)
    kept: torch.Tensor  # (T, k) bool: False where the expert's capacity was full (the assignment is dropped)


def route(logits: torch.Tensor, k: int, capacity_factor: float | None = None,
          bias: torch.Tensor | None = None) -> Routing:
    """Route T tokens to k of E experts each, from the router's logits (T, E)."""
    probs = logits.softmax(dim=-1)
    choice = probs if bias is None else probs + bias
    experts = choice.topk(k, dim=-1).indices
    weights = probs.gather(-1, experts)
    tokens, num_experts = probs.shape
    if capacity_factor is None:  # dropless: every assignment is kept, an expert's load is unbounded
        return Routing(probs, experts, weights, torch.ones_like(experts, dtype=torch.bool))
    capacity = math.ceil(capacity_factor * tokens * k / num_experts)
    queue = experts.t().reshape(-1)  # first choices of every token first, then second choices, ...
    seen = F.one_hot(queue, num_experts).cumsum(0).gather(1, queue[:, None]).squeeze(1)  # place in its queue, from 1
    kept = (seen <= capacity).reshape(k, tokens).t()
    return Routing(probs, experts, weights, kept)


def switch_balance_loss(routing: Routing) -> torch.Tensor:
    """E * sum_i f_i * P_i over the E experts: f_i the fraction of the T*k assignments made to expert i
    (before any drop), P_i the mean router probability of expert i over the T tokens."""
    num_experts = routing.probs.shape[1]
    fraction = torch.bincount(routing.experts.reshape(-1), minlength=num_experts) / routing.experts.numel()
    return num_experts * (fraction * routing.probs.mean(dim=0)).sum()


def update_balance_bias(bias: torch.Tensor, loads: torch.Tensor, rate: float) -> torch.Tensor:
    """The next bias: each expert's bias + rate if its load is below the mean load, - rate if above, unchanged if equal."""
    return bias + rate * torch.sign(loads.float().mean() - loads.float())


def expert_loads(routing: Routing, kept_only: bool = True) -> torch.Tensor:
    """Assignments each expert received (those kept, or all)."""
    chosen = routing.experts[routing.kept] if kept_only else routing.experts.reshape(-1)
    return torch.bincount(chosen, minlength=routing.probs.shape[1])
