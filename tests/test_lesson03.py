"""Lesson 03, ZeRO stage 1: N ranks train exactly like one process, with 1/N of the optimizer states."""

import io
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from graded_cells import graded_cell_with
from sharded_training import (ADAMW, SIZES, TINY_GPT, assert_close, bytes_per_step, gpt_batches, gpt_groups,
                              gpt_groups_noise, gpt_loss, gpt_with_groups, gpt_with_groups_single_process, mlp_batches,
                              mlp_loss, single_process, train, weights)
import zero_lab
from zero_lab import launch
from zero_lab.data import shard_batch
from zero_lab.memory_ledger import model_state_bytes
from zero_lab.models import GPT, MLP
from zero_lab.prepare import prepare
from zero_lab.zero1 import ShardLayout

def _zero1_mlp(stage=1, **options):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer = prepare(MLP(SIZES, seed=0), torch.optim.AdamW, stage=stage, **ADAMW, **options)
    norms = []
    for batch in mlp_batches():
        mlp_loss(model, shard_batch(batch, rank, world_size)).backward()
        optimizer.step()
        norms.append(getattr(optimizer, "last_grad_norm", None))
        optimizer.zero_grad()
    return weights(model), norms


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_matches_single_process_adamw(world_size):
    expected, _ = single_process()
    results = launch(_zero1_mlp, world_size, timeout=60)
    assert_close([w for w, _ in results], expected)


def _zero1_from_parameters_alone(as_groups):
    from zero_lab.zero1 import Zero1Optimizer

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = MLP(SIZES, seed=0)
    params = [{"params": list(model.parameters())}] if as_groups else (p for p in model.parameters())
    optimizer = Zero1Optimizer(None, torch.optim.AdamW, params=params, **ADAMW)  # as ZeroRedundancyOptimizer
    train(model, optimizer, mlp_batches(), mlp_loss)
    return weights(model)


@pytest.mark.parametrize("world_size, as_groups", [(2, False), (3, True)])
def test_built_from_parameters_alone_as_torch_zero_redundancy_optimizer_is(world_size, as_groups):
    assert_close(launch(_zero1_from_parameters_alone, world_size, as_groups, timeout=60), single_process()[0])


def test_neither_model_nor_parameters_names_what_to_pass():
    from zero_lab.zero1 import Zero1Optimizer

    with pytest.raises(zero_lab.RankFailed, match=r"pass the model, or params="):
        launch(lambda: Zero1Optimizer(None, torch.optim.AdamW), 2)


@pytest.mark.parametrize("world_size", [2, 3])
def test_clipping_uses_the_global_norm(world_size):
    expected, expected_norms = single_process(max_grad_norm=0.5)
    assert max(expected_norms) > 0.5, "the test must actually clip"
    results = launch(_zero1_mlp, world_size, max_grad_norm=0.5, timeout=60)
    assert_close([w for w, _ in results], expected)
    for _, norms in results:
        assert [n.item() for n in norms] == pytest.approx(expected_norms, rel=1e-5)


def test_matches_lesson02_ddp():
    ddp = launch(_zero1_mlp, 3, stage=0, timeout=60)
    zero1 = launch(_zero1_mlp, 3, stage=1, timeout=60)
    assert_close([w for w, _ in zero1], ddp[0][0])


def _tiny_param_model(world_size):
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)  # 2 elements over 4 ranks: two shards are all padding
    model, optimizer = prepare(model, torch.optim.AdamW, stage=1, lr=0.1)
    x = shard_batch(torch.linspace(-1, 1, 8).unsqueeze(1), dist.get_rank(), world_size)
    for _ in range(5):
        F.mse_loss(model(x), 3 * x).backward()
        optimizer.step()
        optimizer.zero_grad()
    return weights(model)


def test_world_size_larger_than_the_parameters():
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.linspace(-1, 1, 8).unsqueeze(1)
    for _ in range(5):
        F.mse_loss(model(x), 3 * x).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert_close(launch(_tiny_param_model, 4, 4, timeout=60), weights(model))


