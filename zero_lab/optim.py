"""What makes the course's optimizers drop-in torch.optim.Optimizers.

MasterWeightOptimizer (lesson 02) and the ZeRO optimizers (lessons 03 onwards) each run an
ordinary torch optimizer, `inner`, over tensors the model does not see: fp32 master copies of
the parameters, or this rank's shard of them. `OptimizerOverCopies` is the base they share: a
torch.optim.Optimizer whose param_groups and state *are* inner's, so PyTorch's LR schedulers
(StepLR, OneCycleLR, LambdaLR, ...) accept it, and a change to param_groups[i]["lr"] changes
the next update, as with torch.optim.AdamW.

When each rank holds only a shard of the averaged gradient, the ordinary
`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` would see the wrong gradients
(stage 1: this rank's unreduced ones; stage 2: none). `hold_gradients` routes that call to the
optimizer holding them, which computes the global norm over the shards and clips them.

Hooks that call back into an optimizer or a wrapper go through `weak_hook`: the model (whose
parameters and modules keep their hooks) then does not keep the optimizer alive, and dropping
both frees both. A hook on a parameter that refers back to the parameter must be weak: torch
keeps post-accumulate-grad hooks in C++, where Python's garbage collector cannot see the cycle,
so it would never be freed.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch.utils.weak import WeakIdKeyDictionary


class OptimizerOverCopies(torch.optim.Optimizer):
    """A torch.optim.Optimizer that delegates to `inner`, sharing its param groups and state.

    Subclasses set up the copies, build `inner` over them, call this __init__, and define
    step(closure=None) and zero_grad(set_to_none=True).
    """

    def __init__(self, inner: torch.optim.Optimizer):
        self.optimizer = inner
        # Optimizer.__init__ assigns self.param_groups and self.state (the setters below write
        # them to inner) and adds inner's group dicts back one by one, checking them.
        super().__init__(list(inner.param_groups), inner.defaults)
        self.built = True

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, state) -> None:
        self.optimizer.state = state

    @staticmethod
    def evaluate_closure(closure):
        """What torch.optim's step(closure) does first: re-evaluate the loss, with gradients on
        (step itself runs under no_grad). None without a closure."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "built", False):
            raise NotImplementedError(f"{type(self).__name__} cannot take parameters after it is built: "
                                      "build a new one with every param group (zero_lab.prepare(..., params=groups))")
        super().add_param_group(param_group)


class weak_hook:
    """weak_hook(obj.method, *args): a hook that calls obj.method(*args, *hook_args) while obj is
    alive and does nothing (returns None) once it is gone, without keeping obj alive.

    Register it instead of the bound method (or functools.partial of it) on parameters and modules:
        p.register_post_accumulate_grad_hook(weak_hook(self._on_gradient_ready))
        module.register_forward_pre_hook(weak_hook(self._pre_forward, index))
    """

    __slots__ = ("method", "args", "__weakref__")

    def __init__(self, method, *args):
        self.method = weakref.WeakMethod(method) if method is not None else _gone  # None: a hook of nothing
        self.args = args

    def __call__(self, *args, **kwargs):
        method = self.method()
        return None if method is None else method(*self.args, *args, **kwargs)

    def __reduce__(self):  # copy.deepcopy (and pickle): the same hook on the copy of its object
        return weak_hook, (self.method(), *self.args)

    def __repr__(self) -> str:
        method = self.method()
        return f"weak_hook({'<gone>' if method is None else method.__qualname__})"


def _gone() -> None:
    return None


def _weak_if_bound(function):
    """A bound method as a weak_hook (its object is not kept alive); anything else as it is."""
    return weak_hook(function) if function is not None and hasattr(function, "__self__") and \
        hasattr(function, "__func__") else function


def remove_hooks(*handle_lists) -> None:
    """Remove every hook of these lists of torch's RemovableHandles; removing one twice does nothing."""
    for handles in handle_lists:
        for handle in handles:
            handle.remove()


_holders = WeakIdKeyDictionary()  # parameter -> weakref to the optimizer holding its averaged gradient
_torch_clip_grad_norm_ = torch.nn.utils.clip_grad.clip_grad_norm_


def hold_gradients(optimizer, params) -> None:
    """From now on, torch.nn.utils.clip_grad_norm_ over `params` calls optimizer.clip_grad_norm_(max_norm)."""
    for p in params:
        _holders[p] = weakref.ref(optimizer)
    torch.nn.utils.clip_grad_norm_ = torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_


def _holder(param):
    holder = _holders.get(param)
    return holder() if holder is not None else None


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_, also right for parameters whose gradient a ZeRO optimizer shards."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    holders = {id(h): h for h in map(_holder, params) if h is not None}
    if not holders:
        return _torch_clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
    holder = next(iter(holders.values()))
    given = {id(p) for p in params}
    others = [p for p in params if _holder(p) is not holder and p.grad is not None]
    if len(holders) > 1 or others or any(id(p) not in given for g in holder.groups for p in g.params):
        raise ValueError("clip_grad_norm_ over sharded gradients needs exactly the parameters one ZeRO optimizer "
                         "trains: pass model.parameters(), or use zero_lab.prepare(..., max_grad_norm=)")
    if float(norm_type) != 2.0:
        raise ValueError(f"the ZeRO optimizers clip by the L2 norm only, not norm_type={norm_type}")
    total_norm = holder.clip_grad_norm_(max_norm)
    if error_if_nonfinite and not torch.isfinite(total_norm):
        raise RuntimeError(f"the total norm of the gradients is {total_norm.item()}: not finite")
    return total_norm


