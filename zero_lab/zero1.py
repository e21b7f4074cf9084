# Generated from solutions/03_zero1/03_zero1.ipynb by `zero-lab build`: edit the notebook, not this file.

"""ZeRO stage 1 (P_os): each of N ranks keeps the optimizer states of only 1/N of the parameters.

ShardLayout          how a flat buffer is padded and cut into N equal, contiguous shards (shard_layout.py)
flatten_params_      one flat buffer per param group; the parameters become views into it
reduce_scatter_mean  each rank receives the data-parallel mean of its own gradient shard
all_gather_params    every rank receives every rank's updated shard, straight into the model
clip_grad_norm_      global-norm clipping when each rank holds only a shard of the gradient
shard_master         this rank's fp32 master: its shard of the flat buffer, taken before the bf16 cast
Zero1Optimizer       reduce-scatter -> optimizer step on this rank's shard -> all-gather

Memory per rank (ZeRO paper, section 5.1): 4 Psi + K Psi / Nd bytes with mixed precision, and
the same 2 Psi elements of communication per step as DDP (section 7.2.1).
"""

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.distributed as dist

from zero_lab.optim import (OptimizerOverCopies, ParametersOnly, UnusedParameters, hold_gradients, weak_hook,
                            write_through_loads)

if __name__ != "__main__":  # in the package; in the notebook ShardLayout is your cell below
    from zero_lab.shard_layout import ShardLayout


