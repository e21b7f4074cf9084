"""Lesson 06, ZeRO-Offload: stage 2 (and 1) with the update on the host; the delayed update (DPU)."""

import io
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from graded_cells import assert_mutant_fails
from sharded_training import (ADAMW, SIZES, TINY_GPT, assert_close, gpt_batches, gpt_groups_noise, gpt_loss,
                              gpt_with_groups, gpt_with_groups_single_process, mlp_batches, mlp_loss, train, weights)
from zero_lab import CommLedger, launch
from zero_lab.data import shard_batch
from zero_lab.memory_ledger import TransferLedger, model_state_bytes
from zero_lab.models import GPT, MLP
from zero_lab.cpu_adam import compiled_adam_, compiled_adamw_step, cpu_adam_
from zero_lab.prepare import prepare
from zero_lab.zero1 import ShardLayout

needs_c_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None,
                                      reason="no C compiler: the offload optimizers fall back to cpu_adam_")


def _train_mlp(stage, micro_steps=1, **options):
    model, optimizer = prepare(MLP(SIZES, seed=0), torch.optim.AdamW, stage=stage, **ADAMW, **options)
    train(model, optimizer, mlp_batches(), mlp_loss, micro_steps)
    if hasattr(optimizer, "flush"):
        optimizer.flush()
    return weights(model), [g.master.clone() for g in optimizer.groups], type(optimizer).__name__


def _with_and_without_offload(stage, micro_steps, options, cpu_adam="torch"):
    return (_train_mlp(stage, micro_steps, **options),
            _train_mlp(stage, micro_steps, offload="cpu", cpu_adam=cpu_adam, **options))


@pytest.mark.parametrize("world_size, stage, micro_steps, options", [
    (1, 2, 3, dict(bucket_numel=20)),
    (2, 2, 1, dict(bucket_numel=9, param_dtype=torch.bfloat16, max_grad_norm=0.5)),
    (3, 2, 3, dict(bucket_numel=9, max_grad_norm=0.5)),  # uneven shards (113 elements), accumulation, clipping
    (4, 2, 1, dict(bucket_numel=1, param_dtype=torch.bfloat16)),
    (3, 1, 2, dict(param_dtype=torch.bfloat16, max_grad_norm=0.5)),
])
def test_without_dpu_it_is_stage_1_or_2_bit_for_bit(world_size, stage, micro_steps, options):
    for (plain, plain_masters, _), (offloaded, masters, kind) in launch(
            _with_and_without_offload, world_size, stage, micro_steps, options, timeout=60):
        assert kind == f"Zero{stage}Offload"
        for name in plain:
            assert torch.equal(plain[name], offloaded[name]), name
        assert all(torch.equal(a, b) for a, b in zip(plain_masters, masters)), "fp32 masters differ"


def _which_adam(cpu_adam):
    return prepare(MLP(SIZES), torch.optim.AdamW, stage=2, offload="cpu", cpu_adam=cpu_adam, lr=1e-3)[1].adam.__name__


@needs_c_compiler
def test_the_compiled_cpu_adam_is_the_default_and_within_fp32_rounding_of_stage_2():
    # Its sqrt is exactly rounded; torch's for-loop AdamW (stage 2's) takes MKL's, sometimes 1 ulp off.
    assert launch(_which_adam, 1, "compiled", timeout=60) == ["compiled_adam_"]
    assert launch(_which_adam, 1, "torch", timeout=60) == ["cpu_adam_"]
    for (plain, plain_masters, _), (offloaded, masters, _) in launch(
            _with_and_without_offload, 3, 2, 1, dict(bucket_numel=9, max_grad_norm=0.5), "compiled", timeout=60):
        assert_close([offloaded], plain, atol=1e-6, rtol=1e-5)
        assert_close([dict(enumerate(masters))], dict(enumerate(plain_masters)), atol=1e-6, rtol=1e-5)


