# Generated from solutions/16_checkpoints/16_checkpoints.ipynb by `zero-lab build`: edit the notebook, not this file.

"""Checkpoints that outlive the world: ZeRO shards saved by N ranks, loaded by M.

Piece             which elements of which parameter a rank holds, and where they are in its shards
shard_pieces      a rank's pieces, from the flat buffers' (name, shape) lists and the world size
buffers_of        those lists for a ZeRO optimizer of stage 1, 2 (param groups) or 3 (units)
Read              one read of a load plan: elements of a saved rank's file into this rank's shards
load_plan         every read a rank of the new world makes, from the saved pieces and its own
read_pieces       carry out a plan through one bounded read buffer; the bytes read
save_resharded    every rank writes its shards; rank 0 writes their pieces last and renames the folder (the commit)
AsyncSave         the same save, its files written by a thread while training goes on; finish() commits
open_checkpoint   a finished checkpoint's metadata, its files checked (missing, truncated, corrupted: named)
load_resharded    every rank of any world size reads only the byte ranges its own shards need
load_state_dicts  the same from every saved rank's optimizer.state_dict() (zero_lab.prepare's optimizers)

The files are the same on every stage: per rank, one raw fp32 file per state (the master weights,
Adam's exp_avg and exp_avg_sq), its shards laid end to end, and a JSON file of its pieces and step
counts, the self-describing metadata torch.distributed.checkpoint keeps in its .metadata file.
"""

import hashlib
import json
import math
import os
import shutil
import warnings
from bisect import bisect_right
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch
import torch.distributed as dist

from zero_lab.shard_layout import ShardLayout


class Piece(NamedTuple):
    """Elements [start, start + numel) of parameter `name` (flattened), held at `offset` in a rank's shards."""

    name: str
    shape: tuple[int, ...]
    start: int  # first element of the flattened parameter in the piece
    numel: int  # > 0
    offset: int  # where the piece begins in the rank's shards, laid end to end in buffer order


def shard_pieces(buffers: list[list[tuple[str, tuple[int, ...]]]], world_size: int, rank: int) -> list[Piece]:
    """The pieces of every parameter that `rank`'s shards hold, in shard order (padding is no piece).

    buffers[b] lists the (name, shape) of flat buffer b's parameters in layout order; each buffer is
    cut by ShardLayout(its numel, world_size), and the rank's shards of all buffers are laid end to end.
    Work: in proportion to the parameters, never to their elements.
    """
    pieces, base = [], 0
    for params in buffers:
        layout = ShardLayout(sum(math.prod(shape) for _, shape in params), world_size)
        low, high = layout.shard(rank)
        at = 0  # where the parameter begins in the buffer
        for name, shape in params:
            first, last = max(at, low), min(at + math.prod(shape), high)
            if first < last:
                pieces.append(Piece(name, tuple(shape), first - at, last - first, base + first - low))
            at += math.prod(shape)
        base += layout.shard_numel
    return pieces


def parameter_names(model: torch.nn.Module) -> dict:
    """{parameter: its name}; a tied parameter takes its first name (named_parameters() lists it once)."""
    return {p: name for name, p in model.named_parameters()}


def buffers_of(optimizer) -> list[list[tuple[str, tuple[int, ...]]]]:
    """(name, shape) of each flat buffer's parameters: the param groups of stages 1 and 2, the units of stage 3."""
    names = parameter_names(optimizer.model)
    if optimizer.stage == 3:  # between steps a unit's parameters are empty tensors: the unit keeps their shapes
        return [[(names[p], tuple(shape)) for p, shape in zip(unit.params, unit.shapes)] for unit in optimizer.units]
    return [[(names[p], tuple(p.shape)) for p in group.params] for group in optimizer.groups]


class Read(NamedTuple):
    """numel elements from `offset` in saved rank `rank`'s file into this rank's shards at `to`."""

    rank: int
    offset: int
    to: int
    numel: int


