# Generated from solutions/17_parallelism_3d/17_parallelism_3d.ipynb by `zero-lab build`: edit the notebook, not this file.

"""Ranks on a mesh (lesson 17): one axis per kind of parallelism, a process group along each axis.

mesh_coordinates   a rank's coordinate on a mesh of `shape` (row-major: the last axis varies fastest)
mesh_groups        the groups along one axis: ranks whose coordinates differ only there
Mesh               every group of every axis made on every rank; this rank's own by axis name
AxisLedger         a CommLedger that also sums the bytes sent per mesh axis (dp and tp counted apart)
"""

from __future__ import annotations

import math
from collections import defaultdict
from fractions import Fraction

import torch.distributed as dist

from zero_lab.comm_ledger import CommLedger


def mesh_coordinates(rank: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Coordinate of `rank` on a mesh of `shape`, the last axis varying fastest: (2, 3), rank 4 -> (1, 1)."""
    if not 0 <= rank < math.prod(shape):
        raise ValueError(f"rank {rank} is not on a mesh of shape {tuple(shape)} ({math.prod(shape)} ranks)")
    coordinates = []
    for size in reversed(shape):
        rank, coordinate = divmod(rank, size)
        coordinates.append(coordinate)
    return tuple(reversed(coordinates))


def mesh_groups(shape: tuple[int, ...], dim: int) -> list[list[int]]:
    """The groups along axis `dim`: ranks equal in every other coordinate, each sorted, sorted by first rank."""
    groups = {}
    for rank in range(math.prod(shape)):
        elsewhere = mesh_coordinates(rank, shape)[:dim] + mesh_coordinates(rank, shape)[dim + 1:]
        groups.setdefault(elsewhere, []).append(rank)
    return sorted(groups.values())


class Mesh:
    """The whole world on a mesh: Mesh((2, 3), ("dp", "tp")) on 6 ranks; mesh.group("tp") is this rank's
    tp group, mesh.ranks("dp") its members, mesh.coordinate("tp") this rank's place on that axis."""

    def __init__(self, shape: tuple[int, ...], names: tuple[str, ...]):
        if len(shape) != len(names):
            raise ValueError(f"a mesh of shape {tuple(shape)} needs {len(shape)} axis names, got {tuple(names)}")
        if math.prod(shape) != dist.get_world_size():
            raise ValueError(f"a mesh of shape {tuple(shape)} holds {math.prod(shape)} ranks, the world has "
                             f"{dist.get_world_size()}")
        self.shape, self.names = tuple(shape), tuple(names)
        self.coordinates = mesh_coordinates(dist.get_rank(), self.shape)
        self._groups, self._ranks, self._axis_of = {}, {}, {}
        for dim, name in enumerate(self.names):
            for members in mesh_groups(self.shape, dim):  # new_group is a collective: every rank makes every group
                group = dist.new_group(members)
                if dist.get_rank() in members:
                    self._groups[name], self._ranks[name] = group, members
                    self._axis_of[group] = name

    def group(self, name: str):
        return self._groups[name]

    def ranks(self, name: str) -> list[int]:
        return self._ranks[name]

    def size(self, name: str) -> int:
        return self.shape[self.names.index(name)]

    def coordinate(self, name: str) -> int:
        return self.coordinates[self.names.index(name)]

    def axis_of(self, group) -> str | None:
        """The axis whose group this is (None: the whole world, or a group not of this mesh)."""
        return self._axis_of.get(group)


class AxisLedger(CommLedger):
    """A CommLedger that also sums the bytes each collective sends by the mesh axis it ran on:
    ledger.sent_by_axis() == {"dp": ..., "tp": ...} (the whole world or another group: "world")."""

    def __init__(self, mesh: Mesh):
        super().__init__()
        self.mesh, self.by_axis = mesh, defaultdict(Fraction)

    def record(self, kind, elements, element_size, group_size, group=None):
        before = self.totals[kind].sent_bytes
        super().record(kind, elements, element_size, group_size, group)
        self.by_axis[self.mesh.axis_of(group) or "world"] += self.totals[kind].sent_bytes - before

    def sent_by_axis(self) -> dict[str, float]:
        return {axis: float(sent) for axis, sent in sorted(self.by_axis.items())}
