# Generated from solutions/03_zero1/03_zero1.ipynb by `zero-lab build`: edit the notebook, not this file.

"""ShardLayout: how ZeRO pads a flat buffer and cuts it into N equal, contiguous shards (lesson 03).

Its own module: the optimizers of every stage cut their buffers with it, and so does lesson 16's
resharding, which reads a checkpoint's layout without the optimizer classes.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardLayout:
    """A flat buffer of `numel` real elements, zero-padded at the end to split into equal shards.

    Rank r owns elements shard(r) = [start, stop) of the padded buffer. Shards ignore tensor
    boundaries, so a shard may begin or end in the middle of a parameter.
    """

    numel: int
    world_size: int

    @property
    def shard_numel(self) -> int:
        """Elements per shard: the smallest size such that world_size shards cover numel."""
        return -(-self.numel // self.world_size)  # ceiling division

    @property
    def padded_numel(self) -> int:
        """numel rounded up to a multiple of world_size (the flat buffer's length)."""
        return self.shard_numel * self.world_size

    def shard(self, rank: int) -> tuple[int, int]:
        """(start, stop) of `rank`'s shard in the padded buffer."""
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def real_numel(self, rank: int) -> int:
        """How many elements of `rank`'s shard are real parameters, not padding (may be 0)."""
        start, stop = self.shard(rank)
        return max(0, min(stop, self.numel) - start)
