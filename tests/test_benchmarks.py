"""Every script in benchmarks/ end to end, at 1 rank and at 2, with its smallest options (a tiny
GPT, 3 steps, one launch), called through its `main(argv)`; and the lab bench's device plumbing:
the batches go to the device the bench is given, by default `zero_lab.rank_device()`, which is
also where the scripts put their models.

The ranks run where zero_lab.launch puts them: on CI's CPU; on a GPU machine these same tests
run the GPU path. The scripts' first line says which (zero_lab.placement).
"""

import importlib.util
import sys

import pytest
import torch

import zero_lab
from zero_lab import side_by_side
from zero_lab.course_tools.implementation import REPO
from zero_lab.models import GPTConfig

BENCHMARKS = REPO / "benchmarks"
TINY = GPTConfig(vocab_size=32, n_layer=2, n_head=2, n_embd=16, block_size=16)  # 7,360 parameters
SMALLEST = ["--steps", "3", "--warmup", "1", "--repeats", "1", "--batch-size", "4"]


@pytest.fixture
def script(monkeypatch):
    """Load benchmarks/<name>.py (its folder on sys.path: zero3_profile imports zero3_vs_fsdp2),
    with every model size the scripts take by name made TINY."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setitem(side_by_side.SIZES, "tiny", TINY)

    def load(name):
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up
        spec.loader.exec_module(module)
        if hasattr(module, "CONFIG"):
            monkeypatch.setattr(module, "CONFIG", TINY)
        return module

    return load


def smallest_options(name: str, ranks: int, tmp_path) -> list[str]:
    if name == "zero3_profile":
        return ["--ranks", str(ranks), "--size", "tiny", "--steps", "3", "--warmup", "1", "--batch-size", "4",
                "--rows", "5"]
    if name == "memory_vs_formula":
        return ["--nd", str(ranks), "--rows", "DP", "P_os+g+p", "--sizes", "tiny", "--json", str(tmp_path / "run.json")]
    sizes = ["--sizes", "tiny"] if name.endswith("_fsdp2") else []
    return ["--ranks", str(ranks), *SMALLEST, *sizes]


RANKED = ("ddp_vs_torch", "zero1_vs_torch", "zero2_vs_fsdp2", "zero3_vs_fsdp2", "offload_vs_fsdp2", "zero3_profile",
          "memory_vs_formula", "deepspeed_side_by_side")


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("name", RANKED)
def test_every_script_runs_end_to_end_and_says_where_the_ranks_run(name, ranks, script, capsys, tmp_path,
                                                                  monkeypatch):
    module = script(name)
    if name == "memory_vs_formula":
        monkeypatch.setitem(module.SIZES, "tiny", TINY)
    try:
        module.main(smallest_options(name, ranks, tmp_path))
    except SystemExit as exit:  # deepspeed_side_by_side without DeepSpeed: says so, exits 0
        assert name == "deepspeed_side_by_side" and exit.code == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == str(zero_lab.placement(ranks)), out
    if ranks == 1 and name.endswith("_fsdp2"):  # one rank sends nothing: no ratio to the paper's volume
        assert "—" in out and "0 bytes" in out, out


def test_the_cpu_only_scripts_say_so_in_their_help(script, capsys):
    for name in ("cpu_adam", "grading_time", "import_time"):
        with pytest.raises(SystemExit):
            script(name).main(["--help"])
        assert "No GPU needed" in capsys.readouterr().out, name


def test_cpu_adam_runs_at_its_smallest(script, capsys):
    script("cpu_adam").main(["--sizes", "4096", "--threads", "1", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "torch fused" in out and "memory bound" in out, out


def test_stage3_vs_fsdp2_says_how_ours_compares(monkeypatch):
    """The reusable comparison (a GPU check imports it): the same losses, a step-time ratio."""
    for ranks, dtype in ((1, "fp32"), (2, torch.bfloat16)):
        compared = side_by_side.stage3_vs_fsdp2(ranks, 3, {"tiny": TINY}, dtype, warmup=1, batch_size=4)
        assert compared["placement"] == str(zero_lab.placement(ranks))
        assert compared["dtype"] == ("float32" if dtype == "fp32" else "bfloat16") and compared["steps"] == 3
        row = compared["sizes"]["tiny"]
        assert row["losses_match"] and row["max_loss_diff"] <= compared["tolerance"], row
        assert row["ratio"] == pytest.approx(row["ours_ms"] / row["fsdp2_ms"]) and row["ratio"] > 0
        assert len(row["result"][side_by_side.ZERO3_VERSIONS[1]]["losses"]) == 3
    with pytest.raises(ValueError, match="dtype"):
        side_by_side.stage3_vs_fsdp2(1, 3, {"tiny": TINY}, torch.float16)


# --- batches follow the model's device ------------------------------------------------------------

def _batch_devices(device):
    """interleaved_steps with a stand-in step that only notes where its batch is."""
    seen = []

    def step(tokens, targets):
        seen.append((tokens.device.type, targets.device.type))

    batches = [(torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long))] * 3
    runs = side_by_side.interleaved_steps({"a": step, "b": step}, batches, warmup=1, device=device)
    assert all(len(run["times"]) == 3 for run in runs.values())
    return seen


def test_interleaved_steps_moves_the_batches_to_the_device_it_is_given():
    # "meta": a device other than the CPU that every machine has (shapes, no values)
    assert set(zero_lab.launch(_batch_devices, 2, torch.device("meta"))[0]) == {("meta", "meta")}
    assert set(zero_lab.launch(_batch_devices, 1, torch.device("cpu"))[0]) == {("cpu", "cpu")}


def test_interleaved_steps_defaults_to_the_rank_device(monkeypatch):
    monkeypatch.setattr(zero_lab, "rank_device", lambda: torch.device("meta"))  # the ranks fork with it
    assert set(zero_lab.launch(_batch_devices, 1, None)[0]) == {("meta", "meta")}


MARKED = torch.device("cpu", 0)  # the CPU under a name no code of the bench writes itself ("cpu:0")


def _devices_used(module, train, *args):
    """Run `train(*args)` on this rank with zero_lab.rank_device() returning MARKED and the
    module's prepare, fsdp2_shard and interleaved_steps watched: which of them were called, and
    were they all given MARKED?"""
    used = []

    def watched(name, position):
        real = getattr(module, name)

        def call(*args, **kwargs):
            used.append((name, kwargs["device"] if "device" in kwargs else args[position]))
            return real(*args, **kwargs)
        return call

    zero_lab.rank_device = lambda: MARKED
    for name, position in (("prepare", None), ("fsdp2_shard", 1), ("interleaved_steps", 3)):
        if hasattr(module, name):
            setattr(module, name, watched(name, position))
    train(*args)
    return sorted({name for name, _ in used}), [str(device) for _, device in used]


@pytest.mark.parametrize("name", ["zero1_vs_torch", "zero2_vs_fsdp2", "offload_vs_fsdp2", "side_by_side"])
def test_models_and_batches_go_to_the_rank_device(name, script):
    if name == "side_by_side":  # our stage 3 against FSDP2: what zero3_vs_fsdp2.py and stage3_vs_fsdp2 run
        module, train = side_by_side, side_by_side.zero3_side_by_side
    else:
        module = script(name)
        train = module.train_side_by_side
    names, devices = zero_lab.launch(_devices_used, 1, module, train, 2, 1, 2, TINY)[0]
    assert "prepare" in names and "interleaved_steps" in names, names
    assert "fsdp2_shard" in names or name == "zero1_vs_torch", names
    assert set(devices) == {str(MARKED)}, devices


def test_the_deepspeed_table_has_no_ratio_to_zero_bytes():
    """One rank sends nothing: the bytes / formula column says "—" (the figures here are made up)."""
    row = dict(collectives={}, sent_bytes=0, step_ms=2.0, time_vs_ours=1.0, max_loss_diff=0.0)
    comparison = dict(ranks=1, psi=100, results={(1, side_by_side.OURS): row, (1, "DeepSpeed"): row})
    text = side_by_side.table(comparison)
    assert "1 rank," in text and "—" in text, text
