"""Every ZeRO stage on the same GPT: measured memory against the paper's formulas, the residual
explained, the largest model that fits a budget, step time and bytes per step (lesson 07).

    python benchmarks/memory_vs_formula.py                       # this machine, Nd = 1, 2, 4
    python benchmarks/memory_vs_formula.py --nd 1 2 3 --sizes S M L --fit-budget-mb 24
    torchrun --nproc-per-node 8 benchmarks/memory_vs_formula.py  # a GPU node: Nd = 8, one GPU per rank

A stage is a row of `ROWS` (or of `NVME_ROWS`, lesson 10's, with --rows): the keyword arguments
of `zero_lab.prepare`. A row this build of zero_lab refuses (stage 3 before lesson 05, offload
before lesson 06) is reported as "not available in this build" with prepare's own message. Every
rank trains the course GPT with mixed precision (bf16 parameters and gradients, fp32 masters and
AdamW: the paper's K = 12) on MICRO_BATCH rows of each global batch, so activations per rank
stay fixed as Nd grows. The GPT is built on the CPU and trained on the rank's device
(`zero_lab.rank_device()`: its GPU, or the CPU; `prepare(..., device=)`), the batches too; the
first line of the output says where the ranks run.

What is measured, and said in every output (the probe is zero_lab/step_memory.py):
  any device (`step_memory`): the memory ledger's model-state bytes by category, read at every
       module's forward hook and gradient hook and after each phase; the bytes saved for backward
       and not yet used (saved-tensor hooks). The residual (peak - formula) is split at the
       largest of these readings (zero_lab.benchmark.decompose_residual).
  CPU  the peak: model states at the step's start + the growth of the process's peak RSS during
       the step (Linux VmHWM, reset first; malloc set to map every block of 4 KiB or more on its
       own, so a freed tensor leaves the RSS).
  CUDA (`cuda_step_memory`) per rank, after torch.cuda.reset_peak_memory_stats(): memory_allocated
       after init, forward, backward and step of a steady-state step (the second), max_memory_allocated
       (the peak), max_memory_reserved, inactive_split_bytes (fragmentation) and mem_get_info (what
       the caching allocator does not see: CUDA context, NCCL buffers).
Each run writes a JSON file (machine, configuration, every figure); `plot_runs` draws several.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path

import torch
import torch.distributed as dist

import zero_lab
from zero_lab import memory
from zero_lab.benchmark import decompose_residual, largest_that_fits
from zero_lab.data import shard_batch, token_batches
from zero_lab.memory_ledger import CATEGORIES, model_state_bytes
from zero_lab.models import GPT, GPTConfig
from zero_lab.step_memory import cuda_step_memory, step_memory, step_phases  # noqa: F401 (lesson 07 reads them here)

ROWS = {  # label -> zero_lab.prepare keyword arguments
    "DP": dict(stage=0),
    "P_os": dict(stage=1),
    "P_os+g": dict(stage=2),
    "P_os+g+p": dict(stage=3),
    "P_os+g, offload": dict(stage=2, offload="cpu"),
}
NVME_ROWS = {  # lesson 10: ZeRO-Infinity, parameters and optimizer states on a simulated NVMe tier (files)
    "P_os+g+p, NVMe": dict(stage=3, offload="nvme"),
}
SIZES = {  # the course GPT at three sizes (n_head 4, vocabulary 256, 64 tokens)
    "S": GPTConfig(vocab_size=256, n_layer=2, n_head=4, n_embd=64, block_size=64),
    "M": GPTConfig(vocab_size=256, n_layer=4, n_head=4, n_embd=128, block_size=64),
    "L": GPTConfig(vocab_size=256, n_layer=6, n_head=4, n_embd=256, block_size=64),
}
FIT_DEPTHS = (1, 2, 4)
FIT_WIDTHS = tuple(range(32, 513, 32))  # n_embd candidates, multiples of n_head
MICRO_BATCH = 4  # rows per rank
ADAMW = dict(lr=1e-3, weight_decay=0.1)
PARAM_DTYPE = torch.bfloat16
NOT_AVAILABLE = "not available in this build"
CPU_MEASUREMENT = ("CPU: memory ledger (tensor bytes by category), saved-tensor hooks (activations), "
                   "peak RSS growth during the step (VmHWM); no allocator statistics exist on CPU")
CUDA_MEASUREMENT = "CUDA allocator: memory_allocated, max_memory_allocated/reserved, inactive_split_bytes, mem_get_info"


def row_options(row: str) -> dict:
    """prepare's keyword arguments for a row of ROWS or NVME_ROWS (looked up at call time: tests patch ROWS)."""
    return {**ROWS, **NVME_ROWS}[row]


