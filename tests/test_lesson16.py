"""Lesson 16, checkpoints that outlive the world: a run saved on N ranks resumes on M (stages 1-3) with the saved
state bit for bit, reading exactly its shard through one bounded buffer; typical wrong answers fail their graded cells."""

LESSON = "16_checkpoints"

import json
import math
import os

import pytest
import torch

import nbformat
from graded_cells import assert_mutant_fails, assert_reference_full_and_learner_zero, define_helpers
from zero_lab import RankFailed, launch, prepare, reshard
from zero_lab.memory_ledger import model_state_bytes
from zero_lab.models import GPT, GPTConfig
from zero_lab.data import shard_batch, token_batches
from zero_lab.checkpoint_cost import checkpoint_schedule
from zero_lab.reshard_tp import gpt_tp_params, load_tp, save_tp, tp_pieces
from zero_lab.tensor_parallel import tensor_parallel_gpt  # lesson 17's split GPT, to check t -> t' against
from zero_lab.reshard import (METADATA, Piece, Read, load_dcp, load_plan, load_resharded, open_checkpoint, save_dcp,
                              save_resharded, shard_pieces)
from zero_lab.course_tools.implementation import REPO
from zero_lab.train import train as train_script
from zero_lab.zero_r import bytes_during

CONFIG = GPTConfig(vocab_size=29, n_layer=2, n_head=2, n_embd=8, block_size=8)  # tied weights
BATCHES = list(token_batches(5, 12, CONFIG.block_size, CONFIG.vocab_size, seed=2))


def make(stage, seed=0):
    return prepare(GPT(CONFIG, seed=seed), torch.optim.AdamW, stage=stage, lr=1e-2, weight_decay=0.1)


def train(model, optimizer, batches):
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for batch in batches:
        model(*shard_batch(batch, rank, world_size))[1].backward()
        optimizer.step()
        optimizer.zero_grad()


def plain(full):
    return None if full is None else ({k: v.tolist() for k, v in full["model"].items()},
                                      {i: {k: v.tolist() for k, v in s.items()} for i, s in full["optimizer"]["state"].items()})


def save(stage, folder):
    model, optimizer = make(stage)
    train(model, optimizer, BATCHES[:3])
    save_resharded(optimizer, folder)
    return plain(optimizer.consolidated_state_dict())


def resume(stage, folder, buffer_numel):
    """Load after a step (the states exist): what the load allocates is the read buffer and little else."""
    model, optimizer = make(stage, seed=1)
    train(model, optimizer, BATCHES[:1])
    before = model_state_bytes(model, optimizer).bytes
    figures, peak, _ = bytes_during(load_resharded, optimizer, folder, buffer_numel)
    if stage < 3:  # the weights follow the masters by an all-gather, whose temporary on gloo is the whole buffer
        peak -= sum(group.flat_param.nbytes for group in optimizer.groups)
    loaded = plain(optimizer.consolidated_state_dict())
    train(model, optimizer, BATCHES[3:])
    return figures, peak, before == model_state_bytes(model, optimizer).bytes, loaded, plain(optimizer.consolidated_state_dict())


def continue_from_consolidated(stage, full):
    model, optimizer = make(stage, seed=1)
    model.load_state_dict(full["model"])
    optimizer.load_state_dict(full["optimizer"])
    held = model_state_bytes(model, optimizer).bytes
    train(model, optimizer, BATCHES[3:])
    return plain(optimizer.consolidated_state_dict()), held


