"""Recording what a rank computes and communicates during backward, for the timelines.

    events = []
    record_gradients_ready(model, events)        # before the optimizer's (or DDP's) own hooks
    with recording_collectives(events, "reduce_scatter"):
        dist.barrier()                           # every rank starts backward together
        start = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
    timeline = backward_timeline(events, start, end)   # plain data: return it from the rank
    zero_lab.pictures.draw_comm_timeline(ax, rank, timeline)   # in the notebook, one axis per rank

An event is (seconds, kind, bytes): "ready" when a parameter's gradient is final (the compute
side), "launch" when a collective is issued, "done" when the transport has completed it (a
callback on its future, on gloo's thread; a blocking collective is done when it returns; gloo's
reduce-scatter of unequal pieces has no future, and is marked done when its wait() returns, an
upper bound), "wait" and "waited" around the wait() of an asynchronous one, or around the whole
call of a blocking one (the rank waits for all of it). Hand-written, not exported from a lesson:
lessons 02 (DDP) and 04 (ZeRO-2) record their buckets with it, lesson 05 (ZeRO-3) its units.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

# What one call of each collective moves, in bytes: the full message (the ledger's M).
MESSAGE_BYTES = {
    "all_reduce": lambda tensor, *_: tensor.numel() * tensor.element_size(),
    "reduce_scatter": lambda output, inputs, *_: sum(t.numel() * t.element_size() for t in inputs),
    "reduce_scatter_single": lambda output, input, *_: input.numel() * input.element_size(),
    "all_gather_single": lambda output, input, *_: output.numel() * output.element_size(),
}


class _TimedWork:
    # A collective's handle that logs when wait() is called and when it returns; "done" too
    # when the transport gives no completion callback.
    def __init__(self, work, events, nbytes, done_on_wait):
        self.work, self.events, self.nbytes, self.done_on_wait = work, events, nbytes, done_on_wait

    def wait(self, *args):
        self.events.append((time.perf_counter(), "wait", self.nbytes))
        result = self.work.wait(*args)
        self.events.append((time.perf_counter(), "waited", self.nbytes))
        if self.done_on_wait:
            self.events.append((time.perf_counter(), "done", self.nbytes))
        return result


def record_gradients_ready(model: torch.nn.Module, events: list) -> None:
    """Log "ready" when each trainable parameter's gradient is final. Register before the
    optimizer's or DDP's hooks, so that "ready" is logged before their hook runs."""
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(
                lambda p: events.append((time.perf_counter(), "ready", p.numel() * p.element_size())))


@contextmanager
def recording_collectives(events: list, *kinds: str):
    """Log every call of the torch.distributed collectives `kinds` (keys of MESSAGE_BYTES) made
    inside the block, whoever makes it: launch, done, and wait/waited for asynchronous ones."""
    real = {kind: getattr(dist, kind) for kind in kinds}

    def recorded(kind):
        def collective(*args, async_op=False, **kwargs):
            nbytes, start = MESSAGE_BYTES[kind](*args), time.perf_counter()
            events.append((start, "launch", nbytes))
            work = real[kind](*args, async_op=async_op, **kwargs)
            if not async_op:  # blocking: the rank waited for all of it
                end = time.perf_counter()
                events.extend([(start, "wait", nbytes), (end, "done", nbytes), (end, "waited", nbytes)])
                return work
            try:
                work.get_future().then(lambda _: events.append((time.perf_counter(), "done", nbytes)))
            except RuntimeError:  # "getFuture not implemented": gloo's reduce-scatter of unequal pieces
                return _TimedWork(work, events, nbytes, done_on_wait=True)
            return _TimedWork(work, events, nbytes, done_on_wait=False)
        return collective

    for kind in kinds:
        setattr(dist, kind, recorded(kind))
    try:
        yield
    finally:
        for kind, function in real.items():
            setattr(dist, kind, function)


def backward_timeline(events: list, start: float, end: float) -> dict:
    """The events in ms since `start` (when backward was called), and how long backward took."""
    return {"backward_ms": 1e3 * (end - start), "events": [(1e3 * (t - start), kind, nbytes) for t, kind, nbytes in events]}
