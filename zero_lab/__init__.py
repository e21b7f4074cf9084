"""zero-lab: build ZeRO yourself. Lessons export their modules here; see README.md.

`import zero_lab` is light (no torch): it installs the switch between the reference code and
the learner's own, says in one line when this PyTorch or Python is not the tested one, and, in a
Jupyter kernel, installs the one-line message for an unfinished exercise.
The names below load their module (and torch) on first use: `zero_lab.launch`, `zero_lab.prepare`.
"""

import importlib
import os
import sys
import types

from zero_lab import torch_versions
from zero_lab.course_tools import implementation

# Asking "is there a GPU?" through NVML keeps CUDA uninitialised in the parent, so ranks forked
# by zero_lab.launch can still use it. Set here, before the user's code first asks torch.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

# First, so that every later `import zero_lab.<module>` goes through the reference/mine switch.
implementation.install()

# On a PyTorch or Python the course is not tested on: one line now, not a failure deep in a lesson
# (once per program: under torchrun, on rank 0 only).
if (untested := torch_versions.untested(torch_versions.installed_torch())) and os.environ.get("RANK", "0") == "0":
    print(untested, file=sys.stderr)

if implementation.in_notebook():  # in Jupyter: an unfinished exercise says so in one line
    from zero_lab.course_tools import notebook

    notebook.install()

# Where each top-level name lives (also read by the lessons' "where this lives" cell).
TOP_LEVEL = {"CommLedger": "zero_lab.comm_ledger", "RankFailed": "zero_lab.launcher", "RanksHung": "zero_lab.launcher",
         "init_distributed": "zero_lab.launcher", "launch": "zero_lab.launcher", "launch_restored": "zero_lab.launcher",
         "placement": "zero_lab.launcher", "rank_device": "zero_lab.launcher",
         "load_checkpoint": "zero_lab.checkpoint", "save_checkpoint": "zero_lab.checkpoint", "prepare": "zero_lab.prepare"}
__all__ = sorted(TOP_LEVEL)


def __getattr__(name: str):
    if name not in TOP_LEVEL:
        raise AttributeError(f"module 'zero_lab' has no attribute {name!r}")
    value = getattr(importlib.import_module(TOP_LEVEL[name]), name)
    globals()[name] = value  # once: later uses are plain attribute reads
    return value


def __dir__():
    return sorted([*globals(), *TOP_LEVEL])


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        # `import zero_lab.prepare` (train.py, the stage modules) binds the submodule here, over the function.
        if name == "prepare" and isinstance(value, types.ModuleType):
            value = value.prepare
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
