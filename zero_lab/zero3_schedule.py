# Generated from solutions/05_zero3/05_zero3.ipynb by `zero-lab build`: edit the notebook, not this file.

"""When ZeRO stage 3 gathers, frees and reduce-scatters each unit (lesson 05).

prefetch_plan         which units to start gathering now, by the recorded execution order
ExecutionOrder        the order of calls, recorded in the first step and checked on every rank after
UnitSchedule          the hooks that gather, free, re-gather and reduce-scatter each unit (extension
                      points all_gather, release, reduce_scatter: lessons 09 and 10 plug in there)
"""

from functools import partial

import torch
import torch.distributed as dist

from zero_lab.optim import weak_hook

if __name__ != "__main__":  # in the package; in the notebook these names are your cells below
    from zero_lab.zero3_units import Unit, free_unit, gather_unit, reduce_scatter_unit, regather_before_backward


def prefetch_plan(order: list[list[int]], position: int, depth: int, resident: set[int],
                  numels: list[int], live_numel: int, max_live_numel: int | None = None) -> list[int]:
    """The units to start all-gathering at call `position` of the recorded order.

    order[i] lists the units that call i needs. Take the units of the next `depth` calls
    (position + 1, ...), in order, each once, skipping those already resident (gathered or in
    flight); stop before the first one that would bring the live gathered elements above
    max_live_numel (None: no cap).
    """
    plan = []
    for needed in order[position + 1:position + 1 + depth]:
        for unit in needed:
            if unit in resident or unit in plan:
                continue
            if max_live_numel is not None and live_numel + numels[unit] > max_live_numel:
                return plan
            plan.append(unit)
            live_numel += numels[unit]
    return plan


class ExecutionOrder:
    """The order of calls of the forward and the backward pass, the same on every rank.

    In the first step (or the first after invalidate()) each call is recorded and announced to
    the other ranks (a tiny all-gather, before the call's own collectives): a rank on another
    path is caught at once. From the next step on, each call is checked against the record.
    """

    PHASES = ("forward", "backward")

    def __init__(self, call_names: list[str], device: torch.device):
        self.call_names, self.device = call_names, device
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.invalidate()

    def invalidate(self) -> None:
        """Forget the record: the next step records the order again."""
        self.recorded = dict.fromkeys(self.PHASES)  # phase -> list of call indices, None until recorded
        self.recording = {phase: [] for phase in self.PHASES}
        self.position = dict.fromkeys(self.PHASES, -1)  # index of the current call in the pass

    def start_forward(self) -> None:
        self.position["forward"] = -1
        if self.recorded["forward"] is None:
            self.recording = {phase: [] for phase in self.PHASES}

    def end_backward(self) -> None:
        """After the first step, its order (checked call by call on every rank) is the record."""
        if self.recorded["forward"] is None:
            self.recorded = {phase: list(calls) for phase, calls in self.recording.items()}
        self.position = dict.fromkeys(self.PHASES, -1)

    def follow(self, phase: str, index: int) -> None:
        """Record call `index`, or check it against the record."""
        position = self.position[phase] = self.position[phase] + 1
        order = self.recorded[phase]
        if order is None:
            self.recording[phase].append(index)
            self._check_same_call(phase, position, index)
        elif position >= len(order) or order[position] != index:
            expected = f"'{self.call_names[order[position]]}'" if position < len(order) else "no call (it had ended)"
            raise RuntimeError(
                f"rank {self.rank}: call {position} of the {phase} pass is unit '{self.call_names[index]}', but the "
                f"execution order recorded in the first step (the same on every rank) has {expected} there. Every "
                "rank must run the same units in the same order, or the all-gathers no longer match and the ranks "
                "hang. If the order changed on purpose on every rank, call optimizer.invalidate_order() on every "
                "rank before that step: it is recorded again, without prefetching.")

    def _check_same_call(self, phase, position, index):
        mine = torch.tensor([self.PHASES.index(phase), position, index], device=self.device)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine)
        if any(not torch.equal(theirs, mine) for theirs in everyone):
            calls = "; ".join(f"rank {rank}: {self.PHASES[b]} call {k} '{self.call_names[i]}'"
                              for rank, (b, k, i) in enumerate(t.tolist() for t in everyone))
            raise RuntimeError(f"rank {self.rank}: the ranks ran different units in the first step ({calls}). Every "
                               "rank must run the same units in the same order, or their all-gathers do not match.")


