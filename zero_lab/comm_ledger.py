"""Communication ledger: count every collective a rank issues, whoever issues it.

The launcher (and `init_distributed` under torchrun) creates the default process group
with the backend "counted": a thin Python process group that records each call and then
hands it to the real transport, by the tensors' device: gloo for CPU tensors, and for CUDA
tensors nccl (a GPU per rank) or gloo (ranks that share a GPU: zero_lab/rank_placement.py).
Because it sits *under* `torch.distributed`, it sees our own code and PyTorch's DDP reducer (C++), FSDP2 and
ZeroRedundancyOptimizer alike, so lessons can compare them side by side.

With a FakeStore (torch's fake process group, a private API:
`dist.init_process_group("counted", store=FakeStore(), rank=r, world_size=N)` after `register()`)
the transport is torch's FakeProcessGroup: every collective returns at once and moves nothing,
and the ledger still charges it. Lesson 13 counts one rank of a 1024-rank world that way.

Convention for "bytes sent" (docs/communication.md has the derivation):
a collective over N ranks on a logical message of M elements is charged what one rank sends
with the bandwidth-optimal ring algorithm, i.e. the total traffic on all links divided by N:

    all_reduce                      2 (N-1)/N * M
    reduce_scatter, all_gather      (N-1)/N * M     (M = the full, unsharded size)
    broadcast, reduce, all_to_all   (N-1)/N * M
    send                            M               (recv counts as received, not sent)

The ZeRO paper's "Psi" per collective is this (N-1)/N * Psi rounded to Psi. Values are exact
`Fraction`s so a test can compare them with a formula without rounding.
"""

from __future__ import annotations

import sys
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta
from fractions import Fraction

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from zero_lab import perturb_sums, torch_versions

torch_versions.check(torch.__version__)
torch_versions.bridge_collective_names()  # the collectives' current names, on an older torch too

BACKEND = "counted"

# How many "M"s a rank sends per element of the logical message, times N/(N-1).
_RING_FACTOR = {
    "all_reduce": 2,
    "reduce_scatter": 1,
    "all_gather": 1,
    "broadcast": 1,
    "reduce": 1,
    "all_to_all": 1,
    "gather": 1,
    "scatter": 1,
}

_active: list["CommLedger"] = []
_lock = threading.Lock()


@dataclass
class KindTotals:
    calls: int = 0
    elements: int = 0  # logical message size M, summed over calls
    bytes: int = 0  # M times element size, summed over calls
    sent_bytes: Fraction = field(default_factory=Fraction)  # per the ring convention above


class CommLedger:
    """Counts the collectives this rank issues inside a `with` block.

    >>> with CommLedger() as ledger:
    ...     dist.all_reduce(torch.ones(10))
    >>> ledger.totals["all_reduce"].calls, ledger.sent_bytes()
    """

    def __init__(self):
        self.totals: dict[str, KindTotals] = defaultdict(KindTotals)

    def __enter__(self) -> "CommLedger":
        if not dist.is_initialized() or dist.get_backend() != BACKEND:
            raise RuntimeError(
                "CommLedger needs the process group made by zero_lab.launch or "
                "zero_lab.init_distributed (backend 'counted'); "
                f"this one is {dist.get_backend() if dist.is_initialized() else 'not initialized'}."
            )
        with _lock:
            _active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _lock:
            _active.remove(self)

    def record(self, kind: str, elements: int, element_size: int, group_size: int, group=None) -> None:
        """Charge one collective; `group` is the process group it ran on (lesson 09 splits by its ranks)."""
        totals = self.totals[kind]
        totals.calls += 1
        totals.elements += elements
        totals.bytes += elements * element_size
        if kind == "send":
            totals.sent_bytes += elements * element_size
        elif kind in _RING_FACTOR:
            totals.sent_bytes += Fraction(
                _RING_FACTOR[kind] * (group_size - 1) * elements * element_size, group_size
            )

    def calls(self, kind: str | None = None) -> int:
        return sum(t.calls for k, t in self.totals.items() if kind in (None, k))

    def sent_bytes(self, kind: str | None = None) -> Fraction:
        return sum((t.sent_bytes for k, t in self.totals.items() if kind in (None, k)), Fraction())

    def summary(self) -> dict[str, dict]:
        """Plain data (picklable, printable): {kind: {calls, elements, bytes, sent_bytes}}."""
        return {
            kind: {
                "calls": t.calls,
                "elements": t.elements,
                "bytes": t.bytes,
                "sent_bytes": float(t.sent_bytes),
            }
            for kind, t in sorted(self.totals.items())
        }

    def table(self) -> str:
        rows = [f"{'collective':<16}{'calls':>7}{'elements':>14}{'bytes sent':>16}"]
        for kind, t in sorted(self.totals.items()):
            rows.append(f"{kind:<16}{t.calls:>7}{t.elements:>14}{float(t.sent_bytes):>16,.0f}")
        return "\n".join(rows)


