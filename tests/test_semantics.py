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
from zero_lab import launch, load_checkpoint, save_checkpoint
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


def _new_model(model_class, seed):
    return TwoHeads(seed) if model_class is TwoHeads else MLP(SIZES, seed=seed)


def _losses(model_class):
    """The loss of each step, as a function of the model, on the whole global batch."""
    if model_class is TwoHeads:
        batches = regression_batches(len(BRANCHES), GLOBAL_BATCH, 6, 5, seed=1)
        return [lambda m, b=b, branch=branch: F.mse_loss(m(b[0], branch), b[1]) for b, branch in zip(batches, BRANCHES)]
    return [lambda m, b=b: mlp_loss(m, b) for b in mlp_batches()]


def _reference(model_class=MLP, warmup_steps=None, make_scheduler=None, change=None,
               optimizer_class=torch.optim.AdamW, **options):
    """One process, torch.optim on the whole batch; with warmup_steps, lesson 06's delayed algorithm
    (the gradients of step t come from the parameters of step t - 2 once past the warm-up); with
    change=(k, fn), fn(model) after step k."""
    model, master = _new_model(model_class, 0), _new_model(model_class, 0)
    optimizer = optimizer_class(master.parameters(), **(options or ADAMW))
    scheduler = make_scheduler(optimizer) if make_scheduler else None
    delays = warmup_steps is not None

    def upload():
        model.load_state_dict(master.state_dict())

    for step, loss in enumerate(_losses(model_class), start=1):
        loss(model).backward()
        for p, q in zip(model.parameters(), master.parameters()):
            q.grad, p.grad = p.grad, None  # None stays None: torch.optim skips that parameter
        if delays and step > warmup_steps:
            upload()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
        if not delays or step <= warmup_steps:
            upload()
        if change is not None and step == change[0]:
            change[1](master)
            upload()
    upload()
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


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("setup", SETUPS)
def test_unused_parameter_is_not_updated(setup, world_size):
    """Each head is skipped in some steps: torch.optim leaves it (weights, moments, step count) as it
    is, so that its later updates use its own step count; `spare` never moves."""
    options = SETUPS[setup]
    expected = _reference(TwoHeads, warmup_steps=options.get("dpu_warmup_steps"))
    results = launch(_two_heads_on_ranks, world_size, options, timeout=90)
    assert_close(results, expected)
    for got in results:
        assert torch.equal(got["spare.weight"], TwoHeads().spare.weight.detach())


@pytest.mark.parametrize("world_size", [2, 3])
def test_unused_parameter_is_not_updated_at_stage_0(world_size):
    results = launch(_two_heads_on_ranks, world_size, dict(stage=0), timeout=90)
    assert_close(results, _reference(TwoHeads))


@pytest.mark.parametrize("stage", [1, 2])
def test_unused_parameter_is_not_updated_with_sgd_momentum(stage):
    """SGD's momentum buffer: a parameter first used late starts it fresh, as torch does."""
    sgd = dict(lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.01)
    results = launch(_two_heads_on_ranks, 3, dict(stage=stage), torch.optim.SGD, sgd, timeout=90)
    assert_close(results, _reference(TwoHeads, optimizer_class=torch.optim.SGD, **sgd))


def _unused_without_the_option(stage, offload):
    options = dict(offload="cpu") if offload else {}
    model, optimizer = prepare(TwoHeads(), torch.optim.AdamW, stage=stage, lr=1e-2, **options)
    _train_two_heads(model, optimizer, steps=1)


@pytest.mark.parametrize("stage, offload", [(0, False), (1, False), (2, False), (2, True)])
def test_parameter_without_gradient_names_find_unused_parameters(stage, offload):
    with pytest.raises(Exception, match=r"find_unused_parameters=True"):
        launch(_unused_without_the_option, 2, stage, offload, timeout=60)


def _lambda_lr(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))


def _one_cycle(optimizer):  # changes lr and Adam's beta1 every step
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-2, total_steps=len(mlp_batches()))


SCHEDULERS = {"LambdaLR": _lambda_lr, "OneCycleLR": _one_cycle}


def _train_with_scheduler(options, scheduler):
    model, optimizer = prepare(MLP(SIZES, seed=0), torch.optim.AdamW, **options, **ADAMW)
    train(model, optimizer, mlp_batches(), mlp_loss, scheduler=SCHEDULERS[scheduler](optimizer))
    return _flushed_weights(model, optimizer)


@pytest.mark.parametrize("stage, world_size, scheduler, cpu_adam",
                         [(1, 2, "LambdaLR", "compiled"), (2, 3, "OneCycleLR", "torch"), (2, 2, "LambdaLR", "torch")])