@pytest.mark.parametrize("stage, saved_world, world", [(2, 3, 2), (3, 1, 3), (1, 4, 1)])
def test_a_resharded_resume_holds_the_saved_state_and_trains_like_a_consolidated_one(tmp_path, stage, saved_world, world):
    folder = tmp_path / "checkpoint"
    saved = launch(save, saved_world, stage, str(folder), timeout=60)[0]
    results = launch(resume, world, stage, str(folder), 16, timeout=60)
    assert results[0][3] == saved  # masters, moments and step counts, bit for bit
    checkpoint_bytes = sum(os.path.getsize(folder / f) for f in os.listdir(folder) if f.endswith(".bin"))
    for figures, peak, same_memory, _, _ in results:
        assert figures["bytes_read"] == figures["shard_bytes"] and same_memory
        assert figures["buffer_bytes"] == 64 and peak <= 64 + 1024  # the read buffer, and 0-dim step counters
        assert world == 1 or figures["bytes_read"] < checkpoint_bytes / (world - 0.5)  # about 1/M of the checkpoint
    metadata = json.loads((folder / METADATA).read_text())
    assert sum(r[0]["bytes_read"] for r in results) == sum(p[3] for r in metadata["ranks"] for p in r["pieces"]) * 3 * 4


def consolidated_after(stage, folder):
    model, optimizer = make(stage)
    train(model, optimizer, BATCHES[:3])
    full = optimizer.consolidated_state_dict()
    save_resharded(optimizer, folder)
    if full is not None:
        torch.save(full, os.path.join(folder, "full.pt"))


def both_ways(stage, folder):
    a = make(stage, seed=1)
    load_resharded(a[1], folder)
    b = make(stage, seed=2)
    full = torch.load(os.path.join(folder, "full.pt"))
    b[0].load_state_dict(full["model"])
    b[1].load_state_dict(full["optimizer"])
    held = [model_state_bytes(*pair).bytes for pair in (a, b)]
    for pair in (a, b):
        train(*pair, BATCHES[3:])
    return held, [plain(pair[1].consolidated_state_dict()) for pair in (a, b)]


def test_resharded_and_consolidated_loads_continue_alike_and_hold_the_same_bytes(tmp_path):
    """Lesson 03's consolidated load keeps each rank's shard of the moments, not a view of the whole buffer."""
    launch(consolidated_after, 2, 1, str(tmp_path / "checkpoint"), timeout=60)
    for rank, (held, continued) in enumerate(launch(both_ways, 3, 1, str(tmp_path / "checkpoint"), timeout=60)):
        assert held[0] == held[1], f"rank {rank}: {held}"
        if rank == 0:
            assert continued[0] == continued[1]


def test_load_plan_refuses_another_model_naming_the_parameter():
    saved = [shard_pieces([[("w", (4, 3)), ("b", (3,))]], 2, r) for r in range(2)]
    with pytest.raises(ValueError, match="w was saved with shape"):
        load_plan(saved, shard_pieces([[("w", (3, 4)), ("b", (3,))]], 3, 0))
    with pytest.raises(ValueError, match="extra is not in the checkpoint"):
        load_plan(saved, shard_pieces([[("w", (4, 3)), ("b", (3,)), ("extra", (1,))]], 1, 0))


def test_the_worked_examples_of_exercises_4_and_5():
    assert tp_pieces("w", (12, 4), "heads", 2, 1) == [Piece("w", (12, 4), 8, 8, 0), Piece("w", (12, 4), 24, 8, 8),
                                                      Piece("w", (12, 4), 40, 8, 16)]
    assert tp_pieces("w", (4, 4), "columns", 3, 0) == [Piece("w", (4, 4), 4 * row, 2, 2 * row) for row in range(4)]
    plan = checkpoint_schedule(10**9, 12e9, 10_000)
    assert (plan["bytes"], plan["save_seconds"], round(plan["interval_seconds"]), round(plan["lost_fraction"], 3)) == \
        (12e9, 1.0, 141, 0.014)


def tp_saves(folder, config):
    save_tp(tensor_parallel_gpt(GPT(config, seed=0)), gpt_tp_params(GPT(config)), folder)


def tp_loads(folder, config, saved_t):
    model = tensor_parallel_gpt(GPT(config, seed=1))
    figures = load_tp(model, gpt_tp_params(GPT(config)), folder, saved_t, buffer_numel=100)
    expected = tensor_parallel_gpt(GPT(config, seed=0))
    return figures, [name for (name, a), b in zip(model.named_parameters(), expected.parameters()) if not torch.equal(a, b)]