def test_bf16_accumulation_on_the_host_is_within_rounding_of_stage_2():
    # Stage 2 accumulates micro-steps in a bf16 shard; the host's shard is fp32: not the same sums.
    for (plain, _, _), (offloaded, _, _) in launch(_with_and_without_offload, 3, 2, 2,
                                                     dict(bucket_numel=20, param_dtype=torch.bfloat16), timeout=60):
        assert_close([offloaded], plain, atol=2e-2, rtol=2e-2)


def _delayed_reference(warmup_steps):
    """One process, the delayed algorithm: forward and backward on `model`, AdamW on `master`."""
    model, master = MLP(SIZES, seed=0), MLP(SIZES, seed=0)
    optimizer = torch.optim.AdamW(master.parameters(), **ADAMW)

    def upload():
        for p, q in zip(model.parameters(), master.parameters()):
            p.data.copy_(q.data)

    for step, batch in enumerate(mlp_batches(), start=1):
        mlp_loss(model, batch).backward()
        for p, q in zip(model.parameters(), master.parameters()):
            q.grad, p.grad = p.grad, None
        if step > warmup_steps:
            upload()  # step - 1's parameters go up; this step's update overlaps the next step
        optimizer.step()
        optimizer.zero_grad()
        if step <= warmup_steps:
            upload()
    upload()  # flush
    return weights(model)


@pytest.mark.parametrize("world_size, stage, warmup_steps", [(3, 2, 2), (2, 1, 0)])
def test_dpu_is_the_delayed_algorithm(world_size, stage, warmup_steps):
    options = dict(bucket_numel=9) if stage == 2 else {}
    results = launch(_train_mlp, world_size, stage, offload="cpu", dpu_warmup_steps=warmup_steps, timeout=60, **options)
    expected = _delayed_reference(warmup_steps)
    assert_close([w for w, _, _ in results], expected)
    undelayed = launch(_train_mlp, 1, 2, offload="cpu", timeout=60)[0][0]
    assert any(not torch.equal(expected[name], undelayed[name]) for name in expected), "the delay must show"


def test_param_groups_frozen_and_tied_parameters_with_dpu_warmup_beyond_the_run():
    expected, frozen_before = gpt_with_groups_single_process()
    results = launch(gpt_with_groups, 3, 2, bucket_numel=64, offload="cpu", dpu_warmup_steps=100, timeout=60)
    assert_close([w for w, _, _ in results], expected, noise=gpt_groups_noise())  # key biases within AdamW's drift
    for w, tied, _ in results:
        assert tied and torch.equal(w["transformer.wpe.weight"], frozen_before)


def _bytes(stage, bucket_numel):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    options = dict(bucket_numel=bucket_numel) if stage == 2 else {}
    model, optimizer = prepare(GPT(TINY_GPT, seed=0), torch.optim.AdamW, stage=stage, offload="cpu",
                               param_dtype=torch.bfloat16, lr=1e-3, **options)
    batch = shard_batch(gpt_batches(1)[0], rank, world_size)
    for _ in range(2):  # the second step is measured
        with TransferLedger() as moved, CommLedger() as sent:
            gpt_loss(model, batch).backward()
            after_backward = model_state_bytes(model, optimizer, placement="device").bytes
            optimizer.step()
        optimizer.zero_grad()
    return (after_backward, model_state_bytes(model, optimizer, placement="device").bytes,
            model_state_bytes(model, optimizer, placement="host").bytes, moved.bytes, sent.summary())