def test_delayed_update_uses_the_options_of_its_own_step(stage, world_size, scheduler, cpu_adam):
    """The scheduler steps right after optimizer.step() returns, while the delayed update still runs."""
    expected = _reference(warmup_steps=1, make_scheduler=SCHEDULERS[scheduler])
    options = dict(stage=stage, offload="cpu", dpu_warmup_steps=1, cpu_adam=cpu_adam)
    for _ in range(3):  # it was a race: try it more than once
        assert_close(launch(_train_with_scheduler, world_size, options, scheduler, timeout=90), expected)


LOAD_SETUPS = {
    "stage 0, bf16": dict(stage=0, param_dtype=torch.bfloat16),
    "stage 1, bf16": dict(stage=1, param_dtype=torch.bfloat16),
    "stage 2, bf16": dict(stage=2, param_dtype=torch.bfloat16, bucket_numel=20),
    "stage 1, offload": dict(stage=1, offload="cpu"),
    "stage 2, offload, DPU": dict(stage=2, offload="cpu", bucket_numel=20, dpu_warmup_steps=2),
}


def _other_weights():
    return {name: p.detach().clone() for name, p in MLP(SIZES, seed=7).named_parameters()}


def _load_after_prepare(options, load_after=4):
    model, optimizer = prepare(MLP(SIZES, seed=0), torch.optim.AdamW, **options, **ADAMW)
    batches = mlp_batches()
    train(model, optimizer, batches[:load_after], mlp_loss)
    getattr(model, "module", model).load_state_dict(_other_weights())  # stage 0: DDP's wrapper holds it
    masters = _fp32_weights(model, optimizer)
    train(model, optimizer, batches[load_after:], mlp_loss)
    return masters, _flushed_weights(model, optimizer)


def _fp32_weights(model, optimizer):
    """The fp32 weights the optimizer updates (rank 0: all of them; None elsewhere)."""
    if hasattr(optimizer, "master_of"):  # stage 0 with bf16: lesson 02's MasterWeightOptimizer
        return {name: optimizer.master_of[id(p)].clone() for name, p in model.module.named_parameters()}
    full = optimizer.consolidated_state_dict(dst=0)
    return full and full["model"]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("setup", LOAD_SETUPS)
def test_model_load_state_dict_after_prepare_sets_the_weights(setup, world_size):
    """The fp32 masters (on the host with offload) take the loaded values exactly, and training goes
    on from them as one process does after model.load_state_dict."""
    options = LOAD_SETUPS[setup]
    results = launch(_load_after_prepare, world_size, options, timeout=90)
    other = _other_weights()
    for name, value in other.items():
        assert torch.equal(results[0][0][name], value), f"{name}: the master is not the loaded value"
    if "param_dtype" not in options:  # fp32: as one process, to fp32 rounding
        expected = _reference(warmup_steps=options.get("dpu_warmup_steps"), change=(4, lambda m: m.load_state_dict(other)))
        assert_close([w for _, w in results], expected)


CHECKPOINT_SETUPS = {  # (options, steps before saving)
    "stage 1, offload, DPU, saved while delayed": (dict(stage=1, dpu_warmup_steps=2), 5),
    "stage 2, offload, DPU, saved during warm-up": (dict(stage=2, bucket_numel=20, dpu_warmup_steps=6), 4),
    "stage 2, offload, DPU from the start": (dict(stage=2, bucket_numel=20, dpu_warmup_steps=0), 3),
}


def _dpu_run(options, save_at=None, path=None, resume=False):
    """Train; with save_at, call state_dict() there (and write it to path if given); with resume,
    start instead from path's files, in these fresh processes."""
    rank, batches = dist.get_rank(), mlp_batches()
    options = dict(offload="cpu", param_dtype=torch.bfloat16, **options, **ADAMW)
    model, optimizer = prepare(MLP(SIZES, seed=123 if resume else 0), torch.optim.AdamW, **options)
    if resume:
        state = load_checkpoint(f"{path}/rank{rank}.pt")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        train(model, optimizer, batches[save_at:], mlp_loss)
        return _flushed_weights(model, optimizer)
    train(model, optimizer, batches[:save_at], mlp_loss)
    if save_at is not None:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        if path is not None:
            save_checkpoint(state, f"{path}/rank{rank}.pt")
            return None
        train(model, optimizer, batches[save_at:], mlp_loss)
    return _flushed_weights(model, optimizer)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("setup", CHECKPOINT_SETUPS)
