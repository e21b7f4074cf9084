# Generated from solutions/06_offload/06_offload.ipynb by `zero-lab build`: edit the notebook, not this file.

"""ZeRO-Offload (Ren et al., USENIX ATC'21, arXiv:2101.06840) on top of ZeRO stages 1 and 2.

Per rank the device keeps the 16-bit parameters (2 Psi bytes) and runs forward and backward;
the host (CPU memory) keeps this rank's shard of the fp32 master weights, Adam's m and v and an
fp32 gradient shard (16 Psi / Nd bytes) and runs the update. Per step this rank's 16-bit
gradient shard goes down (2 Psi / Nd bytes), the updated 16-bit parameter shard comes up
(2 Psi / Nd bytes), and the ranks all-gather the parameters on the device, as in stage 2.

Link               the host-device link: host buffers, copies across it (counted), a side stream on CUDA
Timeline           spans of work per lane (device, host), for the pictures
offload_bucket     finish a reduced gradient bucket: this rank's piece goes down into the fp32 host shard
upload_shard       the updated shard goes up in 16 bits and is all-gathered on the device
cpu_adam_          AdamW on flat fp32 host shards with torch's operations: in cache-sized chunks, optionally on threads
compiled_adam_     the same step as one compiled C loop (one pass over memory), built with this machine's compiler
host_update        one such step for every param group, with torch.optim.AdamW's state and options
DelayedUpdate      when the host update runs: at once, or one step delayed (the paper's DPU)
Zero1Offload, Zero2Offload   the optimizers behind zero_lab.prepare(..., stage=1|2, offload="cpu")
"""

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from zero_lab.memory_ledger import record_transfer
from zero_lab.zero1 import FlatGroup, Zero1Optimizer, all_gather_params
from zero_lab.zero2 import Bucket, Zero2Optimizer


class Link:
    """The host-device link: host buffers, and copies across the link, counted by direction.

    On CUDA the device is this rank's GPU. Host buffers are pinned (page-locked), so a copy is a
    DMA transfer, issued non-blocking on a side stream and ordered by CUDA events: the copy waits
    for the device work that produced its source, later device work waits for the copy's event,
    and the host thread waits only where it reads a copy's result (to_host). Uploads never block
    the host: they overlap each other, the device's compute and the host's next work. This CUDA
    path has not been run on a GPU in this course (it has none); the lesson runs the simulated one.
    Without an accelerator the device is *simulated*: device tensors are ordinary CPU tensors that
    the optimizer reports to the memory ledger as device memory, and a copy across the link is a
    real copy, counted the same way (zero_lab.memory_ledger.TransferLedger).
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.simulated = self.device.type != "cuda"
        self.stream = None if self.simulated else torch.cuda.Stream(self.device)
        self.in_flight: list[tuple[torch.cuda.Event, torch.Tensor]] = []  # uploads' host sources, kept until copied

    def host_zeros(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, pin_memory=not self.simulated)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of device `tensor` (same dtype), ready to read when this returns."""
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=not self.simulated)
        copied = self._copy(host, tensor)
        record_transfer("to_host", tensor)
        if copied is not None:
            copied.synchronize()  # the host reads it next: wait for this copy only, not for the stream
        return host

    def to_device(self, device_tensor: torch.Tensor, host_tensor: torch.Tensor) -> None:
        """Copy host_tensor into device_tensor (same dtype: cast on the host, send the small one).
        Returns at once on CUDA; device work queued afterwards sees the copy."""
        copied = self._copy(device_tensor, host_tensor)
        record_transfer("to_device", host_tensor)
        if copied is not None:
            self.in_flight.append((copied, host_tensor))

    def _copy(self, destination: torch.Tensor, source: torch.Tensor) -> torch.cuda.Event | None:
        """Copy across the link; on CUDA return the event that marks the copy done."""
        if self.stream is None:
            destination.copy_(source)
            return None
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # the source was written by device work queued before
        with torch.cuda.stream(self.stream):
            destination.copy_(source, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        for tensor in (destination, source):
            if tensor.is_cuda:
                tensor.record_stream(self.stream)  # the allocator must not reuse it before the copy ran
        compute.wait_event(copied)  # device work queued after sees the copy
        self.in_flight = [(event, kept) for event, kept in self.in_flight if not event.query()]
        return copied


class Timeline:
    """Spans of work per lane ("device", "host"), recorded as they happen, for the timeline picture.

    Wall-clock times from the thread that does the work. On CUDA, kernels run asynchronously to
    the host thread that queues them, and a device lane would need CUDA events instead.
    """

    def __init__(self):
        self.origin = time.perf_counter()
        self.spans: list[tuple[str, str, float, float]] = []  # (lane, label, start s, stop s)

    @contextmanager
    def span(self, lane: str, label: str):
        start = time.perf_counter() - self.origin
        try:
            yield
        finally:
            self.spans.append((lane, label, start, time.perf_counter() - self.origin))


@torch.no_grad()
def offload_bucket(bucket: Bucket, host_grad: torch.Tensor, shard_start: int, rank: int, link: Link) -> None:
    """Finish a bucket whose reduce-scatter was started (lesson 04's hook): this rank's piece of
    the mean gradient goes down to the host and is added into its fp32 gradient shard.

    host_grad is this rank's fp32 gradient shard on the host, starting at shard_start in the
    padded flat buffer; bucket.slices[rank] is the piece, in buffer coordinates. Average on the
    device, in the 16-bit dtype (as stage 2 does), so that only 2 bytes per element cross the
    link; then release bucket.staging, bucket.received and bucket.work.
    """
    bucket.work.wait()
    lo, hi = bucket.slices[rank]
    piece = link.to_host(bucket.received / dist.get_world_size())
    host_grad[lo - shard_start:hi - shard_start] += piece  # fp32 += 16-bit: widened exactly
    bucket.staging = bucket.received = bucket.work = None


@torch.no_grad()
def upload_shard(flat_param: torch.Tensor, master: torch.Tensor, shard_start: int, link: Link) -> None:
    """Send this rank's updated fp32 master shard up and all-gather the parameters on the device.

    flat_param is the padded flat buffer of parameters on the device (compute dtype); master is
    this rank's fp32 shard on the host, elements [shard_start, shard_start + master.numel()).
    Cast on the host, copy into this rank's slice of flat_param, then all-gather in place.
    """
    own = flat_param[shard_start:shard_start + master.numel()]
    link.to_device(own, master.to(flat_param.dtype))
    dist.all_gather_single(flat_param, own)


CHUNK_NUMEL = 2**16  # 256 kB per fp32 array: one chunk's arrays stay in the core's cache between passes


@torch.no_grad()
def cpu_adam_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int, *,
              lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
              pool: ThreadPoolExecutor | None = None, chunk_numel: int = CHUNK_NUMEL) -> None:
    """AdamW on flat fp32 host tensors, in place, with torch.optim.AdamW's arithmetic op for op.

    step is the number of this update, counting from 1: the bias corrections use it. The tensors
    are updated chunk_numel elements at a time, all of AdamW's passes over one chunk before the
    next, so that memory sees each element about once; with a pool (a ThreadPoolExecutor) the
    chunks are spread over its threads. No Python loop over parameters or elements.
    """
    beta1, beta2 = betas
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5

    def update(start: int) -> None:
        p, g, m, v = (t[start:start + chunk_numel] for t in (param, grad, exp_avg, exp_avg_sq))
        p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        p.addcdiv_(m, (v.sqrt() / bias_correction2_sqrt).add_(eps), value=-step_size)

    starts = range(0, param.numel(), chunk_numel)
    if pool is None:
        for start in starts:
            update(start)
    else:
        list(pool.map(update, starts))  # list(): wait, and re-raise a thread's exception


