"""Graded test cells cannot be fooled by what a notebook patches before they run.

The cheats of issue 10, against lesson 00's ring_all_reduce test cell (hidden checks included),
run as nbgrader runs it: the cell's code in the namespace the notebook built.
"""

import ast
import json
import os
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zero_lab
from zero_lab import collectives

NOTEBOOK = Path(__file__).resolve().parents[1] / "solutions" / "00_collectives" / "00_collectives.ipynb"


def _test_cell(test_id):
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    return next("".join(c["source"]) for c in cells if "".join(c["source"]).startswith(f"#| test {test_id} "))


def _notebook_namespace():
    namespace = {"torch": torch, "dist": dist, "zero_lab": zero_lab, "os": os, "Fraction": Fraction,
                 **{name: getattr(collectives, name) for name in ("chunk_bounds", "ring_exchange")}}
    helpers = ast.parse(_test_cell("ring_exchange"))  # defines _random_tensors and _fresh_seed
    helpers.body = [node for node in helpers.body if isinstance(node, ast.FunctionDef)]
    exec(compile(helpers, "ring_exchange test cell", "exec"), namespace)
    return namespace


def _identity_ring(tensor, average=False):
    return tensor


def _torch_all_reduce(tensor, average=False):
    dist.all_reduce(tensor)
    return tensor.div_(dist.get_world_size()) if average else tensor


@pytest.mark.parametrize("cheat", ["no-op all_reduce + identity ring", "stubbed ledger + torch's all_reduce"])
def test_cheats_fail_the_ring_all_reduce_cell(cheat, monkeypatch):
    namespace = _notebook_namespace()
    if cheat == "no-op all_reduce + identity ring":
        monkeypatch.setattr(dist, "all_reduce", lambda *args, **kwargs: None)
        namespace["ring_all_reduce"], message = _identity_ring, "expected"
    else:
        monkeypatch.setattr(zero_lab.CommLedger, "record", lambda self, *args: None)
        namespace["ring_all_reduce"], message = _torch_all_reduce, "use send/recv only"
    with pytest.raises(AssertionError, match=message):
        exec(compile(_test_cell("ring_all_reduce"), "ring_all_reduce test cell", "exec"), namespace)
