# Generated from solutions/05_zero3/05_zero3.ipynb by `zero-lab build`: edit the notebook, not this file.

"""ZeRO stage 3 (P_os+g+p): parameters, gradients and optimizer states all partitioned.

Its parts, one idea each:
zero3_units           a unit's flat buffer and shards, and the collectives that gather and reduce it
zero3_schedule        when each unit is gathered, freed and reduce-scattered, by the recorded order
zero3_model_state     leaving stage 3: gathered parameters, model state dicts, checkpoints
Here:
meta_parameters       build a model without memory; seeded_init/init_model fill it one unit at a time
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
from functools import partial

import torch
import torch.distributed as dist

from zero_lab.optim import OptimizerOverCopies, hold_gradients
from zero_lab.zero1 import MASTER_DTYPE, clip_grad_norm_, param_groups_of

if __name__ != "__main__":  # in the package; in the notebook these names are your cells below
    from zero_lab.zero3_model_state import ShardedModelState
    from zero_lab.zero3_schedule import ExecutionOrder, UnitSchedule  # ExecutionOrder: lesson 13 reaches it here
    from zero_lab.zero3_units import Unit, build_unit, default_is_unit, sharding_units


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
