# Generated from solutions/15_flight_recorder/15_flight_recorder.ipynb by `zero-lab build`: edit the notebook, not this file.

"""Lesson 15, part 3: a canary for training that runs, whose loss falls, and that is wrong.

full_weights                  a model's whole parameters by name (any stage: stage 3 gathers them)
replicas_agree, update_error  the first two checks (exercises 3 and 4)
ReduceLedger, average_grads_  which micro-batches each gradient held when this rank entered its reduce
contribution_gaps             the third check (exercise 5): did every rank bring every micro-batch?
Canary                        a single-process shadow of each step, and both checks after it
Setup, BASELINES              the runs: correct ones through zero_lab.prepare and by hand (zero_lab.silent_runs:
                              the silent bugs, under neutral labels)
run_with_canary, evidence_of  train one Setup for some steps in a rank, the canary watching; what it saw, as data
SILENT_CAUSES                 the diagnosis vocabulary
"""

import copy
import math
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zero_lab.data import regression_batches, shard_batch
from zero_lab.models import MLP
from zero_lab.muon import split_params
from zero_lab.prepare import prepare

SIZES = [6, 16, 5]
GLOBAL_ROWS, MICRO_STEPS = 12, 2  # 12 rows split over 2 or 3 ranks, each rank's rows in 2 micro-batches
ADAMW = dict(lr=0.05, weight_decay=0.01)
MUON = dict(lr=0.05, weight_decay=0.01)  # torch.optim.Muon for the hidden matrices, AdamW (ADAMW) for the rest
# The canary's tolerance on an update's relative error (update_error), from the arithmetic of a correct run:
# fp32 sums in another order change a gradient by a few ulps (2^-23 ~ 1.2e-7 relative), and AdamW at most
# doubles a gradient's relative error into its update: 1e-4 leaves a factor of several hundred for the ulps of
# the shadow's own sums and optimizer state.
FP32_TOLERANCE = 1e-4
# Muon orthogonalises in bf16 (8 significant bits): a gradient one ulp away can move the bf16 rounding of a
# Newton-Schulz input by 2^-8 ~ 4e-3 of it, and the five iterations pass such changes on to the update, each
# iteration adding its own roundings: 2e-2 = 5 * 2^-8 allows one such rounding per iteration.
MUON_TOLERANCE = 2e-2


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter (not the buffers), whole and in fp32, by name: a DDP wrapper's "module." dropped,
    stage 3's shards gathered (its state_dict does that; every rank must call it)."""
    params = {name for name, _ in model.named_parameters()}
    return {name.removeprefix("module."): value.detach().float().clone()
            for name, value in model.state_dict().items() if name in params}


def replicas_agree(tensors: list[torch.Tensor]) -> list[int]:
    """The ranks whose `tensors` differ from what most ranks hold (a tie: from what rank 0 holds); [] if all agree."""
    position = torch.arange(1, sum(t.numel() for t in tensors) + 1, dtype=torch.float64)
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    mine = torch.stack([flat.sum(), (flat * position).sum()])  # a permutation changes the second
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    keys = [tuple(s.tolist()) for s in every]
    counts = Counter(keys)
    usual = max(counts, key=lambda key: (counts[key], key == keys[0]))
    return [rank for rank, key in enumerate(keys) if key != usual]


def update_error(before: dict, after: dict, shadow_after: dict) -> float:
    """The largest relative error, over the parameters, of the update a step made against the shadow's update."""
    worst = 0.0
    for name, start in before.items():
        made, expected = after[name] - start, shadow_after[name] - start
        error, size = (made - expected).norm().item(), expected.norm().item()
        if error:
            worst = max(worst, error / size if size else math.inf)
    return worst


