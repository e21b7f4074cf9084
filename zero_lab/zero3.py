# Generated from solutions/05_zero3/05_zero3.ipynb by `zero-lab build`: edit the notebook, not this file.

"""ZeRO stage 3 (P_os+g+p): parameters, gradients and optimizer states all partitioned.

Unit                  one sharding unit: the parameters a module owns, in one flat padded buffer
sharding_units        which module owns which parameter: bottom-up, tied weights to their first owner
gather_unit           give the flat buffer its storage back and all-gather every rank's shard into it
free_unit             release the gathered buffer for real (storage resized to 0)
RegatherForBackward   an identity on a module's outputs whose backward gathers the module's units again
reduce_scatter_unit   the mean gradient of this rank's shard of a unit, added into its gradient shard
prefetch_plan         which units to start gathering now, by the recorded execution order
Zero3Optimizer        the hooks that run all of the above, the step on the shards, checkpoints

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

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from zero_lab.optim import OptimizerOverCopies, hold_gradients
from zero_lab.zero1 import MASTER_DTYPE, ShardLayout, clip_grad_norm_, gather_shards, param_groups_of, param_views


@dataclass(eq=False)
class Unit:
    """One sharding unit: the parameters one module owns, laid out in one flat padded buffer.

    flat is the whole padded buffer in the compute dtype and the parameters are views into it;
    when the unit is not gathered, its storage has size 0 (the views keep their shapes). shard
    is this rank's part of it, the only copy of the unit's weights the rank always holds.
    """

    name: str  # the owning module's name ("" for the root)
    params: list[torch.nn.Parameter]  # in flat-buffer order: trainable (by param group), then frozen
    layout: ShardLayout
    flat: torch.Tensor
    shard: torch.Tensor
    work: dist.Work | None = None  # the all-gather in flight, if it was started asynchronously
    holders: int = 0  # module calls of the forward pass that are using the gathered unit
    ready: set = field(default_factory=set)  # trainable parameters whose gradient is final

    def is_gathered(self) -> bool:
        """True from the start of its all-gather until it is freed."""
        return self.flat.untyped_storage().nbytes() > 0


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


def gather_unit(unit: Unit, async_op: bool = False) -> dist.Work | None:
    """All-gather every rank's unit.shard into unit.flat, giving flat its storage back first.

    The parameters are views into flat, so afterwards they hold the whole unit. With async_op
    the all-gather is started and its handle returned (wait on it before using the parameters).
    """
    unit.flat.untyped_storage().resize_(unit.flat.numel() * unit.flat.element_size())
    with torch.no_grad():
        return dist.all_gather_single(unit.flat, unit.shard, async_op=async_op)


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
def reduce_scatter_unit(unit: Unit, grad_shard: torch.Tensor) -> None:
    """Add this rank's shard of the data-parallel mean of the unit's gradients into grad_shard.

    Copies every parameter's .grad into one padded flat buffer (zeros for parameters without a
    gradient and for the padding), frees the full-size .grad, reduce-scatters the buffer and
    adds the received sum, divided by the number of ranks, into grad_shard.
    """
    flat_grad = grad_shard.new_zeros(unit.layout.padded_numel)
    for p, view in zip(unit.params, param_views(flat_grad, unit.params)):
        if p.grad is not None:
            view.copy_(p.grad)
            p.grad = None
    received = torch.empty_like(grad_shard)
    dist.reduce_scatter_single(received, flat_grad)
    grad_shard += received / dist.get_world_size()


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


class Zero3Optimizer(OptimizerOverCopies):
    """ZeRO stage 3 around an element-wise torch optimizer (AdamW by default).

    Shards the model in place: every parameter becomes a view into its unit's flat buffer, which
    holds data only while a forward or backward pass needs it. The ordinary loop works:
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
    **defaults      the optimizer's options (lr, weight_decay, ...)
    """

    stage = 3

    def __init__(self, model, optimizer_class=torch.optim.AdamW, params=None, *, param_dtype=None, max_grad_norm=None,
                 units=None, prefetch: int = 1, max_live_numel: int | None = None, reshard_last: bool = True,
                 init_fn=None, **defaults):
        if prefetch not in (0, 1, 2):
            raise ValueError(f"prefetch is how many calls ahead to gather: 0, 1 or 2, got {prefetch!r}")
        self.model, self.max_grad_norm, self.prefetch = model, max_grad_norm, prefetch
        self.max_live_numel, self.reshard_last = max_live_numel, reshard_last
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if isinstance(units, tuple):
            units = partial(lambda classes, module: isinstance(module, classes), units)
        groups = param_groups_of(model, params)
        self.group_params = [[p for p in g.pop("params") if p.requires_grad] for g in groups]  # frozen: left out
        group_of = {p: index for index, params in enumerate(self.group_params) for p in params}
        self._check_params(model, group_of)
        self.names = {p: name for name, p in model.named_parameters()}
        self.units, self.calls, self.masters, self.grad_shards, self.views = [], [], [], [], []
        inner_params, unit_index = [[] for _ in groups], {}
        for name, module, owned, uses in sharding_units(model, units or default_is_unit):
            if owned:
                unit_index[name] = len(self.units)
                self._add_unit(name, owned, group_of, param_dtype, init_fn, inner_params)
            needs = ([unit_index[name]] if owned else []) + [unit_index[owner] for owner in uses]
            if needs:
                self.calls.append((name, module, needs))
        for module in model.modules():
            for buffer_name, buffer in module.named_buffers(recurse=False):
                if buffer.device.type == "meta":
                    raise ValueError(f"buffer {buffer_name} of {type(module).__name__} is on the meta device: build "
                                     "the model inside zero_lab.zero3.meta_parameters(), which makes buffers as usual")
                if param_dtype is not None and buffer.is_floating_point():
                    buffer.data = buffer.data.to(param_dtype)
        super().__init__(optimizer_class([{**g, "params": p} for g, p in zip(groups, inner_params)], **defaults))
        self.unit_of = {p: unit for unit in self.units for p in unit.params}
        self.trainable = [sum(p.requires_grad for p in unit.params) for unit in self.units]
        self.hook_handles = [model.register_forward_pre_hook(self._start_forward, prepend=True)]
        for index, (_, module, _) in enumerate(self.calls):
            self.hook_handles.append(module.register_forward_pre_hook(partial(self._pre_forward, index)))
            self.hook_handles.append(module.register_forward_hook(partial(self._post_forward, index)))
        for p in self.unit_of:
            p.grad = None
            if p.requires_grad:
                self.hook_handles.append(p.register_post_accumulate_grad_hook(self._on_gradient_ready))
        hold_gradients(self, self.unit_of)  # torch.nn.utils.clip_grad_norm_(model.parameters()) clips the shards
        self.last_grad_norm, self.trace = None, None  # trace: a list to record gathered elements over time
        self.number = {unit: i for i, unit in enumerate(self.units)}
        self.reduced = set()  # units reduce-scattered in this backward pass
        self.invalidate_order()

    @staticmethod
    def _check_params(model, group_of):
        for name, p in model.named_parameters():
            if p.requires_grad and p not in group_of:
                raise ValueError(f"{name} is trainable but in no param group: stage 3 shards every parameter; "
                                 "add it to a group, or freeze it with requires_grad_(False)")

    def _add_unit(self, name, owned, group_of, param_dtype, init_fn, inner_params):
        trainable = sorted((p for p in owned if p.requires_grad), key=lambda p: group_of[p])
        params = trainable + [p for p in owned if not p.requires_grad]
        layout = ShardLayout(sum(p.numel() for p in params), self.world_size)
        on_meta = any(p.device.type == "meta" for p in params)
        device = params[0].device if not on_meta else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
        full = torch.zeros(layout.padded_numel, dtype=MASTER_DTYPE, device=device)  # one unit at a time
        for p, view in zip(params, param_views(full, params)):
            if p.device.type != "meta":
                view.copy_(p.detach())
            elif init_fn is not None:
                init_fn(self.names[p], view)
            else:
                raise ValueError(f"{self.names[p]} is on the meta device: pass init_fn to make its weights")
        if not on_meta:
            dist.broadcast(full, src=0)  # every rank starts from rank 0's weights, as in DDP
        start, stop = layout.shard(self.rank)
        master = full[start:stop].clone()
        compute_dtype = param_dtype or params[0].dtype
        shard = master if compute_dtype == MASTER_DTYPE else master.to(compute_dtype)
        flat = torch.empty(layout.padded_numel, dtype=compute_dtype, device=device)
        for i, view in enumerate(param_views(flat, params)):
            if params[i].device.type == "meta":  # a meta tensor cannot take data: a new parameter replaces it
                params[i] = self._replace_parameter(params[i], torch.nn.Parameter(
                    torch.empty(0, dtype=compute_dtype, device=device), requires_grad=params[i].requires_grad))
            params[i].data = view  # the parameter keeps its own version counter
        unit = Unit(name, params, layout, flat, shard)
        free_unit(unit)
        self.units.append(unit)
        self.masters.append(master)
        self.grad_shards.append(torch.zeros_like(shard) if trainable else None)
        # Each param group's elements of this unit are contiguous: its part of this rank's
        # shard is one view of the master, optimized as one tensor (possibly empty).
        ranges, offset = {}, 0
        for p in trainable:
            ranges.setdefault(group_of[p], [offset, offset])[1] = offset + p.numel()
            offset += p.numel()
        views = []
        for group, (lo, hi) in ranges.items():
            lo, hi = min(max(lo, start), stop), max(min(hi, stop), start)
            view = master[lo - start:max(lo, hi) - start]
            inner_params[group].append(view)
            views.append((view, lo - start))
        self.views.append(views)

    def _replace_parameter(self, old, new):
        for module in self.model.modules():
            for key, value in module._parameters.items():
                if value is old:  # every module that holds it: tied weights stay tied
                    module._parameters[key] = new
        self.names[new] = self.names[old]
        self.group_params = [[new if p is old else p for p in params] for params in self.group_params]
        return new

    # ---- the lifecycle of a unit, driven by hooks
    def invalidate_order(self) -> None:
        """Forget the recorded execution order: the next step records it again, without prefetching.
        Call it on every rank when the model's order of calls changes on purpose."""
        self.order = {"forward": None, "backward": None}
        self.recording = {"forward": [], "backward": []}
        self.position = {"forward": -1, "backward": -1}
        self.backward_started = False

    def gathered_numel(self) -> int:
        """Elements of gathered (or being gathered) units on this rank right now."""
        return sum(unit.flat.numel() for unit in self.units if unit.is_gathered())

    def _log(self, phase, action, unit):
        if self.trace is not None:
            self.trace.append((phase, action, unit.name, self.gathered_numel()))

    def _start_forward(self, module, args):
        self._release_all()  # units a previous forward prefetched or kept, if no backward came
        self.position["forward"] = -1
        if self.order["forward"] is None:
            self.recording = {"forward": [], "backward": []}

    def _follow(self, phase, index):
        """Record the call, or check it against the recorded order (the same on every rank)."""
        position = self.position[phase] = self.position[phase] + 1
        order = self.order[phase]
        if order is None:
            self.recording[phase].append(index)
            self._check_same_call(phase, position, index)
        elif position >= len(order) or order[position] != index:
            expected = f"'{self.calls[order[position]][0]}'" if position < len(order) else "no call (it had ended)"
            raise RuntimeError(
                f"rank {self.rank}: call {position} of the {phase} pass is unit '{self.calls[index][0]}', but the "
                f"execution order recorded in the first step (the same on every rank) has {expected} there. Every "
                "rank must run the same units in the same order, or the all-gathers no longer match and the ranks "
                "hang. If the order changed on purpose on every rank, call optimizer.invalidate_order() on every "
                "rank before that step: it is recorded again, without prefetching.")

    def _check_same_call(self, phase, position, index):
        """While the order is recorded, every call is announced to the other ranks (a tiny
        all-gather, before the call's own collectives): a rank on another path is caught at once."""
        mine = torch.tensor([phase == "backward", position, index], device=self.units[0].flat.device)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine)
        if any(not torch.equal(theirs, mine) for theirs in everyone):
            calls = "; ".join(f"rank {rank}: {('forward', 'backward')[int(b)]} call {int(k)} '{self.calls[int(i)][0]}'"
                              for rank, (b, k, i) in enumerate(t.tolist() for t in everyone))
            raise RuntimeError(f"rank {self.rank}: the ranks ran different units in the first step ({calls}). Every "
                               "rank must run the same units in the same order, or their all-gathers do not match.")

    def _acquire(self, index, phase):
        unit = self.units[index]
        if unit.work is not None:  # prefetched: the all-gather was started earlier
            unit.work.wait()
            unit.work = None
        elif not unit.is_gathered():
            gather_unit(unit)
            self._log(phase, "gather", unit)

    def _prefetch(self, phase):
        """Start the all-gathers that prefetch_plan asks for at the current position of the recorded
        order of `phase`, asynchronously (keep each handle in unit.work). Nothing while the order is
        being recorded, nor with prefetch=0."""
        if self.order[phase] is None or not self.prefetch:
            return  # nothing is prefetched before the order is known
        needs = [self.calls[index][2] for index in self.order[phase]]
        resident = {i for i, unit in enumerate(self.units) if unit.is_gathered()}
        numels = [unit.flat.numel() for unit in self.units]
        for index in prefetch_plan(needs, self.position[phase], self.prefetch, resident, numels,
                                   self.gathered_numel(), self.max_live_numel):
            self.units[index].work = gather_unit(self.units[index], async_op=True)
            self._log(phase, "prefetch", self.units[index])

    def _free(self, unit, phase):
        if unit.work is not None:
            unit.work.wait()
            unit.work = None
        free_unit(unit)
        self._log(phase, "free", unit)

    def _pre_forward(self, index, module, args):
        """Forward pre-hook of call `index`: follow the order, make sure each unit the call needs is
        gathered (_acquire) and count the call among its holders, then prefetch."""
        self._follow("forward", index)
        for unit in self.calls[index][2]:
            self._acquire(unit, "forward")
            self.units[unit].holders += 1
        self._prefetch("forward")

    def _post_forward(self, index, module, args, output):
        """Forward hook of call `index`: release its units, freeing each one no call holds any more
        (with reshard_last=False, nothing from the last call of the recorded forward on). With
        grad enabled, return the outputs passed through RegatherForBackward, so that
        _pre_backward(index) runs before this call's backward."""
        order = self.order["forward"]
        keep = not self.reshard_last and order is not None and self.position["forward"] == len(order) - 1
        for unit in map(self.units.__getitem__, self.calls[index][2]):
            unit.holders -= 1
            if unit.holders == 0 and not keep:
                self._free(unit, "forward")
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
        self._follow("backward", index)
        for unit in self.calls[index][2]:
            self._acquire(unit, "backward")
        self._prefetch("backward")

    def _on_gradient_ready(self, param):
        """Post-accumulate-grad hook: once every trainable parameter of the unit has its gradient
        for this backward pass, reduce the unit."""
        unit = self.unit_of[param]
        unit.ready.add(param)
        if len(unit.ready) == self.trainable[self.number[unit]]:
            self._reduce(unit)

    def _reduce(self, unit):
        """Reduce-scatter the unit's gradients into its gradient shard, remember that it was reduced
        in this backward pass, and free it unless a forward call still holds it."""
        reduce_scatter_unit(unit, self.grad_shards[self.number[unit]])
        unit.ready.clear()
        self.reduced.add(unit)
        if unit.holders == 0 and unit.is_gathered():
            self._free(unit, "backward")

    def _release_all(self):
        for unit in self.units:
            unit.holders = 0
            if unit.is_gathered():
                self._free(unit, "end")

    def _finish_backward(self):
        """Runs when backward ends: reduce what backward never reached (zeros: every rank must
        take part), free everything, and after the first step, keep its order as the record."""
        for index, unit in enumerate(self.units):
            if self.trainable[index] and unit not in self.reduced:
                self._reduce(unit)
        self._release_all()
        self.reduced.clear()
        if self.order["forward"] is None:  # the first step is over: its order, checked call by call, is the record
            self.order = {phase: list(calls) for phase, calls in self.recording.items()}
        self.position = {"forward": -1, "backward": -1}
        self.backward_started = False

    # ---- the step, on this rank's shards
    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step on every unit's shard; nothing is gathered (the next forward does)."""
        if closure is not None:
            raise ValueError("stage 3 does not take a closure: compute the loss and call backward() before step()")
        grads = []
        for grad_shard, views in zip(self.grad_shards, self.views):
            if grad_shard is None:
                continue
            grad = grad_shard.to(MASTER_DTYPE)  # a copy with mixed precision: the fp32 gradient lives during the step
            for view, offset in views:
                view.grad = grad[offset:offset + view.numel()]
                grads.append(view.grad)
        if self.max_grad_norm is not None:
            self.last_grad_norm = clip_grad_norm_(grads, [g.numel() for g in grads], self.max_grad_norm)
        self.optimizer.step()
        for unit, master, views in zip(self.units, self.masters, self.views):
            for view, _ in views:
                view.grad = None
            if unit.shard is not master:
                unit.shard.copy_(master)  # the compute-dtype shard follows its fp32 master

    @property
    def groups(self) -> list[Unit]:
        """The units: what torch.nn.utils.clip_grad_norm_ checks it was given every parameter of."""
        return self.units

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradient shards so that the whole gradient's norm is <= max_norm (call it
        between backward and step, on every rank); returns the norm before clipping."""
        shards = [g for g in self.grad_shards if g is not None]
        return clip_grad_norm_(shards, [g.numel() for g in shards], max_norm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient shards in place (set_to_none is ignored: they are reused)."""
        for grad_shard in self.grad_shards:
            if grad_shard is not None:
                grad_shard.zero_()

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this rank holds, for zero_lab.memory_ledger (a freed unit holds nothing)."""
        return {
            "parameters": [unit.shard for unit in self.units] + [unit.flat for unit in self.units],
            "gradients": [g for g in self.grad_shards if g is not None]
                         + [p.grad for p in self.unit_of if p.grad is not None],
            "master_params": [m for unit, m in zip(self.units, self.masters) if m is not unit.shard],
            "optimizer_states": [v for state in self.optimizer.state.values() for v in state.values()
                                 if torch.is_tensor(v) and v.dim() > 0],
        }

    # ---- leaving stage 3: gathered parameters, checkpoints, an ordinary state dict
    @contextmanager
    def gathered_parameters(self, params=None, modifier_rank: int | None = None):
        """Inside, the units of `params` (default: all) are gathered on every rank (call it on every
        rank). With modifier_rank, what that rank wrote into them is broadcast and becomes the new
        shards and fp32 masters on exit; otherwise changes are dropped."""
        wanted = set(self.unit_of[p] for p in params) if params is not None else set(self.units)
        units = [(i, unit) for i, unit in enumerate(self.units) if unit in wanted]
        for _, unit in units:
            if not unit.is_gathered():
                gather_unit(unit)
        try:
            yield
        finally:
            for i, unit in units:
                if modifier_rank is not None:
                    dist.broadcast(unit.flat, src=modifier_rank)
                    start, stop = unit.layout.shard(self.rank)
                    self.masters[i].copy_(unit.flat[start:stop])
                    unit.shard.copy_(unit.flat[start:stop])
                free_unit(unit)

    @torch.no_grad()
    def unshard_model(self) -> None:
        """Give every parameter its whole fp32 weights back, in storage of its own (every rank calls
        it; the hooks are removed first, through hook_handles). The optimizer is unusable after."""
        for handle in self.hook_handles:
            handle.remove()
        for unit, master in zip(self.units, self.masters):
            full = master.new_empty(unit.layout.padded_numel)
            dist.all_gather_single(full, master)
            free_unit(unit)
            for p, view in zip(unit.params, param_views(full, unit.params)):
                p.data = view.clone()

    def state_dict(self) -> dict:
        """This rank's shard of the training state (fp32 masters, which include frozen parameters,
        and the optimizer's states): save one file per rank. It is the whole checkpoint: the
        model's own state_dict() holds unallocated parameters in stage 3."""
        return {"stage": self.stage, "rank": self.rank, "world_size": self.world_size,
                "numels": [unit.layout.numel for unit in self.units],
                "masters": [m.clone() for m in self.masters], "optimizer": self.optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Load this rank's shard (every rank calls it, with the same world size and units)."""
        numels = [unit.layout.numel for unit in self.units]
        if (state.get("stage"), state["world_size"], state["numels"]) != (self.stage, self.world_size, numels):
            raise ValueError(
                f"this checkpoint is a stage {state.get('stage')} one sharded for {state['world_size']} ranks and units "
                f"of {state['numels']} elements, not stage 3 on {self.world_size} ranks and {numels}: resume with the "
                "same setup, or load the consolidated_state_dict() into any setup")
        if state["rank"] != self.rank:
            raise ValueError(f"rank {self.rank} was given rank {state['rank']}'s shard: load each rank's own file")
        self.optimizer.load_state_dict(state["optimizer"])
        for unit, master, saved in zip(self.units, self.masters, state["masters"]):
            master.copy_(saved)
            if unit.shard is not master:
                unit.shard.copy_(master)

    @torch.no_grad()
    def consolidated_state_dict(self, dst: int = 0) -> dict | None:
        """The full fp32 training state on rank `dst` (None elsewhere); every rank must call it.

        {"model": an ordinary model state_dict (padding removed, tied names sharing one tensor),
        "optimizer": the state_dict of the same torch optimizer over the unsharded parameters}.
        """
        values, states = {}, {}
        for unit, master, views in zip(self.units, self.masters, self.views):
            shard_states = {}
            for view, offset in views:
                for key, value in self.optimizer.state.get(view, {}).items():
                    if value.dim() == 0:
                        shard_states.setdefault(key, value.clone())
                    else:
                        shard_states.setdefault(key, torch.zeros_like(master))[offset:offset + view.numel()] = value
            gathered = {key: gather_shards(t, dst) if t.dim() else t for key, t in
                        {"master": master, **shard_states}.items()}
            if self.rank != dst:
                continue
            for key, full in gathered.items():
                pieces = param_views(full, unit.params) if full.dim() else [full] * len(unit.params)
                for p, piece in zip(unit.params, pieces):
                    if key == "master":
                        values[p] = piece.clone()
                    elif p.requires_grad:
                        states.setdefault(p, {})[key] = piece.clone()
        if self.rank != dst:
            return None
        model_state = {k: v.float() if v.is_floating_point() else v.clone()
                       for k, v in self.model.state_dict().items() if k not in self._parameter_names()}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            model_state[name] = values[p]  # tied names: the same tensor
        index = iter(range(sum(len(params) for params in self.group_params)))
        groups, state = [], {}
        for params, options in zip(self.group_params, self.param_groups):
            numbers = [next(index) for _ in params]
            state.update((i, states[p]) for i, p in zip(numbers, params) if p in states)
            groups.append({**{k: v for k, v in options.items() if k != "params"}, "params": numbers})
        return {"model": model_state, "optimizer": {"state": state, "param_groups": groups}}

    def _parameter_names(self) -> set[str]:
        return {name for name, _ in self.model.named_parameters(remove_duplicate=False)}
