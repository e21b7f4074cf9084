"""Our ZeRO stages 1 and 2 next to DeepSpeed's, in the same run.

    python benchmarks/deepspeed_side_by_side.py [--ranks 2] [--steps 12] [--repeats 2]

For each stage zero_lab has (1 from lesson 03; 2 once lesson 04 exported zero_lab.zero2), every
rank trains the course GPT three ways on the same shards of the same global batches: ours
(`zero_lab.prepare(..., stage=S)`), DeepSpeed's ZeRO stage S with its defaults, and DeepSpeed's
with "use_multi_rank_bucket_allreduce": false. Same torch AdamW (lr, betas, eps, weight decay),
fp32, no clipping, no loss scaling. The models are built on the CPU (seed 0) and moved to the
rank's device (`zero_lab.rank_device()`: its GPU, or the CPU); the batches follow them. Prints
where the ranks run, then per version: the collectives and bytes each rank sends per step (comm
ledger, ring convention) against ZeRO's 2(N-1)/N * psi * 4 bytes, the median step time (the
device synchronized before each reading of the clock) and its ratio to ours, and the largest
difference between its loss curve and ours. The code is zero_lab/side_by_side.py, which lesson 03
uses too.

Needs DeepSpeed (`DS_BUILD_OPS=0 pip install deepspeed==0.19.8`); without it, says so and exits 0.
"""

from __future__ import annotations

import sys

import zero_lab
from zero_lab import side_by_side


def main(argv=None) -> None:
    parser = side_by_side.benchmark_parser(__doc__.split("\n\n")[0], warmup=2, repeats=2)
    parser.add_argument("--verbose", action="store_true", help="also print what DeepSpeed printed while starting")
    args = parser.parse_args(argv)
    print(zero_lab.placement(args.ranks))
    if not side_by_side.deepspeed_available():
        print(f"DeepSpeed is not installed, nothing to compare. Install it with:\n  {side_by_side.INSTALL}")
        sys.exit(0)
    stages = side_by_side.our_stages()
    if 2 not in stages:
        print("zero_lab.zero2 does not exist yet (lesson 04 exports it: `zero-lab build 04_zero2`): stage 1 only.\n")
    comparison = side_by_side.compare(stages, args.ranks, args.steps, args.warmup, args.repeats, args.batch_size)
    if args.verbose:
        print(comparison["deepspeed_log"])
    print(side_by_side.table(comparison))
    results = comparison["results"]
    print(f"\nstep ms: median over {args.repeats} launch(es) of rank 0's median over steps {args.warmup + 1}-{args.steps}; "
          "wall-clock on this machine, noisy when other programs run. Per launch: "
          + "; ".join(f"{stage}/{name} {', '.join(f'{t:.1f}' for t in row['step_ms_all'])}"
                      for (stage, name), row in results.items()))
    worst = max(row["max_loss_diff"] for row in results.values())
    print(f"loss curves ({args.steps} steps, global-batch mean): largest difference from ours {worst:.1e} "
          f"({'identical within fp32 tolerance' if worst < 1e-5 else 'NOT within 1e-5'})")


if __name__ == "__main__":
    main()
