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


import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from zero_lab.data import token_batches
from zero_lab.models import GPT, GPTConfig
from zero_lab.prepare import prepare
from zero_lab.side_by_side import (benchmark_parser, median_over_launches, interleaved_steps, ledger_figures, optimizer_step,
                                   timing_note)

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
    models = {name: build(name, GPT(config, seed=0), bucket_numel) for name in VERSIONS}
    step_fns = {name: optimizer_step(model, optimizer) for name, (model, optimizer) in models.items()}
    runs = interleaved_steps(step_fns, token_batches(steps, batch_size, config.block_size, config.vocab_size), warmup)
    result = {"max_weight_diff": max_weight_diff(*(models[name][0] for name in VERSIONS))}
    for name, run in runs.items():
        result[name] = dict(
            **ledger_figures(run["ledgers"][-1].summary()),
            step_ms=run["step_ms"],
            losses=run["losses"],
        )
    return result


def compare(ranks: int = 2, steps: int = 12, warmup: int = 3, repeats: int = 3, batch_size: int = 16,
            config: GPTConfig = CONFIG, bucket_numel: int = BUCKET_NUMEL, progress=lambda iterable: iterable) -> dict:
    """Rank 0's figures of the first launch, with step_ms the median over `repeats` launches."""
    return median_over_launches(train_side_by_side, VERSIONS, ranks, repeats, steps, warmup, batch_size, config, bucket_numel, progress=progress)


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
    parser = benchmark_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--bucket-numel", type=int, default=BUCKET_NUMEL, help="our stage 2's bucket size (elements)")
    args = parser.parse_args()
    result = compare(args.ranks, args.steps, args.warmup, args.repeats, args.batch_size, bucket_numel=args.bucket_numel)
    print(table(result, GPT(CONFIG).num_params(), args.ranks))
    print(timing_note(args, {name: result[name]["step_ms_all"] for name in VERSIONS}))


if __name__ == "__main__":
    main()
