"""Lesson 06's link (zero_lab.host_link): the CUDA path's ordering, run on CPU with RecordingStreams in place of
CUDA's streams and events; the simulated path; CudaTimeline; benchmarks/link_overlap.py without a GPU."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from sharded_training import ADAMW, SIZES, mlp_batches, mlp_loss, weights
from zero_lab import launch
from zero_lab.data import shard_batch
from zero_lab.host_link import CudaTimeline, Link, RecordingStreams, Timeline, Transfer
from zero_lab.memory_ledger import TransferLedger
from zero_lab.models import MLP
from zero_lab.prepare import prepare

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "link_overlap.py"


def stand_in_link():
    streams = RecordingStreams()
    return Link(torch.device("cpu"), streams=streams), streams


def recorded(calls, stream):
    """The events recorded on `stream`, in order."""
    return [call[2] for call in calls if call[:2] == ("record", stream)]


def test_a_download_waits_for_its_producer_only_and_the_host_only_where_it_reads_it():
    link, streams = stand_in_link()
    source = torch.arange(6.0).to(torch.bfloat16)  # written by the device work queued just before
    down = link.to_host(source)
    assert isinstance(down, Transfer) and down.tensor.dtype == torch.bfloat16
    produced, copied = recorded(streams.calls, "compute"), recorded(streams.calls, "side")
    assert len(produced) == 1 and len(copied) == 1
    assert streams.calls == [("record", "compute", produced[0]), ("wait", "side", produced[0]),
                             ("record", "side", copied[0]), ("keep", "side")]  # the source is kept for the copy
    assert not down.ready() and down.done.id == copied[0]
    more = link.to_host(torch.ones(3))  # a second download: the first is still not waited for
    assert not any(call[0] in ("synchronize", "wait_stream") for call in streams.calls)
    assert not any(call[:2] == ("wait", "compute") for call in streams.calls), "the device never waits for a download"
    assert torch.equal(down.host_wait(), source) and streams.calls[-1] == ("synchronize", copied[0])
    assert not more.ready(), "the host waited for that copy only"


def test_a_download_given_its_producers_event_waits_for_that_event():
    link, streams = stand_in_link()
    produced = link.mark()  # after the producer was queued; later compute is queued after it
    link.to_host(torch.zeros(4), after=produced)
    assert [call for call in streams.calls if call[0] == "wait"] == [("wait", "side", produced.id)]
    assert recorded(streams.calls, "compute") == [produced.id], "no other event on the compute stream"


def test_an_upload_starts_at_once_and_only_its_reader_waits_for_it():
    link, streams = stand_in_link()
    free = link.mark()  # the destination's last reader was queued before this
    destination, source = torch.zeros(5, dtype=torch.bfloat16), torch.arange(5.0).to(torch.bfloat16)
    up = link.to_device(destination, source, after=free)
    other = link.to_device(torch.zeros(2), torch.ones(2), after=free)
    assert [call for call in streams.calls if call[0] == "wait"] == [("wait", "side", free.id)] * 2
    assert torch.equal(up.device_wait(), source)
    assert streams.calls[-1] == ("wait", "compute", up.done.id), "the reader waits for this upload"
    assert not any(call[:2] == ("wait", "compute") and call[2] == other.done.id for call in streams.calls)
    assert not any(call[0] in ("synchronize", "wait_stream") for call in streams.calls), "the host never waits"
    link.to_device(torch.zeros(2), torch.ones(2))  # by default: an event recorded now, after the last reader
    assert streams.calls[-4:-2] == [("record", "compute", streams.events - 1), ("wait", "side", streams.events - 1)]


def test_downloads_added_in_arrive_in_order_without_waiting_or_when_the_host_reads():
    link, streams = stand_in_link()
    host = torch.zeros(3)
    first = link.to_host(torch.full((3,), 1.0), add_to=host)
    second = link.to_host(torch.full((3,), 2.0), add_to=host)
    third = link.to_host(torch.full((2,), 4.0), add_to=host[:2])
    assert host.tolist() == [0, 0, 0], "nothing is read before it arrived"
    streams.complete(second.done)  # later copies first: added in only after the first, in order
    link.to_host(torch.zeros(1))
    assert host.tolist() == [0, 0, 0]
    streams.complete(first.done)
    link.to_host(torch.zeros(1))  # a later copy adds in what has arrived, without waiting
    assert host.tolist() == [3, 3, 3] and not any(call[0] == "synchronize" for call in streams.calls)
    link.wait_downloads()  # the host reads: waits for the rest
    assert host.tolist() == [7, 7, 3] and streams.calls[-1] == ("synchronize", third.done.id)
    assert link.arriving == []


def test_the_simulated_link_copies_at_once_and_counts_what_crosses():
    link = Link(torch.device("cpu"))
    assert link.streams is None and link.mark() is None
    host = torch.zeros(4)
    with TransferLedger() as moved:
        down = link.to_host(torch.ones(4, dtype=torch.bfloat16), add_to=host)
        assert down.ready() and host.tolist() == [1, 1, 1, 1], "added in at once"
        destination = torch.zeros(3, dtype=torch.bfloat16)
        up = link.to_device(destination, torch.arange(3.0).to(torch.bfloat16))
        assert up.ready() and destination.tolist() == [0, 1, 2] and up.device_wait() is destination
    assert moved.bytes == {"to_host": 8, "to_device": 6} and moved.calls == {"to_host": 1, "to_device": 1}


def _offload_on_the_stand_in(stage, stand_in):
    """Two steps of the offload optimizer, its link on the stand-in (or simulated); the stand-in's calls per phase."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    options = dict(bucket_numel=20) if stage == 2 else {}
    model, optimizer = prepare(MLP(SIZES, seed=0), torch.optim.AdamW, stage=stage, offload="cpu",
                               param_dtype=torch.bfloat16, **ADAMW, **options)
    streams = RecordingStreams() if stand_in else None
    optimizer.link = Link(torch.device("cpu"), streams=streams)
    calls = streams.calls if stand_in else []
    all_gather = dist.all_gather_single

    def logged_all_gather(*args, **kwargs):
        calls.append(("all_gather",))
        return all_gather(*args, **kwargs)

    dist.all_gather_single = logged_all_gather
    phases, untouched = [], []
    try:
        for batch in mlp_batches(2):
            start = len(calls)
            mlp_loss(model, shard_batch(batch, rank, world_size)).backward()
            untouched.append(all(not g.any() for g in optimizer.host_grads))
            middle = len(calls)
            optimizer.step()
            optimizer.zero_grad()
            phases.append((calls[start:middle], calls[middle:]))
    finally:
        dist.all_gather_single = all_gather
    return weights(model), phases, untouched


