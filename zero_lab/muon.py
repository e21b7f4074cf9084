# Generated from solutions/12_muon/12_muon.ipynb by `zero-lab build`: edit the notebook, not this file.

"""Muon under ZeRO stage 1: an optimizer whose update needs whole matrices, sharded two ways.

newton_schulz        the orthogonalisation of one 2-D matrix, as torch.optim.Muon computes it (in bf16)
momentum_direction_  Nesterov momentum: element-wise, so it runs on any shard
adjust_lr, apply_update_  decoupled weight decay and the scaled step: element-wise, given the matrix's shape
muon_step_           single-process Muon over whole matrices (= torch.optim.Muon)
split_params         2-D hidden weights to Muon; embeddings (the tied LM head), norms and biases to AdamW
GatherMuon           way 1: momentum in ZeRO-1's flat shards; the direction all-gathered, whole matrices on every rank
assign_owners, OwnerLayout, OwnerMuon
                     way 2: each rank owns whole matrices (balanced by size); gradients reduce-scattered to
                     their owners, only owners orthogonalise, the updated matrices all-gathered
muon_bytes_per_step, ns_flops_per_rank   what each way sends and computes per rank and step
MuonZero1            the hybrid optimizer zero_lab.prepare(model, torch.optim.Muon, stage=1, muon_sharding=...) builds
"""

import math
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.distributed as dist

from zero_lab.zero1 import (ShardLayout, Zero1Optimizer, all_gather_params, flatten_params_, param_views,
                            reduce_scatter_mean)

NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's (a, b, c)
NS_STEPS, NS_EPS = 5, 1e-7


def muon_defaults(**options) -> dict:
    """torch.optim.Muon's hyperparameters with `options` applied (checked by torch.optim.Muon itself):
    lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn."""
    return dict(torch.optim.Muon([torch.zeros(1, 1, requires_grad=True)], **options).defaults)


def ns_flops(shape, steps: int = NS_STEPS) -> int:
    """FLOPs of newton_schulz on a matrix of `shape` (2 per multiply-add), with m <= n its short and
    long side: per step X Xᵀ (2m²n), gram @ gram (2m³) and update @ X (2m²n)."""
    m, n = sorted(shape)
    return steps * (4 * m * m * n + 2 * m ** 3)


def newton_schulz(matrix: torch.Tensor, coefficients=NS_COEFFICIENTS, steps: int = NS_STEPS,
                  eps: float = NS_EPS) -> torch.Tensor:
    """The orthogonalised `matrix` (bf16, same shape), computed exactly as torch.optim.Muon does."""
    a, b, c = coefficients
    tall = matrix.size(0) > matrix.size(1)
    x = matrix.bfloat16()
    if tall:
        x = x.T  # the Gram matrix of the short side is the small one
    x = x / x.norm().clamp(min=eps)  # Frobenius norm <= 1, so every singular value is <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def momentum_direction_(grad: torch.Tensor, buffer: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """Update the momentum `buffer` in place with `grad`; return the direction to orthogonalise."""
    buffer.lerp_(grad, 1 - momentum)
    return grad.lerp(buffer, momentum) if nesterov else buffer


def adjust_lr(lr: float, adjust_lr_fn: str | None, shape) -> float:
    """The learning rate of the orthogonalised step for a matrix of `shape` (rows, columns)."""
    rows, columns = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / columns))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, columns))
    return lr


def apply_update_(param: torch.Tensor, ortho: torch.Tensor, shape, lr: float, weight_decay: float,
                  adjust_lr_fn: str | None) -> None:
    """Decoupled weight decay, then the step along `ortho`, on `param` (a whole matrix of `shape`, or
    any slice of it with the same slice of `ortho`)."""
    param.mul_(1 - lr * weight_decay)
    param.add_(ortho, alpha=-adjust_lr(lr, adjust_lr_fn, shape))


@torch.no_grad()
def muon_step_(params, grads, buffers, group: dict) -> None:
    """One step of single-process Muon over whole matrices; `group` holds torch.optim.Muon's hyperparameters."""
    for param, grad, buffer in zip(params, grads, buffers):
        direction = momentum_direction_(grad, buffer, group["momentum"], group["nesterov"])
        ortho = newton_schulz(direction, group["ns_coefficients"], group["ns_steps"], group["eps"])
        apply_update_(param, ortho, param.shape, group["lr"], group["weight_decay"], group["adjust_lr_fn"])


