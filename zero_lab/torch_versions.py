"""Which PyTorch and Python the course is tested on, and the one place that bridges older PyTorch.

CI tests the pinned PyTorch (constraints.txt); the suite is run on Python 3.11 to 3.13. Older PyTorch down to OLDEST
runs the course too: torch 2.13 renamed two collectives (all_gather_into_tensor ->
all_gather_single, reduce_scatter_tensor -> reduce_scatter_single, the old names deprecated), and
the lessons use the new names; on an older torch, importing zero_lab's launcher or ledger adds
them to torch.distributed as aliases of the old ones (same arguments), so the same code runs on both.

On a version the course is not tested on, `import zero_lab` says so in one line (`untested`) before
a lesson can fail deep inside. This module does not import torch: `import zero_lab` stays light,
reading the version from torch's own version.py.
"""

from __future__ import annotations

import re
import sys
from importlib.util import find_spec
from pathlib import Path

OLDEST = (2, 11)  # FSDP2 (fully_shard) and the collectives the course uses, bridged below
PINNED = "2.14.1"  # what constraints.txt pins and CI tests
TESTED_TORCH = (2, 14)  # PINNED's minor version: its patch releases count as tested
TESTED_PYTHON = ((3, 11), (3, 13))  # the oldest and newest Python the suite runs on
RENAMED = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


def version_tuple(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def installed_torch() -> str | None:
    """The version `import torch` gives (without importing it), or None where there is no torch."""
    if "torch" in sys.modules:
        return sys.modules["torch"].__version__
    spec = find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        text = (Path(list(spec.submodule_search_locations)[0]) / "version.py").read_text()
    except OSError:  # a torch that is not a plain package on disk
        return None
    found = re.search(r"""^__version__\s*=\s*['"]([^'"]+)""", text, re.M)
    return found[1] if found else None


def untested(torch_version: str | None, python: tuple[int, int] = sys.version_info[:2]) -> str | None:
    """One line for a learner on a PyTorch or Python that the course is not tested on; None on a tested one."""
    oldest_py, newest_py = (".".join(map(str, v)) for v in TESTED_PYTHON)
    outside, fixes = [], []
    if torch_version is not None and version_tuple(torch_version) != TESTED_TORCH:
        outside.append(f"PyTorch {torch_version}")
        fixes.append(f"pip install torch=={PINNED}")
    if not TESTED_PYTHON[0] <= python <= TESTED_PYTHON[1]:
        outside.append(f"Python {python[0]}.{python[1]}")
        fixes.append(f"a new .venv from a tested Python (rm -r .venv; PYTHON=python{newest_py} ./quickstart lab)")
    if not outside:
        return None
    return (f"zero_lab: this is {' and '.join(outside)}; the course is tested on PyTorch {PINNED} and Python "
            f"{oldest_py}-{newest_py}. If a lesson fails, try {' and '.join(fixes)}.")


def check(version: str) -> None:
    if version_tuple(version) < OLDEST:
        raise ImportError(f"zero_lab needs PyTorch {'.'.join(map(str, OLDEST))} or newer, this is {version}: "
                          f"pip install torch=={PINNED} (or ./quickstart, which installs it)")


def bridge_collective_names(module=None) -> list[str]:
    """Add the new collective names where this torch lacks them (to torch.distributed by default);
    return the names added."""
    if module is None:
        import torch.distributed as module
    added = [new for new, old in RENAMED.items() if not hasattr(module, new) and hasattr(module, old)]
    for new in added:
        setattr(module, new, getattr(module, RENAMED[new]))
    return added
