# Generated from solutions/12_muon/12_muon.ipynb by `zero-lab build`: edit the notebook, not this file.

"""Muon under ZeRO stage 3: whole matrices orthogonalised by an owner, everything else in stage 3's flat shards.

ns_work              Newton–Schulz work of one matrix, m·n·min(m, n) (per iteration, up to a constant)
MatrixPlan, plan_matrices, exchange_rounds
                     the plan: each matrix's owner (balancing ns_work) and how many of its elements each
                     rank's shard of its unit holds; the rounds of the exchange (one matrix per owner per round)
exchange_bytes, bytes_leaving, ns_loads, in_flight
                     what one step of the exchange sends per rank (the ledger's convention; what leaves it), the
                     Newton–Schulz work each rank does, the most elements a round moves for a rank
MuonZero3            the optimizer zero_lab.prepare(model, torch.optim.Muon, stage=3, adamw={...}) builds: lesson 05's
                     Zero3Optimizer with AdamW for the rest, and per round one all-to-all of the momentum directions
                     to the owners and one of the bf16 updates back to the shards
"""

import math
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.distributed as dist

from zero_lab.zero1 import ShardLayout
from zero_lab.zero3 import Zero3Optimizer

if __name__ != "__main__":  # in the package; in the notebook these names are your cells above
    from zero_lab.muon import (apply_update_, assign_owners, momentum_direction_, muon_and_adamw_params,
                               muon_defaults, newton_schulz)


def ns_work(shape) -> int:
    """Newton–Schulz work of a matrix of `shape` per iteration, up to a constant: m·n·min(m, n). (X Xᵀ on the
    short side m costs m²n multiply-adds, the Gram matrix squared m³, the update m²n: ns_flops of lesson 12.)"""
    rows, columns = shape
    return rows * columns * min(rows, columns)


@dataclass(frozen=True)
class MatrixPlan:
    """One matrix in the exchange: its shape, the rank that orthogonalises it, and sizes[r], the number of its
    elements in rank r's shard of its unit (they follow each other in rank order: the flattened matrix)."""

    shape: tuple[int, int]
    owner: int
    sizes: tuple[int, ...]


def plan_matrices(spans, world_size: int) -> list[MatrixPlan]:
    """spans[i] = (numel of matrix i's unit, where the matrix starts in the unit's flat buffer, its shape). The
    owners balance ns_work with assign_owners' rule (largest first, to the least loaded rank)."""
    owners = assign_owners([ns_work(shape) for _, _, shape in spans], world_size)
    plans = []
    for (unit_numel, offset, shape), owner in zip(spans, owners):
        layout, end = ShardLayout(unit_numel, world_size), offset + math.prod(shape)
        sizes = []
        for rank in range(world_size):
            start, stop = layout.shard(rank)
            sizes.append(max(0, min(end, stop) - max(offset, start)))
        plans.append(MatrixPlan(tuple(shape), owner, tuple(sizes)))
    return plans


def exchange_rounds(plans: list[MatrixPlan], world_size: int) -> list[list[int | None]]:
    """rounds[k][o]: the k-th matrix (in plan order) that rank o owns, None if it owns fewer than k + 1."""
    owned = [[i for i, plan in enumerate(plans) if plan.owner == rank] for rank in range(world_size)]
    return [[mine[k] if k < len(mine) else None for mine in owned] for k in range(max(map(len, owned)))]


MUON_OPTION_NAMES = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn")


class AdamWBesideMuon(torch.optim.AdamW):
    """MuonZero3's inner optimizer over stage 3's shard slices. Param group 0 is Muon's: its hyperparameters, the
    matrices' slices and their momentum (state "momentum_buffer", as torch.optim.Muon's); MuonZero3.muon_step steps
    it, since it needs the other ranks' pieces. AdamW steps the other groups (the embeddings, norms and biases)."""

    def __setstate__(self, state):
        """load_state_dict: Adam's own fix-up expects a step count in every state; Muon's holds its momentum alone."""
        muon = {p: state["state"].pop(p) for p in state["param_groups"][0]["params"] if p in state["state"]}
        super().__setstate__(state)
        self.state.update(muon)

    def step(self, closure=None):
        muon = self.param_groups.pop(0)
        try:
            return super().step(closure)
        finally:
            self.param_groups.insert(0, muon)


