"""Training that is never silently wrong (issue 19, section 2) at stages 0, 1, 2 and with offload:
N ranks end where single-process torch.optim.AdamW ends, whatever a user does that torch allows
(a step that leaves parameters without gradient, an LR scheduler with the delayed update,
model.load_state_dict after prepare, saving and resuming, another world size), or get an
error that names the fix. World sizes 2 and 3 over parameters that do not split evenly."""

import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sharded_training import ADAMW, GLOBAL_BATCH, SIZES, assert_close, mlp_batches, mlp_loss, train, weights
from zero_lab import launch
from zero_lab.data import regression_batches, shard_batch
from zero_lab.models import MLP
from zero_lab.prepare import prepare

# Which head each step uses: both heads are skipped in some steps, and `spare` in all of them.
BRANCHES = "aabab" "baaab"
SETUPS = {  # name: prepare's options
    "stage 1": dict(stage=1),
    "stage 2": dict(stage=2, bucket_numel=20),
    "stage 1, offload": dict(stage=1, offload="cpu", cpu_adam="torch"),
    "stage 2, offload, DPU": dict(stage=2, offload="cpu", bucket_numel=20, dpu_warmup_steps=3),
}


class TwoHeads(nn.Module):
    """A trunk and two heads, one used per step (the same on every rank); a layer never used.
    6*9+9 + 2*(9*5+5) + 4 = 167 parameters, a prime: every shard boundary cuts through a tensor."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.trunk, self.a, self.b, self.spare = nn.Linear(6, 9), nn.Linear(9, 5), nn.Linear(9, 5), nn.Linear(3, 1)

    def forward(self, x, branch):
        return (self.a if branch == "a" else self.b)(torch.tanh(self.trunk(x)))


def _train_two_heads(model, optimizer, steps=len(BRANCHES), first=0):
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    batches = list(regression_batches(len(BRANCHES), GLOBAL_BATCH, 6, 5, seed=1))
    for step in range(first, first + steps):
        x, y = shard_batch(batches[step], rank, world_size)
        F.mse_loss(model(x, BRANCHES[step]), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _single_process_two_heads(optimizer_class=torch.optim.AdamW, **options):
    model = TwoHeads()
    _train_two_heads(model, optimizer_class(model.parameters(), **(options or ADAMW)))
    return weights(model)


def _flushed_weights(model, optimizer):
    if hasattr(optimizer, "flush"):
        optimizer.flush()
    return weights(model)


def _two_heads_on_ranks(options, optimizer_class=torch.optim.AdamW, optimizer_options=None):
    model, optimizer = prepare(TwoHeads(), optimizer_class, find_unused_parameters=True, **options,
                               **(optimizer_options or ADAMW))
    _train_two_heads(model, optimizer)
    return _flushed_weights(model, optimizer)


def _dpu_reference_two_heads(warmup_steps):
    """One process, the delayed algorithm (lesson 06) on TwoHeads: gradients of step t come from the
    parameters of step t - 2 once past the warm-up."""
    model, master = TwoHeads(), TwoHeads()
    optimizer = torch.optim.AdamW(master.parameters(), **ADAMW)
    batches = list(regression_batches(len(BRANCHES), GLOBAL_BATCH, 6, 5, seed=1))

    def upload():
        for p, q in zip(model.parameters(), master.parameters()):
            p.data.copy_(q.data)

    for step, branch in enumerate(BRANCHES, start=1):
        F.mse_loss(model(batches[step - 1][0], branch), batches[step - 1][1]).backward()
        for p, q in zip(model.parameters(), master.parameters()):
            q.grad, p.grad = p.grad, None
        if step > warmup_steps:
            upload()
        optimizer.step()
        optimizer.zero_grad()
        if step <= warmup_steps:
            upload()
    upload()
    return weights(model)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("setup", SETUPS)
def test_unused_parameter_is_not_updated(setup, world_size):
    """Each head is skipped in some steps: torch.optim leaves it (weights, moments, step count) as it
    is, so that its later updates use its own step count; `spare` never moves."""
    options = SETUPS[setup]
    warmup = options.get("dpu_warmup_steps")
    expected = _single_process_two_heads() if warmup is None else _dpu_reference_two_heads(warmup)
    results = launch(_two_heads_on_ranks, world_size, options, timeout=90)
    assert_close(results, expected)
    for got in results:
        assert torch.equal(got["spare.weight"], TwoHeads().spare.weight.detach())


@pytest.mark.parametrize("world_size", [2, 3])
def test_unused_parameter_is_not_updated_at_stage_0(world_size):
    results = launch(_two_heads_on_ranks, world_size, dict(stage=0), timeout=90)
    assert_close(results, _single_process_two_heads())


@pytest.mark.parametrize("stage", [1, 2])
def test_unused_parameter_is_not_updated_with_sgd_momentum(stage):
    """SGD's momentum buffer: a parameter first used late starts it fresh, as torch does."""
    sgd = dict(lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.01)
    results = launch(_two_heads_on_ranks, 3, dict(stage=stage), torch.optim.SGD, sgd, timeout=90)
    assert_close(results, _single_process_two_heads(torch.optim.SGD, **sgd))


def _unused_without_the_option(stage, offload):
    options = dict(offload="cpu") if offload else {}
    model, optimizer = prepare(TwoHeads(), torch.optim.AdamW, stage=stage, lr=1e-2, **options)
    _train_two_heads(model, optimizer, steps=1)


@pytest.mark.parametrize("stage, offload", [(0, False), (1, False), (2, False), (2, True)])
def test_parameter_without_gradient_names_find_unused_parameters(stage, offload):
    with pytest.raises(Exception, match=r"find_unused_parameters=True"):
        launch(_unused_without_the_option, 2, stage, offload, timeout=60)
