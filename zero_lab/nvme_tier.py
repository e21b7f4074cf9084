# Generated from solutions/10_infinity/10_infinity.ipynb by `zero-lab build`: edit the notebook, not this file.

"""A SIMULATED NVMe tier (lesson 10): files that move at a bandwidth the course chooses.

TokenBucket       a device of a given bandwidth: every transfer waits its bytes / bandwidth, in a queue
NvmeTier          named flat fp32 tensors in files, each read and write charged to a TokenBucket
No real SSD is timed: the OS page cache would hide its speed; the bucket's bandwidth is the model.
"""
import ctypes
import errno
import os
import tempfile
import threading
import time
import weakref
from pathlib import Path

import torch


class TokenBucket:
    """Transfers at `bandwidth` bytes/s, one after another, from any thread: charge() waits for each.

    clock() is now in seconds and sleep(seconds) waits: a test passes its own to see what the bucket asks for."""

    def __init__(self, bandwidth: float, clock=time.perf_counter, sleep=time.sleep):
        if not bandwidth > 0:
            raise ValueError(f"bandwidth must be a positive number of bytes/s, got {bandwidth!r}; pass None for no throttle")
        self.bandwidth, self.clock, self.sleep = float(bandwidth), clock, sleep
        self.free_at = clock()  # when the device has finished every transfer charged so far
        self.lock = threading.Lock()

    def charge(self, nbytes: int) -> float:
        """Queue a transfer of nbytes, sleep until it has finished; return the seconds slept."""
        with self.lock:
            now = self.clock()
            self.free_at = max(now, self.free_at) + nbytes / self.bandwidth
            wait = self.free_at - now
        self.sleep(wait)
        return wait


class NvmeTier:
    """SIMULATED NVMe: named flat fp32 tensors, one file each in `directory`, files that have no name.

    Each file is unlinked as soon as it is created (an anonymous file): the tier holds it open, and the
    operating system frees it when the tier closes it or when the process ends, however it ends (a
    crash, SIGKILL, os._exit of a forked rank), so no launcher has to clean up after it. Their bytes
    count in the disk's free space (df), not in any directory listing.
    bandwidth   bytes/s charged to every read and write (a TokenBucket shared by all threads); None: unthrottled
    quota       the most bytes the tier may hold; a write beyond it raises OSError (ENOSPC) and changes nothing
    bytes_read, bytes_written    every byte moved, counted exactly
    held_bytes  bytes read and not yet written back (with write(..., start=...)): the host memory a
                streaming loop holds; peak_held_bytes its maximum
    close() (or leaving a `with` block, or dropping the tier) frees the files at once.
    """

    def __init__(self, directory, bandwidth: float | None = None, quota: int | None = None):
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._new_file().close()  # can we make files here?
        except OSError as error:
            raise OSError(error.errno, f"NvmeTier cannot create its files under {str(directory)!r} ({error.strerror}): "
                                       f"pass a directory you can write to, e.g. tempfile.gettempdir()") from error
        self.files: dict = {}  # name -> an open anonymous file
        self._removal = weakref.finalize(self, _close_all, self.files)  # a dropped tier frees its files at once
        self.bucket = TokenBucket(bandwidth) if bandwidth is not None else None
        self.quota = quota
        self.numels: dict[str, int] = {}
        self.bytes_read = self.bytes_written = self.held_bytes = self.peak_held_bytes = 0
        self.lock = threading.Lock()  # the counters: a prefetching thread reads while the caller writes

    def _new_file(self):
        """A file in the directory that already has no name (O_TMPFILE where the file system has it)."""
        return tempfile.TemporaryFile(prefix="nvme-tier-", dir=self.directory, buffering=0)

    @staticmethod
    def check_name(name: str) -> None:
        if not name or os.sep in name or name.startswith("."):
            raise ValueError(f"tensor name {name!r}: use a plain file name (no '{os.sep}', not starting with '.')")

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
        data = self._read_bytes(name, start, numel, held=True)
        return torch.frombuffer(data, dtype=torch.float32) if data else torch.empty(0)

    def read_into(self, name: str, out: torch.Tensor, start: int = 0) -> None:
        """Copy elements [start, start + out.numel()) of `name` into `out` (any dtype): nothing is left held."""
        data = self._read_bytes(name, start, out.numel(), held=False)
        if data:
            out.copy_(torch.frombuffer(data, dtype=torch.float32))

    def _read_bytes(self, name: str, start: int, numel: int | None, held: bool) -> bytearray:
        if name not in self.numels:
            raise KeyError(f"no tensor {name!r} on the tier; it holds {sorted(self.numels)}")
        numel = self.numels[name] - start if numel is None else numel
        data = bytearray(4 * numel)
        done, fd = 0, self.files[name].fileno()
        while done < len(data):  # pread: no shared file position, so threads may read at once
            got = os.preadv(fd, [memoryview(data)[done:]], 4 * start + done)
            if got == 0:
                raise EOFError(f"{name!r}: the tier's file ends before element {start + done // 4}")
            done += got
        self.count(len(data), read=True, held=len(data) if held else 0)
        return data

    @staticmethod
    def _write_at(file, data: bytes, offset: int) -> None:
        done = 0
        while done < len(data):
            done += os.pwrite(file.fileno(), memoryview(data)[done:], offset + done)

    def write(self, name: str, tensor: torch.Tensor, start: int | None = None) -> None:
        """start=None: tensor becomes `name` (atomically: a new file, swapped in once it is written).
        start=k: write tensor back over elements [k, k + numel) of the existing `name`, in place."""
        self.check_name(name)
        flat = tensor.detach().to("cpu", torch.float32).contiguous().reshape(-1)
        data = ctypes.string_at(flat.data_ptr(), 4 * flat.numel())  # not .numpy(): it pins the storage's size
        if start is not None:
            if start + len(data) // 4 > self.numels.get(name, -1):
                raise ValueError(f"{name!r}: a slice [{start}, {start + len(data) // 4}) beyond its {self.numels.get(name)} elements")
            self._write_at(self.files[name], data, 4 * start)
            return self.count(len(data), read=False, held=-len(data))
        used = 4 * (sum(self.numels.values()) - self.numels.get(name, 0)) + len(data)
        if self.quota is not None and used > self.quota:
            raise OSError(errno.ENOSPC, f"NvmeTier quota of {self.quota} bytes exceeded: writing {name!r} "
                                        f"({len(data)} bytes) would make {used}; pass a larger quota= or delete() a tensor")
        file = self._new_file()
        try:
            self._write_at(file, data, 0)
        except BaseException:
            file.close()  # a full disk: the old contents stay
            raise
        old, self.files[name] = self.files.get(name), file
        if old is not None:
            old.close()
        self.numels[name] = len(data) // 4
        self.count(len(data), read=False, held=0)

    def delete(self, name: str) -> None:
        self.files.pop(name).close()
        del self.numels[name]

    def close(self) -> None:
        self._removal()  # closes every file (the OS frees it), once
        self.numels.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _close_all(files: dict) -> None:
    for file in files.values():
        file.close()
    files.clear()
