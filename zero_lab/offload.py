# Generated from solutions/06_offload/06_offload.ipynb by `zero-lab build`: edit the notebook, not this file.

"""ZeRO-Offload (Ren et al., USENIX ATC'21, arXiv:2101.06840) on top of ZeRO stages 1 and 2.

Per rank the device keeps the 16-bit parameters (2 Psi bytes) and runs forward and backward;
the host (CPU memory) keeps this rank's shard of the fp32 master weights, Adam's m and v and an
fp32 gradient shard (16 Psi / Nd bytes) and runs the update. Per step this rank's 16-bit
gradient shard goes down (2 Psi / Nd bytes), the updated 16-bit parameter shard comes up
(2 Psi / Nd bytes), and the ranks all-gather the parameters on the device, as in stage 2.
The link is zero_lab.host_link, the host's AdamW zero_lab.cpu_adam.

DelayedUpdate        when the host update runs: at once, or one step delayed (the paper's DPU)
OffloadCheckpoints   saving, loading and editing the weights with offload (a part of the optimizers)
Zero1Offload, Zero2Offload   the optimizers behind zero_lab.prepare(..., stage=1|2, offload="cpu")
"""

from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext

import torch
import torch.distributed as dist

from zero_lab.optim import weak_hook
from zero_lab.zero1 import FlatGroup, Zero1Optimizer, all_gather_params
from zero_lab.zero2 import Bucket, Zero2Optimizer

if __name__ != "__main__":  # in the package; in the notebook these names are your cells above
    from zero_lab.cpu_adam import compiled_adam_, compiled_adamw_step, cpu_adam_, host_update
    from zero_lab.host_link import Link, Timeline, offload_bucket, upload_shard


