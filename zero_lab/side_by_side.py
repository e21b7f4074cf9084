"""Our ZeRO stages next to DeepSpeed's, in the same run: losses, bytes per step, step time.

Hand-written (not generated from a lesson). Used by benchmarks/deepspeed_side_by_side.py, the
optional DeepSpeed section of lesson 03 and tests/test_deepspeed.py:

    from zero_lab import side_by_side
    if side_by_side.deepspeed_available():
        comparison = side_by_side.compare(stages=(1,), ranks=2, steps=8)
        print(side_by_side.table(comparison))

On every rank and for every stage S, the same GPT (seed 0) is built once per version: ours with
`zero_lab.prepare(model, torch.optim.AdamW, stage=S, ...)`, DeepSpeed's with
`deepspeed.initialize` and ZeRO stage S. DeepSpeed gets torch's own AdamW ("torch_adam": true)
with the same lr, betas, eps and weight decay; fp32, no gradient clipping, no loss scaling; it
runs on the launcher's process group (backend "counted"), so `CommLedger` sees its collectives.
All versions train on the same shards of the same global batches, one step each in turn (the
order rotates every step, so machine noise hits all alike).

The measuring loop itself (`interleaved_steps`, with `optimizer_step` and `ledger_figures`)
and the scripts' command-line options and timing note (`benchmark_parser`, `timing_note`) are
shared with benchmarks/ddp_vs_torch.py and benchmarks/zero1_vs_torch.py; the FSDP2 scripts
(benchmarks/zero2_vs_fsdp2.py, zero3_vs_fsdp2.py, offload_vs_fsdp2.py, which lessons 04-06
load) also share FSDP2's set-up, their table and their `--sizes` sweep (`fsdp2_shard`,
`fsdp2_table`, `fsdp2_parser`, `fsdp2_sweep`). `stage3_vs_fsdp2` is our stage 3 against FSDP2
in one call (benchmarks/zero3_vs_fsdp2.py's set-up): step-time ratio, and whether the losses match.

The lab bench runs on `zero_lab.rank_device()`: every version's model is built on the CPU (same
seed, the same weights on every device), then moved there (ours by `prepare(..., device=)`), the
batches follow it, and the clock is read after the device has finished (`synchronize`).

DeepSpeed versions (ZeRO config options on top of DeepSpeed's defaults):
    "DeepSpeed"             the defaults
    "DeepSpeed, reduce"     "use_multi_rank_bucket_allreduce": false, which replaces the gradient
                            all-reduce of the defaults by one `reduce` to each owning rank
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import zero_lab
from zero_lab.data import shard_batch, token_batches
from zero_lab.models import GPT, Block, GPTConfig
from zero_lab.prepare import prepare

DEEPSPEED_VERSION = "0.19.8"
INSTALL = f"DS_BUILD_OPS=0 pip install deepspeed=={DEEPSPEED_VERSION}   (or: DS_BUILD_OPS=0 pip install -e '.[deepspeed]')"
OURS = "ours"
DEEPSPEED_VERSIONS = {
    "DeepSpeed": {},
    "DeepSpeed, reduce": {"use_multi_rank_bucket_allreduce": False},
}
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CONFIG = GPTConfig()  # the course GPT: 28,544 parameters
# The FSDP2 scripts' models (--sizes); "0.8M" is their default.
SIZES = {
    "0.8M": GPTConfig(vocab_size=256, n_layer=4, n_head=4, n_embd=128, block_size=64),  # 834,304 parameters
    "3M": GPTConfig(vocab_size=256, n_layer=4, n_head=4, n_embd=256, block_size=64),  # 3,241,472
    "7M": GPTConfig(vocab_size=256, n_layer=4, n_head=6, n_embd=384, block_size=64),  # 7,221,504
    "30M": GPTConfig(vocab_size=256, n_layer=6, n_head=10, n_embd=640, block_size=64),  # 29,747,200
}


def deepspeed_available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def our_stages() -> tuple[int, ...]:
    """The stages zero_lab has built so far: 1 (lesson 03), and 2 once lesson 04 exported zero_lab.zero2."""
    return (1, 2) if importlib.util.find_spec("zero_lab.zero2") is not None else (1,)


def _deepspeed_engine(model, stage: int, micro_batch: int, zero_options: dict, log: io.StringIO,
                      device: torch.device):
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "torch_adam": True}},
        "zero_optimization": {"stage": stage, **zero_options},
        "gradient_clipping": 0.0,  # the default, spelled out: no clipping; no fp16/bf16 section: fp32, no loss scaling
        "steps_per_print": 10**9,
    }
    with _captured(log):
        import deepspeed

        # On a GPU, DeepSpeed's device is args.device_rank, else cuda:LOCAL_RANK: none such when ranks share a GPU.
        args = argparse.Namespace(device_rank=device.index) if device.type == "cuda" else None
        engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(), config=config,
                                          dist_init_required=False)
    for handler in deepspeed.utils.logger.handlers:  # made during the import: later warnings go to stdout again
        if getattr(handler, "stream", None) is log:
            handler.setStream(sys.stdout)
    return engine


@contextlib.contextmanager
def _captured(log: io.StringIO):
    """Python's and the process's stdout and stderr into `log`, for DeepSpeed's start-up notices
    (its accelerator, the ops it builds) and the compiler errors of the op checks it runs on
    import, which reach file descriptor 2 directly under Jupyter. Printed if something fails."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile(mode="w+") as file:
        os.dup2(file.fileno(), 1)
        os.dup2(file.fileno(), 2)
        failed = False
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                yield
        except BaseException:
            failed = True
            raise
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            file.seek(0)
            log.write(file.read())
            if failed:
                sys.stderr.write(log.getvalue())


