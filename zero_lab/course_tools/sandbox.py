"""What `nbgrader autograde` gives learner code: it runs with the grader's rights, so grading
confines what it can. nbgrader_config.py calls `confine` in an autograde run (docs/grading.md's
`nbgrader autograde` and `zero-lab grade` alike):

- HOME and TMPDIR point into a scratch folder inside the course (nothing written outside it),
  removed when nbgrader exits; the kernel starts in the notebook's own folder (nbgrader's
  default);
- on macOS and Linux the kernel talks to nbgrader over Unix sockets (nbgrader_config.py), not
  TCP: jupyter_client picks free ports and lets them go before the kernel binds them, and a
  rank's gloo socket can take one in between ("Address already in use", jupyter/nbconvert#1066);
- on Linux nbgrader becomes a child subreaper: a process learner code started, even in a new
  session (`setsid`), is re-parented to it when its parent dies, and is killed when nbgrader
  exits;
- the kernels get grading_kernel.py as an IPython startup file (progress, kernel death, and the
  grading guard: a grade only for the learner's own code, grading_guard.py); earlier lessons'
  modules are the reference (ZERO_LAB_IMPL=reference).

It is no security boundary: a notebook can still read and write what the grader can.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import tempfile
from pathlib import Path

from zero_lab.course_tools import kernel_sockets

SCRATCH_PREFIX = ".autograde-scratch-"
PR_SET_CHILD_SUBREAPER = 36


def confine(course_root: str | Path) -> None:
    if os.environ.get("ZERO_LAB_CONFINED"):
        return
    scratch = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=course_root))
    home, tmp = scratch / "home", scratch / "tmp"
    startup = home / ".ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    tmp.mkdir()
    # A Unix socket's path has at most 104 bytes (macOS), so the kernels' sockets get a short folder.
    runtime = kernel_sockets.short_folder() if os.name == "posix" else str(scratch / "runtime")
    shutil.copy(Path(__file__).with_name("grading_kernel.py"), startup / "00-zero-lab-grading.py")
    os.environ.update(HOME=str(home), TMPDIR=str(tmp), IPYTHONDIR=str(home / ".ipython"), ZERO_LAB_CONFINED="1",
                      JUPYTER_RUNTIME_DIR=runtime,
                      ZERO_LAB_COURSE_ROOT=str(Path(course_root).resolve()), ZERO_LAB_IMPL="reference")
    if hasattr(os, "sched_getaffinity"):  # Linux
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    atexit.register(clean_up, scratch, Path(runtime))


def children() -> list[int]:
    me, found = os.getpid(), []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            stat = entry.read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == me:
            found.append(int(entry.parent.name))
    return found


def kill_descendants() -> None:
    """Kill and reap every child; their children are re-parented to us, so repeat."""
    for _ in range(100):
        pids = children() if Path("/proc/self").exists() else []
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


def clean_up(*folders: Path) -> None:
    kill_descendants()
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