class UnusedParameters:
    """torch.optim's rule for a parameter that got no gradient, kept by optimizers over flat shards.

    torch.optim skips a parameter whose .grad is None: no weight decay, no change to its moments or
    to its step count. A flat shard is updated as one tensor, so the ZeRO optimizers learn which
    parameters got a gradient since the last step (a post-accumulate-grad hook on each) and, at step():
    - by default, as torch's DDP, a parameter without gradient on this rank is an error that names
      find_unused_parameters=True: nothing is communicated, nothing moves silently;
    - with find_unused_parameters=True, one all-reduce of a flag per parameter tells every rank which
      parameters no rank used (any rank used it: it has a gradient). After the update their elements
      get back their values and states, and every parameter keeps its own step count: one skipped in
      some steps is updated with Adam's bias corrections for its own count (the state keeps the counts
      as "param_steps" while they differ from the shard's "step").
    Works for any optimizer over flat param groups with .params, .layout (ShardLayout) and .master
    (this rank's shard): lessons 03, 04 and 06 use it, and stage 3's shards fit it too.
    """

    def __init__(self, groups, rank: int, names: dict, find_unused_parameters: bool = False):
        self.groups, self.rank, self.names = groups, rank, names
        self.find_unused_parameters = find_unused_parameters
        self.used = set()  # ids of the parameters that got a gradient since the last plan()
        self.pieces = [self._pieces(group) for group in groups]
        self.handles = [p.register_post_accumulate_grad_hook(weak_hook(self._mark_used)) for g in groups for p in g.params]

    def _mark_used(self, param) -> None:
        self.used.add(id(param))

    def _pieces(self, group) -> list[tuple[int, int, int]]:
        """(parameter index, lo, hi): where each parameter lies in this rank's shard, in shard coordinates."""
        start, stop = group.layout.shard(self.rank)
        pieces, offset = [], 0
        for index, p in enumerate(group.params):
            lo, hi = max(offset, start), min(offset + p.numel(), stop)
            if lo < hi:
                pieces.append((index, lo - start, hi - start))
            offset += p.numel()
        return pieces

    def plan(self) -> list[list[bool]] | None:
        """Per group, which parameters got a gradient on some rank since the last plan; None when
        there is nothing to skip. Every rank calls it once per step, before the update."""
        used = [[id(p) in self.used for p in g.params] for g in self.groups]
        self.used.clear()
        if not self.find_unused_parameters:
            missing = [self.names.get(p, f"#{i}") for g, flags in zip(self.groups, used)
                       for i, (p, u) in enumerate(zip(g.params, flags)) if not u]
            if missing:
                raise RuntimeError(
                    f"parameters {missing} got no gradient on rank {self.rank} since the last step. torch.optim "
                    "would leave them as they are; a flat shard would move them (weight decay, moments). If the "
                    "model skips parameters in some steps, pass find_unused_parameters=True (zero_lab.prepare or "
                    "the optimizer: one small all-reduce per step); if they never train, freeze them "
                    "(requires_grad=False) or leave them out of params")
            return None
        flags = torch.tensor([u for flags in used for u in flags], dtype=torch.int32,
                             device=self.groups[0].flat_param.device)
        torch.distributed.all_reduce(flags)  # how many ranks used each parameter
        anywhere = iter(flags.gt(0).tolist())
        return [[next(anywhere) for _ in g.params] for g in self.groups]

    @staticmethod
    def _count(state, count: float | None = None) -> float:
        """A step count as the shard's state compares it: Adam's "step"; an optimizer without one
        (SGD) only knows whether it has state, so every count from 1 on is the same."""
        if count is None:
            return float(state["step"]) if "step" in state else float(bool(state))
        return count if "step" in state or not state else min(count, 1.0)

    @torch.no_grad()
    def before(self, plan, optimizer, grads) -> list | None:
        """Call just before optimizer updates the masters with grads; pass what it returns to after()."""
        if plan is None:
            return None
        records = []
        for index, (group, used, grad) in enumerate(zip(self.groups, plan, grads)):
            state = optimizer.state[group.master]
            counts = state.get("param_steps")
            if all(used) and counts is None:
                continue  # every parameter used, every count the shard's: the update is torch's
            shard_count = self._count(state)
            counts = counts.tolist() if counts is not None else [shard_count] * len(used)
            held = [(lo, hi) for i, lo, hi in self.pieces[index] if not used[i]]
            own = {}  # count -> pieces of used parameters whose count is not the shard's
            for i, lo, hi in self.pieces[index]:
                if used[i] and self._count(state, counts[i]) != shard_count:
                    own.setdefault(counts[i], []).append((lo, hi))
            device, row = group.master.device, sum(hi - lo for lo, hi in held)
            updates = []  # (count, positions in the shard, rows of the saved values)
            for count, pieces in own.items():
                numel = sum(hi - lo for lo, hi in pieces)
                updates.append((count, _positions(pieces, device), torch.arange(row, row + numel, device=device)))
                row += numel
            positions = _positions(held + [piece for pieces in own.values() for piece in pieces], device)
            keys = [k for k, v in state.items()
                    if torch.is_tensor(v) and v.shape == group.master.shape and k != "param_steps"]
            records.append(dict(
                index=index, used=used, counts=counts, keys=keys, positions=positions, updates=updates,
                had_state=bool(state), step=state["step"].clone() if "step" in state else None, grad=grad,
                saved={"master": group.master[positions].clone(), **{k: state[k][positions].clone() for k in keys}}))
        return records

    @torch.no_grad()
    def after(self, optimizer, records) -> None:
        """Undo the update where torch.optim would not have made it; redo it with each parameter's own count."""
        for record in records or []:
            group = self.groups[record["index"]]
            master, state, positions, saved = group.master, optimizer.state[group.master], record["positions"], record["saved"]
            master[positions] = saved["master"]
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == master.shape and key != "param_steps":
                    value[positions] = saved[key] if key in saved else 0  # a state made in this step starts at 0
            if not any(record["used"]):  # nothing in this group was updated: neither is its step count
                if not record["had_state"]:
                    state.clear()
                elif record["step"] is not None:
                    state["step"].copy_(record["step"])
            options = {k: v for k, v in optimizer.param_groups[record["index"]].items() if k != "params"}
            for count, own, rows in record["updates"]:
                self._own_update(type(optimizer), options, master, state, record, own, rows, count)
            counts = [c + u for c, u in zip(record["counts"], record["used"])]
            state.pop("param_steps", None)
            if state and any(self._count(state, c) != self._count(state) for c in counts):
                state["param_steps"] = torch.tensor(counts, dtype=torch.float32, device=master.device)

    @staticmethod
    def _own_update(optimizer_class, options, master, state, record, positions, rows, count) -> None:
        """One step of the same torch optimizer over the elements `positions`, from their own state and count."""
        piece = record["saved"]["master"][rows].clone()
        piece.grad = record["grad"][positions].to(piece.dtype)
        single = optimizer_class([{**options, "params": [piece]}])
        if count > 0:  # a parameter never updated starts from torch's fresh state
            single.state[piece] = {k: record["saved"][k][rows].clone() for k in record["keys"]}
            if record["step"] is not None:
                single.state[piece]["step"] = torch.tensor(float(count), dtype=record["step"].dtype)
        single.step()
        master[positions] = piece
        for key, value in single.state[piece].items():
            if torch.is_tensor(value) and value.shape == piece.shape:
                state[key][positions] = value

    @contextmanager
    def applied(self, plan, optimizer, grads):
        """with unused.applied(plan, optimizer, grads): <the update of the masters>."""
        records = self.before(plan, optimizer, grads)
        yield
        self.after(optimizer, records)