def test_dpu_checkpoint_resumes_bit_for_bit_and_saving_changes_nothing(setup, world_size, tmp_path):
    options, save_at = CHECKPOINT_SETUPS[setup]
    straight = launch(_dpu_run, world_size, options, timeout=90)
    saved_on_the_way = launch(_dpu_run, world_size, options, save_at, timeout=90)
    launch(_dpu_run, world_size, options, save_at, str(tmp_path), timeout=90)
    resumed = launch(_dpu_run, world_size, options, save_at, str(tmp_path), True, timeout=90)
    for rank in range(world_size):
        for name, value in straight[rank].items():
            assert torch.equal(saved_on_the_way[rank][name], value), f"rank {rank}, {name}: saving changed the run"
            assert torch.equal(resumed[rank][name], value), f"rank {rank}, {name}: the resumed run differs"


CONSOLIDATE_SETUPS = {
    "stage 1": dict(stage=1),
    "stage 2": dict(stage=2, bucket_numel=20),
    "stage 1, offload": dict(stage=1, offload="cpu", cpu_adam="torch"),
    "stage 2, offload": dict(stage=2, offload="cpu", bucket_numel=20, cpu_adam="torch"),
}


def _consolidate(options, steps, model_class, unused):
    model, optimizer = prepare(_new_model(model_class, 0), torch.optim.AdamW, find_unused_parameters=unused, **options, **ADAMW)
    if model_class is TwoHeads:
        _train_two_heads(model, optimizer, steps=steps)
    else:
        train(model, optimizer, mlp_batches()[:steps], mlp_loss)
    buffer = io.BytesIO()
    torch.save(optimizer.consolidated_state_dict(dst=0), buffer)  # as a file would
    return buffer.getvalue()


def _continue_from(options, full_bytes, steps, model_class, unused):
    full = torch.load(io.BytesIO(full_bytes))
    model, optimizer = prepare(_new_model(model_class, 5), torch.optim.AdamW, find_unused_parameters=unused, **options, **ADAMW)
    model.load_state_dict(full["model"])
    optimizer.load_state_dict(full["optimizer"])
    if model_class is TwoHeads:
        _train_two_heads(model, optimizer, steps=len(BRANCHES) - steps, first=steps)
    else:
        train(model, optimizer, mlp_batches()[steps:], mlp_loss)
    return _flushed_weights(model, optimizer)


@pytest.mark.parametrize("saved_on, loaded_on", [(3, 2), (2, 3)])
@pytest.mark.parametrize("setup", CONSOLIDATE_SETUPS)
def test_consolidated_state_loads_at_another_world_size(setup, saved_on, loaded_on):
    options = CONSOLIDATE_SETUPS[setup]
    full = launch(_consolidate, saved_on, options, 4, MLP, False, timeout=90)[0]
    results = launch(_continue_from, loaded_on, options, full, 4, MLP, False, timeout=90)
    assert_close(results, _reference())


@pytest.mark.parametrize("stage", [1, 2])
def test_consolidated_state_keeps_each_parameter_s_step_count(stage):
    """Heads skipped in some steps have their own Adam step counts: through consolidation, at another
    world size, and into plain torch.optim.AdamW."""
    options = CONSOLIDATE_SETUPS[f"stage {stage}"]
    full = launch(_consolidate, 3, options, 6, TwoHeads, True, timeout=90)[0]
    results = launch(_continue_from, 2, options, full, 6, TwoHeads, True, timeout=90)
    expected = _reference(TwoHeads)
    assert_close(results, expected)
    state = torch.load(io.BytesIO(full))
    model = TwoHeads(seed=5)
    model.load_state_dict(state["model"])
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    optimizer.load_state_dict(state["optimizer"])
    _train_two_heads(model, optimizer, steps=len(BRANCHES) - 6, first=6)
    assert_close([weights(model)], expected)


@torch.no_grad()
def _halve(model):
    for p in model.parameters():
        p.mul_(0.5)


def _edit_after_prepare(options, edit_after=4):
    model, optimizer = prepare(MLP(SIZES, seed=0), torch.optim.AdamW, **options, **ADAMW)
    batches = mlp_batches()
    train(model, optimizer, batches[:edit_after], mlp_loss)
    _halve(model)
    train(model, optimizer, batches[edit_after:], mlp_loss)
    return _flushed_weights(model, optimizer)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [1, 2])
def test_weights_edited_in_place_after_prepare_are_kept_with_offload(stage, world_size):
    options = dict(stage=stage, offload="cpu", **({"bucket_numel": 20} if stage == 2 else {}))
    results = launch(_edit_after_prepare, world_size, options, timeout=90)
    assert_close(results, _reference(change=(4, _halve)))


def test_in_place_edit_during_a_delayed_update_names_flush():
    with pytest.raises(Exception, match=r"optimizer.flush\(\) before editing"):
        launch(_edit_after_prepare, 2, dict(stage=2, offload="cpu", dpu_warmup_steps=1), timeout=60)
