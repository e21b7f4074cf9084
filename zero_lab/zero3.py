# Generated from solutions/05_zero3/05_zero3.ipynb by `zero-lab build`: edit the notebook, not this file.

"""ZeRO stage 3 (P_os+g+p): parameters, gradients and optimizer states all partitioned.

Unit                  one sharding unit: its flat padded buffer, shard, fp32 master, gradient shard
sharding_units        which module owns which parameter: bottom-up, tied weights to their first owner
gather_unit           give the flat buffer its storage back and all-gather every rank's shard into it
free_unit             release the gathered buffer for real (storage resized to 0)
RegatherForBackward   an identity on a module's outputs whose backward gathers the module's units again
reduce_scatter_unit   the mean gradient of this rank's shard of a unit, added into its gradient shard
prefetch_plan         which units to start gathering now, by the recorded execution order
ExecutionOrder        the order of calls, recorded in the first step and checked on every rank after
UnitSchedule          the hooks that gather, free, re-gather and reduce-scatter each unit (extension
                      points all_gather, release, reduce_scatter: lessons 09 and 10 plug in there)
build_unit            shard one unit's weights: shard, master, gradient shard, one slice per parameter
ShardedModelState     leaving stage 3: gathered parameters, model state dicts, checkpoints
Zero3Optimizer        the slim optimizer: builds the units and the schedule, steps the shards

Every rank keeps only its shard of every unit (2 Psi / Nd bytes of bf16 parameters), of the
gradients (2 Psi / Nd) and of the fp32 masters and Adam states (12 Psi / Nd): 16 Psi / Nd bytes with
mixed precision (ZeRO paper, section 5.3). A unit is all-gathered before its module's forward,
freed after it, gathered again before its backward, and its gradients are reduce-scattered as
soon as they are complete: 3 Psi of communication per step (section 7.2.2).
"""

import zlib
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from zero_lab.optim import OptimizerOverCopies, hold_gradients, weak_hook
from zero_lab.zero1 import MASTER_DTYPE, ShardLayout, clip_grad_norm_, gather_shards, param_groups_of, param_views


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


def prefetch_plan(order: list[list[int]], position: int, depth: int, resident: set[int],
                  numels: list[int], live_numel: int, max_live_numel: int | None = None) -> list[int]:
    """The units to start all-gathering at call `position` of the recorded order.

    order[i] lists the units that call i needs. Take the units of the next `depth` calls
    (position + 1, ...), in order, each once, skipping those already resident (gathered or in
    flight); stop before the first one that would bring the live gathered elements above
    max_live_numel (None: no cap).
    """
    plan = []
    for needed in order[position + 1:position + 1 + depth]:
        for unit in needed:
            if unit in resident or unit in plan:
                continue
            if max_live_numel is not None and live_numel + numels[unit] > max_live_numel:
                return plan
            plan.append(unit)
            live_numel += numels[unit]
    return plan


