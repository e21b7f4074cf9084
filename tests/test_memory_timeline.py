"""zero_lab.memory_timeline: PyTorch's memory timeline of a block, as files its viewer opens.
The CPU half runs the profiler for real; the CUDA half runs on stand-ins for the allocator's history."""

import base64
import contextlib
import pickle
import re

import pytest
import torch

from zero_lab.memory_timeline import recorded

MIB = 2**20


def test_the_cpu_trace_replays_to_the_peak_of_the_tensors_alive_at_once(tmp_path):
    with recorded("cpu") as timeline:
        first = torch.ones(MIB // 4)  # 1 MiB of fp32
        second = torch.ones(MIB // 2)  # 2 MiB: 3 alive
        del first
        third = torch.ones(MIB // 4)  # 1 MiB in the freed space: still 3 alive
        del second, third
    assert 3 * MIB <= timeline.peak_bytes() < 3 * MIB + 64 * 1024
    html, raw = timeline.save(tmp_path / "timelines" / "step")
    snapshot = pickle.loads(raw.read_bytes())
    assert snapshot == timeline.snapshot
    alloc = [e for e in snapshot["device_traces"][0] if e["action"] == "alloc" and e["size"] == 2 * MIB]
    assert alloc and any("test_the_cpu_trace" in frame["name"] for frame in alloc[0]["frames"])
    embedded = re.search(r'"base64": "([^"]+)"', html.read_text()).group(1)  # the viewer's page carries it
    assert pickle.loads(base64.b64decode(embedded)) == snapshot


def test_the_timeline_is_read_after_its_block_and_only_on_cpu_or_cuda():
    with recorded("cpu") as timeline:
        with pytest.raises(RuntimeError, match="after its `with recorded"):
            timeline.peak_bytes()
    with pytest.raises(ValueError, match="'cuda' or 'cpu' only"):
        with recorded("meta"):
            pass


class StandInHistory:
    """torch.cuda.memory's recorder: what was switched on and off, and a snapshot to hand back."""

    def __init__(self):
        self.calls = []

    def record(self, enabled="all", max_entries=None):
        self.calls.append(enabled if enabled is None else ("on", max_entries))

    def snapshot(self, device=None):
        events = [dict(action="alloc", addr=0, size=512), dict(action="alloc", addr=512, size=1024),
                  dict(action="free_requested", addr=0, size=512), dict(action="free_completed", addr=0, size=512)]
        return {"device_traces": [events], "segments": []}


@pytest.mark.parametrize("fails", [False, True])
def test_on_cuda_the_allocators_history_is_switched_off_however_the_block_ends(monkeypatch, fails):
    history = StandInHistory()
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", history.record)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", history.snapshot)
    with pytest.raises(KeyError) if fails else contextlib.nullcontext():
        with recorded("cuda", max_entries=10) as timeline:
            if fails:
                raise KeyError("the step failed")
    assert history.calls == [("on", 10), None]
    if not fails:
        assert timeline.peak_bytes() == 1536
