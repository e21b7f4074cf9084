"""Where a ZeRO-3 step spends its time, ours or FSDP2's: torch.profiler over a few steps on rank 0.

    python benchmarks/zero3_profile.py [--fsdp2] [--size 7M] [--ranks 2] [--steps 6] [--warmup 2] [--prefetch 1]
                                       [--stacks aten::copy_ aten::fill_ torch::autograd::AccumulateGrad]

Trains the GPT of `--size` with benchmarks/zero3_vs_fsdp2.py's set-up (one unit per block, on the
rank's device, `zero_lab.rank_device()`, the batches too): `zero_lab.prepare(..., stage=3)`, or with
`--fsdp2` FSDP2's `fully_shard`, and profiles the steps after `--warmup` on rank 0 (CPU activities,
with stacks; on a GPU also its kernels, whose time is a column of its own, and the clock stops once
the device has finished). Prints where the ranks run, then the operators by self CPU time (on a GPU:
the time to launch their kernels) — compute (addmm, bmm, softmax...),
gloo's collectives (the all-gather and reduce-scatter calls, waiting included), copies
(copy_, cat, narrow), the optimizer (_foreach ops / adamw) — and the share of the profiled wall
time each takes. Python's frames are recorded (so that a hook's wait for gloo is an event of its
own, not time of the autograd node that ran the hook); the tracing inflates the Python share, for
both versions alike. Then the same time in five kinds (compute, `KINDS`: communication, copies and
fills, optimizer; Python), which lesson 05's demo prints for both versions at a small size (`breakdown`).
"""

from __future__ import annotations

import argparse
import time

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import zero_lab
from zero_lab.data import shard_batch, token_batches
from zero_lab.models import GPT
from zero_lab.side_by_side import SIZES, synchronize

from zero3_vs_fsdp2 import VERSIONS, build  # the side-by-side's set-up (this script's folder is on sys.path)


# An operator's kind, by its name (the first that matches); the rest of the operators are compute.
KINDS = {
    "communication": ("wait", "allgather", "all_gather", "reduce_scatter", "allreduce", "all_reduce", "barrier",
                      "broadcast", "FSDP::"),  # gloo's calls and the waits for them; FSDP2's ranges include its Python
    "copies and fills": ("aten::copy_", "aten::fill_", "aten::zero_", "aten::cat", "aten::_chunk_cat",
                         "aten::split_with_sizes_copy", "aten::clone"),
    "optimizer": ("aten::lerp_", "aten::addcdiv_", "aten::addcmul_", "aten::sqrt", "_foreach_", "adamw", "Optimizer."),
}


PYTHON = "Python (hooks, schedule, loop)"


def kind_of(name: str) -> str:
    """An event's kind; Python frames (recorded with stacks: "file.py(line): function", built-in
    methods) that are not collectives count as Python."""
    found = next((kind for kind, marks in KINDS.items() if any(mark in name for mark in marks)), None)
    if found is None and (".py(" in name or name.startswith("<built-in")):
        return PYTHON
    return found or "compute"


def breakdown(events, wall_us: float, steps: int) -> dict[str, float]:
    """Milliseconds per step by kind: the self times of the profiled events (Python's frames among
    them when recorded with stacks), plus the wall time no event accounts for, counted as Python."""
    per_kind = dict.fromkeys(["compute", *KINDS, PYTHON], 0.0)
    for event in events:
        per_kind[kind_of(event.key)] += event.self_cpu_time_total / 1e3 / steps
    per_kind[PYTHON] += max(0.0, wall_us / 1e3 / steps - sum(per_kind.values()))
    return per_kind


