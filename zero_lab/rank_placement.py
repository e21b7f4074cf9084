"""Where ranks run: the device each rank computes on, and the transport that carries its tensors.

    placement = Placement.choose(world_size=4)   # ZERO_LAB_DEVICE=cpu|cuda, else a GPU if one is visible
    str(placement)        # '4 ranks on 1 GPU (cuda:0), gloo'  or  '4 ranks on CPU, gloo'
    placement.device(3)   # cuda:(3 mod G), or cpu

CPU tensors always travel over gloo. CUDA tensors travel over NCCL when every rank of this
machine has a GPU of its own; NCCL refuses two ranks on one GPU, so with more ranks than GPUs,
rank r computes on cuda:(r mod G) and gloo carries its CUDA tensors too (through host memory).
That is how N ranks share the one GPU most learners have.

Asking how many GPUs there are goes through NVML (PYTORCH_NVML_BASED_CUDA_CHECK, set by
zero_lab), so it leaves CUDA uninitialised: ranks forked afterwards can still use it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

DEVICE_VARIABLE = "ZERO_LAB_DEVICE"
KINDS = ("cpu", "cuda")


@dataclass(frozen=True)
class Placement:
    world_size: int  # ranks on this machine
    gpus: int  # GPUs the ranks compute on; 0: the CPU

    @classmethod
    def choose(cls, world_size: int, device: str | None = None, visible_gpus: int | None = None) -> "Placement":
        """`device` ("cpu" or "cuda"), else $ZERO_LAB_DEVICE, else "cuda" when a GPU is visible.
        visible_gpus: how many GPUs this process sees (default: ask torch; tests pass a stand-in)."""
        visible = torch.cuda.device_count() if visible_gpus is None else visible_gpus
        kind = device or os.environ.get(DEVICE_VARIABLE) or ("cuda" if visible else "cpu")
        kind = str(kind)
        if kind not in KINDS:
            raise ValueError(f"the ranks' device must be 'cpu' or 'cuda' (launch's device= or ${DEVICE_VARIABLE}), "
                             f"got {kind!r}")
        if kind == "cuda" and not visible:
            raise ValueError(f"device 'cuda' was asked for (launch's device= or ${DEVICE_VARIABLE}), but no GPU is "
                             "visible to this process: use 'cpu', or check CUDA_VISIBLE_DEVICES and the driver")
        return cls(world_size, min(visible, world_size) if kind == "cuda" else 0)

    def device(self, local_rank: int) -> torch.device:
        return torch.device("cuda", local_rank % self.gpus) if self.gpus else torch.device("cpu")

    @property
    def cuda_transport(self) -> str | None:
        """What carries CUDA tensors: "nccl" (a GPU per rank), "gloo" (ranks share GPUs), None (no GPU)."""
        if not self.gpus:
            return None
        return "nccl" if self.world_size <= self.gpus else "gloo"

    def __str__(self) -> str:
        ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"
        if not self.gpus:
            return f"{ranks} on CPU, gloo"
        names = ", ".join(f"cuda:{index}" for index in range(self.gpus))
        return f"{ranks} on {self.gpus} GPU{'s' if self.gpus != 1 else ''} ({names}), {self.cuda_transport}"
