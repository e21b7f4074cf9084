"""`zero-lab build`: lesson notebooks -> package modules, nbgrader metadata, learner edition.

The cell directives are described in docs/authoring.md and the design in docs/build.md.
`render` computes every generated file in memory (the learner edition through nbgrader in a
temporary course); `build` writes them, `check` compares them with the files on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbgrader.preprocessors import NbGraderPreprocessor

from zero_lab import stages
from zero_lab.course_tools import questions, where
from zero_lab.course_tools.export import (COURSE_DIR, GENERATED_PREFIX, PACKAGE_DIR, REPO, SOLUTION_MARKERS, SOURCE_DIR,
                                          BuildError, Directive, has_region, is_generated, module_sources,
                                          notebook_text, parse_directive, read_notebook, source_notebook)

CONFIG_NAME = "nbgrader_config.py"
FIX = "run `zero-lab build`"
# What the build last wrote (repo-relative path -> sha256), to tell its own files from edits.
MANIFEST = ".zero-lab/built.json"
STAGES_DOC = "docs/stages.md"  # the table of zero_lab/stages.py

FIRST_DEFINITION = re.compile(r"^(?:async\s+)?(?:def|class)\s+(\w+)", re.MULTILINE)
HIDDEN_MARKERS = ("BEGIN HIDDEN TESTS", "END HIDDEN TESTS")
# What nbgrader puts in place of a solution region: never a sign of a leak.
STUB_LINES = {"# YOUR CODE HERE", "raise NotImplementedError()"}
MIN_LEAK_LINE = 8  # shorter region lines ("pass", "else:") say nothing about a leak


def region_lines(source: str, markers: tuple[str, str]) -> list[str]:
    """The lines between the markers (exclusive)."""
    inside, lines = False, []
    for line in source.splitlines():
        if markers[0] in line:
            inside = True
        elif markers[1] in line:
            inside = False
        elif inside:
            lines.append(line)
    return lines


def grading_metadata(directive: Directive | None, source: str, where: str) -> dict | None:
    """The nbgrader metadata a cell's directive calls for (None: a plain cell)."""
    solution_region = has_region(source, SOLUTION_MARKERS)
    hidden_region = has_region(source, HIDDEN_MARKERS)
    kind = directive.kind if directive else None
    if solution_region and kind not in ("export", "solution"):
        raise BuildError(f"{where}: a BEGIN SOLUTION region needs a `#| export <module>` or `#| solution <id>` directive")
    if hidden_region and kind != "test":
        raise BuildError(f"{where}: BEGIN HIDDEN TESTS belongs in a `#| test <id> points=<N>` cell")
    if kind == "solution" and not solution_region:
        raise BuildError(f"{where}: a `#| solution` cell needs a ### BEGIN SOLUTION ... ### END SOLUTION region")
    base = {"schema_version": 3, "task": False}
    if kind == "test":
        return {**base, "grade": True, "solution": False, "locked": True,
                "grade_id": directive.name, "points": directive.points}
    if kind == "solution":
        return {**base, "grade": False, "solution": True, "locked": False, "grade_id": directive.name}
    if kind == "export" and solution_region:
        definition = FIRST_DEFINITION.search(source)
        if not definition:
            raise BuildError(f"{where}: an exported solution cell needs a def or class (its grade id is <module>-<name>)")
        grade_id = f"{directive.name}-{definition[1]}"
        return {**base, "grade": False, "solution": True, "locked": False, "grade_id": grade_id}
    return None


# Jupyter writes these when a notebook first opens: present from the start, the committed
# notebooks open unmodified.
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
LANGUAGE_INFO = {"codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py",
                 "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
                 "pygments_lexer": "ipython3"}
# JupyterLab's Run All goes on past an error in a cell with this tag.
RUN_ALL_CONTINUES = "raises-exception"


