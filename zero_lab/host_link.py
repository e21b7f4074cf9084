# Generated from solutions/06_offload/06_offload.ipynb by `zero-lab build`: edit the notebook, not this file.

"""The host-device link of ZeRO-Offload (lesson 06): what crosses it, counted, and when.

Link               the host-device link: host buffers, copies across it (counted), a side stream on CUDA
Timeline           spans of work per lane (device, host), for the pictures
offload_bucket     finish a reduced gradient bucket: this rank's piece goes down into the fp32 host shard
upload_shard       the updated shard goes up in 16 bits and is all-gathered on the device

Per step this rank's 16-bit gradient shard goes down (2 Psi / Nd bytes) and the updated 16-bit
parameter shard comes up (2 Psi / Nd bytes); without an accelerator the device is simulated in
CPU memory and every copy is still real and counted (zero_lab.memory_ledger.TransferLedger).
"""

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from zero_lab.memory_ledger import record_transfer
from zero_lab.zero2 import Bucket


class Link:
    """The host-device link: host buffers, and copies across the link, counted by direction.

    On CUDA the device is this rank's GPU. Host buffers are pinned (page-locked), so a copy is a
    DMA transfer, issued non-blocking on a side stream and ordered by CUDA events: the copy waits
    for the device work that produced its source, later device work waits for the copy's event,
    and the host thread waits only where it reads a copy's result (to_host). Uploads never block
    the host: they overlap each other, the device's compute and the host's next work. This CUDA
    path has not been run on a GPU in this course (it has none); the lesson runs the simulated one.
    Without an accelerator the device is *simulated*: device tensors are ordinary CPU tensors that
    the optimizer reports to the memory ledger as device memory, and a copy across the link is a
    real copy, counted the same way (zero_lab.memory_ledger.TransferLedger).
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.simulated = self.device.type != "cuda"
        self.stream = None if self.simulated else torch.cuda.Stream(self.device)
        self.in_flight: list[tuple[torch.cuda.Event, torch.Tensor]] = []  # uploads' host sources, kept until copied

    def host_zeros(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, pin_memory=not self.simulated)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of device `tensor` (same dtype), ready to read when this returns."""
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=not self.simulated)
        copied = self._copy(host, tensor)
        record_transfer("to_host", tensor)
        if copied is not None:
            copied.synchronize()  # the host reads it next: wait for this copy only, not for the stream
        return host

    def to_device(self, device_tensor: torch.Tensor, host_tensor: torch.Tensor) -> None:
        """Copy host_tensor into device_tensor (same dtype: cast on the host, send the small one).
        Returns at once on CUDA; device work queued afterwards sees the copy."""
        copied = self._copy(device_tensor, host_tensor)
        record_transfer("to_device", host_tensor)
        if copied is not None:
            self.in_flight.append((copied, host_tensor))

    def _copy(self, destination: torch.Tensor, source: torch.Tensor) -> torch.cuda.Event | None:
        """Copy across the link; on CUDA return the event that marks the copy done."""
        if self.stream is None:
            destination.copy_(source)
            return None
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # the source was written by device work queued before
        with torch.cuda.stream(self.stream):
            destination.copy_(source, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        for tensor in (destination, source):
            if tensor.is_cuda:
                tensor.record_stream(self.stream)  # the allocator must not reuse it before the copy ran
        compute.wait_event(copied)  # device work queued after sees the copy
        self.in_flight = [(event, kept) for event, kept in self.in_flight if not event.query()]
        return copied


class Timeline:
    """Spans of work per lane ("device", "host"), recorded as they happen, for the timeline picture.

    Wall-clock times from the thread that does the work. On CUDA, kernels run asynchronously to
    the host thread that queues them, and a device lane would need CUDA events instead.
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


@torch.no_grad()
def offload_bucket(bucket: Bucket, host_grad: torch.Tensor, shard_start: int, rank: int, link: Link) -> None:
    """Finish a bucket whose reduce-scatter was started (lesson 04's hook): this rank's piece of
    the mean gradient goes down to the host and is added into its fp32 gradient shard.

    host_grad is this rank's fp32 gradient shard on the host, starting at shard_start in the
    padded flat buffer; bucket.slices[rank] is the piece, in buffer coordinates. Average on the
    device, in the 16-bit dtype (as stage 2 does), so that only 2 bytes per element cross the
    link; then release bucket.staging, bucket.received and bucket.work.
    """
    bucket.work.wait()
    lo, hi = bucket.slices[rank]
    piece = link.to_host(bucket.received / dist.get_world_size())
    host_grad[lo - shard_start:hi - shard_start] += piece  # fp32 += 16-bit: widened exactly
    bucket.staging = bucket.received = bucket.work = None


@torch.no_grad()
def upload_shard(flat_param: torch.Tensor, master: torch.Tensor, shard_start: int, link: Link) -> None:
    """Send this rank's updated fp32 master shard up and all-gather the parameters on the device.

    flat_param is the padded flat buffer of parameters on the device (compute dtype); master is
    this rank's fp32 shard on the host, elements [shard_start, shard_start + master.numel()).
    Cast on the host, copy into this rank's slice of flat_param, then all-gather in place.
    """
    own = flat_param[shard_start:shard_start + master.numel()]
    link.to_device(own, master.to(flat_param.dtype))
    dist.all_gather_single(flat_param, own)
