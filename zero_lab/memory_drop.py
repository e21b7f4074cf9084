# Generated from solutions/13_scale/13_scale.ipynb by `zero-lab build`: edit the notebook, not this file.

"""Why doesn't my memory drop? Five causes, each reproduced small on CPU and measured.

measure_step         one measured step on this rank: formula, counted states, activations, peak, residual, RSS
measure_runs         measure_step for several runs on every rank of an nd-rank world (zero_lab.launch): rank 0's figures
tracked_step         one step under torch's MemTracker (private API) and the memory ledger, on this rank
peak_parts           the predicted bytes at a rank's peak: the formula's model states and the residual's named parts
dominant_cause       which part of peak_parts is largest: the answer to "why doesn't my memory drop?"
tracker_vs_ledger    torch's MemTracker's categories next to the memory ledger's, row by row

Measured on CPU: the memory ledger (tensor bytes by category), saved-tensor hooks (activations) and the
process's resident memory (Linux VmRSS, VmHWM), read by lesson 07's step_memory.
"""

import gc

import torch
import torch.distributed as dist

import zero_lab
from zero_lab.benchmark import decompose_residual
from zero_lab.memory import model_states_per_device
from zero_lab.memory_ledger import CATEGORIES
from zero_lab.models import GPT, GPTConfig
from zero_lab.step_memory import _rss, step_memory, step_phases  # lesson 07's probe

PARAM_DTYPE = torch.bfloat16


def one_unit(module):
    """units= for stage 3 that makes no module a unit: the root alone, the whole model gathered at once."""
    return False


def gpt_config(n_layer=2, n_embd=64, block_size=64) -> GPTConfig:
    return GPTConfig(vocab_size=256, n_layer=n_layer, n_head=4, n_embd=n_embd, block_size=block_size)


def formula_bytes(psi: int, nd: int, stage: int) -> int:
    return int(sum(model_states_per_device(psi, nd, stage).values()))


def measure_step(config: GPTConfig, stage: int, rows: int, options: dict | None = None) -> dict:
    """On this rank: prepare GPT(config) at `stage` (bf16 parameters, AdamW), one step to create AdamW's state,
    then one step measured by lesson 07's step_memory. Returns psi, nd, stage, formula (the paper's model-state
    bytes, model_states_per_device), counted (the ledger's model states after backward), activations, peak,
    residual (decompose_residual's parts of peak - formula) and rss (the process: VmRSS and VmHWM after it)."""
    nd, rank = dist.get_world_size(), dist.get_rank()
    gc.collect()
    model, optimizer = zero_lab.prepare(GPT(config, seed=0), torch.optim.AdamW, stage=stage,
                                        param_dtype=PARAM_DTYPE, lr=1e-3, **(options or {}))
    psi = GPT(config).num_params()
    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, config.vocab_size, (2, rows, config.block_size), generator=generator)
               for _ in range(2)]
    for _, run in step_phases(model, optimizer, *batches[0]):
        run()
    figures = step_memory(model, optimizer, step_phases(model, optimizer, *batches[1]), torch.device("cpu"))
    formula = {k: float(v) for k, v in model_states_per_device(psi, nd, stage).items()}
    after_backward = next(s for s in reversed(figures["samples"]) if s["phase"] == "backward")
    result = dict(psi=psi, nd=nd, stage=stage, formula=sum(formula.values()),
                  counted=sum(after_backward[c] for c in CATEGORIES), activations=figures["activations"],
                  peak=figures["peak"], residual=decompose_residual(figures["samples"], formula, figures["peak"]),
                  rss=_rss())
    del model, optimizer, figures
    gc.collect()
    return result


def measure_runs(runs, nd: int, timeout: float = 120.0) -> list[dict]:
    """measure_step(*run) for each run of `runs` on every rank of an nd-rank world; rank 0's figures."""
    return zero_lab.launch(lambda: [measure_step(*run) for run in runs], nd, timeout=timeout)[0]


