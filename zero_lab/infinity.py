# Generated from solutions/10_infinity/10_infinity.ipynb by `zero-lab build`: edit the notebook, not this file.

"""ZeRO-Infinity (Rajbhandari et al., SC'21, arXiv:2104.07857): NVMe as a third memory tier, SIMULATED.

The tier itself is nvme_tier.py (TokenBucket, NvmeTier); memory-centric tiling, tiled_linear.py.
tier_adamw_step   AdamW over master, exp_avg, exp_avg_sq kept on the tier, streamed chunk by chunk,
                  the next chunks' reads running while the current chunk is updated (§5.2)
Zero3Infinity     stage 3 with its shards and those states on the tier: prepare(..., stage=3, offload="nvme");
                  stream_step is its step, every trainable piece streamed through tier_adamw_step
put_partitioned, read_partitioned   bandwidth-centric partitioning (§6.1): every rank reads its own slice
                  of a parameter from its own tier, then one all-gather assembles the whole
"""
import errno
import math
import os
import shutil
import tempfile
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist

from zero_lab.cpu_adam import cpu_adam_
from zero_lab.optim import weak_hook
from zero_lab.zero1 import MASTER_DTYPE, clip_grad_norm_
from zero_lab.zero3 import UnitSchedule, Zero3Optimizer

if __name__ != "__main__":  # in the package; in the notebook NvmeTier is a cell below
    from zero_lab.nvme_tier import NvmeTier


STATES = ("master", "exp_avg", "exp_avg_sq")


def put_states(tier: NvmeTier, names: list[str], masters: list[torch.Tensor]) -> None:
    """Put each flat fp32 master on the tier as `<name>.master`, with zero `<name>.exp_avg` and `<name>.exp_avg_sq`."""
    for name, master in zip(names, masters):
        for state, value in zip(STATES, (master, torch.zeros_like(master), torch.zeros_like(master))):
            tier.write(f"{name}.{state}", value)


@torch.no_grad()
def tier_adamw_step(tier: NvmeTier, names: list[str], grads: list[torch.Tensor], step: int, *, lr: float,
                    betas: tuple[float, float], eps: float, weight_decay: float, chunk_numel: int,
                    prefetch: int = 1, on_update=None) -> None:
    """One AdamW step (torch.optim.AdamW's arithmetic) of the states put_states put on the tier; step counts from 1.

    Streams (master, exp_avg, exp_avg_sq) chunk_numel elements at a time, prefetch chunks' reads ahead
    in a background thread; host memory holds at most (prefetch + 1) chunks of the three. on_update(name,
    start, master), if given, sees each updated master chunk once it is written back (stage 3 copies it
    into the shard the model computes with).
    """
    chunks = [(name, grad.reshape(-1), start, min(chunk_numel, grad.numel() - start))
              for name, grad in zip(names, grads) for start in range(0, grad.numel(), chunk_numel)]

    def fetch(chunk):
        name, _, start, numel = chunk
        return [tier.read(f"{name}.{state}", start, numel) for state in STATES]

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvme-prefetch") as reader:
        pending = deque(reader.submit(fetch, chunk) for chunk in chunks[:prefetch])
        for i, chunk in enumerate(chunks):
            master, exp_avg, exp_avg_sq = pending.popleft().result() if prefetch else fetch(chunk)
            if prefetch and i + prefetch < len(chunks):
                pending.append(reader.submit(fetch, chunks[i + prefetch]))
            name, grad, start, numel = chunk
            cpu_adam_(master, grad[start:start + numel], exp_avg, exp_avg_sq, step, lr=lr, betas=betas, eps=eps,
                      weight_decay=weight_decay)
            for state, value in zip(STATES, (master, exp_avg, exp_avg_sq)):
                tier.write(f"{name}.{state}", value, start)
            if on_update is not None:
                on_update(name, start, master)


