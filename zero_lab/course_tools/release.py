"""`zero-lab release --student DIR`: the course for a closed assignment, without the answers.

What git tracks in the repository, less solutions/ (reference solutions, hidden tests), tests/
(they run the reference) and the zero_lab/ modules the lessons generate (the reference code),
but for those of the lessons before `keep_modules_before`, which a graded lesson builds on.
Learners of such a release run later lessons on their own code (ZERO_LAB_IMPL=mine); the
instructor grades in their own checkout, where solutions/ holds the hidden tests.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from zero_lab.course_tools import build
from zero_lab.course_tools.export import exporting_lesson

LEFT_OUT = (build.SOURCE_DIR + "/", "tests/", ".zero-lab/")


class ReleaseError(Exception):
    pass


def tracked_files(repo: Path) -> list[str]:
    listed = subprocess.run(["git", "-C", str(repo), "ls-files", "-z"], capture_output=True, text=True)
    if listed.returncode != 0:
        raise ReleaseError(f"{repo} is not a git checkout: a release copies what git tracks")
    return [path for path in listed.stdout.split("\0") if path]


def student_release(repo: Path, destination: Path, keep_modules_before: str | None = None) -> list[str]:
    """Write the student release into `destination` (new or empty); return the files left out."""
    if keep_modules_before is not None:
        build.find_lessons(repo, [keep_modules_before])  # a lesson that exists
    if destination.exists() and any(destination.iterdir()):
        raise ReleaseError(f"{destination} is not empty: give a new folder (nothing there is overwritten)")
    left_out = []
    for relative in tracked_files(repo):
        source = repo / relative
        if not source.is_file():
            continue
        lesson = exporting_lesson(source) if relative.startswith(build.PACKAGE_DIR + "/") and relative.endswith(".py") else None
        if relative.startswith(LEFT_OUT) or lesson and not (keep_modules_before and lesson < keep_modules_before):
            left_out.append(relative)
            continue
        target = destination / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    return left_out
