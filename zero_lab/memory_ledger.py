"""Memory ledger: how many bytes of model states this rank holds, by category, from live tensors.

    report = model_state_bytes(model, optimizer)
    report.bytes        # {"parameters": ..., "gradients": ..., "master_params": ..., "optimizer_states": ...}
    report.total        # their sum: the paper's "model states"
    report.measurement  # which measurement ran (tensor bytes, plus the CUDA allocator on GPU)

    activations = activation_bytes(model, lambda: model(tokens, targets)[1])

    device = model_state_bytes(model, optimizer, placement="device")  # an offloading optimizer (lesson 06)
    with TransferLedger() as moved:     # bytes copied between host and device inside the block
        ...
    moved.bytes                         # {"to_host": ..., "to_device": ...}

What is counted is storage, not tensor names: a storage shared by several tensors (the GPT's
tied embedding and LM head, views into one flat buffer) is counted once, in the first category
that reaches it. Categories are filled in this order:

    parameters        model.parameters()
    gradients         their .grad, and the .grad of master params (e.g. fp32 copies of
                      the gradients made for a mixed-precision update, while they exist)
    master_params     tensors in optimizer.param_groups that are not model parameters
                      (e.g. fp32 copies of the parameters that a mixed-precision optimizer updates)
    optimizer_states  tensors in optimizer.state with at least one dimension
                      (Adam: exp_avg, exp_avg_sq)

Zero-dimensional optimizer state (Adam's per-tensor `step` counter) is bookkeeping that the
paper's accounting ignores: it goes to `report.bookkeeping_bytes`, outside the total.

Our own ZeRO optimizers (later lessons) partition these states and know best what a rank
holds, so they report it themselves: if the optimizer has a method `model_state_tensors()`
returning {category: [tensors]}, that is used *instead of* the walk above. It must list
everything the rank holds, including the model's own parameters and gradients if it keeps them.

Offloading optimizers (lesson 06, zero_lab.offload) keep some states on the host (CPU memory)
and the rest on the device. They take `model_state_tensors(placement)` with placement "device"
or "host", and `model_state_bytes(..., placement=...)` counts only that side. Without an
accelerator the device is simulated: its tensors are CPU tensors that the optimizer reports as
device-resident, and the measurement says so. Their copies across the link go through
`record_transfer`, which every active `TransferLedger` adds up by direction.

Fake and meta tensors (lesson 13: counting at the paper's sizes) have storages without bytes
behind them; their sizes are counted all the same, each storage once, as for real tensors.

Measurements: on CPU this is the only one (PyTorch's CPU allocator keeps no statistics): bytes
of the live storages. On CUDA the report also carries torch.cuda.memory_allocated and
max_memory_allocated, which include everything else on the device (activations, buffers,
the caching allocator's rounding), so they are at least the model-state total.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

CATEGORIES = ("parameters", "gradients", "master_params", "optimizer_states")
PLACEMENTS = ("device", "host")
DIRECTIONS = ("to_host", "to_device")


@dataclass
class MemoryReport:
    bytes: dict[str, int]
    measurement: str
    bookkeeping_bytes: int = 0
    cuda_allocated_bytes: int | None = None
    cuda_max_allocated_bytes: int | None = None

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


@dataclass
class ActivationReport:
    bytes: int
    measurement: str


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    storage = tensor.untyped_storage()
    if tensor.device.type == "meta" or _is_fake(tensor):  # no data: every storage's pointer is 0
        return f"{tensor.device} (no data)", storage._cdata  # the storage object itself (lesson 13)
    return str(tensor.device), storage.data_ptr()


def _is_fake(tensor: torch.Tensor) -> bool:
    """A FakeTensor (torch._subclasses.fake_tensor, private): shapes, dtypes and storages, no bytes behind them."""
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(tensor, FakeTensor)


class _StorageCounter:
    """Adds up storage bytes, each storage once however many tensors point into it."""

    def __init__(self):
        self.seen: set[tuple[str, int]] = set()

    def add(self, tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for tensor in tensors:
            key = _storage_key(tensor)
            nbytes = tensor.untyped_storage().nbytes()
            if nbytes == 0 or key in self.seen:  # a freed (resized-to-zero) tensor holds nothing
                continue
            self.seen.add(key)
            total += nbytes
        return total


def _walk(model: torch.nn.Module, optimizer) -> tuple[dict[str, list[torch.Tensor]], list[torch.Tensor]]:
    params = list(model.parameters())
    param_keys = {_storage_key(p) for p in params}
    master, states, bookkeeping = [], [], []
    if optimizer is not None:
        for group in optimizer.param_groups:
            master += [t for t in group["params"] if _storage_key(t) not in param_keys]
            bookkeeping += [v for k, v in group.items() if k != "params" and isinstance(v, torch.Tensor)]
        for per_param_state in optimizer.state.values():
            for value in per_param_state.values():
                if isinstance(value, torch.Tensor):
                    (states if value.dim() > 0 else bookkeeping).append(value)
    tensors = {
        "parameters": params,
        "gradients": [t.grad for t in params + master if t.grad is not None],
        "master_params": master,
        "optimizer_states": states,
    }
    return tensors, bookkeeping


def model_state_bytes(model: torch.nn.Module, optimizer=None, placement: str | None = None) -> MemoryReport:
    """Bytes of parameters, gradients, master params and optimizer states this process holds
    (placement "device" or "host": only those an offloading optimizer keeps there)."""
    if placement is not None:
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS} or None, got {placement!r}")
        if not hasattr(optimizer, "model_state_tensors") or not getattr(optimizer, "offloads", False):
            raise ValueError("placement= needs an optimizer that offloads (zero_lab.offload): "
                             "without one everything is on the model's device; leave placement out")
    if optimizer is not None and hasattr(optimizer, "model_state_tensors"):
        tensors = optimizer.model_state_tensors(placement) if placement else optimizer.model_state_tensors()
        unknown = set(tensors) - set(CATEGORIES)
        if unknown:
            raise ValueError(f"model_state_tensors() returned unknown categories {sorted(unknown)}; use {CATEGORIES}")
        bookkeeping: list[torch.Tensor] = []
    else:
        tensors, bookkeeping = _walk(model, optimizer)

    counter = _StorageCounter()
    by_category = {category: counter.add(tensors.get(category, [])) for category in CATEGORIES}
    report = MemoryReport(
        bytes=by_category,
        measurement="tensor bytes of live storages (CPU: no allocator statistics exist)",
        bookkeeping_bytes=counter.add(bookkeeping),
    )
    all_tensors = [t for group in tensors.values() for t in group]
    if placement == "device" and all_tensors and not any(t.is_cuda for t in all_tensors):
        report.measurement += "; device simulated in CPU memory (no accelerator): what the optimizer places there"
    elif placement == "host":
        report.measurement += "; host (CPU) memory"
    cuda_devices = {t.device for t in all_tensors if t.is_cuda}
    if cuda_devices:
        device = min(cuda_devices, key=lambda d: d.index or 0)
        report.measurement = f"tensor bytes of live storages + CUDA allocator on {device}"
        report.cuda_allocated_bytes = torch.cuda.memory_allocated(device)
        report.cuda_max_allocated_bytes = torch.cuda.max_memory_allocated(device)
    return report


_transfer_ledgers: list["TransferLedger"] = []
_transfer_lock = threading.Lock()


class TransferLedger:
    """Bytes copied between host and device inside a `with` block, by direction.

    >>> with TransferLedger() as moved:
    ...     optimizer.step()
    >>> moved.bytes["to_device"], moved.calls["to_host"]
    """

    def __init__(self):
        self.bytes = dict.fromkeys(DIRECTIONS, 0)
        self.calls = dict.fromkeys(DIRECTIONS, 0)

    def __enter__(self) -> "TransferLedger":
        with _transfer_lock:
            _transfer_ledgers.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _transfer_lock:
            _transfer_ledgers.remove(self)


def record_transfer(direction: str, tensor: torch.Tensor) -> None:
    """Called by whatever copies `tensor` across the host-device link (zero_lab.host_link.Link)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    with _transfer_lock:
        for ledger in _transfer_ledgers:
            ledger.bytes[direction] += tensor.numel() * tensor.element_size()
            ledger.calls[direction] += 1


