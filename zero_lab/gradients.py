"""Per-parameter gradients when the stages keep them sharded (read after backward, before step).

Stages 2 and 3 reduce-scatter each gradient into flat shards during backward and leave
`p.grad = None`, so code that reads per-parameter gradients (norm logging, a test that compares
gradients) sees nothing. The peers offer two views, and so does this module:

    piece = local_grad(optimizer, p)   # this rank's part of p's averaged gradient: piece.values (a view
                                       # of the optimizer's shard, no copy) are p.flatten()[piece.start:piece.stop]
    g = full_grad(optimizer, p)        # the whole averaged gradient, shaped like p: a collective
                                       # (every rank calls it, for the same parameters in the same order)

DeepSpeed's `safe_get_local_grad` / `safe_get_full_grad` (deepspeed/utils/tensor_fragment.py) and
FSDP2's sharded `p.grad` (a DTensor, Shard(0)) answer the same need. Stages 0 and 1 keep whole
gradients in `p.grad`: stage 0 already averaged; stage 1 this rank's own, averaged only in step(),
so reading it here costs an all-reduce. Offloaded gradients live on the host: not offered.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist


class GradPiece(NamedTuple):
    """Elements [start, stop) of the flattened parameter's averaged gradient, held by this rank."""

    values: torch.Tensor
    start: int

    @property
    def stop(self) -> int:
        return self.start + self.values.numel()


def local_grad(optimizer, param: torch.Tensor) -> GradPiece | None:
    """This rank's part of param's averaged gradient: None if the optimizer does not train param
    (stages 0-1: or it has no .grad); stages 2-3 keep zeros for a parameter no rank's backward
    reached. Stages 0 and 1 give the whole gradient (start 0)."""
    stage = _stage(optimizer)
    if stage >= 2:
        found = _sharded(optimizer, param, stage)
        return None if found is None else found[0]
    if param.grad is None:
        return None
    grad = param.grad.reshape(-1)
    if stage == 1:  # not averaged until step(): average it here, on every rank
        grad = grad.clone()
        dist.all_reduce(grad)
        grad /= dist.get_world_size()
    return GradPiece(grad, 0)


def full_grad(optimizer, param: torch.Tensor) -> torch.Tensor | None:
    """The whole averaged gradient of param, shaped like it, on every rank (a collective: the
    ranks that hold its pieces add them up). None if the optimizer does not train param."""
    stage = _stage(optimizer)
    if stage < 2:
        piece = local_grad(optimizer, param)
        return None if piece is None else piece.values.view(param.shape)
    found = _sharded(optimizer, param, stage)
    if found is None:
        return None
    piece, shape = found
    full = piece.values.new_zeros(shape.numel())
    full[piece.start:piece.stop] = piece.values
    dist.all_reduce(full, group=getattr(optimizer, "shard_group", None))  # each element is on one rank only
    return full.view(shape)


def _stage(optimizer) -> int:
    if getattr(optimizer, "offloads", False):
        raise ValueError("an offloading optimizer keeps its gradient shards on the host, summed as they arrive: "
                         "per-parameter views are not offered; read optimizer.model_state_tensors('host')")
    if hasattr(optimizer, "units"):
        return 3
    if hasattr(optimizer, "grad_shards"):
        return 2
    return getattr(optimizer, "stage", 0)  # a torch optimizer beside stage 0's wrapper: whole, averaged


def _sharded(optimizer, param, stage: int) -> tuple[GradPiece, torch.Size] | None:
    """(this rank's piece of param's gradient shard, param's whole shape), or None if not trained.
    Every rank has a piece of every trained parameter, empty where its shard holds none of it."""
    if stage == 2:
        if id(param) not in optimizer.master_offsets:
            return None
        group, offset = optimizer.master_offsets[id(param)]
        shard = next(shard for g, shard in zip(optimizer.groups, optimizer.grad_shards) if g is group)
        start, stop = group.layout.shard(optimizer.rank)
        lo, hi = max(offset, start), min(offset + param.numel(), stop)
        piece = GradPiece(shard[lo - start:hi - start], lo - offset) if lo < hi else GradPiece(shard[:0], 0)
        return piece, param.shape
    for unit in optimizer.units:  # stage 3: the parameter itself is empty between steps
        for piece in unit.slices:
            if piece.param is param:
                values = unit.grad_shard[piece.shard_offset:piece.shard_offset + piece.master.numel()]
                return GradPiece(values, piece.param_offset), next(shape for p, shape in zip(unit.params, unit.shapes) if p is param)
    return None
