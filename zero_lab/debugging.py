# Generated from solutions/11_debugging/11_debugging.ipynb by `zero-lab build`: edit the notebook, not this file.

"""Lesson 11: distributed-training failures, reproduced small, diagnosed and fixed.

Diagnosis, CAUSES, COLLECTIVES   a diagnosis as data: a cause from the vocabulary, a collective, a rank
layer_weights, shard_of          full weights from a seed; a rank's padded slice of one (ZeRO-3/FSDP storage)
gather_full                      all-gather the shards of a tensor back into the full tensor
and, case by case in the notebook's order, the helpers of each repro and its fix:
forward_every_rank_gathers (1), full_state_on_rank0 (2), clip_sharded_grads_ (3), accumulate_then_sync (4),
broadcast_model_ (5), rank_batch_indices (6), overflow_anywhere (7), sync_batch_norm (8), sync_grads_ (9),
partition_ and gathered_params (10), OpCounter and adamw_foreach_ (11), DynamicLossScaler (12),
offload_adamw_step_ (13).
"""

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.optim.adamw import adamw as functional_adamw  # the function behind torch.optim.AdamW
from torch.utils._python_dispatch import TorchDispatchMode

CAUSES = {  # in alphabetical order; several words fit no case of this lesson
    "collective-on-one-rank": "a collective was called on some ranks only (under `if rank == 0:`)",
    "collective-order-mismatch": "every rank issued the same collectives, but in different orders",
    "divergent-control-flow": "ranks ran different code paths, so they issued different collectives",
    "gradient-overflow": "the gradients really are too large for the format: the model diverged",
    "local-batch-statistics": "normalisation statistics were computed from one rank's rows only",
    "local-grad-norm": "a norm computed from one rank's part of the gradient was used as the global norm",
    "local-overflow-check": "each rank decided on its own whether the step overflowed",
    "lr-not-scaled": "the learning rate was not adapted to the global batch size",
    "missing-average": "gradients were summed over ranks where they should have been averaged",
    "never-synced": "gradients were never reduced across ranks",
    "per-parameter-loop": "a step issued a few small operations per tensor, in Python",
    "read-outside-gather": "a sharded parameter was read where only its empty placeholder exists",
    "same-seed-every-rank": "ranks drew the same random numbers (same data, same dropout masks)",
    "shape-mismatch": "ranks passed tensors of different sizes to the same collective",
    "stale-overflow-flag": "an overflow found in one step was never cleared, so later steps count as overflows too",
    "state-like-gradient": "optimizer state was created like the gradient (its device, dtype), not like the master weights",
    "sync-every-microstep": "gradients were reduced after every micro-batch of an accumulation",
    "unsynchronized-init": "ranks started training from different weights",
    "unused-parameter": "a parameter got no gradient on some rank, so that rank skipped its reduction",
    "wrong-dtype": "a tensor had the wrong precision",
}
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "gather", "barrier")


@dataclass(frozen=True)
class Diagnosis:
    """cause: a key of CAUSES; collective: the one that hung or is missing; rank: the odd one out."""

    cause: str
    collective: str | None = None
    rank: int | None = None

    def __post_init__(self):
        if self.cause not in CAUSES:
            raise ValueError(f"cause {self.cause!r} is not in the vocabulary; pick one of: {', '.join(CAUSES)}")
        if self.collective is not None and self.collective not in COLLECTIVES:
            raise ValueError(f"collective {self.collective!r}: pick one of {COLLECTIVES} or None")