def train_side_by_side(stages, steps: int, warmup: int, batch_size: int, config: GPTConfig = CONFIG,
                       versions=tuple(DEEPSPEED_VERSIONS)) -> dict:
    """Runs on every rank. runs: {(stage, version): this rank's losses, ledger summaries and median
    step time}; deepspeed_log: what DeepSpeed printed while importing and initialising (dropped
    from the output: its accelerator and op-build notices)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if batch_size % world_size:
        raise ValueError(f"the global batch of {batch_size} rows must split evenly over {world_size} ranks")
    device = zero_lab.rank_device()
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use", category=FutureWarning)
    log = io.StringIO()
    step_fns = {}
    for stage in stages:
        model, optimizer = prepare(GPT(config, seed=0), torch.optim.AdamW, stage=stage, device=device, **ADAMW)
        step_fns[stage, OURS] = optimizer_step(model, optimizer)
        for name in versions:
            engine = _deepspeed_engine(GPT(config, seed=0).to(device), stage, batch_size // world_size,
                                       DEEPSPEED_VERSIONS[name], log, device)
            step_fns[stage, name] = _deepspeed_step(engine)
    batches = token_batches(steps, batch_size, config.block_size, config.vocab_size, seed=0)
    runs = interleaved_steps(step_fns, batches, warmup, device)
    return dict(runs={key: dict(losses=run["losses"], ledgers=[ledger.summary() for ledger in run["ledgers"]],
                                step_ms=run["step_ms"]) for key, run in runs.items()},
                deepspeed_log=log.getvalue())


def synchronize(device: torch.device) -> None:
    """Wait until `device` has finished the work queued so far (a no-op on the CPU): before
    reading the clock, since a GPU runs its kernels after Python has moved on."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_steps(steps: dict, batches, warmup: int, device: torch.device | None = None) -> dict:
    """Runs on every rank: one training step of every version per global batch, timed.

    steps: {version: step(tokens, targets)}, each doing one whole step (forward, backward,
    communication, optimizer) on this rank's shard of the batch and returning its loss (a
    tensor or a float), or None. The versions take turns on the same shard, in an order that
    rotates every batch so that machine noise hits all alike; the ranks meet at a barrier
    before each step, so the clock measures the step, not the wait for the other ranks'
    previous one, and each step runs inside its own `CommLedger`. device: where the models are,
    which the shards are moved to (default `zero_lab.rank_device()`); the clock starts and stops
    with the device idle.

    Returns {version: dict(losses, ledgers, times, step_ms)}: per step the loss (a float, or
    None) and the CommLedger; the step times in seconds; step_ms, the median step time in
    milliseconds over the steps after the first `warmup`.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = zero_lab.rank_device() if device is None else torch.device(device)
    names = list(steps)
    runs = {name: dict(losses=[], ledgers=[], times=[]) for name in names}
    for index, batch in enumerate(batches):
        tokens, targets = (t.to(device) for t in shard_batch(batch, rank, world_size))
        for name in names[index % len(names):] + names[:index % len(names)]:
            run = runs[name]
            synchronize(device)  # the previous step's (and the copy's) kernels are not this one's
            dist.barrier()  # time the step, not the wait for the other ranks' previous one
            start = time.perf_counter()
            with zero_lab.CommLedger() as ledger:
                loss = steps[name](tokens, targets)
                if isinstance(loss, torch.Tensor):
                    loss = loss.item()  # on a GPU: waits for the step's kernels so far
                synchronize(device)  # and for all of them, whatever the step returned
            run["times"].append(time.perf_counter() - start)
            run["losses"].append(loss)
            run["ledgers"].append(ledger)
    for run in runs.values():
        if len(run["times"]) <= warmup:
            raise ValueError(f"{warmup} warm-up steps leave none of the {len(run['times'])} steps to time")
        run["step_ms"] = 1e3 * statistics.median(run["times"][warmup:])
    return runs


def ledger_figures(summary: dict) -> dict:
    """A step's `CommLedger.summary()` as the benchmarks report it: collectives, {kind: (calls,
    bytes sent)}, and sent_bytes, their total."""
    return dict(collectives={kind: (t["calls"], t["sent_bytes"]) for kind, t in summary.items()},
                sent_bytes=sum(t["sent_bytes"] for t in summary.values()))


def median_over_launches(train_fn, versions, ranks: int, repeats: int, *args, progress=lambda iterable: iterable) -> dict:
    """Rank 0's figures of the first of `repeats` launches of `train_fn(*args)` on `ranks` ranks, with each
    version's step_ms the median over the launches and max_loss_diff between the first two versions."""
    runs = [zero_lab.launch(train_fn, ranks, *args, timeout=600)[0] for _ in progress(range(repeats))]
    result = dict(runs[0])
    for name in versions:
        times = [run[name]["step_ms"] for run in runs]
        result[name] = {**runs[0][name], "step_ms": statistics.median(times), "step_ms_all": times}
    result["max_loss_diff"] = max(abs(a - b) for a, b in zip(*(result[name]["losses"] for name in versions[:2])))
    return result


