# Generated from solutions/14_zero_r/14_zero_r.ipynb by `zero-lab build`: edit the notebook, not this file.

"""ZeRO-R (ZeRO paper §6): the residual states — activations, temporary buffers, fragmentation.

TensorParallelMLP          one rank's slice of Linear-GeLU-Linear (column-, then row-parallel, one all-reduce)
partition_checkpoint       P_a: this rank's 1/Nm slice of an activation, zero-padded to whole slices
gather_checkpoint          P_a: the whole activation back from the Nm slices (one all-gather)
PartitionedCheckpoint      P_a: recompute a block in backward, keeping only 1/Nm of its input (P_a+cpu: on the host)
saved_bytes                bytes autograd keeps for backward while a function runs (parameters left out)
bytes_during               bytes of the tensors a function creates: the most alive at once, and in all
fused_all_reduce           average gradients through one buffer holding them all (4Ψ bytes in fp32)
bucketed_all_reduce        C_B: the same average through one buffer of constant size
FirstFitAllocator          a model of a device allocator (first fit), to see fragmentation
ContiguousBuffer           M_D: one pre-allocated buffer; long-lived tensors are copied into views of it
keep_gradients_contiguous  M_D for gradients: each .grad moved into the buffer as backward produces it
residual_trace             a forward pass in the allocator model, with and without M_D
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class _CopyToModelParallel(torch.autograd.Function):
    """Megatron's f: identity forward; backward sums the input's gradient over the MP ranks."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromModelParallel(torch.autograd.Function):
    """Megatron's g: forward sums the partial outputs over the MP ranks; backward is the identity."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TensorParallelMLP(nn.Module):
    """This rank's slice of `mlp` = Sequential(Linear(h, f), GELU(), Linear(f, h)) over the MP group.

    fc1's weight and bias split by output feature, fc2's weight by input feature (uneven allowed);
    fc2's bias stays whole and is added once, after the all-reduce.
    """

    def __init__(self, mlp: nn.Sequential, group=None):
        super().__init__()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        fc1, fc2 = mlp[0], mlp[2]
        part = lambda tensor, dim: nn.Parameter(tensor.detach().tensor_split(size, dim)[rank].clone())
        self.w1, self.b1, self.w2 = part(fc1.weight, 0), part(fc1.bias, 0), part(fc2.weight, 1)
        self.b2 = nn.Parameter(fc2.bias.detach().clone())
        self.group = group

    def forward(self, x):
        x = _CopyToModelParallel.apply(x, self.group)
        hidden = F.gelu(F.linear(x, self.w1, self.b1))
        return _ReduceFromModelParallel.apply(F.linear(hidden, self.w2), self.group) + self.b2


def partition_checkpoint(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank's slice of x flattened and zero-padded to a multiple of world_size: ceil(numel / Nm) elements, its own storage."""
    per_rank = -(-x.numel() // world_size)
    padded = x.new_zeros(per_rank * world_size)
    padded[:x.numel()] = x.detach().reshape(-1)
    return padded[rank * per_rank:(rank + 1) * per_rank].clone()


def gather_checkpoint(shard: torch.Tensor, shape, group=None) -> torch.Tensor:
    """The activation of `shape` from every rank's slice (one all-gather, rank order), padding dropped."""
    gathered = shard.new_empty(shard.numel() * dist.get_world_size(group))
    dist.all_gather_single(gathered, shard.contiguous(), group=group)
    return gathered[:math.prod(shape)].view(shape)


class PartitionedCheckpoint(torch.autograd.Function):
    """P_a: keep only this rank's 1/Nm slice of the block's input (on offload_device for P_a+cpu);
    backward gathers the input, recomputes the block and backpropagates through it."""

    @staticmethod
    def forward(ctx, x, block, group, offload_device):
        ctx.block, ctx.group, ctx.shape, ctx.device = block, group, x.shape, x.device
        shard = partition_checkpoint(x, dist.get_rank(group), dist.get_world_size(group))
        ctx.save_for_backward(shard if offload_device is None else shard.to(offload_device))
        return block(x)

    @staticmethod
    def backward(ctx, grad_out):
        shard, = ctx.saved_tensors
        x = gather_checkpoint(shard.to(ctx.device), ctx.shape, ctx.group).detach().requires_grad_()
        with torch.enable_grad():
            out = ctx.block(x)
        torch.autograd.backward(out, grad_out)
        return x.grad, None, None, None


def checkpointed(block: nn.Module, x: torch.Tensor, group=None, offload_device=None) -> torch.Tensor:
    """block(x), keeping 1/Nm of x for backward (x must require grad); offload_device="cpu" for P_a+cpu."""
    return PartitionedCheckpoint.apply(x, block, group, offload_device)


def saved_bytes(fn, *args, **kwargs) -> tuple[object, int]:
    """(fn(*args, **kwargs), bytes of the tensors autograd saved for backward meanwhile, parameters left out)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn(*args, **kwargs)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
                if not isinstance(t, nn.Parameter)}
    return out, sum(storages.values())


from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _NewStorages(TorchDispatchMode):
    """Every storage an operator returns that none of its inputs had: its bytes while it lives."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.allocated = [], 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = lambda tree: [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in tensors((args, kwargs))}
        self.live = [(ref, nbytes) for ref, nbytes in self.live if not ref.expired()]
        for tensor in tensors(out):
            storage = tensor.untyped_storage()
            ref = StorageWeakRef(storage)
            if storage.data_ptr() not in inputs and all(ref.cdata != known.cdata for known, _ in self.live):
                self.live.append((ref, storage.nbytes()))
                self.allocated += storage.nbytes()
        self.peak = max(self.peak, sum(nbytes for _, nbytes in self.live))
        return out


def bytes_during(fn, *args, **kwargs) -> tuple[object, int, int]:
    """(fn(*args, **kwargs), peak, allocated): bytes of the tensors fn creates, the most alive at once and in all."""
    with _NewStorages() as counter:
        out = fn(*args, **kwargs)
    return out, counter.peak, counter.allocated


def fused_all_reduce(params, group=None) -> None:
    """Average every gradient over the group's ranks through one buffer holding them all (4Ψ bytes in fp32)."""
    grads = [p.grad for p in params if p.grad is not None]
    fused = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(fused, group=group)
    fused /= dist.get_world_size(group)
    for grad, averaged in zip(grads, fused.split([g.numel() for g in grads])):
        grad.copy_(averaged.view_as(grad))


def bucketed_all_reduce(params, bucket_numel: int, group=None) -> None:
    """C_B: every gradient averaged over the group's ranks through one buffer of bucket_numel elements."""
    grads = [p.grad.view(-1) for p in params if p.grad is not None]
    bucket = grads[0].new_empty(bucket_numel)
    pending, fill = [], 0  # pending: (flat gradient, its offset, count, offset in the bucket)

    def flush():
        dist.all_reduce(bucket[:fill], group=group)
        bucket[:fill] /= dist.get_world_size(group)
        for grad, start, count, at in pending:
            grad[start:start + count] = bucket[at:at + count]
        pending.clear()

    for grad in grads:
        done = 0
        while done < grad.numel():
            count = min(bucket_numel - fill, grad.numel() - done)
            bucket[fill:fill + count] = grad[done:done + count]
            pending.append((grad, done, count, fill))
            fill, done = fill + count, done + count
            if fill == bucket_numel:
                flush()
                fill = 0
    if fill:
        flush()


class FirstFitAllocator:
    """A model of a device allocator over [0, capacity) bytes: first fit, frees merged with their neighbours.

    holes: the free ranges (start, size), sorted, never touching; blocks: {start: (size, label)} of live ones.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.holes: list[tuple[int, int]] = [(0, capacity)]
        self.blocks: dict[int, tuple[int, str]] = {}

    def allocate(self, size: int, label: str = "") -> int | None:
        """The start of `size` bytes at the lowest address that fits, or None when no hole is large enough."""
        if size <= 0:
            raise ValueError(f"allocate a positive number of bytes, got {size}")
        for index, (start, hole) in enumerate(self.holes):
            if hole >= size:
                self.holes[index:index + 1] = [(start + size, hole - size)] if hole > size else []
                self.blocks[start] = (size, label)
                return start
        return None

    def free(self, start: int) -> None:
        """Give back the block at `start`; its range joins the holes next to it."""
        if start not in self.blocks:
            raise ValueError(f"no allocation starts at {start}: free an address allocate returned, once")
        size, _ = self.blocks.pop(start)
        merged = []
        for hole_start, hole in sorted(self.holes + [(start, size)]):
            if merged and merged[-1][0] + merged[-1][1] == hole_start:
                merged[-1] = (merged[-1][0], merged[-1][1] + hole)
            else:
                merged.append((hole_start, hole))
        self.holes = merged

    def free_bytes(self) -> int:
        return sum(size for _, size in self.holes)

    def largest_hole(self) -> int:
        return max((size for _, size in self.holes), default=0)


def residual_trace(capacity: int, layers: int, temporaries=(8, 28), kept: int = 16, contiguous: bool = False):
    """A forward pass in the allocator model (bytes): each layer's two sub-blocks (attention, MLP) allocate a
    temporary, produce a long-lived fp32 checkpoint of `kept` bytes and free the temporary. Without M_D the
    checkpoint stays where it was produced; with it, it is copied into a ContiguousBuffer reserved before the
    pass and freed. Returns (allocator, the checkpoints, the buffer or None)."""
    allocator = FirstFitAllocator(capacity)
    buffer = ContiguousBuffer(layers * len(temporaries) * kept // 4, allocator=allocator) if contiguous else None
    checkpoints = []
    for layer in range(layers):
        for temporary in temporaries:
            scratch = allocator.allocate(temporary, "temporary")
            checkpoint = torch.full((kept // 4,), float(layer))
            produced = allocator.allocate(checkpoint.nbytes, f"kept {layer}")
            if buffer is not None:
                checkpoint = buffer.keep(checkpoint)
                allocator.free(produced)
            checkpoints.append(checkpoint)
            allocator.free(scratch)
    return allocator, checkpoints, buffer


class ContiguousBuffer:
    """M_D: one buffer reserved up front; long-lived tensors are copied into consecutive views of it.

    flat: the buffer (1-D, numel elements); start: its address in the allocator model (None without one);
    used: the elements handed out since the last reset.
    """

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32, allocator: FirstFitAllocator | None = None):
        self.flat = torch.empty(numel, dtype=dtype)
        self.used, self.start = 0, None
        if allocator is not None:
            self.start = allocator.allocate(self.flat.nbytes, "contiguous buffer")
            if self.start is None:
                raise MemoryError(f"no {self.flat.nbytes} contiguous bytes for the buffer: reserve it before the "
                                  "temporaries fragment memory")

    @torch.no_grad()
    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        """A view of the buffer right after the ones kept before, with the tensor's shape and values."""
        if self.used + tensor.numel() > self.flat.numel():
            raise MemoryError(f"{tensor.numel()} elements do not fit: {self.flat.numel() - self.used} of "
                              f"{self.flat.numel()} left; reserve more for the long-lived tensors")
        view = self.flat[self.used:self.used + tensor.numel()].view(tensor.shape)
        view.copy_(tensor)
        self.used += tensor.numel()
        return view

    def reset(self) -> None:
        """The next step's tensors reuse the buffer from its start."""
        self.used = 0

    def address(self, view: torch.Tensor) -> int:
        """A view's address in the allocator model."""
        return self.start + view.storage_offset() * view.element_size()


def keep_gradients_contiguous(params, buffer: ContiguousBuffer) -> list:
    """M_D for gradients: each parameter's .grad copied into `buffer` when backward produces it; the hook handles."""
    def place(param):
        if param.grad.untyped_storage().data_ptr() != buffer.flat.untyped_storage().data_ptr():
            param.grad = buffer.keep(param.grad)

    return [p.register_post_accumulate_grad_hook(place) for p in params if p.requires_grad]
