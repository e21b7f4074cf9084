# Generated from solutions/05_zero3/05_zero3.ipynb by `zero-lab build`: edit the notebook, not this file.

"""ZeRO stage 3's sharding units (lesson 05): what a unit holds and the collectives on it.

ShardSlice            where one parameter lies in its unit's flat buffer and in this rank's shard
Unit                  one sharding unit: its flat padded buffer, shard, fp32 master, gradient shard
sharding_units        which module owns which parameter: bottom-up, tied weights to their first owner
gather_unit           give the flat buffer its storage back and all-gather every rank's shard into it
free_unit             release the gathered buffer for real (storage resized to 0)
RegatherForBackward   an identity on a module's outputs whose backward gathers the module's units again
reduce_scatter_unit   the mean gradient of this rank's shard of a unit, added into its gradient shard
build_unit            shard one unit's weights: shard, master, gradient shard, one slice per parameter
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from zero_lab.zero1 import MASTER_DTYPE, ShardLayout, param_views


class ShardSlice(NamedTuple):
    """A trainable parameter's elements in this rank's shard: the inner optimizer's tensor for it."""

    param: torch.nn.Parameter
    master: torch.Tensor  # a view of the unit's fp32 master (empty if the shard holds none of the parameter)
    shard_offset: int  # where it starts in the shard
    param_offset: int  # where it starts in the flattened parameter


@dataclass(eq=False)
class Unit:
    """One sharding unit: the parameters one module owns, laid out in one flat padded buffer.

    flat is the whole padded buffer in the compute dtype; while the unit is gathered the
    parameters are views into it, otherwise its storage has size 0 and the parameters are empty
    tensors. shard is this rank's part of it, the only copy of the unit's weights the rank always
    holds. The optimizer fills in the rest of the unit's state (master, grad_shard, slices).
    """

    name: str  # the owning module's name ("" for the root)
    params: list[torch.nn.Parameter]  # in flat-buffer order
    layout: ShardLayout
    flat: torch.Tensor
    shard: torch.Tensor
    master: torch.Tensor | None = None  # fp32 copy of the shard (the shard itself in fp32)
    grad_shard: torch.Tensor | None = None  # this rank's part of the mean gradient (None: nothing trainable)
    slices: list[ShardSlice] = field(default_factory=list)  # one per trainable parameter
    work: dist.Work | None = None  # the all-gather in flight, if it was started asynchronously
    holders: int = 0  # module calls of the forward pass that are using the gathered unit
    ready: set = field(default_factory=set)  # trainable parameters whose gradient is final in this backward
    had_grad: set = field(default_factory=set)  # trainable parameters that got a gradient since zero_grad
    shapes: list[torch.Size] = field(init=False)

    def __post_init__(self):
        self.shapes = [p.shape for p in self.params]

    def is_gathered(self) -> bool:
        """True from the start of its all-gather until it is freed."""
        return self.flat.untyped_storage().nbytes() > 0

    def show_params(self) -> None:
        """Make every parameter a view into flat with its own shape (after flat got its storage)."""
        for p, view in zip(self.params, self.views_of(self.flat)):
            p.data = view  # .data: the parameter keeps its identity, hooks and version counter

    def hide_params(self) -> None:
        """Make every parameter an honest empty tensor (shape (0,)), so that reading it between
        steps gives nothing instead of touching freed memory (DeepSpeed shows its partitioned
        parameters the same way)."""
        for p in self.params:
            p.data = self.flat[:0]

    def views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views into a buffer laid out like flat, with the parameters' shapes."""
        views, offset = [], 0
        for shape in self.shapes:
            views.append(flat[offset:offset + shape.numel()].view(shape))
            offset += shape.numel()
        return views


def sharding_units(model: torch.nn.Module, is_unit: Callable[[torch.nn.Module], bool]) -> list[tuple]:
    """Which module owns which parameter, and which modules use parameters owned elsewhere.

    The root and every module for which is_unit(module) is true are unit modules. A unit module
    owns the parameters of its subtree that no unit module below it owns (bottom-up: children
    first), so the root holds the leftovers. A parameter reached from two unit modules (tied
    weights) belongs to the first of them; the other one *uses* that unit.
    Returns, per unit module in bottom-up order: (name, module, owned parameters, names of the
    unit modules whose units it uses besides its own).
    """
    owner, result = {}, []

    def visit(name, module):
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        if module is not model and not is_unit(module):
            return
        owned, uses = [], []
        for p in local_parameters(module, is_unit, root=module):
            if p not in owner:
                owner[p] = name
                owned.append(p)
            elif owner[p] != name and owner[p] not in uses:
                uses.append(owner[p])
        result.append((name, module, owned, uses))

    visit("", model)
    return result


def default_is_unit(module: torch.nn.Module) -> bool:
    """The default units: every module that registers parameters of its own (Linear, LayerNorm, ...)."""
    return any(True for _ in module.parameters(recurse=False))


def local_parameters(module, is_unit, root) -> list[torch.nn.Parameter]:
    """The parameters of module's subtree, without descending into unit modules below `root`."""
    params = list(module.parameters(recurse=False))
    for child in module.children():
        if not is_unit(child):
            params += local_parameters(child, is_unit, root)
    return list(dict.fromkeys(params))  # a parameter registered twice counts once