@pytest.mark.parametrize("saved_t, t", [(2, 3), (3, 2)])
def test_a_tensor_parallel_checkpoint_resumes_at_another_width(tmp_path, saved_t, t):
    """Lesson 17's tensor-parallel GPT (heads, rows and columns cut by tensor_split), saved at t, read back at t'."""
    config = GPTConfig(vocab_size=29, n_layer=2, n_head=6, n_embd=18, block_size=8)  # 4 * 18 MLP rows: uneven at t = 5
    launch(tp_saves, saved_t, str(tmp_path), config, timeout=60)
    for figures, differ in launch(tp_loads, t, str(tmp_path), config, saved_t, timeout=60):
        assert not differ and figures["bytes_read"] == figures["local_bytes"], (differ, figures)


def test_the_worked_examples():
    buffers = [[("a", (2, 3)), ("b", (5,))]]
    assert [shard_pieces(buffers, 3, r) for r in range(3)] == [
        [Piece("a", (2, 3), 0, 4, 0)], [Piece("a", (2, 3), 4, 2, 0), Piece("b", (5,), 0, 2, 2)], [Piece("b", (5,), 2, 3, 0)]]
    saved = [shard_pieces(buffers, 3, r) for r in range(3)]
    assert load_plan(saved, shard_pieces(buffers, 2, 0)) == [Read(0, 0, 0, 4), Read(1, 0, 4, 2)]
    assert load_plan(saved, shard_pieces(buffers, 2, 1)) == [Read(1, 2, 0, 2), Read(2, 0, 2, 3)]


def test_reference_full_marks_learner_zero(graded):
    assert_reference_full_and_learner_zero(graded, LESSON, 19)


# Typical wrong answers: each must fail the graded cell named with it.
BY_ELEMENT = """    pieces, base = [], 0  # every element labelled, runs merged: the code the test's own reference is
    for params in buffers:
        labels = [(name, tuple(shape), i) for name, shape in params for i in range(math.prod(shape))]
        shard = -(-len(labels) // world_size)
        for at, (name, shape, i) in enumerate(labels[rank * shard:(rank + 1) * shard]):
            last = pieces[-1] if pieces else None
            if last and last.name == name and last.start + last.numel == i and last.offset + last.numel == base + at:
                pieces[-1] = last._replace(numel=last.numel + 1)
            else:
                pieces.append(Piece(name, shape, i, 1, base + at))
        base += shard
    return pieces
"""
MUTANTS = {
    "empty pieces listed (<= at a shard boundary)": ("            if first < last:\n", "            if first <= last:\n",
                                                     "reshard_pieces"),
    "offsets restart at every buffer": ("                pieces.append(Piece(name, tuple(shape), first - at, last - first, base + first - low))\n",
                                        "                pieces.append(Piece(name, tuple(shape), first - at, last - first, first - low))\n",
                                        "reshard_pieces"),
    "shards of floor(numel / N) between buffers (padding dropped)": (
        "        base += layout.shard_numel\n", "        base += layout.numel // world_size\n", "reshard_pieces"),
    "padding listed as a piece of the last parameter": (
        "            first, last = max(at, low), min(at + math.prod(shape), high)\n",
        "            first, last = max(at, low), min(at + math.prod(shape) + (layout.padded_numel - layout.numel\n"
        "                                                                     if name == params[-1][0] else 0), high)\n",
        "reshard_pieces"),
    "reads never merged": ("        if last and last.rank == read.rank", "        if False and last and last.rank == read.rank",
                           "reshard_load_plan"),
    "the whole saved piece read, not the overlap": (
        "                reads.append(Read(rank, piece.offset + first - piece.start, want.offset + first - want.start,\n"
        "                                  last - first))\n",
        "                reads.append(Read(rank, piece.offset, want.offset + piece.start - want.start, piece.numel))\n",
        "reshard_load_plan"),
    "one element too many at the end of each overlap": (
        "                                  last - first))\n", "                                  last - first + 1))\n",
        "reshard_load_plan"),
    "shapes not compared": ("            if piece.shape != want.shape:\n", "            if False:\n", "reshard_load_plan"),
    "elements missing from the checkpoint not noticed": ("        if covered != want.numel:\n", "        if False:\n",
                                                         "reshard_load_plan"),
    "a copy of the buffer handed on (the bound not kept)": ("            put(read.to + done, buffer[:count])\n",
                                                            "            put(read.to + done, buffer[:count].clone())\n",
                                                            "reshard_read_pieces"),
    "a short read not noticed": ("            if got != count * itemsize:\n", "            if False:\n", "reshard_read_pieces"),
    "the offset in the file read as bytes, not elements": (
        "            file.seek((read.offset + done) * itemsize)\n", "            file.seek(read.offset + done)\n",
        "reshard_read_pieces"),
    "every part read from the read's start": ("            file.seek((read.offset + done) * itemsize)\n",
                                              "            file.seek(read.offset * itemsize)\n", "reshard_read_pieces"),
    "a brute force (every element labelled): right pieces, but work that grows with the elements": (
        "    pieces, base = [], 0\n    for params in buffers:\n        layout = ", BY_ELEMENT + "    pieces, base = [], 0\n"
        "    for params in buffers:\n        layout = ", "reshard_pieces"),
    "tensor-parallel parts cut as torch.chunk cuts (not tensor_split)": (
        "        base, longer = divmod(n, t)\n        low = rank * base + min(rank, longer)\n        return low, low + base + (rank < longer)\n",
        "        size = -(-n // t)\n        return min(n, rank * size), min(n, (rank + 1) * size)\n", "reshard_tp_pieces"),
    "c_attn's rows cut as one block (not each of q, k, v)": (
        "        runs = [((block * width + low) * row, (high - low) * row) for block in range(3)]\n",
        "        low, high = part(rows)\n        runs = [(low * row, (high - low) * row)]\n", "reshard_tp_pieces"),
    "a checkpoint of the 16 bytes a parameter held in memory": (
        "    size = 12 * psi", "    size = 16 * psi", "reshard_checkpoint_schedule"),
    "the interval sqrt(δ·M), without the 2": ("math.sqrt(2 * save * mtbf_seconds)", "math.sqrt(save * mtbf_seconds)",
                                               "reshard_checkpoint_schedule"),
}



