# Generated from solutions/05_zero3/05_zero3.ipynb by `zero-lab build`: edit the notebook, not this file.

"""Leaving ZeRO stage 3 (lesson 05): the whole model again, from the shards every rank holds.

ShardedModelState     gathered parameters, the model's state dicts, consolidated and sharded checkpoints
persistent_buffers    the model's buffers that belong in its state dict
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist

from zero_lab.zero1 import MASTER_DTYPE, gather_shards

if __name__ != "__main__":  # in the package; in the notebook these names are your cells below
    from zero_lab.zero3_units import Unit


class ShardedModelState:
    """Leaving stage 3 (a part of Zero3Optimizer): gathered parameters, the model's own state dict
    and load_state_dict, sharded checkpoints and a consolidated one. Every rank must call each of
    them (they all-gather), as with FSDP's full state dict."""

    @contextmanager
    def gathered_parameters(self, params=None, modifier_rank: int | None = None):
        """Inside, the units of `params` (default: all) are gathered on every rank (call it on every
        rank). With modifier_rank, what that rank wrote into them is broadcast and becomes the new
        shards and fp32 masters on exit; otherwise changes are dropped."""
        if modifier_rank is not None and self.process_group is not None:
            raise NotImplementedError("gathered_parameters(modifier_rank=) broadcasts to all ranks, which group= does "
                                      "not shard over: write through model.load_state_dict() instead")
        wanted = {self.schedule.unit_of[p] for p in params} if params is not None else set(self.units)
        units = [unit for unit in self.units if unit in wanted]
        for unit in units:
            if not unit.is_gathered():
                self.schedule.gather(unit, "outside")
        try:
            yield
        finally:
            for unit in units:
                if modifier_rank is not None:
                    dist.broadcast(unit.flat, src=modifier_rank)
                    self._write_through(unit, unit.flat)
                self.schedule.free(unit, "outside")

    @torch.no_grad()
    def _write_through(self, unit: Unit, full: torch.Tensor) -> None:
        """Make this rank's part of `full` (the whole unit) its new fp32 master and shard."""
        start, stop = unit.layout.shard(dist.get_rank(self.shard_group))
        unit.master.copy_(full[start:stop])
        if unit.shard is not unit.master:
            unit.shard.copy_(unit.master)

    @torch.no_grad()
    def _full_masters(self, unit: Unit) -> list[torch.Tensor]:
        """The unit's whole fp32 weights, one tensor of its own per parameter (an all-gather)."""
        full = unit.master.new_empty(unit.layout.padded_numel)
        dist.all_gather_single(full, unit.master, group=self.shard_group)
        return [view.clone() for view in unit.views_of(full)]

    def _model_state_hooks(self) -> list:
        """model.state_dict() gives whole fp32 tensors; model.load_state_dict() writes through to
        the shards and masters (optimizer states stay, as with torch)."""
        loading = []

        def full_state(module, state, prefix, local_metadata):
            values = {p: value for unit in self.units for p, value in zip(unit.params, self._full_masters(unit))}
            for name, p in module.named_parameters(remove_duplicate=False):
                if prefix + name in state:
                    state[prefix + name] = values[p]  # tied names: the same tensor

        def gather_before_load(module, state, prefix, *args):
            loading.append((state, prefix))
            for unit in self.units:
                self.schedule.gather(unit, "outside")

        def write_after_load(module, incompatible_keys):
            state, prefix = loading.pop()
            loaded = {p: state[prefix + name] for name, p in module.named_parameters(remove_duplicate=False)
                      if prefix + name in state}
            for unit in self.units:
                full = unit.flat.to(MASTER_DTYPE)  # what load_state_dict left there (kept where not given)
                for p, view in zip(unit.params, unit.views_of(full)):
                    if p in loaded and loaded[p].shape == view.shape:  # a wrong shape: torch names it
                        view.copy_(loaded[p])  # in fp32, not rounded through the compute dtype
                self._write_through(unit, full)
                self.schedule.free(unit, "outside")

        return [self.model.register_state_dict_post_hook(full_state),
                self.model.register_load_state_dict_pre_hook(gather_before_load),
                self.model.register_load_state_dict_post_hook(write_after_load)]

    @torch.no_grad()
    def unshard_model(self) -> None:
        """Give every parameter its whole fp32 weights back, in storage of its own (every rank calls
        it; the hooks are removed first, through hook_handles). The optimizer is unusable after."""
        for handle in self.hook_handles:
            handle.remove()
        for unit in self.units:
            for p, value in zip(unit.params, self._full_masters(unit)):
                p.data = value

    def state_dict(self) -> dict:
        """This rank's shard of the training state (fp32 masters, which include frozen parameters,
        and the optimizer's states): save one file per rank, with the same world size to resume."""
        return {"stage": self.stage, "rank": self.rank, "world_size": self.world_size,
                "numels": [unit.layout.numel for unit in self.units],
                "masters": [unit.master.clone() for unit in self.units], "optimizer": self.optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Load this rank's shard; saved at another world size, the list of every saved rank's state_dict()
        or file path, in rank order (lesson 16); or the "optimizer" part of a consolidated_state_dict() at any
        world size (then load its "model" part with model.load_state_dict)."""
        if isinstance(state, (list, tuple)):  # every saved rank's, saved at any world size (lesson 16)
            from zero_lab.reshard import load_state_dicts  # lesson 16's: loaded only to reshard
            load_state_dicts(self, state)
            return
        if "stage" not in state and {"state", "param_groups"} <= set(state):
            return self._load_consolidated(state)
        numels = [unit.layout.numel for unit in self.units]
        if (state.get("stage"), state.get("world_size"), state.get("numels")) != (self.stage, self.world_size, numels):
            raise ValueError(
                f"this checkpoint is a stage {state.get('stage')} one sharded for {state.get('world_size')} ranks and "
                f"units of {state.get('numels')} elements, not stage 3 on {self.world_size} ranks and {numels}: resume "
                "with the same setup, pass every rank the list of all saved ranks' state dicts or files, in rank order "
                "(each reads only its part), or load a consolidated_state_dict() (model.load_state_dict(full['model']), "
                "optimizer.load_state_dict(full['optimizer'])) into any setup")
        if state["rank"] != self.rank:
            raise ValueError(f"rank {self.rank} was given rank {state['rank']}'s shard: load each rank's own file")
        self.optimizer.load_state_dict(state["optimizer"])
        for unit, saved in zip(self.units, state["masters"]):
            unit.master.copy_(saved)
            if unit.shard is not unit.master:
                unit.shard.copy_(unit.master)

    def _load_consolidated(self, state: dict) -> None:
        """Cut each parameter's saved state (numbered as over the unsharded parameters, which the
        inner optimizer's tensors follow one to one) down to this rank's slice of it."""
        slice_of = {s.param: s for unit in self.units for s in unit.slices}
        params = [p for group in self.group_params for p in group]
        if len(params) != sum(len(g["params"]) for g in state["param_groups"]):
            raise ValueError(f"this optimizer state is for {sum(len(g['params']) for g in state['param_groups'])} "
                             f"parameters, this optimizer trains {len(params)}: load it into the same model")
        shards = {}
        for index, saved in state["state"].items():
            piece = slice_of[params[int(index)]]
            shards[index] = {key: value.reshape(-1)[piece.param_offset:piece.param_offset + piece.master.numel()].clone()
                             if torch.is_tensor(value) and value.dim() else value for key, value in saved.items()}
        self.optimizer.load_state_dict({"state": shards, "param_groups": state["param_groups"]})

    @torch.no_grad()
    def consolidated_state_dict(self, dst: int = 0) -> dict | None:
        """The full fp32 training state on rank `dst` (None elsewhere); every rank must call it.

        {"model": an ordinary model state_dict (padding removed, tied names sharing one tensor),
        "optimizer": the state_dict of the same torch optimizer over the unsharded parameters}.
        """
        if self.process_group is not None:
            raise NotImplementedError("consolidated_state_dict gathers over all ranks, which group= does not shard "
                                      "over: save each rank's state_dict() instead")
        values, states = {}, {}
        for unit in self.units:
            shard_states = {}
            for piece in unit.slices:
                for key, value in self.optimizer.state.get(piece.master, {}).items():
                    if value.dim() == 0:
                        states.setdefault(piece.param, {})[key] = value.clone()
                    else:
                        shard_states.setdefault(key, torch.zeros_like(unit.master))[
                            piece.shard_offset:piece.shard_offset + piece.master.numel()] = value
            gathered = {key: gather_shards(t, dst) for key, t in {"master": unit.master, **shard_states}.items()}
            if self.rank != dst:
                continue
            for key, full in gathered.items():
                for p, piece in zip(unit.params, unit.views_of(full)):
                    if key == "master":
                        values[p] = piece.clone()
                    elif p in states:  # a parameter that was never stepped has no state
                        states[p][key] = piece.clone()
        if self.rank != dst:
            return None
        model_state = {name: b.float() if b.is_floating_point() else b.clone()
                       for name, b in persistent_buffers(self.model)}  # not model.state_dict(): that one gathers
        for name, p in self.model.named_parameters(remove_duplicate=False):
            model_state[name] = values[p]  # tied names: the same tensor
        index = iter(range(sum(len(params) for params in self.group_params)))
        groups, state = [], {}
        for params, options in zip(self.group_params, self.param_groups):
            numbers = [next(index) for _ in params]
            state.update((i, states[p]) for i, p in zip(numbers, params) if p in states)
            groups.append({**{k: v for k, v in options.items() if k != "params"}, "params": numbers})
        return {"model": model_state, "optimizer": {"state": state, "param_groups": groups}}


def persistent_buffers(model: torch.nn.Module):
    """(name, buffer) for the buffers that model.state_dict() holds."""
    for module_name, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield f"{module_name}.{name}" if module_name else name, buffer
