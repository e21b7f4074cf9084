# Generated from solutions/06_offload/06_offload.ipynb by `zero-lab build`: edit the notebook, not this file.

"""The host-device link of ZeRO-Offload (lesson 06): what crosses it, counted, and when.

Link               the host-device link: host buffers, copies across it (counted); on CUDA a side stream
Transfer           one copy across the link: the host waits for it (host_wait) or the device does (device_wait)
CudaStreams        the CUDA streams and events the Link uses; RecordingStreams: a CPU stand-in that records them
Timeline           spans of work per lane (device, host), wall clock; CudaTimeline: device lanes from CUDA events
offload_bucket     a reduced gradient bucket: this rank's piece goes down, to be added into the fp32 host shard
upload_shard       the updated shard goes up in 16 bits and is all-gathered on the device

Per step this rank's 16-bit gradient shard goes down (2 Psi / Nd bytes) and the updated 16-bit
parameter shard comes up (2 Psi / Nd bytes); without an accelerator the device is simulated in
CPU memory and every copy is still real and counted (zero_lab.memory_ledger.TransferLedger).
"""

import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from zero_lab.memory_ledger import record_transfer
from zero_lab.zero2 import Bucket


class Transfer:
    """One copy across the link, maybe still running. tensor: its destination; done: the event recorded after
    the copy on the link's stream (None: the copy is done already, as on the simulated device)."""

    def __init__(self, tensor: torch.Tensor, source: torch.Tensor, done=None, streams=None):
        self.tensor, self.source, self.done, self.streams = tensor, source, done, streams  # source: kept until done

    def ready(self) -> bool:
        """Whether the copy has run; never waits."""
        return self.done is None or self.done.query()

    def host_wait(self) -> torch.Tensor:
        """The host thread waits for this copy, and no other work, and gets the destination: call it where the host
        reads a download."""
        if self.done is not None:
            self.done.synchronize()
        return self.tensor

    def device_wait(self) -> torch.Tensor:
        """Device work queued from now on (on the current stream) waits for this copy; the host does not. Call it
        just before queuing the device work that reads an upload; returns the destination."""
        if self.done is not None:
            self.streams.current().wait_event(self.done)
        return self.tensor


