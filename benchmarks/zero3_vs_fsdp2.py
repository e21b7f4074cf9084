"""Our ZeRO stage 3 next to PyTorch's FSDP2 in its ZeRO-3 mode, in the same run.

    python benchmarks/zero3_vs_fsdp2.py [--ranks 2] [--steps 12] [--repeats 3] [--prefetch 1] [--dtype fp32]
                                        [--sizes 0.8M 3M 7M 30M]

Each rank trains two replicas of the same GPT on the same shards: ours, through
`zero_lab.prepare(..., stage=3, units=(Block,))` (one unit per transformer block, the root holds
the embeddings, the final LayerNorm and the tied head), and FSDP2's
`fully_shard(reshard_after_forward=True)` on every block and on the root: the same units. Both are
built on the CPU and moved to the rank's device (`zero_lab.rank_device()`: its GPU, or the CPU);
the batches follow them. Their steps are interleaved so that machine noise hits both alike. Prints
where the ranks run, the largest loss and weight differences, the collectives and bytes each rank
sends per step (comm ledger, ring convention), the median step time (forward + backward +
communication + AdamW, rank 0, the device synchronized before each reading of the clock) over
`--repeats` launches, and the ratio ours / FSDP2; with several `--sizes`, that ratio per model size.
`--dtype bf16`: bf16 parameters, gradients and collectives for both (prepare's param_dtype, FSDP2's
MixedPrecisionPolicy), fp32 masters and AdamW. With gloo (on CPU, or ranks sharing a GPU), gloo runs
a reduce-scatter as an all-reduce: the ledger counts a reduce-scatter's bytes, the clock sees an
all-reduce's time, for both versions. The code is zero_lab/side_by_side.py's `stage3_vs_fsdp2`.
"""

from __future__ import annotations

import torch

from zero_lab.models import GPTConfig
from zero_lab.side_by_side import (DTYPES, SIZES, ZERO3_LR, ZERO3_VERSIONS, fsdp2_parser, fsdp2_sweep, fsdp2_table,
                                   stage3_vs_fsdp2, zero3_build, zero3_side_by_side)

CONFIG = SIZES["0.8M"]
VERSIONS = ZERO3_VERSIONS
LR = ZERO3_LR
train_side_by_side = zero3_side_by_side  # runs on every rank


def build(name: str, model: torch.nn.Module, prefetch: int):
    """(model, optimizer) for one version, with the same sharding units, on zero_lab.rank_device()."""
    return zero3_build(name, model, prefetch)


def compare(ranks: int = 2, steps: int = 12, warmup: int = 3, repeats: int = 3, batch_size: int = 16,
            config: GPTConfig = CONFIG, prefetch: int = 1, dtype: torch.dtype = torch.float32,
            progress=lambda iterable: iterable) -> dict:
    """Rank 0's figures of the first launch, with step_ms the median over `repeats` launches."""
    compared = stage3_vs_fsdp2(ranks, steps, {"model": config}, dtype, warmup=warmup, repeats=repeats,
                               batch_size=batch_size, prefetch=prefetch, progress=progress)
    return compared["sizes"]["model"]["result"]


def table(result: dict, psi: int, ranks: int) -> str:
    return fsdp2_table(result, psi, ranks, VERSIONS, ("3(N-1)/N", 3))


def main(argv=None) -> None:
    parser = fsdp2_parser(__doc__)
    parser.add_argument("--prefetch", type=int, default=1, help="our prefetch depth (0, 1, 2)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32",
                        help="parameters and gradients in forward, backward and the collectives (fp32 masters)")
    args = parser.parse_args(argv)
    fsdp2_sweep(args, compare, table, VERSIONS, prefetch=args.prefetch, dtype=DTYPES[args.dtype])


if __name__ == "__main__":
    main()
