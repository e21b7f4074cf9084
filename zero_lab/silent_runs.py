"""Lesson 15's silent runs: training that runs, whose loss falls, and that is wrong, each modelled on a public
report. Lab bench, not an exercise: the lesson shows them under neutral labels ("run 1", ...) and its learners
diagnose them from what the canary saw (`zero_lab.canary.evidence_of`), not from this code, which is the answer
key: read it after your diagnosis.

SILENT          the runs, each named by its cause (a key of zero_lab.canary.SILENT_CAUSES)
labelled_runs   the silent runs and three correct ones, shuffled by a seed under neutral labels
cause_of        a labelled run's cause (None for a correct run)
"""

import dataclasses
import random

import torch
import torch.distributed as dist

from zero_lab.canary import (ADAMW, BASELINES, MUON, MUON_TOLERANCE, ReduceLedger, Setup, TwoExperts, adamw,
                             average_grads_, by_hand, loss_of, muon_and_adamw, row_losses)
from zero_lab.muon import split_params


def _step_with_ledger(model, optimizers, backward_all):
    """A data-parallel step written by hand: `backward_all(micro_batches)`, every gradient averaged (the ledger
    noting what each held), every optimizer steps."""
    ledger = ReduceLedger(model)

    def step(micro_batches):
        backward_all(micro_batches)
        average_grads_(model, ledger)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        return ledger.take()
    return model, step, optimizers


def _last_micro_batch_only(model):
    def backward_all(micro_batches):
        for micro_batch in micro_batches:
            model.zero_grad(set_to_none=True)  # each backward taken for a boundary, which resets the accumulator
            (loss_of(model, micro_batch) / len(micro_batches)).backward()
    return _step_with_ledger(model, [torch.optim.AdamW(model.parameters(), **ADAMW)], backward_all)


def _boundary_micro_batch_local(model):
    ledger, optimizer = ReduceLedger(model), torch.optim.AdamW(model.parameters(), **ADAMW)

    def step(micro_batches):
        for micro_batch in micro_batches[:-1]:
            (loss_of(model, micro_batch) / len(micro_batches)).backward()
        average_grads_(model, ledger)  # the all-reduce runs before the last micro-batch's gradient is in
        (loss_of(model, micro_batches[-1]) / len(micro_batches)).backward()
        optimizer.step()
        optimizer.zero_grad()
        return ledger.take()
    return model, step, [optimizer]


def _bf16_accumulation(model):
    def backward_all(micro_batches):
        sums = [torch.zeros_like(p, dtype=torch.bfloat16) for p in model.parameters()]
        for micro_batch in micro_batches:
            (loss_of(model, micro_batch) / len(micro_batches)).backward()
            for total, p in zip(sums, model.parameters()):
                total += p.grad  # the accumulator is bf16: each addition rounds to 8 significant bits
                p.grad.zero_()
        for total, p in zip(sums, model.parameters()):
            p.grad.copy_(total)
    return _step_with_ledger(model, [torch.optim.AdamW(model.parameters(), **ADAMW)], backward_all)


def _no_fp32_masters(model):
    model = model.to(torch.bfloat16)  # the upcast to fp32 that did not happen: the optimizer steps bf16 weights
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)

    def step(micro_batches):
        for micro_batch in micro_batches:
            (loss_of(model, micro_batch) / len(micro_batches)).backward()
        for p in model.parameters():
            grad = p.grad.float()
            dist.all_reduce(grad)
            p.grad = (grad / dist.get_world_size()).to(p.dtype)
        optimizer.step()
        optimizer.zero_grad()
    return model, step, [optimizer]


def _mean_of_micro_batches(model):
    def backward_all(micro_batches):
        for micro_batch in micro_batches:
            (loss_of(model, micro_batch) / len(micro_batches)).backward()
    return backward_all


