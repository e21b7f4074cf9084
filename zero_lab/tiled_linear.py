# Generated from solutions/10_infinity/10_infinity.ipynb by `zero-lab build`: edit the notebook, not this file.

"""Memory-centric tiling (ZeRO-Infinity, §5.1.3; lesson 10): a wide Linear that never gathers all its weight.

LiveBytes             bytes of the tracked tensors still alive, and their peak: counted, not assumed
TiledLinear           a Linear sharded tile by tile over the ranks, stage-3 style
TiledLinearFunction   runs it with one gathered tile alive at a time, in forward and in backward
"""
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn


class LiveBytes:
    """Bytes of the tensors passed to track() that are still alive, and their peak: counted, not assumed.

    A tensor counts until its last reference is gone, a view of it included: a tile that a variable, a
    list or ctx still holds keeps counting.
    """

    def __init__(self):
        self.live = self.peak = 0

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self.release, nbytes)
        return tensor

    def release(self, nbytes: int) -> None:
        self.live -= nbytes


class TiledLinear(nn.Module):
    """Memory-centric tiling (§5.1.3) of `linear`, its weight and bias sharded over the ranks of `group` (stage 3).

    The output features are cut into `tiles` tiles of consecutive rows (tensor_split: sizes differ by at most
    one); row_ranges[t] = (first row, rows). Tile t is its weight rows and bias entries as one flat tensor,
    zero-padded to a multiple of the world size N; this rank keeps its 1/N slice as the parameter shards[t].
    gather_tile(t) all-gathers one tile; `gathered` counts the bytes of the gathered tiles still alive.
    """

    def __init__(self, linear: nn.Linear, tiles: int, group=None):
        super().__init__()
        if linear.bias is None or not 1 <= tiles <= linear.out_features:
            raise ValueError(f"TiledLinear needs a Linear with a bias and 1 <= tiles <= out_features = "
                             f"{linear.out_features}; got bias={linear.bias is not None}, tiles={tiles}")
        self.in_features, self.out_features, self.group = linear.in_features, linear.out_features, group
        self.world_size = dist.get_world_size(group)
        rows = [len(part) for part in torch.arange(linear.out_features).tensor_split(tiles)]
        self.row_ranges = [(sum(rows[:t]), n) for t, n in enumerate(rows)]
        self.shard_numels = [-(-n * (self.in_features + 1) // self.world_size) for n in rows]
        rank = dist.get_rank(group)
        with torch.no_grad():
            self.shards = nn.ParameterList(
                self.pad_tile(t, linear.weight[start:start + n], linear.bias[start:start + n])
                .view(self.world_size, -1)[rank].clone()
                for t, (start, n) in enumerate(self.row_ranges))
        self.gathered = LiveBytes()

    def pad_tile(self, t: int, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Tile t's (rows, in_features) weight and (rows,) bias as one flat tensor, zero-padded to N · shard."""
        flat = torch.cat([weight.reshape(-1), bias.reshape(-1)])
        return torch.cat([flat, flat.new_zeros(self.world_size * self.shard_numels[t] - flat.numel())])

    def gather_tile(self, t: int) -> torch.Tensor:
        """Tile t, padded and flat, all-gathered from the N shards into a new buffer counted in `gathered`."""
        flat = self.gathered.track(self.shards[t].new_empty(self.world_size * self.shard_numels[t]))
        # the collective gets a detached alias: its worker thread may drop its reference a moment after
        # returning, and the count must follow only the references the caller keeps
        dist.all_gather_single(flat.detach(), self.shards[t].detach(), group=self.group)
        return flat

    def split_tile(self, t: int, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of a padded flat tile t: its (rows, in_features) weight and (rows,) bias."""
        rows = self.row_ranges[t][1]
        weight_numel = rows * self.in_features
        return flat[:weight_numel].view(rows, self.in_features), flat[weight_numel:weight_numel + rows]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TiledLinearFunction.apply(x, self, *self.shards)


class TiledLinearFunction(torch.autograd.Function):
    """x @ Wᵀ + b of a TiledLinear, one gathered tile alive at a time; backward regathers each tile and
    reduce-scatters the tile's data-parallel mean gradient into this rank's shard gradient."""

    @staticmethod
    def forward(ctx, x, layer, *shards):
        ctx.layer = layer
        ctx.save_for_backward(x)
        outputs = []
        for t in range(len(shards)):
            flat = layer.gather_tile(t)
            weight, bias = layer.split_tile(t, flat)
            outputs.append(x @ weight.T + bias)
            del flat, weight, bias  # freed before the next tile is gathered
        return torch.cat(outputs, dim=-1)

    @staticmethod
    def backward(ctx, grad_out):
        x, = ctx.saved_tensors
        layer = ctx.layer
        x_rows = x.reshape(-1, layer.in_features)
        grad_x, grad_shards = torch.zeros_like(x), []
        for t, (start, rows) in enumerate(layer.row_ranges):
            flat = layer.gather_tile(t)
            weight = layer.split_tile(t, flat)[0]
            grad_tile = grad_out[..., start:start + rows]
            grad_x += grad_tile @ weight
            del flat, weight
            grad_tile = grad_tile.reshape(-1, rows)
            grad_flat = layer.pad_tile(t, grad_tile.T @ x_rows, grad_tile.sum(0))
            grad_shard = torch.empty_like(layer.shards[t])
            dist.reduce_scatter_single(grad_shard, grad_flat, group=layer.group)
            grad_shards.append(grad_shard / layer.world_size)
        return grad_x, None, *grad_shards
