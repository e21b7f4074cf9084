"""zero_lab.prepare as a drop-in for the ordinary PyTorch loop: whatever a user does that works
with torch.optim.AdamW on one process trains the same on N ranks, or is refused with an error."""

import copy
import dataclasses
import importlib
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR, OneCycleLR, StepLR

from sharded_training import (ADAMW, SIZES, STEPS, assert_close, mlp_batches, mlp_loss, single_process, train,
                              weights)
from zero_lab import CommLedger, launch
from zero_lab.ddp import MasterWeightOptimizer
from zero_lab.models import MLP
from zero_lab.prepare import prepare
from zero_lab.stages import NVME_MODULE, OFFLOAD_MODULE, STAGES

SCHEDULERS = {
    "StepLR": lambda optimizer: StepLR(optimizer, step_size=3, gamma=0.3),
    "OneCycleLR": lambda optimizer: OneCycleLR(optimizer, max_lr=3e-2, total_steps=STEPS),  # cycles Adam's beta1 too
    "LambdaLR": lambda optimizer: LambdaLR(optimizer, lambda step: 1 / (1 + step)),
}


def _train_mlp(stage, scheduler=None, max_norm=None, **options):
    model, optimizer = prepare(MLP(SIZES, seed=0), torch.optim.AdamW, stage=stage, **ADAMW, **options)
    assert isinstance(optimizer, torch.optim.Optimizer)
    scheduler = SCHEDULERS[scheduler](optimizer) if scheduler else None
    norms = train(model, optimizer, mlp_batches(), mlp_loss, scheduler=scheduler, max_norm=max_norm)
    return weights(model), norms


@pytest.mark.parametrize("stage, world_size, scheduler", [(1, 3, "StepLR"), (2, 3, "OneCycleLR"), (2, 2, "LambdaLR")])
def test_lr_schedulers_change_the_update_as_for_adamw(stage, world_size, scheduler):
    expected, _ = single_process(make_scheduler=SCHEDULERS[scheduler])
    options = {"bucket_numel": 9} if stage == 2 else {}
    results = launch(_train_mlp, world_size, stage, scheduler, timeout=60, **options)
    assert_close([w for w, _ in results], expected)


def test_master_weight_optimizer_is_a_torch_optimizer():
    """Over fp32 parameters its masters are exact copies: it must update exactly as AdamW, schedule included."""
    expected, _ = single_process(make_scheduler=SCHEDULERS["LambdaLR"])
    model = MLP(SIZES, seed=0)
    optimizer = MasterWeightOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
    train(model, optimizer, mlp_batches(), mlp_loss, scheduler=SCHEDULERS["LambdaLR"](optimizer))
    assert_close([weights(model)], expected)
    with pytest.raises(NotImplementedError, match="param group"):
        optimizer.add_param_group({"params": [torch.zeros(1, requires_grad=True)]})


@pytest.mark.parametrize("stage", [1, 2])
def test_torch_clip_grad_norm_clips_by_the_global_norm(stage):
    expected, expected_norms = single_process(max_grad_norm=0.5)
    assert max(expected_norms) > 0.5, "the test must actually clip"
    results = launch(_train_mlp, 3, stage, max_norm=0.5, timeout=60)
    assert_close([w for w, _ in results], expected)
    for _, norms in results:
        assert norms == pytest.approx(expected_norms, rel=1e-5)


def _resume_stage0_bf16():
    """Stage 0 with bf16 (MasterWeightOptimizer): a run stopped after 4 steps and resumed from its
    state_dict ends exactly where the straight run does."""
    batches = mlp_batches()
    options = dict(stage=0, param_dtype=torch.bfloat16, **ADAMW)
    model, optimizer = prepare(MLP(SIZES, seed=0), torch.optim.AdamW, **options)
    train(model, optimizer, batches[:4], mlp_loss)
    state = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})  # as torch.save
    train(model, optimizer, batches[4:], mlp_loss)
    resumed, resumed_optimizer = prepare(MLP(SIZES, seed=5), torch.optim.AdamW, **options)
    resumed.load_state_dict(state["model"])
    resumed_optimizer.load_state_dict(state["optimizer"])
    train(resumed, resumed_optimizer, batches[4:], mlp_loss)
    return weights(model), weights(resumed)


def test_stage0_bf16_resumes_exactly():
    for straight, resumed in launch(_resume_stage0_bf16, 2, timeout=60):
        for name in straight:
            assert torch.equal(straight[name], resumed[name]), name


def _prepare_twice(first_stage, second_stage):
    """Re-running a notebook cell: the same model prepared again must train like a fresh one."""
    model = MLP(SIZES, seed=0)
    prepare(model, torch.optim.AdamW, stage=first_stage, **ADAMW)
    model, optimizer = prepare(model, torch.optim.AdamW, stage=second_stage, **ADAMW)
    batches = mlp_batches()
    train(model, optimizer, batches[:-1], mlp_loss)
    with CommLedger() as ledger:
        train(model, optimizer, batches[-1:], mlp_loss)
    return weights(model), ledger.sent_bytes()