class Link:
    """The host-device link: host buffers, and copies across the link, counted by direction.

    Without an accelerator the device is *simulated*: device tensors are ordinary CPU tensors that
    the optimizer reports to the memory ledger as device memory, and a copy across the link is a
    real copy, done when the call returns and counted the same way (zero_lab.memory_ledger.TransferLedger).

    On CUDA (streams: CudaStreams) host buffers are pinned (page-locked: the GPU's DMA engine reads them, so a
    copy can run while the GPU computes). Each copy is queued on the link's side stream and returns at once with
    a Transfer, ordered by CUDA events alone: it waits on the device for one event, `after` (by default one
    recorded on the current stream when the copy is asked for, after the work that wrote a download's source or
    last read an upload's destination); the host waits for a download only where it reads it
    (Transfer.host_wait, or wait_downloads for those sent with add_to); device work waits for an upload only
    where it reads it (Transfer.device_wait), and never for a download. That ordering is tested on CPU, with
    RecordingStreams in place of CudaStreams; the CUDA path has not been run or timed on a GPU in this course
    (benchmarks/link_overlap.py times it).
    """

    def __init__(self, device: torch.device, streams=None):
        self.device = torch.device(device)
        self.simulated = self.device.type != "cuda"  # device tensors live in CPU memory
        self.streams = CudaStreams(self.device) if streams is None and not self.simulated else streams
        self.stream = None if self.streams is None else self.streams.new_stream()  # the side stream of the copies
        self.in_flight: list[Transfer] = []  # copies not known to be done: their tensors are kept alive
        self.arriving: list[tuple[Transfer, torch.Tensor]] = []  # downloads to add into host tensors, in order
        self.timeline = None  # a Timeline: each copy becomes a span of the "link" lane

    def host_zeros(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, pin_memory=not self.simulated)

    def mark(self):
        """An event recorded now on the device's current stream: done when the device work queued so far has run
        (None when there are no streams: simulated, nothing to wait for)."""
        if self.streams is None:
            return None
        event = self.streams.event()
        event.record(self.streams.current())
        return event

    def to_host(self, tensor: torch.Tensor, *, add_to: torch.Tensor | None = None, after=None) -> Transfer:
        """Start copying device `tensor` down into a new host tensor (same dtype). Returns at once.

        after: the event that marks the source written (mark() after its producer was queued); by default one
        recorded now. With add_to (a host tensor of the same shape), the link adds the copy into it once it has
        arrived: at a later copy if it is done by then (no waiting), at the latest in wait_downloads().
        """
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=not self.simulated)
        transfer = self._copy("to_host", host, tensor, after)
        if add_to is not None:
            self.arriving.append((transfer, add_to))
        self._add_arrived(wait=False)
        return transfer

    def to_device(self, device_tensor: torch.Tensor, host_tensor: torch.Tensor, *, after=None) -> Transfer:
        """Start copying host_tensor up into device_tensor (same dtype: cast on the host, send the small one).
        Returns at once. after: the event that marks device_tensor's last reader done (mark() after that reader
        was queued); by default one recorded now. Device work that reads device_tensor: after device_wait()."""
        if not self.simulated and not host_tensor.is_pinned():
            host_tensor = host_tensor.pin_memory()  # from pageable memory the copy could block the host
        return self._copy("to_device", device_tensor, host_tensor, after)

    def wait_downloads(self) -> None:
        """The host waits for the downloads given add_to that have not arrived, and adds them in: call it before
        reading those host tensors."""
        self._add_arrived(wait=True)

    def _add_arrived(self, wait: bool) -> None:
        # In the order they were sent (one stream: they arrive in that order), so that sums do not depend on timing.
        while self.arriving and (wait or self.arriving[0][0].ready()):
            transfer, add_to = self.arriving.pop(0)
            arrived = transfer.host_wait() if wait else transfer.tensor  # ready: nothing to wait for
            add_to.add_(arrived)  # fp32 += 16-bit: widened exactly

    def _copy(self, direction: str, destination: torch.Tensor, source: torch.Tensor, after) -> Transfer:
        record_transfer(direction, source)
        label = {"to_host": "down", "to_device": "up"}[direction]
        span = nullcontext() if self.timeline is None else self.timeline.span("link", label)
        if self.streams is None:  # simulated: a plain copy, done when this returns
            with span:
                destination.copy_(source)
            return Transfer(destination, source)
        self.stream.wait_event(self.mark() if after is None else after)  # that event only, not the whole stream
        with self.streams.using(self.stream), span:
            destination.copy_(source, non_blocking=True)
            done = self.streams.event()
            done.record(self.stream)
        # The allocator must not reuse the device tensor's memory before the copy ran; the host tensors are kept
        # alive in self.in_flight until then.
        self.streams.keep(source if direction == "to_host" else destination, self.stream)
        transfer = Transfer(destination, source, done, self.streams)
        self.in_flight = [t for t in self.in_flight if not t.ready()] + [transfer]
        return transfer


