"""Stage 3 keeps torch's single-process semantics outside the happy path: unused parameters,
model.state_dict / load_state_dict after prepare, resuming at another world size, reading a
parameter between steps, a model with nothing to train (issue 19, section 2, stage 3)."""

import io

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from sharded_training import ADAMW, assert_close, mlp_batches, weights
from zero_lab import RankFailed, RanksHung, launch
from zero_lab.data import shard_batch
from zero_lab.prepare import prepare


class Branchy(nn.Module):
    """A Linear used every step; `gate.skip` (one unit with `gate.used`) only in even steps; a
    module used every step whose `rare` parameter is used only in odd steps. 6*9+9 + 9*9+9 + 9 + 9*5+5:
    units of 63, 90 (with the skipped path), 9 + 9 and 50 elements, uneven on 2 and 3 ranks."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.first, self.skip, self.last = nn.Linear(6, 9), nn.Linear(9, 9), nn.Linear(9, 5)
            self.often = nn.Parameter(torch.randn(9))
            self.rare = nn.Parameter(torch.randn(9))

    def forward(self, x, step):
        h = torch.tanh(self.first(x)) * self.often
        if step % 2 == 0:
            h = torch.tanh(self.skip(h))
        else:
            h = h + self.rare
        return self.last(h)


def _branchy_steps(model, optimizer, batches, rank=0, world_size=1, invalidate=None):
    for step, (x, y) in enumerate(batches):
        if invalidate is not None and step > 0:
            invalidate()  # the order of calls changes every step, on every rank alike
        x, y = shard_batch((x, y), rank, world_size)
        F.mse_loss(model(x, step), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _unused_single_process():
    model = Branchy()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    _branchy_steps(model, optimizer, mlp_batches(5))
    steps = {name: int(optimizer.state[p]["step"]) for name, p in model.named_parameters()}
    return weights(model), steps


def _unused_stage3(**options):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer = prepare(Branchy(), torch.optim.AdamW, stage=3, **ADAMW, **options)
    _branchy_steps(model, optimizer, mlp_batches(5), rank, world_size, optimizer.invalidate_order)
    full = optimizer.consolidated_state_dict()
    with optimizer.gathered_parameters():
        got = weights(model)
    if full is None:
        return got, None
    names = [name for name, p in model.named_parameters()]
    return got, {names[i]: int(state["step"]) for i, state in full["optimizer"]["state"].items()}


@pytest.mark.parametrize("world_size, options", [(2, {}), (3, {}), (3, {"offload": "nvme", "nvme_chunk_numel": 8})])
def test_unused_parameter_is_not_updated(world_size, options):
    expected, expected_steps = _unused_single_process()
    results = launch(_unused_stage3, world_size, timeout=60, **options)
    assert_close([w for w, _ in results], expected, atol=1e-6, rtol=1e-5)  # sharded_training.assert_close's default, why there
    assert results[0][1] == expected_steps, "a parameter without gradient keeps its step count"
    assert expected_steps["skip.weight"] == 3 and expected_steps["rare"] == 2


class Corners(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.first, self.twice, self.last = nn.Linear(6, 9), nn.Linear(9, 9), nn.Linear(9, 5)
            self.tied = nn.Linear(9, 9, bias=False)
            self.tied.weight = self.twice.weight

    def forward(self, x):
        h = torch.tanh(self.twice(torch.tanh(self.first(x))))
        return self.last(torch.tanh(self.twice(h)) + self.tied(h))


def _train(model, optimizer, batches, rank=0, world_size=1):
    for batch in batches:
        x, y = shard_batch(batch, rank, world_size)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _loaded_single_process():
    model = Corners()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    _train(model, optimizer, mlp_batches(3))
    model.load_state_dict(Corners(seed=7).state_dict())  # new weights, the optimizer's moments stay
    _train(model, optimizer, mlp_batches(6)[3:])
    return weights(model)


def _loaded_stage3(param_dtype):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer = prepare(Corners(), torch.optim.AdamW, stage=3, param_dtype=param_dtype, **ADAMW)
    _train(model, optimizer, mlp_batches(3), rank, world_size)
    model.load_state_dict(Corners(seed=7).state_dict())  # every rank, as with DDP
    _train(model, optimizer, mlp_batches(6)[3:], rank, world_size)
    with optimizer.gathered_parameters():
        return weights(model), model.tied.weight is model.twice.weight


@pytest.mark.parametrize("world_size", [2, 3])
def test_model_load_state_dict_after_prepare_writes_through_to_the_shards(world_size):
    results = launch(_loaded_stage3, world_size, None, timeout=60)
    assert_close([w for w, _ in results], _loaded_single_process(), atol=1e-6, rtol=1e-5)  # sharded_training.assert_close's default, why there
    assert all(tied for _, tied in results)


def test_model_load_state_dict_in_bf16_keeps_the_fp32_weights_in_the_masters():
    def masters():
        model, optimizer = prepare(Corners(), torch.optim.AdamW, stage=3, param_dtype=torch.bfloat16, **ADAMW)
        model.load_state_dict(Corners(seed=7).state_dict())
        return optimizer.consolidated_state_dict()

    full = launch(masters, 3, timeout=60)[0]
    for name, value in Corners(seed=7).state_dict().items():
        assert torch.equal(full["model"][name], value), f"{name} went through bf16"


def _saved_state_dict():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer = prepare(Corners(), torch.optim.AdamW, stage=3, **ADAMW)
    _train(model, optimizer, mlp_batches(2), rank, world_size)
    file = io.BytesIO()
    torch.save(model.state_dict(), file)  # every rank calls it: it gathers, like FSDP's full state dict
    file.seek(0)
    loaded = torch.load(file)
    consolidated = optimizer.consolidated_state_dict()
    return loaded, consolidated and consolidated["model"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_save_of_model_state_dict_gives_full_loadable_tensors(world_size):
    results = launch(_saved_state_dict, world_size, timeout=60)
    consolidated = results[0][1]
    for loaded, _ in results:
        plain = Corners(seed=3)
        plain.load_state_dict(loaded)  # strict: every name, whole shapes
        assert loaded["tied.weight"] is loaded["twice.weight"], "tied names share one tensor, as torch's"
        assert all(torch.equal(loaded[k], consolidated[k]) for k in consolidated), "the fp32 masters"


def _resume_elsewhere(full, steps):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer = prepare(Corners(seed=5), torch.optim.AdamW, stage=3, **ADAMW)
    if full is not None:
        model.load_state_dict(full["model"])
        optimizer.load_state_dict(full["optimizer"])
    batches = mlp_batches(10)
    _train(model, optimizer, batches[:steps] if full is None else batches[steps:], rank, world_size)
    consolidated = optimizer.consolidated_state_dict()
    with optimizer.gathered_parameters():
        return weights(model), consolidated


@pytest.mark.parametrize("first, then", [(2, 3), (3, 2)])
def test_consolidated_state_resumes_at_another_world_size(first, then):
    model = Corners(seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    _train(model, optimizer, mlp_batches(10))
    expected = weights(model)
    full = launch(_resume_elsewhere, first, None, 4, timeout=60)[0][1]
    resumed = launch(_resume_elsewhere, then, full, 4, timeout=60)
    assert_close([w for w, _ in resumed], expected, atol=1e-6, rtol=1e-5)  # sharded_training.assert_close's default, why there


def _between_steps():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer = prepare(Corners(), torch.optim.AdamW, stage=3, **ADAMW)
    _train(model, optimizer, mlp_batches(2), rank, world_size)
    logged = torch.cat([p.detach().float().flatten() for p in model.parameters()])  # a weight-norm log line
    shapes = {tuple(p.shape) for p in model.parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)  # an in-place write outside gathered_parameters: nothing there to change
    x, y = shard_batch(mlp_batches(1)[0], rank, world_size)
    F.mse_loss(model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # numel/shape consumers
    optimizer.step()
    torch.save(model.state_dict(), io.BytesIO())
    with optimizer.gathered_parameters():
        gathered = {tuple(p.shape) for p in model.parameters()}
    return logged.numel(), shapes, float(norm), gathered


@pytest.mark.parametrize("world_size", [2, 3])
def test_reading_a_parameter_between_steps_gives_an_empty_tensor_not_a_crash(world_size):
    for numel, shapes, norm, gathered in launch(_between_steps, world_size, timeout=60):
        assert numel == 0 and shapes == {(0,)}, "between steps a parameter is an honest empty tensor"
        assert norm > 0
        assert gathered == {(9, 6), (9,), (9, 9), (5, 9), (5,)}, "gathered_parameters() shows the whole weights"


def test_model_without_trainable_parameters_is_refused_at_prepare():
    def frozen():
        prepare(Corners().requires_grad_(False), torch.optim.AdamW, stage=3, lr=1e-3)

    with pytest.raises(RankFailed, match="no trainable parameters"):
        launch(frozen, 2, timeout=30)


class Extra(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.last = nn.Linear(6, 9), nn.Linear(9, 5)
        self.extra = nn.Parameter(torch.zeros(9))  # the root's unit

    def forward(self, x, use_extra):
        h = torch.tanh(self.first(x))
        return self.last(h + self.extra if use_extra else h)


def _extra_on_rank_one():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer = prepare(Extra(), torch.optim.AdamW, stage=3, **ADAMW)
    x, y = shard_batch(mlp_batches(1)[0], rank, world_size)
    F.mse_loss(model(x, use_extra=rank == 1), y).backward()  # the same calls, not the same parameters


def test_parameters_used_on_some_ranks_only_stop_within_seconds_naming_the_collectives():
    # Each rank steps a parameter only if it had a gradient; a parameter used on some ranks only is
    # caught by the schedule itself: the unit's reduce-scatter comes at different points.
    with pytest.raises(RanksHung, match=r"rank 1: blocked in .*reduce_scatter"):
        launch(_extra_on_rank_one, 2, timeout=10)