def test_param_groups_frozen_and_tied_parameters():
    expected, frozen_before = gpt_with_groups_single_process()
    results = launch(gpt_with_groups, 3, 1, timeout=60)
    # The key biases' gradient is rounding noise: within AdamW's drift (gpt_groups_noise); the rest, assert_close's default.
    assert_close([w for w, _, _ in results], expected, noise=gpt_groups_noise())
    for w, tied, memory in results:
        assert tied, "the LM head must still share the embedding's tensor"
        assert torch.equal(w["transformer.wpe.weight"], frozen_before), "a frozen parameter changed"
    # Frozen parameters get no optimizer state: 8 bytes of Adam state per padded trainable element.
    padded = sum(ShardLayout(sum(p.numel() for p in g["params"]), 3).padded_numel for g in gpt_groups(GPT(TINY_GPT)))
    assert sum(memory["optimizer_states"] for _, _, memory in results) == 8 * padded


def _train_with_checkpoint(path, stop_after, param_dtype):
    batches = mlp_batches()
    model, optimizer = prepare(MLP(SIZES, seed=0), torch.optim.AdamW, stage=1, param_dtype=param_dtype, **ADAMW)
    if stop_after is None:  # never stopping
        train(model, optimizer, batches, mlp_loss)
        return weights(model), [g.master.clone() for g in optimizer.groups]
    train(model, optimizer, batches[:stop_after], mlp_loss)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    del model, optimizer
    # A fresh start from other weights: everything must come from the checkpoint.
    model, optimizer = prepare(MLP(SIZES, seed=123), torch.optim.AdamW, stage=1, param_dtype=param_dtype, **ADAMW)
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    train(model, optimizer, batches[stop_after:], mlp_loss)
    return weights(model), [g.master.clone() for g in optimizer.groups]


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_resume_is_the_same_as_never_stopping(param_dtype):
    straight = launch(_train_with_checkpoint, 3, None, None, param_dtype, timeout=60)
    resumed = launch(_train_with_checkpoint, 3, None, 4, param_dtype, timeout=60)
    for (w_straight, m_straight), (w_resumed, m_resumed) in zip(straight, resumed):
        for name in w_straight:
            assert torch.equal(w_straight[name], w_resumed[name]), name
        for a, b in zip(m_straight, m_resumed):
            assert torch.equal(a, b), "fp32 masters differ after resuming"


def _consolidate_then_continue():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    batches = mlp_batches()
    model, optimizer = prepare(MLP(SIZES, seed=0), torch.optim.AdamW, stage=1, param_dtype=torch.bfloat16, **ADAMW)
    train(model, optimizer, batches[:5], mlp_loss)
    full = optimizer.consolidated_state_dict(dst=0)
    assert (full is None) == (rank != 0)
    masters = [g.master.clone() for g in optimizer.groups]
    return full, masters


def test_consolidated_state_loads_into_a_single_process():
    results = launch(_consolidate_then_continue, 3, timeout=60)
    full = results[0][0]
    # The fp32 weights are the concatenated masters, not the bf16 model's.
    flat = torch.cat([m for _, masters in results for m in masters])[:sum(v.numel() for v in full["model"].values())]
    assert torch.equal(torch.cat([v.reshape(-1) for v in full["model"].values()]), flat)
    assert all(v.dtype == torch.float32 for v in full["model"].values())
    # It loads into plain torch: model + AdamW, and both continue like one process that never sharded.
    model = MLP(SIZES, seed=7)
    model.load_state_dict(full["model"])
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    optimizer.load_state_dict(full["optimizer"])
    reference = MLP(SIZES, seed=0)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW)
    train(reference, reference_optimizer, mlp_batches()[:5], mlp_loss)
    for key in ("exp_avg", "exp_avg_sq"):
        for p, q in zip(model.parameters(), reference.parameters()):
            # bf16 gradients (8 significant bits, 2^-8 = 4e-3 relative per rounding) against the fp32 run's: rtol 5e-2
            # allows a dozen roundings; atol for moments near zero.
            torch.testing.assert_close(optimizer.state[p][key], reference_optimizer.state[q][key], atol=2e-2, rtol=5e-2)
    assert optimizer.state[next(model.parameters())]["step"].item() == 5