class MuonZero3(Zero3Optimizer):
    """ZeRO stage 3 with torch.optim.Muon for the hidden matrices and AdamW for the rest (lesson 12, part 2).

    zero_lab.prepare(model, torch.optim.Muon, stage=3, adamw={...}, lr=...) builds it. Every parameter lives in
    lesson 05's units and shards, and AdamW (adamw=: its options) steps the shards of the embeddings, norms and
    biases as Zero3Optimizer does. Each matrix has an owner (plan_matrices); its momentum stays in the ranks'
    shards (1/N). A step, one round at a time (exchange_rounds): the momentum and Nesterov direction of every
    piece, one all-to-all of the directions to their owners, Newton–Schulz of each whole matrix there, one
    all-to-all of the bf16 updates back, the update of every piece. Every matrix must get a gradient in every
    step (torch skips a matrix without one; not built here). units=, prefetch=, max_live_numel=, reshard_last=
    as Zero3Optimizer; fp32, all ranks. param_groups: Muon's, then AdamW's (a scheduler reaches both).
    """

    def __init__(self, model, optimizer_class=torch.optim.Muon, params=None, *, adamw=None, units=None,
                 prefetch: int = 1, max_live_numel: int | None = None, reshard_last: bool = True, param_dtype=None,
                 **options):
        if optimizer_class is not torch.optim.Muon:
            raise ValueError(f"MuonZero3 runs torch.optim.Muon, not {optimizer_class.__name__}")
        not_built = sorted(k for k, v in options.items() if k not in MUON_OPTION_NAMES and v not in (None, False))
        not_built += ["param_dtype"] if param_dtype not in (None, torch.float32) else []
        if not_built:
            raise TypeError(f"{not_built} are not built for Muon at stage 3 in this course (fp32, every rank, no "
                            "clipping, ZeRO++ or NVMe): leave them out")
        matrices, others = muon_and_adamw_params(model, params)
        muon = muon_defaults(**{k: v for k, v in options.items() if k in MUON_OPTION_NAMES})
        groups = [{"params": matrices, **muon}] + ([{"params": others, **(adamw or {})}] if others else [])
        super().__init__(model, AdamWBesideMuon, groups, units=units, prefetch=prefetch,
                         max_live_numel=max_live_numel, reshard_last=reshard_last)
        self.plans, self.slices, self.grads = self._plan()
        self.rounds = exchange_rounds(self.plans, self.world_size)

    def locate(self):
        """For each of Muon's matrices (self.group_params[0]), in order: its span in its unit, (unit numel, offset,
        shape) for plan_matrices; this rank's ShardSlice of it; the view of its unit's gradient shard on that slice."""
        spans, slices, grads = [], [], []
        for p in self.group_params[0]:
            unit = self.schedule.unit_of[p]
            index = next(k for k, q in enumerate(unit.params) if q is p)  # `is`: == on tensors compares values
            spans.append((unit.layout.numel, sum(s.numel() for s in unit.shapes[:index]), tuple(unit.shapes[index])))
            piece = next(s for s in unit.slices if s.param is p)
            slices.append(piece)
            grads.append(unit.grad_shard[piece.shard_offset:piece.shard_offset + piece.master.numel()])
        return spans, slices, grads

    def _plan(self):
        """The plan of the matrices at this world size (checked against this rank's slices), the slices, the views."""
        spans, slices, grads = self.locate()
        plans = plan_matrices(spans, self.world_size)
        for i, (plan, piece, (_, offset, shape)) in enumerate(zip(plans, slices, spans)):
            if plan.sizes[self.rank] != piece.master.numel() or sum(plan.sizes) != math.prod(shape):
                raise ValueError(f"plan_matrices: matrix {i} {shape} at element {offset} of a unit of {spans[i][0]}: "
                                 f"sizes {list(plan.sizes)}, but rank {self.rank}'s shard holds {piece.master.numel()} "
                                 f"of its {math.prod(shape)} elements")
        return plans, slices, grads

    def momentum(self, i: int) -> torch.Tensor:
        """The momentum of this rank's piece of matrix i (zeros before its first step, as torch.optim.Muon's)."""
        master = self.slices[i].master
        return self.state[master].setdefault("momentum_buffer", torch.zeros_like(master))

    @torch.no_grad()
    def muon_step(self) -> None:
        """Muon's step for every matrix, round by round: each rank's pieces (self.slices[i].master, the gradient
        self.grads[i], self.momentum(i)) sized by self.plans, each whole matrix orthogonalised by its owner."""
        g, rank = self.param_groups[0], self.rank
        for round_ in self.rounds:
            mine = round_[rank]  # the matrix I orthogonalise in this round (None: none)
            out_sizes = [self.plans[i].sizes[rank] if i is not None else 0 for i in round_]
            in_sizes = list(self.plans[mine].sizes) if mine is not None else [0] * self.world_size
            directions = [momentum_direction_(self.grads[i], self.momentum(i), g["momentum"], g["nesterov"])
                          for i in round_ if i is not None]  # in owner order, as out_sizes
            whole = self.grads[0].new_empty(sum(in_sizes))
            dist.all_to_all_single(whole, torch.cat(directions), in_sizes, out_sizes)
            ortho = whole.new_empty(0, dtype=torch.bfloat16)
            if mine is not None:  # the pieces arrive in rank order: the flattened matrix
                ortho = newton_schulz(whole.view(self.plans[mine].shape), g["ns_coefficients"], g["ns_steps"],
                                      g["eps"]).reshape(-1)
            updates = ortho.new_empty(sum(out_sizes))
            dist.all_to_all_single(updates, ortho, out_sizes, in_sizes)
            for i, update in zip(round_, updates.split(out_sizes)):
                if i is not None:
                    apply_update_(self.slices[i].master, update, self.plans[i].shape, g["lr"], g["weight_decay"],
                                  g["adjust_lr_fn"])

    @torch.no_grad()
    def step(self, closure=None):
        """Muon's step of the matrices (muon_step), then lesson 05's step, whose AdamW skips Muon's group."""
        if closure is not None:
            raise ValueError("stage 3 does not take a closure: compute the loss and call backward() before step()")
        self.muon_step()
        return super().step()

    def consolidated_state_dict(self, dst: int = 0) -> dict | None:
        """Lesson 05's, Muon's momentum included: lesson 05 takes a parameter as stepped when its state holds a 0-dim
        value (AdamW's step count); torch.optim.Muon's state is its momentum alone, so a marker stands in meanwhile."""
        for piece in self.slices:
            self.state[piece.master]["stepped"] = torch.zeros(())
        try:
            full = super().consolidated_state_dict(dst)
        finally:
            for piece in self.slices:
                del self.state[piece.master]["stepped"]
        for state in (full or {}).get("optimizer", {}).get("state", {}).values():
            state.pop("stepped", None)
        return full

    def load_state_dict(self, state) -> None:
        """This rank's state_dict() at the same world size, or a consolidated_state_dict()'s "optimizer" at any."""
        if isinstance(state, (list, tuple)):
            raise ValueError("resharding a list of every rank's state dicts (lesson 16) is built for element-wise "
                             "optimizers; Muon's momentum is element-wise too, but its plan (owners, rounds) belongs "
                             "to the new world size and lesson 16 reads only plain stage 1-3 layouts: save "
                             "consolidated_state_dict() and load its 'optimizer' part at any world size")
        super().load_state_dict(state)