@contextmanager
def meta_parameters():
    """Inside, modules create their parameters on the meta device: shapes, no memory.

    Buffers (small, often computed, like a causal mask) are made as usual. Pass the model to
    Zero3Optimizer with an init_fn; each rank then materializes one unit at a time and keeps
    only its shard (DeepSpeed's zero.Init and FSDP2's meta-device initialization do the same).
    """
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def seeded_init(init: Callable[[str, torch.Tensor, torch.Generator], None], seed: int = 0):
    """An init_fn(name, tensor) that draws each parameter from a generator seeded by (seed, name):
    the same weights whatever the order or the rank that makes them. init(name, tensor,
    generator) fills tensor in place; apply it to an ordinary model with `init_model`."""
    def init_fn(name: str, tensor: torch.Tensor) -> None:
        generator = torch.Generator(device=tensor.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        with torch.no_grad():
            init(name, tensor, generator)
    return init_fn


@torch.no_grad()
def init_model(model: torch.nn.Module, init_fn: Callable[[str, torch.Tensor], None]) -> torch.nn.Module:
    """Initialize an ordinary (single-process) model's parameters with init_fn, by name."""
    for name, p in model.named_parameters():
        init_fn(name, p)
    return model


class ExecutionOrder:
    """The order of calls of the forward and the backward pass, the same on every rank.

    In the first step (or the first after invalidate()) each call is recorded and announced to
    the other ranks (a tiny all-gather, before the call's own collectives): a rank on another
    path is caught at once. From the next step on, each call is checked against the record.
    """

    PHASES = ("forward", "backward")

    def __init__(self, call_names: list[str], device: torch.device):
        self.call_names, self.device = call_names, device
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.invalidate()

    def invalidate(self) -> None:
        """Forget the record: the next step records the order again."""
        self.recorded = dict.fromkeys(self.PHASES)  # phase -> list of call indices, None until recorded
        self.recording = {phase: [] for phase in self.PHASES}
        self.position = dict.fromkeys(self.PHASES, -1)  # index of the current call in the pass

    def start_forward(self) -> None:
        self.position["forward"] = -1
        if self.recorded["forward"] is None:
            self.recording = {phase: [] for phase in self.PHASES}

    def end_backward(self) -> None:
        """After the first step, its order (checked call by call on every rank) is the record."""
        if self.recorded["forward"] is None:
            self.recorded = {phase: list(calls) for phase, calls in self.recording.items()}
        self.position = dict.fromkeys(self.PHASES, -1)

    def follow(self, phase: str, index: int) -> None:
        """Record call `index`, or check it against the record."""
        position = self.position[phase] = self.position[phase] + 1
        order = self.recorded[phase]
        if order is None:
            self.recording[phase].append(index)
            self._check_same_call(phase, position, index)
        elif position >= len(order) or order[position] != index:
            expected = f"'{self.call_names[order[position]]}'" if position < len(order) else "no call (it had ended)"
            raise RuntimeError(
                f"rank {self.rank}: call {position} of the {phase} pass is unit '{self.call_names[index]}', but the "
                f"execution order recorded in the first step (the same on every rank) has {expected} there. Every "
                "rank must run the same units in the same order, or the all-gathers no longer match and the ranks "
                "hang. If the order changed on purpose on every rank, call optimizer.invalidate_order() on every "
                "rank before that step: it is recorded again, without prefetching.")

    def _check_same_call(self, phase, position, index):
        mine = torch.tensor([self.PHASES.index(phase), position, index], device=self.device)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine)
        if any(not torch.equal(theirs, mine) for theirs in everyone):
            calls = "; ".join(f"rank {rank}: {self.PHASES[b]} call {k} '{self.call_names[i]}'"
                              for rank, (b, k, i) in enumerate(t.tolist() for t in everyone))
            raise RuntimeError(f"rank {self.rank}: the ranks ran different units in the first step ({calls}). Every "
                               "rank must run the same units in the same order, or their all-gathers do not match.")


