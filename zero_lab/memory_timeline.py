"""A memory timeline of a block of code, as a file PyTorch's memory viewer opens in a browser.

    with recorded(device) as timeline:
        ...one training step...
    timeline.peak_bytes()                   # the most bytes alive at once, replayed from the trace
    html, pickle = timeline.save("stage3")  # stage3.html (open it), stage3.pickle (pytorch.org/memory_viz)

Both halves are PyTorch's own tools, used as a cross-check of the memory ledger (which stays the
course's instrument):
  CUDA  the caching allocator's history: `torch.cuda.memory._record_memory_history` and `_snapshot`
        (every allocation and free on the device, with its Python stack), as in
        https://pytorch.org/docs/stable/torch_cuda_memory.html
  CPU   the profiler's allocation events (`torch.profiler.profile(profile_memory=True)`: address,
        size, the Python calls around it), written in the same snapshot format. Not through
        `torch.cuda._memory_viz.profile_plot`, which would add categories (parameter, gradient, ...)
        but fails now and then on a training step (AssertionError "version mismatch",
        https://github.com/pytorch/pytorch/issues/167838, open).
The snapshot format, the viewer and the event tree are private (leading underscore) and may move
between releases: written against torch 2.13. The HTML page loads PyTorch's viewer script from a CDN, so opening it needs internet;
offline, drop the .pickle on https://pytorch.org/memory_viz.
"""

from __future__ import annotations

import pickle
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.cuda import _memory_viz

MAX_ENTRIES = 200_000  # allocator events kept; one step of the course's models makes far fewer


class Timeline:
    def __init__(self):
        self.snapshot: dict | None = None  # filled when the block ends

    def _traces(self) -> list[list[dict]]:
        if self.snapshot is None:
            raise RuntimeError("the timeline is read after its `with recorded(...)` block ends")
        return self.snapshot["device_traces"]

    def peak_bytes(self) -> int:
        """The most bytes alive at once on one device, replayed from the trace (a block counts until
        its free completes: on CUDA a freed block still in use by a stream is not yet reusable)."""
        peak = 0
        for trace in self._traces():
            alive = 0
            for event in trace:
                if event["action"] == "alloc":
                    alive += event["size"]
                elif event["action"] == "free_completed":
                    alive -= event["size"]
                peak = max(peak, alive)
        return peak

    def save(self, stem: str | Path) -> tuple[Path, Path]:
        """Write STEM.html (the viewer with the snapshot inside) and STEM.pickle; return both paths."""
        stem = Path(stem)
        stem.parent.mkdir(parents=True, exist_ok=True)
        html, raw = stem.with_suffix(".html"), stem.with_suffix(".pickle")
        self._traces()  # refuses an unfinished timeline
        html.write_text(_memory_viz.trace_plot(self.snapshot), encoding="utf-8")
        raw.write_bytes(pickle.dumps(self.snapshot))
        return html, raw


@contextmanager
def recorded(device: torch.device | str, max_entries: int = MAX_ENTRIES):
    """Record every allocation and free on `device` (CUDA: the allocator; CPU: the profiler) while
    the block runs; the Timeline it yields is filled when the block ends."""
    device = torch.device(device)
    timeline = Timeline()
    if device.type == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=max_entries)
        try:
            yield timeline
            timeline.snapshot = torch.cuda.memory._snapshot(device)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
    elif device.type == "cpu":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                    with_stack=True) as profile:
            yield timeline
        timeline.snapshot = _profiled_snapshot(profile)
    else:
        raise ValueError(f"recorded(device={str(device)!r}): a timeline is recorded on 'cuda' or 'cpu' only")


def _profiled_snapshot(profile) -> dict:
    """The profiler's CPU allocations and frees as the allocator's snapshot format: one device trace
    (a free is a negative allocation at the same address), no segments."""
    from torch._C._profiler import _EventType

    allocations, stack = [], list(profile.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack += event.children
        if event.tag == _EventType.Allocation and event.extra_fields.alloc_size != 0:
            allocations.append(event)
    trace = []
    for event in sorted(allocations, key=lambda e: e.start_time_ns):
        size, frames, parent = event.extra_fields.alloc_size, [], event.parent
        while parent is not None:  # the Python calls around it, innermost first, as the viewer expects
            if parent.tag in (_EventType.PyCall, _EventType.PyCCall):
                frames.append({"filename": "", "line": 0, "name": parent.name})
            parent = parent.parent
        entry = {"addr": event.extra_fields.ptr, "size": abs(size), "stream": 0, "frames": frames}
        actions = ("alloc",) if size > 0 else ("free_requested", "free_completed")
        trace += [{"action": action, **entry} for action in actions]
    return {"device_traces": [trace], "segments": []}
