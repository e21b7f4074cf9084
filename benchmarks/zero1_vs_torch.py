"""Our ZeRO stage 1 next to PyTorch's ZeroRedundancyOptimizer + DistributedDataParallel.

    python benchmarks/zero1_vs_torch.py [--ranks 2] [--steps 12] [--repeats 3]

Each rank trains three replicas of the same GPT on the same shards (our DDP from lesson 02,
our stage 1 from lesson 03, torch's ZeroRedundancyOptimizer wrapped around AdamW under torch
DDP), interleaving their steps so machine noise hits all alike. The replicas are built on the
CPU (seed 0) and moved to the rank's device (`zero_lab.rank_device()`: its GPU, or the CPU); the
batches follow them. Prints where the ranks run, then per step: the collectives and bytes each
rank sends (comm ledger, ring convention), the median step time (forward + backward +
communication + AdamW, rank 0, the device synchronized before each reading of the clock) over
`--repeats` launches, the ratio to torch's, and how far the weights end up from torch's (fp32;
sums in another order).
"""

from __future__ import annotations

import statistics

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import zero_lab
from zero_lab.data import token_batches
from zero_lab.models import GPT, GPTConfig
from zero_lab.prepare import prepare
from zero_lab.side_by_side import (benchmark_parser, interleaved_steps, ledger_figures, optimizer_step,
                                   timing_note)

CONFIG = GPTConfig(vocab_size=256, n_layer=4, n_head=4, n_embd=128, block_size=64)
VERSIONS = ("DDP (ours)", "ZeRO-1 (ours)", "torch ZeRO + DDP")
LR = 1e-3


def build(name: str, model: torch.nn.Module, device: torch.device):
    """(model to call, optimizer) for one version, the model moved to `device`."""
    if name == "DDP (ours)":
        return prepare(model, torch.optim.AdamW, stage=0, device=device, lr=LR)
    if name == "ZeRO-1 (ours)":
        return prepare(model, torch.optim.AdamW, stage=1, device=device, lr=LR)
    # The causal masks never change: broadcasting them before every forward (the default) would
    # blur the comparison of what the optimizers send.
    ddp = DistributedDataParallel(model.to(device), device_ids=[device.index] if device.type == "cuda" else None,
                                  forward_sync_buffers=False)
    return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)


def train_side_by_side(steps: int, warmup: int, batch_size: int, config: GPTConfig = CONFIG) -> dict:
    device = zero_lab.rank_device()
    models = {name: build(name, GPT(config, seed=0), device) for name in VERSIONS}
    step_fns = {name: optimizer_step(model, optimizer) for name, (model, optimizer) in models.items()}
    runs = interleaved_steps(step_fns, token_batches(steps, batch_size, config.block_size, config.vocab_size), warmup,
                             device)
    torch_weights = list(models["torch ZeRO + DDP"][0].parameters())
    results = {}
    for name, run in runs.items():
        results[name] = dict(
            **ledger_figures(run["ledgers"][-1].summary()),
            step_ms=run["step_ms"],
            max_diff_to_torch=max((a.detach() - b.detach()).abs().max().item()
                                  for a, b in zip(models[name][0].parameters(), torch_weights)),
        )
    return results


def compare(ranks: int = 2, steps: int = 12, warmup: int = 3, repeats: int = 3, batch_size: int = 16,
            config: GPTConfig = CONFIG, progress=lambda iterable: iterable) -> dict:
    """{version: rank 0's figures, step_ms being the median over `repeats` launches}."""
    runs = [zero_lab.launch(train_side_by_side, ranks, steps, warmup, batch_size, config, timeout=600)[0]
            for _ in progress(range(repeats))]
    return {name: {**runs[0][name], "step_ms": statistics.median(run[name]["step_ms"] for run in runs),
                   "step_ms_all": [run[name]["step_ms"] for run in runs]}
            for name in VERSIONS}


def table(results: dict, psi: int, ranks: int) -> str:
    reference = results["torch ZeRO + DDP"]["step_ms"]
    rows = [f"GPT with {psi:,} parameters, {ranks} rank{'s' if ranks != 1 else ''}, fp32; DDP's 2(N-1)/N * 4 bytes * psi "
            f"= {2 * (ranks - 1) / ranks * 4 * psi:,.0f} bytes",
            f"{'version':>17} {'bytes sent':>12} {'step ms':>8} {'/ torch':>8} {'max |w - torch|':>16}  collectives (calls)"]
    for name, row in results.items():
        calls = ", ".join(f"{kind} {calls}" for kind, (calls, _) in sorted(row["collectives"].items()))
        rows.append(f"{name:>17} {row['sent_bytes']:>12,.0f} {row['step_ms']:>8.1f} "
                    f"{row['step_ms'] / reference:>8.2f} {row['max_diff_to_torch']:>16.1e}  {calls}")
    return "\n".join(rows)


def main(argv=None) -> None:
    args = benchmark_parser(__doc__.split("\n\n")[0]).parse_args(argv)
    print(zero_lab.placement(args.ranks))
    config = CONFIG  # looked up now: tests make it tiny
    results = compare(args.ranks, args.steps, args.warmup, args.repeats, args.batch_size, config)
    print(table(results, GPT(config).num_params(), args.ranks))
    print(timing_note(args, {name: row["step_ms_all"] for name, row in results.items()}))


if __name__ == "__main__":
    main()