class ReduceLedger:
    """What each gradient held when this rank entered its reduce, counted by hooks on the parameters (not by what
    the step code believes): `held` {name: backward passes in the current p.grad}, `entries` {name: held on entry}."""

    def __init__(self, model: torch.nn.Module):
        self.held, self.entries, self._grads = {}, {}, {}
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, name=name: self.accumulated(name, p))

    def accumulated(self, name: str, p: torch.Tensor) -> None:
        """After a backward added into p.grad: one more micro-batch in it, or the first in a new tensor."""
        same_tensor = self._grads.get(name) is p.grad
        self.held[name] = self.held.get(name, 0) + 1 if same_tensor else 1
        self._grads[name] = p.grad

    def entered(self, name: str, grad: torch.Tensor | None) -> None:
        """This rank enters `name`'s reduce with `grad`: what the hooks counted in it (0 if no backward reached it)."""
        self.entries[name] = self.held.get(name, 0) if grad is not None and grad is self._grads.get(name) else 0

    def take(self) -> dict[str, int]:
        """This step's entries; the next step starts a new ledger page."""
        entries, self.entries = self.entries, {}
        return entries


def average_grads_(model: torch.nn.Module, ledger: ReduceLedger) -> None:
    """Every gradient all-reduced and divided by the number of ranks, the ledger noting what each held on entry."""
    for name, p in model.named_parameters():
        ledger.entered(name, p.grad)
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def contribution_gaps(entries: dict[str, int], expected: int) -> dict[str, dict[int, int]]:
    """{gradient: {rank: micro-batches it held}} where a rank entered its reduce without exactly `expected`
    micro-batches in, or never entered it; {} when every rank brought every micro-batch. Every rank calls it."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, entries)
    gaps = {}
    for name in sorted({name for ledger in every for name in ledger}):
        short = {rank: ledger.get(name, 0) for rank, ledger in enumerate(every) if ledger.get(name, 0) != expected}
        if short:
            gaps[name] = short
    return gaps


def row_losses(model: torch.nn.Module, micro_batch) -> torch.Tensor:
    """Each row's squared error (mean over its outputs), 0 for the rows the micro-batch's mask leaves out."""
    x, y, valid = micro_batch
    return F.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y, reduction="none").mean(dim=1) * valid


def loss_of(model: torch.nn.Module, micro_batch) -> torch.Tensor:
    """The micro-batch's mean loss over its valid rows (all rows, in a run without a mask)."""
    return row_losses(model, micro_batch).sum() / micro_batch[2].sum().clamp(min=1)


class Canary:
    """Shadows each step in one process: the optimizer the run means to use, from the run's own weights before
    the step, on the global batch; then update_error against the shadow and replicas_agree across ranks."""

    def __init__(self, model: torch.nn.Module, make_optimizers, tolerance: float):
        self.shadow = copy.deepcopy(model).float()  # before the run touches the model (stage 3 shards it)
        self.optimizers = make_optimizers(self.shadow)
        self.tolerance = tolerance

    def _shadow_step(self, before: dict, micro_batches: list) -> tuple[float, dict]:
        with torch.no_grad():
            for name, p in self.shadow.named_parameters():
                p.copy_(before[name])
        self.shadow.zero_grad(set_to_none=True)
        # the global batch's mean over its valid rows: every valid row weighs the same, whichever rank holds it
        loss = sum(row_losses(self.shadow, mb).sum() for mb in micro_batches) / sum(mb[2].sum() for mb in micro_batches)
        loss.backward()
        for optimizer in self.optimizers:
            optimizer.step()
        return loss.item(), {name: p.detach().clone() for name, p in self.shadow.named_parameters()}

    def check(self, before: dict, after: dict, micro_batches: list, ledger: dict) -> dict:
        """The step that took `before` to `after`; micro_batches: every rank's, of this step; ledger: this rank's
        ReduceLedger entries of the step ({} for a run that keeps none). Every rank calls it."""
        loss, shadow_after = self._shadow_step(before, micro_batches)
        error, odd_ranks = update_error(before, after, shadow_after), replicas_agree(list(after.values()))
        gaps = contribution_gaps(ledger, MICRO_STEPS)
        return {"loss": loss, "update_error": error, "odd_ranks": odd_ranks, "ledger_gaps": gaps,
                "flagged": error > self.tolerance or bool(odd_ranks) or bool(gaps)}


