"""What the course tools share: where the course's files are, and the `#| export` step.

Build, workspace, questions, grading and the implementation switch import this module; it
imports none of them (and nothing heavy: `import zero_lab` goes through it). The directives are
described in docs/authoring.md:

    module_sources(nb, banner, where)   # {module: code} of a notebook's `#| export` cells
    export_mine(notebook, directory)     # a learner's notebook -> directory/<module>.py
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]
PACKAGE = Path(__file__).resolve().parents[1]
SOURCE_DIR, COURSE_DIR, PACKAGE_DIR, WORK_DIR = "solutions", "course", "zero_lab", "work"
GENERATED_PREFIX = "# Generated from "

DIRECTIVE = re.compile(r"#\|\s*(\w+)\s*(.*)")
TEST_ARGS = re.compile(r"(?P<id>[\w-]+)\s+points=(?P<points>\d+(?:\.\d+)?)")
ID = re.compile(r"[\w-]+")
MODULE = re.compile(r"[a-z_][a-z0-9_]*")
# nbgrader recognises a delimiter anywhere in a line, so do we.
SOLUTION_MARKERS = ("BEGIN SOLUTION", "END SOLUTION")


class BuildError(Exception):
    """A lesson cannot be built, or (with --check) the generated files are out of date."""


@dataclass(frozen=True)
class Directive:
    kind: str  # "export", "solution" or "test"
    name: str  # the module for export, else the cell's grade id
    points: float | None = None


def parse_directive(source: str, where: str) -> Directive | None:
    """The directive on the first line of a code cell, if any."""
    first_line = source.lstrip("\n").split("\n", 1)[0].strip()
    match = DIRECTIVE.fullmatch(first_line)
    if not match:
        return None
    kind, args = match[1], match[2].strip()
    if kind == "export" and MODULE.fullmatch(args):
        return Directive(kind, args)
    if kind == "solution" and ID.fullmatch(args):
        return Directive(kind, args)
    if kind == "test" and (test := TEST_ARGS.fullmatch(args)):
        points = float(test["points"])
        return Directive(kind, test["id"], int(points) if points.is_integer() else points)
    usage = {"export": "#| export <module>", "solution": "#| solution <id>", "test": "#| test <id> points=<N>"}
    if kind in usage:
        raise BuildError(f"{where}: malformed directive {first_line!r}; expected {usage[kind]!r}")
    raise BuildError(f"{where}: unknown directive {first_line!r}; known: {', '.join(usage.values())}")


def has_region(source: str, markers: tuple[str, str]) -> bool:
    return any(markers[0] in line for line in source.splitlines())


def is_demo(cell) -> bool:
    """A cell no test needs: tagged `demo`, or an interview answer (`seed:<id>`, `q:<id>`)."""
    tags = cell.metadata.get("tags", [])
    return cell.cell_type == "code" and any(t == "demo" or t.startswith(("seed:", "q:")) for t in tags)


def is_generated(module_file: Path) -> bool:
    with open(module_file) as f:
        return f.readline().startswith(GENERATED_PREFIX)


def exporting_lesson(module_file: Path) -> str | None:
    """The lesson whose notebook generated this module of zero_lab (None: a hand-written one)."""
    with open(module_file) as f:
        first_line = f.readline()
    if not first_line.startswith(GENERATED_PREFIX):
        return None
    return Path(first_line[len(GENERATED_PREFIX):].split()[0]).parent.name


def source_notebook(repo: Path, lesson: str) -> Path:
    return repo / SOURCE_DIR / lesson / f"{lesson}.ipynb"


def read_notebook(path: Path):
    import nbformat  # here, not at the top: `import zero_lab` needs this module, not nbformat

    return nbformat.read(path, as_version=4)


def read_cells(path: Path) -> list[SimpleNamespace]:
    """The cells (cell_type, source, metadata) of a notebook the build wrote, read as plain JSON:
    each grading kernel reads its lesson's source at start-up, and importing nbformat there would
    cost it about 2 s of CPU (jsonschema's format checkers)."""
    with open(path) as f:
        cells = json.load(f)["cells"]
    return [SimpleNamespace(cell_type=c["cell_type"], metadata=c.get("metadata", {}),
                            source=c["source"] if isinstance(c["source"], str) else "".join(c["source"]))
            for c in cells]


def notebook_text(nb) -> str:
    """The one JSON form every notebook the build writes has."""
    import nbformat

    return nbformat.writes(nb).rstrip("\n") + "\n"


def module_sources(nb, banner: str, where: str) -> dict[str, str]:
    """{module: code} from the `#| export` cells, directive and solution markers removed."""
    cells: dict[str, list[str]] = {}
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        directive = parse_directive(cell.source, f"{where}, cell {index}")
        if directive and directive.kind == "export":
            lines = cell.source.lstrip("\n").splitlines()[1:]
            code = "\n".join(line for line in lines if not any(m in line for m in SOLUTION_MARKERS))
            cells.setdefault(directive.name, []).append(code.strip("\n"))
    return {module: f"{banner}\n\n" + "\n\n\n".join(parts) + "\n" for module, parts in cells.items()}


def export_mine(notebook: Path, directory: Path) -> list[Path]:
    """Write a learner notebook's `#| export` cells to `directory`/<module>.py (ZERO_LAB_IMPL=mine)."""
    banner = f"# Exported from your {notebook.name} by `zero-lab mine`: ZERO_LAB_IMPL=mine imports it."
    modules = module_sources(read_notebook(notebook), banner, str(notebook))
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for module, code in modules.items():
        path = directory / f"{module}.py"
        path.write_text(code)
        written.append(path)
    return written


def workspace_notebooks(repo: Path = REPO) -> list[Path]:
    """The learner's lesson notebooks in work/, in lesson order."""
    return sorted(p for p in (repo / WORK_DIR).glob("*/*.ipynb") if p.stem == p.parent.name)
