"""Run one Python function on N ranks of this machine and get each rank's result back.

    results = zero_lab.launch(fn, world_size=4, *args)   # [fn's result on rank 0, 1, 2, 3]

The same call serves notebook cells, pytest and scripts. Ranks are processes started with
`fork` where the OS has it, so `fn` may be defined in a notebook cell; inside, `fn` sees an
initialised default process group ("counted": CPU tensors over gloo; CUDA tensors over nccl
with a GPU per rank, over gloo when ranks share a GPU) and can use `torch.distributed` as usual.
`rank_device()` is the rank's device: cuda:(rank mod GPUs), or the CPU (`placement(n)` says
which, and `device=` or $ZERO_LAB_DEVICE chooses).

Failures surface in the caller, never as a silent hang:
- an exception on any rank raises `RankFailed` naming the rank, with its traceback, and the
  other ranks are killed at once;
- ranks that are stuck after `timeout` seconds (say only some ranks entered a collective)
  raise `RanksHung`, which names every stuck rank, the collective it is blocked in and its
  Python stack (dumped by faulthandler), then kills them all. Stuck means blocked (no rank used
  CPU for a second) or running away (a rank used `timeout` seconds of CPU itself): a machine
  busy with other work makes ranks slower, never hung, so one timeout holds on any laptop.
When a rank dies, its peers soon fail too, with "Connection reset by peer": `RankFailed`
names the rank that died or raised first, not a peer that lost its connection to it.
With `flight_recorder=FOLDER` (or True: a new temporary folder) the ranks run with PyTorch's Flight
Recorder on, and a hang or a failure also writes each live rank's dump, FOLDER/rank_<r>, before the
ranks are killed; the error says where (its `dumps` attribute too). A run that succeeds writes nothing.

No process outlives `launch`: each rank runs in its own session, and every path ends with
SIGKILL to each rank's process group (so processes a rank started with subprocess or os.fork
go too) and a reap, even when Ctrl-C is pressed twice. Ranks also die with their parent
(PR_SET_PDEATHSIG) if the caller itself is killed; the rendezvous directory such a killed
caller leaves behind is removed by the next `launch`. (An NVMe tier's files need no help: they
have no name on disk, so the OS frees them when their rank ends, however it ends.)

Under `torchrun`, call `init_distributed()` instead: it reads torchrun's environment.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import faulthandler
import gc
import glob
import importlib
import multiprocessing as mp
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import types
import warnings
from datetime import timedelta
from multiprocessing.connection import wait

# Asking "is there a GPU?" through NVML keeps CUDA uninitialised in the parent, so forked
# ranks can still use it. Must be set before torch first queries CUDA.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.distributed_c10d as distributed_c10d  # noqa: E402
import torch.utils._pytree  # noqa: E402

from zero_lab import comm_ledger, perturb_sums  # noqa: E402
from zero_lab.hang_watch import HangWatch  # noqa: E402
from zero_lab.rank_placement import DEVICE_VARIABLE, Placement  # noqa: E402

DEFAULT_TIMEOUT = 120.0
# The process group's own timeout: launch's watchdog decides first, even for a rank that computes
# for `timeout` CPU-seconds on a machine several times oversubscribed.
PROCESS_GROUP_TIMEOUT_FACTOR, PROCESS_GROUP_TIMEOUT_MARGIN = 10, 60.0
# The Flight Recorder's ring buffer: the last this many collectives of each rank are kept.
FLIGHT_RECORDER_ENTRIES = 2000
DUMP_WAIT = 20.0  # seconds to wait for the ranks' dumps: a small one takes milliseconds, a full buffer on a busy machine more
FAILURE_GRACE = 5.0  # seconds to wait for the rank that broke the connections, once a peer reports it
RENDEZVOUS_PREFIX = "zero_lab_rendezvous_"
# How a rank reports that a peer went away: its error is a consequence, not the cause.
TRANSPORT_ERROR = re.compile(r"Connection (reset|closed) by peer|Broken pipe|gloo/transport|DistNetworkError"
                             r"|NCCL communicator was aborted|ncclRemoteError")
_in_rank = False  # True in a process that launch started


class RankFailed(RuntimeError):
    """A rank raised an exception or died; `rank` and `rank_traceback` say which and where.

    `others` maps the ranks that failed after it (often: lost their connection to it) to the
    last line of their error.
    """

    dumps: str | None = None  # the folder of the ranks' Flight Recorder dumps, with launch(flight_recorder=...)

    def __init__(self, rank: int, world_size: int, rank_traceback: str, others: dict[int, str] | None = None):
        self.rank, self.world_size, self.rank_traceback = rank, world_size, rank_traceback
        self.others = others or {}
        then = "".join(f"\nthen rank {r} failed: {line}" for r, line in sorted(self.others.items()))
        super().__init__(f"rank {rank} of {world_size} failed:\n{rank_traceback.rstrip()}{then}")


class RanksHung(TimeoutError):
    """Ranks still running after the timeout; `stuck` maps rank -> where it was blocked."""

    dumps: str | None = None  # the folder of the ranks' Flight Recorder dumps, with launch(flight_recorder=...)

    def __init__(self, timeout: float, world_size: int, stuck: dict[int, str], stacks: dict[int, str]):
        self.stuck, self.stacks = stuck, stacks
        lines = [f"{len(stuck)} of {world_size} ranks still running after {timeout:g} s:"]
        lines += [f"  rank {rank}: {where}" for rank, where in sorted(stuck.items())]
        lines.append("(a collective that not every rank entered, or entered in a different order, blocks forever)")
        for rank, stack in sorted(stacks.items()):
            lines.append(f"\n--- rank {rank} Python stack (most recent call first) ---\n{stack.strip()}")
        super().__init__("\n".join(lines))


_placement: Placement | None = None  # in a rank: where this machine's ranks run (set by init_distributed)


def placement(world_size: int | None = None, device: str | None = None) -> Placement:
    """Where ranks run: this group's placement in a rank, else where `launch` would put world_size
    ranks (default 1). device: "cpu" or "cuda" (default: $ZERO_LAB_DEVICE, else a GPU if visible)."""
    if _placement is not None and world_size is None and device is None:
        return _placement
    return Placement.choose(world_size or 1, device)


def rank_device() -> torch.device:
    """This rank's device: cuda:(local rank mod GPUs), or cpu. Where the lab bench (lesson 07's GPU
    cells, the benchmarks, train) puts its model and batches; a lesson's own tensors stay where
    its cells make them. Outside a rank, the device of a single process."""
    device = placement().device(int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # here, not at start: a rank that never asks leaves CUDA alone
    return device


def init_distributed(timeout: float | None = None, init_method: str = "env://", device: str | None = None) -> torch.device:
    """Join the default process group from environment variables; return this rank's device.

    Works under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) and inside `launch`, which sets the same variables. `device` ("cpu" or "cuda";
    default $ZERO_LAB_DEVICE, else a GPU if visible) and the number of this machine's ranks decide
    the placement (zero_lab/rank_placement.py): with more local ranks than GPUs they share them over
    gloo. A no-op if the group already exists. Under torchrun the worker dies with its agent, as
    `launch`'s ranks die with their parent: a worker whose agent was killed would otherwise keep
    training with the other machines.
    """
    global _placement
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if dist.is_initialized() and _placement is not None:  # joined already (in a rank of launch: before fn ran)
        return _placement.device(local_rank)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        _die_with_parent()
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    _placement = Placement.choose(local_world_size, device)
    rank_device_now = _placement.device(local_rank)
    if _placement.cuda_transport == "nccl":
        torch.cuda.set_device(rank_device_now)  # NCCL binds each rank to its GPU when the group starts
    if not dist.is_initialized():
        backend = comm_ledger.register(_placement.cuda_transport)
        kwargs = {"timeout": timedelta(seconds=timeout)} if timeout else {}
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, **kwargs)
    return rank_device_now


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _dump_when_asked(requests, path: str) -> None:
    """In a rank (a side thread): wait for the parent's request, then write this rank's Flight Recorder
    dump to `path`. A thread, because the rank's main thread may be blocked in a collective for good."""
    try:
        requests.recv_bytes()
    except EOFError:  # the parent closed the pipe: no dump wanted
        return
    dump = torch._C._distributed_c10d._dump_fr_trace(includeCollectives=True, includeStackTraces=True,
                                                     onlyActive=False)
    with open(path + ".part", "wb") as out:
        out.write(dump)
    os.replace(path + ".part", path)  # whole or absent: the parent never reads half a dump


