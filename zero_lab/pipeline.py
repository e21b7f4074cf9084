# Generated from solutions/17_parallelism_3d/17_parallelism_3d.ipynb by `zero-lab build`: edit the notebook, not this file.

"""Pipeline parallelism (lesson 17; GPipe and 1F1B as in Narayanan et al. 2021, §2.2) on a logical clock.

stage_of        the layers of a Sequential that pipeline stage p of P runs (consecutive Linear layers, ReLUs with them)
PipeStage       one rank's stage: forward/backward of micro-batches, send/recv to the neighbours, the clock, the timeline
gpipe           all forwards, then all backwards
one_f_one_b     warm-up forwards, then one forward and one backward at a time, then the remaining backwards
bubble          the idle share of a step, from the stages' timelines
torch_schedule  the same step with torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B), to compare
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

FORWARD_TICKS, BACKWARD_TICKS = 1, 2  # the logical clock: a backward costs about twice a forward


def stage_of(model: nn.Sequential, stages: int, stage: int) -> nn.Sequential:
    """Stage `stage` of `stages`: a share of the Linear layers (tensor_split of their indices), each with what
    follows it up to the next Linear (its activation)."""
    starts = [i for i, layer in enumerate(model) if isinstance(layer, nn.Linear)]
    mine = torch.arange(len(starts)).tensor_split(stages)[stage].tolist()
    ends = starts[1:] + [len(model)]
    return nn.Sequential(*[model[j] for i in mine for j in range(starts[i], ends[i])])


class PipeStage:
    """Rank p of a P-rank pipeline (the world): its layers, the micro-batches it keeps for backward, a clock."""

    def __init__(self, layers: nn.Sequential, micro_batches: int, loss_fn=None):
        self.layers, self.m, self.loss_fn = layers, micro_batches, loss_fn
        self.rank, self.p = dist.get_rank(), dist.get_world_size()
        self.first, self.last = self.rank == 0, self.rank == self.p - 1
        self.width = next(layer for layer in layers if isinstance(layer, nn.Linear)).in_features
        self.kept, self.peak_kept, self.clock, self.timeline, self.sending = {}, 0, 0, [], []
        self.targets = None  # the last stage's targets, set by the schedule's caller

    def _receive(self, shape, src) -> torch.Tensor:
        x, arrived = torch.empty(shape), torch.zeros((), dtype=torch.int64)
        dist.recv(x, src)
        dist.recv(arrived, src)  # the tick the sender finished: work on it starts no earlier
        self.clock = max(self.clock, int(arrived))
        return x

    def _send(self, tensor, dst) -> None:
        # isend: 1F1B's neighbours send to each other at the same time; a blocking send would wait for ever
        for message in (tensor.detach().contiguous(), torch.tensor(self.clock)):
            self.sending.append((dist.isend(message, dst), message))  # the message lives until it is sent

    def flush(self) -> None:
        """Wait for this stage's sends: call it after the schedule."""
        for work, _ in self.sending:
            work.wait()
        self.sending.clear()

    def receive_activation(self, batch_rows: int) -> torch.Tensor:
        return self._receive((batch_rows, self.width), self.rank - 1)

    def send_activation(self, y: torch.Tensor) -> None:
        self._send(y, self.rank + 1)

    def forward(self, m: int, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_(not self.first)
        y = self.layers(x)
        if self.last:
            y = self.loss_fn(y, self.targets[m]) / self.m
        self.kept[m] = (x, y)
        self.peak_kept = max(self.peak_kept, len(self.kept))
        self._tick("F", m, FORWARD_TICKS)
        return y

    def backward(self, m: int) -> None:
        x, y = self.kept.pop(m)
        grad = None if self.last else self._receive(y.shape, self.rank + 1)
        y.backward(grad)
        self._tick("B", m, BACKWARD_TICKS)
        if not self.first:
            self._send(x.grad, self.rank - 1)

    def _tick(self, kind: str, m: int, ticks: int) -> None:
        self.timeline.append((kind, m, self.clock, self.clock + ticks))
        self.clock += ticks


def bubble(timelines: list[list[tuple]]) -> float:
    """The idle share of a step: 1 - (busy ticks of all stages) / (stages * the step's length)."""
    length = max(end for timeline in timelines for *_, end in timeline)
    busy = sum(end - start for timeline in timelines for *_, start, end in timeline)
    return 1 - busy / (len(timelines) * length)


def gpipe(stage: PipeStage, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
    """GPipe: every micro-batch's forward (0 ... M - 1), then every backward (0 ... M - 1)."""
    stage.targets = targets
    for m in range(stage.m):
        x = inputs[m] if stage.first else stage.receive_activation(len(targets[m]))
        y = stage.forward(m, x)
        if not stage.last:
            stage.send_activation(y)
    for m in range(stage.m):
        stage.backward(m)


def one_f_one_b(stage: PipeStage, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
    """1F1B: min(P - p - 1, M) warm-up forwards, then one forward and one backward, then the remaining backwards."""
    stage.targets = targets
    def forward(m):
        x = inputs[m] if stage.first else stage.receive_activation(len(targets[m]))
        y = stage.forward(m, x)
        if not stage.last:
            stage.send_activation(y)

    warmup = min(stage.p - stage.rank - 1, stage.m)
    for m in range(warmup):
        forward(m)
    for m in range(warmup, stage.m):
        forward(m)
        stage.backward(m - warmup)
    for m in range(stage.m - warmup, stage.m):
        stage.backward(m)


def torch_schedule(layers: nn.Sequential, micro_batches: int, kind: str, inputs=None, targets=None, loss_fn=None):
    """One step of this rank's stage under torch.distributed.pipelining (kind "gpipe" or "1f1b"): stage 0 passes the
    whole batch `inputs`, the last stage the whole `targets`; torch cuts them into micro-batches."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, stages = dist.get_rank(), dist.get_world_size()
    stage = PipelineStage(layers, rank, stages, torch.device("cpu"))
    schedule = (ScheduleGPipe if kind == "gpipe" else Schedule1F1B)(stage, n_microbatches=micro_batches,
                                                                    loss_fn=loss_fn)
    if rank == 0:
        schedule.step(torch.cat(inputs))
    elif rank == stages - 1:
        schedule.step(target=torch.cat(targets))
    else:
        schedule.step()
