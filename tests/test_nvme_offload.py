"""Stage 3 with offload="nvme" (lesson 10, ZeRO-Infinity's optimizer states on a simulated NVMe tier):
the same training as one process and as stage 3 in memory, exactly the bytes of the formula through the
tier, checkpoints that resume bit for bit, clear errors for bad directories and full disks, and no file
left behind however training ends."""

import errno
import os

import pytest
import torch
import torch.distributed as dist

from sharded_training import (ADAMW, SIZES, TINY_GPT, assert_close, gpt_batches, gpt_groups_noise, gpt_loss,
                              gpt_with_groups, gpt_with_groups_single_process, mlp_batches, mlp_loss, single_process,
                              train, weights)
from zero_lab import RankFailed, launch
from zero_lab.checkpoint import load_checkpoint, save_checkpoint
from zero_lab.memory_ledger import model_state_bytes
from zero_lab.models import GPT, MLP
from zero_lab.prepare import prepare


def leftovers(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.startswith("nvme-tier-"))


@pytest.mark.parametrize("world_size", [2, 3])
def test_gpt_with_tied_frozen_and_grouped_parameters_trains_as_one_process(world_size, tmp_path):
    expected, frozen_before = gpt_with_groups_single_process()
    results = launch(gpt_with_groups, world_size, 3, offload="nvme", nvme_dir=tmp_path, nvme_chunk_numel=37,
                     timeout=120)
    # The key biases' gradient is rounding noise: within AdamW's drift (gpt_groups_noise); the rest, assert_close's default.
    assert_close([got for got, _, _ in results], expected, noise=gpt_groups_noise())
    in_memory = launch(gpt_with_groups, world_size, 3, timeout=120)
    for (got, _, _), (plain, _, _) in zip(results, in_memory):
        assert all(torch.equal(got[name], plain[name]) for name in plain), "not bit for bit stage 3 in memory"
    for got, tied, held in results:
        assert tied, "the LM head must still share the embedding's tensor"
        assert torch.equal(got["transformer.wpe.weight"], frozen_before), "a frozen parameter moved"
        assert held["optimizer_states"] == 0, f"AdamW's moments belong on the tier, memory holds {held}"
    assert leftovers(tmp_path) == [], "the tiers' files outlived training"


def _accumulate_and_measure(options):
    """Two micro-batches per step, a scheduler and clipping, on the MLP; what the tier moved in the last step."""
    model, optimizer = prepare(MLP(SIZES, seed=0), torch.optim.AdamW, stage=3, **ADAMW, **options)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    batches, tier = mlp_batches(), optimizer.tier
    train(model, optimizer, batches[:-1], mlp_loss, micro_steps=2, scheduler=scheduler, max_norm=0.5)
    before, optimizer.trace = (tier.bytes_read, tier.bytes_written), []
    train(model, optimizer, batches[-1:], mlp_loss, micro_steps=2, scheduler=scheduler, max_norm=0.5)
    shard_numel = {unit.name: unit.shard.numel() for unit in optimizer.units}
    gathered = sum(shard_numel[name] for _, action, name, _ in optimizer.trace if action in ("gather", "prefetch"))
    moved = (tier.bytes_read - before[0], tier.bytes_written - before[1])
    trained = sum(piece.master.numel() for unit in optimizer.units for piece in unit.slices)
    rest = sum(shard_numel.values()) - trained
    with optimizer.gathered_parameters():
        got = weights(model)
    held = model_state_bytes(model, optimizer).bytes
    return got, moved, gathered, trained, rest, optimizer.tier_bytes(), held, tier.peak_held_bytes