def _rank_main(fn, args, kwargs, rank, world_size, store_file, conn, stack_file, timeout, restore, device,
               recorder=None):
    global _in_rank
    if restore:
        restore_as_imported()
    _in_rank = True
    _die_with_parent()
    os.setsid()  # a process group of its own: launch kills whatever this rank starts along with it
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked by the parent while it forked
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), **{DEVICE_VARIABLE: device},  # fn's own placement() agrees
    )
    # One thread per rank: an OpenMP pool the parent already used cannot be reused after
    # fork (the first multi-threaded matmul would hang), and ranks share the cores anyway.
    torch.set_num_threads(1)
    perturb_sums.install()  # under ZERO_LAB_PERTURB_SUMS: this rank rounds its sums as another CPU might
    if recorder is not None:  # (request pipe, dump folder): the recorder is on from the group's first collective
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))
        threading.Thread(target=_dump_when_asked, args=(recorder[0], os.path.join(recorder[1], f"rank_{rank}")),
                         daemon=True).start()
    try:
        # Rendezvous through a file, not a TCP store: no rank can try to connect before the
        # store's server listens (c10d's retry path can stall for seconds on a reverse-DNS lookup).
        # The group's own timeout comes after launch's, which then reports the hang (RanksHung,
        # with stacks) instead of racing gloo's "Timed out waiting" error.
        init_distributed(timeout=PROCESS_GROUP_TIMEOUT_FACTOR * timeout + PROCESS_GROUP_TIMEOUT_MARGIN,
                         init_method=f"file://{store_file}", device=device)
        message = ("ok", _on_host(fn(*args, **kwargs)))
    except BaseException:
        message = ("error", _cells_named(traceback.format_exc()))
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


