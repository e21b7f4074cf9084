"""Everything the course claims about a GPU, checked on the one GPU at hand, in a few minutes.

    python benchmarks/gpu_check.py                 # a machine with a GPU: ranks share it over gloo
    python benchmarks/gpu_check.py --device cpu    # the same checks on the CPU (what CI runs, --quick)

Checks, each a row of one table (written to gpu_check.json too); the exit status is 1 if any fails:
  training   every stage (0-3), ZeRO-Offload, the NVMe tier and ZeRO++'s hpZ and HSDP on 2x2 ranks,
             each against single-process torch.optim.AdamW on the same device and global batch
             (largest weight difference after a few steps, fp32)
  memory     lesson 07's benchmark at Nd = 1, 2, 4 ranks sharing the device: per-rank model states
             against the formula (up to padding), offload's device (2Ψ) and host (16Ψ/Nd) split,
             bytes sent per step against 2Ψ / 3Ψ (Nd-1)/Nd (stage 3: plus its second gather of the
             GPT's tied embedding)
  link       ZeRO-Offload's host-device link (benchmarks/link_overlap.py): bandwidth each way, and
             whether uploads and downloads hide at least half their time behind matmuls (GPU only)
  fsdp2      our stage 3 against PyTorch's FSDP2 on the same GPT: same losses, the ratio of step times
  snapshot   a memory timeline of rank 0 building and training one step of each stage (CUDA: the
             allocator's history; CPU: the profiler's memory profile), saved as STAGE.html to open
             in a browser (and STAGE.pickle for pytorch.org/memory_viz) under --snapshots; its peak
             against the memory ledger's model states (zero_lab/memory_timeline.py)
The first line says where the ranks run, the card and the torch version.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark scripts

import zero_lab  # noqa: E402
from zero_lab.data import regression_batches, shard_batch  # noqa: E402
from zero_lab.models import MLP, GPTConfig  # noqa: E402
from zero_lab.rank_placement import DEVICE_VARIABLE  # noqa: E402

SIZES = [6, 9, 5]  # 113 parameters, a prime: every world size pads and cuts through tensors
STEPS, GLOBAL_BATCH = 4, 8
ADAMW = dict(lr=1e-2, weight_decay=0.1)
TRAINING = {  # label -> (ranks, prepare's options, tolerance)
    "stage 0 (DDP)": (2, dict(stage=0), 1e-5),
    "stage 1": (2, dict(stage=1), 1e-5),
    "stage 2": (2, dict(stage=2), 1e-5),
    "stage 3": (2, dict(stage=3), 1e-5),
    "stage 2, offload": (2, dict(stage=2, offload="cpu"), 1e-4),  # the host's compiled AdamW: its own rounding
    "stage 3, NVMe tier": (2, dict(stage=3, offload="nvme"), 1e-5),
    "stage 3, hpZ on 2x2": (4, dict(stage=3, ranks_per_node=2, hpz=True), 1e-5),
    "HSDP on 2x2": (4, dict(stage=3, ranks_per_node=2, replicate_across_nodes=True), 1e-5),
}
STATES_PADDING = 0.02  # model states may exceed the formula by padding: at most 2 % for these sizes
BYTES_PADDING = 0.02


def _train(options: dict | None) -> list[float]:
    """Train the MLP on this rank's shard of each global batch (options None: plain AdamW, one
    process, the whole batch); return its weights, flat."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-nvme-") as nvme_dir:  # removed even when a rank fails
        return _train_in(options, nvme_dir)


def _train_in(options: dict | None, nvme_dir: str) -> list[float]:
    device = zero_lab.rank_device()
    model = MLP(SIZES, seed=0)  # made on the CPU: the same weights whatever the device
    if options is None:
        model.to(device)
        optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    else:
        options = dict(options)
        if options.get("offload") == "nvme":
            options["nvme_dir"] = nvme_dir
        model, optimizer = zero_lab.prepare(model, torch.optim.AdamW, device=device, **{**ADAMW, **options})
    rank, world_size = (dist.get_rank(), dist.get_world_size())
    for x, y in regression_batches(STEPS, GLOBAL_BATCH, SIZES[0], SIZES[-1], seed=1):
        x, y = (t.to(device) for t in shard_batch((x, y), rank, world_size if options is not None else 1))
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    if hasattr(optimizer, "flush"):
        optimizer.flush()
    state = getattr(model, "module", model).state_dict()  # whole weights at every stage (stage 3 gathers them)
    weights = torch.cat([t.detach().float().flatten().cpu() for t in state.values()]).tolist()
    if hasattr(optimizer, "close"):
        optimizer.close()
    return weights


def check_training(device: str, quick: bool) -> list[dict]:
    expected = zero_lab.launch(_train, 1, None, device=device)[0]
    rows = []
    for label, (ranks, options, tolerance) in TRAINING.items():
        if quick and ranks > 2:
            continue
        try:
            got = zero_lab.launch(_train, ranks, options, device=device)
        except zero_lab.RankFailed as failure:
            rows.append(_row("training", f"{label}, {ranks} ranks", str(failure).splitlines()[-1][:80],
                             f"≤ {tolerance:g}", False))
            continue
        worst = max(abs(a - b) for weights in got for a, b in zip(weights, expected))
        rows.append(_row("training", f"{label}, {ranks} ranks", f"largest difference {worst:.1e}",
                         f"≤ {tolerance:g}", worst <= tolerance))
    return rows