class UnitSchedule:
    """When each unit is gathered, freed and reduced: module hooks that follow the recorded order.

    units are the model's Units; calls[i] = (module name, module, indices of the units it needs):
    every unit module, and every module that uses another unit (a tied head), is a call.

    Extension points (override in a subclass; lessons 09 and 10 plug in here):
      all_gather(unit, phase, async_op)  fill unit.flat with the whole unit from the shards; return
                                         the handle if async_op (its wait() must leave flat complete)
      release(unit, phase)               drop the gathered unit's memory
      reduce_scatter(unit)               add this rank's shard of the mean gradient into unit.grad_shard
    phase is "forward", "backward", "end" (after backward) or "outside" (gathered_parameters, state dicts).
    group is the ranks the units are sharded over (None: all).
    """

    def __init__(self, model, units: list[Unit], calls: list[tuple], *, prefetch: int = 1,
                 max_live_numel: int | None = None, reshard_last: bool = True, group=None):
        self.units, self.calls, self.group = units, calls, group
        self.prefetch, self.max_live_numel, self.reshard_last = prefetch, max_live_numel, reshard_last
        self.order = ExecutionOrder([name for name, _, _ in calls], units[0].flat.device)
        self.unit_of = {p: unit for unit in units for p in unit.params}
        self.trace = None  # a list to record (phase, action, unit name, gathered elements) over time
        self.reduced = set()  # units reduce-scattered in this backward pass
        self.backward_started = False
        self.handles = [model.register_forward_pre_hook(self._start_forward, prepend=True)]
        for index, (_, module, _) in enumerate(calls):
            self.handles.append(module.register_forward_pre_hook(partial(self._pre_forward, index)))
            self.handles.append(module.register_forward_hook(partial(self._post_forward, index)))
        for p in self.unit_of:
            if p.requires_grad:
                # weak: torch keeps this hook in C++, where a cycle back to p (through unit_of) is never freed;
                # the model's module hooks above keep the schedule alive while the model is
                self.handles.append(p.register_post_accumulate_grad_hook(weak_hook(self._gradient_arrived)))

    # ---- extension points
    def all_gather(self, unit: Unit, phase: str, async_op: bool = False) -> dist.Work | None:
        return gather_unit(unit, async_op=async_op, group=self.group)

    def release(self, unit: Unit, phase: str) -> None:
        free_unit(unit)

    def reduce_scatter(self, unit: Unit) -> None:
        reduce_scatter_unit(unit, unit.grad_shard, self.group)

    # ---- gathering and freeing one unit
    def gather(self, unit: Unit, phase: str, async_op: bool = False) -> dist.Work | None:
        """Gather the unit (now, or started with async_op) and make its parameters views into it."""
        work = self.all_gather(unit, phase, async_op)
        unit.show_params()
        self._log(phase, "prefetch" if async_op else "gather", unit)
        return work

    def free(self, unit: Unit, phase: str) -> None:
        if unit.work is not None:
            unit.work.wait()
            unit.work = None
        unit.hide_params()
        self.release(unit, phase)
        self._log(phase, "free", unit)

    def _acquire(self, index, phase):
        unit = self.units[index]
        if unit.work is not None:  # prefetched: the all-gather was started earlier
            unit.work.wait()
            unit.work = None
        elif not unit.is_gathered():
            self.gather(unit, phase)

    def gathered_numel(self) -> int:
        """Elements of gathered (or being gathered) units on this rank right now."""
        return sum(unit.flat.numel() for unit in self.units if unit.is_gathered())

    def _log(self, phase, action, unit):
        if self.trace is not None:
            self.trace.append((phase, action, unit.name, self.gathered_numel()))

    # ---- the hooks
    def _start_forward(self, module, args):
        self.release_all()  # units a previous forward prefetched or kept, if no backward came
        self.order.start_forward()

    def _prefetch(self, phase):
        """Start the all-gathers that prefetch_plan asks for at the current position of the recorded
        order of `phase`, asynchronously (keep each handle in unit.work). Nothing while the order is
        being recorded, nor with prefetch=0."""
        order = self.order.recorded[phase]
        if order is None or not self.prefetch:
            return  # nothing is prefetched before the order is known
        needs = [self.calls[index][2] for index in order]
        resident = {i for i, unit in enumerate(self.units) if unit.is_gathered()}
        numels = [unit.flat.numel() for unit in self.units]
        for index in prefetch_plan(needs, self.order.position[phase], self.prefetch, resident, numels,
                                   self.gathered_numel(), self.max_live_numel):
            self.units[index].work = self.gather(self.units[index], phase, async_op=True)

    def _pre_forward(self, index, module, args):
        """Forward pre-hook of call `index`: follow the order, make sure each unit the call needs is
        gathered (_acquire) and count the call among its holders, then prefetch."""
        self.order.follow("forward", index)
        for unit in self.calls[index][2]:
            self._acquire(unit, "forward")
            self.units[unit].holders += 1
        self._prefetch("forward")

    def _post_forward(self, index, module, args, output):
        """Forward hook of call `index`: release its units, freeing each one no call holds any more
        (with reshard_last=False, nothing from the last call of the recorded forward on). With
        grad enabled, return the outputs passed through RegatherForBackward, so that
        _pre_backward(index) runs before this call's backward."""
        order = self.order.recorded["forward"]
        keep = not self.reshard_last and order is not None and self.order.position["forward"] == len(order) - 1
        for unit in map(self.units.__getitem__, self.calls[index][2]):
            unit.holders -= 1
            if unit.holders == 0 and not keep:
                self.free(unit, "forward")
        if not torch.is_grad_enabled():
            return output
        return regather_before_backward(output, partial(self._pre_backward, index))

    def _pre_backward(self, index):
        """Runs just before call `index`'s backward. On the first call of a backward pass, queue
        _finish_backward with the autograd engine; then follow the order, acquire the units the
        call needs (gathered until their gradients are reduced) and prefetch."""
        if not self.backward_started:
            self.backward_started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self.order.follow("backward", index)
        for unit in self.calls[index][2]:
            self._acquire(unit, "backward")
        self._prefetch("backward")

    def _gradient_arrived(self, param):
        param_unit = self.unit_of[param]
        param_unit.had_grad.add(param)  # the step updates only parameters that got a gradient
        self._on_gradient_ready(param)

    def _on_gradient_ready(self, param):
        """Post-accumulate-grad hook: once every trainable parameter of the unit has its gradient
        for this backward pass, reduce the unit."""
        unit = self.unit_of[param]
        unit.ready.add(param)
        if len(unit.ready) == len(unit.slices):
            self._reduce(unit)

    def _reduce(self, unit):
        """Reduce-scatter the unit's gradients into its gradient shard (self.reduce_scatter),
        remember that it was reduced in this backward pass, and free it unless a forward call
        still holds it."""
        self.reduce_scatter(unit)
        unit.ready.clear()
        self.reduced.add(unit)
        if unit.holders == 0 and unit.is_gathered():
            self.free(unit, "backward")

    def release_all(self):
        for unit in self.units:
            unit.holders = 0
            if unit.is_gathered():
                self.free(unit, "end")

    def _finish_backward(self):
        """Runs when backward ends: reduce what backward never reached (zeros: every rank must
        take part; its parameters got no gradient, so the step leaves them alone), free
        everything, and after the first step keep its order as the record."""
        for unit in self.units:
            if unit.grad_shard is not None and unit not in self.reduced:
                self._reduce(unit)
        self.release_all()
        self.reduced.clear()
        self.order.end_backward()
        self.backward_started = False


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


