"""The "where this lives" cell: each lesson's first code cell, written by `zero-lab build`.

It says which modules the lesson's `#| export` cells become, which modules of earlier lessons
and of the lab bench its code uses, and which `zero_lab.prepare` arguments reach its code (from
zero_lab/stages.py), then prints where `zero_lab.launch` puts the lesson's ranks (on the CPU, or
sharing this machine's GPUs). `zero-lab build` writes it (before the first code cell, in a lesson
that has none yet); `zero-lab build --check` fails when it is stale.
"""

from __future__ import annotations

import re
import textwrap
from collections import Counter
from pathlib import Path

import zero_lab
from zero_lab import stages
from zero_lab.course_tools.export import is_generated, module_sources

CELL_ID = "where-this-lives"
TITLE = "# Where this lesson's code lives (written by `zero-lab build` from the notebook and zero_lab/stages.py)"
IMPORTED = re.compile(r"^\s*(?:from\s+zero_lab\.(\w+)\s+import|import\s+zero_lab\.(\w+)|from\s+zero_lab\s+import\s+(.+))",
                      re.MULTILINE)
TOP_LEVEL_USE = re.compile(r"\bzero_lab\.(\w+)")  # zero_lab.launch(...): zero_lab.launcher
WORLD_SIZE = re.compile(r"\blaunch(?:_restored)?\(\s*\w+\s*,\s*(\d+)")  # launch(fn, 4, ...)
WIDTH = 100


def modules_used(nb) -> set[str]:
    """zero_lab modules the notebook's code cells use (the exported cells' imports included)."""
    used = set()
    for cell in nb.cells:
        if cell.cell_type != "code" or is_where_cell(cell):
            continue
        for module, dotted, names in IMPORTED.findall(cell.source):
            used.update(filter(None, (module, dotted)))
            used.update(name.split(" as ")[0].strip(" ()") for name in names.split(","))
        used.update(TOP_LEVEL_USE.findall(cell.source))
    return {zero_lab.TOP_LEVEL[name].rpartition(".")[2] if name in zero_lab.TOP_LEVEL else name for name in used}


def cell_source(nb, lesson: str, exporters: dict[str, str], package: Path) -> str:
    """The cell's text. exporters: {module: the lesson that exports it}, for every lesson;
    package: the zero_lab folder, whose hand-written modules are the lab bench."""
    exports = sorted(module_sources(nb, "", lesson))
    used = modules_used(nb) - set(exports)
    earlier = sorted(m for m in used if m in exporters and exporters[m] < lesson)
    bench = sorted(m for m in used if m not in exporters and (package / f"{m}.py").is_file()
                   and not is_generated(package / f"{m}.py"))
    rows = [("exports", ", ".join(f"zero_lab.{m}" for m in exports) + " (your `#| export` cells; "
             "ZERO_LAB_IMPL=mine imports yours)" if exports else "nothing: this lesson adds no module"),
            ("uses, earlier", ", ".join(f"zero_lab.{m} ({exporters[m]})" for m in earlier) or "no earlier lesson's module"),
            ("uses, lab bench", ", ".join(f"zero_lab.{m}" for m in bench) or "nothing"),
            *(("" if index else "prepare reaches", entry) for index, entry in enumerate(
                stages.prepare_arguments(lesson) or ["nothing here: no stage of zero_lab.prepare is built from this lesson"]))]
    ranks = ranks_launched(nb)
    if ranks:
        rows.append(("ranks", f"zero_lab.launch(fn, {ranks}) runs {ranks} processes: on the CPU, or on this machine's "
                     "GPUs, shared over gloo when there are more ranks than GPUs (ZERO_LAB_DEVICE=cpu|cuda chooses). "
                     "The exercises' tensors stay where their cells make them, on the CPU; GPU cells put theirs on "
                     "zero_lab.rank_device()"))
    lines = [TITLE]
    for name, text in rows:
        lines += textwrap.wrap(text, WIDTH, initial_indent=f"# {name:<16} ", subsequent_indent="#" + " " * 18,
                               break_on_hyphens=False)
    if ranks:
        lines += ["import zero_lab", "", f"print(zero_lab.placement({ranks}))"]
    return "\n".join(lines)


def ranks_launched(nb) -> int | None:
    """The world size the lesson launches most often (2 if none is written out; None: it launches nothing)."""
    sources = [cell.source for cell in nb.cells if cell.cell_type == "code" and not is_where_cell(cell)]
    sizes = Counter(int(n) for source in sources for n in WORLD_SIZE.findall(source))
    if sizes:
        return max(sizes, key=lambda n: (sizes[n], n))
    return 2 if any(re.search(r"\blaunch(?:_restored)?\(", source) for source in sources) else None


def is_where_cell(cell) -> bool:
    return cell.cell_type == "code" and cell.source.startswith(TITLE)


def current(nb) -> str | None:
    return next((cell.source for cell in nb.cells if is_where_cell(cell)), None)


def refresh(nb, lesson: str, exporters: dict[str, str], package: Path) -> None:
    """Write the cell into `nb`: in place, or before the first code cell if it has none yet."""
    source = cell_source(nb, lesson, exporters, package)
    for cell in nb.cells:
        if is_where_cell(cell):
            cell.source = source
            return
    import nbformat  # only a lesson without the cell needs a new one

    first_code = next((i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"), len(nb.cells))
    nb.cells.insert(first_code, nbformat.v4.new_code_cell(source, id=CELL_ID))

