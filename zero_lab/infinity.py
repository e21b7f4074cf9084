# Generated from solutions/10_infinity/10_infinity.ipynb by `zero-lab build`: edit the notebook, not this file.

"""ZeRO-Infinity (Rajbhandari et al., SC'21, arXiv:2104.07857): NVMe as a third memory tier, SIMULATED.

TokenBucket       a device of a given bandwidth: every transfer waits its bytes / bandwidth, in a queue
NvmeTier          named flat fp32 tensors in files, each read and write charged to a TokenBucket
tier_adamw_step   AdamW over master, exp_avg, exp_avg_sq kept on the tier, streamed chunk by chunk,
                  the next chunks' reads running while the current chunk is updated (§5, §6.2)
No real SSD is timed: the OS page cache would hide its speed; the bucket's bandwidth is the model.
"""
import errno
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from zero_lab.cpu_adam import cpu_adam_


class TokenBucket:
    """Transfers at `bandwidth` bytes/s, one after another, from any thread: charge() waits for each."""

    def __init__(self, bandwidth: float):
        if not bandwidth > 0:
            raise ValueError(f"bandwidth must be a positive number of bytes/s, got {bandwidth!r}; pass None for no throttle")
        self.bandwidth = float(bandwidth)
        self.free_at = time.perf_counter()  # when the device has finished every transfer charged so far
        self.lock = threading.Lock()

    def charge(self, nbytes: int) -> float:
        """Queue a transfer of nbytes, sleep until it has finished; return the seconds slept."""
        with self.lock:
            now = time.perf_counter()
            self.free_at = max(now, self.free_at) + nbytes / self.bandwidth
            wait = self.free_at - now
        time.sleep(wait)
        return wait


class NvmeTier:
    """SIMULATED NVMe: named flat fp32 tensors, one file each, in a fresh subdirectory of `directory`.

    bandwidth   bytes/s charged to every read and write (a TokenBucket shared by all threads); None: unthrottled
    quota       the most bytes the tier may hold; a write beyond it raises OSError (ENOSPC) and changes nothing
    bytes_read, bytes_written    every byte moved, counted exactly
    held_bytes  bytes read and not yet written back (with write(..., start=...)): the host memory a
                streaming loop holds; peak_held_bytes its maximum
    close() (or leaving a `with` block) removes the subdirectory and everything in it, nothing else.
    """

    def __init__(self, directory, bandwidth: float | None = None, quota: int | None = None):
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self.directory = Path(tempfile.mkdtemp(prefix="nvme-tier-", dir=directory))
        except OSError as error:
            raise OSError(error.errno, f"NvmeTier cannot create its files under {str(directory)!r} ({error.strerror}): "
                                       f"pass a directory you can write to, e.g. tempfile.gettempdir()") from error
        self.bucket = TokenBucket(bandwidth) if bandwidth is not None else None
        self.quota = quota
        self.numels: dict[str, int] = {}
        self.bytes_read = self.bytes_written = self.held_bytes = self.peak_held_bytes = 0
        self.lock = threading.Lock()  # the counters: a prefetching thread reads while the caller writes

    def path(self, name: str) -> Path:
        if not name or os.sep in name or name.startswith("."):
            raise ValueError(f"tensor name {name!r}: use a plain file name (no '{os.sep}', not starting with '.')")
        return self.directory / f"{name}.f32"

    def count(self, nbytes: int, read: bool, held: int) -> None:
        if self.bucket is not None:
            self.bucket.charge(nbytes)
        with self.lock:
            if read:
                self.bytes_read += nbytes
            else:
                self.bytes_written += nbytes
            self.held_bytes += held
            self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)

    def read(self, name: str, start: int = 0, numel: int | None = None) -> torch.Tensor:
        """Elements [start, start + numel) of tensor `name` (all of it by default), a new CPU fp32 tensor."""
        if name not in self.numels:
            raise KeyError(f"no tensor {name!r} on the tier; it holds {sorted(self.numels)}")
        numel = self.numels[name] - start if numel is None else numel
        with open(self.path(name), "rb") as file:
            file.seek(4 * start)
            data = bytearray(file.read(4 * numel))
        self.count(len(data), read=True, held=len(data))
        return torch.frombuffer(data, dtype=torch.float32) if data else torch.empty(0)

    def write(self, name: str, tensor: torch.Tensor, start: int | None = None) -> None:
        """start=None: tensor becomes `name` (atomically: a temporary file, then os.replace).
        start=k: write tensor back over elements [k, k + numel) of the existing `name`, in place."""
        data = tensor.detach().to("cpu", torch.float32).contiguous().reshape(-1).numpy().tobytes()
        if start is not None:
            if start + len(data) // 4 > self.numels.get(name, -1):
                raise ValueError(f"{name!r}: a slice [{start}, {start + len(data) // 4}) beyond its {self.numels.get(name)} elements")
            with open(self.path(name), "r+b") as file:
                file.seek(4 * start)
                file.write(data)
            return self.count(len(data), read=False, held=-len(data))
        used = 4 * (sum(self.numels.values()) - self.numels.get(name, 0)) + len(data)
        if self.quota is not None and used > self.quota:
            raise OSError(errno.ENOSPC, f"NvmeTier quota of {self.quota} bytes exceeded: writing {name!r} "
                                        f"({len(data)} bytes) would make {used}; pass a larger quota= or delete() a tensor")
        temporary = self.path(name).with_suffix(".tmp")
        try:
            temporary.write_bytes(data)
            os.replace(temporary, self.path(name))
        finally:
            temporary.unlink(missing_ok=True)
        self.numels[name] = len(data) // 4
        self.count(len(data), read=False, held=0)

    def delete(self, name: str) -> None:
        self.path(name).unlink()
        del self.numels[name]

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        self.numels.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


