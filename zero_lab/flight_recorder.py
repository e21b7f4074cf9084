# Generated from solutions/15_flight_recorder/15_flight_recorder.ipynb by `zero-lab build`: edit the notebook, not this file.

"""Lesson 15: PyTorch's Flight Recorder dumps, read and lined up across ranks.

load_dumps           {rank: dump} from a folder of per-rank dump files
rank_stack           a recorded stack as "file:line in function" strings, the rank's own code only
Call, calls_of       one collective of one rank, in plain terms; all of a dump's
Mismatch             the first collective the ranks disagree on, as data
first_mismatch       find it
fake_dump            a dump in the recorder's format from a list of Calls (generated traces)
"""

import os
import pickle
import re
import sysconfig
from dataclasses import dataclass

import torch

DEFAULT_GROUP = "0"  # the default process group's name in the entries
# Frames that are not the rank's own code: torch, Python's library, and the lab bench's launcher and comm ledger.
LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep, sysconfig.get_paths()["stdlib"] + os.sep)
BENCH_FILES = (os.path.join("zero_lab", "launcher.py"), os.path.join("zero_lab", "comm_ledger.py"))


def load_dumps(folder) -> dict[int, dict]:
    """{rank: its unpickled dump} from the files of `folder`, whose names end with the rank."""
    dumps = {}
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as file:
            dumps[int(re.search(r"(\d+)$", name).group(1))] = pickle.load(file)
    return dict(sorted(dumps.items()))


def rank_stack(frames: list[dict]) -> tuple[str, ...]:
    """A recorded stack (innermost frame first) as "file:line in function", without torch's, Python's
    and the bench's frames; what a launched rank inherited from the parent (below `_rank_main`) is cut."""
    kept = []
    for frame in frames:
        path = frame["filename"]
        if frame["name"] == "_rank_main" and path.endswith(BENCH_FILES[0]):
            break
        if not path.startswith(LIBRARY_DIRS) and not path.endswith(BENCH_FILES):
            kept.append(f"{os.path.basename(path)}:{frame['line']} in {frame['name']}")
    return tuple(kept)


@dataclass(frozen=True)
class Call:
    """One collective one rank issued, as its Flight Recorder saw it."""

    group: str  # the process group's name: "0" is the default group
    seq: int  # its number among this group's collectives on this rank: 1, 2, ...
    op: str  # the operation, without the backend: "all_reduce", "all_gather", "barrier", ...
    sizes: tuple[tuple[int, ...], ...]  # the input tensors' shapes, e.g. ((8, 6),); () for a barrier
    done: bool  # it completed on this rank
    created_ns: int  # when the rank issued it (one clock per machine)
    stack: tuple[str, ...]  # rank_stack of the frames that issued it, innermost first


def fake_dump(calls: list[Call], keep: int | None = None) -> dict:
    """A dump in the Flight Recorder's format holding `calls` (its fields calls_of reads; gloo's pg_config); with
    `keep`, only the last `keep` of them, as a ring buffer of that size keeps them (record_id still counts them all)."""
    entries = []
    for record_id, call in enumerate(calls):
        frames = [dict(zip(("filename", "line", "name"), re.fullmatch(r"(.+):(\d+) in (.+)", where).groups()))
                  for where in call.stack]
        entries.append({"record_id": record_id, "process_group": (call.group, "default_pg" if call.group == "0" else "undefined"),
                        "collective_seq_id": call.seq, "profiling_name": f"gloo:{call.op}",
                        "input_sizes": [list(size) for size in call.sizes], "retired": call.done,
                        "state": "scheduled", "time_created_ns": call.created_ns,
                        "frames": [dict(frame, line=int(frame["line"])) for frame in frames], "is_p2p": False})
    return {"version": "2.10", "pg_config": {"": {"name": "", "desc": "", "ranks": "[]"}},
            "entries": entries[-keep:] if keep else entries}


def calls_of(dump: dict) -> list[Call]:
    """The collectives of one rank's dump, in the order it issued them."""
    return [Call(group=entry["process_group"][0], seq=entry["collective_seq_id"],
                 op=entry["profiling_name"].split(":", 1)[-1],
                 sizes=tuple(tuple(size) for size in entry["input_sizes"]), done=entry["retired"],
                 created_ns=entry["time_created_ns"], stack=rank_stack(entry["frames"]))
            for entry in dump["entries"]]


@dataclass(frozen=True)
class Mismatch:
    """The first collective the ranks disagree on."""

    kind: str  # "missing" (a rank never issued it), "group" (it did, in another group), "op" or "sizes"
    group: str
    seq: int
    calls: dict  # rank -> its Call at (group, seq), None for a rank of the group that issued none there
    waiting: tuple[int, ...]  # ranks whose call there never completed: blocked in it
    missing: tuple[int, ...]  # ranks of the group that never issued it: those the waiting ranks wait for


def first_mismatch(dumps: dict[int, dict]) -> Mismatch | None:
    """The first collective the ranks of `dumps` disagree on, or None if they agree on all they issued."""
    calls = {rank: calls_of(dump) for rank, dump in dumps.items()}
    lost_calls = {rank for rank, dump in dumps.items() if dump["entries"] and dump["entries"][0]["record_id"] > 0}
    at = {(c.group, c.seq, rank): c for rank, rank_calls in calls.items() for c in rank_calls}
    members = {DEFAULT_GROUP: set(dumps)}
    for group, _, rank in at:
        members.setdefault(group, set()).add(rank)
    found = []
    for group, ranks in members.items():
        held = {rank: [c.seq for c in calls[rank] if c.group == group] for rank in ranks}
        if any(not held[rank] for rank in ranks & lost_calls):
            continue  # a member's calls of this group all fell out of its buffer: nothing here can be compared
        first_covered = max([min(held[rank]) for rank in ranks & lost_calls], default=1)
        for seq in sorted({s for g, s, _ in at if g == group and s >= first_covered}):
            here = {rank: at.get((group, seq, rank)) for rank in sorted(ranks)}
            present = [c for c in here.values() if c is not None]
            if len(present) < len(here) or len({(c.op, c.sizes) for c in present}) > 1:
                found.append((min(c.created_ns for c in present), group, seq, here, present))
                break
    if not found:
        return None
    _, group, seq, here, present = min(found, key=lambda item: item[0])
    missing = tuple(rank for rank, c in here.items() if c is None)
    if missing:
        pending = [next((c for c in calls[rank] if not c.done), None) for rank in missing]
        elsewhere = any(p is not None and p.group != group and any((p.op, p.sizes) == (c.op, c.sizes) for c in present)
                        for p in pending)
        kind = "group" if elsewhere else "missing"
    else:
        kind = "op" if len({c.op for c in present}) > 1 else "sizes"
    waiting = tuple(rank for rank, c in here.items() if c is not None and not c.done)
    return Mismatch(kind, group, seq, here, waiting, missing)
