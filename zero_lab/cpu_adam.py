# Generated from solutions/06_offload/06_offload.ipynb by `zero-lab build`: edit the notebook, not this file.

"""AdamW on the host's flat fp32 shards (lesson 06): ZeRO-Offload's CPU-Adam, at the speed of memory.

cpu_adam_          AdamW with torch's operations: in cache-sized chunks, optionally on threads
host_update        one such step for every param group, with torch.optim.AdamW's state and options
ADAMW_C            the same step as one C loop (one pass over memory, torch's arithmetic and rounding)
build_c_library    compile C source with this machine's compiler, cached; adamw_kernel: its adamw_step
compiled_adam_     cpu_adam_ as the compiled loop (compiled_adamw_step builds it at first use)
"""

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch


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
