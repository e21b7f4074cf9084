"""Prepared models are freed: after `del model, optimizer` nothing of zero_lab keeps them alive.

For every stage of zero_lab.prepare (0 = DDP, 1, 2, 3; fp32 and bf16; stages 1-2 with offload="cpu",
stage 3 with offload="nvme", ZeRO++ and HSDP on nodes), right after prepare and after two training
steps, with a frozen parameter and with the GPT's tied embedding, weak references to the model, the
optimizer and a parameter are dead once the names are gone: at once (reference counting alone) for
stages 0-2, after one gc.collect() for stage 3, whose model keeps its schedule and its optimizer
through module and state-dict hooks, reference cycles the garbage collector frees; at stage 3 its
schedule, NVMe tier and the units' tensors are checked too, and the tier's schedule holds its optimizer
weakly (no cycle of its own on top of stage 3's). Re-running a cell
(prepare, train, drop, three times; or the same model prepared again) grows neither the live tensors
and their storages nor the modules, optimizers, process groups and threads, and a dropped NVMe tier
removes its files. Each world size is one launch that runs every configuration; the checks happen in
the parent, which names what survived and what refers to it.
"""

from __future__ import annotations

import copy
import functools
import gc
import os
import tempfile
import threading
import time
import types
import weakref

import pytest
import torch
import torch.distributed as dist

from sharded_training import TINY_GPT, gpt_batches, gpt_loss, train
from zero_lab import launch
from zero_lab.models import GPT
from zero_lab.optim import weak_hook
from zero_lab.prepare import prepare

BF16 = {"param_dtype": torch.bfloat16}
STEPS = 2


def _configs(world_size: int) -> dict[str, dict]:
    """name -> prepare's options: every stage and variant prepare builds (docs/stages.md)."""
    configs = {"stage 0": dict(stage=0), "stage 0 bf16": dict(stage=0, **BF16),
               "stage 1": dict(stage=1), "stage 1 bf16": dict(stage=1, **BF16),
               "stage 2": dict(stage=2, bucket_numel=300), "stage 2 bf16": dict(stage=2, bucket_numel=300, **BF16),
               "stage 3": dict(stage=3), "stage 3 bf16": dict(stage=3, **BF16),
               "stage 1 offload": dict(stage=1, offload="cpu", cpu_adam="torch"),
               "stage 2 offload bf16 dpu": dict(stage=2, offload="cpu", dpu_warmup_steps=0, adam_threads=2, **BF16),
               "stage 3 nvme": dict(stage=3, offload="nvme", nvme_chunk_numel=500),
               "stage 3 nvme bf16": dict(stage=3, offload="nvme", **BF16)}
    for ranks_per_node in (1, world_size):
        configs[f"ZeRO++ {ranks_per_node}/node"] = dict(stage=3, ranks_per_node=ranks_per_node, qwz=True, hpz=True,
                                                       qgz=True)
        configs[f"HSDP {ranks_per_node}/node bf16"] = dict(stage=3, ranks_per_node=ranks_per_node,
                                                          replicate_across_nodes=True, **BF16)
    return configs


def _needs_collection(options: dict) -> bool:
    """Stage 3's model holds its schedule and optimizer through its hooks: cycles for gc.collect()."""
    return options["stage"] == 3


# ---- in the ranks

def _model(frozen: bool) -> GPT:
    model = GPT(TINY_GPT, seed=0)  # lm_head.weight is transformer.wte.weight: tied
    if frozen:
        model.transformer.wpe.weight.requires_grad_(False)
    return model


def _prepare_and_train(options: dict, steps: int, frozen: bool, nvme_dir: str) -> dict[str, weakref.ref]:
    """Build, prepare, train `steps` steps; return weak references to what must be freed (the strong
    names go when this returns)."""
    model = _model(frozen)
    if options.get("offload") == "nvme":
        options = {**options, "nvme_dir": nvme_dir}
    wrapped, optimizer = prepare(model, torch.optim.AdamW, lr=1e-3, **options)
    train(wrapped, optimizer, gpt_batches(steps), gpt_loss)
    pending = getattr(getattr(optimizer, "schedule", None), "pending", None)
    if pending is not None:  # a delayed update (DPU) still running holds the optimizer until it ends
        pending.result()
    refs = {"model": weakref.ref(model), "optimizer": weakref.ref(optimizer),
            "tied parameter": weakref.ref(model.lm_head.weight),
            "parameter": weakref.ref(model.transformer.h[0].mlp.c_fc.weight)}
    if wrapped is not model:
        refs["wrapper"] = weakref.ref(wrapped)
    if isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        refs["inner optimizer"] = weakref.ref(optimizer.optimizer)
    if frozen:
        refs["frozen parameter"] = weakref.ref(model.transformer.wpe.weight)
    refs.update(_stage3_refs(optimizer))
    return refs


