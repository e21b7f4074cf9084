"""Whose code `import zero_lab.<module>` loads: the course's reference or the learner's own.

    ZERO_LAB_IMPL=reference   (default) the modules generated from the solution notebooks
    ZERO_LAB_IMPL=mine        the learner's modules exported by `zero-lab mine` into
                              ZERO_LAB_MINE_DIR (default <repo>/mine/), where they exist

The variable is read once, when zero_lab is first imported (in Jupyter: before the kernel
starts, or before the first `import zero_lab`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHOICES = ("reference", "mine")


def mine_dir() -> Path:
    return Path(os.environ.get("ZERO_LAB_MINE_DIR") or REPO / "mine")


class LearnerModules:
    """Meta path finder: `zero_lab.<name>` from `<directory>/<name>.py` for the given names."""

    def __init__(self, directory: Path, names: set[str]):
        self.directory, self.names = directory, names

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package == "zero_lab" and name in self.names:
            return importlib.util.spec_from_file_location(fullname, self.directory / f"{name}.py")
        return None


def install() -> None:
    """Put the learner's modules in front of the package's if ZERO_LAB_IMPL says so."""
    choice = os.environ.get("ZERO_LAB_IMPL", "reference")
    if choice not in CHOICES:
        raise ImportError(
            f"ZERO_LAB_IMPL={choice!r} is not one of {CHOICES}: 'reference' uses the course's code, "
            f"'mine' your own modules exported with `zero-lab mine` (into {mine_dir()})."
        )
    if choice == "reference":
        return
    directory = mine_dir()
    names = {p.stem for p in directory.glob("*.py")}
    if not names:
        print(f"zero_lab: ZERO_LAB_IMPL=mine, but {directory} holds no modules "
              "(run `zero-lab mine course/<lesson>`); using the reference code.", file=sys.stderr)
        return
    sys.meta_path.insert(0, LearnerModules(directory, names))
    listed = ", ".join(f"zero_lab.{name}" for name in sorted(names))
    print(f"zero_lab: ZERO_LAB_IMPL=mine: {listed} from {directory}", file=sys.stderr)