def fit_config(depth: int, width: int) -> GPTConfig:
    return GPTConfig(vocab_size=256, n_layer=depth, n_head=4, n_embd=width, block_size=64)


def formula(row: str, psi: int, nd: int) -> dict:
    """The paper's model-state bytes per rank and category (bf16 compute, fp32 master: K = 12).

    Offload (zero_lab.offload, lesson 06) keeps stage 2's partitioned states on the host and, as
    DeepSpeed's estimators count, an fp32 gradient shard there: 2Ψ on the device + 16Ψ/Nd on the host.
    The NVMe rows (lesson 10) keep stage 3's 16-bit gradient shards in memory, 2Ψ/Nd, and the fp32
    masters (the parameters' only copy) and moments on the tier, 12Ψ/Nd.
    """
    states = memory.model_states_per_device(psi, nd, row_options(row)["stage"])
    if row_options(row).get("offload") == "cpu":
        states["gradients"] = Fraction(4 * psi, nd)
    if row_options(row).get("offload") == "nvme":  # parameters (the masters) and moments, 12Ψ/Nd, on the tier
        states.update(parameters=Fraction(0), master_params=Fraction(0), optimizer_states=Fraction(0))
    return states


def predicted_fit(row: str, budget: int, nd: int, device_only: bool) -> int:
    """The largest Ψ whose formula bytes fit the budget. device_only (a GPU): offload counts its
    2Ψ on the device; on CPU the simulated device and the host share one memory: every byte counts."""
    per_param = formula(row, 1, nd)
    per_param = per_param["parameters"] if device_only and row_options(row).get("offload") == "cpu" \
        else sum(per_param.values())
    return math.floor(Fraction(budget) / per_param)


def comm_formula(row: str, psi: int, nd: int) -> Fraction:
    """Bytes a rank sends per step: 2Ψ (3Ψ for stage 3) bf16 elements, exact ring factor (Nd-1)/Nd."""
    return 2 * memory.communication_volume(psi, row_options(row)["stage"], nd)


# --- one configuration on this rank ---------------------------------------------------------------

def _device() -> torch.device:
    return zero_lab.rank_device()


def _prepare(row: str, model):
    return zero_lab.prepare(model, torch.optim.AdamW, param_dtype=PARAM_DTYPE, device=_device(), **row_options(row),
                            **ADAMW)


def availability(row: str) -> str | None:
    """None if this build's prepare takes the row, else "not available in this build: <why>".
    Runs on every rank (prepare may communicate); probed on a one-layer model."""
    try:
        _prepare(row, torch.nn.Linear(4, 4))
    except (ValueError, TypeError, RuntimeError) as refusal:
        return f"{NOT_AVAILABLE}: {str(refusal).splitlines()[0]}"
    return None


def run_config(row: str, config: GPTConfig, timed_steps: int = 2, decompose=decompose_residual) -> dict:
    """Train `config` with the row's stage on this rank: step 1 (creates AdamW's state), step 2
    measured, then `timed_steps` timed steps in a CommLedger. Every rank returns its figures."""
    device, rank, nd = _device(), dist.get_rank(), dist.get_world_size()
    gc.collect()
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0  # what earlier rows left, if any
    model, optimizer = _prepare(row, GPT(config, seed=0))
    psi = GPT(config).num_params()
    batches = [shard_batch(b, rank, nd) for b in
               token_batches(2 + timed_steps, MICRO_BATCH * nd, config.block_size, config.vocab_size)]
    batches = [(tokens.to(device), targets.to(device)) for tokens, targets in batches]
    for _, run in step_phases(model, optimizer, *batches[0]):
        run()
    phases = step_phases(model, optimizer, *batches[1])
    figures = dict(psi=psi, formula={k: float(v) for k, v in formula(row, psi, nd).items()},
                   comm_formula=float(comm_formula(row, psi, nd)))
    figures.update(step_memory(model, optimizer, phases, device))
    if "cuda" in figures:  # this row's own: the peak less what was allocated before its model was built
        figures["cuda"]["before_model"] = before
        figures["peak"] -= before
    after_backward = next(s for s in reversed(figures["samples"]) if s["phase"] == "backward")
    figures["model_states"] = {c: after_backward[c] for c in CATEGORIES}
    if row_options(row).get("offload") == "cpu":  # where offload keeps them: 2Ψ on the device, 16Ψ/Nd on the host
        figures["placement"] = {where: sum(model_state_bytes(model, optimizer, placement=where).bytes.values())
                                for where in ("device", "host")}
        figures["placement_formula"] = {"device": 2 * psi, "host": float(Fraction(16 * psi, nd))}
    if figures["peak"] is not None:
        figures["residual"] = decompose(figures["samples"], figures["formula"], figures["peak"])
    if timed_steps:
        figures.update(_timed_steps(model, optimizer, batches[2:], device))
    del model, optimizer
    gc.collect()
    return figures


