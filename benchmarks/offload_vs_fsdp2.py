"""Our ZeRO-Offload next to PyTorch's FSDP2 with CPU offload, in the same run.

    python benchmarks/offload_vs_fsdp2.py [--ranks 2] [--steps 12] [--repeats 3] [--sizes 0.8M 3M 7M 30M]

Each rank trains two replicas of the same GPT on the same shards, fp32 AdamW: ours through
`zero_lab.prepare(..., stage=2, offload="cpu")`, and FSDP2's `fully_shard(...,
reshard_after_forward=False, offload_policy=CPUOffloadPolicy(pin_memory=...))` on every block
and on the root. FSDP2's CPU offload keeps the *sharded* parameters, their gradients and the
optimizer states on the host and copies each block's shard to the device for forward and
backward; ZeRO-Offload keeps the whole 16-bit model on the device. (Pinned host memory on a GPU;
`pin_memory=False` on CPU ranks: pinning needs an accelerator.) Both models are built on the CPU
and moved to the rank's device (`zero_lab.rank_device()`); the batches follow them. Their steps
are interleaved so that machine noise hits both alike. Prints where the ranks run, the largest
loss difference, the collectives and bytes each rank sends per step (comm ledger, ring
convention), our bytes moved between host and device, and the median step time (the device
synchronized before each reading of the clock); with several `--sizes`, the ratio ours / FSDP2
per model size.

On CPU ranks both "devices" are this CPU: our device is simulated (its copies are real copies),
and FSDP2's host-device copies are copies within CPU memory.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import CPUOffloadPolicy

import zero_lab
from zero_lab.data import token_batches
from zero_lab.memory_ledger import TransferLedger
from zero_lab.models import GPT, GPTConfig
from zero_lab.prepare import prepare
from zero_lab.side_by_side import (SIZES, fsdp2_parser, fsdp2_shard, fsdp2_sweep, fsdp2_table, interleaved_steps,
                                   ledger_figures, median_over_launches, optimizer_step)

CONFIG = SIZES["0.8M"]
VERSIONS = ("ZeRO-Offload (ours)", "FSDP2 + CPUOffloadPolicy")
LR = 1e-3


def build(name: str, model: torch.nn.Module, device: torch.device):
    """(model, optimizer) for one version, training on `device`."""
    if name == VERSIONS[0]:
        return prepare(model, torch.optim.AdamW, stage=2, offload="cpu", device=device, lr=LR)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    fsdp2_shard(model, device, reshard_after_forward=False, offload_policy=offload)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def train_side_by_side(steps: int, warmup: int, batch_size: int, config: GPTConfig = CONFIG) -> dict:
    device = zero_lab.rank_device()
    models = {name: build(name, GPT(config, seed=0), device) for name in VERSIONS}
    step_fns = {name: optimizer_step(model, optimizer) for name, (model, optimizer) in models.items()}
    ours = step_fns[VERSIONS[0]]
    moved = []

    def ours_counted(tokens, targets):  # our host-device traffic, step by step
        with TransferLedger() as ledger:
            loss = ours(tokens, targets)
        moved.append(ledger.bytes)
        return loss

    step_fns[VERSIONS[0]] = ours_counted
    runs = interleaved_steps(step_fns, token_batches(steps, batch_size, config.block_size, config.vocab_size), warmup,
                             device)
    result = {"moved": moved[-1]}
    for name, run in runs.items():
        result[name] = dict(**ledger_figures(run["ledgers"][-1].summary()), step_ms=run["step_ms"], losses=run["losses"])
    return result


def compare(ranks: int = 2, steps: int = 12, warmup: int = 3, repeats: int = 3, batch_size: int = 16,
            config: GPTConfig = CONFIG, progress=lambda iterable: iterable) -> dict:
    """Rank 0's figures of the first launch, with step_ms the median over `repeats` launches."""
    return median_over_launches(train_side_by_side, VERSIONS, ranks, repeats, steps, warmup, batch_size, config, progress=progress)


def table(result: dict, psi: int, ranks: int) -> str:
    moved = result["moved"]
    note = (f"ours, host <-> device per step (rank 0): {moved['to_host']:,} bytes down, {moved['to_device']:,} up "
            f"(4 psi / Nd each in fp32 = {4 * psi // ranks:,})")
    return fsdp2_table(result, psi, ranks, VERSIONS, ("2(N-1)/N", 2), notes=[note])


def main(argv=None) -> None:
    fsdp2_sweep(fsdp2_parser(__doc__).parse_args(argv), compare, table, VERSIONS)


if __name__ == "__main__":
    main()
