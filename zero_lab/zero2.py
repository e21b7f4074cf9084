# Generated from solutions/04_zero2/04_zero2.ipynb by `zero-lab build`: edit the notebook, not this file.

"""ZeRO stage 2 (P_os+g): gradients are reduce-scattered bucket by bucket during backward,
and each rank keeps only the gradient of its own shard.

bucket_ranges          cut a flat param group into buckets of whole parameters, in backward order
rank_slices            where a bucket meets each rank's shard: the pieces of its reduce-scatter
Bucket                 one bucket's bookkeeping, from its first gradient to its reduced slice
reduce_scatter_bucket  flatten a full bucket's gradients, free them, start its reduce-scatter
accumulate_into_shard  wait for it, add this rank's slice of the mean into the gradient shard
Zero2Optimizer         lesson 03's Zero1Optimizer, fed by hooks: launch complete buckets in order
                       during backward, one in flight; drain the rest when backward ends

Layout, fp32 masters, step, all-gather, clipping and checkpoints are lesson 03's
(zero_lab.zero1). Memory per rank (ZeRO paper, section 5.2): 2 Psi + (2 + K) Psi / Nd bytes
with mixed precision, and the same 2 Psi of communication per step as DDP (section 7.2.1).
"""

from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import accumulate

import torch
import torch.distributed as dist

from zero_lab.optim import weak_hook
from zero_lab.zero1 import FlatGroup, ShardLayout, Zero1Optimizer


def bucket_ranges(numels: list[int], padded_numel: int, bucket_numel: int) -> list[tuple[int, int, list[int]]]:
    """Cut a flat buffer of parameters (sizes `numels`, laid out in order) into buckets.

    Returns (start, stop, indices of the bucket's parameters in increasing order) per bucket, in
    the order backward fills them: the last parameters first. A bucket takes whole parameters
    and is closed as soon as it holds >= bucket_numel elements; the first parameter closes the
    last bucket, whatever its size. The padding at the end of the buffer goes to the first
    bucket, so the buckets tile [0, padded_numel) exactly.
    """
    starts = [0, *accumulate(numels)][:-1]
    buckets, stop, members = [], padded_numel, []
    for index in reversed(range(len(numels))):
        members.insert(0, index)
        if stop - starts[index] >= bucket_numel or index == 0:
            buckets.append((starts[index], stop, members))
            stop, members = starts[index], []
    return buckets


def rank_slices(start: int, stop: int, layout: ShardLayout) -> list[tuple[int, int]]:
    """For each rank, the part (lo, hi) of [start, stop) that lies in its shard; lo == hi if none.

    These are the pieces of the bucket's reduce-scatter: rank r receives the sum of piece r.
    """
    slices = []
    for rank in range(layout.world_size):
        shard_start, shard_stop = layout.shard(rank)
        lo = min(max(start, shard_start), stop)
        slices.append((lo, max(lo, min(stop, shard_stop))))
    return slices


@dataclass(eq=False)
class Bucket:
    """One bucket of a flat param group: [start, stop) of its flat buffer."""

    group: int  # index of its param group
    start: int
    stop: int
    params: list[torch.nn.Parameter]  # in flat-buffer order
    slices: list[tuple[int, int]]  # rank_slices(start, stop, layout)
    ready: set = field(default_factory=set)  # parameters whose gradient this backward is final
    staging: torch.Tensor | None = None  # the bucket's gradients, flat: only while being reduced
    received: torch.Tensor | None = None  # this rank's piece of the sum over ranks
    work: dist.Work | None = None  # the handle of the asynchronous reduce-scatter


