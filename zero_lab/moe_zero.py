# Generated from solutions/19_moe/19_moe.ipynb by `zero-lab build`: edit the notebook, not this file.

"""ZeRO with experts (lesson 19): dense parameters sharded over the whole data-parallel world, each expert's over
the ranks that hold a replica of it (DeepSpeed-MoE's expert-data-parallel group).

expert_groups        the expert-parallel and expert-data-parallel groups of a world, as rank lists
make_expert_groups   this rank's two process groups, every group made on every rank
moe_param_groups     param groups for zero_lab.prepare: the dense ones over the world, the experts over their group
OverProcessGroups    what prepare builds for them: one ZeRO optimizer per process group, stepped together
moe_state_bytes      model-state bytes per rank at stages 1-2, the formula
moe_block_units      stage 3's sharding units with every MoE block whole (DeepSpeed's set_z3_leaf_modules)
all_to_all_bytes     the bytes one rank's all-to-alls send per MoE layer and step, the formula
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from zero_lab.zero1 import param_groups_of

if __name__ != "__main__":
    from zero_lab.moe_dispatch import MoELayer


def expert_groups(world_size: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-parallel groups, expert-data-parallel groups) of world_size ranks with ep ranks per expert-parallel
    group: consecutive ranks share the experts out; the ranks at the same place in every expert-parallel group
    hold the same experts."""
    if world_size % ep:
        raise ValueError(f"{world_size} ranks do not split into expert-parallel groups of {ep}")
    parallel = [list(range(start, start + ep)) for start in range(0, world_size, ep)]
    replicas = [list(range(place, world_size, ep)) for place in range(ep)]
    return parallel, replicas


def moe_param_groups(model: nn.Module, expert_data_group) -> list[dict]:
    """Param groups for zero_lab.prepare: every parameter of an MoE layer's experts in one group over
    `expert_data_group` ("process_group"), every other trainable parameter in one group over the whole world."""
    experts = {id(p) for m in model.modules() if isinstance(m, MoELayer) for p in m.experts.parameters()}
    dense = [p for p in model.parameters() if p.requires_grad and id(p) not in experts]
    expert_params = [p for p in model.parameters() if p.requires_grad and id(p) in experts]
    return [{"params": dense}, {"params": expert_params, "process_group": expert_data_group}]


def make_expert_groups(ep: int):
    """(this rank's expert-parallel group, its expert-data-parallel group). new_group is collective: every rank
    makes every group, in the same order."""
    parallel, replicas = expert_groups(dist.get_world_size(), ep)
    rank, mine = dist.get_rank(), {}
    for kind, lists in (("ep", parallel), ("edp", replicas)):
        for ranks in lists:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = group
    return mine["ep"], mine["edp"]


class OverProcessGroups(torch.optim.Optimizer):
    """One ZeRO optimizer (`build`: lesson 03's or 04's class) per process group of the param groups ("process_group"
    key; absent: the whole world), stepped together. Each gradient is summed over its group and divided by the
    world's size, as one process's mean over the global batch: a group of G ranks would divide by G, so its
    gradients are scaled by G / world first (an expert's gradient already holds its expert-parallel group's tokens;
    DeepSpeed's engine divides expert gradients by the data-parallel world size too)."""

    def __init__(self, build, model, optimizer_class, params, **options):
        by_group = {}
        for g in param_groups_of(model, params):
            by_group.setdefault(g.pop("process_group", None), []).append(g)
        world, self.parts, scales = dist.get_world_size(), [], []
        for group, groups in by_group.items():
            size = world if group is None else dist.get_world_size(group)
            if size != world:
                scales += [p.register_hook(lambda grad, s=size / world: grad * s)
                           for g in groups for p in g["params"] if p.requires_grad]
            self.parts.append(build(model, optimizer_class, groups, group=group, **options))
        self.hook_handles = scales + [h for part in self.parts for h in getattr(part, "hook_handles", [])]
        self.model_hooks = [h for part in self.parts for h in part.model_hooks]
        super().__init__([g for part in self.parts for g in part.param_groups], {})  # the parts' own dicts

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.parts[0].evaluate_closure(closure)
        for part in self.parts:
            part.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"parts": [part.state_dict() for part in self.parts]}

    def load_state_dict(self, state: dict) -> None:
        for part, saved in zip(self.parts, state["parts"]):
            part.load_state_dict(saved)

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        merged = {}
        for part in self.parts:
            for kind, tensors in part.model_state_tensors().items():
                merged.setdefault(kind, {}).update((id(t), t) for t in tensors)
        return {kind: list(tensors.values()) for kind, tensors in merged.items()}


def over_process_groups(build):
    """prepare's builder for param groups with their own process groups, around the stage's class `build`."""
    return lambda model, optimizer_class, params, **options: OverProcessGroups(build, model, optimizer_class, params,
                                                                               **options)


def moe_state_bytes(dense: int, expert: int, world: int, ep: int, stage: int, state_bytes: int = 12) -> int:
    """Model-state bytes on one rank, fp32, stage 1 or 2: `dense` parameters over all `world` ranks, `expert`
    parameters (every expert of the model) of which this rank holds 1/ep, sharded over world/ep replicas. Per
    parameter group of P parameters over N ranks: 4 P bytes of weights; gradients 4 N ceil(P/N) at stage 1 (a
    padded flat buffer), 4 ceil(P/N) at stage 2; state_bytes ceil(P/N) of fp32 master and optimizer states."""
    def group(params: int, ranks: int) -> int:
        shard = -(-params // ranks)
        gradients = 4 * shard * (ranks if stage == 1 else 1)
        return 4 * params + gradients + state_bytes * shard
    return group(dense, world) + group(expert // ep, world // ep)


def moe_block_units(model: nn.Module):
    """Stage 3's `units=` predicate: every MoELayer is one unit holding all its parameters (router and experts, so
    it is gathered whole on entering the layer); elsewhere stage 3's default units: every module that registers parameters of its own."""
    inside = {id(m) for layer in model.modules() if isinstance(layer, MoELayer) for m in layer.modules()
              if m is not layer}
    return lambda module: isinstance(module, MoELayer) or (id(module) not in inside and
                                                        any(True for _ in module.parameters(recurse=False)))


def all_to_all_bytes(sent: int, received: int, d: int, num_experts: int, ep: int, element_size: int = 4) -> float:
    """Bytes one rank's all-to-alls send in one MoE layer's forward and backward, as zero_lab's CommLedger counts an
    all-to-all ((N - 1) / N of its input, N = ep): the counts exchange (num_experts int64), the dispatch of `sent`
    rows of d elements, the combine of the `received` rows' results, and the gradients of both sent back."""
    off_rank = (ep - 1) / ep
    return off_rank * (num_experts * 8 + 2 * (sent + received) * d * element_size)