def _stage3_refs(optimizer) -> dict[str, weakref.ref]:
    """Stage 3's schedule, its NVMe tier and the memory of its units (gathered buffer, shards, master,
    gradient shard): what a GPU gives back to torch.cuda.empty_cache() once they are freed."""
    units = getattr(optimizer, "units", None)
    if units is None or not hasattr(optimizer, "schedule"):
        return {}
    refs = {"schedule": weakref.ref(optimizer.schedule)}
    if hasattr(optimizer, "tier"):
        refs["NVMe tier"] = weakref.ref(optimizer.tier)
        refs["NVMe tier's reader"] = weakref.ref(optimizer.schedule.reader)
    for i, unit in enumerate(units):
        for name in ("flat", "shard", "master", "grad_shard"):
            if isinstance(tensor := getattr(unit, name, None), torch.Tensor):
                refs[f"unit {i}'s {name}"] = weakref.ref(tensor)
    return refs


def _short(key) -> str:
    return f"<{type(key).__name__} {tuple(key.shape)}>" if isinstance(key, torch.Tensor) else repr(key)[:40]


def _label(referrer, target) -> str:
    if isinstance(referrer, dict):
        keys = [_short(k) for k, v in referrer.items() if v is target][:3] or ["(as a key)"]
        owners = [type(o).__qualname__ for o in gc.get_referrers(referrer) if getattr(o, "__dict__", None) is referrer]
        return f"attribute {', '.join(keys)} of a {owners[0]}" if owners else f"dict entry {', '.join(keys)}"
    if isinstance(referrer, types.MethodType):
        return f"bound method {referrer.__func__.__qualname__}"
    if isinstance(referrer, types.FunctionType):
        return f"function {referrer.__qualname__}"
    if isinstance(referrer, types.CellType):
        return "closure cell"
    if isinstance(referrer, (list, tuple, set)):
        return f"{type(referrer).__name__} of {len(referrer)}"
    return type(referrer).__qualname__


def _describe(target, depth: int = 3, lines: list | None = None, skip: set | None = None) -> list[str]:
    """What refers to target (gc.get_referrers), and what refers to those, up to depth levels."""
    lines = [] if lines is None else lines
    skip = {id(lines)} if skip is None else skip
    referrers = gc.get_referrers(target)
    skip.add(id(referrers))
    level = 3 - depth
    for referrer in referrers:
        if id(referrer) in skip or isinstance(referrer, types.FrameType) or len(lines) >= 30:
            continue
        lines.append("  " * level + "<- " + _label(referrer, target))
        if depth > 1 and not isinstance(referrer, types.ModuleType):
            _describe(referrer, depth - 1, lines, skip)
    return lines


def _survivors(refs: dict[str, weakref.ref]) -> dict[str, list[str]]:
    """name -> referrers, for every object still alive."""
    found = {}
    for what, ref in refs.items():
        obj = ref()
        if obj is not None:
            found[what] = _describe(obj)
            del obj
    return found


