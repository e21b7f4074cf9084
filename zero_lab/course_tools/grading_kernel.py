"""IPython startup file for the kernels of `nbgrader autograde` (installed by sandbox.confine).

In every autograde run (`zero-lab grade` and the instructor's own), before any learner code, it
imports zero_lab and installs the grading guard (grading_guard.py) for the lesson being graded:
the notebook's folder is the lesson's name, ZERO_LAB_COURSE_ROOT the course that holds its source.

Under `zero-lab grade` (ZERO_LAB_GRADE_STATE names a folder) it writes, per student, the cell
running now (`running-<student>`: count and source, emptied when the cell ends): the grader
shows progress from it and, if the kernel dies, knows which cell killed it. Cells whose hash is
listed in `skip-<student>` (killers of an earlier attempt) raise instead of running.
Otherwise self-contained: it runs before anything is imported in the kernel.
"""

import hashlib
import os
from pathlib import Path

KILLED = "zero-lab grade: this cell killed the kernel (os._exit, a crash or out of memory); it was skipped and the rest graded"


def cell_hash(source: str) -> str:
    return hashlib.sha256(source.strip().encode()).hexdigest()


def _install(shell, state: Path, student: str) -> None:
    running, skip_file = state / f"running-{student}", state / f"skip-{student}"
    skip = set(skip_file.read_text().split()) if skip_file.exists() else set()
    count = 0

    def write(text):
        partial = running.with_suffix(".partial")
        partial.write_text(text)
        partial.replace(running)

    def before(info):
        nonlocal count
        count += 1
        write(f"{count}\n{info.raw_cell}")

    def skip_killer(lines):
        if cell_hash("".join(lines)) in skip:
            return [f"raise RuntimeError({KILLED!r})\n"]
        return lines

    shell.events.register("pre_run_cell", before)
    shell.events.register("post_run_cell", lambda result: write(""))
    shell.input_transformers_cleanup.insert(0, skip_killer)


if os.environ.get("ZERO_LAB_GRADE_STATE") and "get_ipython" in globals():
    _install(get_ipython(), Path(os.environ["ZERO_LAB_GRADE_STATE"]), Path.cwd().parent.name)  # noqa: F821
if os.environ.get("ZERO_LAB_PERTURB_SUMS", "0").strip() not in ("", "0"):  # sums rounded as another CPU's (docs/troubleshooting.md)
    from zero_lab import perturb_sums

    perturb_sums.install()
    del perturb_sums
if os.environ.get("ZERO_LAB_COURSE_ROOT") and "get_ipython" in globals():
    from zero_lab.course_tools import grading_guard

    grading_guard.install(get_ipython(), Path.cwd().name, Path(os.environ["ZERO_LAB_COURSE_ROOT"]))  # noqa: F821
    del grading_guard
