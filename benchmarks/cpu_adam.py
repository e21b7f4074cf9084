"""CPU AdamW bake-off on flat fp32 shards, against this machine's memory bound, in one run.

    python benchmarks/cpu_adam.py [--sizes 1e6 1e7 1e8] [--threads 1 2] [--repeats 5] [--deepspeed]

No GPU needed, none used: every version runs on this machine's CPU (an offloaded optimizer's
step), in this one process; there are no ranks.

For each shard size and thread count, one AdamW step on a flat fp32 shard of that size is timed
for each version:

    torch for-loop     torch.optim.AdamW(foreach=False): one pass over memory per operation
    torch foreach      torch.optim.AdamW(foreach=True): the same passes, batched over tensors
    torch fused        torch.optim.AdamW(fused=True): one kernel, one pass
    cpu_adam_          zero_lab.cpu_adam.cpu_adam_ (lesson 06's exercise): torch's operations,
                       cache-blocked, on a thread pool
    compiled_adam_     zero_lab.cpu_adam.compiled_adam_: the same step as one C loop, one pass
    DeepSpeedCPUAdam   with --deepspeed, if DeepSpeed is installed (it JIT-builds its op with this
                       machine's compiler, which takes minutes the first time)

torch's versions run on torch's intra-op threads (torch.set_num_threads); ours run their chunks
on a pool of that many threads. AdamW must read parameter, gradient, m and v and write
parameter, m and v: 28 bytes per element. The memory bound is measured with exactly that
traffic: a C loop over four arrays of the shard's size that loads each element of all four and
stores three of them back, with one add each and nothing else (same threads, same chunks). Its
time is the least any AdamW step can take here ("x bound" = bound time / step time). A STREAM
triad (a = b + s*c, 2^25 elements) is printed beside it, and is no substitute: it moves 12
bytes per element by STREAM's count, 16 really (the store to `a` first reads its cache line:
write-allocate), over three streams instead of AdamW's four, and one core's bandwidth depends on
how many streams it has in flight; on the machine this was written on it reported about half
of what the AdamW-shaped loop moves. Without a C compiler the bound falls back to the triad at
16 bytes per element, and says so. "bytes/elem" is what each version's tensor operations read
and write per element (counted by a dispatch mode, one step on a small shard; an argument the op
declares mutable counts as read and written); the C loop's loads and stores are read off its
source (28). Times are the median of `--repeats` steps after one warm-up step (the bound: the
best of at least 10 runs before and 10 after them), wall-clock on this machine: noisy when others
use it ("x bound" above 1 means the bound's own runs were slowed by other work).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from zero_lab.cpu_adam import COMPILED_CHUNK_NUMEL, build_c_library, compiled_adam_, compiled_adamw_step, cpu_adam_

ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
ADAM_BYTES_PER_ELEMENT = 28  # read p, g, m, v; write p, m, v (fp32)
TRIAD_BYTES_PER_ELEMENT = 12  # STREAM's count: read b, c; write a (fp32)
TRIAD_WRITE_ALLOCATE_BYTES_PER_ELEMENT = 16  # what moves: the store to `a` reads its cache line first
TORCH_VERSIONS = {"torch for-loop": dict(foreach=False), "torch foreach": dict(foreach=True),
                  "torch fused": dict(fused=True)}
OURS, COMPILED, DEEPSPEED = "cpu_adam_", "compiled_adam_", "DeepSpeedCPUAdam"
ADAMW_TRAFFIC_C = r"""
/* AdamW's memory traffic and nothing else: load g, p, m, v; store p, m, v (28 bytes per element). */
void adamw_traffic(float *restrict p, const float *restrict g, float *restrict m, float *restrict v, long n) {
    for (long i = 0; i < n; i++) {
        float x = g[i];
        p[i] += x;
        m[i] += x;
        v[i] += x;
    }
}
"""


def deepspeed_available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


class _BytesTouched(TorchDispatchMode):
    """Bytes read and written by every tensor operation run inside it (in-place arguments count twice)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
            return out  # a view (a chunk of the shard): no data moves
        values = list(args) + [kwargs.get(a.name) for a in func._schema.arguments[len(args):]]
        for argument, value in zip(func._schema.arguments, values):
            written = argument.alias_info is not None and argument.alias_info.is_write
            self.bytes += sum(t.nbytes for t in tree_leaves(value) if isinstance(t, torch.Tensor)) * (1 + written)
        if all(r.alias_info is None for r in func._schema.returns):  # a new result: written once
            self.bytes += sum(t.nbytes for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def triad_seconds(numel: int, threads: int, repeats: int = 5) -> float:
    """Best time of STREAM's triad, a = b + s * c, on `threads` of torch's threads."""
    torch.set_num_threads(threads)
    a, b, c = torch.zeros(numel), torch.rand(numel), torch.rand(numel)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        times.append(time.perf_counter() - start)
    return min(times[1:])


def adamw_traffic_seconds(numel: int, threads: int, repeats: int = 5) -> float | None:
    """Best time of ADAMW_TRAFFIC_C over four arrays of numel elements, chunked over a pool of
    `threads` as compiled_adam_ is; None without a C compiler."""
    if compiled_adamw_step() is None:  # it has said why, once
        return None
    kernel = build_c_library(ADAMW_TRAFFIC_C).adamw_traffic
    kernel.argtypes, kernel.restype = [ctypes.c_void_p] * 4 + [ctypes.c_long], None
    arrays = [torch.rand(numel) for _ in range(4)]
    addresses = [t.data_ptr() for t in arrays]

    def chunk(start: int) -> None:
        kernel(*(a + 4 * start for a in addresses), min(COMPILED_CHUNK_NUMEL, numel - start))

    with ThreadPoolExecutor(threads) as pool:
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            if threads == 1:
                kernel(*addresses, numel)
            else:
                list(pool.map(chunk, range(0, numel, COMPILED_CHUNK_NUMEL)))
            times.append(time.perf_counter() - start)
    return min(times[1:])


def make_step(version: str, numel: int, threads: int, ours=cpu_adam_):
    """A function doing one AdamW step on a fresh flat fp32 shard of `numel` elements, and a cleanup."""
    generator = torch.Generator().manual_seed(0)
    param, grad = torch.randn(numel, generator=generator), torch.randn(numel, generator=generator)
    if version in (OURS, COMPILED):
        torch.set_num_threads(1)
        kernel = ours if version == OURS else compiled_adam_
        pool = ThreadPoolExecutor(threads) if threads > 1 else None
        exp_avg, exp_avg_sq, steps = torch.zeros(numel), torch.zeros(numel), iter(range(1, 10**9))
        step = lambda: kernel(param, grad, exp_avg, exp_avg_sq, next(steps), pool=pool, **ADAMW)  # noqa: E731
        return step, (pool.shutdown if pool else lambda: None)
    torch.set_num_threads(threads)
    param = torch.nn.Parameter(param)
    param.grad = grad
    if version == DEEPSPEED:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam([param], adamw_mode=True, **ADAMW)
    else:
        optimizer = torch.optim.AdamW([param], **ADAMW, **TORCH_VERSIONS[version])
    return optimizer.step, lambda: None


def bytes_touched_per_element(version: str, numel: int = 2**16, ours=cpu_adam_) -> float | None:
    """What one step's tensor operations read and write, per element (None: not visible to torch)."""
    if version == COMPILED:
        return float(ADAM_BYTES_PER_ELEMENT)  # outside torch's dispatcher: its loop's 4 loads and 3 stores
    if version == DEEPSPEED:
        return None  # its own C++ kernel, called outside torch's dispatcher
    step, cleanup = make_step(version, numel, 1, ours)
    step()  # the first step creates the states
    with _BytesTouched() as counter:
        step()
    cleanup()
    return counter.bytes / numel


def time_step(version: str, numel: int, threads: int, repeats: int, ours=cpu_adam_) -> float:
    """Median seconds of one step, after one warm-up step."""
    step, cleanup = make_step(version, numel, threads, ours)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    cleanup()
    return statistics.median(times[1:])


def bake_off(sizes=(10**6, 10**7, 10**8), threads=(1, 2), repeats: int = 5, deepspeed: bool = False,
             triad_numel: int = 2**25, progress=lambda iterable: iterable, ours=cpu_adam_) -> dict:
    """{"rows": [...], "bounds": [...], "triad": {threads: GB/s}}; a row per (size, threads, version)
    with ms, GB/s (at 28 bytes per element), bytes its operations touch per element, time vs fused
    and vs the memory bound of that size and thread count ("bounds": its rows, with where it came
    from). ours: the function timed as cpu_adam_ (default zero_lab.cpu_adam's; a lesson passes the learner's)."""
    versions = [*TORCH_VERSIONS, OURS] + ([COMPILED] if compiled_adamw_step() is not None else []) + (
        [DEEPSPEED] if deepspeed and deepspeed_available() else [])
    saved_threads = torch.get_num_threads()
    touched = {version: bytes_touched_per_element(version, ours=ours) for version in versions}
    triad, rows, bounds = {}, [], []
    try:
        for numel, count in progress([(n, t) for n in sizes for t in threads]):
            if count not in triad:
                triad[count] = TRIAD_WRITE_ALLOCATE_BYTES_PER_ELEMENT * triad_numel / triad_seconds(triad_numel, count) / 1e9
            bound_repeats = max(repeats, 10)  # a bound is the best the memory does: many cheap runs, before and after
            bound = adamw_traffic_seconds(numel, count, bound_repeats)
            seconds = {version: time_step(version, numel, count, repeats, ours) for version in versions}
            bound = bound and min(bound, adamw_traffic_seconds(numel, count, bound_repeats))
            source = "AdamW's traffic, C loop"
            if bound is None:
                bound, source = ADAM_BYTES_PER_ELEMENT * numel / (triad[count] * 1e9), "triad at 16 bytes/element"
            bounds.append(dict(numel=numel, threads=count, ms=1e3 * bound, gbps=ADAM_BYTES_PER_ELEMENT * numel / bound / 1e9,
                               source=source))
            for version, t in seconds.items():
                rows.append(dict(version=version, numel=numel, threads=count, ms=1e3 * t,
                                 gbps=ADAM_BYTES_PER_ELEMENT * numel / t / 1e9, bytes_touched=touched[version],
                                 vs_fused=seconds["torch fused"] / t, vs_bound=bound / t))
    finally:
        torch.set_num_threads(saved_threads)
    return dict(rows=rows, bounds=bounds, triad=triad)


def table(result: dict) -> str:
    triad = ", ".join(f"{t} thread(s): {gbps:.1f} GB/s" for t, gbps in sorted(result["triad"].items()))
    lines = [f"STREAM triad, 2^25 elements, write-allocate counted (16 bytes/element): {triad}",
             f"{'numel':>11} {'thr':>3} {'version':>18} {'ms':>9} {'GB/s':>6} {'bytes/elem':>10} "
             f"{'x fused speed':>13} {'x bound':>7}"]
    for bound in result["bounds"]:
        lines.append(f"{bound['numel']:>11,} {bound['threads']:>3} {'memory bound':>18} {bound['ms']:>9.2f} "
                     f"{bound['gbps']:>6.1f} {'28':>10} {'':>13} {'1.00':>7}  ({bound['source']})")
        for row in result["rows"]:
            if (row["numel"], row["threads"]) == (bound["numel"], bound["threads"]):
                touched = "-" if row["bytes_touched"] is None else f"{row['bytes_touched']:.0f}"
                lines.append(f"{row['numel']:>11,} {row['threads']:>3} {row['version']:>18} {row['ms']:>9.2f} "
                             f"{row['gbps']:>6.1f} {touched:>10} {row['vs_fused']:>13.2f} {row['vs_bound']:>7.2f}")
    lines.append("GB/s = 28 bytes per element / time; x fused speed = fused time / time; "
                 "x bound = memory bound time / time, 1.0 = as fast as merely moving AdamW's bytes.")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="No GPU needed, none used: the CPU's AdamW, in this one process.")
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7, 1e8], help="shard sizes (elements)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--deepspeed", action="store_true", help="add DeepSpeedCPUAdam (JIT-builds its op)")
    args = parser.parse_args(argv)
    if args.deepspeed and not deepspeed_available():
        print("DeepSpeed is not installed: DS_BUILD_OPS=0 pip install -e '.[deepspeed]' (the op builds at first use)")
    result = bake_off([int(n) for n in args.sizes], args.threads, args.repeats, args.deepspeed)
    print(table(result))


if __name__ == "__main__":
    main()