@pytest.mark.parametrize("world_size, chunk_numel, prefetch", [(2, 16, 1), (3, 7, 2)])
def test_accumulation_scheduler_and_clipping_match_one_process_and_the_bytes_match_the_formula(
        world_size, chunk_numel, prefetch, tmp_path):
    expected, _ = single_process(max_grad_norm=0.5,
                                 make_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5))
    results = launch(_accumulate_and_measure, world_size,
                     dict(offload="nvme", nvme_dir=tmp_path, nvme_chunk_numel=chunk_numel, prefetch=prefetch))
    assert_close([got for got, *_ in results], expected)
    assert sum(trained for _, _, _, trained, *_ in results) == sum(p.numel() for p in MLP(SIZES).parameters())
    for rank, (_, moved, gathered, trained, rest, tier_bytes, held, peak) in enumerate(results):
        assert gathered >= trained + rest, f"rank {rank}: every unit is gathered at least once a step"
        assert moved == (4 * gathered + 12 * trained, 12 * trained), \
            f"rank {rank}: a step reads each gathered shard (4 B per element) and AdamW's 12 B per trained element"
        assert tier_bytes == 12 * trained + 4 * rest, f"rank {rank}: masters and moments, the padding's master"
        assert held["parameters"] == held["master_params"] == held["optimizer_states"] == 0, \
            f"rank {rank}: between steps the parameters and states are on the tier only, memory holds {held}"
        assert peak <= (prefetch + 1) * 12 * chunk_numel, f"rank {rank}: host held {peak} B of AdamW's chunks at once"


def _resume(directory, checkpoint_dir, param_dtype, split):
    """Train 5 steps straight, or `split` steps, save, then a fresh prepare that loads and trains the rest."""
    rank = dist.get_rank()
    options = dict(offload="nvme", nvme_dir=directory, nvme_chunk_numel=16, param_dtype=param_dtype, **ADAMW)
    batches = mlp_batches(5)
    model, optimizer = prepare(MLP(SIZES, seed=0), torch.optim.AdamW, stage=3, **options)
    if split is None:
        train(model, optimizer, batches, mlp_loss)
    else:
        train(model, optimizer, batches[:split], mlp_loss)
        save_checkpoint(optimizer.state_dict(), checkpoint_dir / f"rank{rank}.pt")
        model, optimizer = prepare(MLP(SIZES, seed=1), torch.optim.AdamW, stage=3, **options)
        optimizer.load_state_dict(load_checkpoint(checkpoint_dir / f"rank{rank}.pt"))
        train(model, optimizer, batches[split:], mlp_loss)
    with optimizer.gathered_parameters():
        got = weights(model)
    return got, optimizer.consolidated_state_dict()


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_a_checkpoint_resumes_bit_for_bit(param_dtype, tmp_path):
    straight = launch(_resume, 2, tmp_path, tmp_path, param_dtype, None)
    resumed = launch(_resume, 2, tmp_path, tmp_path, param_dtype, 2)
    for (a, full_a), (b, full_b) in zip(straight, resumed):
        for name in a:
            assert torch.equal(a[name], b[name]), f"{name} differs after resuming"
    states_a, states_b = straight[0][1]["optimizer"]["state"], resumed[0][1]["optimizer"]["state"]
    for index in states_a:
        for key in states_a[index]:
            assert torch.equal(states_a[index][key], states_b[index][key]), f"state {index}.{key} differs after resuming"
    assert leftovers(tmp_path) == []


def _bf16_weights(options):
    model, optimizer = prepare(GPT(TINY_GPT, seed=0), torch.optim.AdamW, stage=3, param_dtype=torch.bfloat16,
                               lr=1e-2, **options)
    train(model, optimizer, gpt_batches(4), gpt_loss)
    memory = model_state_bytes(model, optimizer).bytes
    state = model.state_dict()
    return {name: value.clone() for name, value in state.items()}, memory


def test_mixed_precision_keeps_the_fp32_masters_on_the_tier_only_and_trains_as_stage_3(tmp_path):
    in_memory = launch(_bf16_weights, 2, {})
    on_tier = launch(_bf16_weights, 2, dict(offload="nvme", nvme_dir=tmp_path))
    for (expected, memory), (got, tier_memory) in zip(in_memory, on_tier):
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")
        assert memory["master_params"] > 0 and tier_memory["master_params"] == 0
        assert tier_memory["optimizer_states"] == 0