class TwoExperts(torch.nn.Module):
    """A trunk and two experts: a row goes to expert 1 only if its first feature exceeds 1 (about one row in six)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.trunk = torch.nn.Linear(SIZES[0], SIZES[1])
            self.experts = torch.nn.ModuleList(torch.nn.Linear(SIZES[1], SIZES[-1]) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, rare = torch.relu(self.trunk(x)), x[:, 0] > 1.0
        out = self.experts[0](h)
        if rare.any():  # expert 1 runs only on the rows routed to it: on no row, it has no gradient
            out = out.clone()
            out[rare] = self.experts[1](h[rare])
        return out


@dataclass(frozen=True)
class Setup:
    """One run: `build(model)` makes it in a rank and returns (the model to read weights from, step, the optimizers
    it steps), where step(micro_batches) is one optimizer step on this rank's micro-batches (x, y, valid rows),
    returning its ReduceLedger's entries (None for a run without a ledger); `optimizers(model)` is what the run
    means to do, for the shadow. `masked`: some rows of each micro-batch do not count (as padding or prompt tokens
    do not), so the ranks hold different numbers of valid rows."""

    name: str
    build: object
    optimizers: object
    tolerance: float = FP32_TOLERANCE
    model: object = field(default=lambda: MLP(SIZES, seed=0))
    masked: bool = False
    report: str = ""  # the public report it is modelled on


def adamw(model):
    return [torch.optim.AdamW(model.parameters(), **ADAMW)]


def muon_and_adamw(model):
    matrices, others = split_params(model)
    return [torch.optim.Muon(matrices, **MUON), torch.optim.AdamW(others, **ADAMW)]


def accumulate_and_step(model, optimizers, micro_batches) -> None:
    """The ordinary loop: each micro-batch's loss / their number, backward, then every optimizer steps."""
    for micro_batch in micro_batches:
        (loss_of(model, micro_batch) / len(micro_batches)).backward()
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


def prepared(stage: int, optimizer_class=torch.optim.AdamW, **options):
    """A correct run: zero_lab.prepare at `stage`, the ordinary loop."""
    def build(model):
        model, optimizer = prepare(model, optimizer_class, stage=stage, **options)
        return model, lambda micro_batches: accumulate_and_step(model, [optimizer], micro_batches), [optimizer]
    return build


def by_hand(model):
    """A correct run written by hand: accumulate the micro-batches, average every gradient (the ledger noting
    each), step."""
    ledger, optimizer = ReduceLedger(model), torch.optim.AdamW(model.parameters(), **ADAMW)

    def step(micro_batches):
        for micro_batch in micro_batches:
            (loss_of(model, micro_batch) / len(micro_batches)).backward()
        average_grads_(model, ledger)
        optimizer.step()
        optimizer.zero_grad()
        return ledger.take()
    return model, step, [optimizer]


def token_mean_by_hand(model):
    """A correct run with a mask: each rank's loss is its valid rows' sum over the global number of valid rows (one
    all-reduce of a count), times the number of ranks, which the average of the gradients divides out again."""
    ledger, optimizer = ReduceLedger(model), torch.optim.AdamW(model.parameters(), **ADAMW)

    def step(micro_batches):
        valid = torch.stack([valid for _, _, valid in micro_batches]).sum()
        dist.all_reduce(valid)
        for micro_batch in micro_batches:
            (row_losses(model, micro_batch).sum() * dist.get_world_size() / valid).backward()
        average_grads_(model, ledger)
        optimizer.step()
        optimizer.zero_grad()
        return ledger.take()
    return model, step, [optimizer]


BASELINES = [
    Setup("data parallel by hand", by_hand, adamw),
    Setup("rows masked, the global mean by hand", token_mean_by_hand, adamw, masked=True),
    Setup("stage 0 (DDP)", prepared(0, **ADAMW), adamw),
    Setup("stage 1", prepared(1, **ADAMW), adamw),
    Setup("stage 2", prepared(2, **ADAMW), adamw),
    Setup("stage 3", prepared(3, **ADAMW), adamw),
    Setup("stage 1, offload to the CPU", prepared(1, offload="cpu", **ADAMW), adamw),
    Setup("stage 1, Muon", prepared(1, torch.optim.Muon, muon_sharding="gather", adamw=ADAMW, **MUON), muon_and_adamw,
          MUON_TOLERANCE),
]


