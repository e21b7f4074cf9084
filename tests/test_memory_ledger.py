"""The memory ledger counts model-state bytes from live tensors, each storage once."""

import pytest
import torch

from zero_lab.data import token_batches
from zero_lab.memory_ledger import activation_bytes, model_state_bytes
from zero_lab.models import GPT, MLP, GPTConfig

SMALL = GPTConfig(vocab_size=32, n_layer=2, n_head=2, n_embd=16, block_size=8)


def adam_step(model, optimizer, tokens, targets):
    optimizer.zero_grad(set_to_none=True)
    model(tokens, targets)[1].backward()
    optimizer.step()


def test_tied_weights_are_counted_once():
    model = GPT(SMALL)
    unique = sum(p.numel() for p in model.parameters())
    assert model_state_bytes(model).bytes["parameters"] == 4 * unique
    # The head reuses the embedding's storage: naming both would double count without dedup.
    head = model.lm_head.weight.numel()
    assert unique + head == sum(p.numel() for m in model.modules() for p in m.parameters(recurse=False))


def test_fp32_adam_is_16_bytes_per_parameter_after_one_step():
    model = GPT(SMALL)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    assert model_state_bytes(model, optimizer).total == 4 * model.num_params()  # no grads, no state yet
    adam_step(model, optimizer, *next(token_batches(1, 2, 8, 32)))
    psi = model.num_params()
    report = model_state_bytes(model, optimizer)
    assert report.bytes == {"parameters": 4 * psi, "gradients": 4 * psi, "master_params": 0, "optimizer_states": 8 * psi}
    assert report.total == 16 * psi
    # Adam's 0-dim `step` counters (4 bytes per parameter tensor) stay outside the model states.
    assert report.bookkeeping_bytes == 4 * len(list(model.parameters()))
    assert "CPU" in report.measurement and report.cuda_allocated_bytes is None


def test_frozen_parameters_have_no_gradients():
    model = MLP([4, 8, 2])
    frozen = model.layers[0]
    for p in frozen.parameters():
        p.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    report = model_state_bytes(model, optimizer)
    trainable_numel = sum(p.numel() for p in trainable)
    assert report.bytes["parameters"] == 4 * model.num_params()
    assert report.bytes["gradients"] == 4 * trainable_numel
    assert report.bytes["optimizer_states"] == 8 * trainable_numel


def test_master_copies_in_the_optimizer_are_counted_as_master_params():
    model = MLP([4, 8, 2]).to(torch.bfloat16)
    master = [p.detach().float().requires_grad_() for p in model.parameters()]
    optimizer = torch.optim.Adam(master)
    for p_master in master:
        p_master.grad = torch.zeros_like(p_master)
    optimizer.step()
    psi = model.num_params()
    # While the fp32 gradient copies exist they are gradients too ...
    report = model_state_bytes(model, optimizer)
    assert report.bytes == {"parameters": 2 * psi, "gradients": 4 * psi, "master_params": 4 * psi, "optimizer_states": 8 * psi}
    # ... and once freed, the bf16 parameters, fp32 master copies and Adam states remain.
    for p_master in master:
        p_master.grad = None
    report = model_state_bytes(model, optimizer)
    assert report.bytes == {"parameters": 2 * psi, "gradients": 0, "master_params": 4 * psi, "optimizer_states": 8 * psi}


def test_optimizers_can_report_their_own_tensors():
    flat = torch.zeros(100)

    class ShardedOptimizer:
        def model_state_tensors(self):
            # Two views into one buffer: one storage, counted once.
            return {"parameters": [flat[:50], flat[50:]], "optimizer_states": [torch.zeros(10, dtype=torch.float64)]}

    report = model_state_bytes(MLP([4, 2]), ShardedOptimizer())
    assert report.bytes == {"parameters": 400, "gradients": 0, "master_params": 0, "optimizer_states": 80}

    class Misspelt:
        def model_state_tensors(self):
            return {"grads": [flat]}

    with pytest.raises(ValueError, match="unknown categories"):
        model_state_bytes(MLP([4, 2]), Misspelt())


def test_activations_grow_with_batch_and_exclude_weights():
    model = GPT(SMALL)

    def saved(batch_size):
        tokens, targets = next(token_batches(1, batch_size, 8, 32))
        return activation_bytes(model, lambda: model(tokens, targets)[1]).bytes

    one, two = saved(1), saved(2)
    assert 0 < one < two <= 2 * one + 64  # everything scales with batch (a few scalars do not)
    weights = 4 * model.num_params()
    with torch.no_grad():
        assert activation_bytes(model, lambda: model(*next(token_batches(1, 1, 8, 32)))[1]).bytes == 0
    assert one < weights  # tiny batch: activations are far below the weights, none of which counted


def test_cuda_allocator_switch_says_when_it_cannot_run():
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    with pytest.raises(RuntimeError, match="CUDA"):
        activation_bytes(MLP([2, 2]), lambda: None, use_cuda_allocator=True)