class DelayedUpdate:
    """When the host update of each step runs: at once, or one step delayed (DPU).

    update(grads)  runs the optimizer on the host's fp32 shards with these gradient shards
    upload()       sends the updated shards up and all-gathers the parameters on the device
    warmup_steps   None: no DPU, every step updates and uploads before returning. K: the first
                   K steps do the same; from step K + 1 on, step t starts its update in a
                   background thread and returns at once, so that the device computes forward
                   and backward of step t + 1 while the host updates; step t + 1 first waits
                   for that update and uploads its parameters. Forward and backward of step
                   t + 1 therefore see the parameters of step t - 1 (the one-step delayed parameter update of ZeRO-Offload).
    The gradient shards passed to step() are read by the background update: the caller must
    not write them until the next step() has returned (the optimizer alternates two buffers).
    """

    def __init__(self, update, upload, warmup_steps: int | None = None):
        self.update, self.upload, self.warmup_steps = update, upload, warmup_steps
        self.steps = 0  # step() calls so far
        self.pending: Future | None = None  # the update running in the background, if any
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-update")

    def delays(self) -> bool:
        """Whether the current step (the self.steps-th) runs its update in the background."""
        return self.warmup_steps is not None and self.steps > self.warmup_steps

    def step(self, grads: list[torch.Tensor]) -> None:
        """Count the step; finish the previous step's delayed update if there is one (flush);
        then update with grads either now, followed by upload(), or in the background
        (self.pending = self.worker.submit(...)) once past the warm-up."""
        self.steps += 1
        self.flush()
        if self.delays():
            self.pending = self.worker.submit(self.update, grads)
        else:
            self.update(grads)
            self.upload()

    def flush(self) -> None:
        """If an update runs in the background: wait for it (re-raising its exception), forget
        it, and upload its parameters. Called by step(), and before anything reads the weights."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()
            self.upload()


class OffloadCheckpoints:
    """Saving, loading and editing the weights with offload (a part of _Offload, below): a delayed
    update (DPU) belongs to the checkpoint, its upload to the next step; loaded weights reach the host masters."""

    def _finish_update(self) -> None:
        """Wait for a delayed update but leave its upload to the next step, as if nothing had happened."""
        if self.schedule.pending is not None:
            self.schedule.pending.result()

    def _before_load(self) -> None:  # model.load_state_dict: the loaded weights come after every update
        self.flush()

    def _own_weights(self, group: FlatGroup) -> torch.Tensor:
        return self.link.to_host(group.flat_param[slice(*group.layout.shard(self.rank))]).host_wait()

    def _adopt_edited_weights(self) -> None:
        edited = any(self._edited(g, versions) for g, versions in zip(self.groups, self.weight_versions))
        if edited and self.schedule.pending is not None:
            raise RuntimeError("parameters were changed in place while a delayed update (DPU) was pending: the device "
                               "holds older parameters than the host, so the edit cannot be told from the update. Call "
                               "optimizer.flush() before editing them, or set them with model.load_state_dict(...)")
        super()._adopt_edited_weights()

    def state_dict(self) -> dict:
        """Lesson 03's, plus the schedule: saving does not change the run, and a resumed run goes on
        exactly, warm-up and delay included (with DPU, the device's older parameters are saved too)."""
        self._finish_update()  # the delayed update belongs to the checkpoint; its upload stays pending
        state = super().state_dict()
        delayed = self.schedule.pending is not None
        state["schedule"] = {"steps": self.schedule.steps, "device_params": [
            g.flat_param[slice(*g.layout.shard(self.rank))].clone() for g in self.groups] if delayed else None}
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Lesson 03's loading (checks, AdamW's state, the masters), with its all-gather on the device.

        Lesson 03 copies each saved master shard into group.master and all-gathers it into
        flat_param. Here the masters live on the host, and a collective on CUDA (nccl) takes device
        tensors only: so while it loads, group.master is this rank's slice of the device's
        flat_param; the saved shard goes up into it, the all-gather runs on the device, and the host
        master takes the saved fp32 values.
        """
        if "world_size" not in state:  # a consolidated state: optimizer states only (lesson 03)
            self.flush()
            return super().load_state_dict(state)
        self._finish_update()
        self.schedule.pending = None  # replaced by what the checkpoint says
        host_masters = [group.master for group in self.groups]
        for group, master in zip(self.groups, host_masters):
            start = group.layout.shard(self.rank)[0]
            group.master = group.flat_param[start:start + master.numel()]
        try:
            super().load_state_dict(state)
        finally:
            for group, master in zip(self.groups, host_masters):
                group.master = master
        for master, saved in zip(host_masters, state["masters"]):
            master.copy_(saved)
        schedule = state.get("schedule", {"steps": 0, "device_params": None})
        self.schedule.steps = schedule["steps"]  # the warm-up is not repeated
        if schedule["device_params"] is not None:  # saved between a delayed update and its upload
            for group, shard in zip(self.groups, schedule["device_params"]):
                all_gather_params(group.flat_param, shard.to(group.flat_param.device))
            self.schedule.pending = Future()
            self.schedule.pending.set_result(None)  # the next step uploads the loaded masters
        self._note_weights()  # the weights just loaded are no edit

    def consolidated_state_dict(self, dst: int = 0) -> dict | None:
        self._finish_update()
        return super().consolidated_state_dict(dst)


DPU_WARMUP_STEPS = 40  # the paper's: DPU after the first 40 iterations in its convergence runs (section 6.2.4)


class _Offload(OffloadCheckpoints):
    """What offloading adds to lesson 03's and 04's optimizers (mixed in below).

    Takes their arguments (params, param_dtype, max_grad_norm, bucket_numel for stage 2, the
    optimizer's options), plus
    dpu_warmup_steps  None: no delayed update. K: one-step delayed parameter update (DPU) after
                      K ordinary steps (e.g. DPU_WARMUP_STEPS).
    cpu_adam          "compiled" (default): AdamW runs as compiled_adam_, one compiled pass, equal
                      to torch's fused AdamW; cpu_adam_ if there is no C compiler. "torch": as
                      cpu_adam_, torch's operations, bit for bit torch's default (for-loop) AdamW.
    adam_threads      threads of the host's AdamW; 1 runs it in the calling thread.
    Adam, SGD or AdamW with amsgrad/maximize run as torch's own step on the host shards. The
    device is the model's: CUDA, or simulated when the model is on the CPU.
    """

    offloads = True
    reshardable = False  # its states live in host buffers of its own: lesson 16's resharding does not reach them

    def __init__(self, model, optimizer_class=torch.optim.AdamW, params=None, *,
                 dpu_warmup_steps: int | None = None, cpu_adam: str = "compiled", adam_threads: int = 1, **options):
        if dpu_warmup_steps is not None and dpu_warmup_steps < 0:
            raise ValueError(f"dpu_warmup_steps must be None (no DPU) or >= 0, got {dpu_warmup_steps}")
        if adam_threads < 1:
            raise ValueError(f"adam_threads must be at least 1, got {adam_threads}")
        if cpu_adam not in ("compiled", "torch"):
            raise ValueError(f'cpu_adam must be "compiled" (one compiled pass) or "torch" (cpu_adam_), got {cpu_adam!r}')
        self.link = Link(next(model.parameters()).device)
        self.timeline: Timeline | None = None  # set one to record the spans of work
        super().__init__(model, optimizer_class, params, **options)
        self.host_grads = [self.link.host_zeros(g.master.numel()) for g in self.groups]
        self.spare_grads: list[torch.Tensor] | None = None  # DPU: backward fills these while the host updates
        self.pool = ThreadPoolExecutor(adam_threads, thread_name_prefix="cpu-adam") if adam_threads > 1 else None
        runs_adamw = optimizer_class is torch.optim.AdamW and not any(
            g.get("amsgrad") or g.get("maximize") for g in self.optimizer.param_groups)
        compiled = cpu_adam == "compiled" and runs_adamw and compiled_adamw_step() is not None
        self.adam = (compiled_adam_ if compiled else cpu_adam_) if runs_adamw else None  # None: torch's own step
        self.schedule = DelayedUpdate(weak_hook(self._update), weak_hook(self._upload), dpu_warmup_steps)  # no cycle
        self.gradients_sent = False
        # The host update runs on its own copy of the param groups, with the options that step() found
        # (a delayed update runs after step() has returned, when an LR scheduler has changed them for the
        # next step), over the same masters and state.
        self.host_optimizer = type(self.optimizer)([{**g, "params": list(g["params"])} for g in self.optimizer.param_groups])
        self.step_inputs = {}  # id of a gradient buffer list -> (options, unused plan) of the step it feeds

    def _flatten_group(self, params, param_dtype) -> FlatGroup:
        group = super()._flatten_group(params, param_dtype)
        master = self.link.host_zeros(group.master.numel())
        master.copy_(group.master)  # the fp32 shard moves to the host: never a view of the device buffer
        group.master = master
        return group

    def _span(self, lane: str, label: str):
        return nullcontext() if self.timeline is None else self.timeline.span(lane, label)

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step (_step); as with torch.optim, a closure re-evaluates the loss first."""
        loss = self.evaluate_closure(closure)
        options = [{k: v.clone() if torch.is_tensor(v) else v for k, v in g.items() if k != "params"}
                   for g in self.optimizer.param_groups]
        self.step_inputs[id(self.host_grads)] = (options, self.unused.plan())  # _step hands host_grads over
        self._step()
        self.gradients_sent = False  # stage 1: the next step reduces and sends its own gradients
        return loss

    def _step(self) -> None:
        """Gradient shards on the host (_host_gradients), clipped (_clip_) if max_grad_norm is set
        (the norm goes to self.last_grad_norm), handed to self.schedule; if the schedule left the
        update running, switch host_grads with spare_grads (made like host_grads the first time)."""
        grads = self._host_gradients()
        if self.max_grad_norm is not None:
            self.last_grad_norm = self._clip_(grads, self.max_grad_norm)
        self.schedule.step(grads)
        if self.schedule.pending is not None:  # the update reads grads in the background: switch buffers
            self.spare_grads = self.spare_grads or [torch.zeros_like(g) for g in self.host_grads]
            self.host_grads, self.spare_grads = self.spare_grads, self.host_grads

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the host gradient shards to a global L2 norm <= max_norm before step(); return the
        norm. torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) calls this."""
        return self._clip_(self._host_gradients(), max_norm)

    def flush(self) -> None:
        """Finish a delayed update now (DPU): afterwards the model holds the newest parameters."""
        self.schedule.flush()

    def _update(self, grads: list[torch.Tensor]) -> None:
        options, plan = self.step_inputs[id(grads)]  # as they were when step() was called
        optimizer = self.host_optimizer
        optimizer.state = self.optimizer.state  # one state (load_state_dict replaces the dict)
        for group, frozen in zip(optimizer.param_groups, options):
            group.update(frozen)
        masters = [g.master for g in self.groups]
        with self._span("host", "update"), self.unused.applied(plan, optimizer, grads):
            if self.adam is not None:
                host_update(optimizer, masters, grads, self.pool, self.adam)
            else:
                for master, grad in zip(masters, grads):
                    master.grad = grad
                optimizer.step()
                for master in masters:
                    master.grad = None

    def _upload(self) -> None:
        with self._span("device", "upload, all-gather"):
            for group in self.groups:
                upload_shard(group.flat_param, group.master, group.layout.shard(self.rank)[0], self.link)

    def _clip_(self, grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        # Lesson 03's global-norm clipping, on host shards: the squared norm crosses to the device for the all-reduce.
        squares = torch.zeros((), dtype=torch.float32)
        for grad, group in zip(grads, self.groups):
            squares += grad[:group.layout.real_numel(self.rank)].pow(2).sum()
        total = squares.to(self.link.device)
        dist.all_reduce(total)
        norm = total.cpu().sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for grad in grads:
            grad.mul_(scale)
        return norm

    def model_state_tensors(self, placement: str | None = None) -> dict[str, list[torch.Tensor]]:
        """What this rank holds on the device (16-bit parameters, gradients not yet offloaded)
        and on the host (fp32 masters, gradient shards, Adam's states), for the memory ledger."""
        device = {"parameters": list(self.model.parameters()), "gradients": self._device_gradients()}
        host = {"gradients": self.host_grads + (self.spare_grads or []),
                "master_params": [g.master for g in self.groups],
                "optimizer_states": [v for state in self.optimizer.state.values() for v in state.values()
                                     if torch.is_tensor(v) and v.dim() > 0]}
        if placement is not None:
            return {"device": device, "host": host}[placement]
        return {k: device.get(k, []) + host.get(k, []) for k in ("parameters", "gradients", "master_params", "optimizer_states")}


class Zero1Offload(_Offload, Zero1Optimizer):
    """Stage 1 with offload: the full 16-bit gradient stays on the device until step(), which
    reduce-scatters it (lesson 03) and sends this rank's shard down. Device: 4 Psi bytes."""

    def _host_gradients(self) -> list[torch.Tensor]:
        if not self.gradients_sent:  # once per step: clip_grad_norm_ may have asked before step()
            self._send_gradients()
            self.gradients_sent = True
        return self.host_grads

    def _send_gradients(self) -> None:
        """Reduce-scatter the device's gradients (lesson 03) and copy each shard down into host_grads."""
        for host_grad, shard in zip(self.host_grads, self.reduce_gradients()):
            host_grad.copy_(self.link.to_host(shard).host_wait())

    def _device_gradients(self) -> list[torch.Tensor]:
        return [g.flat_grad for g in self.groups]


class Zero2Offload(_Offload, Zero2Optimizer):
    """Stage 2 with offload (ZeRO-Offload's multi-GPU mode): each bucket's piece goes down as
    soon as it is reduced, so the device keeps only the 16-bit parameters (2 Psi bytes) and the
    buckets in flight."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        del self.grad_shards  # lesson 04's 16-bit shards: the fp32 ones on the host replace them

    def _accumulate(self, bucket: Bucket) -> None:  # lesson 04's hook, with the shard on the host
        with self._span("device", "offload bucket"):
            offload_bucket(bucket, self.host_grads[bucket.group], self.groups[bucket.group].layout.shard(self.rank)[0],
                           self.rank, self.link)
        bucket.ready.clear()

    def _host_gradients(self) -> list[torch.Tensor]:
        self.shards_used = True  # as in lesson 04: a backward before zero_grad() raises
        self.link.wait_downloads()  # the pieces sent during backward, added in: the host reads them now
        return self.host_grads

    def _device_gradients(self) -> list[torch.Tensor]:
        not_yet_reduced = [p.grad for g in self.groups for p in g.params if p.grad is not None]
        return not_yet_reduced + [t for b in self.buckets for t in (b.staging, b.received) if t is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the host gradient shards (set_to_none is ignored: they are reused)."""
        self.link.wait_downloads()  # no piece may land after the zeros
        for grad in self.host_grads:
            grad.zero_()
        self.shards_used = False


OFFLOAD_OPTIMIZERS = {1: Zero1Offload, 2: Zero2Offload}
