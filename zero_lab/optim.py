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
"""

from __future__ import annotations

import weakref

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
