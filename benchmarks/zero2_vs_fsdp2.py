"""Our ZeRO stage 2 next to PyTorch's FSDP2 in its ZeRO-2 mode, in the same run.

    python benchmarks/zero2_vs_fsdp2.py [--ranks 2] [--steps 12] [--repeats 3] [--sizes 0.8M 3M 7M 30M]

Each rank trains two replicas of the same GPT on the same shards: ours, through
`zero_lab.prepare(..., stage=2)`, and FSDP2's `fully_shard(reshard_after_forward=False)` on
every block and on the root (≈ ZeRO-2: parameters stay gathered from forward to backward,
gradients are reduce-scattered in backward). Both are built on the CPU and moved to the rank's
device (`zero_lab.rank_device()`: its GPU, or the CPU); the batches follow them. Their steps are
interleaved so that machine noise hits both alike. Prints where the ranks run, the loss curves'
largest difference, the collectives and bytes each rank sends per step (comm ledger, ring
convention), the median step time (forward + backward + communication + AdamW, rank 0, the device
synchronized before each reading of the clock) over `--repeats` launches, and the ratio ours /
FSDP2; with several `--sizes`, that ratio per model size.
"""

from __future__ import annotations

import torch

import zero_lab
from zero_lab.data import token_batches
from zero_lab.models import GPT, GPTConfig
from zero_lab.prepare import prepare
from zero_lab.side_by_side import (SIZES, fsdp2_parser, fsdp2_shard, fsdp2_sweep, fsdp2_table, fsdp2_weight_diff,
                                   interleaved_steps, ledger_figures, median_over_launches, optimizer_step)

CONFIG = SIZES["0.8M"]
VERSIONS = ("ZeRO-2 (ours)", "FSDP2 (ZeRO-2 mode)")
LR = 1e-3
BUCKET_NUMEL = 2**17  # 0.5 MB of fp32 gradient per bucket: several buckets, overlapped with backward


def build(name: str, model: torch.nn.Module, bucket_numel: int, device: torch.device):
    """(model, optimizer) for one version, the model moved to `device`."""
    if name == "ZeRO-2 (ours)":
        return prepare(model, torch.optim.AdamW, stage=2, bucket_numel=bucket_numel, device=device, lr=LR)
    fsdp2_shard(model, device, reshard_after_forward=False)  # every block, and the root (embeddings, final LayerNorm)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def train_side_by_side(steps: int, warmup: int, batch_size: int, config: GPTConfig = CONFIG,
                       bucket_numel: int = BUCKET_NUMEL) -> dict:
    device = zero_lab.rank_device()
    models = {name: build(name, GPT(config, seed=0), bucket_numel, device) for name in VERSIONS}
    step_fns = {name: optimizer_step(model, optimizer) for name, (model, optimizer) in models.items()}
    runs = interleaved_steps(step_fns, token_batches(steps, batch_size, config.block_size, config.vocab_size), warmup,
                             device)
    (ours, _), (fsdp2, _) = models.values()
    result = {"max_weight_diff": fsdp2_weight_diff(ours.parameters(), fsdp2)}
    for name, run in runs.items():
        result[name] = dict(**ledger_figures(run["ledgers"][-1].summary()), step_ms=run["step_ms"], losses=run["losses"])
    return result


def compare(ranks: int = 2, steps: int = 12, warmup: int = 3, repeats: int = 3, batch_size: int = 16,
            config: GPTConfig = CONFIG, bucket_numel: int = BUCKET_NUMEL, progress=lambda iterable: iterable) -> dict:
    """Rank 0's figures of the first launch, with step_ms the median over `repeats` launches."""
    return median_over_launches(train_side_by_side, VERSIONS, ranks, repeats, steps, warmup, batch_size, config, bucket_numel, progress=progress)


def table(result: dict, psi: int, ranks: int) -> str:
    return fsdp2_table(result, psi, ranks, VERSIONS, ("DDP's 2(N-1)/N", 2))


def main(argv=None) -> None:
    parser = fsdp2_parser(__doc__)
    parser.add_argument("--bucket-numel", type=int, default=BUCKET_NUMEL, help="our stage 2's bucket size (elements)")
    args = parser.parse_args(argv)
    fsdp2_sweep(args, compare, table, VERSIONS, bucket_numel=args.bucket_numel)


if __name__ == "__main__":
    main()
