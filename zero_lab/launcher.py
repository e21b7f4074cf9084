"""Run one Python function on N ranks of this machine and get each rank's result back.

    results = zero_lab.launch(fn, world_size=4, *args)   # [fn's result on rank 0, 1, 2, 3]

The same call serves notebook cells, pytest and scripts. Ranks are processes started with
`fork` where the OS has it, so `fn` may be defined in a notebook cell; inside, `fn` sees an
initialised default process group ("counted" over gloo on CPU, over nccl with one GPU per
rank when there are enough GPUs) and can use `torch.distributed` as usual.

Failures surface in the caller, never as a silent hang:
- an exception on any rank raises `RankFailed` naming the rank, with its traceback, and the
  other ranks are killed at once;
- a rank that is still running after `timeout` seconds (say only some ranks entered a
  collective) raises `RanksHung`, which names every stuck rank, the collective it is blocked
  in and its Python stack (dumped by faulthandler), then kills them all.
No child outlives `launch`: every path ends with SIGKILL and a reap, and children also die
with their parent (PR_SET_PDEATHSIG) if the caller itself is killed.

Under `torchrun`, call `init_distributed()` instead: it reads torchrun's environment.
"""

from __future__ import annotations

import ctypes
import faulthandler
import importlib
import multiprocessing as mp
import os
import pickle
import re
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait

# Asking "is there a GPU?" through NVML keeps CUDA uninitialised in the parent, so forked
# ranks can still use it. Must be set before torch first queries CUDA.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from zero_lab import comm_ledger  # noqa: E402

DEFAULT_TIMEOUT = 120.0


class RankFailed(RuntimeError):
    """A rank raised an exception or died; `rank` and `rank_traceback` say which and where."""

    def __init__(self, rank: int, world_size: int, rank_traceback: str):
        self.rank, self.world_size, self.rank_traceback = rank, world_size, rank_traceback
        super().__init__(f"rank {rank} of {world_size} failed:\n{rank_traceback}")


class RanksHung(TimeoutError):
    """Ranks still running after the timeout; `stuck` maps rank -> where it was blocked."""

    def __init__(self, timeout: float, world_size: int, stuck: dict[int, str], stacks: dict[int, str]):
        self.stuck, self.stacks = stuck, stacks
        lines = [f"{len(stuck)} of {world_size} ranks still running after {timeout:g} s:"]
        lines += [f"  rank {rank}: {where}" for rank, where in sorted(stuck.items())]
        lines.append("(a collective that not every rank entered, or entered in a different order, blocks forever)")
        for rank, stack in sorted(stacks.items()):
            lines.append(f"\n--- rank {rank} Python stack (most recent call first) ---\n{stack.strip()}")
        super().__init__("\n".join(lines))


def transport() -> str:
    """'nccl' if a GPU is visible, else 'gloo'."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(timeout: float | None = None, init_method: str = "env://") -> torch.device:
    """Join the default process group from environment variables; return this rank's device.

    Works under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and inside
    `launch`, which sets the same variables. A no-op if the group already exists.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if transport() == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = comm_ledger.register(transport())
        kwargs = {"timeout": timedelta(seconds=timeout)} if timeout else {}
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, **kwargs)
    return device


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _rank_main(fn, args, kwargs, rank, world_size, store_file, conn, stack_file, timeout):
    _die_with_parent()
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    # One thread per rank: an OpenMP pool the parent already used cannot be reused after
    # fork (the first multi-threaded matmul would hang), and ranks share the cores anyway.
    torch.set_num_threads(1)
    try:
        # Rendezvous through a file, not a TCP store: no rank can try to connect before the
        # store's server listens (c10d's retry path can stall for seconds on a reverse-DNS lookup).
        init_distributed(timeout=timeout, init_method=f"file://{store_file}")
        message = ("ok", fn(*args, **kwargs))
    except BaseException:
        message = ("error", traceback.format_exc())
    try:
        # Plain pickle: torch's multiprocessing pickler would pass tensors as shared-memory
        # handles, which die with this process.
        conn.send_bytes(pickle.dumps(message))
    except Exception:
        conn.send_bytes(pickle.dumps(("error", "could not send the result back:\n" + traceback.format_exc())))
    sys.stdout.flush()
    sys.stderr.flush()
    # Stay up until the parent has every result and kills us: a rank that left early would
    # break its peers' connections and turn their honest hang into a misleading error.
    while True:
        signal.pause()