class TierSchedule(UnitSchedule):
    """Stage 3's schedule with the shards on the tier: load(unit) reads a shard before its all-gather (in
    a one-thread pool when prefetched, overlapping the current unit's compute) and release drops it again,
    so memory holds the shards of the units in flight only."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvme-params")
        self.load = None  # load(unit) fills unit.shard from the tier (Zero3Infinity sets it)

    def all_gather(self, unit, phase, async_op=False):
        """Read the unit's shard from the tier (self.load), then all-gather it (stage 3's own all_gather); with
        async_op, the read runs in self.reader and the returned handle's wait() ends it, then all-gathers."""
        if not async_op:
            self.load(unit)
            return super().all_gather(unit, phase)
        _resize(unit.flat)  # in flight from now on (is_gathered), as an all-gather started now would be
        return ReadThenGather(self.reader.submit(self.load, unit), partial(super().all_gather, unit, phase))

    def release(self, unit, phase) -> None:
        """Free the gathered unit (stage 3's own release), then drop the shard: the tier keeps it."""
        super().release(unit, phase)
        unit.shard.untyped_storage().resize_(0)


class ReadThenGather:
    """A prefetch's handle: the shard's read runs in the background; wait() ends it, then all-gathers (every rank
    waits on its prefetches in the same order, so the all-gathers still match)."""

    def __init__(self, read, gather):
        self.read, self.gather = read, gather

    def wait(self) -> bool:
        self.read.result()
        self.gather()
        return True


def _resize(tensor: torch.Tensor) -> None:
    """Give a tensor whose storage was freed (resized to 0) its bytes back."""
    tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())


def _drop(unit) -> None:
    """Free the memory of the unit's fp32 master and compute shard (one tensor in fp32): the tier keeps them."""
    for tensor in {id(unit.master): unit.master, id(unit.shard): unit.shard}.values():
        tensor.untyped_storage().resize_(0)