class UnitSchedule:
    """When each unit is gathered, freed and reduced: module hooks that follow the recorded order.

    units are the model's Units; calls[i] = (module name, module, indices of the units it needs):
    every unit module, and every module that uses another unit (a tied head), is a call.

    Extension points (override in a subclass; lessons 09 and 10 plug in here):
      all_gather(unit, phase, async_op)  fill unit.flat with the whole unit from the shards; return
                                         the handle if async_op (its wait() must leave flat complete)
      release(unit, phase)               drop the gathered unit's memory
      reduce_scatter(unit)               add this rank's shard of the mean gradient into unit.grad_shard
    phase is "forward", "backward", "end" (after backward) or "outside" (gathered_parameters, state dicts).
    group is the ranks the units are sharded over (None: all).
    """

    def __init__(self, model, units: list[Unit], calls: list[tuple], *, prefetch: int = 1,
                 max_live_numel: int | None = None, reshard_last: bool = True, group=None):
        self.units, self.calls, self.group = units, calls, group
        self.prefetch, self.max_live_numel, self.reshard_last = prefetch, max_live_numel, reshard_last
        self.order = ExecutionOrder([name for name, _, _ in calls], units[0].flat.device)
        self.unit_of = {p: unit for unit in units for p in unit.params}
        self.trace = None  # a list to record (phase, action, unit name, gathered elements) over time
        self.reduced = set()  # units reduce-scattered in this backward pass
        self.backward_started = False
        self.handles = [model.register_forward_pre_hook(self._start_forward, prepend=True)]
        for index, (_, module, _) in enumerate(calls):
            self.handles.append(module.register_forward_pre_hook(partial(self._pre_forward, index)))
            self.handles.append(module.register_forward_hook(partial(self._post_forward, index)))
        for p in self.unit_of:
            if p.requires_grad:
                # weak: torch keeps this hook in C++, where a cycle back to p (through unit_of) is never freed;
                # the model's module hooks above keep the schedule alive while the model is
                self.handles.append(p.register_post_accumulate_grad_hook(weak_hook(self._gradient_arrived)))

    # ---- extension points
    def all_gather(self, unit: Unit, phase: str, async_op: bool = False) -> dist.Work | None:
        return gather_unit(unit, async_op=async_op, group=self.group)

    def release(self, unit: Unit, phase: str) -> None:
        free_unit(unit)

    def reduce_scatter(self, unit: Unit) -> None:
        reduce_scatter_unit(unit, unit.grad_shard, self.group)

    # ---- gathering and freeing one unit
    def gather(self, unit: Unit, phase: str, async_op: bool = False) -> dist.Work | None:
        """Gather the unit (now, or started with async_op) and make its parameters views into it."""
        work = self.all_gather(unit, phase, async_op)
        unit.show_params()
        self._log(phase, "prefetch" if async_op else "gather", unit)
        return work

    def free(self, unit: Unit, phase: str) -> None:
        if unit.work is not None:
            unit.work.wait()
            unit.work = None
        unit.hide_params()
        self.release(unit, phase)
        self._log(phase, "free", unit)

    def _acquire(self, index, phase):
        unit = self.units[index]
        if unit.work is not None:  # prefetched: the all-gather was started earlier
            unit.work.wait()
            unit.work = None
        elif not unit.is_gathered():
            self.gather(unit, phase)

    def gathered_numel(self) -> int:
        """Elements of gathered (or being gathered) units on this rank right now."""
        return sum(unit.flat.numel() for unit in self.units if unit.is_gathered())

    def _log(self, phase, action, unit):
        if self.trace is not None:
            self.trace.append((phase, action, unit.name, self.gathered_numel()))

    # ---- the hooks
    def _start_forward(self, module, args):
        self.release_all()  # units a previous forward prefetched or kept, if no backward came
        self.order.start_forward()

    def _prefetch(self, phase):
        """Start the all-gathers that prefetch_plan asks for at the current position of the recorded
        order of `phase`, asynchronously (keep each handle in unit.work). Nothing while the order is
        being recorded, nor with prefetch=0."""
        order = self.order.recorded[phase]
        if order is None or not self.prefetch:
            return  # nothing is prefetched before the order is known
        needs = [self.calls[index][2] for index in order]
        resident = {i for i, unit in enumerate(self.units) if unit.is_gathered()}
        numels = [unit.flat.numel() for unit in self.units]
        for index in prefetch_plan(needs, self.order.position[phase], self.prefetch, resident, numels,
                                   self.gathered_numel(), self.max_live_numel):
            self.units[index].work = self.gather(self.units[index], phase, async_op=True)

    def _pre_forward(self, index, module, args):
        """Forward pre-hook of call `index`: follow the order, make sure each unit the call needs is
        gathered (_acquire) and count the call among its holders, then prefetch."""
        self.order.follow("forward", index)
        for unit in self.calls[index][2]:
            self._acquire(unit, "forward")
            self.units[unit].holders += 1
        self._prefetch("forward")

    def _post_forward(self, index, module, args, output):
        """Forward hook of call `index`: release its units, freeing each one no call holds any more
        (with reshard_last=False, nothing from the last call of the recorded forward on). With
        grad enabled, return the outputs passed through RegatherForBackward, so that
        _pre_backward(index) runs before this call's backward."""
        order = self.order.recorded["forward"]
        keep = not self.reshard_last and order is not None and self.order.position["forward"] == len(order) - 1
        for unit in map(self.units.__getitem__, self.calls[index][2]):
            unit.holders -= 1
            if unit.holders == 0 and not keep:
                self.free(unit, "forward")
        if not torch.is_grad_enabled():
            return output
        return regather_before_backward(output, partial(self._pre_backward, index))

    def _pre_backward(self, index):
        """Runs just before call `index`'s backward. On the first call of a backward pass, queue
        _finish_backward with the autograd engine; then follow the order, acquire the units the
        call needs (gathered until their gradients are reduced) and prefetch."""
        if not self.backward_started:
            self.backward_started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self.order.follow("backward", index)
        for unit in self.calls[index][2]:
            self._acquire(unit, "backward")
        self._prefetch("backward")

    def _gradient_arrived(self, param):
        param_unit = self.unit_of[param]
        param_unit.had_grad.add(param)  # the step updates only parameters that got a gradient
        self._on_gradient_ready(param)

    def _on_gradient_ready(self, param):
        """Post-accumulate-grad hook: once every trainable parameter of the unit has its gradient
        for this backward pass, reduce the unit."""
        unit = self.unit_of[param]
        unit.ready.add(param)
        if len(unit.ready) == len(unit.slices):
            self._reduce(unit)

    def _reduce(self, unit):
        """Reduce-scatter the unit's gradients into its gradient shard (self.reduce_scatter),
        remember that it was reduced in this backward pass, and free it unless a forward call
        still holds it."""
        self.reduce_scatter(unit)
        unit.ready.clear()
        self.reduced.add(unit)
        if unit.holders == 0 and unit.is_gathered():
            self.free(unit, "backward")

    def release_all(self):
        for unit in self.units:
            unit.holders = 0
            if unit.is_gathered():
                self.free(unit, "end")

    def _finish_backward(self):
        """Runs when backward ends: reduce what backward never reached (zeros: every rank must
        take part; its parameters got no gradient, so the step leaves them alone), free
        everything, and after the first step keep its order as the record."""
        for unit in self.units:
            if unit.grad_shard is not None and unit not in self.reduced:
                self._reduce(unit)
        self.release_all()
        self.reduced.clear()
        self.order.end_backward()
        self.backward_started = False
