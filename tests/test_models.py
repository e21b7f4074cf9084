"""Models and synthetic data are deterministic, and rank shards rebuild the global batch."""

import torch

from zero_lab.data import regression_batches, shard_batch, token_batches
from zero_lab.models import GPT, MLP, GPTConfig

SMALL = GPTConfig(vocab_size=32, n_layer=2, n_head=2, n_embd=16, block_size=8)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_models_are_deterministic_from_the_seed_and_leave_the_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    gpt_a, gpt_b, gpt_c = GPT(SMALL, seed=0), GPT(SMALL, seed=0), GPT(SMALL, seed=1)
    mlp_a, mlp_b = MLP([4, 8, 2], seed=5), MLP([4, 8, 2], seed=5)
    assert torch.equal(torch.rand(3), expected_next)
    assert same_weights(gpt_a, gpt_b) and not same_weights(gpt_a, gpt_c)
    assert same_weights(mlp_a, mlp_b)


def test_gpt_ties_the_head_to_the_token_embedding():
    model = GPT(SMALL)
    assert model.lm_head.weight is model.transformer.wte.weight
    names = [name for name, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # parameters() yields the shared tensor once
    assert model.num_params() == sum(p.numel() for p in model.parameters())


def test_gpt_forward_and_backward_shapes():
    model = GPT(SMALL)
    tokens, targets = next(token_batches(1, batch_size=3, block_size=8, vocab_size=32))
    logits, loss = model(tokens, targets)
    assert logits.shape == (3, 8, 32)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    _, no_loss = model(tokens)
    assert no_loss is None


def test_mlp_widths():
    model = MLP(sizes=[5, 7, 3])
    assert model(torch.randn(4, 5)).shape == (4, 3)
    assert model.num_params() == 5 * 7 + 7 + 7 * 3 + 3


def test_data_is_deterministic_from_the_seed():
    def tokens(seed):
        return [x for x, _ in token_batches(2, 4, 8, 32, seed=seed)]

    assert all(torch.equal(a, b) for a, b in zip(tokens(0), tokens(0)))
    assert not torch.equal(tokens(0)[0], tokens(1)[0])
    x, y = next(token_batches(1, 4, 8, 32))
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
    first = list(regression_batches(2, 6, 3, 2, seed=7))
    second = list(regression_batches(2, 6, 3, 2, seed=7))
    assert all(torch.equal(a, b) for pair in zip(first, second) for a, b in zip(*pair))


def test_shards_of_a_global_batch_concatenate_to_it():
    for world_size in (1, 2, 3, 4):
        x, y = next(regression_batches(1, batch_size=12, in_features=3, out_features=2))
        shards = [shard_batch((x, y), rank, world_size) for rank in range(world_size)]
        assert torch.equal(torch.cat([s[0] for s in shards]), x)
        assert torch.equal(torch.cat([s[1] for s in shards]), y)


def test_uneven_shards_are_refused():
    x = torch.zeros(10, 3)
    try:
        shard_batch(x, 0, 3)
    except ValueError:
        return
    raise AssertionError("10 rows over 3 ranks should be refused")