class Zero3Infinity(Zero3Optimizer):
    """ZeRO stage 3 with the parameters and AdamW's states on a SIMULATED NVMe tier (ZeRO-Infinity):
    zero_lab.prepare(model, torch.optim.AdamW, stage=3, offload="nvme", nvme_dir=..., ...) builds it.

    Every trainable parameter's slice of this rank's shard keeps its fp32 master, exp_avg and exp_avg_sq
    on the tier (12 bytes per element; 4 for the rest of the shard): the masters are the parameters'
    only copy. A gather reads the unit's shard from the tier first (TierSchedule: in the background when
    prefetched), a release drops it. step() streams the states through tier_adamw_step (stream_step),
    nvme_chunk_numel elements at a time, `prefetch` chunks read ahead. Memory keeps the gradient shards, the units in
    flight and a few chunks; checkpoints, state dicts and model.load_state_dict read the states back,
    one rank's shard at a time.

    nvme_dir        where the tier makes its directory (default: the system's temporary directory)
    nvme_bandwidth  bytes/s charged to every transfer of the tier (None: as fast as the files go)
    nvme_quota      the most bytes this rank's tier may hold (checked before anything is written)
    nvme_chunk_numel  elements per streamed chunk
    The tier's files have no name (NvmeTier): the OS frees them when this process ends, however it ends and
    whatever launched it; close(), or leaving `with optimizer:`, frees them at once.
    """

    reshardable = False  # its states live on the tier: lesson 16's resharding reads and writes device shards

    def __init__(self, model, optimizer_class=torch.optim.AdamW, params=None, *, nvme_dir=None,
                 nvme_bandwidth: float | None = None, nvme_quota: int | None = None, nvme_chunk_numel: int = 2**16,
                 **options):
        if optimizer_class is not torch.optim.AdamW:
            raise ValueError(f"the NVMe tier streams AdamW's states (tier_adamw_step): use torch.optim.AdamW, "
                             f"not {getattr(optimizer_class, '__name__', optimizer_class)}")
        for flag in ("amsgrad", "maximize"):
            if options.get(flag):
                raise ValueError(f"{flag}=True is not streamed from the tier: leave it False")
        self.schedule_class = TierSchedule
        super().__init__(model, optimizer_class, params, **options)
        self.chunk_numel, self.read_ahead = nvme_chunk_numel, self.schedule.prefetch
        self.group_of = {p: i for i, group in enumerate(self.param_groups) for p in group["params"]}
        self.pieces = {unit: [(f"u{i}.p{j}", piece) for j, piece in enumerate(unit.slices)]
                       for i, unit in enumerate(self.units)}
        self.rest = {unit: [(f"u{i}.r{j}", start, numel) for j, (start, numel) in enumerate(_uncovered(unit))]
                     for i, unit in enumerate(self.units)}
        directory = tempfile.gettempdir() if nvme_dir is None else nvme_dir
        self._check_space(directory, nvme_quota)
        self.tier = NvmeTier(directory, nvme_bandwidth, nvme_quota)
        try:
            for unit in self.units:
                put_states(self.tier, [name for name, _ in self.pieces[unit]],
                           [piece.master for _, piece in self.pieces[unit]])
                for name, start, numel in self.rest[unit]:
                    self.tier.write(f"{name}.master", unit.master[start:start + numel])
                _drop(unit)  # on the tier from now on
        except BaseException:
            self.close()
            raise
        self.schedule.load = weak_hook(self._load_shard)  # weak: the schedule must not keep its optimizer alive

    def _check_space(self, directory, quota) -> None:
        """Refuse before writing anything: a quota or a disk too small for this rank's states."""
        needed = sum(12 * piece.master.numel() for unit in self.units for piece in unit.slices) + \
            sum(4 * numel for rest in self.rest.values() for _, _, numel in rest)
        free = shutil.disk_usage(directory).free if os.path.isdir(directory) else None
        for limit, what, fix in ((quota, "nvme_quota", "a larger nvme_quota="),
                                 (free, f"the free space of {directory}", "another nvme_dir= or free some space")):
            if limit is not None and needed > limit:
                raise OSError(errno.ENOSPC, f"rank {self.rank}'s states need {needed:,} bytes on the tier (12 per "
                                            f"trained element of its shard, 4 per other), {what} is {limit:,}: "
                                            f"use {fix}, or more ranks")

    def close(self) -> None:
        """Free the tier's files now (when the process ends, the OS frees them anyway)."""
        if hasattr(self, "tier"):  # not if __init__ failed before making it
            self.schedule.reader.shutdown()
            self.tier.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _load_shard(self, unit) -> None:
        """Read the unit's shard from the tier into unit.shard (the schedule's loader: runs in its reader thread)."""
        _resize(unit.shard)
        for name, start, numel in self._segments(unit):
            self.tier.read_into(f"{name}.master", unit.shard[start:start + numel])

    @contextmanager
    def _states_in_memory(self, units=None, moments=False, write_back=False):
        """Inside: units' fp32 masters and shards (and with moments, AdamW's exp_avg, exp_avg_sq) in memory, as
        stage 3 keeps them; on exit with write_back the tier gets what they hold. Then memory drops what it read."""
        units, loaded = self.units if units is None else units, []
        for unit in units:
            if unit.master.untyped_storage().nbytes() == 0:  # on the tier only (a unit in flight has it)
                loaded.append(unit)
                _resize(unit.master)
                for name, start, numel in self._segments(unit):
                    self.tier.read_into(f"{name}.master", unit.master[start:start + numel])
                if unit.shard is not unit.master:
                    _resize(unit.shard)
                    unit.shard.copy_(unit.master)
            for name, piece in self.pieces[unit] if moments else ():
                state = self.optimizer.state.get(piece.master)
                if state:
                    for key in STATES[1:]:
                        state[key] = torch.empty_like(piece.master)
                        self.tier.read_into(f"{name}.{key}", state[key])
        try:
            yield
        finally:
            for unit in units:
                if write_back:
                    for name, start, numel in self._segments(unit):
                        self.tier.write(f"{name}.master", unit.master[start:start + numel])
                for name, piece in self.pieces[unit]:
                    state = self.optimizer.state.get(piece.master, {})
                    if write_back and moments:
                        for key in STATES[1:]:  # a parameter never stepped starts from zeros, as torch's
                            self.tier.write(f"{name}.{key}", state.get(key, torch.zeros_like(piece.master)))
                    for key in STATES[1:] if moments else ():
                        state.pop(key, None)
            for unit in loaded:
                _drop(unit)

    def _segments(self, unit):
        """(tier name, start, numel): where each part of the unit's shard is kept on the tier."""
        yield from ((name, piece.shard_offset, piece.master.numel()) for name, piece in self.pieces[unit])
        yield from self.rest[unit]

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step streamed from the tier (stream_step, Exercise 4), for the parameters that got a gradient."""
        if closure is not None:
            raise ValueError("stage 3 does not take a closure: compute the loss and call backward() before step()")
        grads = {unit: unit.grad_shard.to(MASTER_DTYPE) for unit in self.units if unit.grad_shard is not None}
        if self.max_grad_norm is not None:  # parameters without gradient have zeros there: the norm is the same
            self.last_grad_norm = clip_grad_norm_(list(grads.values()), [g.numel() for g in grads.values()],
                                                  self.max_grad_norm)
        stream_step(self, grads)

    # Leaving stage 3 reads the states back: each of these runs stage 3's own with them in memory.
    def _full_masters(self, unit):
        with self._states_in_memory([unit]):
            return super()._full_masters(unit)

    def _write_through(self, unit, full) -> None:
        with self._states_in_memory([unit], write_back=True):
            super()._write_through(unit, full)

    def state_dict(self) -> dict:
        with self._states_in_memory(moments=True):
            state = super().state_dict()
            saved = state["optimizer"]["state"]  # the optimizer's own dicts, which leaving the block empties
            state["optimizer"]["state"] = {index: dict(values) for index, values in saved.items()}
            return state

    def load_state_dict(self, state: dict) -> None:
        with self._states_in_memory(moments=True, write_back=True):
            super().load_state_dict(state)

    def consolidated_state_dict(self, dst: int = 0) -> dict | None:
        with self._states_in_memory(moments=True):
            return super().consolidated_state_dict(dst)

    def tier_bytes(self) -> int:
        """Bytes this rank keeps on the tier."""
        return 4 * sum(self.tier.numels.values())


def _uncovered(unit) -> list[tuple[int, int]]:
    """(start, numel) of the parts of the unit's shard no trainable parameter covers: frozen ones, padding."""
    gaps, at = [], 0
    for start, numel in sorted((piece.shard_offset, piece.master.numel()) for piece in unit.slices) + \
            [(unit.master.numel(), 0)]:
        if start > at:
            gaps.append((at, start - at))
        at = max(at, start + numel)
    return gaps