def _blocked_in(stack: str) -> str:
    """Name the torch.distributed call (and the caller's line) a faulthandler stack is in."""
    frames = re.findall(r'File "(.+?)", line (\d+) in (\S+)', stack)
    collective = next((f for path, _, f in frames if path.endswith("distributed_c10d.py")), None)
    caller = next(
        (f"{os.path.basename(path)}:{line} in {func}" for path, line, func in frames
         if f"{os.sep}torch{os.sep}" not in path and not path.endswith("launcher.py")),
        None,
    )
    if collective:
        return f"blocked in torch.distributed.{collective}" + (f" (called from {caller})" if caller else "")
    return f"running {caller}" if caller else "no Python frame (blocked in C code)"


def launch(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, **kwargs) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` ranks; return the list of per-rank results.

    Results travel back by pickle, so return plain data (numbers, lists, dicts, CPU tensors).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if transport() == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"world_size={world_size} needs one GPU per rank, but {torch.cuda.device_count()} are visible; "
            "use fewer ranks or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run them on CPU."
        )
    if "fork" not in mp.get_all_start_methods():
        raise RuntimeError(
            "zero_lab.launch needs the 'fork' start method, which this OS lacks (Windows). "
            "Run the course under WSL2, or run scripts with torchrun (see the README's "
            "Troubleshooting section)."
        )
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "CUDA is already initialised in this process, so forked ranks cannot use it. "
            "Restart the kernel and call zero_lab.launch before touching CUDA in the parent."
        )
    # Building any torch.optim optimizer imports torch._dynamo (~2 s). Importing it here, once,
    # lets every forked rank inherit it instead of paying for it in each launch.
    importlib.import_module("torch._dynamo")

    ctx = mp.get_context("fork")
    store_dir = tempfile.TemporaryDirectory(prefix="zero_lab_rendezvous_")
    store_file = os.path.join(store_dir.name, "store")
    procs, conns, stack_files = [], [], []
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            stack_file = tempfile.TemporaryFile(mode="w+")
            proc = ctx.Process(
                target=_rank_main,
                args=(fn, args, kwargs, rank, world_size, store_file, child_end, stack_file, timeout),
                daemon=True,
            )
            proc.start()
            child_end.close()
            procs.append(proc)
            conns.append(parent_end)
            stack_files.append(stack_file)
        return _collect(procs, conns, stack_files, timeout)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join()
        for item in conns + stack_files:
            item.close()
        store_dir.cleanup()


def _collect(procs, conns, stack_files, timeout):
    world_size = len(procs)
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    while len(results) < world_size:
        pending = [r for r in range(world_size) if r not in results]
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            _raise_hung(pending, procs, stack_files, timeout)
        ready = wait([conns[r] for r in pending] + [procs[r].sentinel for r in pending], remaining)
        for rank in pending:
            if conns[rank] not in ready and procs[rank].sentinel not in ready:
                continue
            try:
                status, payload = pickle.loads(conns[rank].recv_bytes())
            except EOFError:  # the pipe closed with nothing in it: the process died
                procs[rank].join(1)
                raise RankFailed(rank, world_size, f"the process died without a Python exception ({_exit_reason(procs[rank])})")
            if status == "error":
                raise RankFailed(rank, world_size, payload)
            results[rank] = payload
    return [results[r] for r in range(world_size)]


def _exit_reason(proc) -> str:
    code = proc.exitcode
    return f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"


def _raise_hung(pending, procs, stack_files, timeout):
    for rank in pending:
        os.kill(procs[rank].pid, signal.SIGUSR1)
    time.sleep(0.3)  # faulthandler writes from its signal handler: give it a moment
    stacks = {}
    for rank in pending:
        stack_files[rank].seek(0)
        # Keep the frames of the rank's own work: drop the launcher and multiprocessing ones.
        stacks[rank] = stack_files[rank].read().split("in _rank_main")[0].rsplit("\n", 1)[0]
    stuck = {rank: _blocked_in(stacks[rank]) for rank in pending}
    raise RanksHung(timeout, len(procs), stuck, stacks)
