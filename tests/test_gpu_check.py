"""benchmarks/gpu_check.py, its CPU half: the same checks with the ranks on the CPU (CI has no GPU)."""

import importlib.util
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", BENCHMARKS / "gpu_check.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_check_passes_on_the_cpu_and_lands_in_one_table_and_a_json(tmp_path, capsys):
    gpu_check = _gpu_check()
    path = tmp_path / "gpu_check.json"
    snapshots = tmp_path / "snapshots"
    assert gpu_check.main(["--device", "cpu", "--quick", "--json", str(path), "--snapshots", str(snapshots)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("2 ranks on CPU, gloo; no GPU; torch ")
    figures = json.loads(path.read_text())
    checks = {row["check"] for row in figures["rows"]}
    assert checks == set(gpu_check.CHECKS) and all(row["ok"] for row in figures["rows"])
    trained = [row["what"] for row in figures["rows"] if row["check"] == "training"]
    assert trained == [f"{label}, 2 ranks" for label, (ranks, _, _) in gpu_check.TRAINING.items() if ranks == 2]
    assert f"{len(figures['rows'])} passed, 0 failed" in out
    recorded = sorted(p.name for p in snapshots.iterdir())
    assert recorded == ["stage1.html", "stage1.pickle", "stage3.html", "stage3.pickle"]


def test_a_failed_check_fails_the_run_and_says_which(tmp_path, monkeypatch, capsys):
    gpu_check = _gpu_check()
    monkeypatch.setitem(gpu_check.TRAINING, "stage 1", (2, dict(stage=1, lr=1.0), 1e-5))  # not AdamW's lr: differs
    monkeypatch.setattr(gpu_check, "CHECKS", {"training": gpu_check.check_training})
    assert gpu_check.main(["--device", "cpu", "--quick", "--json", str(tmp_path / "g.json")]) == 1
    failed = [line for line in capsys.readouterr().out.splitlines() if line.endswith(" NO")]
    assert len(failed) == 1 and "stage 1, 2 ranks" in failed[0]