def _timed_steps(model, optimizer, batches, device) -> dict:
    """Median step time, tokens/s of the global batch, and the bytes this rank sent in the last step."""
    times = []
    for tokens, targets in batches:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the previous step's kernels are not this one's
        dist.barrier()  # time the step, not the wait for the other ranks' previous one
        start = time.perf_counter()
        with zero_lab.CommLedger() as ledger:
            for _, run in step_phases(model, optimizer, tokens, targets):
                run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    step = statistics.median(times)
    return dict(step_ms=1e3 * step, sent_bytes=float(ledger.sent_bytes()),
                tokens_per_s=tokens.numel() * dist.get_world_size() / step)


def peak_over_ranks(row: str, config: GPTConfig) -> int:
    """The largest measured peak of any rank for one measured step of `config`."""
    peak = run_config(row, config, timed_steps=0)["peak"]
    if peak is None:
        raise RuntimeError("the fit search needs a measured peak: Linux (peak RSS) or a GPU (allocator)")
    peak = torch.tensor(float(peak), device=_device())
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


def run_rank(rows, sizes, fit_budget: int | None, timed_steps: int = 2, family=(FIT_DEPTHS, FIT_WIDTHS),
             decompose=decompose_residual, search=largest_that_fits) -> dict:
    """Every row and size on this rank; with fit_budget, the largest GPT of the `family`
    (depths, widths) that completes a step with every rank's peak under it. Returns {row: figures}
    (rank-local). `decompose` and `search` default to zero_lab.benchmark's (lesson 07)."""
    results = {}
    for row in rows:
        why = availability(row)
        if why is not None:
            results[row] = {"unavailable": why}
            continue
        results[row] = {"sizes": {size: run_config(row, SIZES[size], timed_steps, decompose) for size in sizes}}
        if fit_budget is not None:
            fits = lambda depth, width: peak_over_ranks(row, fit_config(depth, width)) <= fit_budget  # noqa: E731
            best = search(*family, fits, lambda d, w: GPT(fit_config(d, w)).num_params())
            results[row]["fit"] = None if best is None else dict(
                depth=best[0], width=best[1], psi=GPT(fit_config(*best)).num_params())
    return results


# --- runs, files, tables and plots ----------------------------------------------------------------

def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    return dict(cpu=cpu, cores=os.cpu_count(), accelerator=", ".join(_gpu_names()) or "none (CPU only)",
                torch=torch.__version__, python=platform.python_version(), os=platform.platform())


def _gpu_names() -> list[str]:
    """The machine's GPUs' names, asked of nvidia-smi: torch.cuda.get_device_name would initialise
    CUDA in this process, and no later zero_lab.launch (a notebook's next cell) could fork ranks."""
    count = torch.cuda.device_count()  # NVML: leaves CUDA alone
    if not count:
        return []
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        listed = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=30).stdout.split("\n")
        names = [name.strip() for name in listed if name.strip()]
        if names:
            return names  # the machine's, CUDA_VISIBLE_DEVICES or not
    return [f"{count} GPU{'s' if count != 1 else ''}"]


@dataclass
class Run:
    """One benchmark run: per Nd, rank 0's figures for every row (see run_rank)."""
    machine: dict
    measurement: str
    config: dict
    results: dict  # {nd: {row: figures}}