def profiled_steps(version: str, size: str, steps: int, warmup: int, prefetch: int, batch_size: int, rows: int,
                   stacks: tuple[str, ...] = (), config=None) -> str | dict | None:
    """Rank 0's table (rows > 0), or its breakdown by kind (rows == 0); None on the other ranks."""
    config = config or SIZES[size]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = zero_lab.rank_device()
    model, optimizer = build(version, GPT(config, seed=0), prefetch)  # built on the CPU, moved to `device`
    batches = [tuple(t.to(device) for t in shard_batch(batch, rank, world_size))
               for batch in token_batches(steps, batch_size, config.block_size, config.vocab_size)]
    cuda = device.type == "cuda"

    def step(tokens, targets):
        _, loss = model(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for tokens, targets in batches[:warmup]:
        step(tokens, targets)
    synchronize(device)
    dist.barrier()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities, with_stack=True) as prof:  # Python frames: the waits are events
        start = time.perf_counter()
        for tokens, targets in batches[warmup:]:
            step(tokens, targets)
        synchronize(device)  # the kernels still queued belong to these steps
        wall_us = 1e6 * (time.perf_counter() - start)
    if rank != 0:
        return None
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    events.sort(key=lambda e: -e.self_cpu_time_total)
    if rows == 0:
        return breakdown(events, wall_us, steps - warmup)
    operator_us = sum(e.self_cpu_time_total for e in events)
    lines = [f"{version}, GPT {size} ({GPT(config).num_params():,} parameters), {world_size} "
             f"rank{'s' if world_size != 1 else ''} on {device}, {steps - warmup} profiled steps: "
             f"{wall_us / 1e3 / (steps - warmup):.0f} ms per step (rank 0)",
             f"{'operator':>44} {'self ms/step':>13} {'share':>7} {'calls/step':>11}"
             + (f" {'GPU ms/step':>12}" if cuda else "")]
    for event in events[:rows]:
        per_step = event.self_cpu_time_total / 1e3 / (steps - warmup)
        on_device = f" {event.self_device_time_total / 1e3 / (steps - warmup):>12.1f}" if cuda else ""
        lines.append(f"{event.key[:44]:>44} {per_step:>13.1f} {event.self_cpu_time_total / wall_us:>7.1%} "
                     f"{event.count / (steps - warmup):>11.0f}{on_device}")
    lines.append(f"{'in operators, all':>44} {operator_us / 1e3 / (steps - warmup):>13.1f} {operator_us / wall_us:>7.1%}")
    lines.append(f"{'outside operators (Python)':>44} {(wall_us - operator_us) / 1e3 / (steps - warmup):>13.1f} "
                 f"{1 - operator_us / wall_us:>7.1%}")
    lines += [f"{kind:>44} {ms:>13.1f} {ms * 1e3 * (steps - warmup) / wall_us:>7.1%}"
              for kind, ms in breakdown(events, wall_us, steps - warmup).items()]
    if cuda:
        lines.append("on a GPU the self ms are the CPU's (launching the kernels; the GPU's own time is its column), "
                     "and the wall time no operator accounts for, counted as Python, includes waiting for the GPU")
    for name in stacks:  # where in our code each of these operators is called from, costliest first
        by_stack = sorted((e for e in prof.key_averages(group_by_stack_n=6) if e.key == name),
                          key=lambda e: -e.self_cpu_time_total)
        for event in by_stack[:4]:
            ours = [frame for frame in event.stack if "zero_lab" in frame] or event.stack[:2]
            lines.append(f"{name} {event.self_cpu_time_total / 1e3 / (steps - warmup):.1f} ms/step, "
                         f"{event.count / (steps - warmup):.0f} calls/step: {' <- '.join(ours[:3])}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fsdp2", action="store_true", help="profile FSDP2 instead of ours")
    parser.add_argument("--size", choices=list(SIZES), default="7M")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rows", type=int, default=20, help="operators to list")
    parser.add_argument("--stacks", nargs="*", default=(), metavar="OPERATOR",
                        help="for these operators (e.g. aten::copy_ aten::fill_), the calls' places in zero_lab")
    args = parser.parse_args(argv)
    print(zero_lab.placement(args.ranks))
    version = VERSIONS[1] if args.fsdp2 else VERSIONS[0]
    print(zero_lab.launch(profiled_steps, args.ranks, version, args.size, args.steps, args.warmup, args.prefetch,
                          args.batch_size, args.rows, tuple(args.stacks), timeout=600)[0])


if __name__ == "__main__":
    main()
