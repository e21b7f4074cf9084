"""Our ZeRO-Offload next to PyTorch's FSDP2 with CPU offload, in the same run.

    python benchmarks/offload_vs_fsdp2.py [--ranks 2] [--steps 12] [--repeats 3]

Each rank trains two replicas of the same GPT on the same shards, fp32 AdamW: ours through
`zero_lab.prepare(..., stage=2, offload="cpu")`, and FSDP2's `fully_shard(...,
reshard_after_forward=False, offload_policy=CPUOffloadPolicy(pin_memory=False))` on every block
and on the root. FSDP2's CPU offload keeps the *sharded* parameters, their gradients and the
optimizer states on the host and copies each block's shard to the device for forward and
backward; ZeRO-Offload keeps the whole 16-bit model on the device. (`pin_memory=False`: pinning
needs an accelerator.) Their steps are interleaved so that machine noise hits both alike.
Prints the largest loss difference, the collectives and bytes each rank sends per step (comm
ledger, ring convention), our bytes moved between host and device, and the median step time.

Without an accelerator both "devices" are this CPU: our device is simulated (its copies are real
copies), and FSDP2's host-device copies are copies within CPU memory.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

from zero_lab.data import token_batches
from zero_lab.memory_ledger import TransferLedger
from zero_lab.models import GPT, GPTConfig
from zero_lab.prepare import prepare
from zero_lab.side_by_side import benchmark_parser, median_over_launches, interleaved_steps, ledger_figures, optimizer_step, timing_note

CONFIG = GPTConfig(vocab_size=256, n_layer=4, n_head=4, n_embd=128, block_size=64)
VERSIONS = ("ZeRO-Offload (ours)", "FSDP2 + CPUOffloadPolicy")
LR = 1e-3


def build(name: str, model: torch.nn.Module):
    """(model, optimizer) for one version."""
    if name == VERSIONS[0]:
        return prepare(model, torch.optim.AdamW, stage=2, offload="cpu", lr=LR)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = CPUOffloadPolicy(pin_memory=False)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, reshard_after_forward=False, offload_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, offload_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def train_side_by_side(steps: int, warmup: int, batch_size: int, config: GPTConfig = CONFIG) -> dict:
    models = {name: build(name, GPT(config, seed=0)) for name in VERSIONS}
    step_fns = {name: optimizer_step(model, optimizer) for name, (model, optimizer) in models.items()}
    ours = step_fns[VERSIONS[0]]
    moved = []

    def ours_counted(tokens, targets):  # our host-device traffic, step by step
        with TransferLedger() as ledger:
            loss = ours(tokens, targets)
        moved.append(ledger.bytes)
        return loss

    step_fns[VERSIONS[0]] = ours_counted
    runs = interleaved_steps(step_fns, token_batches(steps, batch_size, config.block_size, config.vocab_size), warmup)
    result = {"moved": moved[-1]}
    for name, run in runs.items():
        result[name] = dict(**ledger_figures(run["ledgers"][-1].summary()), step_ms=run["step_ms"], losses=run["losses"])
    return result


def compare(ranks: int = 2, steps: int = 12, warmup: int = 3, repeats: int = 3, batch_size: int = 16,
            config: GPTConfig = CONFIG, progress=lambda iterable: iterable) -> dict:
    """Rank 0's figures of the first launch, with step_ms the median over `repeats` launches."""
    return median_over_launches(train_side_by_side, VERSIONS, ranks, repeats, steps, warmup, batch_size, config, progress=progress)


def table(result: dict, psi: int, ranks: int) -> str:
    fsdp2_ms = result[VERSIONS[1]]["step_ms"]
    rows = [f"GPT with {psi:,} parameters, {ranks} ranks (CPU, gloo), fp32 AdamW; 2(N-1)/N * 4 bytes * psi "
            f"= {2 * (ranks - 1) / ranks * 4 * psi:,.0f} bytes",
            f"{'version':>26} {'bytes sent':>12} {'step ms':>8} {'/ FSDP2':>8}  collectives (calls)"]
    for name in VERSIONS:
        row = result[name]
        calls = ", ".join(f"{kind} {calls}" for kind, (calls, _) in sorted(row["collectives"].items()))
        rows.append(f"{name:>26} {row['sent_bytes']:>12,.0f} {row['step_ms']:>8.1f} {row['step_ms'] / fsdp2_ms:>8.2f}  {calls}")
    moved = result["moved"]
    rows.append(f"ours, host <-> device per step (rank 0): {moved['to_host']:,} bytes down, {moved['to_device']:,} up "
                f"(4 psi / Nd each in fp32 = {4 * psi // ranks:,})")
    rows.append(f"largest loss difference over {len(result[VERSIONS[0]]['losses'])} steps: {result['max_loss_diff']:.1e}")
    return "\n".join(rows)


def main() -> None:
    args = benchmark_parser(__doc__.split("\n\n")[0]).parse_args()
    result = compare(args.ranks, args.steps, args.warmup, args.repeats, args.batch_size)
    print(table(result, GPT(CONFIG).num_params(), args.ranks))
    print(timing_note(args, {name: result[name]["step_ms_all"] for name in VERSIONS}))


if __name__ == "__main__":
    main()