def _cells_named(text: str) -> str:
    """A traceback whose notebook cells (IPython's files, ".../ipykernel_PID/N.py") are named as IPython names
    them, "Cell In[7]": the learner finds the cell and the line of their code that raised."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython else None
    cells = getattr(getattr(shell, "compile", None), "_filename_map", None) or {}  # file -> execution count
    return re.sub(r'File "([^"]+)"', lambda m: f'File "Cell In[{cells[m.group(1)]}]"' if m.group(1) in cells
                  else m.group(0), text)


def _on_host(result):
    """The result with its CUDA tensors copied to the host: unpickling a CUDA tensor in the parent
    would initialise CUDA there, and no later launch could fork ranks that use it."""
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.cpu() if t.is_cuda else t, result)


def _blocked_in(stack: str) -> str:
    """Name the torch.distributed call (and the caller's line) a faulthandler stack is in."""
    frames = re.findall(r'File "(.+?)", line (\d+) in (\S+)', stack)
    collective = next((f for path, _, f in frames if path.endswith("distributed_c10d.py")), None)
    caller = next(
        (f"{os.path.basename(path)}:{line} in {func}" for path, line, func in frames
         if f"{os.sep}torch{os.sep}" not in path and os.path.abspath(path) != os.path.abspath(__file__)),
        None,
    )
    if collective:
        return f"blocked in torch.distributed.{collective}" + (f" (called from {caller})" if caller else "")
    return f"running {caller}" if caller else "no Python frame (blocked in C code)"


def launch(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, device: str | None = None,
           flight_recorder: str | bool | None = None, **kwargs) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` ranks; return the list of per-rank results.

    Results travel back by pickle, so return plain data (numbers, lists, dicts, tensors: CUDA
    tensors come back on the CPU). device: "cpu" or "cuda", where `rank_device()` points in the
    ranks (default: $ZERO_LAB_DEVICE, else a GPU if one is visible; `placement(world_size)` says).
    flight_recorder: a folder (or True: a new temporary one) for one Flight Recorder dump per rank,
    written only if the run hangs or fails.
    """
    return _launch(fn, world_size, args, kwargs, timeout, restore=False, device=device,
                   flight_recorder=flight_recorder)


def launch_restored(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, device: str | None = None,
                    flight_recorder: str | bool | None = None, **kwargs) -> list:
    """`launch` for tests that grade code: each rank first puts builtins, torch, torch.distributed,
    c10d and zero_lab's modules (the comm ledger among them) back as they were when zero_lab was
    imported, before any learner code ran (when grading: before the notebook's first cell, and
    every `launch` does this).

    A monkey-patch made since (`dist.all_reduce = lambda *a, **k: None`, a stubbed ledger
    recorder, `dist` rebound to a fake in the notebook) has no effect in the ranks, so what a
    test computes there with torch.distributed is true, and a CommLedger there counts what
    really went through the process group the launcher made.
    """
    return _launch(fn, world_size, args, kwargs, timeout, restore=True, device=device,
                   flight_recorder=flight_recorder)


# Put back by launch_restored, besides every module of zero_lab and the classes they define:
_RESTORED_NAMESPACES = (torch, torch.Tensor, torch.nn.functional, dist, distributed_c10d, dist.ProcessGroup,
                        dist.ProcessGroupGloo, dist.Work)
_DESCRIPTORS = (staticmethod, classmethod, property, types.ModuleType)
restore_always = False  # grading sets it (course_tools/grading_guard.py): every launch is launch_restored


def _restorable(namespace, value) -> bool:
    if namespace is builtins:  # only Python's own: IPython adds and removes names of its own there
        return isinstance(value, (types.BuiltinFunctionType, type))
    return callable(value) or isinstance(value, _DESCRIPTORS)


def _zero_lab_namespaces() -> list:
    """zero_lab's modules loaded now (not a graded lesson's stand-in, which has no file) and their classes."""
    modules = [module for name, module in list(sys.modules.items())
               if (name == "zero_lab" or name.startswith("zero_lab.")) and getattr(module, "__file__", None)]
    classes = [value for module in modules for value in vars(module).values()
               if isinstance(value, type) and value.__module__ == module.__name__]
    return modules + classes


def snapshot_as_imported() -> list:
    """(namespace, {name: value}) for everything launch_restored puts back: Python's builtins,
    torch (its functions, Tensor's methods, torch.nn.functional), torch.distributed and c10d, and
    every module of zero_lab loaded now with its classes (the ledgers among them)."""
    with warnings.catch_warnings():  # callable() on torch.distributed.reduce_op warns that it is deprecated
        warnings.simplefilter("ignore")
        saved = [(ns, {k: v for k, v in vars(ns).items() if _restorable(ns, v)})
                 for ns in (builtins, *_RESTORED_NAMESPACES, *_zero_lab_namespaces())]
    main = sys.modules.get("__main__")  # the notebook: names bound to modules, e.g. `dist`
    if main is not None:
        saved.append((main, {k: v for k, v in vars(main).items() if isinstance(v, types.ModuleType)}))
    return saved


def restore_as_imported() -> None:
    """Put back what `snapshot_as_imported` saved last (in a rank of launch_restored; before each
    test cell when grading)."""
    for namespace, saved in _AS_IMPORTED:
        current = vars(namespace)
        for name, value in saved.items():
            if current.get(name) is not value:
                setattr(namespace, name, value)


def retake_snapshot() -> None:
    """Take the snapshot again (grading: once zero_lab and the modules a lesson may use are
    imported, before any learner code)."""
    global _AS_IMPORTED
    _AS_IMPORTED = snapshot_as_imported()


def _launch(fn, world_size, args, kwargs, timeout, restore, device=None, flight_recorder=None):
    restore = restore or restore_always
    if _in_rank:
        raise RuntimeError("zero_lab.launch was called inside a rank of another launch: every rank is "
                           "already a process of the group; call the function directly")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int of at least 1, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    device = Placement.choose(world_size, device).device(0).type  # a bad choice fails here, not in every rank
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
    _remove_stale_rendezvous_dirs()

    ctx = mp.get_context("fork")
    store_dir = tempfile.mkdtemp(prefix=f"{RENDEZVOUS_PREFIX}{os.getpid()}_")
    store_file = os.path.join(store_dir, "store")
    procs, conns, stack_files = [], [], []
    # (request pipe per rank, folder or None for a temporary one), or None: recorder off
    recorder = None if flight_recorder in (None, False) else (
        [], None if flight_recorder is True else os.fspath(flight_recorder))
    try:
        # Ctrl-C waits until every started rank is on the list that the cleanup below kills.
        with _sigint_deferred(), _frozen_for_fork():
            for rank in range(world_size):
                parent_end, child_end = ctx.Pipe(duplex=False)
                conns.append(parent_end)
                stack_files.append(tempfile.TemporaryFile(mode="w+"))
                rank_recorder = None
                if recorder is not None:
                    requests, ask = ctx.Pipe(duplex=False)
                    recorder[0].append(ask)
                    rank_recorder = (requests, store_dir)  # the folder is known once the dumps are wanted
                proc = ctx.Process(
                    target=_rank_main,
                    args=(fn, args, kwargs, rank, world_size, store_file, child_end, stack_files[-1], timeout,
                          restore, device, rank_recorder),
                    daemon=True,
                )
                proc.start()
                procs.append(proc)
                child_end.close()
                if rank_recorder is not None:
                    requests.close()
        try:
            return _collect(procs, conns, stack_files, timeout)
        except (RanksHung, RankFailed) as error:
            if recorder is not None:
                _add_dumps(error, procs, recorder[0], recorder[1], store_dir)
            raise
    finally:
        _clean_up(procs, conns + stack_files + (recorder[0] if recorder else []), store_dir)


def _add_dumps(error, procs, asks, folder, written_in) -> None:
    """Ask every live rank for its Flight Recorder dump, move the dumps to `folder` (None: a new temporary
    folder) and name them in `error`'s message and its `dumps` attribute (the folder)."""
    alive = [rank for rank, proc in enumerate(procs) if proc.exitcode is None]
    for rank in alive:
        try:
            asks[rank].send_bytes(b"dump")
        except OSError:  # the rank died just now
            pass
    paths = {rank: os.path.join(written_in, f"rank_{rank}") for rank in alive}
    deadline = time.monotonic() + DUMP_WAIT
    while time.monotonic() < deadline and not all(os.path.exists(p) for p in paths.values()):
        time.sleep(0.05)
    folder = tempfile.mkdtemp(prefix="zero_lab_flight_recorder_") if folder is None else folder
    os.makedirs(folder, exist_ok=True)
    dumped = [rank for rank, path in paths.items() if os.path.exists(path)]
    for rank in dumped:
        shutil.move(paths[rank], os.path.join(folder, f"rank_{rank}"))
    missing = [rank for rank in range(len(procs)) if rank not in dumped]
    note = f"\nFlight Recorder dumps of ranks {dumped} in {folder} (one file per rank, rank_<r>)"
    if missing:
        note += f"; no dump from ranks {missing} (dead, or no answer within {DUMP_WAIT:g} s)"
    error.dumps = folder
    error.args = (str(error) + note,)


class _sigint_deferred:
    """Block SIGINT in this thread inside the block; a Ctrl-C pressed meanwhile arrives after it."""

    def __enter__(self):
        self.previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    def __exit__(self, *exc):
        signal.pthread_sigmask(signal.SIG_SETMASK, self.previous)


@contextlib.contextmanager
def _frozen_for_fork():
    """Fork with the parent's objects in the garbage collector's permanent generation, which the ranks' collections
    skip. A collection that walked them would write to every page holding one: a copy-on-write fault per page, in
    each rank (a test process or notebook kernel holds millions of objects; measured here, under a parent holding
    2 M: a 2-rank launch that trains a small GPT and collects once, 4 s of the ranks' CPU, 0.5 s frozen). The parent's own collections see them again after the fork; a
    caller's own gc.freeze() is left as it was."""
    mine = gc.get_freeze_count() == 0
    if mine:
        gc.freeze()
    try:
        yield
    finally:
        if mine:
            gc.unfreeze()


def _clean_up(procs, closables, store_dir) -> None:
    """Kill every rank's process group, reap the ranks, close and remove what launch made.

    Re-entrant: a KeyboardInterrupt (a second Ctrl-C) in the middle restarts it, and is
    raised once everything is cleaned up.
    """
    interrupted = None
    while True:
        try:
            with _sigint_deferred():
                for proc in procs:
                    _kill_group(proc)
                for proc in procs:
                    proc.join()
                for item in closables:
                    item.close()
                shutil.rmtree(store_dir, ignore_errors=True)
            break
        except KeyboardInterrupt as interrupt:  # delivered just before SIGINT was blocked
            interrupted = interrupt
    if interrupted is not None:
        raise interrupted


def _kill_group(proc) -> None:
    if proc.exitcode is None:
        proc.kill()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # what the rank started (its group outlives the rank)
    except (ProcessLookupError, PermissionError):
        pass  # no such group: the rank had not called setsid yet, or its group is empty


def _remove_stale_rendezvous_dirs() -> None:
    """Remove the rendezvous directories of earlier callers that were killed before cleaning up."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{RENDEZVOUS_PREFIX}*_*")):
        owner = os.path.basename(path)[len(RENDEZVOUS_PREFIX):].split("_")[0]
        if owner.isdigit() and not _process_exists(int(owner)):
            shutil.rmtree(path, ignore_errors=True)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _collect(procs, conns, stack_files, timeout):
    world_size = len(procs)
    results: dict[int, object] = {}
    failures: dict[int, tuple[str, bool]] = {}  # rank -> (what happened, whether it is the cause)
    watchdog = HangWatch(procs, timeout)
    grace_end = None
    while len(results) + len(failures) < world_size:
        pending = [r for r in range(world_size) if r not in results and r not in failures]
        if any(cause for _, cause in failures.values()):
            break
        if failures:  # only peers that lost their connection so far: wait for the rank that broke it
            grace_end = grace_end or time.monotonic() + FAILURE_GRACE
            remaining = grace_end - time.monotonic()
            if remaining <= 0:
                break
        else:
            if watchdog.stuck(pending):
                _raise_hung(pending, procs, stack_files, timeout, watchdog.computing)
            remaining = 0.2
        # Short waits: a Ctrl-C that another thread received is acted on at once, not at the deadline.
        ready = wait([conns[r] for r in pending] + [procs[r].sentinel for r in pending], min(remaining, 0.2))
        for rank in pending:
            if conns[rank] in ready or procs[rank].sentinel in ready:
                _receive(rank, procs[rank], conns[rank], results, failures)
    if failures:
        causes = [rank for rank, (_, cause) in failures.items() if cause] or list(failures)
        first = causes[0]  # dicts keep arrival order
        others = {rank: text.strip().splitlines()[-1][:200] for rank, (text, _) in failures.items() if rank != first}
        raise RankFailed(first, world_size, failures[first][0], others)
    return [results[r] for r in range(world_size)]


def _receive(rank, proc, conn, results, failures) -> None:
    try:
        data = conn.recv_bytes()
    except EOFError:  # the pipe closed with nothing in it: the process died
        proc.join(1)
        failures[rank] = (f"the process died without a Python exception ({_exit_reason(proc)})", True)
        return
    try:
        status, payload = pickle.loads(data)
    except Exception as error:
        failures[rank] = (f"its result could not be unpickled in the parent ({type(error).__name__}: {error}); "
                          "return plain data: numbers, lists, dicts, CPU tensors", True)
        return
    if status == "ok":
        results[rank] = payload
    else:
        failures[rank] = (payload, not TRANSPORT_ERROR.search(payload))


def _exit_reason(proc) -> str:
    code = proc.exitcode
    return f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"


def _raise_hung(pending, procs, stack_files, timeout, computing):
    for rank in pending:
        os.kill(procs[rank].pid, signal.SIGUSR1)
    time.sleep(0.3)  # faulthandler writes from its signal handler: give it a moment
    stacks = {}
    for rank in pending:
        stack_files[rank].seek(0)
        # Keep the frames of the rank's own work: drop the launcher and multiprocessing ones.
        stacks[rank] = stack_files[rank].read().split("in _rank_main")[0].rsplit("\n", 1)[0]
    stuck = {rank: _blocked_in(stacks[rank]) for rank in pending}
    for rank, seconds in computing.items():
        stuck[rank] += f" (computing: {seconds:.0f} CPU-seconds of its own, a loop that does not end?)"
    raise RanksHung(timeout, len(procs), stuck, stacks)


_AS_IMPORTED = snapshot_as_imported()  # last: the functions above are part of it
