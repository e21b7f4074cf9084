"""The learner's workspace: `work/<lesson>/`, a git-ignored copy of the release in course/.

`zero-lab start <lesson>` makes the copy once and never overwrites it. `--fresh` moves the old
copy aside (`work/<lesson>.backup-<time>/`) before copying again. The release a copy was made
from is remembered (`.release` in the copy, a hash of course/<lesson>/); when a newer release
arrives (a `git pull`), `start` says so and `--side-by-side` puts it next to the learner's
notebook in `work/<lesson>/release-<time>/`. Nothing else writes into work/.
"""

from __future__ import annotations

import hashlib
import platform
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from zero_lab.course_tools.export import COURSE_DIR, REPO, WORK_DIR, notebook_text, read_notebook
RELEASE_STAMP = ".release"


class WorkspaceError(Exception):
    pass


@dataclass
class Started:
    notebook: Path  # the notebook to open
    messages: list[str] = field(default_factory=list)


def lesson_name(name: str, repo: Path = REPO) -> str:
    """'00', '00_collectives', 'course/00_collectives' or 'work/00_collectives' -> '00_collectives'."""
    name = Path(name).name
    released = sorted(p.name for p in (repo / COURSE_DIR).glob("*") if p.is_dir())
    matches = [lesson for lesson in released if lesson == name or lesson.split("_")[0] == name]
    if len(matches) != 1:
        raise WorkspaceError(f"no lesson {name!r} in {COURSE_DIR}/; lessons: {', '.join(released) or 'none'}")
    return matches[0]


def workspace(repo: Path, lesson: str) -> Path:
    return repo / WORK_DIR / lesson


def release_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def timestamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def copy_release(release: Path, target: Path) -> None:
    shutil.copytree(release, target, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    (target / RELEASE_STAMP).write_text(release_hash(release) + "\n")
    for notebook in target.glob("*.ipynb"):
        # The kernel (this venv's Python) reports its version when the notebook opens; with it
        # already there, JupyterLab does not mark the learner's fresh copy as modified.
        nb = read_notebook(notebook)
        nb.metadata.setdefault("language_info", {})["version"] = platform.python_version()
        notebook.write_text(notebook_text(nb))


def start(name: str, repo: Path = REPO, fresh: bool = False, side_by_side: bool = False) -> Started:
    """Make (or find) the learner's copy of a lesson; never overwrite the learner's files."""
    lesson = lesson_name(name, repo)
    release = repo / COURSE_DIR / lesson
    target = workspace(repo, lesson)
    relative = target.relative_to(repo)
    notebook = target / f"{lesson}.ipynb"
    if fresh and target.exists():
        backup = target.with_name(f"{lesson}.backup-{timestamp()}")
        target.rename(backup)
        copy_release(release, target)
        return Started(notebook, [f"moved your copy to {backup.relative_to(repo)}/ and copied a fresh {relative}/"])
    if not target.exists():
        copy_release(release, target)
        return Started(notebook, [f"copied {COURSE_DIR}/{lesson}/ to {relative}/ (your copy: edit and grade this one)"])
    messages = [f"{relative}/ exists: opening your copy (unchanged)"]
    stamp = target / RELEASE_STAMP
    seen = stamp.read_text().strip() if stamp.exists() else None
    if seen != release_hash(release):
        if side_by_side:
            beside = target / f"release-{timestamp()}"
            copy_release(release, beside)
            stamp.write_text(release_hash(release) + "\n")
            messages.append(f"the new release of {lesson} is in {beside.relative_to(repo)}/; your notebook is untouched")
        else:
            messages.append(f"a newer release of {lesson} is in {COURSE_DIR}/{lesson}/ (your notebook is untouched): "
                            f"`zero-lab start {lesson} --side-by-side` copies it next to yours")
    return Started(notebook, messages)


def default_notebook(name: str, repo: Path = REPO) -> Path:
    """A path, or a lesson name meaning the learner's copy in work/ (for grade and mine)."""
    path = Path(name)
    if path.exists():
        return path
    lesson = lesson_name(name, repo)
    copy = workspace(repo, lesson)
    if not copy.exists():
        raise WorkspaceError(f"no copy of {lesson} in {WORK_DIR}/ yet: `zero-lab start {lesson}` makes one "
                             f"(or pass a path, e.g. {COURSE_DIR}/{lesson})")
    return copy