def check_memory(device: str, quick: bool) -> list[dict]:
    import memory_vs_formula as bench

    nds = (1, 2) if quick else (1, 2, 4)
    with _device_variable(device):
        run = bench.measure(nds=nds, sizes=("S",), timed_steps=1)
    rows = []
    for nd, results in run.results.items():
        for label, result in results.items():
            if "unavailable" in result:
                rows.append(_row("memory", f"{label}, Nd={nd}", result["unavailable"][:80], "available", False))
                continue
            f = result["sizes"]["S"]
            formula, states = sum(f["formula"].values()), sum(f["model_states"].values())
            ratio = states / formula
            rows.append(_row("memory", f"{label}, Nd={nd}: model states / formula", f"{ratio:.4f}",
                             f"1 to {1 + STATES_PADDING:g}", 1 <= ratio <= 1 + STATES_PADDING))
            if "placement" in f:
                for where in ("device", "host"):
                    ratio = f["placement"][where] / f["placement_formula"][where]
                    rows.append(_row("memory", f"{label}, Nd={nd}: {where} / {'2Ψ' if where == 'device' else '16Ψ/Nd'}",
                                     f"{ratio:.4f}", f"1 to {1 + STATES_PADDING:g}", 1 <= ratio <= 1 + STATES_PADDING))
            if f["peak"] is not None:
                rows.append(_row("memory", f"{label}, Nd={nd}: peak / (formula + activations)",
                                 f"{f['peak'] / (formula + f['activations']):.3f}", "peak ≥ model states",
                                 f["peak"] >= states))
            if nd > 1:
                ratio = f["sent_bytes"] / (f["comm_formula"] + _regathered(bench, label, nd))
                rows.append(_row("memory", f"{label}, Nd={nd}: bytes per step / formula", f"{ratio:.4f}",
                                 f"1 to {1 + BYTES_PADDING:g}", 1 <= ratio <= 1 + BYTES_PADDING))
    return rows


def _regathered(bench, label: str, nd: int) -> float:
    """Stage 3 gathers the GPT's tied embedding once more per step than the formula counts: after the
    embedding its unit is released, and the output layer needs the same weights at the end of forward."""
    if bench.row_options(label)["stage"] != 3:
        return 0.0
    config = bench.SIZES["S"]
    return config.vocab_size * config.n_embd * 2 * (nd - 1) / nd  # bf16 elements, (Nd-1)/Nd of them sent


def check_link(device: str, quick: bool) -> list[dict]:
    if device != "cuda":
        return [_row("link", "host-device link", "skipped: needs a GPU", "", True)]
    figures = zero_lab.launch(_measure_link, 1, 64 if quick else 256, device=device)[0]
    rows = [_row("link", f"plain copy, {way}", f"{rate:.1f} GB/s", "measured", True)
            for way, rate in figures["GB/s"].items()]
    for kind, overlap in figures["overlap"].items():  # interleaved / max(alone): 1 is full overlap
        serial = figures["serial"][kind]
        rows.append(_row("link", f"matmuls + {kind}: interleaved / max(alone)", f"{overlap:.2f} (serial {serial:.2f})",
                         f"≤ {(1 + serial) / 2:.2f}", overlap <= (1 + serial) / 2))
    return rows


def _measure_link(size_mb: int) -> dict:  # in a rank: CUDA stays uninitialised in this process
    from link_overlap import measure_link

    return measure_link(size_mb=size_mb, device=str(zero_lab.rank_device()))


def check_fsdp2(device: str, quick: bool) -> list[dict]:
    from zero_lab.side_by_side import SIZES, stage3_vs_fsdp2

    sizes = {"tiny": GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=16, block_size=16)} if quick else \
        {name: SIZES[name] for name in ("0.8M", "7M")}
    rows = []
    with _device_variable(device):
        for dtype in (torch.float32,) if quick else (torch.float32, torch.bfloat16):
            result = stage3_vs_fsdp2(ranks=2, steps=4 if quick else 8, sizes=sizes, dtype=dtype)
            for size, figures in result["sizes"].items():
                what = f"GPT {size} ({figures['psi']:,} parameters), {result['dtype']}"
                rows.append(_row("fsdp2", f"{what}: losses, ours - FSDP2's", f"{figures['max_loss_diff']:.1e}",
                                 f"≤ {result['tolerance']:g}", figures["losses_match"]))
                rows.append(_row("fsdp2", f"{what}: step time, ours / FSDP2's", f"{figures['ratio']:.2f}",
                                 "measured", True))
    return rows