def benchmark_parser(description: str, warmup: int = 3, repeats: int = 3) -> argparse.ArgumentParser:
    """The options every side-by-side benchmark script takes; add the script's own to it."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=warmup, help="first steps left out of the timing")
    parser.add_argument("--repeats", type=int, default=repeats, help="launches; step times are the median over them")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch, split over the ranks")
    return parser


def timing_note(args: argparse.Namespace, per_launch: dict | None = None) -> str:
    """What the step times of a benchmark run with `args` are; with `per_launch`
    ({version: [step ms of each launch]}), followed by those."""
    note = (f"step ms: median over {args.repeats} launches of the median of steps {args.warmup + 1}-{args.steps} "
            "on rank 0; wall-clock on this machine, noisy if others are using it.")
    if per_launch is not None:
        note += " Per launch: " + "; ".join(f"{name} {', '.join(f'{t:.1f}' for t in times)}"
                                           for name, times in per_launch.items())
    return note


def optimizer_step(model, optimizer):
    """A step function for `interleaved_steps`: forward, backward, optimizer step, zero_grad."""
    def step(tokens, targets):
        _, loss = model(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss
    return step


def _deepspeed_step(engine):
    def step(tokens, targets):
        _, loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()  # DeepSpeed zeroes the gradients itself
        return loss.item()
    return step


def compare(stages=None, ranks: int = 2, steps: int = 8, warmup: int = 2, repeats: int = 1, batch_size: int = 16,
            config: GPTConfig = CONFIG, versions=tuple(DEEPSPEED_VERSIONS), timeout: float = 300) -> dict:
    """Train side by side in `repeats` launches of `ranks` ranks (stages: default all of ours).

    Returns dict(ranks, psi, steps, warmup, repeats, deepspeed_log, results), results mapping
    (stage, version) to:
    losses: the global batch's mean loss per step (the mean of the ranks' means; equal shards);
    max_loss_diff: the largest |loss - our loss| over the steps (0 for ours);
    collectives: {kind: (calls, bytes sent)} of rank 0's last step (the ledger's ring convention);
    sent_bytes: their sum; ledger_per_step: rank 0's bytes sent at each step;
    step_ms: the median over launches of rank 0's median step time (steps after `warmup`);
    step_ms_all: that per launch; time_vs_ours: step_ms / our step_ms at the same stage.
    """
    if not deepspeed_available():
        raise ModuleNotFoundError(f"DeepSpeed is not installed: {INSTALL}")
    stages = our_stages() if stages is None else tuple(stages)
    launches = [zero_lab.launch(train_side_by_side, ranks, stages, steps, warmup, batch_size, config, tuple(versions),
                                timeout=timeout) for _ in range(repeats)]
    results = {}
    per_rank = [rank_result["runs"] for rank_result in launches[0]]
    for key in per_rank[0]:
        losses = [statistics.fmean(runs[key]["losses"][i] for runs in per_rank) for i in range(steps)]
        last = per_rank[0][key]["ledgers"][-1]
        times = [launch[0]["runs"][key]["step_ms"] for launch in launches]
        results[key] = dict(
            losses=losses,
            **ledger_figures(last),
            ledger_per_step=[sum(t["sent_bytes"] for t in ledger.values()) for ledger in per_rank[0][key]["ledgers"]],
            step_ms=statistics.median(times),
            step_ms_all=times,
        )
    for (stage, name), row in results.items():
        ours = results[stage, OURS]
        row["max_loss_diff"] = max(abs(a - b) for a, b in zip(row["losses"], ours["losses"]))
        row["time_vs_ours"] = row["step_ms"] / ours["step_ms"]
    return dict(ranks=ranks, psi=GPT(config).num_params(), steps=steps, warmup=warmup, repeats=repeats,
                deepspeed_log=launches[0][0]["deepspeed_log"], results=results)


def table(comparison: dict) -> str:
    """The comparison as text: one row per (stage, version)."""
    ranks, psi, results = comparison["ranks"], comparison["psi"], comparison["results"]
    formula = 2 * (ranks - 1) / ranks * psi * 4
    rows = [f"GPT with psi = {psi:,} parameters, {ranks} rank{'s' if ranks != 1 else ''}, fp32 AdamW; "
            f"ZeRO's 2(N-1)/N * psi * 4 bytes = {formula:,.0f}",
            f"{'stage':>5} {'version':>17} {'bytes/step':>11} {'/ formula':>9} {'step ms':>8} {'/ ours':>7} "
            f"{'max |loss - ours|':>18}  collectives per step: calls, bytes sent"]
    for (stage, name), row in results.items():
        calls = ", ".join(f"{kind} x{calls} {sent:,.0f}" for kind, (calls, sent) in sorted(row["collectives"].items()))
        rows.append(f"{stage:>5} {name:>17} {row['sent_bytes']:>11,.0f} {ratio(row['sent_bytes'], formula):>9} "
                    f"{row['step_ms']:>8.1f} {row['time_vs_ours']:>7.2f} {row['max_loss_diff']:>18.1e}  {calls}")
    return "\n".join(rows)


def ratio(numerator: float, denominator: float, digits: int = 3) -> str:
    """numerator / denominator as text, or "—" when the denominator is 0 (one rank sends no bytes)."""
    return f"{numerator / denominator:.{digits}f}" if denominator else "—"


def fsdp2_shard(model: torch.nn.Module, device: torch.device | None = None, **options) -> torch.nn.Module:
    """FSDP2's `fully_shard(**options)` on every block of the GPT and on the root (the embeddings,
    the final LayerNorm and the tied head): one all-gather and one reduce-scatter per block.

    The model is moved to `device` first (default `zero_lab.rank_device()`); the mesh is of that
    device's type over the launcher's process group, whatever carries its tensors (on one GPU
    shared by several ranks, gloo: FSDP2's collectives of CUDA tensors go through it too)."""
    device = zero_lab.rank_device() if device is None else torch.device(device)
    model.to(device)
    mesh = DeviceMesh.from_group(dist.distributed_c10d._get_default_group(), device.type)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, **options)
    return fully_shard(model, mesh=mesh, **options)


