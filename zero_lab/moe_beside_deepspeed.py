"""An MoE layer of lesson 19 beside DeepSpeed's `deepspeed.moe.layer.MoE`, on the same ranks (optional).

Hand-written lab bench, used by lesson 19's section 6 and tests/test_deepspeed.py. Both layers get the same
router weight and the same experts (the course's `MoELayer` and `Expert` classes are passed in, so the notebook
compares the learner's own), top-1, no random token selection (`use_rts=False`), over an expert-parallel group
of the whole world (gloo). Each rank feeds both the same tokens, then backward of the same loss.

compare_with_deepspeed   per rank: the largest output gap on the tokens both kept, the balance losses, which tokens
                         each kept, and (when neither dropped any) the largest gradient gap of router and experts
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import zero_lab


def _deepspeed_moe(expert, d: int, experts: int, capacity_factor: float):
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    import deepspeed
    from deepspeed.moe.layer import MoE

    # DeepSpeed's CPU backend compiles a shared-memory all-reduce op when its comm starts (minutes, once); no
    # collective here uses it, so its comm starts without it on the launcher's process group.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # deepspeed.comm.torch is torch, by a star import
    deepspeed.init_distributed(dist_backend="gloo")
    layer = MoE(d, expert, experts, ep_size=dist.get_world_size(), k=1, capacity_factor=capacity_factor,
                eval_capacity_factor=capacity_factor, min_capacity=0, drop_tokens=True, use_rts=False)
    layer.set_deepspeed_parallelism()
    return layer


def _beside_deepspeed(layer_class, expert_class, seed: int, d: int, experts: int, capacity_factor: float,
                      tokens: int) -> dict:
    ours = layer_class(d, 2 * d, experts, 1, capacity_factor, dist.group.WORLD, seed)
    theirs = _deepspeed_moe(expert_class(d, 2 * d), d, experts, capacity_factor)
    their_experts = theirs.deepspeed_moe.experts.deepspeed_experts
    with torch.no_grad():
        theirs.deepspeed_moe.gate.wg.weight.copy_(ours.router.weight)
        for mine, copy in zip(ours.experts, their_experts):
            copy.load_state_dict(mine.state_dict())
    x = torch.randn(1, tokens, d, generator=torch.Generator().manual_seed(1000 * seed + dist.get_rank()))
    mine = ours(x)
    theirs_out, their_loss, _ = theirs(x)
    (mine.sum() + ours.balance_loss).backward()
    (theirs_out.sum() + their_loss).backward()
    mine, theirs_out = mine.detach()[0], theirs_out.detach()[0]
    kept_ours = ours.routing.kept[:, 0].tolist()
    kept_theirs = (theirs_out.abs().sum(1) > 0).tolist()  # a dropped token gets zeros from DeepSpeed's layer
    both = [t for t in range(tokens) if kept_ours[t] and kept_theirs[t]]
    result = {"output_gap": (mine[both] - theirs_out[both]).abs().max().item() if both else 0.0,
              "balance_losses": (ours.balance_loss.item(), their_loss.item()),
              "kept_ours": kept_ours, "kept_theirs": kept_theirs, "experts": ours.routing.experts[:, 0].tolist()}
    if all(kept_ours) and all(kept_theirs):  # the same tokens reached the same experts: gradients comparable
        pairs = [(ours.router.weight, theirs.deepspeed_moe.gate.wg.weight)]
        pairs += [pair for mine_e, copy in zip(ours.experts, their_experts)
                  for pair in zip(mine_e.parameters(), copy.parameters())]
        result["gradient_gap"] = max((a.grad - b.grad).abs().max().item() for a, b in pairs)
    return result


def compare_with_deepspeed(layer_class, expert_class, ranks: int = 2, seed: int = 0, d: int = 8, experts: int = 4,
                           capacity_factor: float = 1.0, tokens: int = 8, timeout: float = 120) -> list[dict]:
    """`_beside_deepspeed` on `ranks` processes: one dict per rank (see the module's docstring)."""
    return zero_lab.launch(_beside_deepspeed, ranks, layer_class, expert_class, seed, d, experts, capacity_factor,
                           tokens, timeout=timeout)