PARTS = ("model states", "activations", "gathered units", "gradient buckets", "fixed overheads")


def peak_parts(psi: int, n: int, stage: int, units: list[int], activations: int, fixed: int = 0,
               bucket_numel: int = 2**20) -> dict:
    """Predicted bytes at a rank's step peak, by PARTS (Exercise 5's contract above). Divisions are exact: a
    Fraction or a float is fine."""
    parameters = 2 * psi / (n if stage >= 3 else 1)
    gradients = 2 * psi / (n if stage >= 2 else 1)
    optimizer = 12 * psi / (n if stage >= 1 else 1)
    return {"model states": parameters + gradients + optimizer,
            "activations": activations,
            "gathered units": 2 * max(units) if stage == 3 else 0,
            "gradient buckets": 2 * min(bucket_numel, psi) if stage == 2 else 0,
            "fixed overheads": fixed}


def dominant_cause(parts: dict) -> str:
    """The part of peak_parts that holds the most bytes ("model states" on a tie with the largest other part):
    when it is not "model states", sharding them further barely moves the peak."""
    others = {name: nbytes for name, nbytes in parts.items() if name != "model states"}
    cause = max(others, key=others.get)
    return cause if others[cause] > parts["model states"] else "model states"


TRACKER_ROWS = {  # the ledger's categories -> MemTracker's (torch.distributed._tools.mem_tracker._MemRefType)
    "parameters": ("PARAM",),
    "gradients": ("GRAD",),
    "master_params + optimizer_states": ("OPT",),
    "not model states": ("BUFFER", "ACT", "TEMP", "OTH"),
}


def tracker_vs_ledger(tracker: dict[str, int], ledger: dict[str, int]) -> list[tuple[str, int, int, int]]:
    """Rows (name, ledger bytes, tracker bytes, tracker - ledger), one per TRACKER_ROWS entry in its order, then
    ("total", ...). tracker: MemTracker's bytes by its categories (names as in TRACKER_ROWS; "Total" ignored);
    ledger: the memory ledger's bytes by category. A row named "a + b" adds the ledger's a and b; the ledger
    has nothing that is not a model state."""
    rows = []
    for name, kinds in TRACKER_ROWS.items():
        mine = sum(ledger.get(category, 0) for category in name.split(" + "))
        theirs = sum(tracker.get(kind, 0) for kind in kinds)
        rows.append((name, mine, theirs, theirs - mine))
    mine, theirs = sum(row[1] for row in rows), sum(row[2] for row in rows)
    return rows + [("total", mine, theirs, theirs - mine)]


def tracked_step(config: GPTConfig, stage: int, rows: int = 4) -> dict:
    """On this rank: one step at `stage` (state created), then a second under torch's MemTracker (private:
    torch.distributed._tools.mem_tracker, may move). Returns the tracker's bytes by its categories after the
    step and at its peak, and the memory ledger's after the same step (gradients kept: no zero_grad)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from zero_lab.memory_ledger import model_state_bytes
    model, optimizer = zero_lab.prepare(GPT(config, seed=0), torch.optim.AdamW, stage=stage,
                                        param_dtype=PARAM_DTYPE, lr=1e-3)
    tokens = torch.randint(0, config.vocab_size, (2, rows, config.block_size), generator=torch.Generator().manual_seed(0))
    for repeat in range(2):
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            model(*tokens)[1].backward()
            optimizer.step()
        if repeat == 0:
            optimizer.zero_grad()

    def plain(snapshot):
        ((device, by_kind),) = snapshot.items()
        return {str(kind).split(".")[-1]: nbytes for kind, nbytes in by_kind.items()}
    return dict(tracker=plain(tracker.get_tracker_snapshot()), tracker_peak=plain(tracker.get_tracker_snapshot("peak")),
                ledger=dict(model_state_bytes(model, optimizer).bytes))
