"""Our ZeRO stage 2 next to PyTorch's FSDP2 in its ZeRO-2 mode, in the same run.

    python benchmarks/zero2_vs_fsdp2.py [--ranks 2] [--steps 12] [--repeats 3]

Each rank trains two replicas of the same GPT on the same shards: ours, through
`zero_lab.prepare(..., stage=2)`, and FSDP2's `fully_shard(reshard_after_forward=False)` on
every block and on the root (≈ ZeRO-2: parameters stay gathered from forward to backward,
gradients are reduce-scattered in backward). Their steps are interleaved so that machine noise
hits both alike. Prints the loss curves' largest difference, the collectives and bytes each
rank sends per step (comm ledger, ring convention), the median step time (forward + backward
+ communication + AdamW, rank 0) over `--repeats` launches, and the ratio ours / FSDP2.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import zero_lab
from zero_lab.data import shard_batch, token_batches
from zero_lab.models import GPT, GPTConfig
from zero_lab.prepare import prepare

CONFIG = GPTConfig(vocab_size=256, n_layer=4, n_head=4, n_embd=128, block_size=64)
VERSIONS = ("ZeRO-2 (ours)", "FSDP2 (ZeRO-2 mode)")
LR = 1e-3
BUCKET_NUMEL = 2**17  # 0.5 MB of fp32 gradient per bucket: several buckets, overlapped with backward


def build(name: str, model: torch.nn.Module, bucket_numel: int):
    """(model, optimizer) for one version."""
    if name == "ZeRO-2 (ours)":
        return prepare(model, torch.optim.AdamW, stage=2, bucket_numel=bucket_numel, lr=LR)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.transformer.h:  # one all-gather and one reduce-scatter per block
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)  # embeddings, final LayerNorm
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def max_weight_diff(ours: torch.nn.Module, fsdp2: torch.nn.Module) -> float:
    """Largest |difference| between the two models' weights, over all ranks."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # FSDP2's parameters are DTensors whose local part is this rank's chunk of dim 0.
    diffs = [(torch.chunk(a.detach(), world_size)[rank] - b.to_local()).abs().max()
             for a, b in zip(ours.parameters(), fsdp2.parameters()) if b.to_local().numel()]
    largest = torch.stack(diffs).max()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return largest.item()


def train_side_by_side(steps: int, warmup: int, batch_size: int, config: GPTConfig = CONFIG,
                       bucket_numel: int = BUCKET_NUMEL) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    runs = {}
    for name in VERSIONS:
        model, optimizer = build(name, GPT(config, seed=0), bucket_numel)
        runs[name] = dict(model=model, optimizer=optimizer, times=[], losses=[])
    for step, batch in enumerate(token_batches(steps, batch_size, config.block_size, config.vocab_size)):
        tokens, targets = shard_batch(batch, rank, world_size)
        for name in VERSIONS[step % 2:] + VERSIONS[:step % 2]:
            run = runs[name]
            dist.barrier()  # time the step, not the wait for the other rank's previous one
            start = time.perf_counter()
            with zero_lab.CommLedger() as ledger:
                loss = run["model"](tokens, targets)[1]
                loss.backward()
                run["optimizer"].step()
                run["optimizer"].zero_grad()
            run["times"].append(time.perf_counter() - start)
            run["losses"].append(loss.item())
            run["ledger"] = ledger.summary()
    return {
        "max_weight_diff": max_weight_diff(*(runs[name]["model"] for name in VERSIONS)),
        **{name: dict(
            collectives={kind: (t["calls"], t["sent_bytes"]) for kind, t in run["ledger"].items()},
            sent_bytes=sum(t["sent_bytes"] for t in run["ledger"].values()),
            step_ms=1e3 * statistics.median(run["times"][warmup:]),
            losses=run["losses"],
        ) for name, run in runs.items()},
    }


def compare(ranks: int = 2, steps: int = 12, warmup: int = 3, repeats: int = 3, batch_size: int = 16,
            config: GPTConfig = CONFIG, bucket_numel: int = BUCKET_NUMEL, progress=lambda iterable: iterable) -> dict:
    """Rank 0's figures of the first launch, with step_ms the median over `repeats` launches."""
    runs = [zero_lab.launch(train_side_by_side, ranks, steps, warmup, batch_size, config, bucket_numel, timeout=600)[0]
            for _ in progress(range(repeats))]
    result = dict(runs[0])
    for name in VERSIONS:
        times = [run[name]["step_ms"] for run in runs]
        result[name] = {**runs[0][name], "step_ms": statistics.median(times), "step_ms_all": times}
    result["max_loss_diff"] = max(abs(a - b) for a, b in zip(*(result[name]["losses"] for name in VERSIONS)))
    return result


def table(result: dict, psi: int, ranks: int) -> str:
    fsdp2_ms = result[VERSIONS[1]]["step_ms"]
    rows = [f"GPT with {psi:,} parameters, {ranks} ranks (CPU, gloo), fp32; DDP's 2(N-1)/N * 4 bytes * psi "
            f"= {2 * (ranks - 1) / ranks * 4 * psi:,.0f} bytes",
            f"{'version':>20} {'bytes sent':>12} {'step ms':>8} {'/ FSDP2':>8}  collectives (calls)"]
    for name in VERSIONS:
        row = result[name]
        calls = ", ".join(f"{kind} {calls}" for kind, (calls, _) in sorted(row["collectives"].items()))
        rows.append(f"{name:>20} {row['sent_bytes']:>12,.0f} {row['step_ms']:>8.1f} {row['step_ms'] / fsdp2_ms:>8.2f}  {calls}")
    rows.append(f"largest loss difference over {len(result[VERSIONS[0]]['losses'])} steps: {result['max_loss_diff']:.1e}; "
                f"largest weight difference at the end: {result['max_weight_diff']:.1e}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the timing")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch, split over the ranks")
    parser.add_argument("--bucket-numel", type=int, default=BUCKET_NUMEL, help="our stage 2's bucket size (elements)")
    args = parser.parse_args()
    result = compare(args.ranks, args.steps, args.warmup, args.repeats, args.batch_size, bucket_numel=args.bucket_numel)
    print(table(result, GPT(CONFIG).num_params(), args.ranks))
    print(f"step ms: median over {args.repeats} launches of the median of steps {args.warmup + 1}-{args.steps} "
          "on rank 0; wall-clock on this machine, noisy if others are using it. Per launch: "
          + "; ".join(f"{name} {', '.join(f'{t:.1f}' for t in result[name]['step_ms_all'])}" for name in VERSIONS))


if __name__ == "__main__":
    main()