class ShardedModelState:
    """Leaving stage 3 (a part of Zero3Optimizer): gathered parameters, the model's own state dict
    and load_state_dict, sharded checkpoints and a consolidated one. Every rank must call each of
    them (they all-gather), as with FSDP's full state dict."""

    @contextmanager
    def gathered_parameters(self, params=None, modifier_rank: int | None = None):
        """Inside, the units of `params` (default: all) are gathered on every rank (call it on every
        rank). With modifier_rank, what that rank wrote into them is broadcast and becomes the new
        shards and fp32 masters on exit; otherwise changes are dropped."""
        if modifier_rank is not None and self.process_group is not None:
            raise NotImplementedError("gathered_parameters(modifier_rank=) broadcasts to all ranks, which group= does "
                                      "not shard over: write through model.load_state_dict() instead")
        wanted = {self.schedule.unit_of[p] for p in params} if params is not None else set(self.units)
        units = [unit for unit in self.units if unit in wanted]
        for unit in units:
            if not unit.is_gathered():
                self.schedule.gather(unit, "outside")
        try:
            yield
        finally:
            for unit in units:
                if modifier_rank is not None:
                    dist.broadcast(unit.flat, src=modifier_rank)
                    self._write_through(unit, unit.flat)
                self.schedule.free(unit, "outside")

    @torch.no_grad()
    def _write_through(self, unit: Unit, full: torch.Tensor) -> None:
        """Make this rank's part of `full` (the whole unit) its new fp32 master and shard."""
        start, stop = unit.layout.shard(dist.get_rank(self.shard_group))
        unit.master.copy_(full[start:stop])
        if unit.shard is not unit.master:
            unit.shard.copy_(unit.master)

    @torch.no_grad()
    def _full_masters(self, unit: Unit) -> list[torch.Tensor]:
        """The unit's whole fp32 weights, one tensor of its own per parameter (an all-gather)."""
        full = unit.master.new_empty(unit.layout.padded_numel)
        dist.all_gather_single(full, unit.master, group=self.shard_group)
        return [view.clone() for view in unit.views_of(full)]

    def _model_state_hooks(self) -> list:
        """model.state_dict() gives whole fp32 tensors; model.load_state_dict() writes through to
        the shards and masters (optimizer states stay, as with torch)."""
        loading = []

        def full_state(module, state, prefix, local_metadata):
            values = {p: value for unit in self.units for p, value in zip(unit.params, self._full_masters(unit))}
            for name, p in module.named_parameters(remove_duplicate=False):
                if prefix + name in state:
                    state[prefix + name] = values[p]  # tied names: the same tensor

        def gather_before_load(module, state, prefix, *args):
            loading.append((state, prefix))
            for unit in self.units:
                self.schedule.gather(unit, "outside")

        def write_after_load(module, incompatible_keys):
            state, prefix = loading.pop()
            loaded = {p: state[prefix + name] for name, p in module.named_parameters(remove_duplicate=False)
                      if prefix + name in state}
            for unit in self.units:
                full = unit.flat.to(MASTER_DTYPE)  # what load_state_dict left there (kept where not given)
                for p, view in zip(unit.params, unit.views_of(full)):
                    if p in loaded and loaded[p].shape == view.shape:  # a wrong shape: torch names it
                        view.copy_(loaded[p])  # in fp32, not rounded through the compute dtype
                self._write_through(unit, full)
                self.schedule.free(unit, "outside")

        return [self.model.register_state_dict_post_hook(full_state),
                self.model.register_load_state_dict_pre_hook(gather_before_load),
                self.model.register_load_state_dict_post_hook(write_after_load)]

    @torch.no_grad()
    def unshard_model(self) -> None:
        """Give every parameter its whole fp32 weights back, in storage of its own (every rank calls
        it; the hooks are removed first, through hook_handles). The optimizer is unusable after."""
        for handle in self.hook_handles:
            handle.remove()
        for unit in self.units:
            for p, value in zip(unit.params, self._full_masters(unit)):
                p.data = value

    def state_dict(self) -> dict:
        """This rank's shard of the training state (fp32 masters, which include frozen parameters,
        and the optimizer's states): save one file per rank, with the same world size to resume."""
        return {"stage": self.stage, "rank": self.rank, "world_size": self.world_size,
                "numels": [unit.layout.numel for unit in self.units],
                "masters": [unit.master.clone() for unit in self.units], "optimizer": self.optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Load this rank's shard; saved at another world size, the list of every saved rank's state_dict()
        or file path, in rank order (lesson 16); or the "optimizer" part of a consolidated_state_dict() at any
        world size (then load its "model" part with model.load_state_dict)."""
        if isinstance(state, (list, tuple)):  # every saved rank's, saved at any world size (lesson 16)
            from zero_lab.reshard import load_state_dicts  # lesson 16's: loaded only to reshard
            load_state_dicts(self, state)
            return
        if "stage" not in state and {"state", "param_groups"} <= set(state):
            return self._load_consolidated(state)
        numels = [unit.layout.numel for unit in self.units]
        if (state.get("stage"), state.get("world_size"), state.get("numels")) != (self.stage, self.world_size, numels):
            raise ValueError(
                f"this checkpoint is a stage {state.get('stage')} one sharded for {state.get('world_size')} ranks and "
                f"units of {state.get('numels')} elements, not stage 3 on {self.world_size} ranks and {numels}: resume "
                "with the same setup, pass every rank the list of all saved ranks' state dicts or files, in rank order "
                "(each reads only its part), or load a consolidated_state_dict() (model.load_state_dict(full['model']), "
                "optimizer.load_state_dict(full['optimizer'])) into any setup")
        if state["rank"] != self.rank:
            raise ValueError(f"rank {self.rank} was given rank {state['rank']}'s shard: load each rank's own file")
        self.optimizer.load_state_dict(state["optimizer"])
        for unit, saved in zip(self.units, state["masters"]):
            unit.master.copy_(saved)
            if unit.shard is not unit.master:
                unit.shard.copy_(unit.master)

    def _load_consolidated(self, state: dict) -> None:
        """Cut each parameter's saved state (numbered as over the unsharded parameters, which the
        inner optimizer's tensors follow one to one) down to this rank's slice of it."""
        slice_of = {s.param: s for unit in self.units for s in unit.slices}
        params = [p for group in self.group_params for p in group]
        if len(params) != sum(len(g["params"]) for g in state["param_groups"]):
            raise ValueError(f"this optimizer state is for {sum(len(g['params']) for g in state['param_groups'])} "
                             f"parameters, this optimizer trains {len(params)}: load it into the same model")
        shards = {}
        for index, saved in state["state"].items():
            piece = slice_of[params[int(index)]]
            shards[index] = {key: value.reshape(-1)[piece.param_offset:piece.param_offset + piece.master.numel()].clone()
                             if torch.is_tensor(value) and value.dim() else value for key, value in saved.items()}
        self.optimizer.load_state_dict({"state": shards, "param_groups": state["param_groups"]})

    @torch.no_grad()
    def consolidated_state_dict(self, dst: int = 0) -> dict | None:
        """The full fp32 training state on rank `dst` (None elsewhere); every rank must call it.

        {"model": an ordinary model state_dict (padding removed, tied names sharing one tensor),
        "optimizer": the state_dict of the same torch optimizer over the unsharded parameters}.
        """
        if self.process_group is not None:
            raise NotImplementedError("consolidated_state_dict gathers over all ranks, which group= does not shard "
                                      "over: save each rank's state_dict() instead")
        values, states = {}, {}
        for unit in self.units:
            shard_states = {}
            for piece in unit.slices:
                for key, value in self.optimizer.state.get(piece.master, {}).items():
                    if value.dim() == 0:
                        states.setdefault(piece.param, {})[key] = value.clone()
                    else:
                        shard_states.setdefault(key, torch.zeros_like(unit.master))[
                            piece.shard_offset:piece.shard_offset + piece.master.numel()] = value
            gathered = {key: gather_shards(t, dst) for key, t in {"master": unit.master, **shard_states}.items()}
            if self.rank != dst:
                continue
            for key, full in gathered.items():
                for p, piece in zip(unit.params, unit.views_of(full)):
                    if key == "master":
                        values[p] = piece.clone()
                    elif p in states:  # a parameter that was never stepped has no state
                        states[p][key] = piece.clone()
        if self.rank != dst:
            return None
        model_state = {name: b.float() if b.is_floating_point() else b.clone()
                       for name, b in persistent_buffers(self.model)}  # not model.state_dict(): that one gathers
        for name, p in self.model.named_parameters(remove_duplicate=False):
            model_state[name] = values[p]  # tied names: the same tensor
        index = iter(range(sum(len(params) for params in self.group_params)))
        groups, state = [], {}
        for params, options in zip(self.group_params, self.param_groups):
            numbers = [next(index) for _ in params]
            state.update((i, states[p]) for i, p in zip(numbers, params) if p in states)
            groups.append({**{k: v for k, v in options.items() if k != "params"}, "params": numbers})
        return {"model": model_state, "optimizer": {"state": state, "param_groups": groups}}


def persistent_buffers(model: torch.nn.Module):
    """(name, buffer) for the buffers that model.state_dict() holds."""
    for module_name, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield f"{module_name}.{name}" if module_name else name, buffer


class Zero3Optimizer(ShardedModelState, OptimizerOverCopies):
    """ZeRO stage 3 around an element-wise torch optimizer (AdamW by default).

    Shards the model in place: every parameter's weights live in its unit, gathered only while a
    forward or backward pass needs them (between steps a parameter is an empty tensor: use
    gathered_parameters() to look at it). The ordinary loop works:
    `loss = f(model(x)); loss.backward(); optimizer.step(); optimizer.zero_grad()`.

    params          tensors or param-group dicts, as for torch.optim (default: model.parameters());
                    every trainable parameter must be in one; frozen ones are sharded, not optimized
    param_dtype     compute dtype (torch.bfloat16 for mixed precision, fp32 masters kept); None keeps it
    max_grad_norm   clip the global gradient norm in step() (None: no clipping)
    units           which modules are sharding units besides the root: a predicate, or a tuple of
                    module classes (default: every module with parameters of its own)
    prefetch        how many calls ahead to all-gather, by the order recorded in the first step (0-2)
    max_live_numel  cap on gathered elements at any time for prefetching (None: no cap)
    reshard_last    free the last unit of the forward pass after it (True), or keep it gathered
                    for the backward pass that starts with it: one all-gather less per step
    init_fn         init_fn(name, tensor) for a model made under meta_parameters()
    group           shard over this process group's ranks only (None: all ranks): a mesh's dp group (lesson 17)
    **defaults      the optimizer's options (lr, weight_decay, ...)
    """

    stage = 3
    reshardable = True  # lesson 16's load_state_dicts may re-cut its shards for another world size
    schedule_class = UnitSchedule  # a subclass may bring its own (lesson 09's ZeRO++)
    process_group = None  # group=: ZeRO over these ranks only (lesson 17's data-parallel axis)
    shard_group = None  # the ranks each unit is sharded over (None: all); a subclass that sets it (lesson
    # 09's HSDP: one node) brings a schedule that gathers and reduces over it

    def __init__(self, model, optimizer_class=torch.optim.AdamW, params=None, *, param_dtype=None, max_grad_norm=None,
                 units=None, prefetch: int = 1, max_live_numel: int | None = None, reshard_last: bool = True,
                 init_fn=None, group=None, **defaults):
        if prefetch not in (0, 1, 2):
            raise ValueError(f"prefetch is how many calls ahead to gather: 0, 1 or 2, got {prefetch!r}")
        self.model, self.max_grad_norm, self.last_grad_norm = model, max_grad_norm, None
        if group is not None:
            if type(self).__name__ != "Zero3Optimizer" or max_grad_norm is not None:
                raise NotImplementedError(f"group= is built for Zero3Optimizer, not {type(self).__name__}, and without "
                                          "max_grad_norm (its norm sums over all ranks)")
            self.shard_group = self.process_group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        if isinstance(units, tuple):
            units = partial(lambda classes, module: isinstance(module, classes), units)
        groups = param_groups_of(model, params)
        self.group_params = [[p for p in g.pop("params") if p.requires_grad] for g in groups]  # frozen: left out
        self._check_params(model)
        names = {p: name for name, p in model.named_parameters()}
        self.units, calls, unit_index = [], [], {}
        for name, module, owned, uses in sharding_units(model, units or default_is_unit):
            if owned:
                unit_index[name] = len(self.units)
                self.units.append(build_unit(name, owned, names, param_dtype, init_fn, self.shard_group, group))
                for old, new in zip(owned, self.units[-1].params):
                    if new is not old:
                        self._replace_parameter(old, new)
            needs = ([unit_index[name]] if owned else []) + [unit_index[owner] for owner in uses]
            if needs:
                calls.append((name, module, needs))
        self._cast_buffers(param_dtype)
        master_of = {piece.param: piece.master for unit in self.units for piece in unit.slices}
        super().__init__(optimizer_class([{**g, "params": [master_of[p] for p in params]}
                                          for g, params in zip(groups, self.group_params)], **defaults))
        self.schedule = self.schedule_class(model, self.units, calls, prefetch=prefetch,
                                            max_live_numel=max_live_numel, reshard_last=reshard_last, group=group)
        self.hook_handles = self.schedule.handles + self._model_state_hooks()
        for p in self.schedule.unit_of:
            p.grad = None
        hold_gradients(self, self.schedule.unit_of)  # torch.nn.utils.clip_grad_norm_(model.parameters()) clips the shards

    def _check_params(self, model):
        grouped = {p for params in self.group_params for p in params}
        for name, p in model.named_parameters():
            if p.requires_grad and p not in grouped:
                raise ValueError(f"{name} is trainable but in no param group: stage 3 shards every parameter; "
                                 "add it to a group, or freeze it with requires_grad_(False)")
        if not grouped:
            raise ValueError(f"{type(model).__name__} has no trainable parameters (all have requires_grad=False): "
                             "there is nothing to train; unfreeze some with requires_grad_(True)")

    def _replace_parameter(self, old, new):
        for module in self.model.modules():
            for key, value in module._parameters.items():
                if value is old:  # every module that holds it: tied weights stay tied
                    module._parameters[key] = new
        self.group_params = [[new if p is old else p for p in params] for params in self.group_params]

    def _cast_buffers(self, param_dtype):
        for module in self.model.modules():
            for buffer_name, buffer in module.named_buffers(recurse=False):
                if buffer.device.type == "meta":
                    raise ValueError(f"buffer {buffer_name} of {type(module).__name__} is on the meta device: build "
                                     "the model inside zero_lab.zero3.meta_parameters(), which makes buffers as usual")
                if param_dtype is not None and buffer.is_floating_point():
                    buffer.data = buffer.data.to(param_dtype)

    # ---- what the schedule does, seen from the optimizer
    def invalidate_order(self) -> None:
        """Forget the recorded execution order: the next step records it again, without prefetching.
        Call it on every rank when the model's order of calls changes on purpose."""
        self.schedule.order.invalidate()

    def gathered_numel(self) -> int:
        return self.schedule.gathered_numel()

    @property
    def trace(self):
        """None, or a list that records (phase, action, unit name, gathered elements) over time."""
        return self.schedule.trace

    @trace.setter
    def trace(self, value):
        self.schedule.trace = value

    # ---- the step, on this rank's shards
    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step on every unit's shard; nothing is gathered (the next forward does).
        A parameter that got no gradient since zero_grad (on any rank) is left alone: its
        weights, moments and step count stay, as torch.optim does for a .grad of None."""
        if closure is not None:
            raise ValueError("stage 3 does not take a closure: compute the loss and call backward() before step()")
        trained = [unit for unit in self.units if unit.grad_shard is not None]
        grads = [unit.grad_shard.to(MASTER_DTYPE) for unit in trained]  # a copy with mixed precision
        if self.max_grad_norm is not None:  # parameters without gradient have zeros there: the norm is the same
            self.last_grad_norm = clip_grad_norm_(grads, [g.numel() for g in grads], self.max_grad_norm)
        for unit, grad in zip(trained, grads):
            for piece in unit.slices:
                if piece.param in unit.had_grad:
                    piece.master.grad = grad[piece.shard_offset:piece.shard_offset + piece.master.numel()]
        self.optimizer.step()
        for unit in trained:
            for piece in unit.slices:
                piece.master.grad = None
            if unit.shard is not unit.master:
                unit.shard.copy_(unit.master)  # the compute-dtype shard follows its fp32 master

    @property
    def groups(self) -> list[Unit]:
        """The units: what torch.nn.utils.clip_grad_norm_ checks it was given every parameter of."""
        return self.units

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradient shards so that the whole gradient's norm is <= max_norm (call it
        between backward and step, on every rank); returns the norm before clipping."""
        shards = [unit.grad_shard for unit in self.units if unit.grad_shard is not None]
        return clip_grad_norm_(shards, [g.numel() for g in shards], max_norm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient shards in place (they are reused). With set_to_none (the default)
        the parameters count as having no gradient until backward gives them one; with False,
        as torch.optim, those that had one keep a zero gradient and are still stepped."""
        for unit in self.units:
            if unit.grad_shard is not None:
                unit.grad_shard.zero_()
            if set_to_none:
                unit.had_grad.clear()

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this rank holds, for zero_lab.memory_ledger (a freed unit holds nothing)."""
        return {
            "parameters": [unit.shard for unit in self.units] + [unit.flat for unit in self.units],
            "gradients": [unit.grad_shard for unit in self.units if unit.grad_shard is not None]
                         + [p.grad for p in self.schedule.unit_of if p.grad is not None],
            "master_params": [unit.master for unit in self.units if unit.master is not unit.shard],
            "optimizer_states": [v for state in self.optimizer.state.values() for v in state.values()
                                 if torch.is_tensor(v) and v.dim() > 0],
        }