def measure(nds=(1, 2, 4), rows=tuple(ROWS), sizes=("S", "M"), fit_budget_mb: float | None = None,
            timed_steps: int = 2, family=(FIT_DEPTHS, FIT_WIDTHS), decompose=decompose_residual,
            search=largest_that_fits, progress=lambda items: items) -> Run:
    """Launch every Nd on this machine (zero_lab.launch) and collect rank 0's figures."""
    fit_budget = None if fit_budget_mb is None else int(fit_budget_mb * 2**20)
    results = {nd: zero_lab.launch(run_rank, nd, rows, sizes, fit_budget, timed_steps, family, decompose, search,
                                   timeout=900)[0]
               for nd in progress(nds)}
    return _run(results, rows, sizes, fit_budget, timed_steps, family, cuda=zero_lab.placement(max(nds)).gpus > 0)


def _run(results, rows, sizes, fit_budget, timed_steps, family=(FIT_DEPTHS, FIT_WIDTHS), cuda: bool | None = None) -> Run:
    """cuda: whether the ranks ran on GPUs (default: where zero_lab.placement() puts them)."""
    cuda = zero_lab.placement().gpus > 0 if cuda is None else cuda
    config = dict(rows={r: {k: str(v) for k, v in row_options(r).items()} for r in rows},
                  sizes={s: asdict(SIZES[s]) for s in sizes}, micro_batch=MICRO_BATCH, param_dtype=str(PARAM_DTYPE),
                  optimizer=f"AdamW {ADAMW}", fit_budget_bytes=fit_budget, fit_depths=family[0],
                  fit_widths=family[1], timed_steps=timed_steps, figures_of="rank 0")
    return Run(machine(), CUDA_MEASUREMENT if cuda else CPU_MEASUREMENT, config, results)


def save(run: Run, path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(asdict(run), indent=1, default=str))
    return path


def load(path) -> Run:
    data = json.loads(Path(path).read_text())
    data["results"] = {int(nd): rows for nd, rows in data["results"].items()}
    return Run(**data)


def _mb(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.2f}"


def memory_table(run: Run) -> str:
    """Measured model states and peak against the formula, per row, size and Nd (MiB, rank 0)."""
    lines = [f"measurement: {run.measurement}; machine: {run.machine['cpu']}, {run.machine['accelerator']}",
             f"{'row':>16} {'size':>4} {'Nd':>3} {'psi':>9} {'formula':>8} {'states':>8} {'/formula':>9} "
             f"{'+act':>8} {'peak':>8} {'peak RSS':>9}   MiB per rank (+act: formula + activations)"]
    for nd, rows in run.results.items():
        for row, result in rows.items():
            if "unavailable" in result:
                lines.append(f"{row:>16} {'':>4} {nd:>3}  {result['unavailable']}")
                continue
            for size, f in result["sizes"].items():
                expected = sum(f["formula"].values())
                states = sum(f.get("model_states", {}).values()) or None
                ratio = f"{states / expected:9.4f}" if states else f"{'-':>9}"
                lines.append(f"{row:>16} {size:>4} {nd:>3} {f['psi']:>9,} {_mb(expected):>8} {_mb(states):>8} "
                             f"{ratio} {_mb(expected + f['activations']):>8} {_mb(f['peak']):>8} "
                             f"{_mb(f.get('peak_rss')):>9}")
    return "\n".join(lines)


def placement_table(run: Run) -> str:
    """Offload's model states by where they live, measured against 2Ψ (device) and 16Ψ/Nd (host)."""
    lines = [f"{'row':>16} {'size':>4} {'Nd':>3} {'device':>8} {'2Ψ':>8} {'host':>8} {'16Ψ/Nd':>8}   MiB per rank"]
    for nd, rows in run.results.items():
        for row, result in rows.items():
            for size, f in result.get("sizes", {}).items():
                if "placement" in f:
                    measured, formula = f["placement"], f["placement_formula"]
                    lines.append(f"{row:>16} {size:>4} {nd:>3} {_mb(measured['device']):>8} {_mb(formula['device']):>8} "
                                 f"{_mb(measured['host']):>8} {_mb(formula['host']):>8}")
    return "\n".join(lines) if len(lines) > 1 else "no offload row in this run"