def grade_your_copy(lesson: str) -> nbformat.NotebookNode:
    """The learner edition's last cell: how to grade the learner's own copy (work/), not the release."""
    number = lesson.split("_")[0]
    return nbformat.v4.new_markdown_cell(
        "## Grade your work\n\n"
        f"Save this notebook, then in a terminal at the repository root run `.venv/bin/zero-lab grade {number}`.\n"
        f"It grades **your copy**, `work/{lesson}/{lesson}.ipynb`, with the visible and the hidden tests, and\n"
        f"says in one line why each lost point was lost. (`course/{lesson}/` is the untouched release: it scores 0.)",
        id="grade-your-copy")  # a fixed id: the build's output stays byte for byte reproducible


def learner_edition(nb: nbformat.NotebookNode, lesson: str) -> nbformat.NotebookNode:
    """Run All runs to the end: every code cell from the first exercise on may fail (an
    unfinished exercise raises NotImplementedError) without stopping the run. The last cell
    says how to grade the learner's copy."""
    nb.cells.append(grade_your_copy(lesson))
    exercise_seen = False
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        exercise_seen = exercise_seen or cell.metadata.get("nbgrader", {}).get("solution", False)
        tags = cell.metadata.get("tags", [])
        if exercise_seen and RUN_ALL_CONTINUES not in tags:
            cell.metadata["tags"] = [*tags, RUN_ALL_CONTINUES]
    return nb


class LearnerEdition(NbGraderPreprocessor):
    """`learner_edition` as the last step of `nbgrader generate_assignment` (nbgrader_config.py),
    so the instructor's nbgrader and `zero-lab build` write the same course/."""

    def preprocess(self, nb, resources):
        return learner_edition(nb, resources["nbgrader"]["assignment"]), resources


def annotate(nb: nbformat.NotebookNode, where: str) -> nbformat.NotebookNode:
    """A copy of a source notebook with nbgrader metadata from its directives, outputs cleared."""
    nb = nbformat.from_dict(nb)
    nb.metadata.kernelspec = dict(KERNELSPEC)
    nb.metadata.language_info = dict(LANGUAGE_INFO)
    seen: dict[str, int] = {}
    for index, cell in enumerate(nb.cells):
        cell_where = f"{where}, cell {index}"
        cell.metadata.pop("nbgrader", None)
        cell.metadata.pop("execution", None)  # Jupyter's per-cell timestamps
        if cell.cell_type != "code":
            continue
        cell.outputs, cell.execution_count = [], None
        meta = grading_metadata(parse_directive(cell.source, cell_where), cell.source, cell_where)
        if meta is None:
            continue
        grade_id = meta["grade_id"]
        if grade_id in seen:
            raise BuildError(f"{cell_where}: id {grade_id!r} is already used by cell {seen[grade_id]}")
        seen[grade_id] = index
        cell.metadata.nbgrader = meta
    return nb


def find_lessons(repo: Path, names: list[str] | None = None) -> list[str]:
    """The lessons in solutions/ (a folder NN_name holding NN_name.ipynb), or the named ones."""
    found = sorted(p.name for p in (repo / SOURCE_DIR).glob("*") if source_notebook(repo, p.name).is_file())
    if not names:
        return found
    lessons = [Path(name).name for name in names]  # also accepts solutions/NN_name or course/NN_name
    for lesson in lessons:
        if lesson not in found:
            raise BuildError(f"no lesson {lesson!r}: expected {SOURCE_DIR}/{lesson}/{lesson}.ipynb")
    return lessons


