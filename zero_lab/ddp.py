# Generated from solutions/02_ddp/02_ddp.ipynb by `zero-lab build`: edit the notebook, not this file.

"""Data parallelism from scratch, the baseline every ZeRO stage is measured against.

    broadcast_parameters(model)            # every rank starts from rank 0's weights
    ...loss.backward()
    all_reduce_gradients(model)            # naive: one all-reduce per parameter
    all_reduce_gradients_flat(model)       # one all-reduce over one flat buffer

    model = BucketedDDP(model)             # bucketed all-reduces overlapped with backward
    loss_fn(model(x), y).backward(); optimizer.step()           # the usual loop, unchanged
    with model.no_sync(): ...              # gradient accumulation without communication

    optimizer = MasterWeightOptimizer(bf16_model.parameters(), torch.optim.AdamW, lr=1e-3)

Follows PyTorch DDP (Li et al., VLDB 2020, arXiv:2006.15704): buckets in reverse parameter
order, launched in order on every rank, all-reduced asynchronously during backward and
waited for before backward returns.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


def broadcast_parameters(module: nn.Module, src: int = 0) -> None:
    """Overwrite every rank's parameters and buffers with rank `src`'s: all replicas start equal."""
    with torch.no_grad():  # an in-place write to a leaf that requires grad is not for autograd
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor, src)


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer updates, in `module.parameters()` order.

    A tied weight is one Parameter and is listed once, so its gradient is reduced once;
    frozen parameters have no gradient to reduce.
    """
    return [p for p in module.parameters() if p.requires_grad]


def gradients_to_reduce(module: nn.Module) -> list[torch.Tensor]:
    """The .grad of every trainable parameter: the same list, in the same order, on every rank."""
    missing = [name for name, p in module.named_parameters() if p.requires_grad and p.grad is None]
    if missing:
        raise RuntimeError(
            f"parameters {missing} got no gradient in this step, so this rank cannot all-reduce "
            "the same tensors as the others. Freeze them (requires_grad=False) or use "
            "BucketedDDP(module, find_unused_parameters=True)."
        )
    return [p.grad for p in trainable_parameters(module)]


def all_reduce_gradients(module: nn.Module) -> None:
    """Naive DDP, called after backward: average each gradient over the ranks, one all-reduce per parameter."""
    world_size = dist.get_world_size()
    for grad in gradients_to_reduce(module):
        dist.all_reduce(grad)  # the sum over ranks ...
        grad.div_(world_size)  # ... divided by N: the gradient of the global mean loss


def all_reduce_gradients_flat(module: nn.Module) -> None:
    """Average all gradients over the ranks with a single all-reduce of one flat buffer."""
    grads = gradients_to_reduce(module)
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(flat)
    flat.div_(dist.get_world_size())
    for grad, averaged in zip(grads, flat.split([grad.numel() for grad in grads])):
        grad.copy_(averaged.view_as(grad))


def assign_buckets(params: list[nn.Parameter], bucket_size_bytes: int) -> list[list[nn.Parameter]]:
    """Group `params` into buckets, last parameter first; close a bucket once it holds at least
    `bucket_size_bytes` bytes of gradient (the last bucket may hold less)."""
    buckets, bucket, bucket_bytes = [], [], 0
    for param in reversed(params):
        bucket.append(param)
        bucket_bytes += param.numel() * param.element_size()
        if bucket_bytes >= bucket_size_bytes:
            buckets.append(bucket)
            bucket, bucket_bytes = [], 0
    if bucket:
        buckets.append(bucket)
    return buckets


from zero_lab.optim import weak_hook  # a hook that does not keep the wrapper alive


@dataclass(eq=False)
class Bucket:
    params: list[nn.Parameter]
    ready: set = field(default_factory=set)  # parameters whose gradient is final for this backward
    buffer: torch.Tensor | None = None  # their gradients, flattened, being all-reduced
    work: dist.Work | None = None  # the handle of that asynchronous all-reduce

    def is_complete(self) -> bool:
        return len(self.ready) == len(self.params)