def _train(setup: Setup, steps: int, seed: int) -> tuple[list[dict], torch.nn.Module, list, Canary]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = setup.model()
    canary = Canary(model, setup.optimizers, setup.tolerance)
    model, step, optimizers = setup.build(model)
    reports = []
    for x, y in regression_batches(steps, GLOBAL_ROWS, SIZES[0], SIZES[-1], seed=seed):
        valid = (x[:, -1] > -0.25).float() if setup.masked else torch.ones(len(x))  # about 60% of the rows count
        micro_batches = [list(zip(*(t.chunk(MICRO_STEPS) for t in shard_batch((x, y, valid), r, world_size))))
                         for r in range(world_size)]
        start = time.perf_counter()
        before = full_weights(model)
        ledger = step(micro_batches[rank])
        stepped = time.perf_counter()
        report = canary.check(before, full_weights(model), [m for ranks in micro_batches for m in ranks], ledger or {})
        valid_rows = [int(sum(mb[2].sum() for mb in ranks)) for ranks in micro_batches]
        reports.append(dict(report, valid_rows=valid_rows, step_s=stepped - start, canary_s=time.perf_counter() - stepped))
    return reports, model, optimizers, canary


def run_with_canary(setup: Setup, steps: int, seed: int = 1) -> list[dict]:
    """Train `setup` for `steps` steps in this rank, the canary checking each: one dict per step, Canary.check's
    with the valid rows of each rank, the seconds of the step (and of reading the weights before it) and of the
    canary's check."""
    return _train(setup, steps, seed)[0]


def _holdings(optimizers) -> dict[str, int]:
    """{optimizer class: how many parameters it steps}."""
    held = Counter()
    for optimizer in optimizers:
        held[type(optimizer).__name__] += sum(len(group["params"]) for group in optimizer.param_groups)
    return dict(sorted(held.items()))


def evidence_of(setup: Setup, steps: int, seed: int = 1) -> dict:
    """What an engineer on call has of a run, without its code: its configuration (the optimizers it was meant to
    use and those it steps, each with how many parameters it holds; its weights' dtype) and the canary's reports."""
    reports, model, optimizers, canary = _train(setup, steps, seed)
    return {"world_size": dist.get_world_size(), "micro_batches": MICRO_STEPS, "meant": _holdings(canary.optimizers),
            "optimizers": _holdings(optimizers), "weights_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "steps": [{key: report[key] for key in ("loss", "update_error", "odd_ranks", "ledger_gaps", "valid_rows",
                                                     "flagged", "step_s", "canary_s")} for report in reports]}


SILENT_CAUSES = {  # in alphabetical order; three fit none of the runs
    "accumulator-reset": "each micro-batch's backward reset the accumulated gradient: only the last reached the step",
    "learning-rate-not-scaled": "the learning rate was not adapted to the global batch size",
    "loss-normalised-per-rank": "each rank divided its loss by its own number of valid rows, not by the global number",
    "low-precision-accumulation": "the micro-batches' gradients were summed in 16 bits",
    "missing-average": "gradients were summed over ranks where they should have been averaged",
    "no-fp32-master-weights": "the optimizer updated 16-bit weights: there was no fp32 master copy",
    "optimizer-chosen-by-shard-shape": "which optimizer a parameter gets was decided from its flat shard's shape",
    "orthogonalisation-skipped": "Muon's update was applied without Newton-Schulz: its momentum, not orthogonalised",
    "reduced-before-last-micro-batch": "gradients were averaged before the last micro-batch's was added: it stayed local",
    "same-seed-every-rank": "every rank drew the same data",
    "update-skipped-without-local-gradient": "a rank without a local gradient for a parameter skipped its update",
}