def reduce_scatter_bucket(bucket: Bucket, rank: int, group=None) -> None:
    """Start summing a complete bucket's gradients over the ranks; free the full-size gradients.

    Copies the gradients of bucket.params into one flat bucket.staging tensor of stop - start
    elements (zeros for a parameter without a gradient and for the padding), sets every .grad
    to None, and starts an asynchronous reduce-scatter whose pieces are the bucket's rank
    slices: bucket.received gets this rank's piece of the sum, bucket.work the handle. The ranks are
    those of `group` (None: all; lesson 17 passes a mesh's data-parallel group) and `rank` is this
    rank's number in it.
    """
    grads = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in bucket.params]
    padding = bucket.stop - bucket.start - sum(g.numel() for g in grads)
    bucket.staging = torch.cat([*grads, grads[0].new_zeros(padding)])
    for p in bucket.params:
        p.grad = None  # the only full-size copy left is staging, alive until the bucket is reduced
    pieces = [bucket.staging[lo - bucket.start:hi - bucket.start] for lo, hi in bucket.slices]
    bucket.received = torch.empty_like(pieces[rank])
    bucket.work = dist.reduce_scatter(bucket.received, pieces, group=group, async_op=True)


@torch.no_grad()
def accumulate_into_shard(bucket: Bucket, grad_shard: torch.Tensor, shard_start: int, rank: int, group=None) -> None:
    """Finish a bucket: wait for its reduce-scatter, add this rank's slice of the mean gradient.

    grad_shard holds this rank's shard, which starts at shard_start in the padded flat buffer;
    bucket.received is the sum over ranks of bucket.slices[rank]. Divide by the number of ranks
    (the data-parallel mean; the ranks of `group`, None: all), add into grad_shard, then release
    staging, received and work.
    """
    bucket.work.wait()
    lo, hi = bucket.slices[rank]
    grad_shard[lo - shard_start:hi - shard_start] += bucket.received / dist.get_world_size(group)
    bucket.staging = bucket.received = bucket.work = None


