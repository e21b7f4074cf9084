"""Our ZeRO stage 3 next to PyTorch's FSDP2 in its ZeRO-3 mode, in the same run.

    python benchmarks/zero3_vs_fsdp2.py [--ranks 2] [--steps 12] [--repeats 3] [--prefetch 1] [--sizes 0.8M 3M 7M 30M]

Each rank trains two replicas of the same GPT on the same shards: ours, through
`zero_lab.prepare(..., stage=3, units=(Block,))` (one unit per transformer block, the root holds
the embeddings, the final LayerNorm and the tied head), and FSDP2's
`fully_shard(reshard_after_forward=True)` on every block and on the root: the same units. Their
steps are interleaved so that machine noise hits both alike. Prints the largest loss and weight
differences, the collectives and bytes each rank sends per step (comm ledger, ring convention),
the median step time (forward + backward + communication + AdamW, rank 0) over `--repeats`
launches, and the ratio ours / FSDP2; with several `--sizes`, that ratio per model size. On CPU, gloo runs a reduce-scatter as an all-reduce: the
ledger counts a reduce-scatter's bytes, the clock sees an all-reduce's time, for both versions.
"""

from __future__ import annotations

import torch

from zero_lab.data import token_batches
from zero_lab.models import GPT, Block, GPTConfig
from zero_lab.prepare import prepare
from zero_lab.side_by_side import (SIZES, fsdp2_parser, fsdp2_shard, fsdp2_sweep, fsdp2_table, fsdp2_weight_diff,
                                   interleaved_steps, ledger_figures, median_over_launches, optimizer_step)

CONFIG = SIZES["0.8M"]
VERSIONS = ("ZeRO-3 (ours)", "FSDP2 (ZeRO-3 mode)")
LR = 1e-3


def build(name: str, model: torch.nn.Module, prefetch: int):
    """(model, optimizer) for one version, with the same sharding units."""
    if name == VERSIONS[0]:
        return prepare(model, torch.optim.AdamW, stage=3, units=(Block,), prefetch=prefetch, lr=LR)
    fsdp2_shard(model, reshard_after_forward=True)  # every block, and the root: the same units
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def train_side_by_side(steps: int, warmup: int, batch_size: int, config: GPTConfig = CONFIG, prefetch: int = 1) -> dict:
    models = {name: build(name, GPT(config, seed=0), prefetch) for name in VERSIONS}
    step_fns = {name: optimizer_step(model, optimizer) for name, (model, optimizer) in models.items()}
    runs = interleaved_steps(step_fns, token_batches(steps, batch_size, config.block_size, config.vocab_size), warmup)
    (ours, optimizer), (fsdp2, _) = models.values()
    with optimizer.gathered_parameters():
        result = {"max_weight_diff": fsdp2_weight_diff(ours.parameters(), fsdp2)}
    for name, run in runs.items():
        result[name] = dict(**ledger_figures(run["ledgers"][-1].summary()), step_ms=run["step_ms"], losses=run["losses"])
    return result


def compare(ranks: int = 2, steps: int = 12, warmup: int = 3, repeats: int = 3, batch_size: int = 16,
            config: GPTConfig = CONFIG, prefetch: int = 1, progress=lambda iterable: iterable) -> dict:
    """Rank 0's figures of the first launch, with step_ms the median over `repeats` launches."""
    return median_over_launches(train_side_by_side, VERSIONS, ranks, repeats, steps, warmup, batch_size, config, prefetch, progress=progress)


def table(result: dict, psi: int, ranks: int) -> str:
    return fsdp2_table(result, psi, ranks, VERSIONS, ("3(N-1)/N * 4 bytes * psi", 3))


def main() -> None:
    parser = fsdp2_parser(__doc__)
    parser.add_argument("--prefetch", type=int, default=1, help="our prefetch depth (0, 1, 2)")
    args = parser.parse_args()
    fsdp2_sweep(args, compare, table, VERSIONS, prefetch=args.prefetch)


if __name__ == "__main__":
    main()