class CudaStreams:
    """The CUDA streams and events a Link (and a CudaTimeline) uses, on one device."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def event(self, timing: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=timing)

    def using(self, stream: torch.cuda.Stream):
        return torch.cuda.stream(stream)  # device work queued inside goes to stream

    def keep(self, device_tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        device_tensor.record_stream(stream)  # the allocator must not reuse its memory before stream's queued work ran


class RecordingStreams:
    """A stand-in for CudaStreams on CPU, for tests: the CUDA path of a Link, with every call recorded.

    calls: ("record", stream, event); ("wait", stream, event): the stream waits for the event; ("wait_stream",
    stream, other); ("synchronize", event): the host waits; ("keep", stream): a device tensor is kept for the
    stream's work. Streams are "compute" (the current one) and "side"; events are numbered from 1. Copies
    happen at once (CPU tensors), but an event is done (query) only after complete(event) or a synchronize.
    Each event is stamped with `clock` (ms, set by the test) when recorded, for elapsed_time.
    """

    def __init__(self):
        self.calls: list[tuple] = []
        self.finished: set[int] = set()
        self.clock, self.events, self.stream = 0.0, 0, "compute"

    def current(self):
        return _RecordedStream(self, self.stream)

    def new_stream(self):
        return _RecordedStream(self, "side")

    def event(self, timing: bool = False):
        self.events += 1
        return _RecordedEvent(self, self.events)

    @contextmanager
    def using(self, stream):
        previous, self.stream = self.stream, stream.name
        try:
            yield
        finally:
            self.stream = previous

    def keep(self, device_tensor: torch.Tensor, stream) -> None:
        self.calls.append(("keep", stream.name))

    def complete(self, event) -> None:
        """The device has run everything up to this event."""
        self.finished.add(event.id)


class _RecordedStream:
    def __init__(self, streams: RecordingStreams, name: str):
        self.streams, self.name = streams, name

    def wait_event(self, event) -> None:
        self.streams.calls.append(("wait", self.name, event.id))

    def wait_stream(self, other) -> None:
        self.streams.calls.append(("wait_stream", self.name, other.name))


class _RecordedEvent:
    def __init__(self, streams: RecordingStreams, id: int):
        self.streams, self.id, self.time = streams, id, None

    def record(self, stream=None) -> None:
        stream = stream or self.streams.current()
        self.streams.calls.append(("record", stream.name, self.id))
        self.time = self.streams.clock

    def query(self) -> bool:
        return self.id in self.streams.finished

    def synchronize(self) -> None:
        self.streams.calls.append(("synchronize", self.id))
        self.streams.finished.add(self.id)

    def elapsed_time(self, end) -> float:
        return end.time - self.time


class Timeline:
    """Spans of work per lane ("device", "host", "link"), recorded as they happen, for the timeline picture.

    Wall-clock times from the thread that does the work: right for the host, and for the simulated device,
    whose work runs in the thread that queues it. On CUDA it does not (kernels run after the host queued
    them): use CudaTimeline. read() gives the spans, (lane, label, start s, stop s).
    """

    def __init__(self):
        self.origin = time.perf_counter()
        self.spans: list[tuple[str, str, float, float]] = []  # (lane, label, start s, stop s)

    @contextmanager
    def span(self, lane: str, label: str):
        start = time.perf_counter() - self.origin
        try:
            yield
        finally:
            self.spans.append((lane, label, start, time.perf_counter() - self.origin))

    def read(self) -> list[tuple[str, str, float, float]]:
        return self.spans


class CudaTimeline(Timeline):
    """A Timeline whose lanes other than "host" are timed on the device: a span is two CUDA events, recorded
    on the current stream when it opens and closes (the link's side stream for a copy), and its times are
    their elapsed_time from an event recorded at the start. Host spans stay wall-clock; both clocks start
    together, once the device's current stream has run what was queued before (to within that wait)."""

    def __init__(self, streams=None):
        self.streams = streams or CudaStreams(torch.device("cuda", torch.cuda.current_device()))
        self.zero = self.streams.event(timing=True)
        self.zero.record(self.streams.current())
        self.zero.synchronize()
        super().__init__()
        self.pending: list[tuple] = []  # device spans: (lane, label, start event, stop event)

    @contextmanager
    def span(self, lane: str, label: str):
        if lane == "host":
            with super().span(lane, label):
                yield
            return
        start = self.streams.event(timing=True)
        start.record(self.streams.current())
        try:
            yield
        finally:
            stop = self.streams.event(timing=True)
            stop.record(self.streams.current())
            self.pending.append((lane, label, start, stop))

    def read(self) -> list[tuple[str, str, float, float]]:
        """The spans; waits for the device to reach each pending span's end."""
        for lane, label, start, stop in self.pending:
            stop.synchronize()
            self.spans.append((lane, label, self.zero.elapsed_time(start) / 1e3, self.zero.elapsed_time(stop) / 1e3))
        self.pending.clear()
        return self.spans


@torch.no_grad()
def offload_bucket(bucket: Bucket, host_grad: torch.Tensor, shard_start: int, rank: int, link: Link) -> None:
    """Finish a bucket whose reduce-scatter was started (lesson 04's hook): this rank's piece of
    the mean gradient goes down to the host, to be added into its fp32 gradient shard.

    host_grad is this rank's fp32 gradient shard on the host, starting at shard_start in the
    padded flat buffer; bucket.slices[rank] is the piece, in buffer coordinates. Average on the
    device, in the 16-bit dtype (as stage 2 does), so that only 2 bytes per element cross the
    link; send it with link.to_host(..., add_to=its slice of host_grad), which returns at once
    (the host adds it in when it reads the shard: link.wait_downloads()); then release
    bucket.staging, bucket.received and bucket.work.
    """
    bucket.work.wait()
    lo, hi = bucket.slices[rank]
    link.to_host(bucket.received / dist.get_world_size(), add_to=host_grad[lo - shard_start:hi - shard_start])
    bucket.staging = bucket.received = bucket.work = None


@torch.no_grad()
def upload_shard(flat_param: torch.Tensor, master: torch.Tensor, shard_start: int, link: Link) -> None:
    """Send this rank's updated fp32 master shard up and all-gather the parameters on the device.

    flat_param is the padded flat buffer of parameters on the device (compute dtype); master is
    this rank's fp32 shard on the host, elements [shard_start, shard_start + master.numel()).
    Cast on the host, copy into this rank's slice of flat_param (link.to_device), let the device
    wait for that copy (device_wait: the all-gather reads the slice), then all-gather in place.
    """
    own = flat_param[shard_start:shard_start + master.numel()]
    link.to_device(own, master.to(flat_param.dtype)).device_wait()
    dist.all_gather_single(flat_param, own)