def stream_step(optimizer: "Zero3Infinity", grads: dict) -> None:
    """Zero3Infinity.step's AdamW step of every trainable piece, streamed from the tier through tier_adamw_step.

    grads: {unit: this rank's fp32 gradient shard of it}. A piece whose parameter got a gradient (unit.had_grad)
    takes one step with its own step count (kept where torch keeps it, optimizer.optimizer.state[piece.master])
    and its param group's hyperparameters; the others keep their states. Pieces that share a group and a step
    count stream through one call, so the reads run ahead across them; a shard in memory follows the update.
    """
    batches = {}  # (param group, step count) -> the names and gradients streamed in one call
    for unit, grad in grads.items():
        for name, piece in optimizer.pieces[unit]:
            if piece.param in unit.had_grad:
                state = optimizer.optimizer.state[piece.master]
                state["step"] = state.get("step", torch.tensor(0.0)) + 1
                key = (optimizer.group_of[piece.master], int(state["step"]))
                names, piece_grads = batches.setdefault(key, ([], []))
                names.append(name)
                piece_grads.append(grad[piece.shard_offset:piece.shard_offset + piece.master.numel()])
    in_memory = {name: unit.shard[piece.shard_offset:piece.shard_offset + piece.master.numel()]
                 for unit in grads if unit.shard.untyped_storage().nbytes() for name, piece in optimizer.pieces[unit]}

    def refresh(name, start, master):  # a unit in flight computes from its shard in memory: it follows the tier
        if name in in_memory:
            in_memory[name][start:start + master.numel()].copy_(master)

    for (index, step), (names, piece_grads) in batches.items():
        group = optimizer.param_groups[index]
        tier_adamw_step(optimizer.tier, names, piece_grads, step, lr=group["lr"], betas=group["betas"],
                        eps=group["eps"], weight_decay=group["weight_decay"], chunk_numel=optimizer.chunk_numel,
                        prefetch=optimizer.read_ahead, on_update=refresh)


def put_partitioned(tier: NvmeTier, name: str, tensor: torch.Tensor, group=None) -> None:
    """This rank's 1/N slice of `tensor` (flat, zero-padded to N * ceil(numel / N)) onto its own tier as `name`."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    shard = -(-tensor.numel() // world_size)
    flat = torch.zeros(shard * world_size)
    flat[:tensor.numel()] = tensor.detach().reshape(-1)
    tier.write(name, flat[rank * shard:(rank + 1) * shard])


def read_partitioned(tier: NvmeTier, name: str, shape, group=None) -> torch.Tensor:
    """The whole parameter of `shape`: this rank reads only its slice from its own tier, then one all-gather."""
    shard = tier.read(name)
    whole = torch.empty(dist.get_world_size(group) * shard.numel())
    dist.all_gather_single(whole, shard, group=group)
    return whole[:math.prod(shape)].view(shape)