def _consolidated_after(steps):
    model, optimizer = prepare(MLP(SIZES, seed=0), torch.optim.AdamW, stage=1, **ADAMW)
    train(model, optimizer, mlp_batches()[:steps], mlp_loss)
    return optimizer.consolidated_state_dict(dst=0)


def test_training_continues_from_the_consolidated_state_like_one_process():
    full = launch(_consolidated_after, 3, 5, timeout=60)[0]
    model = MLP(SIZES, seed=7)
    model.load_state_dict(full["model"])
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    optimizer.load_state_dict(full["optimizer"])
    train(model, optimizer, mlp_batches()[5:], mlp_loss)  # each parameter's step must count 6, 7, ...
    assert_close([weights(model)], single_process()[0])


def _memory(param_dtype):
    model = GPT(TINY_GPT, seed=0)
    model, optimizer = prepare(model, torch.optim.AdamW, stage=1, param_dtype=param_dtype, lr=1e-3)
    train(model, optimizer, gpt_batches()[:1], gpt_loss)
    return model_state_bytes(model, optimizer).bytes


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_memory_is_4psi_plus_12psi_over_nd(world_size):
    psi = GPT(TINY_GPT).num_params()
    padded = ShardLayout(psi, world_size).padded_numel
    for memory in launch(_memory, world_size, torch.bfloat16, timeout=60):
        assert memory == {"parameters": 2 * padded, "gradients": 2 * padded,
                          "master_params": 4 * padded // world_size, "optimizer_states": 8 * padded // world_size}
        assert 4 * psi + Fraction(12 * psi, world_size) <= sum(memory.values()) <= 16 * psi
    if world_size == 2:  # fp32: no separate master copy, K = 8
        for memory in launch(_memory, world_size, None, timeout=60):
            assert memory["master_params"] == 0 and memory["optimizer_states"] == 8 * padded // 2


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_communication_is_ddp_s_two_psi(world_size):
    sizes = [6, 10, 6]  # 136 parameters
    ddp, psi, _ = launch(bytes_per_step, world_size, 0, sizes, timeout=60)[0]
    zero1, _, _ = launch(bytes_per_step, world_size, 1, sizes, timeout=60)[0]
    padded = ShardLayout(psi, world_size).padded_numel
    ring = Fraction(world_size - 1, world_size) * 4  # bytes a rank sends per fp32 element, per half
    assert zero1["reduce_scatter"]["sent_bytes"] == zero1["all_gather"]["sent_bytes"] == ring * padded
    assert set(zero1) == {"reduce_scatter", "all_gather"}
    ddp_bytes = sum(kind["sent_bytes"] for kind in ddp.values())
    zero1_bytes = sum(kind["sent_bytes"] for kind in zero1.values())
    assert ddp_bytes == float(2 * ring * psi)
    assert zero1_bytes == float(2 * ring * padded), "exactly DDP's bytes, plus the padding"
    if psi % world_size == 0:
        assert zero1_bytes == ddp_bytes


def _zero_grad_styles():
    model, optimizer = prepare(MLP(SIZES, seed=0), torch.optim.AdamW, stage=1, **ADAMW)
    for i, batch in enumerate(mlp_batches()):
        mlp_loss(model, shard_batch(batch, dist.get_rank(), dist.get_world_size())).backward()
        optimizer.step()
        (model.zero_grad if i % 2 else optimizer.zero_grad)()  # set_to_none on the model's side too
    return weights(model)


def test_model_zero_grad_does_not_lose_gradients():
    assert_close(launch(_zero_grad_styles, 2, timeout=60), single_process()[0])


def _prepare_error(**kwargs):
    arguments = dict(model=MLP(SIZES), optimizer_class=torch.optim.AdamW, stage=1, lr=1e-3)
    arguments.update(kwargs)
    with pytest.raises((ValueError, TypeError, RuntimeError)) as error:
        prepare(**arguments)
    return str(error.value)


def _prepare_errors():
    return {
        "stage 7": _prepare_error(stage=7),
        "LBFGS": _prepare_error(optimizer_class=torch.optim.LBFGS),
        "instance": _prepare_error(optimizer_class=torch.optim.AdamW(MLP(SIZES).parameters())),
        "float16": _prepare_error(param_dtype=torch.float16),
        "float64 model": _prepare_error(model=MLP(SIZES).double()),
        "typo": _prepare_error(learning_rate=1e-3),
        "bucket at stage 1": _prepare_error(bucket_numel=100),
        "clipping at stage 0": _prepare_error(stage=0, max_grad_norm=1.0),
    }


def test_prepare_refuses_what_it_cannot_do_and_names_the_fix():
    with pytest.raises(RuntimeError, match="zero_lab.launch"):
        prepare(MLP(SIZES), torch.optim.AdamW, stage=1)  # no process group here
    errors = launch(_prepare_errors, 1, timeout=60)[0]
    assert "0 = DDP" in errors["stage 7"]
    assert "torch.optim.AdamW" in errors["LBFGS"] and "stage=0" in errors["LBFGS"]
    assert "class" in errors["instance"]
    assert "bfloat16" in errors["float16"]
    assert "model.float()" in errors["float64 model"]
    assert "learning_rate" in errors["typo"] and "'lr'" in errors["typo"]
    assert "stage 2" in errors["bucket at stage 1"]
    assert "stage 1" in errors["clipping at stage 0"] and "clip_grad_norm_" in errors["clipping at stage 0"]


@pytest.mark.parametrize("numel, world_size, shard_numel", [(10, 3, 4), (12, 3, 4), (2, 4, 1), (1, 1, 1), (113, 4, 29)])
def test_shard_layout(numel, world_size, shard_numel):
    layout = ShardLayout(numel, world_size)
    assert layout.shard_numel == shard_numel and layout.padded_numel == world_size * shard_numel
    assert [layout.shard(r) for r in range(world_size)] == [(r * shard_numel, (r + 1) * shard_numel) for r in range(world_size)]
    assert sum(layout.real_numel(r) for r in range(world_size)) == numel


# Typical wrong answers to the exercises lose points: the notebook's definitions with one solution
# replaced, then one graded cell run as nbgrader runs it (grading the whole notebook is test_grading.py's job).


MUTANTS = {
    "all-reduce and slice": ("step_collectives",
                             "    dist.reduce_scatter_single(shard, flat_grad, group=group)\n    return shard.div_(world_size)",
                             "    full = flat_grad.clone()\n    dist.all_reduce(full, group=group)\n"
                             "    return full.chunk(world_size)[dist.get_rank(group)].div(world_size)"),
    "all-gather the stale bf16 slice": ("bf16_path", "all_gather_params(group.flat_param, group.master, self.process_group)\n        ### END SOLUTION\n        return",
                                        "start, stop = group.layout.shard(self.rank)\n            all_gather_params("
                                        "group.flat_param, group.flat_param[start:stop].clone(), self.process_group)\n        ### END SOLUTION\n        return"),
    "state_dict saves views": ("checkpoint", '"masters": [g.master.detach().clone() for g in self.groups]',
                               '"masters": [g.master.detach() for g in self.groups]'),
}



@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_typical_wrong_answers_lose_points(mutant):
    namespace, cell = graded_cell_with("03_zero1", *MUTANTS[mutant])
    with pytest.raises((AssertionError, zero_lab.RankFailed)):
        exec(cell, namespace)