def residual_table(run: Run, size: str) -> str:
    """peak - formula, by part (MiB, rank 0), for one model size."""
    parts = None
    lines = []
    for nd, rows in run.results.items():
        for row, result in rows.items():
            residual = result.get("sizes", {}).get(size, {}).get("residual")
            if residual is None:
                continue
            if parts is None:
                parts = list(residual)
                lines.append(f"{'row':>16} {'Nd':>3} " + " ".join(f"{p[:12]:>12}" for p in parts) + "   MiB")
            lines.append(f"{row:>16} {nd:>3} " + " ".join(f"{_mb(residual[p]):>12}" for p in parts))
    return "\n".join(lines) or "no residual (needs the CPU peak RSS of Linux or a GPU)"


def throughput_table(run: Run, size: str) -> str:
    lines = [f"{'row':>16} {'Nd':>3} {'step ms':>8} {'tokens/s':>9} {'bytes/step':>11} {'formula':>11} {'ratio':>6}"]
    for nd, rows in run.results.items():
        for row, result in rows.items():
            f = result.get("sizes", {}).get(size)
            if f is None:
                continue
            ratio = f"{f['sent_bytes'] / f['comm_formula']:6.3f}" if f["comm_formula"] else f"{'-':>6}"
            lines.append(f"{row:>16} {nd:>3} {f['step_ms']:>8.1f} {f['tokens_per_s']:>9,.0f} "
                         f"{f['sent_bytes']:>11,.0f} {f['comm_formula']:>11,.0f} {ratio}")
    lines.append("step ms: median of the timed steps on rank 0; wall-clock, noisy on a shared machine")
    return "\n".join(lines)


def fit_table(run: Run) -> str:
    budget = run.config["fit_budget_bytes"]
    lines = [f"budget {_mb(budget)} MiB per rank; measured: largest (depth, width) of the GPT family that "
             "completes a step under it; formula: the largest model whose model states alone fit (predicted_fit)",
             f"{'row':>16} {'Nd':>3} {'measured psi':>13} {'(depth, width)':>15} {'formula psi':>12}"]
    for nd, rows in run.results.items():
        for row, result in rows.items():
            if "fit" not in result:
                continue
            fit = result["fit"]
            predicted = predicted_fit(row, budget, nd, run.measurement == CUDA_MEASUREMENT)
            shape = "-" if fit is None else f"({fit['depth']}, {fit['width']})"
            lines.append(f"{row:>16} {nd:>3} {fit['psi'] if fit else 0:>13,} {shape:>15} {predicted:>12,}")
    return "\n".join(lines)


def plot_memory(run: Run, size: str, ax=None):
    """Measured model states and peak against the formula over Nd, one colour per row."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(7, 4))[1]
    for index, row in enumerate(ROWS):
        series = [(nd, rows[row]["sizes"][size]) for nd, rows in run.results.items() if "sizes" in rows.get(row, {})]
        if not series:
            continue
        nds = [nd for nd, _ in series]
        color = f"C{index}"
        ax.plot(nds, [sum(f["formula"].values()) / 2**20 for _, f in series], "--", color=color, label=f"{row} formula")
        ax.plot(nds, [sum(f.get("model_states", f["formula"]).values()) / 2**20 for _, f in series], "o", color=color,
                label=f"{row} model states, measured")
        if series[0][1]["peak"] is not None:
            ax.plot(nds, [f["peak"] / 2**20 for _, f in series], "^-", color=color, alpha=0.5, label=f"{row} peak")
    ax.set_xlabel("Nd (ranks)")
    ax.set_ylabel("MiB per rank")
    ax.set_xticks(sorted(run.results))
    ax.set_title(f"GPT {size}: measured vs formula ({run.measurement.split(':')[0]})")
    ax.legend(fontsize=7, ncol=2)
    return ax


def plot_residual(run: Run, size: str, ax=None):
    """Stacked bars of peak - formula by part, one bar per (row, Nd)."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(9, 4))[1]
    bars = [(f"{row}\nNd={nd}", result["sizes"][size]["residual"]) for nd, rows in run.results.items()
            for row, result in rows.items() if result.get("sizes", {}).get(size, {}).get("residual")]
    for x, (_, residual) in enumerate(bars):
        up = down = 0.0
        for index, (part, value) in enumerate(residual.items()):
            value /= 2**20
            base = up if value >= 0 else down
            ax.bar(x, value, bottom=base, color=f"C{index}", label=part if x == 0 else None)
            up, down = (up + value, down) if value >= 0 else (up, down + value)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=7)
    ax.set_ylabel("MiB per rank (peak - formula)")
    ax.set_title(f"GPT {size}: what the formula leaves out")
    ax.legend(fontsize=7)
    return ax