def _survivors_once_gloo_lets_go(refs: dict[str, weakref.ref], seconds: float = 10.0) -> dict[str, list[str]]:
    """_survivors, asked again for a while (no further gc.collect()) while what is alive has no Python referrer: a
    gloo worker thread lets go of a finished collective's tensors a moment later (seen on a loaded machine)."""
    deadline = time.monotonic() + seconds
    while (found := _survivors(refs)) and not any(found.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def _check_freed(configs: dict, nvme_dir: str) -> list[tuple]:
    """(config, case, survivors without gc, survivors after one gc.collect()) for every configuration and case."""
    results = []
    for name, options in configs.items():
        for case, steps, frozen in (("after prepare", 0, False), ("after 2 steps", STEPS, False),
                                    ("after 2 steps, frozen parameter", STEPS, True)):
            gc.collect()  # what earlier configurations left, and torch's one-time imports
            gc.disable()  # reference counting alone from here
            try:
                refs = _prepare_and_train(dict(options), steps, frozen, nvme_dir)
                without_gc = _survivors(refs)
            finally:
                gc.enable()
            gc.collect()
            results.append((name, case, without_gc, _survivors_once_gloo_lets_go(refs)))
    return results


def _live_tensors() -> dict[str, int]:
    """Live tensors the garbage collector knows, their storages (each once) and modules, optimizers."""
    gc.collect()
    live = gc.get_objects()
    tensors = [o for o in live if issubclass(type(o), torch.Tensor)]
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[(str(t.device), storage.data_ptr())] = storage.nbytes()
    counts = {"tensors": len(tensors), "storage bytes": sum(storages.values()),
              "modules": sum(issubclass(type(o), torch.nn.Module) for o in live),
              "optimizers": sum(issubclass(type(o), torch.optim.Optimizer) for o in live),
              "process groups": len(dist.distributed_c10d._world.pg_map)}
    del live, tensors
    if torch.cuda.is_available():
        counts["cuda allocated bytes"] = torch.cuda.memory_allocated()
    return counts


def _settled(baseline: dict | None, seconds: float = 15.0) -> dict:
    """What is live (_live_tensors, and Python threads), measured again for a while as long as it is more than
    `baseline`: a thread pool ends its threads a moment after it is collected, and gloo's worker threads let go
    of a finished collective's tensors a moment after the caller has its result (later on a busy machine)."""
    deadline = time.monotonic() + seconds
    while True:
        live = {**_live_tensors(), "threads": threading.active_count()}
        if baseline is None or all(live[k] <= baseline[k] for k in live) or time.monotonic() > deadline:
            return live
        time.sleep(0.05)


def _rerun_rounds(configs: dict, nvme_dir: str) -> dict[str, list[dict]]:
    """A cell re-run three times: a new model prepared, trained and dropped each round (`new model`),
    and one model prepared again each round (`same model`, prepare's re-run path). What is live after
    each round, per configuration."""
    results = {}
    for name, options in configs.items():
        options = {**options, "nvme_dir": nvme_dir} if options.get("offload") == "nvme" else options
        rounds = []
        for _ in range(3):
            _prepare_and_train(dict(options), STEPS, False, nvme_dir)
            rounds.append(_settled(rounds[0] if rounds else None))
        results[f"{name}, new model"] = rounds
        model, rounds = _model(frozen=False), []
        for _ in range(3):
            wrapped, optimizer = prepare(model, torch.optim.AdamW, lr=1e-3, **options)
            train(wrapped, optimizer, gpt_batches(STEPS), gpt_loss)
            pending = getattr(getattr(optimizer, "schedule", None), "pending", None)
            if pending is not None:  # a delayed update (DPU) running in the background
                pending.result()
            del wrapped, optimizer, pending  # the next round's `model, optimizer = prepare(...)` replaces them
            rounds.append(_settled(rounds[0] if rounds else None))
        del model
        results[f"{name}, same model"] = rounds
    return results


def _tier_files(nvme_dir: str) -> dict:
    """The NVMe tier's directory while the optimizer lives, and what is left of it once dropped."""
    model, optimizer = prepare(_model(frozen=False), torch.optim.AdamW, stage=3, offload="nvme", nvme_dir=nvme_dir,
                               lr=1e-3)
    train(model, optimizer, gpt_batches(STEPS), gpt_loss)
    directory, files = str(optimizer.tier.directory), list(optimizer.tier.files.values())
    alive = [os.fstat(f.fileno()).st_size for f in files]
    # what the schedule holds that is the optimizer, or one of its bound methods (the shard loader)
    holds = [name for name, value in vars(optimizer.schedule).items()
             if value is optimizer or getattr(value, "__self__", None) is optimizer]
    del model, optimizer
    gc.collect()
    return {"directory": directory, "files while alive": alive, "exists after drop": not all(f.closed for f in files),
            "left in nvme_dir": sorted(os.listdir(nvme_dir)), "schedule holds the optimizer by": holds}


RERUN_AT_3 = ("stage 0 bf16", "stage 2 offload bf16 dpu", "stage 3 nvme", "HSDP 3/node bf16")  # time: 3 ranks, 2 cores


def _hooks_left(options: dict) -> dict:
    """Drop what prepare made (stage 0's wrapper, or the optimizer) and keep the model: its hooks go with it."""
    model = _model(frozen=False)
    wrapped, optimizer = prepare(model, torch.optim.AdamW, lr=1e-3, **options)
    train(wrapped, optimizer, gpt_batches(STEPS), gpt_loss)
    while_alive = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    del wrapped, optimizer
    left = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    return {"while alive": while_alive, "left": left, "load hooks left": len(model._load_state_dict_pre_hooks)}


def _run_all(world_size: int) -> dict:
    configs = _configs(world_size)
    rerun = configs if world_size == 2 else {name: configs[name] for name in RERUN_AT_3}
    _prepare_and_train(configs["stage 1"], STEPS, False, "")  # torch's one-time set-up (imports, caches) first
    gc.collect()
    gc.freeze()  # what exists now is no concern: each gc.collect() and gc.get_objects() below skips it
    with tempfile.TemporaryDirectory(prefix=f"freed-{dist.get_rank()}-") as nvme_dir:
        return {"freed": _check_freed(configs, nvme_dir), "reruns": _rerun_rounds(rerun, nvme_dir),
                "tier": _tier_files(nvme_dir),
                "hooks": {name: _hooks_left(configs[name]) for name in ("stage 0 bf16", "stage 1", "stage 2 bf16")}}


# ---- in the parent

@functools.cache
def _results(world_size: int) -> list[dict]:
    return launch(_run_all, world_size, world_size, timeout=240)


WORLD_SIZES = [2, 3]


def _report(survivors: dict[str, list[str]]) -> str:
    return "\n".join(f"{what} is alive; referred to by:\n" + "\n".join(f"    {line}" for line in lines)
                     for what, lines in survivors.items())


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_dropping_model_and_optimizer_frees_them(world_size):
    configs = _configs(world_size)
    failures = []
    for rank, result in enumerate(_results(world_size)):
        for name, case, without_gc, after_gc in result["freed"]:
            if after_gc:
                failures.append(f"rank {rank}, {name}, {case}, after one gc.collect():\n{_report(after_gc)}")
            elif without_gc and not _needs_collection(configs[name]):
                failures.append(f"rank {rank}, {name}, {case}, without gc.collect() (reference cycle):\n"
                                f"{_report(without_gc)}")
    assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_rerunning_a_cell_does_not_grow_memory(world_size):
    grown = []
    for rank, result in enumerate(_results(world_size)):
        for name, rounds in result["reruns"].items():
            first, last = rounds[0], rounds[-1]
            more = {k: (first[k], last[k]) for k in first if last[k] > first[k]}
            if more:
                grown.append(f"rank {rank}, {name}: after round 1 -> after round 3 {more}")
    assert not grown, "\n".join(grown)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_dropped_nvme_tier_removes_its_files(world_size):
    for rank, tier in enumerate(_results(world_size)):
        tier = tier["tier"]
        assert tier["files while alive"], f"rank {rank}: the tier wrote no files in {tier['directory']}"
        assert not tier["exists after drop"], f"rank {rank}: the tier's files in {tier['directory']} are still open after the drop"
        assert tier["left in nvme_dir"] == [], f"rank {rank}: left behind {tier['left in nvme_dir']}"
        assert tier["schedule holds the optimizer by"] == [], (
            f"rank {rank}: the tier's schedule holds its optimizer strongly by {tier['schedule holds the optimizer by']}: "
            "a cycle on top of stage 3's (hold it through zero_lab.optim.weak_hook)")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_hooks_go_with_what_prepare_made(world_size):
    for rank, result in enumerate(_results(world_size)):
        for name, hooks in result["hooks"].items():
            assert hooks["while alive"] > 0, f"rank {rank}, {name}: no gradient hooks to check"
            assert hooks["left"] == hooks["load hooks left"] == 0, f"rank {rank}, {name}: hooks left {hooks}"


def test_weak_hook_keeps_nothing_alive_and_copies_with_its_object():
    class Owner:
        def __init__(self):
            self.hooks = [weak_hook(self.called, "first")]

        def called(self, *args):
            return self, args

    owner = Owner()
    assert owner.hooks[0]("then") == (owner, ("first", "then"))
    copied = copy.deepcopy(owner)
    assert copied.hooks[0]("then") == (copied, ("first", "then")), "the copy's hook calls the copy"
    ref, hook = weakref.ref(owner), owner.hooks[0]
    del owner
    assert ref() is None, "the hook keeps its object alive"
    assert hook("then") is None, "a hook whose object is gone does nothing"