@pytest.mark.parametrize("world_size, stage", [(1, 2), (2, 2), (3, 2), (4, 2), (3, 1)])
def test_device_2psi_host_16psi_over_nd_and_2psi_over_nd_each_way(world_size, stage):
    padded = ShardLayout(GPT(TINY_GPT).num_params(), world_size).padded_numel
    shard = padded // world_size
    for after_backward, device, host, moved, sent in launch(_bytes, world_size, stage, 64, timeout=60):
        gradients = 0 if stage == 2 else 2 * padded  # stage 1 keeps the full bf16 gradient on the device
        assert after_backward == device == {"parameters": 2 * padded, "gradients": gradients,
                                            "master_params": 0, "optimizer_states": 0}
        assert host == {"parameters": 0, "gradients": 4 * shard, "master_params": 4 * shard, "optimizer_states": 8 * shard}
        assert moved == {"to_host": 2 * shard, "to_device": 2 * shard}
        if world_size > 1:  # between ranks, stage 2's bytes: a reduce-scatter and an all-gather of the padded buffer
            assert set(sent) == {"reduce_scatter", "all_gather"}
            assert sent["all_gather"]["sent_bytes"] == sent["reduce_scatter"]["sent_bytes"] == 2 * (world_size - 1) * shard


def _resume(stop_after):
    def fresh(seed):
        return prepare(MLP(SIZES, seed=seed), torch.optim.AdamW, stage=2, offload="cpu", param_dtype=torch.bfloat16,
                       bucket_numel=20, max_grad_norm=1.0, **ADAMW)

    batches = mlp_batches()
    model, optimizer = fresh(seed=0)
    if stop_after is None:
        train(model, optimizer, batches, mlp_loss)
        return weights(model), None
    train(model, optimizer, batches[:stop_after], mlp_loss)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    model, optimizer = fresh(seed=123)
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    train(model, optimizer, batches[stop_after:], mlp_loss)
    return weights(model), optimizer.consolidated_state_dict(dst=0)


def test_resume_is_the_same_as_never_stopping_and_consolidates():
    straight = launch(_resume, 3, None, timeout=60)
    resumed = launch(_resume, 3, 4, timeout=60)
    for (w_straight, _), (w_resumed, _) in zip(straight, resumed):
        assert all(torch.equal(w_straight[name], w_resumed[name]) for name in w_straight)
    model = MLP(SIZES)
    model.load_state_dict(resumed[0][1]["model"])
    torch.optim.AdamW(model.parameters(), **ADAMW).load_state_dict(resumed[0][1]["optimizer"])


def _prepare_errors():
    with pytest.raises(ValueError, match='offload must be "cpu" .*"nvme" .*or None'):
        prepare(MLP(SIZES), torch.optim.AdamW, stage=2, offload="disk", lr=1e-3)
    with pytest.raises(ValueError, match='offload="nvme" is ZeRO-Infinity for stage 3 .*use stage=3'):
        prepare(MLP(SIZES), torch.optim.AdamW, stage=2, offload="nvme", lr=1e-3)
    with pytest.raises(TypeError, match="only apply with offload"):
        prepare(MLP(SIZES), torch.optim.AdamW, stage=2, dpu_warmup_steps=40, lr=1e-3)
    with pytest.raises(TypeError, match="offload works with stages 1 and 2 .*or stage=0 without it"):
        prepare(MLP(SIZES), torch.optim.AdamW, stage=0, offload="cpu", lr=1e-3)
    with pytest.raises(ValueError, match="dpu_warmup_steps"):
        prepare(MLP(SIZES), torch.optim.AdamW, stage=2, offload="cpu", dpu_warmup_steps=-1, lr=1e-3)
    with pytest.raises(ValueError, match='offload="cpu" is ZeRO-Offload for stages 1 and 2 .*offload="nvme"'):
        prepare(MLP(SIZES), torch.optim.AdamW, stage=3, offload="cpu", lr=1e-3)
    with pytest.raises(ValueError, match='cpu_adam must be "compiled"'):
        prepare(MLP(SIZES), torch.optim.AdamW, stage=2, offload="cpu", cpu_adam="fast", lr=1e-3)
    model, optimizer = prepare(MLP(SIZES), torch.optim.AdamW, stage=1, lr=1e-3)
    with pytest.raises(ValueError, match="needs an optimizer that offloads"):
        model_state_bytes(model, optimizer, placement="device")
    return True


def test_prepare_refuses_bad_offload_options():
    assert launch(_prepare_errors, 1, timeout=60) == [True]