def _prepare_on(directory, **options):
    try:
        prepare(MLP(SIZES, seed=0), torch.optim.AdamW, stage=3, offload="nvme", nvme_dir=directory, lr=1e-3, **options)
    except Exception as error:
        return type(error).__name__, getattr(error, "errno", None), str(error)
    return None


def test_bad_directories_and_full_disks_say_what_to_do_and_leave_nothing(tmp_path):
    not_a_directory = tmp_path / "a_file"
    not_a_directory.write_text("mine")
    kind, _, message = launch(_prepare_on, 1, not_a_directory / "tier")[0]
    assert kind in ("OSError", "NotADirectoryError") and "pass a directory you can write to" in message
    assert not_a_directory.read_text() == "mine"
    kind, code, message = launch(_prepare_on, 2, tmp_path, nvme_quota=500)[1]
    assert code == errno.ENOSPC and "nvme_quota" in message and "need" in message, message
    assert leftovers(tmp_path) == []


def _disk_fills_up(directory):
    from zero_lab import infinity
    written = []
    original = infinity.NvmeTier.write

    def fails_on_the_fourth(self, name, tensor, start=None):
        written.append(name)
        if len(written) == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, name, tensor, start)

    infinity.NvmeTier.write = fails_on_the_fourth
    return _prepare_on(directory)


def test_a_disk_that_fills_up_while_the_states_are_written_removes_the_tier(tmp_path):
    kind, code, _ = launch(_disk_fills_up, 1, tmp_path)[0]
    assert code == errno.ENOSPC
    assert leftovers(tmp_path) == []


def test_a_failed_checkpoint_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    from zero_lab import checkpoint
    path = tmp_path / "rank0.pt"
    save_checkpoint({"step": 1}, path)

    def full_disk(f, payload):
        f.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "_write", full_disk)
    with pytest.raises(OSError):
        save_checkpoint({"step": 2}, path)
    monkeypatch.undo()
    assert load_checkpoint(path) == {"step": 1}
    assert os.listdir(tmp_path) == ["rank0.pt"]


def _one_rank_fails(directory):
    model, optimizer = prepare(MLP(SIZES, seed=0), torch.optim.AdamW, stage=3, offload="nvme", nvme_dir=directory,
                               lr=1e-3)
    train(model, optimizer, mlp_batches(1), mlp_loss)
    assert optimizer.tier_bytes() > 0 and leftovers(directory) == [], "the tiers hold files that have no name"
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 fails after a step")
    dist.barrier()


def test_the_tiers_are_removed_when_a_rank_fails(tmp_path):
    with pytest.raises(RankFailed, match="rank 1 fails after a step"):
        launch(_one_rank_fails, 2, tmp_path, timeout=60)
    assert leftovers(tmp_path) == []


def _refusals():
    messages = []
    for stage, options in ((3, dict(offload="cpu")), (2, dict(offload="nvme")), (3, dict(nvme_dir="/tmp")),
                           (3, dict(offload="nvme", ranks_per_node=1))):
        try:
            prepare(MLP(SIZES, seed=0), torch.optim.AdamW, stage=stage, lr=1e-3, **options)
        except (TypeError, ValueError) as error:
            messages.append(str(error))
    try:
        prepare(MLP(SIZES, seed=0), torch.optim.SGD, stage=3, offload="nvme", lr=1e-3)
    except ValueError as error:
        messages.append(str(error))
    return messages