@pytest.mark.parametrize("mutant", MUTANTS)
def test_typical_mistakes_fail_their_graded_cell(mutant):
    assert_mutant_fails(LESSON, *MUTANTS[mutant])


def run_graded_cell_with(test_id: str, old: str, new: str) -> None:
    """The notebook's untagged cells up to `#| test test_id`, with `old` replaced by `new`; then that cell."""
    namespace = {"__name__": f"lesson_{LESSON}"}
    for cell in nbformat.read(REPO / "solutions" / LESSON / f"{LESSON}.ipynb", as_version=4).cells:
        if cell.cell_type != "code" or cell.metadata.get("tags"):
            continue
        if not cell.source.startswith("#| test "):
            exec(compile(cell.source.replace(old, new), "cell", "exec"), namespace)
        elif cell.source.split()[2] == test_id:
            exec(compile(cell.source, test_id, "exec"), namespace)
            return
        else:
            define_helpers(cell.source, namespace)


def test_a_truncated_file_read_without_an_error_is_reported_as_such():
    """Not as "the shards differ at [4, 5]", which reads like an offset bug (issue 43)."""
    with pytest.raises(AssertionError, match=r"rank1.bin was cut to 28 bytes \(7 elements\) and the plan reads past its "
                                             r"end, yet read_pieces raised no error"):
        run_graded_cell_with("reshard_read_pieces", *MUTANTS["a short read not noticed"][:2])


def test_the_resume_names_the_exercise_that_fails():
    with pytest.raises(AssertionError, match=r"Exercise 1, shard_pieces, fails its own test first"):
        run_graded_cell_with("reshard_resume", *MUTANTS["offsets restart at every buffer"][:2])


# zero_lab.prepare's optimizers: optimizer.load_state_dict(list of every saved rank's state dict or file)
def frozen_and_groups(model):
    """A frozen position embedding (not in a stage 1-2 optimizer's state: it comes with the model) and two groups."""
    model.transformer.wpe.weight.requires_grad_(False)
    return [{"params": [p for p in model.parameters() if p.requires_grad and p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.requires_grad and p.dim() < 2], "weight_decay": 0.0, "lr": 3e-2}]