@pytest.mark.parametrize("numel, threads, chunk_numel", [(5000, 1, 1024), (3 * 2**16 + 17, 2, 2**16)])
def test_cpu_adam_is_torch_adamw_bit_for_bit(numel, threads, chunk_numel):
    generator = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(numel, generator=generator))
    grads = [torch.randn(numel, generator=generator) for _ in range(3)]
    ours, m, v = param.detach().clone(), torch.zeros(numel), torch.zeros(numel)
    optimizer = torch.optim.AdamW([param], foreach=False, **ADAMW)
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    for step, grad in enumerate(grads, start=1):
        param.grad = grad
        optimizer.step()
        cpu_adam_(ours, grad, m, v, step, betas=(0.9, 0.999), eps=1e-8, pool=pool, chunk_numel=chunk_numel, **ADAMW)
    state = optimizer.state[param]
    assert torch.equal(ours, param.detach()) and torch.equal(m, state["exp_avg"]) and torch.equal(v, state["exp_avg_sq"])


def _torch_clip_and_scheduler(stage, offload):
    options = dict(offload="cpu", cpu_adam="torch") if offload else {}
    model, optimizer = prepare(MLP(SIZES, seed=0), torch.optim.AdamW, stage=stage, **ADAMW, **options)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    norms = []
    for batch in mlp_batches():
        mlp_loss(model, shard_batch(batch, rank, world_size)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return weights(model), norms


@pytest.mark.parametrize("stage", [1, 2])
def test_torch_clip_grad_norm_and_lr_schedulers_work_as_without_offload(stage):
    plain = launch(_torch_clip_and_scheduler, 3, stage, False, timeout=60)
    offloaded = launch(_torch_clip_and_scheduler, 3, stage, True, timeout=60)
    for (w_plain, n_plain), (w_offloaded, n_offloaded) in zip(plain, offloaded):
        assert n_plain == n_offloaded and max(n_plain) > 0.5, "the same global norms, and the test must clip"
        assert all(torch.equal(w_plain[name], w_offloaded[name]) for name in w_plain)


def _backward_twice_without_zero_grad():
    model, optimizer = prepare(MLP(SIZES, seed=0), torch.optim.AdamW, stage=2, offload="cpu", lr=1e-3)
    batch = shard_batch(mlp_batches(1)[0], dist.get_rank(), dist.get_world_size())
    mlp_loss(model, batch).backward()
    optimizer.step()
    with pytest.raises(RuntimeError, match="without optimizer.zero_grad"):
        mlp_loss(model, batch).backward()
    return True


def test_backward_after_step_without_zero_grad_raises_as_in_stage_2():
    assert launch(_backward_twice_without_zero_grad, 2, timeout=60) == [True, True]


@needs_c_compiler
@pytest.mark.parametrize("numel, threads, betas", [(5000, 1, (0.9, 0.999)), (3 * 2**18 + 17, 2, (0.3, 0.95))])
def test_compiled_adam_is_torch_fused_adamw(numel, threads, betas):
    generator = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(numel, generator=generator))
    grads = [torch.randn(numel, generator=generator) * scale for scale in (1.0, 1e-3, 1e3)]
    ours, m, v = param.detach().clone(), torch.zeros(numel), torch.zeros(numel)
    optimizer = torch.optim.AdamW([param], fused=True, betas=betas, **ADAMW)
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    for step, grad in enumerate(grads, start=1):
        param.grad = grad
        optimizer.step()
        compiled_adam_(ours, grad, m, v, step, betas=betas, eps=1e-8, pool=pool, **ADAMW)
    state = optimizer.state[param]
    for name, got, want in [("param", ours, param.detach()), ("exp_avg", m, state["exp_avg"]), ("exp_avg_sq", v, state["exp_avg_sq"])]:
        if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):  # torch's vectorized kernel: its FMAs are ours
            assert torch.equal(got, want), name
        else:  # torch's scalar kernel may round a product our fmaf fuses: per step, one rounding of the largest value
            torch.testing.assert_close(got, want, rtol=0, atol=len(grads) * 2 ** -23 * want.abs().max().item(), msg=name)
    with pytest.raises(ValueError, match="contiguous fp32"):
        compiled_adam_(ours[::2], grad[::2], m[::2], v[::2], 4, betas=betas, eps=1e-8, **ADAMW)


