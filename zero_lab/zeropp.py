# Generated from solutions/09_zeropp/09_zeropp.ipynb by `zero-lab build`: edit the notebook, not this file.

"""ZeRO++ and hierarchical sharding: stage 3 on nodes of several ranks, less traffic between nodes.

NodeLayout                   which rank is on which node (ranks of a node are consecutive)
node_groups                  the process groups "my node" and "my peers on the other nodes"
split_sent_bytes             a collective's bytes, split into intra-node and inter-node ones
NodeLedger                   a CommLedger that keeps that split for every collective it counts
quantize_blocks              symmetric int8 / int4 quantization, one scale per block
dequantize_blocks            back to floats
quantized_all_gather         qwZ: the all-gather of int8 shards and their scales
quantized_all_to_all         one all-to-all of quantized rows, dequantized on arrival
hierarchical_reduce_scatter  qgZ: intra-node all-to-all, reduce, inter-node all-to-all, reduce
keep_secondary, gather_secondary  hpZ: this rank's slice of a node-wide copy, re-gathered in the node
hsdp_reduce_gradients        HSDP: reduce-scatter in the node, all-reduce the shard across nodes
ZeroPPSchedule               lesson 05's UnitSchedule with the gathers and reductions above
ZeroPPOptimizer              lesson 05's Zero3Optimizer with that schedule (HSDP: sharded over the node)

ZeRO++ (Wang et al., 2023, arXiv 2306.10209): stage 3 moves 3M bytes between nodes per step (M =
the model in 16 bits): qwZ halves the forward all-gather (int8), hpZ keeps the backward all-gather
inside the node, qgZ sends int4 gradients through a 2-hop all-to-all: 0.5M + 0 + 0.25M = 0.75M.
HSDP (FSDP2 with a 2-D mesh; MiCS) shards inside a node and replicates across nodes.
"""

from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from fractions import Fraction

import torch
import torch.distributed as dist

from zero_lab.comm_ledger import CommLedger
from zero_lab.zero1 import param_views
from zero_lab.zero3 import Unit, UnitSchedule, Zero3Optimizer


@dataclass(frozen=True)
class NodeLayout:
    """world_size ranks on nodes of ranks_per_node each: node i holds ranks i*k ... i*k + k - 1."""

    world_size: int
    ranks_per_node: int

    def __post_init__(self):
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(f"ranks_per_node={self.ranks_per_node} does not divide the {self.world_size} ranks "
                             "into whole nodes: pass a divisor of the world size (the ranks of each machine)")

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        """The ranks of node `node`."""
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def peer_ranks(self, local_rank: int) -> list[int]:
        """The ranks with local rank `local_rank`, one on every node."""
        return list(range(local_rank, self.world_size, self.ranks_per_node))


def node_groups(layout: NodeLayout):
    """(this rank's node group, this rank's peer group); every rank must call it, in the same order."""
    rank = dist.get_rank()
    node_group = peer_group = None
    for node in range(layout.nodes):  # every rank creates every group: new_group is collective
        group = dist.new_group(layout.node_ranks(node))
        if node == layout.node_of(rank):
            node_group = group
    for local in range(layout.ranks_per_node):
        group = dist.new_group(layout.peer_ranks(local))
        if local == layout.local_rank(rank):
            peer_group = group
    return node_group, peer_group


RING_KINDS = {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "gather", "scatter"}