def gather_unit(unit: Unit, async_op: bool = False, group=None) -> dist.Work | None:
    """All-gather every rank's unit.shard into unit.flat, giving flat its storage back first.

    The parameters are views into flat, so afterwards they hold the whole unit. With async_op
    the all-gather is started and its handle returned (wait on it before using the parameters).
    The ranks are those of `group` (None: all; lesson 17 passes a mesh's data-parallel group).
    """
    unit.flat.untyped_storage().resize_(unit.flat.numel() * unit.flat.element_size())
    with torch.no_grad():
        return dist.all_gather_single(unit.flat, unit.shard, group=group, async_op=async_op)


def free_unit(unit: Unit) -> None:
    """Release the memory of the gathered unit; its parameters keep their shapes, not their data."""
    unit.flat.untyped_storage().resize_(0)


class RegatherForBackward(torch.autograd.Function):
    """Identity on a module's output tensors; its backward runs before the module's own backward.

    forward(ctx, before_backward, *outputs) returns the outputs unchanged (as new tensors);
    backward calls before_backward() once, then passes the gradients through.
    """

    @staticmethod
    def forward(ctx, before_backward, *outputs):
        ctx.before_backward = before_backward
        return tuple(t.view_as(t) for t in outputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.before_backward()
        return (None, *grads)


def regather_before_backward(outputs, before_backward: Callable[[], None]):
    """The module's outputs (any nesting of tuples, lists, dicts), with their tensors that
    require grad passed through RegatherForBackward."""
    leaves, spec = tree_flatten(outputs)
    positions = [i for i, leaf in enumerate(leaves) if torch.is_tensor(leaf) and leaf.requires_grad]
    if not positions:
        return outputs
    wrapped = RegatherForBackward.apply(before_backward, *(leaves[i] for i in positions))
    for i, tensor in zip(positions, wrapped):
        leaves[i] = tensor
    return tree_unflatten(leaves, spec)


@torch.no_grad()
def reduce_scatter_unit(unit: Unit, grad_shard: torch.Tensor, group=None) -> None:
    """Add this rank's shard of the data-parallel mean of the unit's gradients into grad_shard.

    Copies every parameter's .grad into one padded flat buffer (zeros for parameters without a
    gradient and for the padding), frees the full-size .grad, reduce-scatters the buffer and
    adds the received sum, divided by the number of ranks, into grad_shard. The ranks are those
    of `group` (None: all).
    """
    pieces = [p.grad.reshape(-1) if p.grad is not None else grad_shard.new_zeros(shape.numel())
              for p, shape in zip(unit.params, unit.shapes)]  # shapes: a freed unit's parameters are empty
    padding = grad_shard.new_zeros(unit.layout.padded_numel - unit.layout.numel)
    flat_grad = torch.cat([*pieces, padding])  # one pass: no zero-filled buffer to copy into
    for p in unit.params:
        p.grad = None
    received = torch.empty_like(grad_shard)
    dist.reduce_scatter_single(received, flat_grad, group=group)
    grad_shard += received.div_(dist.get_world_size(group))  # divided in place: no temporary


@torch.no_grad()
def build_unit(name: str, params: list[torch.nn.Parameter], names: dict, param_dtype: torch.dtype | None,
               init_fn: Callable[[str, torch.Tensor], None] | None, group=None, start_group=None) -> Unit:
    """Shard one unit over the ranks of `group` (None: all ranks): its full fp32 weights (rank 0's,
    broadcast, or made by init_fn for meta parameters) exist only inside this call; the Unit keeps
    this rank's shard, its fp32 master, a gradient shard and one ShardSlice per trainable parameter.
    start_group: the ranks that start from its first rank's weights (None: all, rank 0's).
    Meta parameters are replaced by new ones in unit.params (the caller puts those into the modules)."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    layout = ShardLayout(sum(p.numel() for p in params), world_size)
    on_meta = any(p.device.type == "meta" for p in params)
    device = params[0].device if not on_meta else torch.get_default_device()  # prepare(device=) sets it
    full = torch.zeros(layout.padded_numel, dtype=MASTER_DTYPE, device=device)  # one unit at a time
    for p, view in zip(params, param_views(full, params)):
        if p.device.type != "meta":
            view.copy_(p.detach())
        elif init_fn is not None:
            init_fn(names[p], view)
        else:
            raise ValueError(f"{names[p]} is on the meta device: pass init_fn to make its weights")
    if not on_meta:
        first = dist.get_global_rank(start_group, 0) if start_group is not None else 0
        dist.broadcast(full, src=first, group=start_group)  # every rank starts from rank 0's weights, as in DDP
    start, stop = layout.shard(rank)
    master = full[start:stop].clone()
    compute_dtype = param_dtype or params[0].dtype
    shard = master if compute_dtype == MASTER_DTYPE else master.to(compute_dtype)
    flat = torch.empty(layout.padded_numel, dtype=compute_dtype, device=device)
    params = [p if p.device.type != "meta" else  # a meta tensor cannot take data: a new parameter replaces it
              torch.nn.Parameter(torch.empty(p.shape, dtype=compute_dtype, device=device), requires_grad=p.requires_grad)
              for p in params]
    unit = Unit(name, params, layout, flat, shard, master=master)
    offset = 0
    for p in params:
        if p.requires_grad:  # the parameter's elements [offset, offset + numel) that fall in [start, stop)
            lo, hi = min(max(offset, start), stop), min(max(offset + p.numel(), start), stop)
            unit.slices.append(ShardSlice(p, master[lo - start:hi - start], lo - start, lo - offset))
        offset += p.numel()
    unit.grad_shard = torch.zeros_like(shard) if unit.slices else None
    unit.hide_params()
    flat.untyped_storage().resize_(0)  # not gathered until a hook needs it
    return unit
