"""One entry point for every stage, used with the ordinary training loop:

    model, optimizer = zero_lab.prepare(model, torch.optim.AdamW, stage=1, lr=3e-4)
    for batch in my_shard_of_each_global_batch:
        loss = compute_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

The stages, their modules, classes and options are one table, zero_lab/stages.py (docs/stages.md):
stage 0 is DDP (lesson 02), 1 shards the optimizer states (P_os, lesson 03), 2 the gradients too
(P_os+g, lesson 04), 3 the parameters too (P_os+g+p, lesson 05); stages 1-2 with offload="cpu"
are ZeRO-Offload (lesson 06), stage 3 with offload="nvme" ZeRO-Infinity's NVMe tier (lesson 10).

Options besides the optimizer's own (lr, betas, weight_decay, ...):
    params=         tensors or param-group dicts, as torch.optim takes them (default: all of the model's)
    device=         where the model trains: it is moved there first (zero_lab.rank_device() is this rank's GPU,
                    or the CPU). Default: where it is, when the process group carries that device's tensors
                    (zero_lab's does, CPU and CUDA); a CPU model under an nccl-only group goes to the current
                    GPU, as FSDP2 and DeepSpeed do. Stage 3 makes a meta model's shards there (init_fn=).
                    Batches go to the model's device: the caller moves them (batch.to(device))
    param_dtype=    compute dtype, torch.bfloat16 for mixed precision (fp32 masters kept)
    max_grad_norm=  stages 1-3: clip the global gradient norm in optimizer.step()
    find_unused_parameters=  stages 0-2, as torch's DDP: True lets a step leave parameters without gradient
                    (they are not updated, as with torch.optim); False (default) makes that an error
    params=[{"params": ..., "process_group": pg}, ...]
                    stages 1-2: each param group sharded over its own process group (absent: all ranks), its
                    gradient summed there and divided by the world's size (lesson 19: experts over their
                    expert-data-parallel group, zero_lab.moe_zero); not with group=
    group=          stages 1-3: shard over the ranks of this process group only (default all ranks): on a mesh, the
                    data-parallel group, each tensor-parallel slice sharded over its own (lesson 17, zero_lab.mesh);
                    not with max_grad_norm, find_unused_parameters, offload, Muon or ranks_per_node
    bucket_numel=   stage 2: elements per gradient bucket
    units=, prefetch=, max_live_numel=, reshard_last=, init_fn=
                    stage 3: sharding units, prefetch depth and cap, meta-device init (zero_lab.zero3)
    ranks_per_node=, qwz=, hpz=, qgz=, replicate_across_nodes=
                    stage 3 on nodes of ranks_per_node ranks (lesson 09, zero_lab.zeropp): ZeRO++'s
                    quantized weights, hierarchical partition, quantized gradients (any subset), or HSDP
    offload="nvme", nvme_dir=, nvme_bandwidth=, nvme_quota=, nvme_chunk_numel=
                    stage 3: ZeRO-Infinity (lesson 10, zero_lab.infinity): fp32 masters and Adam's states on a
                    simulated NVMe tier in nvme_dir (bytes/s nvme_bandwidth, at most nvme_quota bytes per rank),
                    streamed nvme_chunk_numel elements at a time, prefetch= chunks read ahead
    offload="cpu"   stages 1-2: ZeRO-Offload (lesson 06, zero_lab.offload): fp32 masters, Adam's states,
                    gradient shards and the update on the host; the 16-bit parameters on the device
    dpu_warmup_steps=  with offload: the one-step delayed parameter update after this many ordinary
                    steps (None, the default: no delay; the paper warms up without it); call optimizer.flush()
                    before reading the weights
    cpu_adam=       with offload: "compiled" (default: one compiled C pass, torch's fused AdamW's
                    results; torch's operations if no C compiler) or "torch" (bit for bit stage 1-2's AdamW)
    adam_threads=   with offload: threads of the host's AdamW (default 1)
    muon_sharding=, adamw=
                    stage 1 with torch.optim.Muon (lesson 12, zero_lab.muon): "gather" (momentum in flat shards,
                    each matrix's direction all-gathered) or "own" (whole matrices owned by ranks); Muon for the
                    2-D hidden weights, AdamW with the options in adamw= for embeddings, norms and biases; fp32.
                    Stage 3 with torch.optim.Muon (lesson 12, part 2, zero_lab.muon_zero3) takes adamw= and
                    units=, prefetch=, max_live_numel=, reshard_last=: each matrix orthogonalised by an owner, its
                    pieces sent there and back by all-to-all. Other optimizers that need whole matrices (Adafactor),
                    and Muon at stage 2, are refused
Defaults keep the model's dtype. Anything else is refused with an error that names the fix.
Call it on every rank, inside zero_lab.launch or after zero_lab.init_distributed().

The optimizer is a torch.optim.Optimizer (LR schedulers, param_groups, state_dict) and
torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) clips by the global norm at every
stage. Preparing the same model again (re-running a cell) detaches the earlier preparation's
hooks. Nothing in zero_lab keeps a prepared model or its optimizer alive: `del model, optimizer`
frees them at once at stages 0-2, and at the next garbage collection (gc.collect()) at stage 3,
whose model holds its schedule and optimizer through its hooks. BatchNorm running statistics stay per rank, computed on each rank's shard of the batch
(prepare warns): on GPUs convert the model with torch.nn.SyncBatchNorm.convert_sync_batchnorm
for statistics over the global batch; on CPU use LayerNorm/GroupNorm, or keep rank 0's.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import warnings
import weakref

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from zero_lab.optim import remove_hooks
from zero_lab.stages import (MUON_LESSON, MUON_OPTIONS, NODE_OPTIONS, NVME_LESSON, NVME_MODULE, NVME_OPTIONS,
                             OFFLOAD_LESSON, OFFLOAD_MODULE, OFFLOAD_OPTIONS, PROCESS_GROUP_KEY, PROCESS_GROUPS_LESSON,
                             PROCESS_GROUPS_MODULE, PROCESS_GROUPS_STAGES, STAGES)

PARAM_DTYPES = (torch.float32, torch.bfloat16)
# model -> weakref to what prepare made of it last (holds its gradient hooks). Weak both ways: a strong
# value would keep its key alive (the optimizer refers to the model), and nothing here may outlive the user's names.
_prepared = WeakIdKeyDictionary()


def prepare(model: torch.nn.Module, optimizer_class: type, stage: int = 0, *, params=None, **options):
    """Return (model, optimizer) set up for data-parallel training with the given ZeRO stage."""
    model = next((m for m, made in list(_prepared.items()) if made() is model), model)  # given stage 0's wrapper back
    _check_setup(model, optimizer_class, stage)
    on_meta = any(p.device.type == "meta" for p in model.parameters())  # stage 3 makes it (init_fn=)
    device = _training_device(model, options.pop("device", None), on_meta)
    row = STAGES[stage]
    zero_options = {k: options.pop(k) for k in list(options) if k in row.options}
    _check_options(optimizer_class, stage, options)
    _check_dtypes(model, zero_options.get("param_dtype"))
    offload = _check_offload(stage, zero_options)
    muon = _check_muon(optimizer_class, zero_options, offload)
    on_nodes = _on_nodes(zero_options)
    if offload == "nvme" and on_nodes:
        raise TypeError('offload="nvme" and ranks_per_node= together are not built in this course: use one of them')
    module_name, lesson, builds = ((row.muon.module, row.muon.lesson, row.muon.builds) if muon
                                   else (OFFLOAD_MODULE, OFFLOAD_LESSON, row.offload) if offload == "cpu"
                                   else (NVME_MODULE, NVME_LESSON, row.nvme) if offload == "nvme"
                                   else (row.nodes.module, row.nodes.lesson, row.nodes.builds) if on_nodes
                                   else (row.module, row.lesson, row.builds))
    variant = f' with offload="{offload}"' if offload else " on nodes" if on_nodes else " with Muon" if muon else ""
    module = _lesson_module(module_name, lesson, f"stage {stage}{variant}")
    param_dtype = zero_options.get("param_dtype")
    _warn_about_batch_norm(model)
    earlier = _prepared.pop(model, None)
    if earlier is not None:  # prepared before (a re-run cell): start afresh
        previous = earlier()  # None if it was freed (its hooks went with it)
        if previous is not None:  # its hooks would reduce every gradient again, or hand the new optimizer zeros
            remove_hooks(getattr(previous, "hook_handles", []), getattr(previous, "model_hooks", []))
        if hasattr(previous, "unshard_model"):  # stage 3 sharded the model in place: whole parameters again
            previous.unshard_model()
        if hasattr(previous, "close"):  # its NVMe tier's files
            previous.close()
        del previous
        model.zero_grad(set_to_none=True)  # views into the old optimizer's buffers
    if not on_meta:
        model.to(device)
    built = getattr(module, builds)
    if _names_process_groups(params):
        built = _over_process_groups(built, stage, variant, zero_options)
    with torch.device(device) if on_meta else contextlib.nullcontext():  # where stage 3 makes a meta model's shards
        wrapped, optimizer = _build(row, built, module, model, optimizer_class, params, param_dtype, options,
                                    zero_options)
    if param_dtype is not None and not row.shards_parameters:  # stage 3 casts its shards and the buffers itself
        model.to(param_dtype)  # frozen parameters and buffers too; the fp32 masters were taken before
    return wrapped, optimizer


def _build(row, built, module, model, optimizer_class, params, param_dtype, options, zero_options):
    if row.wraps_model:
        wrapped, optimizer = _prepare_ddp(built, module, model, optimizer_class, params, param_dtype, options,
                                          zero_options.get("find_unused_parameters", False))
        made = wrapped
    else:
        wrapped, made = model, built(model, optimizer_class, params, **zero_options, **options)
        optimizer = made
    _prepared[model] = weakref.ref(made)
    # Its hooks hold it weakly (zero_lab.optim.weak_hook): if it is freed while the model lives on, they go too.
    weakref.finalize(made, remove_hooks, getattr(made, "hook_handles", []), getattr(made, "model_hooks", []))
    return wrapped, optimizer


def _names_process_groups(params) -> bool:
    params = params if isinstance(params, (list, tuple)) else []
    return any(isinstance(g, dict) and PROCESS_GROUP_KEY in g for g in params)


def _over_process_groups(built, stage: int, variant: str, zero_options: dict):
    """Param groups with their own process groups (lesson 19): one optimizer of the stage per process group."""
    if stage not in PROCESS_GROUPS_STAGES or variant or "group" in zero_options:
        raise ValueError(f'param groups with a "{PROCESS_GROUP_KEY}" are built for stages {PROCESS_GROUPS_STAGES}, '
                         f"without group=, offload, Muon or nodes (lesson {PROCESS_GROUPS_LESSON}), not stage "
                         f"{stage}{variant}")
    return _lesson_module(PROCESS_GROUPS_MODULE, PROCESS_GROUPS_LESSON, "param groups with process groups"
                          ).over_process_groups(built)


def _training_device(model, device, on_meta: bool) -> torch.device:
    """Where the model trains: `device`, else where it is if the process group carries that device's
    tensors, else the current GPU (a CPU model under an nccl-only group). A meta model (stage 3's
    init_fn) is made on `device`, else on torch's default device."""
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r}, but no GPU is visible: use device='cpu' or leave device out")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    if on_meta:
        return torch.get_default_device()
    current = next(model.parameters()).device
    carried = {d.type for d in dist.distributed_c10d._get_default_group()._device_types}
    if current.type in carried:
        return current
    if current.type == "cpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    raise ValueError(f"the model is on {current}, which the process group ({dist.get_backend()}) does not carry: "
                     f"move it with model.to(device), or pass device= to prepare")