def made_with_groups(stage):
    model = GPT(CONFIG, seed=0)
    return prepare(model, torch.optim.AdamW, stage=stage, params=frozen_and_groups(model), lr=1e-2)


def save_state_dict(stage, folder):
    model, optimizer = made_with_groups(stage)
    train(model, optimizer, BATCHES[:3])
    torch.save(optimizer.state_dict(), os.path.join(folder, f"rank{optimizer.rank}.pt"))
    full = optimizer.consolidated_state_dict()
    if full is not None:
        torch.save(full, os.path.join(folder, "full.pt"))
    return plain(full)


def load_state_dict_list(stage, folder, saved_world, as_paths):
    paths = [os.path.join(folder, f"rank{rank}.pt") for rank in range(saved_world)]
    resharded, consolidated = made_with_groups(stage), made_with_groups(stage)
    resharded[1].load_state_dict(paths if as_paths else [torch.load(path) for path in paths])
    full = torch.load(os.path.join(folder, "full.pt"))
    consolidated[0].load_state_dict(full["model"])
    consolidated[1].load_state_dict(full["optimizer"])
    loaded = plain(resharded[1].consolidated_state_dict())
    for pair in (resharded, consolidated):
        train(*pair, BATCHES[3:])
    return loaded, plain(resharded[1].consolidated_state_dict()) == plain(consolidated[1].consolidated_state_dict())


@pytest.mark.parametrize("stage, saved_world, world, as_paths", [(2, 3, 2, True), (3, 2, 3, False)])
def test_prepare_s_optimizer_loads_every_rank_s_state_dict_at_another_world_size(tmp_path, stage, saved_world, world,
                                                                                as_paths):
    saved = launch(save_state_dict, saved_world, stage, str(tmp_path), timeout=60)[0]
    loaded, continues_alike = launch(load_state_dict_list, world, stage, str(tmp_path), saved_world, as_paths, timeout=60)[0]
    assert loaded == saved and continues_alike


def refusals(folder):
    model, optimizer = made_with_groups(3)
    train(model, optimizer, BATCHES[:1])
    errors = []
    if optimizer.rank == 0:
        for wrong in ({**optimizer.state_dict(), "world_size": 3}, [optimizer.state_dict()]):  # another world; a list of 1
            try:
                optimizer.load_state_dict(wrong)
            except ValueError as error:
                errors.append(str(error))
    torch.distributed.barrier()
    return errors


def offloaded_refuses():
    model = GPT(CONFIG, seed=0)
    model, optimizer = prepare(model, torch.optim.AdamW, stage=1, offload="cpu", lr=1e-2)
    with pytest.raises(ValueError, match="resharding .* is built for stages 1-3 without offload"):
        optimizer.load_state_dict([optimizer.state_dict()])


def test_a_state_dict_of_another_world_is_refused_naming_the_list():
    single, listed = launch(refusals, 2, None, timeout=60)[0]
    assert "sharded for 3 ranks" in single and "list of all saved ranks' state dicts" in single
    assert "state dict 0 of the list is rank 0 of 2" in listed
    launch(offloaded_refuses, 1, timeout=60)


# Nothing lost: a rank killed while saving, a shard cut short or corrupted, another model
def killed_while_saving(folder, victim):
    model, optimizer = make(1)
    train(model, optimizer, BATCHES[:2])
    save_resharded(optimizer, os.path.join(folder, "step2"))
    train(model, optimizer, BATCHES[2:3])
    if optimizer.rank == victim:
        opened = []

        def open_until_killed(*args, **kwargs):
            opened.append(args[0])
            if len(opened) > 2:
                os._exit(1)
            return open(*args, **kwargs)

        reshard.open = open_until_killed  # the module's name comes before the builtin
    save_resharded(optimizer, os.path.join(folder, "step3"))