def param_views(flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views into `flat` with the shapes of `params`, laid out one after the other."""
    views, offset = [], 0
    for p in params:
        views.append(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    return views


def flatten_params_(params: list[torch.nn.Parameter], world_size: int) -> tuple[torch.Tensor, ShardLayout]:
    """Copy `params` into one zero-padded flat buffer and make every parameter a view into it.

    With the parameters living in the buffer, one all-gather into the buffer updates the
    whole model, and shards are plain slices of it.
    """
    layout = ShardLayout(sum(p.numel() for p in params), world_size)
    flat = torch.zeros(layout.padded_numel, dtype=params[0].dtype, device=params[0].device)
    for p, view in zip(params, param_views(flat, params)):
        view.copy_(p.detach())
        p.data = view
    return flat, layout


def reduce_scatter_mean(flat_grad: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's shard of the gradient, summed over the ranks of `group` and divided by their number.

    `flat_grad` is this rank's full padded gradient buffer (length a multiple of the group's
    size); the result is a new tensor of length len(flat_grad) / group size. `group` None means
    all ranks (lesson 17 passes a data-parallel group of a mesh).
    """
    world_size = dist.get_world_size(group)
    shard = torch.empty(flat_grad.numel() // world_size, dtype=flat_grad.dtype, device=flat_grad.device)
    dist.reduce_scatter_single(shard, flat_grad, group=group)
    return shard.div_(world_size)  # gloo has no AVG: sum, then divide


def all_gather_params(flat_param: torch.Tensor, shard: torch.Tensor, group=None) -> None:
    """Write every rank's `shard` into every rank's `flat_param`, in rank order (the ranks of `group`; None: all).

    `shard` may have another dtype (the fp32 master); it is cast to flat_param's dtype.
    """
    dist.all_gather_single(flat_param, shard.to(flat_param.dtype), group=group)


def clip_grad_norm_(grad_shards: list[torch.Tensor], real_numels: list[int], max_norm: float) -> torch.Tensor:
    """Scale every rank's gradient shards so that the norm of the *whole* gradient is <= max_norm.

    Only the first real_numels[i] elements of grad_shards[i] are gradient; the rest is padding
    and must not count. Returns the global norm before clipping (the same on every rank), and
    scales like torch.nn.utils.clip_grad_norm_: by min(1, max_norm / (norm + 1e-6)).
    """
    squares = torch.zeros((), dtype=torch.float32, device=grad_shards[0].device)
    for grad, real in zip(grad_shards, real_numels):
        squares += grad[:real].float().pow(2).sum()
    dist.all_reduce(squares)  # sum of squares over all shards = squared global norm
    total_norm = squares.sqrt()
    scale = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    for grad in grad_shards:
        grad.mul_(scale)
    return total_norm


SHARDABLE_OPTIMIZERS = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)  # element-wise updates
MASTER_DTYPE = torch.float32


@dataclass
class FlatGroup:
    """One param group, flattened: the model's parameters are views into flat_param."""

    params: list[torch.nn.Parameter]
    layout: ShardLayout
    flat_param: torch.Tensor  # padded, compute dtype, every parameter of the group
    master: torch.Tensor  # this rank's shard in fp32: a view of flat_param when that is fp32
    flat_grad: torch.Tensor | None  # padded, compute dtype (stage 1 keeps full gradients)


def param_groups_of(model: torch.nn.Module, params=None) -> list[dict]:
    """Param groups as torch.optim takes them (tensors or dicts), default all of `model`'s."""
    params = list(model.parameters() if params is None else params)
    groups = [dict(g) for g in params] if params and isinstance(params[0], dict) else [{"params": params}]
    for g in groups:
        g["params"] = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
    listed = [id(p) for g in groups for p in g["params"]]
    if len(listed) != len(set(listed)):  # it would get two places in the buffers, two updates per step
        raise ValueError("some parameters appear more than once in the param groups (as torch.optim, "
                         "which refuses them too): list each parameter once")
    return groups


def shard_master(flat: torch.Tensor, layout: ShardLayout, rank: int,
                 compute_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(master, compute_flat): this rank's shard of `flat` as the fp32 master, and `flat` in the compute dtype.

    The master is taken before any cast, so it keeps the full fp32 weights: a view of flat's
    shard when the model computes in fp32 (no copy), else an fp32 copy of the shard.
    """
    start, stop = layout.shard(rank)
    if compute_dtype == MASTER_DTYPE == flat.dtype:
        return flat[start:stop], flat  # the model's own fp32 elements: the optimizer updates them in place
    return flat[start:stop].to(MASTER_DTYPE, copy=True), flat.to(compute_dtype)


def gather_shards(shard: torch.Tensor, dst: int, device: torch.device | None = None) -> torch.Tensor | None:
    """The concatenation of every rank's `shard` on rank `dst` (None elsewhere), gathered on `device`
    (default the shard's): the model's, since nccl gathers only CUDA tensors and an offloaded shard
    lives on the host."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shard = shard.to(device or shard.device).contiguous()
    parts = [torch.empty_like(shard) for _ in range(world_size)] if rank == dst else None
    dist.gather(shard, parts, dst=dst)
    return torch.cat(parts) if rank == dst else None


GROUP_BUILT = ("Zero1Optimizer", "Zero2Optimizer")  # by name: not their offload or Muon subclasses


def place_in(group, optimizer, max_grad_norm=None, find_unused_parameters=False) -> tuple[int, int, int]:
    """(this rank's number in `group`, the group's size, its first rank's global number); None: all ranks.
    group= is built for Zero1Optimizer and Zero2Optimizer (lesson 17), without max_grad_norm and find_unused_parameters."""
    if group is None:
        return dist.get_rank(), dist.get_world_size(), 0
    if type(optimizer).__name__ not in GROUP_BUILT or max_grad_norm is not None or find_unused_parameters:
        raise NotImplementedError(f"group= is built for {' and '.join(GROUP_BUILT)}, not {type(optimizer).__name__}, and without "
                                  "max_grad_norm and find_unused_parameters (their collectives span all ranks)")
    return dist.get_rank(group), dist.get_world_size(group), dist.get_global_rank(group, 0)


class ShardedCheckpoint:
    """Saving and loading for the ZeRO optimizers (needs .model, .groups, .optimizer, .rank, .world_size)."""

    process_group = None  # the ranks the shards are spread over (None: all); stage 1's group= (lesson 17)
    reshardable = True  # lesson 16's load_state_dicts may re-cut its shards for another world size

    def state_dict(self) -> dict:
        """This rank's shard of the training state: save one file per rank."""
        return {
            "stage": self.stage, "rank": self.rank, "world_size": self.world_size,
            "numels": [g.layout.numel for g in self.groups],
            "masters": [g.master.detach().clone() for g in self.groups],  # clone: not the whole flat buffer
            "optimizer": self.optimizer.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict | list) -> None:
        """Load this rank's shard (every rank calls it); the model's weights follow the masters. Saved at another
        world size: the list of every saved rank's state_dict() or file path, in rank order (lesson 16)."""
        if isinstance(state, (list, tuple)):
            from zero_lab.reshard import load_state_dicts  # lesson 16's: loaded only to reshard
            load_state_dicts(self, state)
            return
        if "world_size" not in state and "param_groups" in state:  # consolidated_state_dict()["optimizer"]
            return self._load_consolidated(state)
        numels = [g.layout.numel for g in self.groups]
        if (state["world_size"], state["numels"]) != (self.world_size, numels):
            raise ValueError(
                f"this checkpoint is sharded for {state['world_size']} ranks and groups of {state['numels']} "
                f"elements, not {self.world_size} ranks and {numels}: resume with the same world size and "
                "param groups, or pass every rank the list of all saved ranks' state dicts or files, in rank order "
                "(each reads only its part), or load the consolidated_state_dict() into any setup")
        if state["rank"] != self.rank:
            raise ValueError(f"rank {self.rank} was given rank {state['rank']}'s shard: load each rank's own file")
        self.optimizer.load_state_dict(state["optimizer"])
        for group, master in zip(self.groups, state["masters"]):
            group.master.copy_(master)
            all_gather_params(group.flat_param, group.master, self.process_group)

    @torch.no_grad()
    def consolidated_state_dict(self, dst: int = 0) -> dict | None:
        """The full fp32 training state on rank `dst` (None elsewhere), like DeepSpeed's zero_to_fp32.

        {"model": the model's state_dict with fp32 master weights, "optimizer": the state_dict of
        the same torch optimizer over the unsharded trainable parameters}. Every rank must call it.
        """
        if self.process_group is not None:
            raise NotImplementedError("consolidated_state_dict gathers over all ranks, which group= does not shard "
                                      "over: save each rank's state_dict() instead")
        full_values, full_states = {}, {}
        for group in self.groups:
            state = self.optimizer.state[group.master]
            counts = state.get("param_steps")  # each parameter's own step count, where some were skipped
            shards = {"master": group.master, **{k: v for k, v in state.items() if v.dim() > 0 and k != "param_steps"}}
            gathered = {key: gather_shards(shard, dst, group.flat_param.device) for key, shard in shards.items()}
            if self.rank != dst:
                continue
            scalars = {k: v for k, v in state.items() if v.dim() == 0}  # Adam's step count
            for key, full in gathered.items():
                for i, (p, view) in enumerate(zip(group.params, param_views(full, group.params))):
                    if key == "master":
                        full_values[p] = view.clone()
                    elif counts is None or counts[i] > 0:  # a parameter never updated has no state in torch
                        # a step tensor per parameter: torch.optim increments each one in place
                        own = {k: (counts[i] if counts is not None and k == "step" else v).to(v.dtype, copy=True)
                               for k, v in scalars.items()}
                        full_states.setdefault(p, own)[key] = view.clone()
        if self.rank != dst:
            return None
        model_state = {k: v.float() if v.is_floating_point() else v.clone() for k, v in self.model.state_dict().items()}
        for name, p in self.model.named_parameters(remove_duplicate=False):  # tied weights: every name
            if p in full_values:
                model_state[name] = full_values[p]
        return {"model": model_state, "optimizer": self._unsharded_optimizer_state(full_states)}

    @torch.no_grad()
    def _load_consolidated(self, full: dict) -> None:
        """Load consolidated_state_dict()["optimizer"] (torch's format over the unsharded parameters),
        saved at any world size: each rank keeps its shard of every state tensor. The weights come
        with the model's state: model.load_state_dict(consolidated["model"]) reaches the masters."""
        sizes = [len(saved["params"]) for saved in full["param_groups"]]
        if sizes != [len(g.params) for g in self.groups]:
            raise ValueError(f"this optimizer state has param groups of {sizes} parameters, not "
                             f"{[len(g.params) for g in self.groups]}: prepare the model with the same param groups")
        shards = {}
        for index, (group, saved) in enumerate(zip(self.groups, full["param_groups"])):
            states = [full["state"].get(i, {}) for i in saved["params"]]
            start, stop = group.layout.shard(self.rank)
            shard = {}
            for key in sorted({k for s in states for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0}):
                flat = torch.zeros(group.layout.padded_numel, dtype=MASTER_DTYPE)  # zeros: no state yet
                for s, view in zip(states, param_views(flat, group.params)):
                    if key in s:
                        view.copy_(s[key])
                shard[key] = flat[start:stop].clone()  # its own storage: a view keeps the whole buffer alive
            if any("step" in s for s in states):  # Adam: the shard counts the most; the others keep their own
                counts = [float(s.get("step", 0)) for s in states]
                shard["step"] = torch.tensor(max(counts))
                if len(set(counts)) > 1:
                    shard["param_steps"] = torch.tensor(counts)
            if shard:
                shards[index] = shard
        groups = [{**{k: v for k, v in saved.items() if k != "params"}, "params": [index]}
                  for index, saved in enumerate(full["param_groups"])]
        self.optimizer.load_state_dict({"state": shards, "param_groups": groups})

    def _unsharded_optimizer_state(self, full_states: dict) -> dict:
        # torch.optim numbers the parameters consecutively through the groups.
        state, groups, index = {}, [], 0
        for group, options in zip(self.groups, self.optimizer.param_groups):
            indices = list(range(index, index + len(group.params)))
            state.update((i, full_states[p]) for i, p in zip(indices, group.params) if p in full_states)
            groups.append({**{k: v for k, v in options.items() if k != "params"}, "params": indices})
            index += len(group.params)
        return {"state": state, "param_groups": groups}


class Zero1Optimizer(ShardedCheckpoint, OptimizerOverCopies):
    """ZeRO stage 1 around an element-wise torch optimizer (AdamW by default).

    Every rank keeps the whole model in the compute dtype and whole gradients; only this rank's
    shard of each flat param group has an fp32 master copy and optimizer state. The ordinary
    loop works: `loss.backward(); optimizer.step(); optimizer.zero_grad()`. It is a
    torch.optim.Optimizer whose param_groups are the inner optimizer's (one per flat group), so
    LR schedulers and changes to param_groups[i]["lr"] work as usual, and
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) clips by the global norm.

    params         tensors or param-group dicts, as for torch.optim (default: model.parameters());
                   frozen parameters (requires_grad=False) are left out. With model=None, params alone
                   (as torch's ZeroRedundancyOptimizer takes them): load_state_dict of a model then does
                   not reach the fp32 masters; load the optimizer's own state dict
    param_dtype    cast the trainable parameters to this compute dtype (torch.bfloat16 for mixed
                   precision); the fp32 masters are taken before the cast. None keeps the dtype.
    max_grad_norm  clip the global gradient norm to this in step() (None: no clipping)
    find_unused_parameters  as torch's DDP: False (default), a parameter without gradient in a step
                   is an error; True, one that no rank used is not updated (zero_lab.optim.UnusedParameters)
    group          shard over this process group's ranks only (None: all ranks): a mesh's dp group (lesson 17)
    **defaults     the optimizer's options (lr, weight_decay, ...)
    model.load_state_dict(...) after building it also sets the fp32 masters.
    """

    stage = 1

    def __init__(self, model, optimizer_class=torch.optim.AdamW, params=None, *,
                 param_dtype=None, max_grad_norm=None, find_unused_parameters=False, group=None, **defaults):
        if model is None:  # parameters alone, as torch's ZeroRedundancyOptimizer(params, ...) takes them
            if params is None:
                raise TypeError("pass the model, or params= (its parameters or param groups) with model=None")
            params = param_groups_of(None, params)
            model = ParametersOnly(params)
        self.model, self.max_grad_norm, self.process_group = model, max_grad_norm, group
        self.rank, self.world_size, self.first_rank = place_in(group, self, max_grad_norm, find_unused_parameters)
        self.groups, inner_groups = [], []
        for index, options in enumerate(param_groups_of(model, params)):
            trainable = [p for p in options.pop("params") if p.requires_grad]
            if not trainable:
                raise ValueError(f"param group {index} has no trainable parameters: leave it out")
            group = self._flatten_group(trainable, param_dtype)
            self.groups.append(group)
            inner_groups.append({**options, "params": [group.master]})
        super().__init__(optimizer_class(inner_groups, **defaults))
        hold_gradients(self, [p for g in self.groups for p in g.params])
        self.last_grad_norm = None
        # torch.optim's semantics around the inner step: parameters without gradient are not updated,
        # and model.load_state_dict writes through to the masters (zero_lab.optim).
        names = {id(p): name for name, p in model.named_parameters()}
        self.unused = UnusedParameters(self.groups, self.rank, {p: names.get(id(p), "?") for g in self.groups for p in g.params},
                                       find_unused_parameters)
        self.stepping = False  # inside step(): then the inner optimizer's step is this step's update
        # weak_hook: hooks on itself and on inner would be cycles, freed only by the garbage collector
        self.register_step_pre_hook(weak_hook(self._enter_step))
        self.register_step_post_hook(weak_hook(self._leave_step))
        self.optimizer.register_step_pre_hook(weak_hook(self._before_update))
        self.optimizer.register_step_post_hook(weak_hook(self._after_update))
        self.master_offsets = {id(p): (group, offset) for group in self.groups
                               for p, offset in zip(group.params, accumulate([0] + [q.numel() for q in group.params]))}
        self.model_hooks = [*self.unused.handles, write_through_loads(model, self._write_master, self._before_load)]
        self._note_weights()

    def _flatten_group(self, params, param_dtype) -> FlatGroup:
        flat, layout = flatten_params_(params, self.world_size)
        dist.broadcast(flat, src=self.first_rank, group=self.process_group)  # all start from its first rank's weights
        master, compute_flat = shard_master(flat, layout, self.rank, param_dtype or flat.dtype)
        if compute_flat is not flat:  # the model computes in the compute dtype from now on
            for p, view in zip(params, param_views(compute_flat, params)):
                p.data = view
        return FlatGroup(params, layout, compute_flat, master, self._new_flat_grad(compute_flat, params))

    def _enter_step(self, optimizer, args, kwargs) -> None:
        self.stepping = True
        self._adopt_edited_weights()

    def _leave_step(self, optimizer, args, kwargs) -> None:
        self.stepping = False
        self._note_weights()

    def _note_weights(self) -> None:
        """Each parameter's version counter now: an in-place edit (with torch.no_grad(): p.mul_(...))
        increments it, as autograd's checks rely on; this optimizer's writes into the flat buffer do not."""
        self.weight_versions = [[p._version for p in g.params] for g in self.groups]

    def _edited(self, group: FlatGroup, versions: list[int]) -> bool:
        return any(p._version != version for p, version in zip(group.params, versions))

    @torch.no_grad()
    def _adopt_edited_weights(self) -> None:
        """Parameters edited in place since the last step: the masters take the edited elements of this
        rank's shard (the next step would otherwise write the masters over them)."""
        for group, versions in zip(self.groups, self.weight_versions):
            if self._edited(group, versions):
                own = self._own_weights(group)
                edited = own != group.master.to(own.dtype)
                group.master[edited] = own[edited].to(group.master.dtype)
        self._note_weights()

    def _own_weights(self, group: FlatGroup) -> torch.Tensor:
        """This rank's shard of the model's weights, where its master is (lesson 06: on the host)."""
        return group.flat_param[slice(*group.layout.shard(self.rank))]

    def _before_update(self, optimizer, args, kwargs) -> None:
        plan = self.unused.plan() if self.stepping else None  # not when the inner optimizer is stepped by hand
        self.skipped = self.unused.before(plan, optimizer, [g.master.grad for g in self.groups])

    def _after_update(self, optimizer, args, kwargs) -> None:
        self.unused.after(optimizer, self.skipped)

    @torch.no_grad()
    def _write_master(self, param, value: torch.Tensor) -> None:
        """model.load_state_dict's value of `param` also goes into this rank's fp32 master (its part of the shard)."""
        if id(param) not in self.master_offsets:
            return  # frozen: no master
        group, offset = self.master_offsets[id(param)]
        start, stop = group.layout.shard(self.rank)
        lo, hi = max(offset, start), min(offset + param.numel(), stop)
        if lo < hi:
            group.master[lo - start:hi - start] = value.reshape(-1)[lo - offset:hi - offset].to(group.master)

    def _before_load(self) -> None:
        """What must happen before model.load_state_dict writes the weights (lesson 06: finish a delayed update)."""

    def _new_flat_grad(self, flat_param, params):
        # .grad as views into one flat buffer: backward accumulates into them in place, so the
        # reduce-scatter needs no copy (like DDP's gradient_as_bucket_view; DeepSpeed's
        # contiguous_gradients copies the gradients into a buffer instead).
        flat_grad = torch.zeros_like(flat_param)
        for p, view in zip(params, param_views(flat_grad, params)):
            p.grad = view
        return flat_grad

    def reduce_gradients(self) -> list[torch.Tensor]:
        """Each group's averaged gradient shard. Stage 1: one reduce-scatter per flat buffer."""
        shards = []
        for group in self.groups:
            self._adopt_replaced_grads(group)
            shards.append(reduce_scatter_mean(group.flat_grad, self.process_group))
        return shards

    @staticmethod
    def _adopt_replaced_grads(group: FlatGroup) -> None:
        # model.zero_grad() sets .grad to None and the next backward makes a fresh tensor:
        # copy such gradients into the flat buffer instead of silently dropping them.
        for p, view in zip(group.params, param_views(group.flat_grad, group.params)):
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad) if p.grad is not None else view.zero_()
                p.grad = view

    @torch.no_grad()
    def _reduce_into_masters(self) -> None:
        """Give each fp32 master its averaged gradient shard, once per step."""
        if self.groups[0].master.grad is None:  # clip_grad_norm_ may have reduced already
            for group, grad_shard in zip(self.groups, self.reduce_gradients()):
                group.master.grad = grad_shard.to(MASTER_DTYPE)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the averaged gradient to global L2 norm <= max_norm before step(); return the norm.
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) calls this."""
        self._reduce_into_masters()  # step() will not reduce a second time
        return clip_grad_norm_([g.master.grad for g in self.groups],
                               [g.layout.real_numel(self.rank) for g in self.groups], max_norm)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.evaluate_closure(closure)
        self._reduce_into_masters()
        if self.max_grad_norm is not None:
            self.last_grad_norm = self.clip_grad_norm_(self.max_grad_norm)
        self.optimizer.step()
        for group in self.groups:
            group.master.grad = None  # the fp32 gradient shard lives only during the step
            all_gather_params(group.flat_param, group.master, self.process_group)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffers in place; `set_to_none` is ignored (the .grad views must stay)."""
        for group in self.groups:
            group.flat_grad.zero_()
            group.master.grad = None  # a clipped gradient not yet stepped on

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this rank holds, for zero_lab.memory_ledger (shared storages are counted once)."""
        return {
            "parameters": list(self.model.parameters()),
            "gradients": [g.flat_grad for g in self.groups if g.flat_grad is not None],
            "master_params": [g.master for g in self.groups],
            "optimizer_states": [v for state in self.optimizer.state.values() for v in state.values()
                                 if torch.is_tensor(v) and v.dim() > 0],
        }