def layer_weights(sizes: list[int], seed: int) -> list[torch.Tensor]:
    """Weights of a stack of bias-free linear layers sizes[0] -> sizes[1] -> ..., the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(n_out, n_in, generator=generator) / math.sqrt(n_in) for n_in, n_out in zip(sizes, sizes[1:])]


def shard_of(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """`rank`'s equal, contiguous slice of full.flatten(), zero-padded at the end: how ZeRO-3 stores a parameter."""
    flat = full.reshape(-1)
    size = -(-flat.numel() // world_size)
    padded = torch.zeros(size * world_size, dtype=flat.dtype)
    padded[:flat.numel()] = flat
    return padded[rank * size:(rank + 1) * size].clone()


def gather_full(shard: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """All-gather every rank's shard and drop the padding: the full tensor, on every rank."""
    flat = torch.empty(shard.numel() * dist.get_world_size(), dtype=shard.dtype)
    dist.all_gather_single(flat, shard)
    return flat[:math.prod(shape)].view(shape)


WIDTH = 8
SHAPES = [torch.Size([WIDTH, WIDTH])] * 3  # three layers of the same size


def is_hard(x: torch.Tensor) -> bool:
    """The branch: the middle layer refines inputs of large magnitude only."""
    return bool(x.abs().mean() > 0.5)


def rank_input(rank: int, easy_ranks: set[int], seed: int, rows: int = 4) -> torch.Tensor:
    """`rank`'s batch: small values (an easy batch) on the ranks in `easy_ranks`, large ones elsewhere."""
    generator = torch.Generator().manual_seed(seed + rank)
    return torch.randn(rows, WIDTH, generator=generator) * (0.1 if rank in easy_ranks else 2.0)


def forward_every_rank_gathers(shards: list[torch.Tensor], shapes: list[torch.Size], x: torch.Tensor) -> torch.Tensor:
    """forward_branchy's result, with the same all_gathers, in the same order, on every rank."""
    h = torch.relu(x @ gather_full(shards[0], shapes[0]).T)
    middle = gather_full(shards[1], shapes[1])  # every rank takes part, used or not
    if is_hard(x):
        h = torch.relu(h @ middle.T)
    del middle
    return h @ gather_full(shards[2], shapes[2]).T


def full_state_on_rank0(shards: list[torch.Tensor], shapes: list[torch.Size]) -> list[torch.Tensor] | None:
    """The full tensors on rank 0, None on the other ranks; every rank must call it."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    full = []
    for shard, shape in zip(shards, shapes):
        pieces = [torch.empty_like(shard) for _ in range(world_size)] if rank == 0 else None
        dist.gather(shard, pieces, dst=0)
        if rank == 0:
            full.append(torch.cat(pieces)[:math.prod(shape)].view(shape))
    return full if rank == 0 else None


def model_grads(seed: int, scale: float = 1.0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The full averaged gradient of a small model: two matrices (sharded) and two vectors (replicated)."""
    generator = torch.Generator().manual_seed(seed)
    matrices = [torch.randn(shape, generator=generator) * scale for shape in [(7, 5), (3, 7)]]
    vectors = [torch.randn(n, generator=generator) * scale for n in [7, 3]]
    return matrices, vectors


def clip_sharded_grads_(shard_grads: list[torch.Tensor], replicated_grads: list[torch.Tensor],
                        max_norm: float) -> torch.Tensor:
    """Clip by the norm of the whole gradient; return that norm (the same on every rank)."""
    squares = torch.zeros((), dtype=torch.float32)
    for g in shard_grads:
        squares += g.float().pow(2).sum()
    dist.all_reduce(squares)  # the shards' part, summed over ranks
    for g in replicated_grads:
        squares += g.float().pow(2).sum()  # whole on every rank: count once
    norm = squares.sqrt()
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in shard_grads + replicated_grads:
        g.mul_(factor)
    return norm


def small_mlp(seed: int) -> torch.nn.Sequential:
    """A 6 -> 16 -> 3 MLP, the same on every rank that passes the same seed."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def micro_batches(seed: int, rank: int, micro_steps: int, rows: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`rank`'s k micro-batches of one optimizer step: (inputs, regression targets)."""
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    return [(torch.randn(rows, 6, generator=generator), torch.randn(rows, 3, generator=generator))
            for _ in range(micro_steps)]


def accumulate_then_sync(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Accumulate the gradient of the mean MSE over `batches` locally, then average it across ranks once."""
    for x, y in batches:
        (torch.nn.functional.mse_loss(model(x), y) / len(batches)).backward()
    world_size = dist.get_world_size()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad.div_(world_size)


def broadcast_model_(model: torch.nn.Module, src: int = 0) -> None:
    """Every rank's parameters and buffers become rank `src`'s."""
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor, src=src)


def rank_batch_indices(num_samples: int, global_batch: int, step: int, seed: int, rank: int, world_size: int) -> torch.Tensor:
    """`rank`'s rows of step `step`: a block of one shuffle that every rank computes identically."""
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + step))
    per_rank = global_batch // world_size
    return order[:global_batch][rank * per_rank:(rank + 1) * per_rank]


def overflow_anywhere(grad_shard: torch.Tensor) -> bool:
    """Whether any rank's gradient shard is not finite; the same answer on every rank."""
    flag = torch.tensor([0.0 if bool(torch.isfinite(grad_shard).all()) else 1.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def sync_batch_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                    eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training-mode BatchNorm over the global batch (all ranks' rows); returns (y, mean, unbiased var)."""
    sums = torch.cat([x.sum(0), (x * x).sum(0), torch.tensor([float(x.shape[0])], dtype=x.dtype)])
    dist.all_reduce(sums)
    features = x.shape[1]
    count = sums[-1]
    mean = sums[:features] / count
    var = sums[features:2 * features] / count - mean * mean
    y = (x - mean) / torch.sqrt(var + eps) * weight + bias
    return y, mean, var * count / (count - 1)


def two_head_model(seed: int) -> torch.nn.ModuleDict:
    """A trunk, a main head and an auxiliary head of the same shape, the same on every rank."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return torch.nn.ModuleDict({"trunk": torch.nn.Linear(6, 8), "head": torch.nn.Linear(8, 3),
                                    "aux": torch.nn.Linear(8, 3)})


def two_head_loss(model: torch.nn.ModuleDict, x: torch.Tensor, y: torch.Tensor, use_aux: bool) -> torch.Tensor:
    """MSE of the main head, plus the auxiliary head's output on batches that use it."""
    h = torch.tanh(model["trunk"](x))
    out = model["head"](h) + (model["aux"](h) if use_aux else 0)
    return torch.nn.functional.mse_loss(out, y)


def sync_grads_(params: list[torch.nn.Parameter]) -> None:
    """Average gradients across ranks; unused on some ranks counts as zero there, unused everywhere stays None."""
    world_size = dist.get_world_size()
    used = torch.tensor([float(p.grad is not None) for p in params])
    dist.all_reduce(used)
    for p, users in zip(params, used.tolist()):
        if users == 0:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad.div_(world_size)


def partition_(module: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Size]]:
    """ZeRO-3 storage: keep this rank's shard of every parameter (returned by name, with its full
    shape) and leave the parameter itself an empty placeholder of shape [0]."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shards = {}
    for name, p in module.named_parameters():
        shards[name] = (shard_of(p.detach(), rank, world_size), p.shape)
        p.data = torch.empty(0, dtype=p.dtype)
    return shards


@contextmanager
def gathered_params(module: torch.nn.Module, shards: dict[str, tuple[torch.Tensor, torch.Size]]):
    """Inside the block, every parameter of `module` is full; after it, an empty placeholder again."""
    for name, p in module.named_parameters():
        shard, shape = shards[name]
        p.data = gather_full(shard, shape)
    try:
        yield module
    finally:
        for p in module.parameters():
            p.data = torch.empty(0, dtype=p.dtype)


class OpCounter(TorchDispatchMode):
    """Counts the operator calls (aten ops) issued inside the `with` block."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def adam_state(num_tensors: int, numel: int, seed: int) -> list[list[torch.Tensor]]:
    """[params, grads, exp_avgs, exp_avg_sqs]: `num_tensors` fp32 tensors of `numel` elements each."""
    generator = torch.Generator().manual_seed(seed)
    params, grads = ([torch.randn(numel, generator=generator) for _ in range(num_tensors)] for _ in range(2))
    return [params, grads, [torch.zeros(numel) for _ in range(num_tensors)], [torch.zeros(numel) for _ in range(num_tensors)]]


def adamw_foreach_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                   exp_avg_sqs: list[torch.Tensor], step: int, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                   eps: float = 1e-8, weight_decay: float = 0.01) -> None:
    """torch.optim.AdamW's update of every tensor, with a number of operator calls that does not grow with the tensors."""
    beta1, beta2 = betas
    torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, math.sqrt(1 - beta2 ** step))
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-lr / (1 - beta1 ** step))