def _muon_without_newton_schulz(model):
    matrices, others = split_params(model)
    # ns_steps=0: Muon's momentum, normalised, goes into the weights without being orthogonalised
    optimizers = [torch.optim.Muon(matrices, ns_steps=0, **MUON), torch.optim.AdamW(others, **ADAMW)]
    return _step_with_ledger(model, optimizers, _mean_of_micro_batches(model))


def _muon_on_flat_shards(model):
    # Muon's test "p.ndim >= 2", asked of flat shards (shape (0,) placeholders): no matrix qualifies, all go to
    # AdamW, so the run is the hand-written AdamW one where Muon was asked for
    return by_hand(model)


def _experts_left_stale(model):
    ledger, optimizer = ReduceLedger(model), torch.optim.AdamW(model.parameters(), **ADAMW)

    def step(micro_batches):
        for micro_batch in micro_batches:
            (loss_of(model, micro_batch) / len(micro_batches)).backward()
        for name, p in model.named_parameters():  # an unused expert takes part with zeros, so no rank hangs...
            ledger.entered(name, p.grad)
            grad = torch.zeros_like(p) if p.grad is None else p.grad
            dist.all_reduce(grad)
            if p.grad is not None:  # ...but a rank whose rows never reached it keeps None, and skips its update
                p.grad = grad / dist.get_world_size()
        optimizer.step()
        optimizer.zero_grad()
        return ledger.take()
    return model, step, [optimizer]


def _mean_over_own_valid_rows(model):
    def backward_all(micro_batches):
        own = torch.stack([valid for _, _, valid in micro_batches]).sum().clamp(min=1)  # this rank's count only
        for micro_batch in micro_batches:
            (row_losses(model, micro_batch).sum() / own).backward()
    return _step_with_ledger(model, [torch.optim.AdamW(model.parameters(), **ADAMW)], backward_all)


SILENT = [
    Setup("accumulator-reset", _last_micro_batch_only, adamw, report="allenai/open-instruct#1498"),
    Setup("reduced-before-last-micro-batch", _boundary_micro_batch_local, adamw, report="deepspeedai/DeepSpeed#7985"),
    Setup("low-precision-accumulation", _bf16_accumulation, adamw, report="deepspeedai/DeepSpeed#2768"),
    Setup("no-fp32-master-weights", _no_fp32_masters, adamw, report="huggingface/accelerate#3979"),
    Setup("orthogonalisation-skipped", _muon_without_newton_schulz, muon_and_adamw, MUON_TOLERANCE,
          report="deepspeedai/DeepSpeed#8441"),
    Setup("optimizer-chosen-by-shard-shape", _muon_on_flat_shards, muon_and_adamw, MUON_TOLERANCE,
          report="deepspeedai/DeepSpeed#8438"),
    Setup("update-skipped-without-local-gradient", _experts_left_stale, adamw, model=TwoExperts,
          report="deepspeedai/DeepSpeed#5008"),
    Setup("loss-normalised-per-rank", _mean_over_own_valid_rows, adamw, masked=True, report="pytorch/torchtitan#1842"),
]
_CORRECT = [setup for setup in BASELINES if setup.build in (by_hand,) or setup.masked or setup.tolerance == MUON_TOLERANCE]
_CAUSES = {setup.build: setup.name for setup in SILENT}


def labelled_runs(seed: int) -> list[Setup]:
    """The silent runs and three correct ones (by hand; rows masked; Muon), in an order drawn from `seed`, named
    "run 1", "run 2", ...: what the runs are is in their evidence, not in their names."""
    runs = SILENT + _CORRECT
    random.Random(seed).shuffle(runs)
    return [dataclasses.replace(setup, name=f"run {i}", report="") for i, setup in enumerate(runs, 1)]


def cause_of(setup: Setup) -> str | None:
    """The cause of a run of `labelled_runs` (a key of SILENT_CAUSES), None for a correct one."""
    return _CAUSES.get(setup.build)