def plot_fit(run: Run, ax=None):
    """Largest model that fits the budget over Nd: measured (solid) next to the formula (dashed)."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(7, 4))[1]
    budget = run.config["fit_budget_bytes"]
    for index, row in enumerate(ROWS):
        nds = [nd for nd, rows in run.results.items() if "fit" in rows.get(row, {})]
        if not nds:
            continue
        fits = [run.results[nd][row]["fit"] for nd in nds]
        ax.plot(nds, [f["psi"] / 1e6 if f else 0 for f in fits], "o-", color=f"C{index}", label=f"{row} measured")
        ax.plot(nds, [predicted_fit(row, budget, nd, run.measurement == CUDA_MEASUREMENT) / 1e6 for nd in nds], "--",
                color=f"C{index}", label=f"{row} formula")
    ax.set_xlabel("Nd (ranks)")
    ax.set_ylabel("largest model (M parameters)")
    ax.set_xticks(sorted(run.results))
    ax.set_title(f"Largest GPT under {_mb(budget)} MiB per rank")
    ax.legend(fontsize=7, ncol=2)
    return ax


def plot_runs(paths, size: str = "S"):
    """Several runs' JSON files side by side (e.g. a laptop's and a GPU node's), one panel each."""
    import matplotlib.pyplot as plt

    runs = [load(p) for p in paths]
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False)
    for ax, run in zip(axes[0], runs):
        plot_memory(run, size, ax)
        ax.set_title(f"{run.machine['cpu'][:30]} / {run.machine['accelerator'][:30]}\n{run.measurement.split(':')[0]}",
                     fontsize=9)
    fig.tight_layout()
    return fig


def report(run: Run) -> str:
    sizes = list(run.config["sizes"])
    parts = [memory_table(run), "", placement_table(run)]
    for size in sizes:
        parts += [f"\nresidual, GPT {size}:", residual_table(run, size)]
    parts += [f"\nthroughput and bytes, GPT {sizes[-1]}:", throughput_table(run, sizes[-1])]
    if run.config["fit_budget_bytes"] is not None:
        parts += ["", fit_table(run)]
    return "\n".join(parts)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nd", type=int, nargs="+", default=[1, 2, 4], help="world sizes to launch (not under torchrun)")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=[*ROWS, *NVME_ROWS])
    parser.add_argument("--sizes", nargs="+", default=["S", "M"], choices=list(SIZES))
    parser.add_argument("--fit-budget-mb", type=float, default=None, help="per-rank budget (MiB) for the fit search")
    parser.add_argument("--fit-depths", type=int, nargs="+", default=list(FIT_DEPTHS), help="n_layer candidates")
    parser.add_argument("--fit-widths", type=int, nargs="+", default=list(FIT_WIDTHS),
                        help="n_embd candidates, ascending multiples of 4 (the defaults suit CPU budgets)")
    parser.add_argument("--json", default="memory_vs_formula.json", help="where to write the run")
    args = parser.parse_args(argv)
    budget = None if args.fit_budget_mb is None else int(args.fit_budget_mb * 2**20)
    family = (tuple(args.fit_depths), tuple(args.fit_widths))
    if "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ:  # torchrun: this world size only
        zero_lab.init_distributed()
        if dist.get_rank() == 0:
            print(zero_lab.placement())
        results = run_rank(args.rows, args.sizes, budget, family=family)
        if dist.get_rank() == 0:
            run = _run({dist.get_world_size(): results}, args.rows, args.sizes, budget, 2, family)
        dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return
    else:
        print("; ".join(str(zero_lab.placement(nd)) for nd in args.nd))
        run = measure(tuple(args.nd), tuple(args.rows), tuple(args.sizes), args.fit_budget_mb, family=family)
    print(report(run))
    print(f"wrote {save(run, args.json)}")


if __name__ == "__main__":
    main()