FP16_MAX = 65504.0  # fp16's largest finite value


def overflows_fp16(t: torch.Tensor) -> bool:
    """Whether `t` would overflow an fp16 buffer: an inf or NaN, or a magnitude beyond 65504."""
    return not bool(torch.isfinite(t).all()) or bool(t.abs().max() > FP16_MAX)


def regression_batch(rank: int, step: int, seed: int, spikes: frozenset = frozenset(), rows: int = 4):
    """`rank`'s batch at `step`, targets the inputs' sum; a (rank, step) in `spikes` gets a wild label (a loss spike)."""
    generator = torch.Generator().manual_seed(seed * 10_007 + step * 101 + rank)
    x = torch.randn(rows, 6, generator=generator)
    return x, x.sum(1, keepdim=True) + (1e4 if (rank, step) in spikes else 0.0)


def train_fp16(scaler, steps: int, seed: int, spikes: frozenset = frozenset(), lr: float = 0.05):
    """Data-parallel SGD on this rank with a loss scaler: [(scale used, stepped, held-out loss after the step)]
    per step, and the final weights."""
    weight, bias = torch.zeros(1, 6, requires_grad=True), torch.zeros(1, requires_grad=True)
    held_out_x, held_out_y = regression_batch(0, -1, seed, rows=64)
    history = []
    for step in range(steps):
        x, y = regression_batch(dist.get_rank(), step, seed, spikes)
        loss = torch.nn.functional.mse_loss(x @ weight.T + bias, y)
        scale, weight.grad, bias.grad = scaler.scale, None, None
        (loss * scale).backward()
        for g in (weight.grad, bias.grad):
            dist.all_reduce(g)
            g.div_(dist.get_world_size())
        grads = scaler.unscale_or_skip([weight.grad, bias.grad])
        if grads is not None:
            with torch.no_grad():
                for p, g in zip((weight, bias), grads):
                    p -= lr * g
        with torch.no_grad():
            history.append((scale, grads is not None, torch.nn.functional.mse_loss(held_out_x @ weight.T + bias, held_out_y).item()))
    return history, [weight.detach(), bias.detach()]