def test_without_a_c_compiler_the_host_runs_cpu_adam_with_a_notice(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built there yet
    compiled_adamw_step.cache_clear()
    try:
        with pytest.warns(UserWarning, match="no compiled CPU Adam .*cpu_adam_"):
            assert compiled_adamw_step() is None
        with pytest.raises(RuntimeError, match="needs a C compiler"):
            compiled_adam_(*(torch.zeros(4) for _ in range(4)), 1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    finally:
        compiled_adamw_step.cache_clear()


def _all_gathers_while_loading(stage):
    """Load a checkpoint into a fresh offload optimizer, recording whether each all-gather's input
    lies in the device's flat parameter buffer (nccl on CUDA takes device tensors only)."""
    def fresh(seed):
        options = dict(bucket_numel=20) if stage == 2 else {}
        return prepare(MLP(SIZES, seed=seed), torch.optim.AdamW, stage=stage, offload="cpu",
                       param_dtype=torch.bfloat16, **ADAMW, **options)

    model, optimizer = fresh(seed=0)
    train(model, optimizer, mlp_batches(2), mlp_loss)
    saved, saved_weights = optimizer.state_dict(), weights(model)
    model, optimizer = fresh(seed=99)
    device_buffers = {g.flat_param.untyped_storage().data_ptr() for g in optimizer.groups}
    inputs_on_device, all_gather_single = [], dist.all_gather_single

    def spy(output, input, *args, **kwargs):
        inputs_on_device.append(input.untyped_storage().data_ptr() in device_buffers)
        return all_gather_single(output, input, *args, **kwargs)

    dist.all_gather_single = spy
    try:
        optimizer.load_state_dict(saved)
    finally:
        dist.all_gather_single = all_gather_single
    same_masters = all(torch.equal(g.master, m) for g, m in zip(optimizer.groups, saved["masters"]))
    return inputs_on_device, same_masters, all(torch.equal(saved_weights[n], w) for n, w in weights(model).items())


@pytest.mark.parametrize("stage", [1, 2])
def test_loading_a_checkpoint_all_gathers_on_the_device(stage):
    for inputs_on_device, same_masters, same_weights in launch(_all_gathers_while_loading, 2, stage, timeout=60):
        assert inputs_on_device and all(inputs_on_device), "the all-gather's input must be the device's buffer, not a host tensor"
        assert same_masters and same_weights


MUTANTS = {  # typical mistakes that compute the right numbers and must still lose the speed or DPU points
    "a chunk far smaller than chunk_numel (a Python loop over small pieces)": (
        "    beta1, beta2 = betas\n", "    beta1, beta2 = betas\n    chunk_numel = min(chunk_numel, 64)\n", "cpu_adam"),
    "the whole tensor in one chunk (no cache blocking)": (
        "    starts = range(0, param.numel(), chunk_numel)\n",
        "    chunk_numel = param.numel()\n    starts = range(0, param.numel(), chunk_numel)\n", "cpu_adam"),
    "step() waits for its delayed update": (
        "            self.pending = self.worker.submit(self.update, grads)\n",
        "            self.pending = self.worker.submit(self.update, grads)\n            self.pending.result()\n",
        "dpu_schedule"),
    "the delayed update runs on the calling thread": (
        "            self.pending = self.worker.submit(self.update, grads)\n",
        "            self.pending = Future()\n            self.update(grads)\n            self.pending.set_result(None)\n",
        "dpu_schedule"),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_typical_mistakes_fail_their_graded_cell(mutant):
    assert_mutant_fails("06_offload", *MUTANTS[mutant])
