"""Which PyTorch the course runs on, and the one place that bridges older versions.

CI tests the pinned version (pyproject.toml). Older versions down to OLDEST run the course too:
torch 2.13 renamed two collectives (all_gather_into_tensor -> all_gather_single,
reduce_scatter_tensor -> reduce_scatter_single, the old names deprecated), and the lessons use
the new names; on an older torch, importing zero_lab's launcher or ledger adds them to
torch.distributed as aliases of the old ones (same arguments), so the same code runs on both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

OLDEST = (2, 11)  # FSDP2 (fully_shard) and the collectives the course uses, bridged below
PINNED = "2.13.0"  # what pyproject.toml pins and CI tests
RENAMED = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


def version_tuple(version: str = torch.__version__) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check(version: str = torch.__version__) -> None:
    if version_tuple(version) < OLDEST:
        raise ImportError(f"zero_lab needs PyTorch {'.'.join(map(str, OLDEST))} or newer, this is {version}: "
                          f"pip install torch=={PINNED} (or ./quickstart, which installs it)")


def bridge_collective_names(module=dist) -> list[str]:
    """Add the new collective names where this torch lacks them; return the names added."""
    added = [new for new, old in RENAMED.items() if not hasattr(module, new) and hasattr(module, old)]
    for new in added:
        setattr(module, new, getattr(module, RENAMED[new]))
    return added


check()
bridge_collective_names()