class Zero2Optimizer(Zero1Optimizer):
    """ZeRO stage 2: stage 1 whose gradients are reduce-scattered during backward into shards.

    Takes Zero1Optimizer's arguments (params, param_dtype, max_grad_norm, the optimizer's
    options), plus
    bucket_numel  elements per gradient bucket (a parameter larger than that is a bucket alone).
    Several backward passes before step() accumulate in the shards (gradient accumulation);
    each of them communicates, since the full gradients it produces are freed once reduced.
    Call optimizer.zero_grad() after step(): model.zero_grad() cannot reach the shards, so a
    backward after step() without it raises instead of adding to the old gradients.
    """

    stage = 2

    def __init__(self, model, optimizer_class=torch.optim.AdamW, params=None, *, bucket_numel: int = 2**20, **options):
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel must be at least 1, got {bucket_numel}")
        self.bucket_numel = bucket_numel
        super().__init__(model, optimizer_class, params, **options)
        # self.grad_shards: per group, a zeroed shard shaped like g.master in g.flat_param's (compute)
        # dtype, as the paper counts (2 Psi / Nd bytes with bf16; step() casts it to fp32);
        # self.buckets: every group's self._buckets(index, group), in launch order; self.bucket_of:
        # param -> its bucket; self.hook_handles: _on_gradient_ready as each bucketed param's
        # post-accumulate-grad hook, through weak_hook (zero_lab.optim), so that the parameters do not
        # keep the optimizer alive.
        self.grad_shards = [torch.zeros_like(g.master, dtype=g.flat_param.dtype) for g in self.groups]
        self.buckets = [bucket for index, group in enumerate(self.groups) for bucket in self._buckets(index, group)]
        self.bucket_of = {p: bucket for bucket in self.buckets for p in bucket.params}
        self.hook_handles = [p.register_post_accumulate_grad_hook(weak_hook(self._on_gradient_ready))
                             for p in self.bucket_of]
        self.next_bucket = 0  # buckets are launched strictly in order, the same on every rank
        self.in_flight = None  # the bucket being reduce-scattered: at most one
        self.final_callback_queued = False
        self.shards_used = False  # step() used the shards: zero_grad() must come before the next backward
        self.require_gradient_sync = True  # False inside no_sync() (exercise 7): backward sends nothing

    def _new_flat_grad(self, flat_param, params):
        for p in params:
            p.grad = None  # an earlier gradient would add to the first backward's
        return None  # no full gradient buffer: backward's gradients go to the buckets

    def _buckets(self, index: int, group: FlatGroup) -> list[Bucket]:
        ranges = bucket_ranges([p.numel() for p in group.params], group.layout.padded_numel, self.bucket_numel)
        return [Bucket(index, start, stop, [group.params[i] for i in members], rank_slices(start, stop, group.layout))
                for start, stop, members in ranges]

    @staticmethod
    def _is_complete(bucket: Bucket) -> bool:
        return len(bucket.ready) == len(bucket.params)

    def _on_gradient_ready(self, param) -> None:
        """The hook: param.grad is final for this backward. Queue _finish_backward once per backward,
        mark param ready, and launch, strictly in bucket order, every bucket that is now complete."""
        if self.shards_used and not self.final_callback_queued:
            raise RuntimeError("backward after optimizer.step() without optimizer.zero_grad(): stage 2 keeps "
                               "the gradients in shards that model.zero_grad() cannot reach, so they would add "
                               "to the last step's. Call optimizer.zero_grad() after optimizer.step().")
        if not self.require_gradient_sync:  # no_sync(): the gradient stays whole in param.grad, and adds up
            return
        if not self.final_callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self.final_callback_queued = True
        self.bucket_of[param].ready.add(param)
        while self.next_bucket < len(self.buckets) and self._is_complete(self.buckets[self.next_bucket]):
            self._launch(self.buckets[self.next_bucket])
            self.next_bucket += 1

    def _launch(self, bucket: Bucket) -> None:
        """Start reduce-scattering a complete bucket, after finishing the one in flight: at most one."""
        if self.in_flight is not None:  # one bucket in flight: gradient memory stays bounded
            self._accumulate(self.in_flight)
        reduce_scatter_bucket(bucket, self.rank, self.process_group)
        self.in_flight = bucket

    def _accumulate(self, bucket: Bucket) -> None:
        """Finish a launched bucket into its group's gradient shard; its parameters are not ready any more."""
        shard_start = self.groups[bucket.group].layout.shard(self.rank)[0]
        accumulate_into_shard(bucket, self.grad_shards[bucket.group], shard_start, self.rank, self.process_group)
        bucket.ready.clear()

    def _finish_backward(self) -> None:
        """Runs when backward ends: launch the buckets it did not reach, finish the last, reset."""
        for bucket in self.buckets[self.next_bucket:]:
            self._launch(bucket)
        if self.in_flight is not None:
            self._accumulate(self.in_flight)
        self.next_bucket, self.in_flight, self.final_callback_queued = 0, None, False

    @contextmanager
    def no_sync(self):
        """Exercise 7: backward passes inside send nothing; their gradients add up, whole, in each
        param.grad (stage 1's memory meanwhile), and the first backward after the block
        reduce-scatters the sum with its own. As DDP's no_sync (lesson 02) and FSDP2's
        set_requires_gradient_sync(False)."""
        self.require_gradient_sync = False
        try:
            yield
        finally:
            self.require_gradient_sync = True

    def reduce_gradients(self) -> list[torch.Tensor]:
        """The averaged gradient shards: complete as soon as backward has returned."""
        if not self.require_gradient_sync:
            raise RuntimeError("optimizer.step() inside optimizer.no_sync(): the gradients are not reduced yet; "
                               "run the last micro-step's backward outside the block")
        self.shards_used = True
        return self.grad_shards

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient shards in place (set_to_none is ignored: they are reused)."""
        for shard, group in zip(self.grad_shards, self.groups):
            shard.zero_()
            group.master.grad = None  # a clipped gradient not yet stepped on
        self.shards_used = False

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        tensors = super().model_state_tensors()
        not_yet_reduced = [p.grad for g in self.groups for p in g.params if p.grad is not None]
        in_flight = [t for b in self.buckets for t in (b.staging, b.received) if t is not None]
        tensors["gradients"] = self.grad_shards + not_yet_reduced + in_flight
        return tensors