@torch.no_grad()
def host_update(optimizer: torch.optim.Optimizer, masters: list[torch.Tensor], grads: list[torch.Tensor],
                pool: ThreadPoolExecutor | None = None, adam=cpu_adam_) -> None:
    """One AdamW step on the host: masters[i] with gradient grads[i], for every param group i.

    optimizer is the torch.optim.AdamW over the masters (one per group): its param_groups give
    lr, betas, eps and weight_decay (an LR scheduler changes them there), and its state holds
    step, exp_avg and exp_avg_sq per master, as torch's own AdamW keeps them, so that
    checkpoints and consolidation stay those of lesson 03. adam is the kernel that updates one
    flat shard (cpu_adam_, or compiled_adam_ below: the same arguments).
    """
    for master, grad, options in zip(masters, grads, optimizer.param_groups):
        state = optimizer.state[master]
        if not state:  # the first step, as torch's AdamW initialises it
            state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(master), exp_avg_sq=torch.zeros_like(master))
        state["step"] += 1
        adam(master, grad, state["exp_avg"], state["exp_avg_sq"], int(state["step"].item()), lr=options["lr"],
             betas=options["betas"], eps=options["eps"], weight_decay=options["weight_decay"], pool=pool)


ADAMW_C = r"""
#include <math.h>

/* One AdamW step over n floats in one pass: each element's parameter, gradient, m and v are loaded
   once and parameter, m and v stored once (28 bytes). torch.optim.AdamW's arithmetic in its order,
   fused where torch fuses (lerp, addcmul): the results are those of torch's fused CPU kernel. */
void adamw_step(float *restrict param, const float *restrict grad, float *restrict exp_avg,
                float *restrict exp_avg_sq, long n, float decay, float weight1, float beta2,
                float weight2, float bias_correction2_sqrt, float eps, float neg_step_size) {
    int small = fabsf(weight1) < 0.5f; /* torch's lerp has two forms, chosen by the weight */
    float coeff = small ? weight1 : weight1 - 1.0f;
    for (long i = 0; i < n; i++) {
        float g = grad[i], m = exp_avg[i];
        m = fmaf(coeff, g - m, small ? m : g);                  /* m.lerp_(g, 1 - beta1) */
        float v = fmaf(weight2 * g, g, exp_avg_sq[i] * beta2);  /* v.mul_(beta2).addcmul_(g, g, 1 - beta2) */
        float denom = sqrtf(v) / bias_correction2_sqrt + eps;
        param[i] = param[i] * decay + neg_step_size * m / denom; /* p.mul_(1 - lr wd).addcdiv_(m, denom) */
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
    }
}
"""
C_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")
# -ffp-contract=off: no multiply-add fused unless written (fmaf); -fno-math-errno lets sqrtf vectorize.