def load_plan(saved: list[list[Piece]], wanted: list[Piece]) -> list[Read]:
    """The reads that fill `wanted` (this rank's pieces in the new world) from `saved` (saved[r]: rank r's pieces).

    Reads are ordered by `to`, each element read once; a read that continues the previous one in the same
    file and in the shards is merged into it. A wanted parameter the checkpoint lacks, saved with another
    shape, or not covered whole, raises ValueError naming it. Work: in proportion to the pieces, not the elements.
    """
    holders = defaultdict(list)
    for rank, pieces in enumerate(saved):
        for piece in pieces:
            holders[piece.name].append((rank, piece))
    reads = []
    for want in wanted:
        if not holders[want.name]:
            raise ValueError(f"{want.name} is not in the checkpoint: it was saved from another model")
        covered = 0
        for rank, piece in holders[want.name]:
            if piece.shape != want.shape:
                raise ValueError(f"{want.name} was saved with shape {piece.shape}, this model's is {want.shape}")
            first = max(want.start, piece.start)
            last = min(want.start + want.numel, piece.start + piece.numel)
            if first < last:
                reads.append(Read(rank, piece.offset + first - piece.start, want.offset + first - want.start,
                                  last - first))
                covered += last - first
        if covered != want.numel:
            raise ValueError(f"{want.name}: the checkpoint holds {covered} of the {want.numel} elements wanted")
    merged = []
    for read in sorted(reads, key=lambda r: r.to):
        last = merged[-1] if merged else None
        if last and last.rank == read.rank and last.offset + last.numel == read.offset and last.to + last.numel == read.to:
            merged[-1] = last._replace(numel=last.numel + read.numel)
        else:
            merged.append(read)
    return merged


def read_pieces(plan: list[Read], files: dict, put, buffer: torch.Tensor) -> int:
    """Carry out `plan` through `buffer` (1-D, the files' dtype); returns the bytes read.

    files[rank] is saved rank `rank`'s file, open for binary reading (element i at byte i * itemsize);
    put(to, values) copies the 1-D tensor `values` into this rank's shards from element `to` on.
    A read longer than the buffer goes through it in parts. A file that ends early raises ValueError
    naming it. Nothing but `buffer` is allocated.
    """
    itemsize, total = buffer.element_size(), 0
    window = memoryview(buffer.numpy()).cast("B")  # the buffer's own bytes, no copy
    for read in plan:
        done = 0
        while done < read.numel:
            count = min(buffer.numel(), read.numel - done)
            file = files[read.rank]
            file.seek((read.offset + done) * itemsize)
            got = file.readinto(window[:count * itemsize])
            if got != count * itemsize:
                raise ValueError(f"{getattr(file, 'name', read.rank)} ends early: {got} of {count * itemsize} bytes at "
                                 f"byte {(read.offset + done) * itemsize}")
            put(read.to + done, buffer[:count])
            done, total = done + count, total + got
    return total


MASTER = "master"  # the fp32 master weights; the other states are the inner optimizer's (AdamW: exp_avg, exp_avg_sq)
METADATA = "metadata.json"  # written last, by rank 0: a checkpoint without it is not finished


def _inner_params(optimizer) -> list[list]:
    """For each tensor of the inner optimizer, in its numbering (its state_dict's): the parameters whose steps it
    counts. Stages 1 and 2: one tensor per param group, its whole shard; stage 3: one per trainable parameter."""
    if optimizer.stage == 3:
        return [[p] for params in optimizer.group_params for p in params]
    return [group.params for group in optimizer.groups]