def load_step(folder):
    model, optimizer = make(1, seed=1)
    load_resharded(optimizer, folder)
    return plain(optimizer.consolidated_state_dict())


def saved_step2():
    model, optimizer = make(1)
    train(model, optimizer, BATCHES[:2])
    return plain(optimizer.consolidated_state_dict())


def test_a_rank_killed_while_saving_leaves_the_previous_checkpoint_and_no_new_one(tmp_path):
    with pytest.raises(RankFailed):
        launch(killed_while_saving, 3, str(tmp_path), 1, timeout=60)
    with pytest.raises(ValueError, match=r"step3 is not a finished checkpoint: its metadata.json.*is missing; .*step3.partial "
                                         r"holds only rank0.exp_avg.bin, .*rank1.exp_avg.bin, rank1.master.bin, rank2"):
        open_checkpoint(tmp_path / "step3")
    assert not (tmp_path / "step3").exists()
    assert launch(load_step, 2, str(tmp_path / "step2"), timeout=60)[0] == launch(saved_step2, 3, timeout=60)[0]
    with pytest.raises(RankFailed, match="FileExistsError: .*step2 exists"):
        launch(save, 1, 1, str(tmp_path / "step2"), timeout=60)


def test_a_damaged_shard_or_another_model_is_refused_by_name(tmp_path):
    folder = tmp_path / "checkpoint"
    launch(save, 2, 3, str(folder), timeout=60)
    shard = folder / "rank1.exp_avg_sq.bin"
    data = bytearray(shard.read_bytes())
    data[40] ^= 1
    shard.write_bytes(bytes(data))
    open_checkpoint(folder)  # sizes only: a flipped bit passes
    with pytest.raises(ValueError, match=r"rank1.exp_avg_sq.bin is corrupted: its SHA-256"):
        open_checkpoint(folder, verify=True)
    shard.write_bytes(bytes(data[:-4]))
    with pytest.raises(ValueError, match=r"rank1.exp_avg_sq.bin is truncated or grew: 4,108 bytes, saved 4,112"):
        open_checkpoint(folder)
    wider = GPTConfig(vocab_size=29, n_layer=2, n_head=2, n_embd=12, block_size=8)
    with pytest.raises(RankFailed, match="transformer.wte.weight was saved with shape"):
        launch(load_other_model, 1, str(tmp_path / "other"), wider, timeout=60)


def load_other_model(folder, config):
    model, optimizer = make(3)
    train(model, optimizer, BATCHES[:1])
    save_resharded(optimizer, folder)
    other = prepare(GPT(config, seed=0), torch.optim.AdamW, stage=3, lr=1e-2)[1]
    load_resharded(other, folder)


