# Generated from solutions/13_scale/13_scale.ipynb by `zero-lab build`: edit the notebook, not this file.

"""Memory at the paper's scale: one rank of an N-rank world (N up to 1024 and more), counted, not formulated.

BigLinears           psi parameters as a few huge bias-free Linear layers; its units' element counts
check_countable      what the counting can do: an error that names the limit for anything else
as_fake_rank         fn(*args) in this process as rank r of an n-rank world that costs nothing: the fake process group,
                     FakeTensorMode
in_fake_world        run fn(*args) as rank r of n, for a list of (n, r, fn, args), in one child process: torch's fake process group under
                     the counted backend, tensors made in FakeTensorMode (shapes, no bytes)
predicted_bytes      what the memory ledger will count on a rank, by category, padding included
count_step           inside the fake world: prepare(stage=...), one forward/backward/step, both ledgers read
count_ranks, count_rank  count_step for ranks of worlds, checked first, in one child process
largest_model        the paper's Table 2: the largest psi whose count fits a budget (doubling, then bisecting)
PAPER_TABLE1, PAPER_TABLE2  the paper's own numbers, as it prints them, to set beside the counts

Mixed-precision AdamW (the paper's K = 12): bf16 parameters and gradients, fp32 master copies and two
fp32 moments. Nothing here allocates the model: a 1T-parameter count at N = 1024 stays within a few
hundred MB of real memory.
"""

import math
import multiprocessing
import os
import resource
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode  # private API (torch 2.13)
from torch.testing._internal.distributed.fake_pg import FakeStore  # private: torch's own tests use it

from zero_lab import comm_ledger
from zero_lab.comm_ledger import CommLedger
from zero_lab.launcher import HangWatch  # launch's hang guard
from zero_lab.memory_ledger import CATEGORIES, model_state_bytes
from zero_lab.prepare import prepare

PAPER_PSI = {"7.5B": 7_500_000_000, "128B": 128_000_000_000, "1T": 1_000_000_000_000}
PAPER_ND = (1, 4, 16, 64, 256, 1024)
STAGE_NAMES = {1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}
# ZeRO paper (arXiv:1910.02054) Table 1: GB per device (P_os, P_os+g, P_os+g+p) by (Ψ, Nd), as printed
PAPER_TABLE1 = {
    ("7.5B", 1): (120, 120, 120), ("128B", 1): (2048, 2048, 2048), ("1T", 1): (16000, 16000, 16000),
    ("7.5B", 4): (52.5, 41.3, 30), ("128B", 4): (896, 704, 512), ("1T", 4): (7000, 5500, 4000),
    ("7.5B", 16): (35.6, 21.6, 7.5), ("128B", 16): (608, 368, 128), ("1T", 16): (4750, 2875, 1000),
    ("7.5B", 64): (31.4, 16.6, 1.88), ("128B", 64): (536, 284, 32), ("1T", 64): (4187, 2218, 250),
    ("7.5B", 256): (30.4, 15.4, 0.47), ("128B", 256): (518, 263, 8), ("1T", 256): (4046, 2054, 62.5),
    ("7.5B", 1024): (30.1, 15.1, 0.12), ("128B", 1024): (513, 257, 2), ("1T", 1024): (4011, 2013, 15.6),
}
# Table 2, theoretical: the largest model (billions of parameters; P_os, P_os+g, P_os+g+p) on 32 GB devices,
# 64 data-parallel ranks times MP-way model parallelism, by MP
PAPER_TABLE2 = {1: (7.6, 14.4, 128), 2: (15.2, 28.8, 256), 4: (30.4, 57.6, 500), 8: (60.8, 115.2, 1000),
                16: (121.6, 230.4, 2000)}
BYTES_PER_ELEMENT = {"parameters": 2, "gradients": 2, "master_params": 4, "optimizer_states": 8}  # bf16, fp32, m+v
LAYERS = 4


