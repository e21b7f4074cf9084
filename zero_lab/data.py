"""Deterministic synthetic data, generated on the spot from a seed (nothing is downloaded).

    for tokens, targets in token_batches(num_batches=10, batch_size=8, block_size=32, vocab_size=64):
        logits, loss = gpt(tokens, targets)

    for x, y in regression_batches(num_batches=10, batch_size=32, in_features=16, out_features=4):
        loss = F.mse_loss(mlp(x), y)

Data parallelism splits each *global* batch between ranks:

    tokens_r, targets_r = shard_batch((tokens, targets), rank, world_size)

Every rank generates the same global batches from the same seed and keeps its own rows, so
the shards of all ranks, concatenated in rank order, are exactly the batch a single process
sees. That is what lets a lesson compare N-rank training with one process bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def token_batches(
    num_batches: int, batch_size: int, block_size: int, vocab_size: int, seed: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (tokens, targets), each (batch_size, block_size) int64, targets = tokens shifted by one.

    The text is a random walk on a fixed "successor" table (drawn from the seed): each token is
    followed by its successor 90% of the time and by a uniformly random token otherwise. A
    model can learn it, so its loss falls below log(vocab_size) and training visibly works.
    """
    generator = torch.Generator().manual_seed(seed)
    successor = torch.randperm(vocab_size, generator=generator)
    for _ in range(num_batches):
        text = torch.empty(batch_size, block_size + 1, dtype=torch.long)
        text[:, 0] = torch.randint(vocab_size, (batch_size,), generator=generator)
        for t in range(1, block_size + 1):
            random_tokens = torch.randint(vocab_size, (batch_size,), generator=generator)
            follow_rule = torch.rand(batch_size, generator=generator) < 0.9
            text[:, t] = torch.where(follow_rule, successor[text[:, t - 1]], random_tokens)
        yield text[:, :-1].contiguous(), text[:, 1:].contiguous()


def regression_batches(
    num_batches: int, batch_size: int, in_features: int, out_features: int, seed: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (x, y) with y = x @ W + 0.1 * noise for a fixed W drawn from the seed."""
    generator = torch.Generator().manual_seed(seed)
    true_weight = torch.randn(in_features, out_features, generator=generator)
    for _ in range(num_batches):
        x = torch.randn(batch_size, in_features, generator=generator)
        noise = torch.randn(batch_size, out_features, generator=generator)
        yield x, x @ true_weight + 0.1 * noise


def shard_batch(batch, rank: int, world_size: int):
    """Rank `rank`'s rows of a global batch (a tensor or a tuple of tensors, split along dim 0).

    The global batch size must be a multiple of world_size: with equal shards, the mean of the
    ranks' mean losses is the global mean loss, so averaged gradients equal one process's.
    """
    if isinstance(batch, (tuple, list)):
        return tuple(shard_batch(tensor, rank, world_size) for tensor in batch)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    global_size = batch.shape[0]
    if global_size % world_size != 0:
        raise ValueError(f"global batch of {global_size} rows does not split evenly over {world_size} ranks")
    shard_size = global_size // world_size
    return batch[rank * shard_size:(rank + 1) * shard_size]
