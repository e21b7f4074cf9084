"""Tells a rank that is stuck from one that is slow: launch's hang guard (and lesson 13's fake-world child's).

HangWatch         after the timeout, stuck = none of the pending processes used CPU lately, or one ran away
cpu_seconds       a process's CPU time, from /proc or, where there is none (macOS), from ps
"""

import collections
import os
import subprocess
import time

# A rank blocked in a collective sleeps in the kernel (measured: 0.01 CPU-seconds in 3 s); one that
# computes, however busy the machine, gets far more than this share of a core.
STALL_WINDOW, STALL_CPU_SHARE = 1.0, 0.05


class HangWatch:
    """Tells stuck processes from slow ones (launch's ranks, lesson 13's fake-world child). Before `timeout`
    seconds nothing is stuck; after it, the pending ones (indices into `procs`, which have a `pid`) are stuck
    when none of them used CPU over the last STALL_WINDOW (all blocked: a hang) or one has used `timeout`
    CPU-seconds since the watch began (a runaway loop). One that computes on a loaded machine goes on, and
    so do those blocked in a collective a peer has just finished: a finished peer restarts the window."""

    def __init__(self, procs, timeout: float):
        self.procs, self.timeout = procs, timeout
        self.deadline = time.monotonic() + timeout
        self.started = [cpu_seconds(proc.pid) or 0.0 for proc in procs]
        self.pending = set(range(len(procs)))
        self.samples: collections.deque = collections.deque()  # (when, {rank: CPU-seconds}), STALL_WINDOW of them
        self.computing: dict[int, float] = {}  # when stuck: those that were computing, and their CPU-seconds

    def stuck(self, pending: list[int]) -> bool:
        now = time.monotonic()
        if now < self.deadline - STALL_WINDOW:
            return False
        if set(pending) != self.pending:  # one finished: progress, so the rest are watched afresh
            self.pending, self.samples = set(pending), collections.deque()
        cpu = {rank: cpu_seconds(self.procs[rank].pid) for rank in pending}
        self.samples.append((now, cpu))
        while len(self.samples) > 1 and now - self.samples[1][0] >= STALL_WINDOW:
            self.samples.popleft()
        then, before = self.samples[0]
        if now < self.deadline or now - then < STALL_WINDOW:
            return False
        if None in cpu.values():  # no CPU clock to read (a rank just exited, or no /proc): wall time decides
            return True
        busy = [rank for rank in pending if cpu[rank] - before.get(rank, cpu[rank]) > STALL_CPU_SHARE * (now - then)]
        self.computing = {rank: cpu[rank] - self.started[rank] for rank in busy}
        return not busy or any(used >= self.timeout for used in self.computing.values())


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system, all threads) a process has used; None for a process that is gone."""
    if not os.path.isdir("/proc/self"):  # macOS: ps tells, as [[dd-]hh:]mm:ss[.cc]
        return ps_cpu_seconds(pid)
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ps_cpu_seconds(pid: int) -> float | None:
    try:
        shown = subprocess.run(["ps", "-o", "time=", "-p", str(pid)], capture_output=True, text=True,
                               timeout=5).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    if not shown:
        return None
    days, _, clock = shown.rpartition("-")
    seconds = sum(float(part) * 60 ** i for i, part in enumerate(reversed(clock.split(":"))))
    return seconds + 86400 * int(days or 0)
