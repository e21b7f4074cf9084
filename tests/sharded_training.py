"""Scaffolding shared by the ZeRO lesson tests (test_lesson03.py, test_lesson04.py).

The models, data and losses both lessons train, the single-process baseline they must match,
and a `train` loop that works on one process and inside `zero_lab.launch`.
"""

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zero_lab import CommLedger
from zero_lab.data import regression_batches, shard_batch, token_batches
from zero_lab.memory_ledger import model_state_bytes
from zero_lab.models import GPT, MLP, GPTConfig
from zero_lab.prepare import prepare

SIZES = [6, 9, 5]  # 113 parameters (54, 9, 45, 5), a prime: every N > 1 pads, shards cut through tensors
STEPS, GLOBAL_BATCH = 10, 12  # 12 rows split evenly over 1, 2, 3 or 4 ranks, and 3 micro-steps on 4
ADAMW = dict(lr=1e-2, weight_decay=0.1)
TINY_GPT = GPTConfig(vocab_size=29, n_layer=2, n_head=2, n_embd=8, block_size=8)


def mlp_batches(steps=STEPS):
    return list(regression_batches(steps, GLOBAL_BATCH, SIZES[0], SIZES[-1], seed=1))


def gpt_batches(steps=STEPS):
    return list(token_batches(steps, GLOBAL_BATCH, TINY_GPT.block_size, TINY_GPT.vocab_size, seed=2))


def mlp_loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)


def gpt_loss(model, batch):
    return model(*batch)[1]


def train(model, optimizer, batches, loss_fn, micro_steps=1, scheduler=None, max_norm=None):
    """One optimizer step per global batch, on this rank's shard of it (the whole batch outside
    `launch`), accumulated over `micro_steps` equal micro-batches; the LR `scheduler` steps after
    each, and torch.nn.utils.clip_grad_norm_ clips to `max_norm` before each (returns the norms)."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    norms = []
    for batch in batches:
        micro_batches = zip(*(t.chunk(micro_steps) for t in shard_batch(batch, rank, world_size)))
        for micro_batch in micro_batches:
            (loss_fn(model, micro_batch) / micro_steps).backward()
        if max_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
    return norms


def weights(model):
    model = getattr(model, "module", model)  # DDP wraps the model
    return {name: p.detach().float().clone() for name, p in model.named_parameters()}


def single_process(steps=STEPS, max_grad_norm=None, make_scheduler=None):
    """The baseline: plain torch.optim.AdamW on the whole global batch."""
    model = MLP(SIZES, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    scheduler = make_scheduler(optimizer) if make_scheduler else None
    norms = train(model, optimizer, mlp_batches(steps), mlp_loss, scheduler=scheduler, max_norm=max_grad_norm)
    return weights(model), norms


def assert_close(per_rank, expected, atol=1e-6, rtol=1e-5):
    # Default: another order of the ranks' fp32 sums changes a gradient by a few ulps (2^-23 relative), and AdamW
    # carries a relative error of its gradient into its update at most doubled: rtol 1e-5 is ~80 ulps of the weights.
    for rank, got in enumerate(per_rank):
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, atol=atol, rtol=rtol, msg=lambda m: f"rank {rank}, {name}: {m}")


def gpt_groups(model):
    """Frozen position embedding, no weight decay (and a larger lr) for biases and LayerNorms."""
    model.transformer.wpe.weight.requires_grad_(False)
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 3e-2}]


def gpt_with_groups_single_process():
    """The baseline for `gpt_with_groups`: plain torch.optim.AdamW on the whole global batches.
    Returns the weights and the frozen position embedding as it was before training."""
    model = GPT(TINY_GPT, seed=0)
    frozen_before = model.transformer.wpe.weight.detach().clone()
    optimizer = torch.optim.AdamW(gpt_groups(model), lr=1e-2)
    train(model, optimizer, gpt_batches(), gpt_loss)
    return weights(model), frozen_before


def gpt_with_groups(stage, **options):
    """Runs on every rank: the tiny GPT with `gpt_groups` through `prepare(..., stage)`. Returns the
    weights, whether the LM head still shares the embedding's tensor, and the model-state bytes."""
    model = GPT(TINY_GPT, seed=0)
    model, optimizer = prepare(model, torch.optim.AdamW, stage=stage, params=gpt_groups(model), lr=1e-2, **options)
    train(model, optimizer, gpt_batches(), gpt_loss)
    tied = model.lm_head.weight is model.transformer.wte.weight
    with getattr(optimizer, "gathered_parameters", contextlib.nullcontext)():  # stage 3: whole parameters
        got = weights(model)
    return got, tied, model_state_bytes(model, optimizer).bytes


def bytes_per_step(stage, sizes, bucket_numel=None):
    """Runs on every rank: what one training step of an MLP sends, once started. Returns the
    ledger's summary, the number of parameters and the optimizer's number of buckets (1 if none)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    options = {"bucket_numel": bucket_numel} if stage == 2 else {}
    model, optimizer = prepare(MLP(sizes, seed=0), torch.optim.AdamW, stage=stage, lr=1e-3, **options)
    x = torch.randn(4 * world_size, sizes[0])
    for step in range(2):  # the second step is measured: no start-up traffic in it
        with CommLedger() as ledger:
            model(shard_batch(x, rank, world_size)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    return ledger.summary(), sum(p.numel() for p in model.parameters()), len(getattr(optimizer, "buckets", [None]))