def exchange_bytes(plans: list[MatrixPlan], world_size: int) -> list[Fraction]:
    """Bytes each rank sends in one step of the exchange, as the CommLedger charges an all-to-all ((N−1)/N of
    its input): per round, the fp32 directions of its pieces out, the bf16 update of its matrix back."""
    sent = [Fraction(0)] * world_size
    for round_ in exchange_rounds(plans, world_size):
        for rank in range(world_size):
            out = sum(plans[i].sizes[rank] for i in round_ if i is not None) * 4
            back = math.prod(plans[round_[rank]].shape) * 2 if round_[rank] is not None else 0
            sent[rank] += Fraction(world_size - 1, world_size) * (out + back)
    return sent


def bytes_leaving(plans: list[MatrixPlan], world_size: int) -> list[int]:
    """Bytes that really leave each rank in one step of the exchange: its pieces of the matrices others own
    (fp32), and the bf16 update of each matrix it owns to the other ranks that hold a piece of it."""
    sent = [0] * world_size
    for plan in plans:
        for rank, size in enumerate(plan.sizes):
            if rank != plan.owner:
                sent[rank] += size * 4
                sent[plan.owner] += size * 2
    return sent


def ns_loads(plans: list[MatrixPlan], world_size: int) -> list[int]:
    """Newton–Schulz work (ns_work) each rank does in one step: that of the matrices it owns."""
    loads = [0] * world_size
    for plan in plans:
        loads[plan.owner] += ns_work(plan.shape)
    return loads


def in_flight(plans: list[MatrixPlan], world_size: int) -> list[int]:
    """Per rank, the most elements one round's first all-to-all moves for it: its pieces of the round's matrices
    out, plus the whole matrix it owns in that round coming in."""
    peak = [0] * world_size
    for round_ in exchange_rounds(plans, world_size):
        for rank, mine in enumerate(round_):
            pieces = sum(plans[i].sizes[rank] for i in round_ if i is not None)
            peak[rank] = max(peak[rank], pieces + (math.prod(plans[mine].shape) if mine is not None else 0))
    return peak