def describe(optimizer, world_size: int | None = None, rank: int | None = None) -> dict:
    """What makes a rank's shards readable by another world, for this optimizer's model at `world_size` (default
    its own) and `rank`: the buffers' (name, shape) lists and, for each tensor of the inner optimizer, where it
    starts in the rank's shards and the names of the parameters whose steps it counts."""
    world_size, rank = (optimizer.world_size, optimizer.rank) if world_size is None else (world_size, rank)
    buffers, names = buffers_of(optimizer), parameter_names(optimizer.model)
    begins, shards, base = {}, [], 0  # where each parameter begins in its buffer; each buffer's shard
    for b, params in enumerate(buffers):
        layout, at = ShardLayout(sum(math.prod(shape) for _, shape in params), world_size), 0
        for name, shape in params:
            begins[name] = (b, at)
            at += math.prod(shape)
        shards.append((base, *layout.shard(rank)))
        base += layout.shard_numel
    offsets = []
    for params in _inner_params(optimizer):
        b, begin = begins[names[params[0]]]
        base, low, high = shards[b]
        offsets.append(base + (min(max(begin, low), high) - low if optimizer.stage == 3 else 0))  # a slice or a shard
    return {"buffers": buffers, "offsets": offsets,
            "names": [[names[p] for p in params] for params in _inner_params(optimizer)]}


def _states(optimizer) -> list[tuple[torch.Tensor, int, list]]:
    """(inner optimizer tensor, its offset in this rank's shards, the parameters whose step it counts)."""
    tensors = [t for group in optimizer.optimizer.param_groups for t in group["params"]]
    return list(zip(tensors, describe(optimizer)["offsets"], _inner_params(optimizer)))


def _steps(layout: dict, inner_state: dict) -> dict[str, float]:
    """Each trainable parameter's step count, by name, from an inner optimizer's state_dict()["state"]."""
    steps = {}
    for index, names in enumerate(layout["names"]):
        state = inner_state.get(index, {})
        own = state.get("param_steps")  # lesson 03: a parameter skipped by some steps keeps its own count
        for i, name in enumerate(names):
            steps[name] = float(own[i] if own is not None else state.get("step", 0))
    return steps


def _segments(optimizer, key: str) -> list[tuple[int, torch.Tensor]]:
    """(offset in this rank's shards, 1-D tensor) that hold state `key`, in offset order."""
    if key == MASTER:
        offsets = [0]
        for buffer in optimizer.groups:
            offsets.append(offsets[-1] + buffer.layout.shard_numel)
        return [(offset, buffer.master) for offset, buffer in zip(offsets, optimizer.groups)]
    return sorted(((offset, optimizer.optimizer.state[t][key]) for t, offset, _ in _states(optimizer) if t.numel()),
                  key=lambda segment: segment[0])


def _parts(segments, to: int, numel: int):
    """(offset, view) of the tensors in `segments` that hold elements [to, to + numel): a run may cross buffers."""
    offsets = [offset for offset, _ in segments]
    while numel:
        offset, tensor = segments[bisect_right(offsets, to) - 1]
        count = min(numel, offset + tensor.numel() - to)
        if count <= 0:
            raise ValueError(f"element {to} of the shards is in none of its tensors (padding?)")
        yield to, tensor[to - offset:to - offset + count]
        to, numel = to + count, numel - count


def _put(segments):
    """put(to, values) for read_pieces: the values go into the tensors that hold those elements of the shards."""
    def put(to: int, values: torch.Tensor) -> None:
        for at, view in _parts(segments, to, values.numel()):
            view.copy_(values[at - to:at - to + view.numel()])

    return put


def _fill(optimizer, saved: list[list[Piece]], keys: list[str], steps: dict, options: list[dict], read) -> dict:
    """Fill this rank's masters and moments through read(key, plan, put) -> bytes, then its step counts, the
    param groups' options and the model's weights. Every rank calls it (stages 1 and 2 all-gather the weights)."""
    wanted = shard_pieces(buffers_of(optimizer), optimizer.world_size, optimizer.rank)
    _new_states(optimizer, keys[1:])
    figures = {"bytes_read": 0, "shard_bytes": 0, "reads": 0}
    for key in keys:
        pieces = wanted if key == MASTER else [p for p in wanted if p.name in steps]  # moments: trainable only
        plan = load_plan(saved, pieces)
        figures["bytes_read"] += read(key, plan, _put(_segments(optimizer, key)))
        figures["shard_bytes"] += sum(p.numel for p in pieces) * 4
        figures["reads"] += len(plan)
    _finish_load(optimizer, steps, options)
    return figures


