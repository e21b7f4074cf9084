"""Checkpoint files: what was saved comes back, a damaged file is refused with its name."""

import io

import pytest
import torch

from zero_lab import load_checkpoint, save_checkpoint


def test_round_trip_and_damaged_files(tmp_path):
    state = {"weights": torch.arange(1000.0), "step": 7}
    path = tmp_path / "checkpoint-rank0.pt"
    save_checkpoint(state, path)
    loaded = load_checkpoint(path)
    assert torch.equal(loaded["weights"], state["weights"]) and loaded["step"] == 7
    assert list(tmp_path.iterdir()) == [path], "no temporary file is left"
    data = path.read_bytes()

    path.write_bytes(data[: len(data) // 2])  # a save cut short
    with pytest.raises(ValueError, match=r"checkpoint-rank0\.pt is truncated or corrupted"):
        load_checkpoint(path)
    path.write_bytes(data[:10])
    with pytest.raises(ValueError, match=r"checkpoint-rank0\.pt is truncated"):
        load_checkpoint(path)
    corrupted = bytearray(data)
    corrupted[-2000] ^= 1  # one bit flipped inside the tensor's bytes: torch.load alone would load it
    path.write_bytes(bytes(corrupted))
    with pytest.raises(ValueError, match=r"checkpoint-rank0\.pt is truncated or corrupted"):
        load_checkpoint(path)
    torch.save(state, path)
    with pytest.raises(ValueError, match="torch.load"):
        load_checkpoint(path)

    buffer = io.BytesIO()  # file objects too
    save_checkpoint(state, buffer)
    buffer.seek(0)
    assert load_checkpoint(buffer)["step"] == 7