def test_offload_options_that_do_not_fit_the_stage_are_refused_naming_the_fix():
    cpu_on_3, nvme_on_2, dir_alone, on_nodes, sgd = launch(_refusals, 1)[0]
    assert 'offload="nvme"' in cpu_on_3 and "stage 3" in cpu_on_3
    assert "use stage=3" in nvme_on_2
    assert "only apply with offload=\"nvme\"" in dir_alone
    assert "ranks_per_node" in on_nodes
    assert "torch.optim.AdamW" in sgd


def test_the_benchmark_row_measures_the_model_states_the_formula_gives():
    import importlib.util
    import sys
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "memory_vs_formula.py"
    spec = importlib.util.spec_from_file_location("memory_vs_formula", path)
    bench = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    row = "P_os+g+p, NVMe"
    figures = launch(bench.run_rank, 2, (row,), ("S",), None, 0)[0][row]["sizes"]["S"]
    formula, measured = figures["formula"], figures["model_states"]
    for category in ("parameters", "master_params", "optimizer_states"):  # on the tier
        assert formula[category] == measured[category] == 0, (category, measured, formula)
    # the 16-bit gradient shards, padded to a multiple of the ranks per unit
    assert 0 <= measured["gradients"] - formula["gradients"] < 2 * 64 and formula["gradients"] == figures["psi"]


def _in_flight(prefetch):
    import threading
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(5)))
    model, optimizer = prepare(model, torch.optim.AdamW, stage=3, offload="nvme", prefetch=prefetch, lr=1e-3)
    readers, resident = set(), []
    read_into = optimizer.tier.read_into

    def watched(name, out, start=0):
        readers.add(threading.current_thread().name.split("_")[0])
        return read_into(name, out, start)

    class Trace(list):  # after every gather, prefetch and free: how many shards memory holds
        def append(self, entry):
            resident.append(sum(unit.shard.untyped_storage().nbytes() > 0 for unit in optimizer.units))
            super().append(entry)

    optimizer.tier.read_into = watched
    for _ in range(2):  # the first step records the order, the second prefetches by it
        readers.clear()
        resident.clear()
        optimizer.trace = Trace()
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.close()
    return sorted(readers), max(resident), max(numel for *_, numel in optimizer.trace) // optimizer.units[0].flat.numel()


def test_prefetched_shards_are_read_in_the_background_and_memory_holds_the_units_in_flight():
    for prefetch, (readers, shards, gathered) in zip((0, 1, 2), launch(lambda: [_in_flight(k) for k in (0, 1, 2)], 2)[0]):
        assert readers == (["MainThread", "nvme-params"] if prefetch else ["MainThread"]), (prefetch, readers)
        assert shards <= prefetch + 1 and gathered == prefetch + 1, (prefetch, shards, gathered)


def _forked_rank(rank, world_size, store_path, directory):
    """A rank as another launcher makes it: multiprocessing's fork, its own process group, and os._exit at the end
    (as multiprocessing ends a forked child), so neither atexit nor garbage collection runs."""
    code = 1
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
        model, optimizer = prepare(MLP(SIZES, seed=0), torch.optim.AdamW, stage=3, offload="nvme", nvme_dir=directory,
                                   nvme_chunk_numel=16, lr=1e-3)
        train(model, optimizer, mlp_batches(2), mlp_loss)
        assert optimizer.tier_bytes() > 0
        dist.barrier()
        code = 0
    finally:
        os._exit(code)  # no close(), no atexit, no collection


@pytest.mark.parametrize("world_size", [1, 2])
def test_forked_ranks_that_exit_without_cleanup_leave_no_file(world_size, tmp_path):
    import multiprocessing
    directory, store = tmp_path / "nvme", tmp_path / "store"
    directory.mkdir()
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=_forked_rank, args=(rank, world_size, str(store), str(directory)))
             for rank in range(world_size)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(90)
        if rank.is_alive():
            rank.kill()
    assert [rank.exitcode for rank in ranks] == [0] * world_size, "a forked rank failed"
    assert os.listdir(directory) == [], "the NVMe tier left files in nvme_dir"