STATES = ("master", "exp_avg", "exp_avg_sq")


def put_states(tier: NvmeTier, names: list[str], masters: list[torch.Tensor]) -> None:
    """Put each flat fp32 master on the tier as `<name>.master`, with zero `<name>.exp_avg` and `<name>.exp_avg_sq`."""
    for name, master in zip(names, masters):
        for state, value in zip(STATES, (master, torch.zeros_like(master), torch.zeros_like(master))):
            tier.write(f"{name}.{state}", value)


@torch.no_grad()
def tier_adamw_step(tier: NvmeTier, names: list[str], grads: list[torch.Tensor], step: int, *, lr: float,
                    betas: tuple[float, float], eps: float, weight_decay: float, chunk_numel: int,
                    prefetch: int = 1) -> None:
    """One AdamW step (torch.optim.AdamW's arithmetic) of the states put_states put on the tier; step counts from 1.

    Streams (master, exp_avg, exp_avg_sq) chunk_numel elements at a time, prefetch chunks' reads ahead
    in a background thread; host memory holds at most (prefetch + 1) chunks of the three.
    """
    chunks = [(name, grad.reshape(-1), start, min(chunk_numel, grad.numel() - start))
              for name, grad in zip(names, grads) for start in range(0, grad.numel(), chunk_numel)]

    def fetch(chunk):
        name, _, start, numel = chunk
        return [tier.read(f"{name}.{state}", start, numel) for state in STATES]

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvme-prefetch") as reader:
        pending = deque(reader.submit(fetch, chunk) for chunk in chunks[:prefetch])
        for i, chunk in enumerate(chunks):
            master, exp_avg, exp_avg_sq = pending.popleft().result() if prefetch else fetch(chunk)
            if prefetch and i + prefetch < len(chunks):
                pending.append(reader.submit(fetch, chunks[i + prefetch]))
            name, grad, start, numel = chunk
            cpu_adam_(master, grad[start:start + numel], exp_avg, exp_avg_sq, step, lr=lr, betas=betas, eps=eps,
                      weight_decay=weight_decay)
            for state, value in zip(STATES, (master, exp_avg, exp_avg_sq)):
                tier.write(f"{name}.{state}", value, start)