def _record(kind: str, tensors, group_size: int, elements: int | None = None, group=None) -> None:
    if not _active:
        return
    tensors = list(tensors)
    if elements is None:
        elements = sum(t.numel() for t in tensors)
    element_size = tensors[0].element_size() if tensors else 0
    with _lock:
        for ledger in _active:
            ledger.record(kind, elements, element_size, group_size, group)


def _flat(nested):
    """Tensors of a list, or of a list of lists (the shapes c10d passes to backends)."""
    for item in nested:
        if isinstance(item, torch.Tensor):
            yield item
        else:
            yield from item


class CountingProcessGroup(dist.ProcessGroup):
    """A process group that records each collective, then delegates to a real backend.

    The argument shapes follow the c10d backend interface (lists of tensors, options
    objects); each method names the logical message size M it charges.
    """

    def __init__(self, transports: dict, rank: int, size: int):
        """transports: {device type: (backend, its BackendType)}, "cpu" first."""
        super().__init__(rank, size)
        self.transports = {device: backend for device, (backend, _) in transports.items()}
        self.inner = self.transports["cpu"]  # what carries what is not a tensor (barrier)
        # Registering the transports gives this group a name and devices, which
        # DeviceMesh / FSDP2 look up.
        for device, (backend, backend_type) in transports.items():
            self._register_backend(torch.device(device), backend_type, backend)

    def getBackendName(self) -> str:
        return BACKEND

    def _for(self, tensors):
        """The transport for these tensors (a list, or a list of lists): by their device."""
        first = next(iter(_flat(tensors)), None)
        return self.transports.get(first.device.type, self.inner) if first is not None else self.inner

    # M = the tensor being reduced / broadcast.
    def allreduce(self, tensors, opts=c10d.AllreduceOptions()):
        _record("all_reduce", tensors, self.size(), group=self)
        _perturb_sum(tensors, opts)
        return self._for(tensors).allreduce(tensors, opts)

    def allreduce_coalesced(self, tensors, opts=c10d.AllreduceCoalescedOptions()):
        _record("all_reduce", tensors, self.size(), group=self)
        _perturb_sum(tensors, opts)
        return self._for(tensors).allreduce_coalesced(tensors, opts)

    def broadcast(self, tensors, opts=c10d.BroadcastOptions()):
        _record("broadcast", tensors, self.size(), group=self)
        return self._for(tensors).broadcast(tensors, opts)

    def reduce(self, tensors, opts=c10d.ReduceOptions()):
        _record("reduce", tensors, self.size(), group=self)
        _perturb_sum(tensors, opts)
        return self._for(tensors).reduce(tensors, opts)

    # M = the full (gathered / unscattered) size.
    def allgather(self, output_lists, inputs, opts=c10d.AllgatherOptions()):
        _record("all_gather", _flat(output_lists), self.size(), group=self)
        return self._for(inputs).allgather(output_lists, inputs, opts)

    def allgather_coalesced(self, output_lists, inputs, opts=c10d.AllgatherOptions()):
        _record("all_gather", _flat(output_lists), self.size(), group=self)
        return self._for(inputs).allgather_coalesced(output_lists, inputs, opts)

    def all_gather_single(self, output, input, opts=c10d.AllgatherOptions()):
        _record("all_gather", [output], self.size(), group=self)
        return self._for([input])._allgather_base(output, input, opts)

    _allgather_base = all_gather_single

    def reduce_scatter(self, outputs, input_lists, opts=c10d.ReduceScatterOptions()):
        _record("reduce_scatter", _flat(input_lists), self.size(), group=self)
        input_lists = [_perturb_sum(inputs, opts, in_place=False) for inputs in input_lists]
        return self._for(outputs).reduce_scatter(outputs, input_lists, opts)

    def reduce_scatter_single(self, output, input, opts=c10d.ReduceScatterOptions()):
        _record("reduce_scatter", [input], self.size(), group=self)
        input, = _perturb_sum([input], opts, in_place=False)
        return self._for([input])._reduce_scatter_base(output, input, opts)

    _reduce_scatter_base = reduce_scatter_single

    def alltoall_base(self, output, input, output_splits, input_splits, opts=c10d.AllToAllOptions()):
        _record("all_to_all", [input], self.size(), group=self)
        return self._for([input]).alltoall_base(output, input, output_splits, input_splits, opts)

    def alltoall(self, outputs, inputs, opts=c10d.AllToAllOptions()):
        _record("all_to_all", inputs, self.size(), group=self)
        return self._for(inputs).alltoall(outputs, inputs, opts)

    def gather(self, output_lists, inputs, opts=c10d.GatherOptions()):
        _record("gather", inputs, self.size(), elements=sum(t.numel() for t in inputs) * self.size(), group=self)
        return self._for(inputs).gather(output_lists, inputs, opts)

    def scatter(self, outputs, input_lists, opts=c10d.ScatterOptions()):
        _record("scatter", outputs, self.size(), elements=sum(t.numel() for t in outputs) * self.size(), group=self)
        return self._for(outputs).scatter(outputs, input_lists, opts)

    # Point to point: M = what this rank sends.
    # gloo sends and receives host tensors only: a CUDA tensor goes through a host copy.
    def send(self, tensors, dst, tag):
        _record("send", tensors, self.size(), group=self)
        transport = self._for(tensors)
        if _through_host(transport, tensors):
            tensors = [t.to("cpu", copy=True) for t in tensors]  # the backend's work keeps the copies alive until sent
        return transport.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        _record("recv", tensors, self.size(), group=self)
        return _received(self._for(tensors), tensors, lambda transport, into: transport.recv(into, src, tag))

    def recv_anysource(self, tensors, tag):
        _record("recv", tensors, self.size(), group=self)
        return _received(self._for(tensors), tensors, lambda transport, into: transport.recv_anysource(into, tag))

    def barrier(self, opts=c10d.BarrierOptions()):
        _record("barrier", [], self.size(), elements=0, group=self)
        return self.inner.barrier(opts)

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        return self.inner.monitored_barrier(timeout, wait_all_ranks)