@pytest.mark.parametrize("first_stage, second_stage", [(0, 0), (2, 2), (2, 1)])
def test_preparing_the_same_model_again(first_stage, second_stage):
    results = launch(_prepare_twice, 2, first_stage, second_stage, timeout=60)
    assert_close([w for w, _ in results], single_process()[0])
    psi = sum(SIZES[i] * SIZES[i + 1] + SIZES[i + 1] for i in range(len(SIZES) - 1))
    padded = psi + psi % 2
    assert results[0][1] == 2 * 4 * (psi if second_stage == 0 else padded) / 2, "one reduction per step, not two"


def _model_zero_grad_on_stage2():
    model, optimizer = prepare(MLP(SIZES, seed=0), torch.optim.AdamW, stage=2, **ADAMW)
    x, y = mlp_batches()[0]
    for _ in range(2):
        model.zero_grad()
        mlp_loss(model, (x, y)).backward()
        optimizer.step()


def test_stage2_refuses_to_accumulate_across_steps_without_optimizer_zero_grad():
    with pytest.raises(Exception, match=r"optimizer.zero_grad\(\) after optimizer.step\(\)"):
        launch(_model_zero_grad_on_stage2, 2, timeout=60)


def _batch_norm_warnings():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, optimizer = prepare(model, torch.optim.AdamW, stage=1, lr=1e-3)
        for _ in range(3):
            model(torch.randn(8, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    return [str(w.message) for w in caught]


def test_batch_norm_warns_once():
    rank0, rank1 = launch(_batch_norm_warnings, 2, timeout=60)
    assert len(rank0) == 1 and "SyncBatchNorm" in rank0[0] and "'1'" in rank0[0]
    assert rank1 == []


def _error(model=None, stage=1, params=None, **options):
    model = MLP(SIZES) if model is None else model
    with pytest.raises((ValueError, TypeError)) as error:
        prepare(model, torch.optim.AdamW, stage=stage, params=params, lr=1e-3, **options)
    return str(error.value)


def _refusals():
    mlp = MLP(SIZES)
    twice = [{"params": list(mlp.parameters())}, {"params": [next(mlp.parameters())], "lr": 1.0}]
    with torch.device("meta"):
        on_meta = MLP(SIZES)
    return {
        "twice in groups, stage 1": _error(mlp, 1, twice),
        "twice in groups, stage 2": _error(mlp, 2, twice),
        "no parameters": _error(torch.nn.ReLU()),
        "meta": _error(on_meta),
        "stage=True": _error(stage=True),
        "stage=1.0": _error(stage=1.0),
    }


def test_bad_input_is_refused_with_the_fix():
    errors = launch(_refusals, 1, timeout=60)[0]
    assert "more than once in the param groups" in errors["twice in groups, stage 1"]
    assert "more than once in the param groups" in errors["twice in groups, stage 2"]
    assert "no parameters" in errors["no parameters"]
    assert "meta" in errors["meta"] and "to_empty" in errors["meta"]
    assert "int" in errors["stage=True"] and "bool" in errors["stage=True"]
    assert "float" in errors["stage=1.0"]


def _prepare_a_stage_of_one_row():
    # What lesson 09 adds for ZeRO++: one row; here its module is not built yet.
    STAGES[4] = dataclasses.replace(STAGES[2], name="next", module="zero_lab.not_built_yet", lesson="99_next")
    with pytest.raises(RuntimeError) as unbuilt:
        prepare(MLP(SIZES, seed=0), torch.optim.AdamW, stage=4, lr=1e-3)
    with pytest.raises(TypeError) as unknown:
        prepare(MLP(SIZES, seed=0), torch.optim.AdamW, stage=4, units=())
    return str(unbuilt.value), str(unknown.value)


def test_a_stage_is_one_row_of_the_table_and_an_unbuilt_one_names_its_lesson():
    unbuilt, unknown = launch(_prepare_a_stage_of_one_row, 1, timeout=60)[0]
    assert unbuilt == "stage 4 needs zero_lab.not_built_yet, which does not exist yet: run `zero-lab build 99_next`"
    assert "'units' works with stages [3]" in unknown


def test_every_stage_of_the_table_is_built():
    for number, stage in STAGES.items():
        module = importlib.import_module(stage.module)
        assert isinstance(getattr(module, stage.builds), type), number
        if stage.offload:
            assert isinstance(getattr(importlib.import_module(OFFLOAD_MODULE), stage.offload), type), number
        if stage.nvme:
            assert isinstance(getattr(importlib.import_module(NVME_MODULE), stage.nvme), type), number


def test_zero_lab_prepare_stays_the_function_once_its_module_is_imported():
    script = ("import sys, zero_lab; assert 'torch' not in sys.modules, 'import zero_lab loads torch'; "
              "import zero_lab.prepare; print(zero_lab.prepare.__name__, type(zero_lab.prepare).__name__)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["prepare", "function"], result.stderr
