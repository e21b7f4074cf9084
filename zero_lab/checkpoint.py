"""Checkpoint files that say when they are damaged.

    zero_lab.save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                             f"checkpoint-rank{rank}.pt")
    state = zero_lab.load_checkpoint(f"checkpoint-rank{rank}.pt")

The file is torch.save's bytes behind a header holding their SHA-256: a file cut short (a full
disk, a job killed while saving) or corrupted in a copy is refused with an error that names it,
instead of failing deep inside the unpickler or, worse, loading wrong numbers. Saving to a path
writes a temporary file and renames it over the old one, so an interrupted save leaves the
previous checkpoint as it was. Both also take an open binary file (io.BytesIO, ...).
"""

from __future__ import annotations

import hashlib
import io
import os

import torch

MAGIC = b"zero_lab checkpoint 1\n"
DIGEST_SIZE = hashlib.sha256().digest_size


def save_checkpoint(state, file) -> None:
    """torch.save(state) with a checksum, to a path (atomically) or a binary file object."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getbuffer()
    if not isinstance(file, (str, os.PathLike)):
        _write(file, payload)
        return
    partial = f"{os.fspath(file)}.partial"
    try:
        with open(partial, "wb") as f:
            _write(f, payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, file)
    finally:  # a full disk: the previous checkpoint stays as it was, no half-written file beside it
        if os.path.exists(partial):
            os.remove(partial)


def _write(f, payload) -> None:
    f.write(MAGIC)
    f.write(hashlib.sha256(payload).digest())
    f.write(payload)


def load_checkpoint(file, **torch_load_options):
    """What save_checkpoint saved; a damaged file raises ValueError naming it."""
    if isinstance(file, (str, os.PathLike)):
        name = os.fspath(file)
        with open(file, "rb") as f:
            data = f.read()
    else:
        name, data = getattr(file, "name", f"the {type(file).__name__} given"), file.read()
    if not data.startswith(MAGIC):
        if MAGIC.startswith(data):
            raise ValueError(f"{name} is truncated ({len(data)} bytes): load an earlier checkpoint")
        raise ValueError(f"{name} was not written by zero_lab.save_checkpoint (load a plain torch.save file "
                         "with torch.load)")
    digest, payload = data[len(MAGIC):len(MAGIC) + DIGEST_SIZE], data[len(MAGIC) + DIGEST_SIZE:]
    if hashlib.sha256(payload).digest() != digest:
        raise ValueError(f"{name} is truncated or corrupted: its content ({len(data)} bytes) does not match "
                         "the SHA-256 saved with it; load an earlier checkpoint")
    return torch.load(io.BytesIO(payload), **torch_load_options)