def fsdp2_weight_diff(ours, fsdp2: torch.nn.Module) -> float:
    """Largest |difference| between our whole parameters `ours` and FSDP2's model's, over all ranks
    (FSDP2's fp32 shards rounded to our parameters' dtype: bf16 under mixed precision)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # FSDP2's parameters are DTensors whose local part is this rank's chunk of dim 0.
    diffs = [(torch.chunk(a.detach(), world_size)[rank] - b.to_local().to(a.dtype)).float().abs().max()
             for a, b in zip(ours, fsdp2.parameters()) if b.to_local().numel()]
    largest = torch.stack(diffs).max()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return largest.item()


def fsdp2_table(result: dict, psi: int, ranks: int, versions, volume: tuple[str, float], notes=()) -> str:
    """Ours next to FSDP2 (versions[1]): bytes each rank sends per step, their ratio to the paper's
    volume (its formula before "* bytes * psi", elements per parameter in units of (N-1)/N; "—" with one rank, which sends
    nothing), step time and its ratio to FSDP2's. result["dtype"] (default "float32"): the
    parameters' dtype while they travel, whose size the volume counts."""
    name_width = max(map(len, versions))
    volume_name, factor = volume
    dtype = result.get("dtype", "float32")
    element_bytes = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    volume_bytes = factor * (ranks - 1) / ranks * element_bytes * psi
    precision = "fp32" if dtype == "float32" else f"{dtype} parameters and gradients, fp32 masters and"
    rows = [f"GPT with {psi:,} parameters, {ranks} rank{'s' if ranks != 1 else ''}, {precision} AdamW; "
            f"{volume_name} * {element_bytes} bytes * psi = {volume_bytes:,.0f} bytes",
            f"{'version':>{name_width}} {'bytes sent':>12} {'/ volume':>8} {'step ms':>8} {'/ FSDP2':>8}  collectives (calls)"]
    fsdp2_ms = result[versions[1]]["step_ms"]
    for name in versions:
        row = result[name]
        calls = ", ".join(f"{kind} {calls}" for kind, (calls, _) in sorted(row["collectives"].items())) or "none"
        rows.append(f"{name:>{name_width}} {row['sent_bytes']:>12,.0f} {ratio(row['sent_bytes'], volume_bytes):>8} "
                    f"{row['step_ms']:>8.1f} {row['step_ms'] / fsdp2_ms:>8.2f}  {calls}")
    differences = f"largest loss difference over {len(result[versions[0]]['losses'])} steps: {result['max_loss_diff']:.1e}"
    if "max_weight_diff" in result:
        differences += f"; largest weight difference at the end: {result['max_weight_diff']:.1e}"
    return "\n".join([*rows, *notes, differences])


