"""The training script: the same code under zero_lab.launch and under torchrun."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from zero_lab import launch
from zero_lab.train import main, train

ROOT = Path(__file__).resolve().parents[1]


def test_every_stage_trains_the_same_model_the_same_way():
    curves = {stage: launch(train, 3, stage, 5, 12, 3e-3)[0] for stage in (0, 1, 2)}
    assert curves[0][-1] < curves[0][0]
    for stage in (1, 2):
        assert curves[stage] == pytest.approx(curves[0], rel=1e-5)


def test_stage_3_with_its_optimizer_on_the_nvme_tier_trains_as_stage_3(tmp_path, capfd):
    in_memory = launch(train, 2, 3, 4, 12, 3e-3)[0]
    main(["--stage", "3", "--offload", "nvme", "--nvme-dir", str(tmp_path), "--steps", "4", "--nproc", "2"])
    assert f"stage 3 offload=nvme nvme_dir={tmp_path}, 2 ranks: loss {in_memory[0]:.3f} -> {in_memory[-1]:.3f}" \
        in capfd.readouterr().out
    assert os.listdir(tmp_path) == [], "the tiers' files outlived training"
    for wrong in (["--stage", "2", "--offload", "nvme"], ["--stage", "3", "--nvme-dir", str(tmp_path)]):
        with pytest.raises(SystemExit):
            main(wrong)
    assert "--offload nvme works with --stage 3" in capfd.readouterr().err


def test_runs_under_torchrun_with_env_rendezvous(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", "-m", "zero_lab.train", "--stage", "1", "--steps", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        # torchrun leaves a torchelastic_* directory in TMPDIR: keep it in pytest's, which is cleaned
        env=dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path)),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "stage 1, 2 ranks" in result.stdout
    assert "reduce_scatter" in result.stdout and "all_gather" in result.stdout