def build_c_library(source: str) -> ctypes.CDLL:
    """Compile C source into a shared library with this machine's C compiler ($CC, else cc) and load it.

    Built once per source, flags, compiler and machine (-march=native), cached in the user's cache
    directory; ranks that build at the same time each rename a complete file into place. Raises
    OSError or subprocess.SubprocessError when there is no compiler or the build fails.
    """
    compiler = os.environ.get("CC", "cc")
    key = hashlib.sha256("\0".join([source, *C_FLAGS, compiler, platform.node()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "zero-lab"
    library = cache / f"kernel-{key}.so"
    if not library.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as build:
            source_file, built = Path(build) / "kernel.c", Path(build) / "kernel.so"
            source_file.write_text(source)
            subprocess.run([compiler, *C_FLAGS, str(source_file), "-o", str(built)], check=True,
                           capture_output=True, text=True, timeout=120)
            os.replace(built, library)
    return ctypes.CDLL(str(library))


def adamw_kernel(source: str):
    """The adamw_step of C `source` (ADAMW_C's signature) as a ctypes function; raises as build_c_library does."""
    kernel = build_c_library(source).adamw_step
    kernel.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] + [ctypes.c_float] * 7
    kernel.restype = None
    return kernel


@functools.cache
def compiled_adamw_step():
    """ADAMW_C's adamw_step as a ctypes function, built at first use; None (after a one-line notice) if it cannot be."""
    try:
        return adamw_kernel(ADAMW_C)
    except (OSError, subprocess.SubprocessError) as error:
        reason = (getattr(error, "stderr", None) or str(error)).strip().splitlines()[0]
        warnings.warn(f"no compiled CPU Adam ({reason}): the host runs cpu_adam_, torch's operations (slower)")
        return None


COMPILED_CHUNK_NUMEL = 2**18  # per call on a pool thread: 7 MB of traffic, far more than a call's overhead


@torch.no_grad()
def compiled_adam_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int,
                   *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                   pool: ThreadPoolExecutor | None = None, chunk_numel: int = COMPILED_CHUNK_NUMEL, kernel=None) -> None:
    """cpu_adam_ as one compiled loop (ADAMW_C, or `kernel`: another adamw_kernel): the same arguments, one pass.

    Without a pool one call does the whole shard; with one, chunks of chunk_numel elements run on
    its threads (ctypes releases the GIL). The tensors must be contiguous fp32 CPU tensors of one
    size: the loop reads their memory directly.
    """
    kernel = compiled_adamw_step() if kernel is None else kernel
    if kernel is None:
        raise RuntimeError("compiled_adam_ needs a C compiler (cc, or $CC): use cpu_adam_")
    tensors = (param, grad, exp_avg, exp_avg_sq)
    if any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or t.numel() != param.numel()
           for t in tensors):
        raise ValueError("compiled_adam_ takes contiguous fp32 CPU tensors of one size (a flat host shard and its states)")
    beta1, beta2 = betas
    scalars = (1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, (1 - beta2**step) ** 0.5, eps,
               -(lr / (1 - beta1**step)))  # as torch.optim.AdamW computes them, in double; the loop takes floats
    addresses = [t.data_ptr() for t in tensors]

    def update(start: int) -> None:
        count = min(chunk_numel, param.numel() - start)
        kernel(*(address + 4 * start for address in addresses), count, *scalars)

    if pool is None:
        kernel(*addresses, param.numel(), *scalars)
    else:
        list(pool.map(update, range(0, param.numel(), chunk_numel)))


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


DPU_WARMUP_STEPS = 40  # the paper's: DPU after the first 40 iterations in its convergence runs (section 6.2.4)


class _Offload:
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
        self.schedule = DelayedUpdate(self._update, self._upload, dpu_warmup_steps)
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

    def _finish_update(self) -> None:
        """Wait for a delayed update but leave its upload to the next step, as if nothing had happened."""
        if self.schedule.pending is not None:
            self.schedule.pending.result()

    def _before_load(self) -> None:  # model.load_state_dict: the loaded weights come after every update
        self.flush()

    def _own_weights(self, group: FlatGroup) -> torch.Tensor:
        return self.link.to_host(group.flat_param[slice(*group.layout.shard(self.rank))])

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
            host_grad.copy_(self.link.to_host(shard))

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
        return self.host_grads

    def _device_gradients(self) -> list[torch.Tensor]:
        not_yet_reduced = [p.grad for g in self.groups for p in g.params if p.grad is not None]
        return not_yet_reduced + [t for b in self.buckets for t in (b.staging, b.received) if t is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the host gradient shards (set_to_none is ignored: they are reused)."""
        for grad in self.host_grads:
            grad.zero_()
        self.shards_used = False


OFFLOAD_OPTIMIZERS = {1: Zero1Offload, 2: Zero2Offload}