def _lesson_module(name: str, lesson: str, what: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as missing:
        if missing.name != name:
            raise
        raise RuntimeError(f"{what} needs {name}, which does not exist yet: run `zero-lab build {lesson}`") from None


def _prepare_ddp(wrapper, ddp, model, optimizer_class, params, param_dtype, options, find_unused_parameters):
    model = wrapper(model, find_unused_parameters=find_unused_parameters)  # broadcasts rank 0's weights first
    params = ddp.trainable_parameters(model) if params is None else params
    if param_dtype is None:
        return model, optimizer_class(params, **options)
    params = list(params)
    if params and isinstance(params[0], dict):
        raise ValueError("stage 0 with param_dtype (lesson 02's MasterWeightOptimizer) takes one list of "
                         "parameters, not param groups: use stage=1 for param groups with mixed precision")
    optimizer = ddp.MasterWeightOptimizer(params, optimizer_class, **options)
    from zero_lab.optim import write_through_loads  # model.load_state_dict must reach the fp32 masters
    model.hook_handles.append(write_through_loads(model.module, optimizer.write_master))
    return model, optimizer


def _check_setup(model, optimizer_class, stage) -> None:
    if not dist.is_initialized():
        raise RuntimeError("prepare needs a process group: call it inside zero_lab.launch(fn, world_size), "
                           "or after zero_lab.init_distributed() under torchrun")
    if type(stage) is not int:  # True == 1 and 1.0 == 1 would pass the checks below
        raise TypeError(f"stage must be an int, one of {sorted(STAGES)}, got {stage!r} ({type(stage).__name__})")
    if stage not in STAGES:
        names = ", ".join(f"{number} = {row.name}" for number, row in STAGES.items())
        raise ValueError(f"stage must be one of {sorted(STAGES)} ({names}), got {stage!r}")
    if isinstance(optimizer_class, torch.optim.Optimizer):
        raise TypeError("pass the optimizer class (torch.optim.AdamW), not an optimizer: "
                        "prepare builds it, over the shards for stages 1-3")
    if not STAGES[stage].wraps_model:  # the optimizer runs on flat shards (zero1's list of those that can)
        shardable = _lesson_module(STAGES[1].module, STAGES[1].lesson, f"stage {stage}").SHARDABLE_OPTIMIZERS
        muon_here = optimizer_class is torch.optim.Muon and STAGES[stage].muon
        if optimizer_class in WHOLE_MATRIX_OPTIMIZERS and not muon_here:
            muon_stages = " and ".join(str(s) for s, row in STAGES.items() if row.muon)
            raise ValueError(f"{optimizer_class.__name__}'s update {WHOLE_MATRIX_OPTIMIZERS[optimizer_class]}, which a "
                             f"flat shard cuts through: stage {stage} shards element-wise optimizers "
                             f"({', '.join(c.__name__ for c in shardable)}); torch.optim.Muon is built for stage "
                             f'{muon_stages} (muon_sharding="gather" or "own", lesson {MUON_LESSON}); or use stage=0')
        if optimizer_class not in shardable and not muon_here:
            names = ", ".join(f"torch.optim.{c.__name__}" for c in shardable)
            raise ValueError(f"stage {stage} runs the optimizer on a flat shard that cuts through tensors, so its "
                             f"update must be element-wise: use {names} (or stage=0 for {optimizer_class.__name__})")
    devices = {p.device for p in model.parameters()}
    if not devices:
        raise ValueError(f"{type(model).__name__} has no parameters: there is nothing to train")
    # Stage 3 materializes it shard by shard (init_fn=).
    if torch.device("meta") in devices and not STAGES[stage].shards_parameters:
        raise ValueError("the model is on the meta device (shapes, no values): materialise it first, "
                         "e.g. model.to_empty(device='cpu') and initialise its weights, or build it on CPU "
                         "(or use stage=3 with init_fn=, which makes only this rank's shards)")
    if len(devices) != 1:
        raise ValueError(f"the model's parameters are on {sorted(map(str, devices))}: move the model to one device first")


def _check_options(optimizer_class, stage, options) -> None:
    accepted = set(inspect.signature(optimizer_class).parameters) - {"params"}
    unknown = sorted(set(options) - accepted)
    if not unknown:
        return
    if STAGES[stage].offload is None and set(unknown) & OFFLOAD_OPTIONS:
        offloaded = " and ".join(str(s) for s, row in STAGES.items() if row.offload)
        raise TypeError(f"offload works with stages {offloaded} in this course (ZeRO-Offload, lesson 06): "
                        f'use stage=2 with offload="cpu", or stage={stage} without it')
    elsewhere = {k for s, row in STAGES.items() if s != stage for k in row.options}
    stages_of = {k: sorted(s for s, row in STAGES.items() if k in row.options) for k in unknown if k in elsewhere}
    hints = [f"{k!r} needs stage {stages[0]} or higher" if stages[0] > stage else f"{k!r} works with stages {stages}"
             for k, stages in stages_of.items()]
    if stage == 0 and "max_grad_norm" in unknown:
        hints.append("with DDP every rank has the whole averaged gradient: call "
                     "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) before optimizer.step()")
    raise TypeError(f"unknown option(s) {unknown} for stage {stage} with {optimizer_class.__name__}"
                    + (f" ({'; '.join(hints)})" if hints else "")
                    + f": {optimizer_class.__name__} takes {sorted(accepted)}; "
                    f"stage {stage} adds {sorted(STAGES[stage].options) or 'nothing'}")


def _check_offload(stage: int, zero_options: dict) -> str | None:
    """Where to offload: None, "cpu" or "nvme" (the offload option removed from zero_options); the
    companions of each need it."""
    offload, row = zero_options.pop("offload", None), STAGES[stage]
    offloaded = " and ".join(str(s) for s, r in STAGES.items() if r.offload)
    if offload not in (None, "cpu", "nvme"):
        raise ValueError(f'offload must be "cpu" (ZeRO-Offload, stages {offloaded}: optimizer states and step on the '
                         f'host), "nvme" (ZeRO-Infinity, stage 3: optimizer states on an NVMe tier) or None, '
                         f"got {offload!r}")
    if offload == "cpu" and row.offload is None:
        raise ValueError(f'offload="cpu" is ZeRO-Offload for stages {offloaded} (lesson {OFFLOAD_LESSON}); stage 3 '
                         f'offloads to NVMe here: offload="nvme" (lesson {NVME_LESSON})')
    if offload == "nvme" and row.nvme is None:
        raise ValueError(f'offload="nvme" is ZeRO-Infinity for stage 3 (lesson {NVME_LESSON}): use stage=3, or '
                         f'offload="cpu" with stage {stage}')
    for kind, options in (("cpu", OFFLOAD_OPTIONS), ("nvme", NVME_OPTIONS)):
        companions = sorted(set(zero_options) & (options - {"offload"}))
        if companions and offload != kind:
            raise TypeError(f'{companions} only apply with offload="{kind}": pass offload="{kind}" or leave them out')
    return offload


# Optimizers whose update of an element needs the whole matrix around it (what a flat ZeRO shard cuts).
WHOLE_MATRIX_OPTIMIZERS = {
    torch.optim.Muon: "orthogonalises each 2-D momentum matrix (Newton-Schulz needs the whole matrix)",
    torch.optim.Adafactor: "divides by row and column statistics of each matrix (a factored second moment)",
}


def _check_muon(optimizer_class, zero_options: dict, offload) -> bool:
    """Whether this is Muon under ZeRO (lesson 12); its options need it, and it takes no offload."""
    given = sorted(set(zero_options) & MUON_OPTIONS)
    if optimizer_class is not torch.optim.Muon:
        if given:
            raise TypeError(f"{given} apply to torch.optim.Muon only (lesson {MUON_LESSON}), not to "
                            f"{optimizer_class.__name__}: leave them out")
        return False
    if offload:
        raise ValueError(f'offload="{offload}" is not built for torch.optim.Muon in this course: leave it out')
    return True


def _on_nodes(zero_options: dict) -> bool:
    """Whether stage 3 runs on nodes (lesson 09); its options need ranks_per_node."""
    given = sorted(k for k in NODE_OPTIONS - {"ranks_per_node"} if zero_options.get(k))
    if given and zero_options.get("ranks_per_node") is None:
        raise TypeError(f"{given} need ranks_per_node= (ranks per machine), e.g. prepare(..., stage=3, "
                        "ranks_per_node=8, ...): they treat ranks on one node and across nodes differently")
    return zero_options.get("ranks_per_node") is not None


def _check_dtypes(model, param_dtype) -> None:
    if param_dtype == torch.float16:
        raise ValueError("param_dtype=torch.float16 needs loss scaling, which zero_lab does not implement: "
                         "use torch.bfloat16")
    if param_dtype is not None and param_dtype not in PARAM_DTYPES:
        raise ValueError(f"param_dtype must be torch.float32 or torch.bfloat16, got {param_dtype}")
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    if not dtypes <= set(PARAM_DTYPES) or len(dtypes) > 1:
        raise ValueError(f"trainable parameters must all be float32 or all bfloat16, found {sorted(map(str, dtypes))}: "
                         "convert the model with model.float() and pass param_dtype=torch.bfloat16 for mixed precision")


def _warn_about_batch_norm(model) -> None:
    norms = [name for name, m in model.named_modules()
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(m, torch.nn.SyncBatchNorm)]
    if norms and dist.get_rank() == 0:
        warnings.warn(f"BatchNorm layers {norms} keep running statistics per rank, each over its own shard of the "
                      "batch, so they differ across ranks and from one process's (DDP users expect SyncBatchNorm): "
                      "on GPUs convert the model with torch.nn.SyncBatchNorm.convert_sync_batchnorm(model); on CPU "
                      "(SyncBatchNorm needs a GPU) use LayerNorm or GroupNorm, or save rank 0's", stacklevel=3)