def fsdp2_parser(doc: str) -> argparse.ArgumentParser:
    """`benchmark_parser` with --sizes, for the FSDP2 scripts; add the script's own options to it."""
    parser = benchmark_parser(doc.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=["0.8M"],
                        help="models to compare on, by parameter count (several: a table of the ratios at the end)")
    return parser


def fsdp2_sweep(args: argparse.Namespace, compare, table, versions, **options) -> dict:
    """Say where the ranks run, run a script's `compare` at each of args.sizes and print its table;
    with several sizes, then the step-time ratio ours / FSDP2 per size. Returns {size: result}."""
    print(zero_lab.placement(args.ranks))
    results = {}
    for size in args.sizes:
        config = SIZES[size]
        results[size] = result = compare(args.ranks, args.steps, args.warmup, args.repeats, args.batch_size,
                                         config=config, **options)
        print(table(result, GPT(config).num_params(), args.ranks))
        print(timing_note(args, {name: result[name]["step_ms_all"] for name in versions}), end="\n\n")
    if len(results) > 1:
        print(f"{'size':>5} {'parameters':>11} {'ours ms':>8} {'FSDP2 ms':>9} {'ours / FSDP2':>13}   "
              f"({args.ranks} ranks; load average {', '.join(f'{x:.1f}' for x in os.getloadavg())})")
        for size, result in results.items():
            ours, fsdp2 = (result[name]["step_ms"] for name in versions[:2])
            print(f"{size:>5} {GPT(SIZES[size]).num_params():>11,} {ours:>8.1f} {fsdp2:>9.1f} {ours / fsdp2:>13.2f}")
    return results