_SUMS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PREMUL_SUM)


def _perturb_sum(tensors, opts, in_place=True):
    """Under ZERO_LAB_PERTURB_SUMS (zero_lab/perturb_sums.py): a sum's inputs moved an ulp each, as another order
    would."""
    return perturb_sums.before_sum(tensors, in_place) if any(opts.reduceOp == op for op in _SUMS) else tensors


HOST_ONLY_TRANSPORTS = (dist.ProcessGroupGloo,)  # their send/recv take host tensors only
HOST_DEVICES = ("cpu",)  # a test empties it, so that CPU tensors take the way a CUDA tensor takes


def _through_host(transport, tensors) -> bool:
    return isinstance(transport, HOST_ONLY_TRANSPORTS) and any(t.device.type not in HOST_DEVICES for t in tensors)


def _received(transport, tensors, receive):
    """Receive into `tensors`, through host buffers where the transport needs them."""
    if not _through_host(transport, tensors):
        return receive(transport, tensors)
    hosts = [torch.empty(t.shape, dtype=t.dtype) for t in tensors]
    return _CopiedOnWait(receive(transport, hosts), hosts, tensors)


class _CopiedOnWait(dist.Work):
    """A receive into host buffers that copies them to their device tensors when waited on."""

    def __init__(self, work, hosts, tensors):
        super().__init__()
        self.work, self.hosts, self.tensors = work, hosts, tensors

    def wait(self, timeout=timedelta(0)):
        self.work.wait(timeout) if timeout else self.work.wait()
        for tensor, host in zip(self.tensors, self.hosts):
            tensor.copy_(host)
        return True

    def is_completed(self):
        return self.work.is_completed()

    def _source_rank(self):
        return self.work._source_rank()


_cuda_transport = None  # what carries CUDA tensors in the "counted" group: None, "gloo" or "nccl"; set by register()


def _create_counting_group(store, rank: int, size: int, timeout: timedelta):
    if _is_fake_store(store) or _fake_default_group():  # torch's fake process group (lesson 13): counted, nothing sent
        fake = c10d.FakeProcessGroup._create_internal(rank, size)
        return CountingProcessGroup({"cpu": (fake, dist.ProcessGroup.BackendType.CUSTOM)}, rank, size)
    gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
    transports = {"cpu": (gloo, dist.ProcessGroup.BackendType.GLOO)}
    if _cuda_transport == "gloo":
        transports["cuda"] = transports["cpu"]
    elif _cuda_transport == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size, options)
        transports["cuda"] = (nccl, dist.ProcessGroup.BackendType.NCCL)
    return CountingProcessGroup(transports, rank, size)


def _fake_default_group() -> bool:
    """Whether the world is fake: a subgroup (dist.new_group, lesson 17's mesh) gets the FakeStore back from C++ as a
    plain Store, so the default group's transport tells."""
    fake_group = getattr(c10d, "FakeProcessGroup", None)
    if fake_group is None or not dist.is_initialized():
        return False
    default = dist.distributed_c10d._get_default_group()
    return isinstance(getattr(default, "inner", None), fake_group)


def _is_fake_store(store) -> bool:
    """torch.testing._internal.distributed.fake_pg.FakeStore (a private module: imported only when one is passed)."""
    fake_pg = sys.modules.get("torch.testing._internal.distributed.fake_pg")
    while isinstance(store, dist.PrefixStore):  # init_process_group wraps the store it is given
        store = store.underlying_store
    return fake_pg is not None and isinstance(store, fake_pg.FakeStore)


def register(cuda_transport: str | None = None) -> str:
    """Make backend "counted" available: CPU tensors over gloo, CUDA tensors over `cuda_transport`
    ("nccl" with a GPU per rank, "gloo" for ranks that share GPUs, None without GPUs)."""
    global _cuda_transport
    if cuda_transport not in (None, "gloo", "nccl"):
        raise ValueError(f"cuda_transport must be None, 'gloo' or 'nccl', not {cuda_transport!r}")
    _cuda_transport = cuda_transport
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create_counting_group, devices=["cpu", "cuda"])
    return BACKEND