def nbgrader_env(course_root: Path, **extra: str) -> dict[str, str]:
    """The environment of nbgrader in a throwaway course folder, `extra` added. Its temporary files (the
    alembic.ini folders of the gradebook, its kernels' sockets) go inside the course: removed with it, also
    when nbgrader is killed before it could remove them."""
    tmp = course_root / ".tmp"
    tmp.mkdir(exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmp), **extra)
    # nbgrader calls the `alembic` script of its own environment.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def run_nbgrader(course_root: Path, *args: str, timeout: float | None = None) -> None:
    """Run an nbgrader command in a throwaway course folder; raise BuildError with its log on failure."""
    try:
        # On timeout nbgrader is killed; its kernel notices its parent is gone and exits, and
        # the kernel's ranks die with the kernel.
        result = subprocess.run(
            [sys.executable, "-m", "nbgrader", *args], cwd=course_root, env=nbgrader_env(course_root),
            capture_output=True, text=True, timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise BuildError(f"`nbgrader {' '.join(args)}` did not finish within {timeout:g} s") from None
    if result.returncode != 0:
        raise BuildError(f"`nbgrader {' '.join(args)}` failed:\n{result.stdout}{result.stderr}")


def make_course(root: Path, repo: Path, sources: dict[str, nbformat.NotebookNode]) -> None:
    """A throwaway nbgrader course in `root` with these annotated lesson sources."""
    shutil.copy(REPO / CONFIG_NAME, root / CONFIG_NAME)
    for lesson, nb in sources.items():
        ignore = shutil.ignore_patterns(f"{lesson}.ipynb", ".ipynb_checkpoints", "__pycache__")
        shutil.copytree(repo / SOURCE_DIR / lesson, root / SOURCE_DIR / lesson, ignore=ignore)
        (root / SOURCE_DIR / lesson / f"{lesson}.ipynb").write_text(notebook_text(nb))


@dataclass
class Rendered:
    sources: dict[str, nbformat.NotebookNode]  # lesson -> annotated source notebook
    files: dict[str, bytes]  # repo-relative path -> content, for every generated file


def annotated_sources(repo: Path, lessons: list[str]) -> dict[str, nbformat.NotebookNode]:
    return {
        lesson: annotate(read_notebook(source_notebook(repo, lesson)), f"{SOURCE_DIR}/{lesson}/{lesson}.ipynb")
        for lesson in lessons
    }


def render(repo: Path, lessons: list[str]) -> Rendered:
    sources = annotated_sources(repo, lessons)
    files: dict[str, bytes] = {}
    exporters: dict[str, str] = {}
    # Every lesson, not only those being built: a module has exactly one source notebook.
    for lesson in find_lessons(repo):
        origin = f"{SOURCE_DIR}/{lesson}/{lesson}.ipynb"
        nb = sources.get(lesson) or read_notebook(repo / origin)
        banner = f"{GENERATED_PREFIX}{origin} by `zero-lab build`: edit the notebook, not this file."
        for module, code in module_sources(nb, banner, origin).items():
            if module in exporters:
                raise BuildError(f"module {module!r} is exported by both {exporters[module]} and {origin}")
            exporters[module] = origin
            target = repo / PACKAGE_DIR / f"{module}.py"
            if target.exists() and not is_generated(target):
                raise BuildError(f"{origin} exports {module!r}, but {PACKAGE_DIR}/{module}.py is hand-written")
            if lesson in sources:
                files[f"{PACKAGE_DIR}/{module}.py"] = code.encode()
    lesson_of = {module: origin.split("/")[1] for module, origin in exporters.items()}
    for lesson, nb in sources.items():
        where.refresh(nb, lesson, lesson_of, repo / PACKAGE_DIR)  # before the learner edition is made from it
    with tempfile.TemporaryDirectory(prefix="zero-lab-build-") as tmp:
        root = Path(tmp)
        make_course(root, repo, sources)
        run_nbgrader(root, "generate_assignment", "*", "--force", "--no-db")
        for path in sorted((root / COURSE_DIR).rglob("*")):
            if path.is_file():
                relative = path.relative_to(root).as_posix()
                files[relative] = notebook_text(read_notebook(path)).encode() if path.suffix == ".ipynb" else path.read_bytes()
    files.update(questions.generated_files(repo))  # docs/questions.md, the index of lesson 08
    files[STAGES_DOC] = stages.markdown().encode()
    return Rendered(sources, files)


def stale_files(repo: Path, rendered: Rendered, all_lessons: bool) -> list[Path]:
    """Generated files no lesson produces any more (only known when building every lesson)."""
    if not all_lessons:
        return []
    stale = [p for p in sorted((repo / PACKAGE_DIR).glob("*.py"))
             if is_generated(p) and f"{PACKAGE_DIR}/{p.name}" not in rendered.files]
    stale += [p for p in sorted((repo / COURSE_DIR).glob("*")) if p.is_dir() and p.name not in rendered.sources]
    return stale


def sha256(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


def read_manifest(repo: Path) -> dict[str, str]:
    path = repo / MANIFEST
    return json.loads(path.read_text()) if path.exists() else {}


def write_manifest(repo: Path, written: dict[str, bytes]) -> None:
    path = repo / MANIFEST
    path.parent.mkdir(exist_ok=True)
    entries = {**read_manifest(repo), **{relative: sha256(content) for relative, content in written.items()}}
    path.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")


def uncommitted(repo: Path) -> set[str] | None:
    """Repo-relative paths under course/ with uncommitted changes (None: not a git checkout)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    prefix = git("rev-parse", "--show-prefix")
    if prefix.returncode != 0 or prefix.stdout.strip():
        return None
    status = git("status", "--porcelain=v1", "-z", "--untracked-files=all", "--", COURSE_DIR).stdout
    return {entry[3:] for entry in status.split("\0") if len(entry) > 3}


def edited_by_hand(repo: Path, replaced: dict[str, bytes | None]) -> list[str]:
    """Files about to be replaced (or removed: None) that hold edits the build did not make."""
    built, dirty = read_manifest(repo), None
    problems = []
    for relative, content in sorted(replaced.items()):
        path = repo / relative
        if not path.is_file() or path.read_bytes() == content or built.get(relative) == sha256(path.read_bytes()):
            continue
        if dirty is None:
            dirty = uncommitted(repo)
        if dirty is not None and relative not in dirty:
            continue  # as committed: what a build wrote
        lesson = Path(relative).parts[1]
        problems.append(
            f"{relative}: not overwritten, it has edits `zero-lab build` did not make (answers? learners "
            f"work in their own copy: `zero-lab start {lesson}`). Save what you need, then "
            f"`git checkout -- {relative}` (or delete it) and build again.")
    return problems


def build(repo: Path = REPO, names: list[str] | None = None) -> list[str]:
    """Write every generated file; return the repo-relative paths that changed.

    Refuses (BuildError, nothing written) when a course/ file it would replace or remove was
    edited: it differs both from what the build last wrote and from the committed version."""
    lessons = find_lessons(repo, names)
    rendered = render(repo, lessons)
    stale = stale_files(repo, rendered, all_lessons=not names)
    for lesson, nb in rendered.sources.items():
        rendered.files[f"{SOURCE_DIR}/{lesson}/{lesson}.ipynb"] = notebook_text(nb).encode()
    removed = [p for path in stale for p in ([path] if path.is_file() else sorted(path.rglob("*")))]
    removed += [path for lesson in lessons for path in sorted((repo / COURSE_DIR / lesson).rglob("*"))
                if path.relative_to(repo).as_posix() not in rendered.files]  # nbgrader's output replaces the folder
    removed = [path for path in removed if path.is_file()]
    replaced = {path.relative_to(repo).as_posix(): None for path in removed}
    replaced.update(rendered.files)
    replaced = {relative: content for relative, content in replaced.items() if relative.startswith(COURSE_DIR + "/")}
    if problems := edited_by_hand(repo, replaced):
        raise BuildError("\n".join(problems))
    changed = []
    for path in removed:
        path.unlink()
        changed.append(f"{path.relative_to(repo).as_posix()} (removed)")
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path)
    for relative, content in rendered.files.items():
        path = repo / relative
        if not path.exists() or path.read_bytes() != content:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
            changed.append(relative)
    write_manifest(repo, rendered.files)
    return changed


def has_outputs(nb: nbformat.NotebookNode) -> bool:
    return any(c.cell_type == "code" and (c.outputs or c.execution_count is not None) for c in nb.cells)


def secret_lines(nb: nbformat.NotebookNode) -> set[str]:
    """Lines of solution and hidden-test regions that appear nowhere else in the notebook."""
    secret, public = set(), set()
    for cell in nb.cells:
        inside = region_lines(cell.source, SOLUTION_MARKERS) + region_lines(cell.source, HIDDEN_MARKERS)
        secret.update(line.strip() for line in inside)
        public.update(line.strip() for line in cell.source.splitlines() if line not in inside)
    return {line for line in secret - public - STUB_LINES if len(line) >= MIN_LEAK_LINE}


def leaks(repo: Path, sources: dict[str, nbformat.NotebookNode]) -> list[str]:
    """Solution or hidden-test text that reached course/."""
    problems = []
    for path in sorted((repo / COURSE_DIR).rglob("*")):
        if not path.is_file():
            continue
        relative = path.relative_to(repo).as_posix()
        text = path.read_text(errors="ignore")
        if path.suffix == ".ipynb":
            text = "\n".join(cell.source for cell in read_notebook(path).cells)
        for marker in SOLUTION_MARKERS + HIDDEN_MARKERS:
            if marker in text:
                problems.append(f"{relative}: contains {marker!r}; {FIX}")
        lesson = path.relative_to(repo / COURSE_DIR).parts[0]
        lines = {line.strip() for line in text.splitlines()}
        for line in sorted(secret_lines(sources[lesson]) & lines if lesson in sources else []):
            problems.append(f"{relative}: contains reference solution or hidden test code {line!r}; {FIX}")
    return problems


def check(repo: Path = REPO, names: list[str] | None = None) -> list[str]:
    """Everything `build` would change or that must not be committed, as messages."""
    lessons = find_lessons(repo, names)
    rendered = render(repo, lessons)
    problems = []
    for lesson, expected in rendered.sources.items():
        relative = f"{SOURCE_DIR}/{lesson}/{lesson}.ipynb"
        on_disk = read_notebook(repo / relative)
        if has_outputs(on_disk):
            problems.append(f"{relative}: has outputs or execution counts; {FIX} (it clears them)")
        if where.current(on_disk) != where.current(expected):
            problems.append(f"{relative}: its first code cell, \"where this lesson's code lives\", is missing or "
                            f"out of date; {FIX}")
            continue  # a missing cell shifts the others
        for index, (cell, want) in enumerate(zip(on_disk.cells, expected.cells)):
            if cell.metadata.get("nbgrader") != want.metadata.get("nbgrader"):
                problems.append(f"{relative}, cell {index}: nbgrader metadata does not match its directive; {FIX}")
    for path in sorted((repo / COURSE_DIR).rglob("*.ipynb")):
        if has_outputs(read_notebook(path)):
            problems.append(f"{path.relative_to(repo).as_posix()}: has outputs or execution counts; {FIX}")
    for relative, content in rendered.files.items():
        path = repo / relative
        if not path.exists():
            problems.append(f"{relative}: missing; {FIX}")
        elif path.read_bytes() != content:
            problems.append(f"{relative}: differs from what the notebooks give; {FIX} (edit the notebook, not this file)")
    for lesson in lessons:
        for path in sorted((repo / COURSE_DIR / lesson).rglob("*")):
            if path.is_file() and path.relative_to(repo).as_posix() not in rendered.files:
                problems.append(f"{path.relative_to(repo).as_posix()}: not generated by any lesson; {FIX}")
    for path in stale_files(repo, rendered, all_lessons=not names):
        problems.append(f"{path.relative_to(repo).as_posix()}: no lesson generates it any more; {FIX}")
    return problems + leaks(repo, rendered.sources)