SNAPSHOT_DIR = Path("gpu_check_snapshots")  # where the snapshot check writes, unless --snapshots says
SNAPSHOTS = {  # file name -> prepare's options; each one step of a GPT on 2 ranks, rank 0 recorded
    "stage0": dict(stage=0), "stage1": dict(stage=1), "stage2": dict(stage=2), "stage3": dict(stage=3),
    "stage2-offload": dict(stage=2, offload="cpu"),
}


def check_snapshot(device: str, quick: bool, directory: Path = SNAPSHOT_DIR) -> list[dict]:
    config = GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=16, block_size=16) if quick else \
        GPTConfig(vocab_size=256, n_layer=4, n_head=6, n_embd=384, block_size=64)  # side_by_side's "7M"
    rows = []
    for name, options in SNAPSHOTS.items():
        if quick and name not in ("stage1", "stage3"):
            continue
        figures = zero_lab.launch(_recorded_step, 2, config, options, str(directory / name), device=device)[0]
        peak, states = figures["peak"], figures["model_states"]
        figure = f"peak {peak / 2**20:.2f} MiB, states {states / 2**20:.2f} MiB"
        if figures["allocator_peak"] is not None:
            figure += f", allocator {figures['allocator_peak'] / 2**20:.2f}"
        rows.append(_row("snapshot", f"{name}, rank 0 -> {name}.html", figure, "peak ≥ states",
                         peak >= states and Path(figures["html"]).stat().st_size > 0))
    return rows


def _recorded_step(config: GPTConfig, options: dict, stem: str) -> dict:
    """Build the GPT, prepare it and train one step; rank 0 records it all. The model states are
    counted after the step, when the optimizer's states exist."""
    from zero_lab.memory_ledger import model_state_bytes
    from zero_lab.memory_timeline import recorded
    from zero_lab.models import GPT

    device = zero_lab.rank_device()
    tokens = torch.randint(0, config.vocab_size, (4, config.block_size), generator=torch.Generator().manual_seed(0))
    recording = recorded(device) if dist.get_rank() == 0 else contextlib.nullcontext()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with recording as timeline:
        model, optimizer = zero_lab.prepare(GPT(config), torch.optim.AdamW, device=device, lr=1e-3, **options)
        model(tokens.to(device), tokens.to(device))[1].backward()
        optimizer.step()
        if hasattr(optimizer, "flush"):
            optimizer.flush()
    if timeline is None:
        return {}
    placement = dict(placement="device") if options.get("offload") else {}
    html, _ = timeline.save(stem)
    return dict(peak=timeline.peak_bytes(), model_states=model_state_bytes(model, optimizer, **placement).total,
                allocator_peak=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
                html=str(html))


CHECKS = {"training": check_training, "memory": check_memory, "link": check_link, "fsdp2": check_fsdp2,
          "snapshot": check_snapshot}


def _device_variable(device: str):
    """$ZERO_LAB_DEVICE set for a block, for code that launches ranks without a device= argument."""
    return mock.patch.dict(os.environ, {DEVICE_VARIABLE: device})


def _row(check: str, what: str, figure: str, expected: str, ok: bool) -> dict:
    return dict(check=check, what=what, figure=figure, expected=expected, ok=bool(ok))


def machine(device: str) -> str:
    card = "no GPU" if device == "cpu" else zero_lab.launch(_card, 1, device=device)[0]
    return f"{zero_lab.placement(2, device)}; {card}; torch {torch.__version__}"


def _card() -> str:  # in a rank: CUDA stays uninitialised in this process, which forks the ranks
    device = zero_lab.rank_device()
    return f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}"


def table(rows: list[dict]) -> str:
    width = max(len(r["what"]) for r in rows)
    lines = [f"{'check':<9} {'what':<{width}}  {'figure':<28} {'expected':<18} ok"]
    lines += [f"{r['check']:<9} {r['what']:<{width}}  {r['figure']:<28} {r['expected']:<18} "
              f"{'yes' if r['ok'] else 'NO'}" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="where the ranks run (default: the GPU if one is visible)")
    parser.add_argument("--quick", action="store_true", help="fewer world sizes and steps (CI's CPU run)")
    parser.add_argument("--checks", nargs="+", choices=list(CHECKS), default=list(CHECKS))
    parser.add_argument("--json", default="gpu_check.json", help="where to write the figures")
    parser.add_argument("--snapshots", default=SNAPSHOT_DIR, type=Path,
                        help="where the snapshot check writes its memory timelines")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.device_count() else "cpu")
    print(machine(device), flush=True)
    checks = dict(CHECKS, snapshot=functools.partial(check_snapshot, directory=args.snapshots))
    rows, start = [], time.monotonic()
    for name in args.checks:
        began = time.monotonic()
        try:
            rows += checks[name](device, args.quick)
        except Exception as error:  # one broken check must not hide the others' figures
            rows.append(_row(name, "the check itself", f"{type(error).__name__}: {str(error)[:60]}", "runs", False))
        print(f"{name}: {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
    print(table(rows))
    failed = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed in {time.monotonic() - start:.0f} s")
    Path(args.json).write_text(json.dumps(dict(machine=machine(device), device=device, rows=rows), indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