class BigLinears(torch.nn.Module):
    """psi parameters: LAYERS chained bias-free Linear(w, w), w = isqrt(psi / LAYERS), and a tail
    Linear(1, rest) for the rest. Made in FakeTensorMode it costs nothing."""

    def __init__(self, psi: int, layers: int = LAYERS):
        super().__init__()
        width = max(1, math.isqrt(psi // layers))
        self.body = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
        rest = psi - layers * width * width
        self.tail = torch.nn.Linear(1, rest, bias=False) if rest else None
        self.width = width

    def forward(self, x):
        loss = self.body(x).float().sum()
        return loss + self.tail(x[:, :1]).float().sum() if self.tail is not None else loss

    def _apply(self, fn, recurse=True):
        # prepare() moves the model to its device; torch swaps a fake parameter for a new one even when
        # nothing changes, which fails. Nothing changes here: keep the parameters.
        if all(fn(p) is p for p in self.parameters()):
            return self
        return super()._apply(fn, recurse)


def unit_numels(psi: int, layers: int = LAYERS) -> list[int]:
    """The element counts of BigLinears(psi)'s layers: stage 3's units, one flat buffer each."""
    width = max(1, math.isqrt(psi // layers))
    rest = psi - layers * width * width
    return [width * width] * layers + ([rest] if rest else [])


def check_countable(psi: int, n: int, rank: int = 0, stage: int = 1, offload: bool = False) -> None:
    """Raise ValueError naming the limit when one rank of this world cannot be counted here."""
    if type(n) is not int or n < 1:
        raise ValueError(f"n (ranks) must be an int >= 1, got {n!r}")
    if type(rank) is not int or not 0 <= rank < n:
        raise ValueError(f"rank must be in 0..{n - 1} for n = {n}, got {rank!r}")
    if stage not in STAGE_NAMES:
        raise ValueError(f"stage must be 1, 2 or 3 (the ZeRO stages counted here), got {stage!r}")
    if offload and stage == 3:
        raise ValueError('offload with stage 3 is offload="nvme" (lesson 10), not counted here: use stage 1 or 2')
    if type(psi) is not int or psi < n:
        raise ValueError(f"psi = {psi!r} parameters over n = {n} ranks gives a shard smaller than one element per "
                         f"rank: the counting needs an int psi >= n")


@dataclass
class FakeWorldResult:
    value: object
    rss_grown_bytes: int  # peak resident memory of the child during fn, minus before it (Linux: VmHWM - VmRSS)


def _rss_bytes(field_name: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # no /proc (macOS): the peak


def _reset_peak_rss() -> bool:
    try:  # Linux: writing 5 to clear_refs resets the peak resident size (VmHWM)
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def _in_child(conn, runs):
    try:
        warnings.simplefilter("ignore")  # FakeTensor's data_ptr() warnings: nothing reads data here
        from zero_lab import zero3
        # Stage 3 checks, in the first step, that every rank runs the same unit: it all-gathers each rank's
        # call and compares them. Under the fake group nothing arrives, so there is nothing to compare.
        zero3.ExecutionOrder._check_same_call = lambda *unused: None
        if dist.is_initialized():
            dist.destroy_process_group()
        comm_ledger.register()
        for n, rank, fn, args in runs:
            exact = _reset_peak_rss()
            before = _rss_bytes("VmRSS")
            value = as_fake_rank(n, rank, fn, args)
            # each run's result as it ends (plain data: it crosses a pipe), so the parent sees progress
            conn.send(("ok", (value, _rss_bytes("VmHWM" if exact else "VmRSS") - before)))
    except BaseException as error:  # noqa: BLE001 (sent to the parent, raised there)
        conn.send(("error", error if _picklable(error) else RuntimeError(repr(error))))
    finally:
        conn.close()
        os._exit(0)  # no atexit handlers of the parent's (a forked child)


def _picklable(error) -> bool:
    import pickle
    try:
        pickle.loads(pickle.dumps(error))
        return True
    except Exception:  # noqa: BLE001
        return False


def in_fake_world(runs, timeout: float = 120.0) -> list[FakeWorldResult]:
    """For each (n, rank, fn, args) of `runs`: fn(*args) as rank `rank` of an `n`-rank world, all in one forked
    child process. Its default process group is the counted backend over torch's fake process group
    (collectives return at once, the comm ledger charges them), and every tensor fn makes is a FakeTensor.
    The parent's own process groups are never touched.

    `timeout` guards against a hang, as zero_lab.launch's does, and never against a slow or busy machine: past
    `timeout` seconds of one run, the child is stopped with a TimeoutError only when it has used no CPU over the
    last second (blocked) or that run has used `timeout` CPU-seconds (a runaway loop)."""
    runs = list(runs)
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_in_child, args=(send, runs), daemon=True)
    child.start()
    send.close()
    results = []
    while len(results) < len(runs):
        status, value = _next_result(child, receive, f"run {len(results) + 1} of {len(runs)}", timeout)
        if status == "error":
            child.join()
            raise value
        results.append(FakeWorldResult(*value))
    child.join()
    return results


def _next_result(child, receive, which: str, timeout: float):
    """The child's next message, waiting as long as it makes progress (see in_fake_world's timeout)."""
    watch = HangWatch([child], timeout)
    while not receive.poll(0.2) and child.is_alive():  # a child that is gone: recv below says so
        if watch.stuck([0]):
            child.kill()
            child.join()
            why = (f"used {watch.computing[0]:.0f} CPU-seconds (a runaway loop)" if watch.computing
                   else "used no CPU over the last second (blocked)")
            raise TimeoutError(f"timeout, a guard against a hang: {which} in the fake world {why}; timeout = {timeout:g} "
                               f"(a busy machine only makes a run slower; the child process was stopped)")
    try:
        return receive.recv()
    except EOFError:
        child.join()
        raise RuntimeError(f"the fake world's child process died during {which} (exit code {child.exitcode}), "
                           f"without a Python error: out of memory?") from None


def as_fake_rank(n: int, rank: int, fn, args=()):
    """fn(*args) as rank `rank` of an `n`-rank world in this process: the counted backend over a FakeStore
    (torch's fake process group: collectives return at once, the ledger charges them), every tensor a
    FakeTensor; no default process group afterwards, however fn ends. Returns fn's value."""
    dist.init_process_group(comm_ledger.BACKEND, store=FakeStore(), rank=rank, world_size=n)
    try:
        with FakeTensorMode():
            return fn(*args)
    finally:
        dist.destroy_process_group()


def predicted_bytes(numels: list[int], n: int, rank: int, stage: int, offload: bool = False) -> dict[str, int]:
    """Bytes by category (CATEGORIES) the memory ledger counts on rank `rank` of n with mixed-precision AdamW.

    numels are the flat buffers' real element counts: stages 1-2 flatten every parameter into one buffer
    (sum(numels) elements), stage 3 one buffer per unit (each of numels). Each buffer is zero-padded to a
    multiple of n and cut into n equal shards: a shard holds ceil(m / n) elements, real or padding, on every
    rank. A rank holds the whole padded buffer of what its stage keeps whole, one shard of what it partitions.
    One exception: stage 3 keeps AdamW's moments per parameter slice, so only the real elements of the shard
    have them (the last ranks, whose shards end in padding, hold fewer). With offload (stages 1-2,
    ZeRO-Offload) the gradient shard is fp32 on the host (4 bytes per element); stage 1 keeps its whole bf16
    gradient on the device besides it (it reduce-scatters the whole gradient in step()), stage 2 does not.
    """
    buffers = [sum(numels)] if stage in (1, 2) else list(numels)
    shard = sum(-(-m // n) for m in buffers)
    whole = shard * n  # the padded buffers
    partitioned = {"master_params", "optimizer_states"} | ({"gradients"} if stage >= 2 else set())
    if stage == 3:
        partitioned.add("parameters")
    counted = {category: BYTES_PER_ELEMENT[category] * (shard if category in partitioned else whole)
               for category in CATEGORIES}
    if stage == 3:  # moments for the real elements of this rank's shard of each unit
        real = sum(max(0, min((rank + 1) * -(-m // n), m) - rank * -(-m // n)) for m in buffers)
        counted["optimizer_states"] = BYTES_PER_ELEMENT["optimizer_states"] * real
    if offload:  # the fp32 shard on the host; stage 1's whole bf16 gradient (counted above) stays on the device
        counted["gradients"] = 4 * shard + (counted["gradients"] if stage == 1 else 0)
    return counted


def count_step(psi: int, stage: int, offload: bool = False) -> dict:
    """Run inside in_fake_world: BigLinears(psi) through prepare(stage=..., param_dtype=torch.bfloat16), one
    forward, backward and step on a batch of one row under a CommLedger, then the memory ledger.

    Returns plain data: {"bytes": {category: bytes}, "sent": {collective: bytes this rank sent},
    "device": bytes of model states on the device (offload: the rest is on the host)}.
    """
    model = BigLinears(psi)
    options = dict(offload="cpu", cpu_adam="torch") if offload else {}  # the compiled Adam reads real memory
    model, optimizer = prepare(model, torch.optim.AdamW, stage=stage, param_dtype=torch.bfloat16, lr=1e-4, **options)
    batch = torch.ones(1, model.width, dtype=torch.bfloat16)
    with CommLedger() as ledger:
        model(batch).backward()
        optimizer.step()
    report = model_state_bytes(model, optimizer)
    device = model_state_bytes(model, optimizer, placement="device").total if offload else report.total
    return {"bytes": dict(report.bytes),
            "sent": {kind: totals["sent_bytes"] for kind, totals in ledger.summary().items()},
            "device": device}


def count_ranks(jobs, timeout: float = 120.0) -> list[dict]:
    """count_step for each job, a dict(psi=, n=, rank=, stage=, offload=False), each checked first; all in
    one child process. Each result adds "rss_grown_bytes" (the child's peak resident memory during it)."""
    jobs = [{"offload": False, **job} for job in jobs]
    for job in jobs:
        check_countable(**job)
    runs = [(job["n"], job["rank"], count_step, (job["psi"], job["stage"], job["offload"])) for job in jobs]
    return [{**run.value, "rss_grown_bytes": run.rss_grown_bytes} for run in in_fake_world(runs, timeout)]


def count_rank(psi: int, n: int, rank: int, stage: int, offload: bool = False) -> dict:
    """One count_ranks job."""
    return count_ranks([dict(psi=psi, n=n, rank=rank, stage=stage, offload=offload)])[0]


def largest_model(bytes_of, budget_bytes: float, low: int = 1) -> int:
    """The largest psi >= low with bytes_of(psi) <= budget_bytes < bytes_of(psi + 1), for a non-decreasing
    bytes_of (a count of a model of psi parameters): step up from low by 1, 2, 4, ... until a size does not
    fit, then bisect between the last size that fits and the first that does not, so bytes_of runs
    O(log(psi - low)) times.
    ValueError, naming the budget, when low itself does not fit."""
    if (needed := bytes_of(low)) > budget_bytes:  # each count runs the stage: once per size
        raise ValueError(f"{low} parameters need {needed} bytes: more than the budget of {budget_bytes}")
    fits, step = low, 1
    while bytes_of(fits + step) <= budget_bytes:
        fits, step = fits + step, 2 * step
    too_big = fits + step
    while too_big - fits > 1:
        middle = (fits + too_big) // 2
        if bytes_of(middle) <= budget_bytes:
            fits = middle
        else:
            too_big = middle
    return fits