def _positions(pieces, device) -> torch.Tensor:
    return torch.cat([torch.arange(lo, hi, device=device) for lo, hi in pieces]) if pieces else \
        torch.zeros(0, dtype=torch.long, device=device)


class ParametersOnly(torch.nn.Module):
    """A module that only holds parameters: what an optimizer built from parameters alone (as torch's
    ZeroRedundancyOptimizer(params, ...) is) hooks in place of a model. groups: torch.optim's param
    groups as dicts; the parameters keep their identity (named p0, p1, ... in messages)."""

    def __init__(self, groups: list[dict]):
        super().__init__()
        for index, param in enumerate(p for group in groups for p in group["params"]):
            self.register_parameter(f"p{index}", param)


def write_through_loads(model: torch.nn.Module, write, before=None):
    """Make model.load_state_dict(...) reach the optimizer's own copies of the weights.

    An optimizer that keeps fp32 masters or host shards would overwrite loaded weights with its
    copies at the next step. This registers a load_state_dict pre-hook on `model`: for each loaded
    parameter, write(param, value) gets the value as given (fp32 kept when the model computes in
    bf16); before() runs first (e.g. finish a delayed update). Returns the hook's handle.
    Bound methods are held weakly (weak_hook): the model does not keep their optimizer alive, and
    once it is gone loading writes nothing through.
    """
    named = list(model.named_parameters(remove_duplicate=False))  # tied weights: every name
    write, before = _weak_if_bound(write), _weak_if_bound(before)

    def hook(module, state_dict, prefix, *args):
        found = [(p, state_dict[prefix + name]) for name, p in named
                 if prefix + name in state_dict and torch.is_tensor(state_dict[prefix + name])
                 and state_dict[prefix + name].numel() == p.numel()]  # a wrong shape: torch's own error follows
        if before is not None:
            before()
        with torch.no_grad():
            for p, value in found:
                write(p, value)

    return model.register_load_state_dict_pre_hook(hook)
