"""Memory over one training step, read as it runs: the lab bench's probe for lesson 07's
benchmark (benchmarks/memory_vs_formula.py), on any device.

    phases = step_phases(model, optimizer, tokens, targets)   # forward, backward, step
    figures = step_memory(model, optimizer, phases, device)   # samples, activations, peak

At every module's forward hook, every gradient hook and after each phase: the memory ledger's
model-state bytes by category and the bytes saved for backward and not yet used
(`SavedTensors`). The peak: on CPU, the model states at the start + the growth of the process's
peak RSS during the step (Linux VmHWM, reset first; malloc set to map every block of 4 KiB or
more on its own, so a freed tensor leaves the RSS), and never less than the largest reading; on
CUDA, the caching allocator's figures (`cuda_step_memory`).
"""

from __future__ import annotations

import ctypes
import gc
import sys

import torch

import zero_lab

from zero_lab.memory_ledger import CATEGORIES, model_state_bytes


def step_phases(model, optimizer, tokens, targets) -> list:
    """One training step as (name, callable) phases, for the probes to read memory between them."""
    loss = {}

    def forward():
        loss["value"] = model(tokens, targets)[1]

    def backward():
        loss["value"].backward()
        loss["value"] = loss["value"].detach()

    def step():
        optimizer.step()
        optimizer.zero_grad()

    return [("forward", forward), ("backward", backward), ("step", step)]


class SavedTensors:
    """Bytes saved for backward and not yet used by it (saved-tensor hooks; weights excluded)."""

    def __init__(self, model):
        self.model, self.live = model, {}  # storage -> [bytes, references not yet unpacked]

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in {p.untyped_storage().data_ptr() for p in self.model.parameters()}:
            self.live.setdefault(key, [storage.nbytes(), 0])[1] += 1
        return key, tensor

    def _unpack(self, packed):
        key, tensor = packed
        if key in self.live:
            self.live[key][1] -= 1
            if self.live[key][1] == 0:
                del self.live[key]
        return tensor

    def bytes(self) -> int:
        return sum(nbytes for nbytes, _ in self.live.values())

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


_libc = ctypes.CDLL(None) if sys.platform.startswith("linux") else None


def _rss() -> dict | None:
    """{"VmRSS", "VmHWM"} of this process in bytes (Linux), or None."""
    if _libc is None:
        return None
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}


def _reset_peak_rss() -> None:
    """Make VmHWM the current RSS. Before, have malloc map every block of >= 4 KiB on its own
    (returned to the OS when freed) and release the free memory it holds, so that the RSS grows
    with each new tensor instead of reusing pages that are already resident."""
    M_MMAP_THRESHOLD = -3
    _libc.mallopt(M_MMAP_THRESHOLD, 4096)
    _libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def step_memory(model, optimizer, phases, device: torch.device) -> dict:
    """Run one step's phases, reading memory as it goes (see the module docstring).

    Returns samples (each {category: bytes, "activations": bytes, "phase": name}: the ledger and
    the saved-tensor hooks, on any device), activations (the most saved for backward during
    forward) and peak: on CUDA the allocator's (with its other figures under "cuda"); on CPU the
    model states at the start + the peak RSS growth (None off Linux), with peak_rss, the process's.
    """
    saved, samples, phase_name = SavedTensors(model), [], ["start"]

    def sample(*_):
        reading = model_state_bytes(model, optimizer).bytes
        samples.append({**reading, "activations": saved.bytes(), "phase": phase_name[0]})

    def read_after(name, run):
        def phase():
            phase_name[0] = name
            with saved.hooks():
                run()
            sample()
        return name, phase

    gc.collect()  # on any device: what earlier runs dropped goes first (stage 3's model and optimizer are cycles)
    handles = [p.register_post_accumulate_grad_hook(sample) for p in model.parameters() if p.requires_grad]
    handles += [m.register_forward_hook(sample) for m in model.modules()]
    try:
        sample()
        phases = [read_after(name, run) for name, run in phases]
        figures = dict(cuda=cuda_step_memory(phases, device)) if device.type == "cuda" else _rss_step(phases, samples[0])
    finally:
        for handle in handles:
            handle.remove()
    figures.setdefault("peak", figures.get("cuda", {}).get("peak"))
    if "cuda" not in figures and figures["peak"] is not None:
        # The RSS grows by pages and small tensors reuse freed heap: it can miss a few bytes that the
        # ledger saw live at once, so the peak is at least the largest reading.
        figures["peak"] = max(figures["peak"], max(sum(s[c] for c in CATEGORIES) + s["activations"] for s in samples))
    activations = max(s["activations"] for s in samples if s["phase"] == "forward")
    return dict(samples=samples, activations=activations, **figures)


def _rss_step(phases, start: dict) -> dict:
    """Run the phases on CPU: peak = model states at the start + peak RSS growth (Linux)."""
    gc.collect()
    if _libc is not None:
        _reset_peak_rss()
    before = _rss()
    for _, run in phases:
        run()
    if before is None:
        return dict(peak=None, peak_rss=None)
    after = _rss()
    return dict(peak=sum(start[c] for c in CATEGORIES) + after["VmHWM"] - before["VmRSS"], peak_rss=after["VmHWM"])


def cuda_step_memory(phases, device, cuda=torch.cuda) -> dict:
    """Run one step's phases on `device`, reading the CUDA caching allocator (all bytes).

    `cuda` is torch.cuda (a stand-in in the plumbing test). allocated: memory_allocated after
    init (before the step) and after each phase; outside_allocator: memory in use on the device
    that the allocator did not reserve (context, NCCL), None when ranks share the GPU (the device's
    free memory is then every rank's business, and each rank's allocator sees only its own).
    """
    cuda.synchronize(device)
    cuda.reset_peak_memory_stats(device)
    allocated = {"init": cuda.memory_allocated(device)}
    for name, run in phases:
        run()
        cuda.synchronize(device)
        allocated[name] = cuda.memory_allocated(device)
    free, total = cuda.mem_get_info(device)
    reserved = cuda.memory_reserved(device)
    placement = zero_lab.placement()
    shared = placement.gpus and placement.world_size > placement.gpus
    return dict(allocated=allocated, peak=cuda.max_memory_allocated(device),
                max_reserved=cuda.max_memory_reserved(device),
                inactive_split=cuda.memory_stats(device).get("inactive_split_bytes.all.current", 0),
                device_total=total, outside_allocator=None if shared else total - free - reserved)
