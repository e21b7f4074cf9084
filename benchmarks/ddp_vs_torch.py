"""Our data parallelism (zero_lab.ddp) next to torch.nn.parallel.DistributedDataParallel.

    python benchmarks/ddp_vs_torch.py [--ranks 2] [--steps 12] [--repeats 3]

Each rank trains four replicas of the same GPT on the same shards, one per version (naive,
flat, bucketed, PyTorch DDP), interleaving their steps so machine noise hits all alike. The
replicas are built on the CPU (seeded by rank: the initial broadcast must make them equal) and
moved to the rank's device (`zero_lab.rank_device()`: its GPU, or the CPU); the batches follow
them. Prints where the ranks run, then per step: all-reduce calls, bytes sent (comm ledger, ring
convention), the median step time (forward + backward + sync + AdamW, on rank 0, the device
synchronized before each reading of the clock) over `--repeats` launches, the ratio to PyTorch
DDP, and whether the weights end up bit-identical to PyTorch DDP's (exact with 2 ranks on CPU).
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
from torch import nn

import zero_lab
from zero_lab.data import token_batches
from zero_lab.ddp import (BucketedDDP, all_reduce_gradients, all_reduce_gradients_flat,
                          broadcast_parameters)
from zero_lab.models import GPT, GPTConfig
from zero_lab.side_by_side import benchmark_parser, interleaved_steps, timing_note

CONFIG = GPTConfig(vocab_size=256, n_layer=4, n_head=4, n_embd=128, block_size=64)
VERSIONS = ("naive", "flat", "bucketed", "torch DDP")


def wrap(name: str, model: nn.Module, bucket_size_bytes: int):
    """The model to call and what to run after backward, for one version (the model on its device)."""
    if name == "torch DDP":
        device = next(model.parameters()).device
        device_ids = [device.index] if device.type == "cuda" else None
        return (nn.parallel.DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_size_bytes / 2**20),
                lambda: None)
    if name == "bucketed":
        return BucketedDDP(model, bucket_size_bytes), lambda: None
    broadcast_parameters(model)
    sync = all_reduce_gradients if name == "naive" else all_reduce_gradients_flat
    return model, lambda: sync(model)


def train_side_by_side(steps: int, warmup: int, batch_size: int, bucket_size_bytes: int,
                       config: GPTConfig = CONFIG) -> dict:
    device = zero_lab.rank_device()
    models, step_fns = {}, {}
    for name in VERSIONS:
        model = GPT(config, seed=dist.get_rank()).to(device)  # different per rank: the initial broadcast must fix it
        ddp_model, sync = wrap(name, model, bucket_size_bytes)
        models[name] = model
        step_fns[name] = make_step(ddp_model, sync, torch.optim.AdamW(model.parameters(), lr=1e-3))
    batches = token_batches(steps, batch_size, config.block_size, config.vocab_size)
    runs = interleaved_steps(step_fns, batches, warmup, device)
    reference = list(models["torch DDP"].parameters())
    results = {}
    for name, run in runs.items():
        ledger = run["ledgers"][-1]
        results[name] = dict(
            calls=ledger.calls("all_reduce"),
            all_reduce_bytes=ledger.sent_bytes("all_reduce"),
            other_bytes=ledger.sent_bytes() - ledger.sent_bytes("all_reduce"),
            step_ms=run["step_ms"],
            identical=all(torch.equal(a, b) for a, b in zip(models[name].parameters(), reference)),
        )
    return results


def make_step(ddp_model: nn.Module, sync, optimizer: torch.optim.Optimizer):
    """One training step: forward + backward + sync + AdamW."""
    def step(tokens, targets):
        optimizer.zero_grad()
        ddp_model(tokens, targets)[1].backward()
        sync()
        optimizer.step()
    return step


def main(argv=None) -> None:
    parser = benchmark_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--bucket-mib", type=float, default=1.0)
    args = parser.parse_args(argv)

    print(zero_lab.placement(args.ranks))
    config = CONFIG  # looked up now: tests make it tiny
    bucket_size_bytes = int(args.bucket_mib * 2**20)
    repeats = [
        zero_lab.launch(train_side_by_side, args.ranks, args.steps, args.warmup, args.batch_size,
                        bucket_size_bytes, config, timeout=600)[0]
        for _ in range(args.repeats)
    ]
    psi = GPT(config).num_params()
    expected = 2 * (args.ranks - 1) / args.ranks * 4 * psi
    print(f"GPT with {psi:,} parameters, {args.ranks} rank{'s' if args.ranks != 1 else ''}, "
          f"{args.bucket_mib:g} MiB buckets, global batch {args.batch_size}")
    print(f"all-reduce bytes per step expected: 2(N-1)/N * 4 bytes * psi = {expected:,.0f}")
    print(f"{'version':>10} {'all-reduces':>11} {'their bytes':>12} {'other bytes':>12} {'step ms':>8} "
          f"{'/ torch':>8}  identical to torch DDP")
    step_ms = {name: statistics.median(run[name]["step_ms"] for run in repeats) for name in VERSIONS}
    for name in VERSIONS:
        row = repeats[0][name]
        identical = all(run[name]["identical"] for run in repeats)
        print(f"{name:>10} {row['calls']:>11} {float(row['all_reduce_bytes']):>12,.0f} "
              f"{float(row['other_bytes']):>12,.0f} {step_ms[name]:>8.1f} "
              f"{step_ms[name] / step_ms['torch DDP']:>8.2f}  {identical}")
    print(timing_note(args) + " Other bytes: PyTorch DDP broadcasts buffers (the causal masks) before every "
          "forward (broadcast_buffers=True).")


if __name__ == "__main__":
    main()