# PyTorch's format: zero_lab stage 3 <-> FSDP2 (fully_shard) with torch.optim.AdamW, through torch.distributed.checkpoint
def fsdp2(seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = GPT(CONFIG, seed=seed)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def whole(model, optimizer):
    if hasattr(optimizer, "gathered_parameters"):
        with optimizer.gathered_parameters():
            return {name: p.detach().clone() for name, p in model.named_parameters()}
    return {name: p.to_local().detach().clone() for name, p in model.named_parameters()}  # FSDP2: this rank's rows


def dcp_run(side, folder, saving):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    pair = make(3, seed=0 if saving else 1) if side == "zero_lab" else fsdp2(seed=0 if saving else 1)
    if saving:
        train(*pair, BATCHES[:3])
    if side == "zero_lab":
        (save_dcp if saving else load_dcp)(pair[1], folder)
    else:
        model_state, optimizer_state = get_state_dict(*pair)
        state = {"model": model_state, "optim": optimizer_state}
        if saving:
            dcp.save(state, checkpoint_id=folder)
        else:
            dcp.load(state, checkpoint_id=folder)
            set_state_dict(*pair, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train(*pair, BATCHES[3:])
    return whole(*pair)


@pytest.mark.parametrize("saver, loader, saved_world, world", [("zero_lab", "fsdp2", 2, 3), ("fsdp2", "zero_lab", 3, 2)])
def test_a_dcp_checkpoint_moves_between_zero_lab_stage_3_and_fsdp2_at_another_world_size(tmp_path, saver, loader,
                                                                                       saved_world, world):
    def weights(side, world_size, saving):
        ranks = launch(dcp_run, world_size, side, str(tmp_path), saving, timeout=120)
        return ranks[0] if side == "zero_lab" else {name: torch.cat([r[name] for r in ranks]) for name in ranks[0]}

    saved, loaded = weights(saver, saved_world, True), weights(loader, world, False)
    for name in saved.keys() & loaded.keys():
        a, b = saved[name], loaded[name]
        if name.endswith("attn.c_attn.bias"):  # the keys' bias: zero gradient in exact arithmetic (softmax cancels
            keys = slice(CONFIG.n_embd, 2 * CONFIG.n_embd)  # it), so each side's update is AdamW's on rounding noise
            torch.testing.assert_close(a[keys], b[keys], rtol=0, atol=KEY_BIAS_BOUND)
            a, b = torch.cat([a[:CONFIG.n_embd], a[2 * CONFIG.n_embd:]]), torch.cat([b[:CONFIG.n_embd], b[2 * CONFIG.n_embd:]])
        # gradient sums in another order: a few ulps of each gradient, carried through 3 AdamW steps (rtol ~80 ulps)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def adam_step_bound(step, beta1=0.9, beta2=0.999):
    """The largest |m_hat / sqrt(v_hat)| AdamW can reach at `step`, whatever the gradients: by Cauchy-Schwarz,
    |sum beta1^k g| <= sqrt(sum (beta1^2 / beta2)^k) sqrt(sum beta2^k g^2), with the bias corrections of `step`."""
    reach = math.sqrt(sum((beta1 ** 2 / beta2) ** k for k in range(step)))
    return (1 - beta1) / (1 - beta1 ** step) * reach / math.sqrt((1 - beta2) / (1 - beta2 ** step))


# Steps 4-6 after the load (lr 1e-2): each side moves a key bias by at most lr * bound a step, on noise alone, and the
# weight decay only shrinks their difference, so they stay within twice the sum (about 0.062).
KEY_BIAS_BOUND = 2 * sum(1e-2 * adam_step_bound(step) for step in (4, 5, 6))


def save_while_training(folder):
    model, optimizer = make(2)
    train(model, optimizer, BATCHES[:2])
    at_step_2 = plain(optimizer.consolidated_state_dict())
    pending = reshard.AsyncSave(optimizer, folder)
    train(model, optimizer, BATCHES[2:4])  # the live masters and moments change while the files are written
    assert not os.path.exists(folder)  # not committed before finish()
    pending.finish()
    return at_step_2


def test_an_asynchronous_save_holds_the_step_it_was_started_after(tmp_path):
    folder = str(tmp_path / "checkpoint")
    at_step_2 = launch(save_while_training, 2, folder, timeout=60)[0]
    assert launch(load_step, 3, folder, timeout=60)[0] == at_step_2  # weights, moments, step counts of step 2 (loaded at stage 1)


def test_the_training_script_resumes_from_its_last_checkpoint_on_any_world(tmp_path):
    checkpoints = str(tmp_path / "checkpoints")
    run = (2, 6, 12, 3e-3)  # stage, steps, global batch, lr
    first = launch(train_script, 2, *run, checkpoint_dir=checkpoints, save_every=3, timeout=60)[0]
    assert len(first) == 6 and sorted(os.listdir(checkpoints)) == ["step-000003", "step-000006"]
    resumed = launch(train_script, 2, 2, 8, 12, 3e-3, checkpoint_dir=checkpoints, timeout=60)[0]
    whole = launch(train_script, 2, 2, 8, 12, 3e-3, timeout=60)[0]
    assert len(resumed) == 2 and resumed == whole[6:]  # steps 7 and 8, as if it had not stopped, bit for bit
    smaller = launch(train_script, 1, 3, 8, 12, 3e-3, checkpoint_dir=checkpoints, timeout=60)[0]
    assert len(smaller) == 2  # stage 3 on 1 rank, from stage 2's checkpoint of 2 ranks
