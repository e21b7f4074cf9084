# Generated from solutions/17_parallelism_3d/17_parallelism_3d.ipynb by `zero-lab build`: edit the notebook, not this file.

"""Megatron-style tensor parallelism (lesson 17; Shoeybi et al. 2019, §3) over a tensor-parallel group.

CopyToTensorParallel      f: identity forward; backward all-reduces the input's gradient over the group
ReduceFromTensorParallel  g: forward all-reduces the partial outputs over the group; backward identity
ColumnParallelLinear      this rank's output features of a Linear (f, then the local Linear)
RowParallelLinear         this rank's input features of a Linear (the local product, g, then the whole bias)
TensorParallelAttention   causal self-attention with its heads split over the group
tensor_parallel_gpt       the course GPT with every block's attention and MLP split over the group (in place)
torch_tensor_parallel_gpt the same split with torch.distributed.tensor.parallel (DTensor), to compare
zero_on_mesh, my_rows     the GPT split over a mesh's tp group, ZeRO over its dp group; this rank's rows of a batch
clip_grad_norm_on_mesh    the global gradient norm over a mesh's dp and tp groups, and the clipping (stages 1, 2)
TensorParallelLinears     Linear pairs split over the tp group, for counting at scale in lesson 13's fake world
largest_on_mesh           the paper's Table 2 at MP-way model parallelism: the widest model that fits, counted
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

if __name__ != "__main__":  # in the notebook, the Mesh of your cells above
    from zero_lab.mesh import Mesh


class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: the same x on every rank forward; backward sums x's gradient over the group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: forward sums the partial outputs over the group; backward passes the gradient on."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ColumnParallelLinear(nn.Module):
    """This rank's output features of `linear` (`rows`, default its tensor_split share): f, then a local Linear."""

    def __init__(self, linear: nn.Linear, group=None, rows: torch.Tensor | None = None):
        super().__init__()
        self.group = group
        if rows is None:
            rows = torch.arange(linear.out_features).tensor_split(dist.get_world_size(group))[dist.get_rank(group)]
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach()[rows].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(CopyToTensorParallel.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's input features of `linear` (its tensor_split share): the local product, g, then the whole bias."""

    def __init__(self, linear: nn.Linear, group=None):
        super().__init__()
        self.group = group
        columns = torch.arange(linear.in_features).tensor_split(dist.get_world_size(group))[dist.get_rank(group)]
        self.weight = nn.Parameter(linear.weight.detach()[:, columns].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = ReduceFromTensorParallel.apply(F.linear(x, self.weight), self.group)
        return out if self.bias is None else out + self.bias


class TensorParallelAttention(nn.Module):
    """This rank's n_head/t heads of a CausalSelfAttention: q, k, v column-parallel, c_proj row-parallel."""

    def __init__(self, attn: nn.Module, group=None):
        super().__init__()
        size, rank, width = dist.get_world_size(group), dist.get_rank(group), attn.c_proj.in_features
        if attn.n_head % size:
            raise ValueError(f"{attn.n_head} attention heads do not split over {size} tensor-parallel ranks: "
                             f"use a tensor-parallel size that divides the number of heads")
        self.n_head = attn.n_head // size
        mine = torch.arange(width).tensor_split(size)[rank]  # this rank's heads' features (heads side by side)
        self.c_attn = ColumnParallelLinear(attn.c_attn, group, rows=torch.cat([mine, mine + width, mine + 2 * width]))
        self.c_proj = RowParallelLinear(attn.c_proj, group)
        self.register_buffer("causal_mask", attn.causal_mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = F.softmax(att.masked_fill(~self.causal_mask[:T, :T], float("-inf")), dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(B, T, -1))


def tensor_parallel_gpt(model: nn.Module, group=None) -> nn.Module:
    """Split every block of the course GPT over `group`, in place: heads (exercise 3) and MLP (exercise 2).
    Embeddings, LayerNorms and the tied head stay whole on every rank: their inputs, and so their gradients,
    are the same on each rank of the group."""
    for block in model.transformer.h:
        block.attn = TensorParallelAttention(block.attn, group)
        block.mlp = nn.Sequential(ColumnParallelLinear(block.mlp.c_fc, group), nn.GELU(),
                                  RowParallelLinear(block.mlp.c_proj, group))
    return model


def _local_heads_forward(attn, x):
    """A CausalSelfAttention's forward on the q, k, v features its colwise-sharded c_attn returns locally."""
    B, T, _ = x.shape
    q, k, v = (t.view(B, T, attn.n_head, -1).transpose(1, 2) for t in attn.c_attn(x).chunk(3, dim=2))
    att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
    att = F.softmax(att.masked_fill(~attn.causal_mask[:T, :T], float("-inf")), dim=-1)
    return attn.c_proj((att @ v).transpose(1, 2).reshape(B, T, -1))


def torch_tensor_parallel_gpt(model: nn.Module, tp_mesh) -> nn.Module:
    """The same split with torch.distributed.tensor.parallel on a 1-D device mesh (in place)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    size, width, plan = tp_mesh.size(), model.config.n_embd, {}
    # c_attn's rows [q; k; v] as [q_0; k_0; v_0; q_1; ...], so that an even split of its rows gives each rank its heads
    order = torch.cat([torch.cat([mine, mine + width, mine + 2 * width]) for mine in torch.arange(width).chunk(size)])
    for i, block in enumerate(model.transformer.h):
        attn = block.attn
        with torch.no_grad():
            attn.c_attn.weight.copy_(attn.c_attn.weight[order])
            attn.c_attn.bias.copy_(attn.c_attn.bias[order])
        attn.n_head //= size
        attn.forward = _local_heads_forward.__get__(attn)
        for name, style in (("attn.c_attn", ColwiseParallel), ("attn.c_proj", RowwiseParallel),
                            ("mlp.c_fc", ColwiseParallel), ("mlp.c_proj", RowwiseParallel)):
            plan[f"transformer.h.{i}.{name}"] = style()
    return parallelize_module(model, tp_mesh, plan)


def zero_on_mesh(model: nn.Module, mesh, optimizer_class=torch.optim.AdamW, stage: int = 1, **options):
    """The course GPT split over this rank's tp group, its slice prepared with ZeRO over its dp group."""
    import zero_lab

    model = tensor_parallel_gpt(model, mesh.group("tp"))
    return zero_lab.prepare(model, optimizer_class, stage, group=mesh.group("dp"), **options)


def my_rows(batch_size: int, mesh) -> torch.Tensor:
    """The global batch's rows this rank trains on: its dp coordinate's equal piece; the same across its tp group."""
    if batch_size % mesh.size("dp"):
        raise ValueError(f"a batch of {batch_size} rows does not split evenly over {mesh.size('dp')} data-parallel ranks")
    return torch.arange(batch_size).tensor_split(mesh.size("dp"))[mesh.coordinate("dp")]


@torch.no_grad()
def clip_grad_norm_on_mesh(model: nn.Module, optimizer, mesh, max_norm: float) -> torch.Tensor:
    """Clip zero_on_mesh's gradient (stage 1 or 2) to a global L2 norm <= max_norm, after backward and before
    optimizer.step(); return the norm, the same on every rank. One sum of squares over the dp group (the shards of
    this tp slice), one over the tp group (the slices; what every tp rank holds whole counted on tp rank 0 only)."""
    from zero_lab.zero1 import param_views

    if not hasattr(optimizer, "_reduce_into_masters"):
        raise NotImplementedError(f"clip_grad_norm_on_mesh is built for stages 1 and 2 (each rank a flat shard of "
                                  f"the gradient), not {type(optimizer).__name__}")
    split = {id(p) for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
             for name, p in m.named_parameters(recurse=False) if name == "weight" or isinstance(m, ColumnParallelLinear)}
    optimizer._reduce_into_masters()  # the averaged gradient shards: step() will not reduce them again
    squares = torch.zeros((), dtype=torch.float32)
    for group in optimizer.groups:
        counted = torch.zeros(group.layout.padded_numel)  # 1 where this rank's square counts; padding stays 0
        for p, view in zip(group.params, param_views(counted, group.params)):
            view.fill_(float(id(p) in split or mesh.coordinate("tp") == 0))
        start, stop = group.layout.shard(optimizer.rank)
        squares += (group.master.grad.float().pow(2) * counted[start:stop]).sum()
    dist.all_reduce(squares, group=mesh.group("dp"))  # this tp slice's squared norm
    dist.all_reduce(squares, group=mesh.group("tp"))  # the whole model's
    norm = squares.sqrt()
    for group in optimizer.groups:
        group.master.grad.mul_((max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm


class TensorParallelLinears(nn.Module):
    """`pairs` pairs of Linear(width, width), column- then row-parallel over `group` (no bias): 2 * pairs * width**2
    parameters, 1/t of them on each rank. Made in FakeTensorMode it costs nothing (lesson 13's BigLinears, split)."""

    def __init__(self, width: int, group=None, pairs: int = 2):
        super().__init__()
        if width % dist.get_world_size(group):
            raise ValueError(f"width {width} does not split over {dist.get_world_size(group)} tensor-parallel ranks")
        self.width, self.psi = width, 2 * pairs * width * width
        self.body = nn.Sequential(*[layer for _ in range(pairs) for layer in (
            ColumnParallelLinear(nn.Linear(width, width, bias=False), group),
            RowParallelLinear(nn.Linear(width, width, bias=False), group))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).float().sum()

    def _apply(self, fn, recurse=True):
        # prepare() moves the model to its device; torch would swap each fake parameter for a new one: keep them
        if all(fn(p) is p for p in self.parameters()):
            return self
        return super()._apply(fn, recurse)


def largest_on_mesh(mp: int, dp: int = 64, budget: float = 32e9, pairs: int = 2, stage: int = 1) -> dict:
    """Inside lesson 13's fake world, as rank 0 of dp * mp: the widest TensorParallelLinears (width a multiple of mp)
    whose model states, split over the tp group and `stage` over the dp group (bf16, AdamW), fit `budget` bytes."""
    from zero_lab.memory_ledger import model_state_bytes
    from zero_lab.prepare import prepare
    from zero_lab.scale import largest_model

    mesh, counts = Mesh((dp, mp), ("dp", "tp")), {}

    def bytes_of(k):  # the model of width k * mp, counted
        model = TensorParallelLinears(k * mp, mesh.group("tp"), pairs)
        model, optimizer = prepare(model, torch.optim.AdamW, stage, group=mesh.group("dp"),
                                   param_dtype=torch.bfloat16, lr=1e-4)
        model(torch.ones(1, model.width, dtype=torch.bfloat16)).backward()
        optimizer.step()
        counts[k] = dict(model_state_bytes(model, optimizer).bytes)
        return sum(counts[k].values())

    probe = 1024
    low = int(probe * math.sqrt(budget / bytes_of(probe)) * 0.999)  # bytes grow as width squared: a guess just below
    k = largest_model(bytes_of, budget, low=low)
    return {"psi": 2 * pairs * (k * mp) ** 2, "width": k * mp, "bytes": counts[k], "counts": len(counts)}