def _new_states(optimizer, keys) -> None:
    """AdamW's states for a fresh optimizer (none before its first step), to be overwritten by a load."""
    for tensor, _, _ in _states(optimizer):
        state = optimizer.optimizer.state[tensor]
        state.setdefault("step", torch.tensor(0.0))
        for key in keys:
            state.setdefault(key, torch.zeros_like(tensor))


def _finish_load(optimizer, steps: dict, options: list[dict]) -> None:
    """After the masters and moments: each parameter's step count, the param groups' options, and the model's
    weights, which follow the masters (stage 3's shards; stages 1 and 2 all-gather their flat buffers)."""
    names = parameter_names(optimizer.model)
    for tensor, _, params in _states(optimizer):
        counts = [steps[names[p]] for p in params]
        state = optimizer.optimizer.state[tensor]
        state["step"] = torch.tensor(max(counts))  # as lesson 03 keeps them: the group's count, and each one's
        state.pop("param_steps", None)
        if len(set(counts)) > 1:
            state["param_steps"] = torch.tensor(counts)
    for group, saved_options in zip(optimizer.param_groups, options):
        group.update({k: type(group[k])(v) if isinstance(group.get(k), tuple) else v for k, v in saved_options.items()
                      if k != "params"})
    for buffer in optimizer.groups:
        if optimizer.stage == 3:
            if buffer.shard is not buffer.master:
                buffer.shard.copy_(buffer.master)
        else:
            dist.all_gather_single(buffer.flat_param, buffer.master.to(buffer.flat_param.dtype))


def _digest(path: str) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


@torch.no_grad()
def save_resharded(optimizer, folder) -> None:
    """Save a checkpoint into the new folder `folder`; every rank calls it, after a step (AdamW's states exist).

    Every rank writes its shards (one raw fp32 file per state) into `folder`.partial and hands its pieces, step
    counts and files' sizes and SHA-256 to rank 0, which writes metadata.json there once every rank is done,
    then renames the folder: a save cut short (a rank killed) leaves no `folder`, and earlier checkpoints as
    they were."""
    AsyncSave(optimizer, folder, in_background=False).finish()