def split_sent_bytes(kind: str, sent: Fraction, group_ranks: list[int], rank: int,
                     ranks_per_node: int) -> tuple[Fraction, Fraction]:
    """(intra-node, inter-node) parts of the `sent` bytes this rank was charged for one collective.

    A group within one node: all intra. Ring collectives over G ranks on c nodes (ranks of a node
    adjacent in the ring): c of the ring's G links cross nodes and all links carry the same bytes,
    so a fraction c / G is inter-node. all_to_all: each of the G - 1 others gets the same slice,
    so the share of the others that sit on other nodes is inter-node. Anything else: all inter.
    """
    nodes = {r // ranks_per_node for r in group_ranks}
    if len(nodes) == 1:
        return sent, Fraction(0)
    size = len(group_ranks)
    if kind in RING_KINDS:
        inter = sent * Fraction(len(nodes), size)
    elif kind == "all_to_all":
        same_node = sum(r // ranks_per_node == rank // ranks_per_node for r in group_ranks)
        inter = sent * Fraction(size - same_node, size - 1)
    else:
        inter = sent
    return sent - inter, inter


class NodeLedger(CommLedger):
    """A CommLedger that also splits every collective's sent bytes into intra- and inter-node ones.

    >>> with NodeLedger(ranks_per_node=2) as ledger:
    ...     dist.all_reduce(torch.ones(10))
    >>> ledger.intra_bytes(), ledger.inter_bytes()
    """

    def __init__(self, ranks_per_node: int):
        super().__init__()
        self.ranks_per_node = ranks_per_node
        self.intra, self.inter = defaultdict(Fraction), defaultdict(Fraction)
        self._ranks = {}  # group -> its global ranks

    def record(self, kind, elements, element_size, group_size, group=None):
        before = self.totals[kind].sent_bytes
        super().record(kind, elements, element_size, group_size, group)
        if group not in self._ranks:
            self._ranks[group] = (dist.get_process_group_ranks(group) if group is not None
                                  else list(range(dist.get_world_size())))
        intra, inter = split_sent_bytes(kind, self.totals[kind].sent_bytes - before, self._ranks[group],
                                        dist.get_rank(), self.ranks_per_node)
        self.intra[kind] += intra
        self.inter[kind] += inter

    def intra_bytes(self, kind: str | None = None) -> Fraction:
        return sum((b for k, b in self.intra.items() if kind in (None, k)), Fraction())

    def inter_bytes(self, kind: str | None = None) -> Fraction:
        return sum((b for k, b in self.inter.items() if kind in (None, k)), Fraction())

    def split(self) -> dict[str, dict]:
        """Plain data: {kind: {calls, intra, inter}} (floats)."""
        return {kind: {"calls": t.calls, "intra": float(self.intra[kind]), "inter": float(self.inter[kind])}
                for kind, t in sorted(self.totals.items())}


def _check_bits(bits: int, block: int) -> int:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 8 (int8) or 4 (int4, two per byte), got {bits!r}")
    if block < 2 or block % 2:
        raise ValueError(f"block must be an even number of elements (int4 packs pairs), got {block!r}")
    return 2 ** (bits - 1) - 1


def quantize_blocks(x: torch.Tensor, bits: int = 8, block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantization of a flat tensor, one fp32 scale per block of `block` elements.

    The tensor is zero-padded to whole blocks. scale = max |x| of the block / qmax (qmax = 127 for
    int8, 7 for int4; 1 for an all-zero block), q = round(x / scale) in [-qmax, qmax]. Returns
    (payload, scales): payload is uint8, one byte per value for int8 (the int8 bits), one byte per
    two values for int4 (value + 8 in 4 bits: element 2i in the low half, 2i + 1 in the high half).
    """
    qmax = _check_bits(bits, block)
    blocks = -(-x.numel() // block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    padded[:x.numel()] = x.reshape(-1)
    padded = padded.view(blocks, block)
    scales = padded.abs().amax(dim=1) / qmax
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(padded / scales[:, None]).clamp_(-qmax, qmax).to(torch.int8).view(-1)
    if bits == 8:
        return q.view(torch.uint8), scales
    pairs = (q + 8).to(torch.uint8).view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4), scales


def dequantize_blocks(payload: torch.Tensor, scales: torch.Tensor, bits: int, block: int, numel: int) -> torch.Tensor:
    """The first `numel` values of quantize_blocks' (payload, scales), as fp32."""
    _check_bits(bits, block)
    if bits == 8:
        values = payload.view(torch.int8)
    else:
        values = torch.stack([payload & 15, payload >> 4], dim=1).view(-1).to(torch.int8) - 8
    return (values.view(-1, block).float() * scales[:, None]).view(-1)[:numel]


def quantized_all_gather(flat: torch.Tensor, shard: torch.Tensor, group=None, block: int = 256) -> None:
    """qwZ: every rank's `shard`, sent as int8 + scales, dequantized into `flat` in rank order.

    flat has shard.numel() * (ranks in group) elements, any float dtype.
    """
    size, numel = dist.get_world_size(group), shard.numel()
    payload, scales = quantize_blocks(shard, 8, block)
    payloads = payload.new_empty(size * payload.numel())
    all_scales = scales.new_empty(size * scales.numel())
    dist.all_gather_single(payloads, payload, group=group)
    dist.all_gather_single(all_scales, scales, group=group)
    for rank, (p, s) in enumerate(zip(payloads.chunk(size), all_scales.chunk(size))):
        flat[rank * numel:(rank + 1) * numel] = dequantize_blocks(p, s, 8, block, numel)


def quantized_all_to_all(rows: torch.Tensor, group=None, bits: int = 4, block: int = 256) -> torch.Tensor:
    """Row i of `rows` (one per rank of group) goes to group rank i, quantized; returns, as fp32,
    the rows this rank received: row j from group rank j."""
    quantized = [quantize_blocks(row, bits, block) for row in rows]
    payloads = torch.stack([p for p, _ in quantized])
    scales = torch.stack([s for _, s in quantized])
    got_payloads, got_scales = torch.empty_like(payloads), torch.empty_like(scales)
    dist.all_to_all_single(got_payloads, payloads, group=group)
    dist.all_to_all_single(got_scales, scales, group=group)
    return torch.stack([dequantize_blocks(p, s, bits, block, rows.shape[1]) for p, s in zip(got_payloads, got_scales)])


def hierarchical_reduce_scatter(flat_grad: torch.Tensor, layout: NodeLayout, node_group, peer_group,
                                bits: int = 4, block: int = 256) -> torch.Tensor:
    """qgZ: this rank's shard of the sum over all ranks of flat_grad, as fp32, in the layout of a
    flat reduce-scatter (rank r gets elements [r*S, (r+1)*S), S = numel / world size).

    1. reorder: row l of the intra-node all-to-all holds the shards of the ranks with local rank l,
       node by node; 2. quantized all-to-all in the node, sum: this rank holds its node's sum of
       those shards; 3. quantized all-to-all with the peers on other nodes, sum: the total of its own.
    """
    nodes, k = layout.nodes, layout.ranks_per_node
    shard = flat_grad.numel() // layout.world_size
    by_local_rank = flat_grad.reshape(nodes, k, shard).transpose(0, 1).reshape(k, nodes * shard)
    node_sum = quantized_all_to_all(by_local_rank, node_group, bits, block).sum(dim=0)
    return quantized_all_to_all(node_sum.view(nodes, shard), peer_group, bits, block).sum(dim=0)


def keep_secondary(flat: torch.Tensor, layout: NodeLayout, rank: int) -> torch.Tensor:
    """hpZ: a copy of this rank's slice of the gathered unit cut into ranks_per_node parts."""
    part = flat.numel() // layout.ranks_per_node
    local = layout.local_rank(rank)
    return flat[local * part:(local + 1) * part].clone()


def gather_secondary(flat: torch.Tensor, secondary: torch.Tensor, node_group) -> None:
    """hpZ: the whole unit from the node's secondary slices: an all-gather that stays in the node."""
    dist.all_gather_single(flat, secondary, group=node_group)


def hsdp_reduce_gradients(flat_grad: torch.Tensor, node_group, peer_group) -> torch.Tensor:
    """HSDP: this rank's shard (over its node) of the mean gradient over all ranks."""
    shard = flat_grad.new_empty(flat_grad.numel() // dist.get_world_size(node_group))
    dist.reduce_scatter_single(shard, flat_grad, group=node_group)
    dist.all_reduce(shard, group=peer_group)
    return shard.div_(dist.get_world_size())


TECHNIQUES = ("qwz", "hpz", "qgz")


class ZeroPPSchedule(UnitSchedule):
    """Lesson 05's unit schedule with ZeRO++'s gathers and reductions, or HSDP's node-wide ones.

    The same hooks and order; two extension points change: all_gather (qwZ's int8 forward gather,
    hpZ's backward gather from the node's secondary slices, HSDP's gather inside the node) and
    reduce_scatter (qgZ's 2-hop int4 all-to-all, HSDP's reduce-scatter in the node and all-reduce
    across nodes). release stays: hpZ's secondary slice outlives the freed unit by design.
    """

    def __init__(self, model, units, calls, *, layout: NodeLayout, node_group, peer_group, qwz: bool, hpz: bool,
                 qgz: bool, hsdp: bool, weights_block: int, grads_block: int, **options):
        super().__init__(model, units, calls, **options)
        self.layout, self.node_group, self.peer_group = layout, node_group, peer_group
        self.qwz, self.hpz, self.qgz, self.hsdp = qwz, hpz, qgz, hsdp
        self.weights_block, self.grads_block = weights_block, grads_block
        self.secondaries = {}  # hpZ: unit -> this rank's slice of its node-wide copy

    @torch.no_grad()
    def all_gather(self, unit: Unit, phase: str, async_op: bool = False) -> None:
        """Give unit.flat its storage back and fill it, the way `phase` calls for (always at once:
        ZeRO++ here does not prefetch, so there is no handle to return)."""
        unit.flat.untyped_storage().resize_(unit.flat.numel() * unit.flat.element_size())
        if self.hsdp:
            dist.all_gather_single(unit.flat, unit.shard, group=self.node_group)
        elif self.hpz and phase == "backward" and unit in self.secondaries:
            gather_secondary(unit.flat, self.secondaries[unit], self.node_group)
        elif self.qwz and phase == "forward":
            quantized_all_gather(unit.flat, unit.shard, block=self.weights_block)
        else:
            dist.all_gather_single(unit.flat, unit.shard)
        if self.hpz and phase == "forward":  # refreshed at every forward: the weights of the last step
            self.secondaries[unit] = keep_secondary(unit.flat, self.layout, dist.get_rank())

    @torch.no_grad()
    def reduce_scatter(self, unit: Unit) -> None:
        """Add this rank's shard of the mean of the unit's gradients over all ranks into unit.grad_shard."""
        grad_shard = unit.grad_shard
        flat_grad = grad_shard.new_zeros(unit.layout.padded_numel)
        for p, view in zip(unit.params, param_views(flat_grad, unit.params)):
            if p.grad is not None:
                view.copy_(p.grad)
                p.grad = None
        if self.hsdp:
            grad_shard += hsdp_reduce_gradients(flat_grad, self.node_group, self.peer_group)
        elif self.qgz:
            total = hierarchical_reduce_scatter(flat_grad, self.layout, self.node_group, self.peer_group,
                                                block=self.grads_block)
            grad_shard += (total / dist.get_world_size()).to(grad_shard.dtype)
        else:
            received = torch.empty_like(grad_shard)
            dist.reduce_scatter_single(received, flat_grad)
            grad_shard += received / dist.get_world_size()


_groups_made = {}  # (default process group, ranks_per_node) -> (node group, peer group)


def _node_groups_once(layout: NodeLayout):
    """node_groups(layout), made once per process group: each preparation making its own would add groups
    (threads and connections each) that live as long as the process, however often a cell is re-run."""
    world = dist.group.WORLD
    if any(made_for is not world for made_for, _ in _groups_made):  # a new default group: the old ones are gone
        _groups_made.clear()
    if (world, layout.ranks_per_node) not in _groups_made:
        _groups_made[world, layout.ranks_per_node] = node_groups(layout)
    return _groups_made[world, layout.ranks_per_node]


class ZeroPPOptimizer(Zero3Optimizer):
    """Stage 3 on nodes of `ranks_per_node` ranks, with any of ZeRO++'s techniques, or HSDP.

    qwz                     forward all-gathers of int8 shards + per-block scales (weights_block elements)
    hpz                     after each forward gather, keep this rank's slice of a node-wide copy;
                            backward re-gathers from those slices, inside the node
    qgz                     gradients reduced by the 2-hop all-to-all of int4 blocks (grads_block elements)
    replicate_across_nodes  HSDP: units sharded over the node only (shard_group), gradient shards
                            all-reduced across nodes
    Other options are Zero3Optimizer's; units are gathered when needed (prefetch=0).
    """

    reshardable = False  # hpZ's secondary copies and node groups are not in lesson 16's checkpoint layout

    def __init__(self, model, optimizer_class=torch.optim.AdamW, params=None, *, ranks_per_node: int,
                 qwz: bool = False, hpz: bool = False, qgz: bool = False, replicate_across_nodes: bool = False,
                 weights_block: int = 256, grads_block: int = 256, **options):
        self.layout = NodeLayout(dist.get_world_size(), ranks_per_node)
        if replicate_across_nodes and (qwz or hpz or qgz):
            raise ValueError("replicate_across_nodes (HSDP) already keeps every gather inside the node: combine it "
                             "with none of qwz, hpz, qgz (those are ZeRO++ on top of stage 3's global shards)")
        if options.get("prefetch", 0):
            raise ValueError("ZeRO++ and HSDP here gather each unit when its module runs: leave prefetch out (or 0)")
        if replicate_across_nodes and options.get("max_grad_norm") is not None:
            raise ValueError("max_grad_norm with replicate_across_nodes is not implemented: clip without HSDP")
        _check_bits(8, weights_block), _check_bits(4, grads_block)
        self.hsdp = replicate_across_nodes
        node_group, peer_group = _node_groups_once(self.layout)
        if self.hsdp:
            self.shard_group = node_group  # each unit sharded over the node: this rank keeps 1/ranks_per_node of it
        self.schedule_class = partial(ZeroPPSchedule, layout=self.layout, node_group=node_group, peer_group=peer_group,
                                      qwz=qwz, hpz=hpz, qgz=qgz, hsdp=self.hsdp, weights_block=weights_block,
                                      grads_block=grads_block)
        super().__init__(model, optimizer_class, params, **{**options, "prefetch": 0})

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        held = super().model_state_tensors()
        held["parameters"] += list(self.schedule.secondaries.values())  # hpZ's node-wide copy
        return held

    # ---- what HSDP's replicated shards do not support (a norm or a gather over all ranks would count them twice)
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        if self.hsdp:
            raise NotImplementedError("clipping with replicate_across_nodes is not implemented: clip without HSDP")
        return super().clip_grad_norm_(max_norm)

    def consolidated_state_dict(self, dst: int = 0):
        if self.hsdp:
            raise NotImplementedError("consolidated_state_dict with replicate_across_nodes is not implemented: "
                                      "save each rank's optimizer.state_dict()")
        return super().consolidated_state_dict(dst)
