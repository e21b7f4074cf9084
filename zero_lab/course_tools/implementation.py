"""Whose code `import zero_lab.<module>` loads: the course's reference or the learner's own.

    ZERO_LAB_IMPL=reference   (default) the modules generated from the solution notebooks
    ZERO_LAB_IMPL=mine        the learner's own modules, where they exist: the `#| export`
                              cells of the notebooks in work/ (exported afresh to <repo>/mine/
                              each time zero_lab is imported), or, if ZERO_LAB_MINE_DIR is
                              set, the modules `zero-lab mine --to` wrote there

The variable is read once, when zero_lab is first imported (in Jupyter: before the kernel
starts, or before the first `import zero_lab`). In a notebook, the first import of a lesson
module prints whose implementation it is.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

from zero_lab.course_tools.export import PACKAGE, REPO, export_mine, is_generated, workspace_notebooks

CHOICES = ("reference", "mine")


def mine_dir() -> Path:
    return Path(os.environ.get("ZERO_LAB_MINE_DIR") or REPO / "mine")


def in_notebook() -> bool:
    ipython = sys.modules.get("IPython")
    return bool(ipython) and hasattr(ipython.get_ipython(), "kernel")


def is_lesson_module(path: Path) -> bool:
    return path.is_file() and is_generated(path)


class LessonModules:
    """Meta path finder for `zero_lab.<lesson module>`: the learner's file for the names in
    `mine` (from `directory`), the package's otherwise; in a notebook it says which, once."""

    def __init__(self, directory: Path | None = None, mine: set[str] = frozenset()):
        self.directory, self.mine, self.announced = directory, mine, set()
        self.pid = os.getpid()  # not in ranks forked from the notebook's kernel

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != "zero_lab" or not name.isidentifier():
            return None
        if name in self.mine:
            spec = importlib.util.spec_from_file_location(fullname, self.directory / f"{name}.py")
            whose = f"your implementation ({self.directory / name}.py)"
        else:
            spec = importlib.machinery.PathFinder.find_spec(fullname, [str(PACKAGE)])
            if spec is None or not is_lesson_module(Path(spec.origin)):
                return None
            whose = "the course's reference implementation"
        if in_notebook() and os.getpid() == self.pid and fullname not in self.announced:
            self.announced.add(fullname)
            print(f"{fullname}: {whose}", flush=True)
        return spec


def learner_modules() -> tuple[Path, set[str]]:
    """Where ZERO_LAB_IMPL=mine finds the learner's modules, exporting work/ first if needed."""
    if not os.environ.get("ZERO_LAB_MINE_DIR"):
        for notebook in workspace_notebooks(REPO):
            export_mine(notebook, mine_dir())
    directory = mine_dir()
    return directory, {p.stem for p in directory.glob("*.py")}


def install() -> None:
    """Put the lesson-module finder in front; with ZERO_LAB_IMPL=mine it serves the learner's."""
    choice = os.environ.get("ZERO_LAB_IMPL", "reference")
    if choice not in CHOICES:
        raise ImportError(
            f"ZERO_LAB_IMPL={choice!r} is not one of {CHOICES}: 'reference' uses the course's code, "
            f"'mine' your own (the notebooks in {REPO / 'work'}, see `zero-lab start`)."
        )
    if choice == "reference":
        sys.meta_path.insert(0, LessonModules())
        return
    directory, names = learner_modules()
    if not names:
        print(f"zero_lab: ZERO_LAB_IMPL=mine, but no module of yours was found (notebooks in "
              f"{REPO / 'work'}, see `zero-lab start`); using the reference code.", file=sys.stderr)
    else:
        listed = ", ".join(f"zero_lab.{name}" for name in sorted(names))
        print(f"zero_lab: ZERO_LAB_IMPL=mine: {listed} from {directory}", file=sys.stderr)
    sys.meta_path.insert(0, LessonModules(directory, names))