# --- our stage 3 against FSDP2 (benchmarks/zero3_vs_fsdp2.py, zero3_profile.py; a GPU check imports it) ---

ZERO3_VERSIONS = ("ZeRO-3 (ours)", "FSDP2 (ZeRO-3 mode)")
ZERO3_LR = 1e-3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The largest |loss difference| over the steps that still counts as the same training: fp32 sums
# in another order differ in the last bits; bf16's 8-bit mantissa rounds ~0.4% of a loss of ~5.5.
LOSS_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def zero3_build(name: str, model: torch.nn.Module, prefetch: int = 1, dtype: torch.dtype = torch.float32,
                device: torch.device | None = None):
    """(model, optimizer) for one of ZERO3_VERSIONS, with the same sharding units (one per
    transformer block; the root holds the embeddings, the final LayerNorm and the tied head): ours
    by `prepare(..., stage=3, units=(Block,))`, FSDP2's by `fully_shard(reshard_after_forward=True)`
    on every block and on the root. The model is moved to `device` (default zero_lab.rank_device()).
    dtype: the parameters' and gradients' dtype in forward, backward and the collectives (fp32
    masters and AdamW either way): torch.float32 or torch.bfloat16."""
    device = zero_lab.rank_device() if device is None else torch.device(device)
    if dtype not in LOSS_TOLERANCE:
        raise ValueError(f"dtype must be one of {list(LOSS_TOLERANCE)}, got {dtype}")
    mixed = dtype != torch.float32
    if name == ZERO3_VERSIONS[0]:
        return prepare(model, torch.optim.AdamW, stage=3, units=(Block,), prefetch=prefetch, device=device,
                       lr=ZERO3_LR, **(dict(param_dtype=dtype) if mixed else {}))
    fsdp2_shard(model, device, reshard_after_forward=True,
                **(dict(mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)) if mixed else {}))
    return model, torch.optim.AdamW(model.parameters(), lr=ZERO3_LR)