@pytest.mark.parametrize("stage", [2, 1])
def test_the_offload_optimizer_sends_gradients_during_backward_and_reads_them_in_step(stage):
    stand_in = launch(_offload_on_the_stand_in, 2, stage, True, timeout=60)
    simulated = launch(_offload_on_the_stand_in, 2, stage, False, timeout=60)
    for (w_stand_in, phases, untouched), (w_simulated, _, _) in zip(stand_in, simulated):
        assert all(torch.equal(w_stand_in[name], w_simulated[name]) for name in w_simulated)
        for backward, step in phases:
            everything = backward + step
            assert not any(call[0] == "wait_stream" for call in everything), "no copy waits for a whole stream"
            if stage == 2:  # each bucket's piece goes down during backward, and the host does not wait for it there
                downloads = recorded(backward, "side")
                assert len(downloads) >= 2 and not any(call[0] == "synchronize" for call in backward)
                assert all(untouched), "the host adds the pieces in when it reads them, in step()"
            else:  # stage 1 reduces and sends its gradient in step()
                downloads = [e for e in recorded(step, "side") if ("synchronize", e) in step]
                assert downloads and not recorded(backward, "side")
            waited = [call[1] for call in step if call[0] == "synchronize"]
            assert sorted(waited) == sorted(downloads), "the host waits for each download once, in step()"
            assert not any(call[:2] == ("wait", "compute") and call[2] in downloads for call in everything)
            uploads = [e for e in recorded(step, "side") if e not in downloads]
            gathers = [i for i, call in enumerate(step) if call == ("all_gather",)]
            assert len(uploads) == len(gathers) >= 1
            for upload, at in zip(uploads, gathers):  # each all-gather waits for its upload, after the last download
                assert ("wait", "compute", upload) in step[:at]
                assert step.index(("wait", "compute", upload)) > max(step.index(("synchronize", e)) for e in downloads)


def test_a_cuda_timeline_times_device_lanes_by_events_and_the_host_by_the_clock():
    streams = RecordingStreams()
    timeline = CudaTimeline(streams)
    assert streams.calls[:2] == [("record", "compute", 1), ("synchronize", 1)]  # both clocks start at the device's
    streams.clock = 2.0
    with timeline.span("device", "forward"):
        streams.clock = 7.0
    with streams.using(streams.new_stream()), timeline.span("link", "down"):
        streams.clock = 9.5
    with timeline.span("host", "update"):
        pass
    assert recorded(streams.calls, "side") == [4, 5], "a copy's span is recorded on the copy's stream"
    assert len(timeline.spans) == 1 and timeline.spans[0][:2] == ("host", "update")
    spans = timeline.read()
    assert spans[1:] == [("device", "forward", 0.002, 0.007), ("link", "down", 0.007, 0.0095)]
    assert ("synchronize", 5) in streams.calls and timeline.pending == []
    assert isinstance(Timeline().read(), list)


def test_the_link_records_its_copies_on_a_timeline():
    link, streams = stand_in_link()
    link.timeline = CudaTimeline(streams)
    link.to_host(torch.ones(2))
    link.to_device(torch.zeros(2), torch.ones(2))
    assert [(lane, label) for lane, label, *_ in link.timeline.read()] == [("link", "down"), ("link", "up")]


def test_link_overlap_benchmark():
    if torch.cuda.is_available():  # a quick, small run: the figures exist and are positive
        spec = importlib.util.spec_from_file_location("link_overlap", BENCHMARK)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        result = module.measure_link(size_mb=8, copies=2, matmuls=4, n=1024, repeats=1)
        assert all(v > 0 for v in result["ms"].values()) and set(result["overlap"]) == {"uploads", "downloads"}
        return
    run = subprocess.run([sys.executable, str(BENCHMARK)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.count("\n") == 1 and "needs a CUDA GPU" in run.stdout, run