class DynamicLossScaler:
    """fp16 dynamic loss scaling, GradScaler's rule: on an overflow skip the step and halve the
    scale; after `growth_interval` clean steps in a row, double it."""

    def __init__(self, scale: float = 2.0 ** 16, growth_interval: int = 4):
        self.scale, self.growth_interval = scale, growth_interval
        self.clean_steps = 0  # clean steps since the last overflow or growth
        self.skipped = 0  # steps skipped so far: worth logging on every rank

    def unscale_or_skip(self, scaled_grads: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """This step's gradients divided by the scale, or None (skip the step) when any overflows."""
        if any(overflows_fp16(g) for g in scaled_grads):  # this step's gradients, nothing older
            self.skipped += 1
            self.scale /= 2
            self.clean_steps = 0
            return None
        grads = [g / self.scale for g in scaled_grads]  # the scale they were made with, before any growth
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= 2
            self.clean_steps = 0
        return grads


OFFLOAD_SIZES = [5, 7, 3]  # two layers: 35 and 21 elements, uneven shards


def device_grads(weights: list[torch.Tensor], seed: int, step: int) -> list[torch.Tensor]:
    """Full gradients as they arrive from the accelerator (simulated: bfloat16 on the host), the same on every rank."""
    generator = torch.Generator().manual_seed(seed * 1000 + step)
    return [torch.randn(w.shape, generator=generator).bfloat16() for w in weights]


def adamw_host_(masters: list[torch.Tensor], grads: list[torch.Tensor], state: dict, lr: float = 0.01,
                weight_decay: float = 0.01) -> None:
    """One step of torch's multi-tensor AdamW over the host's lists; `state`: exp_avg, exp_avg_sq, step (lists)."""
    functional_adamw(masters, grads, state["exp_avg"], state["exp_avg_sq"], [], state["step"], foreach=True,
                     amsgrad=False, beta1=0.9, beta2=0.999, lr=lr, weight_decay=weight_decay, eps=1e-8, maximize=False)


def new_adam_state(templates: list[torch.Tensor]) -> dict:
    """Adam's state for one tensor list: zero moments made with torch.zeros_like (its device and dtype), a step count each."""
    return {"exp_avg": [torch.zeros_like(t) for t in templates], "exp_avg_sq": [torch.zeros_like(t) for t in templates],
            "step": [torch.tensor(0.0) for _ in templates]}


def placement(tensors: list[torch.Tensor]) -> list[str]:
    """Each tensor's (device, dtype) as text: the first thing to print when a step fails or drifts."""
    return [f"{t.device}/{str(t.dtype).removeprefix('torch.')}" for t in tensors]


def offload_adamw_step_(masters: list[torch.Tensor], grads_from_device: list[torch.Tensor], state: dict,
                        lr: float = 0.01, weight_decay: float = 0.01) -> None:
    """A host AdamW step over fp32 master shards, the gradients arriving on the accelerator's (device, dtype)."""
    if not state:  # the state lives where the master weights live, in their dtype
        state.update(new_adam_state(masters))
    grads = [g.to(device=m.device, dtype=m.dtype) for g, m in zip(grads_from_device, masters)]
    adamw_host_(masters, grads, state, lr=lr, weight_decay=weight_decay)
