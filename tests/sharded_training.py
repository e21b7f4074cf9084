"""Scaffolding shared by the ZeRO lesson tests (test_lesson03.py, test_lesson04.py).

The models, data and losses both lessons train, the single-process baseline they must match,
and a `train` loop that works on one process and inside `zero_lab.launch`.
"""

import contextlib
import math

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
NO_DECAY_LR = 3e-2  # gpt_groups' biases and LayerNorms
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


def adamw_drift(lrs, betas=(0.9, 0.999), first_step=1) -> float:
    """How far apart two AdamW runs (steps first_step, first_step + 1, ... at lrs) may put an element whose exact
    gradient is zero: what they compute there is rounding noise, which the step divides by its own root mean square,
    so step t moves it by up to lr_t * sqrt(sum_i a_i^2 / b_i), a and b the weights of the bias-corrected moments
    (Cauchy-Schwarz; 1.04 at t = 10), either way, as the rounding says. Decoupled weight decay only shrinks the gap."""
    beta1, beta2 = betas
    drift = 0.0
    for t, lr in enumerate(lrs, first_step):
        a = [(1 - beta1) * beta1 ** (t - i) / (1 - beta1 ** t) for i in range(1, t + 1)]
        b = [(1 - beta2) * beta2 ** (t - i) / (1 - beta2 ** t) for i in range(1, t + 1)]
        drift += lr * math.sqrt(sum(x * x / y for x, y in zip(a, b)))
    return 2 * drift


def key_biases(config=TINY_GPT) -> dict:
    """{name: index} of the GPT's elements whose gradient is zero in exact arithmetic: the key third of each block's
    c_attn.bias (a number added to every score of a query leaves its softmax as it was)."""
    keys = slice(config.n_embd, 2 * config.n_embd)
    return {f"transformer.h.{i}.attn.c_attn.bias": keys for i in range(config.n_layer)}


def assert_close(per_rank, expected, atol=1e-6, rtol=1e-5, noise=None):
    """Each rank's weights against `expected`. noise: {name: (index, bound)}, elements whose exact gradient is zero,
    compared within `bound` (adamw_drift) and left out of the rest's comparison."""
    # Default: another order of the ranks' fp32 sums changes a gradient by a few ulps (2^-23 relative), and AdamW
    # carries a relative error of its gradient into its update at most doubled: rtol 1e-5 is ~80 ulps of the weights.
    for rank, got in enumerate(per_rank):
        for name, value in expected.items():
            mine = got[name]
            if name in (noise or {}):
                index, bound = noise[name]
                torch.testing.assert_close(mine[index], value[index], atol=bound, rtol=0,
                                           msg=lambda m: f"rank {rank}, {name}[{index}], zero exact gradient: {m}")
                rest = torch.ones_like(value, dtype=torch.bool)
                rest[index] = False
                mine, value = mine[rest], value[rest]
            torch.testing.assert_close(mine, value, atol=atol, rtol=rtol, msg=lambda m: f"rank {rank}, {name}: {m}")


def gpt_groups(model):
    """Frozen position embedding, no weight decay (and a larger lr) for biases and LayerNorms."""
    model.transformer.wpe.weight.requires_grad_(False)
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": NO_DECAY_LR}]


def key_bias_noise(lr, steps=STEPS, config=TINY_GPT) -> dict:
    """`assert_close`'s noise= for the GPT trained `steps` AdamW steps at `lr`: its key biases, within adamw_drift."""
    return {name: (index, adamw_drift([lr] * steps)) for name, index in key_biases(config).items()}


def gpt_groups_noise(steps=STEPS) -> dict:
    """`key_bias_noise` of `gpt_groups`: the biases are in the no-decay group."""
    return key_bias_noise(NO_DECAY_LR, steps)


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