def zero3_side_by_side(steps: int, warmup: int, batch_size: int, config: GPTConfig = SIZES["0.8M"], prefetch: int = 1,
                       dtype: torch.dtype = torch.float32) -> dict:
    """Runs on every rank: both ZERO3_VERSIONS of the same GPT (seed 0) on rank_device(), their
    steps interleaved. Returns this rank's max_weight_diff at the end, dtype, and per version its
    last step's collectives and bytes sent, its median step time and its losses."""
    device = zero_lab.rank_device()
    models = {name: zero3_build(name, GPT(config, seed=0), prefetch, dtype, device) for name in ZERO3_VERSIONS}
    step_fns = {name: optimizer_step(model, optimizer) for name, (model, optimizer) in models.items()}
    runs = interleaved_steps(step_fns, token_batches(steps, batch_size, config.block_size, config.vocab_size), warmup,
                             device)
    (ours, optimizer), (fsdp2, _) = models.values()
    with optimizer.gathered_parameters():
        result = {"max_weight_diff": fsdp2_weight_diff(ours.parameters(), fsdp2),
                  "dtype": str(dtype).removeprefix("torch.")}
    for name, run in runs.items():
        result[name] = dict(**ledger_figures(run["ledgers"][-1].summary()), step_ms=run["step_ms"], losses=run["losses"])
    return result


def stage3_vs_fsdp2(ranks: int = 2, steps: int = 6, sizes=("0.8M",), dtype=torch.float32, *, warmup: int = 2,
                    repeats: int = 1, batch_size: int = 16, prefetch: int = 1, tolerance: float | None = None,
                    progress=lambda iterable: iterable) -> dict:
    """Our stage 3 against FSDP2 in its ZeRO-3 mode, on `ranks` ranks where zero_lab.launch puts
    them (zero_lab.placement), for `steps` steps of the same GPT at each size.

    sizes: names of SIZES, or {name: GPTConfig}; dtype: torch.float32 or torch.bfloat16 (or "fp32",
    "bf16"); step times: the median over `repeats` launches of rank 0's median after `warmup` steps.
    Returns dict(placement, dtype, steps, tolerance, sizes={size: dict(psi, ours_ms, fsdp2_ms,
    ratio (ours / FSDP2 step time), max_loss_diff (rank 0's losses), max_weight_diff, losses_match
    (max_loss_diff <= tolerance; default LOSS_TOLERANCE[dtype]), result (benchmarks/zero3_vs_fsdp2.py's
    figures))}).
    """
    dtype = DTYPES.get(dtype, dtype)
    if dtype not in LOSS_TOLERANCE:
        raise ValueError(f"dtype must be one of {list(LOSS_TOLERANCE)} or {list(DTYPES)}, got {dtype!r}")
    tolerance = LOSS_TOLERANCE[dtype] if tolerance is None else tolerance
    configs = dict(sizes) if isinstance(sizes, dict) else {size: SIZES[size] for size in sizes}
    compared = {}
    for size, config in configs.items():
        result = median_over_launches(zero3_side_by_side, ZERO3_VERSIONS, ranks, repeats, steps, warmup, batch_size,
                                      config, prefetch, dtype, progress=progress)
        ours_ms, fsdp2_ms = (result[name]["step_ms"] for name in ZERO3_VERSIONS)
        compared[size] = dict(psi=GPT(config).num_params(), ours_ms=ours_ms, fsdp2_ms=fsdp2_ms, ratio=ours_ms / fsdp2_ms,
                              max_loss_diff=result["max_loss_diff"], max_weight_diff=result["max_weight_diff"],
                              losses_match=result["max_loss_diff"] <= tolerance, result=result)
    return dict(placement=str(zero_lab.placement(ranks)), dtype=str(dtype).removeprefix("torch."), steps=steps,
                tolerance=tolerance, sizes=compared)