class BucketedDDP(nn.Module):
    """Data parallelism as PyTorch DDP does it: gradients are averaged bucket by bucket, each
    bucket all-reduced asynchronously as soon as backward has produced all of its gradients,
    and all of them waited for before `backward()` returns."""

    def __init__(self, module: nn.Module, bucket_size_bytes: int = 25 * 2**20, find_unused_parameters: bool = False):
        super().__init__()
        self.module = module
        self.find_unused_parameters = find_unused_parameters
        self.require_gradient_sync = True
        broadcast_parameters(module)
        params = trainable_parameters(module)
        if len({(p.dtype, p.device) for p in params}) > 1:
            raise ValueError("BucketedDDP flattens gradients into one buffer per bucket: "
                             "give every trainable parameter the same dtype and device")
        self.param_names = {p: name for name, p in module.named_parameters()}
        self.buckets = [Bucket(bucket) for bucket in assign_buckets(params, bucket_size_bytes)]
        self.bucket_of = {p: bucket for bucket in self.buckets for p in bucket.params}
        self.next_bucket = 0  # buckets are launched strictly in order, the same on every rank
        self.final_callback_queued = False
        # weak_hook: the parameters keep their hooks, and must not keep this wrapper alive (nor it them,
        # in a cycle through torch's C++ that Python's garbage collector cannot see): del model frees it
        self.hook_handles = [p.register_post_accumulate_grad_hook(weak_hook(self._on_gradient_ready)) for p in params]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Skip gradient synchronisation inside this block: gradients accumulate locally, and
        the first backward outside it averages the accumulated sums."""
        self.require_gradient_sync = False
        try:
            yield
        finally:
            self.require_gradient_sync = True

    def _on_gradient_ready(self, param: nn.Parameter) -> None:
        """The hook: `param.grad` is final for this backward pass. Launch, in bucket order,
        every bucket that is now complete; make sure the end-of-backward callback is queued."""
        if not self.require_gradient_sync:
            return
        if not self.final_callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_gradient_sync)
            self.final_callback_queued = True
        self.bucket_of[param].ready.add(param)
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].is_complete():
            self._launch(self.buckets[self.next_bucket])
            self.next_bucket += 1

    def _launch(self, bucket: Bucket) -> None:
        """Start averaging this bucket's gradients: flatten, divide by N, all-reduce asynchronously."""
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in bucket.params]
        bucket.buffer = torch.cat([grad.reshape(-1) for grad in grads]).div_(dist.get_world_size())
        bucket.work = dist.all_reduce(bucket.buffer, async_op=True)

    def _finish_gradient_sync(self) -> None:
        """Runs when backward ends: launch what is left, wait for every bucket, reset for the next backward."""
        self._refuse_missing_gradients()
        for bucket in self.buckets[self.next_bucket:]:
            self._launch(bucket)
        unused_everywhere = self._unused_on_every_rank() if self.find_unused_parameters else set()
        for bucket in self.buckets:
            self._wait_and_copy_back(bucket, unused_everywhere)
            bucket.ready.clear()
            bucket.buffer = bucket.work = None  # free the flat copy until the next backward
        self.next_bucket, self.final_callback_queued = 0, False

    def _wait_and_copy_back(self, bucket: Bucket, unused_everywhere: set) -> None:
        """Wait for the bucket's all-reduce; give each parameter its averaged gradient."""
        bucket.work.wait()
        for param, averaged in zip(bucket.params, bucket.buffer.split([p.numel() for p in bucket.params])):
            if param in unused_everywhere:
                continue
            if param.grad is None:
                param.grad = averaged.view_as(param).clone()
            else:
                param.grad.copy_(averaged.view_as(param))

    def _refuse_missing_gradients(self) -> None:
        """Without find_unused_parameters, a parameter without gradient is an error naming the fix."""
        missing = [self.param_names[p] for bucket in self.buckets for p in bucket.params if p not in bucket.ready]
        if missing and not self.find_unused_parameters:
            raise RuntimeError(
                f"parameters {missing} got no gradient in this backward pass, so their buckets "
                "cannot be all-reduced. If the model skips some parameters in some steps, use "
                "BucketedDDP(module, find_unused_parameters=True) (or zero_lab.prepare(..., stage=0, "
                "find_unused_parameters=True)): as with torch.optim, those no rank used are not updated."
            )

    def _unused_on_every_rank(self) -> set:
        """Parameters no rank computed a gradient for (one small all-reduce of flags)."""
        params = [p for bucket in self.buckets for p in bucket.params]
        ranks_with_gradient = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
        dist.all_reduce(ranks_with_gradient)
        return {p for p, count in zip(params, ranks_with_gradient.tolist()) if count == 0}


from zero_lab.optim import OptimizerOverCopies


class MasterWeightOptimizer(OptimizerOverCopies):
    """Mixed-precision optimizer: updates fp32 master copies of the (bf16) model parameters.

    The model holds 2 bytes of parameter and 2 of gradient per element; this holds the 4-byte
    master weights and the inner optimizer's state (8 bytes for Adam): 2 + 2 + 12 bytes.
    A torch.optim.Optimizer to LR schedulers: its param_groups are the inner optimizer's.
    """

    def __init__(self, params, optimizer_class=torch.optim.AdamW, **optimizer_kwargs):
        self.model_params = [p for p in params if p.requires_grad]
        self.master_params = [p.detach().float() for p in self.model_params]
        self.master_of = {id(p): master for p, master in zip(self.model_params, self.master_params)}
        super().__init__(optimizer_class(self.master_params, **optimizer_kwargs))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.evaluate_closure(closure)
        for master, param in zip(self.master_params, self.model_params):
            master.grad = None if param.grad is None else param.grad.float()
        self.optimizer.step()
        for master, param in zip(self.master_params, self.model_params):
            param.copy_(master)  # round to the model's precision
            master.grad = None  # the fp32 gradient copies were only needed for the update
        return loss

    @torch.no_grad()
    def write_master(self, param, value: torch.Tensor) -> None:
        """Give `param`'s fp32 master a loaded value: zero_lab.prepare sends model.load_state_dict here,
        which would otherwise be undone by the next step (it copies the masters into the model)."""
        if id(param) in self.master_of:
            self.master_of[id(param)].copy_(value)

    def state_dict(self) -> dict:
        """The fp32 masters too: the bf16 model alone would lose their low bits on resume."""
        return {"masters": [m.clone() for m in self.master_params], "optimizer": self.optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        for master, param, saved in zip(self.master_params, self.model_params, state["masters"], strict=True):
            master.copy_(saved)
            param.copy_(master)