class AsyncSave:
    """A save whose writing overlaps training: at construction (every rank, between two steps) this rank's
    states are copied to host memory, and a thread writes them into `folder`.partial; finish() (every rank,
    later: before the next save, or at the end) waits for the thread and commits as save_resharded does.
    The copy is the consistency point: the files hold the state after the step just taken, whatever the
    steps taken while they are written do to the live tensors."""

    def __init__(self, optimizer, folder, in_background: bool = True):
        self.optimizer, self.folder, self.partial = optimizer, os.fspath(folder), f"{os.fspath(folder)}.partial"
        if os.path.exists(self.folder):
            raise FileExistsError(f"{self.folder} exists: save each checkpoint into a new folder (the old one stays "
                                  "loadable)")
        if optimizer.rank == 0:  # what a save cut short left behind
            shutil.rmtree(self.partial, ignore_errors=True)
            os.makedirs(self.partial)
        dist.barrier()
        total = sum(buffer.layout.shard_numel for buffer in optimizer.groups)
        self.keys = [MASTER] + sorted({k for t, _, _ in _states(optimizer) for k, v in optimizer.optimizer.state.get(t, {}).items()
                                       if torch.is_tensor(v) and v.dim() and k != "param_steps"})
        shards = {}
        for key in self.keys:  # the copy to host memory: padding and frozen parameters' moments stay zero
            shards[key] = torch.zeros(total, dtype=torch.float32)
            for offset, tensor in _segments(optimizer, key):
                shards[key][offset:offset + tensor.numel()] = tensor
        layout = describe(optimizer)
        self.mine = {"pieces": [list(p) for p in shard_pieces(layout["buffers"], optimizer.world_size, optimizer.rank)],
                     "steps": _steps(layout, optimizer.optimizer.state_dict()["state"])}
        self.options = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        self.writer = ThreadPoolExecutor(1) if in_background else None
        self.written = self.writer.submit(self._write, shards) if in_background else None
        self.files = None if in_background else self._write(shards)

    def _write(self, shards: dict) -> dict:
        files = {}
        for key, values in shards.items():
            name, data = f"rank{self.optimizer.rank}.{key}.bin", memoryview(values.numpy()).cast("B")
            with open(os.path.join(self.partial, name), "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            files[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        return files

    def finish(self) -> None:
        """Wait for this rank's files, then commit: rank 0 writes metadata.json once every rank's files are written,
        and renames the folder. Every rank calls it."""
        if self.written is not None:
            self.files = self.written.result()
            self.writer.shutdown()
        everyone = [None] * self.optimizer.world_size if self.optimizer.rank == 0 else None
        dist.gather_object({**self.mine, "files": self.files}, everyone, dst=0)  # on rank 0: every rank has written
        if self.optimizer.rank == 0:
            with open(os.path.join(self.partial, METADATA), "w") as file:
                json.dump({"world_size": self.optimizer.world_size, "stage": self.optimizer.stage, "keys": self.keys,
                           "param_groups": self.options, "ranks": everyone}, file)
            os.replace(self.partial, self.folder)  # the commit: one rename
        dist.barrier()  # nobody returns before the checkpoint is whole


def open_checkpoint(folder, verify: bool = False) -> dict:
    """metadata.json of a finished checkpoint, its files checked: present and of their saved size (and with
    verify, their SHA-256: that reads every file whole). Refused with ValueError naming what is missing or damaged."""
    folder = os.fspath(folder)
    if not os.path.exists(os.path.join(folder, METADATA)):
        partial = f"{folder}.partial"
        held = sorted(os.listdir(partial)) if os.path.isdir(partial) else []
        raise ValueError(f"{folder} is not a finished checkpoint: its metadata.json, written once every rank has saved, "
                         "is missing" + (f"; {partial} holds only {', '.join(held) or 'nothing'} (a rank stopped while "
                                         "saving): load an earlier checkpoint" if os.path.isdir(partial) else ""))
    with open(os.path.join(folder, METADATA)) as file:
        metadata = json.load(file)
    for saved in metadata["ranks"]:
        for name, expected in saved["files"].items():
            path = os.path.join(folder, name)
            if not os.path.exists(path):
                raise ValueError(f"{path} is missing from the checkpoint")
            if os.path.getsize(path) != expected["bytes"]:
                raise ValueError(f"{path} is truncated or grew: {os.path.getsize(path):,} bytes, saved {expected['bytes']:,}")
            if verify and _digest(path) != expected["sha256"]:
                raise ValueError(f"{path} is corrupted: its SHA-256 is not the one saved with it")
    return metadata


@torch.no_grad()
def load_resharded(optimizer, folder, buffer_numel: int = 1 << 16, verify: bool = False) -> dict:
    """Load a save_resharded checkpoint of any world size into this rank's shards; every rank calls it.
    Returns {"bytes_read", "shard_bytes" (what this rank holds of the saved states), "reads", "buffer_bytes"}."""
    metadata = open_checkpoint(folder, verify)
    saved = [[Piece(name, tuple(shape), start, numel, offset) for name, shape, start, numel, offset in r["pieces"]]
             for r in metadata["ranks"]]
    buffer = torch.empty(buffer_numel, dtype=torch.float32)

    def read(key, plan, put):
        files = {rank: open(os.path.join(folder, f"rank{rank}.{key}.bin"), "rb") for rank in {r.rank for r in plan}}
        try:
            return read_pieces(plan, files, put, buffer)
        finally:
            for file in files.values():
                file.close()

    figures = _fill(optimizer, saved, metadata["keys"], metadata["ranks"][0]["steps"], metadata["param_groups"], read)
    return {**figures, "buffer_bytes": buffer.nbytes}


MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's, under the names torch.optim.AdamW's state dict gives them


def _boxes(shape, start: int, numel: int) -> list[tuple[list[int], list[int], int]]:
    """(offsets, sizes, elements) of the boxes that tile elements [start, start + numel) of a flattened tensor of
    `shape` (at most 2-D: a part of a row, whole rows, a part of a row), in order: DCP's chunks are boxes."""
    if len(shape) <= 1:
        return [([start], [numel], numel)]
    if len(shape) > 2:
        raise ValueError(f"a parameter of shape {tuple(shape)}: DCP chunks of more than 2 dimensions are not built here")
    row, boxes, at, end = shape[1], [], start, start + numel
    while at < end:
        r, c = divmod(at, row)
        if c or end - at < row:
            boxes.append(([r, c], [1, min(row - c, end - at)], min(row - c, end - at)))
        else:
            boxes.append(([r, 0], [(end - at) // row, row], (end - at) // row * row))
        at += boxes[-1][2]
    return boxes


def _sharded(shape, pieces: list[Piece], segments, rank: int):
    """A ShardedTensor of `shape` whose local shards are views of this rank's tensors: DCP reads and writes them."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    local = []
    for piece in pieces:
        at = piece.offset
        for offsets, sizes, count in _boxes(shape, piece.start, piece.numel):
            (_, view), = _parts(segments, at, count)
            local.append(Shard(view.view(sizes), ShardMetadata(offsets, sizes, f"rank:{rank}/cpu")))
            at += count
    if not local:  # an empty box at the far corner: a ShardedTensor without local shards looks for its device on
        # CUDA, and a box at another rank's offset would be taken for that rank's (DCP keys chunks by offset)
        local.append(Shard(segments[0][1].new_empty([0] * len(shape)), ShardMetadata(list(shape), [0] * len(shape),
                                                                                   f"rank:{rank}/cpu")))
    return ShardedTensor._init_from_local_shards(local, *shape)  # every rank calls it: it checks the boxes tile


def dcp_state_dict(optimizer) -> dict:
    """This rank's training state as torch.distributed.checkpoint takes it, with the keys FSDP2's
    get_state_dict(model, optimizer) gives: {"model": {name: ...}, "optim": {"state": {name: {"step",
    "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}}, each tensor a ShardedTensor of views of this rank's
    masters and moments (so dcp.save writes them and dcp.load fills them in place). Every rank calls it."""
    layout = describe(optimizer)
    shapes = {name: shape for buffer in layout["buffers"] for name, shape in buffer}
    pieces = defaultdict(list)
    for piece in shard_pieces(layout["buffers"], optimizer.world_size, optimizer.rank):
        pieces[piece.name].append(piece)
    names = parameter_names(optimizer.model)
    segments = {key: _segments(optimizer, key) for key in (MASTER, *MOMENTS)}
    steps = _steps(layout, optimizer.optimizer.state_dict()["state"])
    model = {name: _sharded(shapes[names[p]], pieces[names[p]], segments[MASTER], optimizer.rank)
             for name, p in optimizer.model.named_parameters(remove_duplicate=False)  # a tied weight under each name
             if names[p] in shapes}  # stages 1 and 2 leave frozen parameters to the model
    state = {name: {"step": torch.tensor(step), **{key: _sharded(shapes[name], pieces[name], segments[key], optimizer.rank)
                                                   for key in MOMENTS}} for name, step in steps.items()}
    groups = [{**{k: v for k, v in options.items() if k != "params"}, "params": [names[p] for p in params]}
              for options, params in zip(optimizer.param_groups, _group_params(optimizer))]
    return {"model": model, "optim": {"state": state, "param_groups": groups}}


def _group_params(optimizer) -> list[list]:
    """The trainable parameters of each param group."""
    if optimizer.stage == 3:
        return optimizer.group_params
    return [group.params for group in optimizer.groups]


def _quietly(call, *args, **kwargs):
    """call(...) without torch's FutureWarning that ShardedTensor is deprecated: it is the type of DCP that takes
    any boxes a rank holds, where a DTensor's Shard placement cuts each dimension into contiguous parts in rank
    order, as torch.chunk does: a flat piece that starts inside a row is no such part."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)
        return call(*args, **kwargs)


def save_dcp(optimizer, path) -> None:
    """dcp.save of this rank's training state (dcp_state_dict); every rank calls it, after a step."""
    import torch.distributed.checkpoint as dcp
    _quietly(dcp.save, _quietly(dcp_state_dict, optimizer), checkpoint_id=os.fspath(path))


@torch.no_grad()
def load_dcp(optimizer, path) -> None:
    """dcp.load into this rank's masters and moments, from a DCP checkpoint saved at any world size by save_dcp or by
    FSDP2 (dcp.save of get_state_dict(model, optimizer) with torch.optim.AdamW); every rank calls it."""
    import torch.distributed.checkpoint as dcp
    _new_states(optimizer, MOMENTS)
    state = _quietly(dcp_state_dict, optimizer)
    _quietly(dcp.load, state, checkpoint_id=os.fspath(path))  # the ShardedTensors' views: straight into the live tensors
    steps = {name: float(values["step"]) for name, values in state["optim"]["state"].items()}
    _finish_load(optimizer, steps, state["optim"]["param_groups"])


def load_state_dicts(optimizer, states: list) -> dict:
    """optimizer.load_state_dict(list) of stages 1-3: every saved rank's state_dict(), or its torch.save file's
    path (opened with mmap: only the bytes this rank needs are read), in rank order, at any world size; every
    rank calls it. The saved ranks' layouts follow from this optimizer's model and the saved world size."""
    if not getattr(optimizer, "reshardable", False):  # what the optimizer declares, not its class
        raise ValueError(f"{type(optimizer).__name__} loads its own rank's state_dict() at the same world size: "
                         "resharding (a list of state dicts) is built for stages 1-3 without offload, hpZ or Muon; "
                         "load a consolidated_state_dict() into any other setup")
    states = [torch.load(s, map_location="cpu", mmap=True, weights_only=True) if isinstance(s, (str, os.PathLike)) else s
              for s in states]
    world_size, numels = len(states), [buffer.layout.numel for buffer in optimizer.groups]
    for rank, state in enumerate(states):
        if (state.get("stage", optimizer.stage), state.get("rank"), state.get("world_size"), state.get("numels")) != (
                optimizer.stage, rank, world_size, numels):
            raise ValueError(f"state dict {rank} of the list is rank {state.get('rank')} of {state.get('world_size')} "
                             f"(stage {state.get('stage')}, buffers of {state.get('numels')} elements): give every saved "
                             f"rank's state dict, in rank order, saved from this model and param groups at stage "
                             f"{optimizer.stage} (buffers of {numels} elements)")
    layouts = [describe(optimizer, world_size, rank) for rank in range(world_size)]
    saved = [shard_pieces(layout["buffers"], world_size, rank) for rank, layout in enumerate(layouts)]
    inner = [state["optimizer"]["state"] for state in states]
    keys = [MASTER] + sorted({k for s in inner for values in s.values() for k, v in values.items()
                              if torch.is_tensor(v) and v.dim() and k != "param_steps"})

    def sources(rank: int, key: str) -> list[tuple[int, torch.Tensor]]:
        if key == MASTER:
            bases = [0]
            for master in states[rank]["masters"]:
                bases.append(bases[-1] + master.numel())
            return list(zip(bases, states[rank]["masters"]))
        return sorted(((offset, inner[rank][i][key]) for i, offset in enumerate(layouts[rank]["offsets"])
                       if i in inner[rank] and inner[rank][i][key].numel()), key=lambda segment: segment[0])

    def read(key, plan, put):
        segments, total = {rank: sources(rank, key) for rank in {r.rank for r in plan}}, 0
        for r in plan:
            for at, view in _parts(segments[r.rank], r.offset, r.numel):
                put(r.to + at - r.offset, view)
                total += view.nbytes
        return total

    options = [{k: v for k, v in group.items() if k != "params"} for group in states[0]["optimizer"]["param_groups"]]
    return _fill(optimizer, saved, keys, _steps(layouts[0], inner[0]), options, read)