def split_params(model: torch.nn.Module, params=None) -> tuple[list, list]:
    """(matrices for Muon, the rest for AdamW) among the trainable `params` (default: the model's)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    heads = {id(p) for name, p in model.named_parameters() if name.startswith("lm_head")}
    matrices, others = [], []
    for p in model.parameters() if params is None else params:
        if p.requires_grad:
            whole_matrix = p.ndim == 2 and id(p) not in embeddings | heads
            (matrices if whole_matrix else others).append(p)
    return matrices, others


def grads_into_(params, views) -> None:
    """Make each parameter's .grad its view into a flat gradient buffer again (model.zero_grad() sets
    them to None, and the next backward makes fresh tensors: copied in, not silently dropped)."""
    for p, view in zip(params, views):
        if p.grad is None or p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad) if p.grad is not None else view.zero_()
            p.grad = view


class GatherMuon:
    """Way 1, Muon on ZeRO-1's flat shards. The matrices live in one flat buffer cut into N equal shards
    (zero_lab.zero1); rank r keeps the momentum of shard r only. A step: reduce-scatter the gradients,
    momentum on my shard, all-gather every shard's direction (whole matrices on every rank),
    orthogonalise the matrices my shard touches, update my shard, all-gather the parameters."""

    def __init__(self, params, group: dict):
        self.params, self.group = list(params), group  # group: torch.optim.Muon's hyperparameters
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.flat_param, self.layout = flatten_params_(self.params, self.world_size)
        dist.broadcast(self.flat_param, src=0)  # every rank starts from rank 0's weights, as in DDP
        self.flat_grad = torch.zeros_like(self.flat_param)
        self.grad_views = param_views(self.flat_grad, self.params)
        grads_into_(self.params, self.grad_views)  # backward accumulates into the flat buffer
        self.offsets = list(accumulate(p.numel() for p in self.params[:-1]))
        self.offsets.insert(0, 0)  # where each matrix starts in the flat buffer
        start, stop = self.layout.shard(self.rank)
        self.master = self.flat_param[start:stop]  # my shard of the weights (fp32: a view, no copy)
        self.momentum = torch.zeros_like(self.master)  # 1/N of the momentum

    def pieces(self):
        """What step() needs to know about each matrix my shard touches: yours to design."""
        first, last = self.layout.shard(self.rank)
        for p, offset in zip(self.params, self.offsets):
            lo, hi = max(offset, first), min(offset + p.numel(), last)
            if lo < hi:  # my shard holds [lo, hi) of the flat buffer; the matrix starts at offset
                yield p, offset, lo, hi

    @torch.no_grad()
    def step(self) -> None:
        grads_into_(self.params, self.grad_views)
        g, start = self.group, self.layout.shard(self.rank)[0]
        grad = reduce_scatter_mean(self.flat_grad)  # my shard of the mean gradient
        direction = momentum_direction_(grad, self.momentum, g["momentum"], g["nesterov"])  # element-wise
        whole = torch.empty_like(self.flat_param)
        dist.all_gather_single(whole, direction)  # every matrix's direction, whole, on every rank
        for p, offset, lo, hi in self.pieces():
            ortho = newton_schulz(whole[offset:offset + p.numel()].view_as(p), g["ns_coefficients"], g["ns_steps"],
                                  g["eps"])
            apply_update_(self.master[lo - start:hi - start], ortho.reshape(-1)[lo - offset:hi - offset], p.shape,
                          g["lr"], g["weight_decay"], g["adjust_lr_fn"])
        all_gather_params(self.flat_param, self.master)  # everybody's updated shard

    def zero_grad(self) -> None:
        self.flat_grad.zero_()

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """For zero_lab.memory_ledger: the momentum this rank holds."""
        return {"optimizer_states": [self.momentum]}


def assign_owners(numels: list[int], world_size: int) -> list[int]:
    """The rank that owns each matrix: the largest first, each to the rank with the fewest elements so
    far (ties: the matrix listed first, the lower rank)."""
    loads, owners = [0] * world_size, [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        owners[i] = min(range(world_size), key=lambda rank: loads[rank])
        loads[owners[i]] += numels[i]
    return owners


@dataclass(frozen=True)
class OwnerLayout:
    """Whole matrices grouped by owner: rank r's matrices, in their order, fill segment r of a flat buffer
    of N equal segments, each as long as the largest load (the others end in padding)."""

    numels: tuple[int, ...]
    owners: tuple[int, ...]
    world_size: int

    def load(self, rank: int) -> int:
        """Elements of the matrices `rank` owns."""
        return sum(n for n, owner in zip(self.numels, self.owners) if owner == rank)

    @property
    def segment_numel(self) -> int:
        return max(self.load(rank) for rank in range(self.world_size))

    @property
    def padded_numel(self) -> int:
        return self.segment_numel * self.world_size

    def offsets(self) -> list[int]:
        """Where each matrix starts in the flat buffer."""
        free = [rank * self.segment_numel for rank in range(self.world_size)]  # next free element per segment
        offsets = []
        for numel, owner in zip(self.numels, self.owners):
            offsets.append(free[owner])
            free[owner] += numel
        return offsets


class OwnerMuon:
    """Way 2, whole-matrix ownership. Rank r owns whole matrices (assign_owners) and keeps their momentum
    only. A step: reduce-scatter the gradients so that each owner receives its matrices whole, momentum and
    orthogonalisation by the owner alone, all-gather the updated matrices from their owners."""

    def __init__(self, params, group: dict):
        self.params, self.group = list(params), group
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        numels = [p.numel() for p in self.params]
        self.layout = OwnerLayout(tuple(numels), tuple(assign_owners(numels, self.world_size)), self.world_size)
        self.offsets = self.layout.offsets()
        self.flat_param = torch.zeros(self.layout.padded_numel, dtype=self.params[0].dtype)
        self.flat_grad = torch.zeros_like(self.flat_param)
        self.grad_views = [self.flat_grad[o:o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets)]
        for p, offset in zip(self.params, self.offsets):
            view = self.flat_param[offset:offset + p.numel()].view_as(p)
            view.copy_(p.detach())
            p.data = view  # the model's matrices live in the flat buffer, grouped by owner
        dist.broadcast(self.flat_param, src=0)
        grads_into_(self.params, self.grad_views)
        self.owned = [i for i, owner in enumerate(self.layout.owners) if owner == self.rank]
        self.momentum = {i: torch.zeros_like(self.params[i]) for i in self.owned}  # whole matrices, mine only

    @torch.no_grad()
    def step(self) -> None:
        grads_into_(self.params, self.grad_views)
        g, segment = self.group, self.layout.segment_numel
        start = self.rank * segment
        grads = reduce_scatter_mean(self.flat_grad)  # segment r: the mean gradients of the matrices I own
        for i in self.owned:
            p, offset = self.params[i], self.offsets[i] - start
            direction = momentum_direction_(grads[offset:offset + p.numel()].view_as(p), self.momentum[i],
                                            g["momentum"], g["nesterov"])
            ortho = newton_schulz(direction, g["ns_coefficients"], g["ns_steps"], g["eps"])
            apply_update_(p, ortho, p.shape, g["lr"], g["weight_decay"], g["adjust_lr_fn"])
        all_gather_params(self.flat_param, self.flat_param[start:start + segment])  # from their owners to all

    def zero_grad(self) -> None:
        self.flat_grad.zero_()

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"optimizer_states": list(self.momentum.values())}


MUON_SHARDINGS = {"gather": GatherMuon, "own": OwnerMuon}


def muon_and_adamw_params(model, params=None) -> tuple[list, list]:
    """split_params for an optimizer under ZeRO: refuses param groups (the split makes the groups) and a model
    without a matrix for Muon."""
    if params is not None and any(isinstance(p, dict) for p in params):
        raise ValueError("Muon under ZeRO takes a list of tensors (it splits them into matrices and the rest "
                         "itself), not param groups")
    matrices, others = split_params(model, params)
    if not matrices:
        raise ValueError("no 2-D hidden weight to give Muon: use torch.optim.AdamW")
    return matrices, others


class MuonZero1(torch.optim.Optimizer):
    """ZeRO stage 1 with Muon for the hidden matrices and AdamW (lesson 03's Zero1Optimizer) for the rest.

    zero_lab.prepare(model, torch.optim.Muon, stage=1, muon_sharding="gather" | "own", adamw={...}, lr=...)
    builds it. muon_sharding picks the way (GatherMuon, OwnerMuon); adamw= holds torch.optim.AdamW's options
    for the embeddings (the tied LM head), norms and biases (default: AdamW's defaults); every other option
    is torch.optim.Muon's. param_groups: the Muon group, then AdamW's (LR schedulers change both). fp32 only.
    """

    stage = 1

    def __init__(self, model, optimizer_class=torch.optim.Muon, params=None, *, muon_sharding="gather",
                 adamw=None, param_dtype=None, max_grad_norm=None, find_unused_parameters=False, **muon_options):
        if optimizer_class is not torch.optim.Muon:
            raise ValueError(f"MuonZero1 runs torch.optim.Muon, not {optimizer_class.__name__}")
        if muon_sharding not in MUON_SHARDINGS:
            raise ValueError(f"muon_sharding must be one of {sorted(MUON_SHARDINGS)} (gather: each matrix's "
                             f"direction all-gathered; own: whole matrices owned by ranks), got {muon_sharding!r}")
        given = {"param_dtype": param_dtype not in (None, torch.float32), "max_grad_norm": max_grad_norm is not None,
                 "find_unused_parameters": bool(find_unused_parameters)}
        if any(given.values()):
            raise TypeError(f"{sorted(k for k, v in given.items() if v)} are not built for Muon in this course "
                            "(lesson 12 trains in fp32, every parameter used, without clipping): leave them out")
        matrices, others = muon_and_adamw_params(model, params)
        defaults = muon_defaults(**muon_options)
        super().__init__([{"params": matrices, **defaults}], defaults)
        self.model = model
        self.muon = MUON_SHARDINGS[muon_sharding](matrices, self.param_groups[0])
        self.adamw = Zero1Optimizer(model, torch.optim.AdamW, others, **(adamw or {})) if others else None
        if self.adamw is not None:
            self.param_groups.extend(self.adamw.param_groups)  # the same dicts: a scheduler reaches AdamW too
        self.model_hooks = self.adamw.model_hooks if self.adamw is not None else []

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        if self.adamw is not None:
            self.adamw.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers in place (the .grad views must stay)."""
        self.muon.zero_grad()
        if self.adamw is not None:
            self.adamw.zero_grad()

    def state_dict(self):
        raise NotImplementedError("checkpoints of Muon under ZeRO are not built in this course (lesson 12); "
                                  "lesson 03's Zero1Optimizer shows how a sharded state_dict is written")

    def load_state_dict(self, state_dict) -> None:
        self.state_dict()

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this rank holds, for zero_lab.memory_ledger: AdamW's part (lesson 03) and Muon's."""
        tensors = self.adamw.model_state_tensors() if self.adamw is not None else {
            "parameters": list(self.model.parameters())}
        tensors["gradients"] = [self.muon.flat_grad, *tensors.get("gradients", [])]
        tensors["optimizer_states"] = [*self.muon.model_state_tensors()["optimizer_states"],
                                       *tensors.get("optimizer_states", [])]
        return tensors


def muon_bytes_per_step(way: str, numels: list[int], world_size: int, element_size: int = 4) -> int:
    """Bytes one rank sends in one step of the Muon matrices (ring convention), way "gather" or "own"."""
    if way == "gather":  # reduce-scatter, all-gather of the direction, all-gather of the parameters
        padded = ShardLayout(sum(numels), world_size).padded_numel
        return 3 * (world_size - 1) * (padded // world_size) * element_size
    layout = OwnerLayout(tuple(numels), tuple(assign_owners(numels, world_size)), world_size)
    return 2 * (world_size - 1) * layout.segment_numel * element_size  # reduce-scatter and all-gather of segments


def ns_flops_per_rank(way: str, shapes: list[tuple[int, int]], world_size: int) -> list[int]:
    """Newton–Schulz FLOPs each rank computes in one step (ns_flops of each matrix it orthogonalises)."""
    numels = [math.prod(shape) for shape in shapes]
    if way == "own":
        owners = assign_owners(numels, world_size)
        return [sum(ns_flops(s) for s, owner in zip(shapes, owners) if owner == rank) for rank in range(world_size)]
    layout, offsets = ShardLayout(sum(numels), world_size), [0, *accumulate(numels)]
    return [sum(ns_flops(s) for s, lo, n in zip(shapes, offsets, numels)
                if max(lo, layout.shard(rank)[0]) < min(lo + n, layout.shard(rank)[1])) for rank in range(world_size)]
