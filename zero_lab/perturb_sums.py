"""ZERO_LAB_PERTURB_SUMS=<seed>: round every sum as another CPU might, on any CPU.

A float tolerance that holds only for the summation order of the machine that chose it fails on a
learner's laptop. Running the tests under other math kernels (ATEN_CPU_CAPABILITY, MKL_CBWR)
reaches only the code paths this machine has; this module changes the rounding itself:

- every reduction an op computes (matmuls, sums, means, norms, softmax and layer norm, forward and
  backward: `SUMMING_OPS`) gets its fp32/fp64 results moved one ulp up or down;
- every sum through the process group (all_reduce, reduce, reduce_scatter; zero_lab.comm_ledger
  calls `before_sum`) adds inputs each moved one ulp: the error of another order of the ranks'
  sum scales with the inputs, not with their sum (which may cancel to nothing).

Up or down is a hash of the value's bits and the seed, so the same computation gives the same
bits wherever it runs (on every rank, in a test and in a notebook, as on one real machine), and
another seed is another machine. Left alone, because every machine computes them alike: zeros,
infinities and NaNs; values whose last 3 significand bits are zero (an exact sum: integers, or
lesson 12's multiples of 2^-21; an inexact one ends so 1 time in 8); 16-bit results of ops (their
kernels sum in fp32 and round once: another order moves that rounding ~1 time in 2^14). The
course's own ring collectives add with `+`, one pair at a time in the order the ring fixes, and
IEEE addition rounds alike everywhere: they are left alone too.

`install()` runs where the variable is set: at every rank's start (zero_lab.launch), in the grading
kernel and in pytest (tests/conftest.py). docs/troubleshooting.md says how to use it.
"""

from __future__ import annotations

import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode_stack

VARIABLE = "ZERO_LAB_PERTURB_SUMS"
EXACT_LOW_BITS = 3  # a value whose last 3 significand bits are 0 is taken to be an exact sum
_INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
             torch.float16: torch.int16}
_OP_DTYPES = (torch.float32, torch.float64)

aten = torch.ops.aten
SUMMING_OPS = {
    aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.addbmm, aten.mv, aten.addmv, aten.dot, aten.vdot,
    aten._addmm_activation, aten.sum, aten.mean, aten.nansum, aten.var, aten.std, aten.var_mean, aten.std_mean,
    aten.norm, aten.linalg_vector_norm, aten._foreach_norm, aten.cumsum, aten.logsumexp, aten._softmax,
    aten._log_softmax, aten._softmax_backward_data, aten._log_softmax_backward_data, aten.native_layer_norm,
    aten.native_layer_norm_backward, aten._fused_rms_norm, aten._fused_rms_norm_backward, aten.embedding_dense_backward,
    aten.index_add, aten.scatter_add, aten.nll_loss_forward, aten.mse_loss, aten.convolution, aten.convolution_backward,
    aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention_for_cpu_backward,
}


def seed() -> int | None:
    """The seed set by the variable (any integer but 0), or None: sums round as this machine's kernels do."""
    value = os.environ.get(VARIABLE, "").strip()
    if value in ("", "0"):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{VARIABLE} is a seed: a whole number (0 or unset: off), not {value!r}") from None


def _mix(bits: torch.Tensor, salt: int) -> torch.Tensor:
    """A 64-bit hash of each element (splitmix64's finalizer; int64 products wrap around)."""
    h = bits.to(torch.int64) + salt * 0x9E3779B97F4A7C15 % 2 ** 63
    h = (h ^ (h >> 30)) * -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9 as a signed int64
    h = (h ^ (h >> 27)) * -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB
    return h ^ (h >> 31)


def perturbed(values: torch.Tensor, salt: int) -> torch.Tensor:
    """`values` with each inexact-looking finite nonzero element one ulp up or down (a hash of its bits and `salt`)."""
    bits = values.view(_INT_VIEW[values.dtype])
    inexact = (bits & (2 ** EXACT_LOW_BITS - 1)) != 0  # zero has none, and neither has infinity
    move = inexact & torch.isfinite(values)
    up = (_mix(bits, salt) & (1 << 40)) != 0
    infinity = torch.tensor(float("inf"), dtype=values.dtype)
    toward = torch.where(up, infinity, -infinity)
    return torch.where(move, torch.nextafter(values, toward), values)


def _plain(t) -> bool:
    return type(t) is torch.Tensor and t.dtype in _OP_DTYPES and t.device.type != "meta" and t.numel() > 0


class PerturbedSums(TorchDispatchMode):
    """Moves the results of `SUMMING_OPS` (fp32/fp64, plain tensors) one ulp, as `perturbed` says."""

    def __init__(self, salt: int):
        super().__init__()
        self.salt = salt

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket not in SUMMING_OPS:
            return out
        with torch.no_grad():
            if isinstance(out, torch.Tensor):
                return self._moved(out, args, kwargs or {})
            if isinstance(out, (tuple, list)):
                return type(out)(self._moved(o, args, kwargs or {}) if isinstance(o, torch.Tensor) else o for o in out)
        return out

    def _moved(self, out, args, kwargs):
        if not _plain(out):
            return out
        new = perturbed(out, self.salt)
        if any(out is a for a in (*args, *kwargs.values())):  # an in-place or out= variant: the caller holds `out`
            out.copy_(new)
            return out
        return new


def install() -> None:
    """Where the variable is set, install the perturbation in this process (once; forked ranks inherit it)."""
    salt = seed()
    if salt is None or any(isinstance(mode, PerturbedSums) for mode in _get_current_dispatch_mode_stack()):
        return
    PerturbedSums(salt).__enter__()  # never left: the whole process rounds this way


def before_sum(tensors, in_place: bool):
    """The process group's inputs to a sum, each element moved one ulp (in place, or copies); unchanged when off."""
    salt = seed()
    if salt is None:
        return tensors
    moved = []
    with torch.no_grad(), _disable_current_modes():  # unseen by the modes that count (zero_r.bytes_during)
        for t in tensors:
            if type(t) is torch.Tensor and t.dtype in _INT_VIEW and t.device.type != "meta" and t.numel() > 0:
                new = perturbed(t.detach(), salt + 1)
                if in_place:
                    t.copy_(new)
                else:
                    t = new
            moved.append(t)
    return moved