def activation_bytes(
    model: torch.nn.Module, forward: Callable[[], object], use_cuda_allocator: bool = False
) -> ActivationReport:
    """Bytes the forward pass keeps alive for backward ("activations"), excluding the model's weights.

    `forward` is a zero-argument callable that runs the forward pass (e.g. returns the loss);
    no backward is run. Two measurements:

    - default (works on CPU): every tensor autograd saves for backward passes through a
      `saved_tensors_hooks` pack hook; we add up their storages, each once, leaving out the
      parameters' own storages (the weights are saved too, but they are model states).
    - use_cuda_allocator=True (CUDA only): torch.cuda.memory_allocated after minus before the
      forward pass. It also counts the output and anything else the forward allocates and
      keeps, so it is a little larger.
    """
    if use_cuda_allocator:
        if not torch.cuda.is_available():
            raise RuntimeError("use_cuda_allocator=True needs CUDA; the saved-tensor measurement works on CPU")
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        output = forward()
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated() - before
        del output
        return ActivationReport(allocated, "CUDA allocator: memory_allocated after - before forward")

    weight_keys = {_storage_key(t) for t in list(model.parameters()) + list(model.buffers())}
    saved: dict[tuple[str, int], int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in weight_keys:
            saved[key] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = forward()  # the graph (and so every saved tensor) lives until we return
    del output
    return ActivationReport(sum(saved.values()), "saved-tensor hooks: bytes of tensors saved for backward")
