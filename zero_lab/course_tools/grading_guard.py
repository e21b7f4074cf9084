"""What keeps a grade the learner's own, in the kernel that grades a lesson.

grading_kernel.py installs it in both grading routes (`zero-lab grade` and the instructor's
`nbgrader autograde`), before any learner code runs, for whichever lesson is graded (the
notebook's folder names it; its source in solutions/ says what it exports and what is graded):

- The modules the lesson exports are the notebook: `import zero_lab.zero3` gives a module whose
  names are the notebook's own definitions, so `prepare` and later lessons' code run the learner's
  code, and `from zero_lab.zero3 import gather_unit` before gather_unit is written fails with
  "zero_lab.zero3.gather_unit is what this lesson builds: write it here". Earlier lessons'
  modules stay the reference.
- Every `zero_lab.launch` is `launch_restored`: in each rank, torch, torch.distributed, c10d and
  every zero_lab module (the ledgers among them) are back as they were before the notebook ran.
- Before each test cell (`#| test <id>`), the same is put back in the kernel, with the names the
  lesson's own import lines bind and those earlier test cells defined; then every exercise the
  test uses (a def or class of a solution cell of the source) must be written in the notebook:
  code compiled from one of its cells, that reaches no reference code (the lesson's modules in
  zero_lab/, solutions/, code exec'd from text) and, for a class, no subclass of the reference or
  one that adds nothing to a zero_lab class. Otherwise the test cell only defines its helpers
  (later tests use them) and fails with NotWrittenHere and one line saying why.

In-process grading cannot stop everything: code can still undo all of this from inside a
call a test makes. That, and copying the published solution text, is for the instructor
(docs/authoring.md, "What grading can and cannot prove").
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.abc
import importlib.util
import os
import re
import sys
import types
from pathlib import Path

from zero_lab import launcher
# Not build, grading or nbformat: each grading kernel imports this module at start-up.
from zero_lab.course_tools.export import (SOLUTION_MARKERS, SOURCE_DIR, Directive, exporting_lesson, has_region, is_demo,
                                          parse_directive, read_cells, source_notebook)
from zero_lab.course_tools.implementation import PACKAGE, REPO

TEST_CELL = re.compile(r"\s*#\|\s*test\s")
MAX_WRAPPERS = 20  # decorators stacked on one exercise (torch.no_grad, functools.wraps, ...)


class NotWrittenHere(Exception):
    """An exercise a test uses is not the learner's own code (the test earns nothing)."""


class NotebookModule(types.ModuleType):
    """A module of the graded lesson: its names are the notebook's own definitions."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        namespace = self.__dict__["__notebook__"]
        if name in namespace:
            return namespace[name]
        # ImportError, not AttributeError: `from m import x` would replace the message by its own.
        raise ImportError(f"{self.__name__}.{name} is what this lesson builds: write it here, in this notebook")


class NotebookModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Meta path finder that answers `import zero_lab.<module>` for the graded lesson's modules."""

    def __init__(self, names: set[str], namespace: dict):
        self.names, self.namespace = names, namespace

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self, origin="the graded notebook") if fullname in self.names else None

    def create_module(self, spec):
        module = NotebookModule(spec.name)
        module.__notebook__ = self.namespace
        return module

    def exec_module(self, module):
        pass


def directives(cells, kind: str) -> list[tuple[object, Directive]]:
    found = []
    for index, cell in enumerate(cells):
        if cell.cell_type == "code":
            directive = parse_directive(cell.source, f"cell {index}")
            if directive and directive.kind == kind:
                found.append((cell, directive))
    return found


def parsed(source: str) -> ast.Module:
    try:
        return ast.parse(source)
    except SyntaxError:
        return ast.Module(body=[], type_ignores=[])


def exercises(cells) -> set[str]:
    """The defs and classes of the cells holding a solution region: what learners write."""
    names = set()
    for cell in cells:
        if cell.cell_type == "code" and has_region(cell.source, SOLUTION_MARKERS):
            names.update(node.name for node in parsed(cell.source).body
                         if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))
    return names


def lesson_imports(cells, own_modules: set[str], exercise_names: set[str]) -> list[types.CodeType]:
    """The import lines of the lesson's cells (not tests, not demos, not of its own modules),
    compiled: run before each test cell, they bind `dist`, `zero_lab`, ... to the real ones."""
    statements = []  # one code object each: an import that fails leaves the others to run
    for cell in cells:
        if cell.cell_type != "code" or is_demo(cell) or TEST_CELL.match(cell.source):
            continue
        for node in parsed(cell.source).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module != "__future__" \
                    and node.module not in own_modules:
                node.names = [alias for alias in node.names if (alias.asname or alias.name) not in exercise_names]
                statements += [node] if node.names else []
            elif isinstance(node, ast.Import):
                statements.append(node)
    return [compile(ast.Module(body=[node], type_ignores=[]), "<the lesson's imports>", "exec") for node in statements]


def definitions_only(source: str) -> str:
    """A test cell's defs, classes, imports and plain assignments, without what it runs."""
    kept = [node for node in parsed(source).body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom))
            or isinstance(node, (ast.Assign, ast.AnnAssign)) and not any(isinstance(n, ast.Call) for n in ast.walk(node))]
    return ast.unparse(ast.Module(body=kept, type_ignores=[]))


def defined_names(source: str) -> set[str]:
    names = set()
    for node in parsed(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def used_names(source: str) -> set[str]:
    return {node.id for node in ast.walk(parsed(source)) if isinstance(node, ast.Name)}


def code_objects(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from code_objects(const)


def wrapper_chain(obj) -> list:
    """obj, then what it wraps (`__wrapped__`, set by functools.wraps and torch.no_grad), innermost last."""
    chain = [obj]
    while hasattr(chain[-1], "__wrapped__") and len(chain) < MAX_WRAPPERS:
        chain.append(chain[-1].__wrapped__)
    return chain


def starts_at(text: str, code: types.CodeType) -> bool:
    """Whether the def (or lambda) of `code` is where `code` says it starts in `text`."""
    for line in text.splitlines()[code.co_firstlineno - 1:]:
        line = line.strip()
        if line.startswith("@"):  # decorators come first
            continue
        if code.co_name == "<lambda>":
            return "lambda" in line
        return re.match(rf"(async\s+)?def\s+{re.escape(code.co_name)}\b", line) is not None
    return False


def own_functions(cls: type) -> dict[str, types.FunctionType]:
    """The functions a class body defines (methods, static and class methods, properties)."""
    found = {}
    for name, value in vars(cls).items():
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            value = value.fget
        value = wrapper_chain(value)[-1]
        if isinstance(value, types.FunctionType):
            found[name] = value
    return found


class Guard:
    """The grading guard of one lesson in one kernel (see the module's docstring)."""

    def __init__(self, shell, lesson: str, source: Path):
        cells = read_cells(source)
        self.shell, self.namespace = shell, shell.user_ns
        self.modules = {f"zero_lab.{d.name}" for _, d in directives(cells, "export")}
        self.exercises = exercises(cells)
        self.imports = lesson_imports(cells, self.modules, self.exercises)
        self.reference_files = {os.path.realpath(PACKAGE / f"{name.rpartition('.')[2]}.py") for name in self.modules}
        # The source notebooks of the graded course and of the repository zero_lab comes from.
        self.solutions = tuple({os.path.realpath(folder) + os.sep for folder in (source.parents[1], REPO / SOURCE_DIR)})
        self.cells: dict[str, str] = {}  # file name IPython compiled a cell under -> its code
        self.files: dict[str, str] = {}  # any other file name -> where()
        self.test_definitions: dict[str, tuple] = {}  # name -> (object, its __code__ if a function)
        self.finder = NotebookModules(self.modules, self.namespace)
        self.lesson = lesson

    # -- what runs where -------------------------------------------------------------------
    def install(self) -> None:
        # The modules earlier lessons export, loaded now: their state is part of the snapshot.
        for module in sorted(PACKAGE.glob("*.py")):
            name, lesson = f"zero_lab.{module.stem}", exporting_lesson(module)
            if lesson and lesson < self.lesson and name not in self.modules:
                try:
                    importlib.import_module(name)
                except Exception as error:  # the notebook will say so where it imports it
                    print(f"zero-lab grading: {name} does not import ({error})", file=sys.stderr)
        importlib.import_module("torch._dynamo")  # patches torch when first imported: before the snapshot
        self.put_back_modules()
        launcher.retake_snapshot()
        launcher.restore_always = True
        self.sys_modules = dict(sys.modules)
        compile_cell = self.shell.compile.cache

        def cache(transformed_code, number=0, raw_code=None):
            name = compile_cell(transformed_code, number, raw_code)
            self.cells[name] = transformed_code
            return name

        self.shell.compile.cache = cache
        self.shell.input_transformers_cleanup.append(self.transform)
        self.shell.events.register("post_run_cell", self.after_cell)

    def put_back_modules(self) -> None:
        """The lesson's modules are the notebook, whatever a cell put in sys.modules or sys.meta_path."""
        if self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)
        sys.meta_path.insert(0, self.finder)
        package = sys.modules["zero_lab"]
        for name in self.modules:
            if name in sys.modules and not isinstance(sys.modules[name], NotebookModule):
                del sys.modules[name]
            attribute = name.rpartition(".")[2]
            if attribute in vars(package) and not isinstance(vars(package)[attribute], NotebookModule):
                delattr(package, attribute)

    def restore(self) -> None:
        """Before a test cell: everything a notebook may have patched, back as graded code needs it."""
        for name, module in self.sys_modules.items():
            if sys.modules.get(name) is not module:
                sys.modules[name] = module
        self.put_back_modules()
        launcher.restore_as_imported()
        launcher.restore_always = True
        for statement in self.imports:
            try:
                exec(statement, self.namespace)
            except Exception:  # as in the notebook's own cell, which said so
                pass
        for name, (value, code) in self.test_definitions.items():
            self.namespace[name] = value
            if code is not None:
                value.__code__ = code

    def transform(self, lines: list[str]) -> list[str]:
        source = "".join(lines)
        if not TEST_CELL.match(source):
            return lines
        self.restore()
        why = self.refusal(source)
        if why is None:
            return lines
        raise_line = f"raise __import__({__name__!r}, fromlist=['NotWrittenHere']).NotWrittenHere({why!r})\n"
        return [line + "\n" for line in definitions_only(source).splitlines()] + [raise_line]

    def after_cell(self, result) -> None:
        source = result.info.raw_cell if result.info else ""
        if not TEST_CELL.match(source or ""):
            return
        for name in defined_names(source) - self.exercises:
            if name in self.namespace:
                value = self.namespace[name]
                self.test_definitions[name] = (value, value.__code__ if isinstance(value, types.FunctionType) else None)

    # -- whose code it is ------------------------------------------------------------------
    def refusal(self, test_source: str) -> str | None:
        """Why the exercises a test uses are not the learner's own code (None: they are)."""
        for name in sorted(used_names(test_source) & self.exercises):
            if name not in self.namespace:
                return f"{name} is not defined in this notebook: write it here"
            why = self.not_written_here(name, self.namespace[name])
            if why:
                return why
        return None

    def where(self, code: types.CodeType) -> str:
        """'cell' (a cell of the notebook), 'reference' (the lesson's modules, solutions/), 'text'
        (exec'd from a string) or 'library' (any other file)."""
        filename = code.co_filename
        if filename in self.cells:
            # Code compiled under a cell's name from other text does not start where the cell does.
            return "cell" if starts_at(self.cells[filename], code) else "text"
        if filename not in self.files:
            path = os.path.realpath(filename)
            if path in self.reference_files or path.startswith(self.solutions) or path.endswith(".ipynb"):
                self.files[filename] = "reference"
            else:
                self.files[filename] = "library" if os.path.isfile(path) else "text"
        return self.files[filename]

    def is_reference(self, value) -> bool:
        """Code of the lesson's reference, or code exec'd from text (a function, a class, a module)."""
        if isinstance(value, types.MethodType):
            value = value.__func__
        if isinstance(value, functools.partial):
            value = value.func
        if isinstance(value, types.ModuleType):
            return os.path.realpath(getattr(value, "__file__", None) or "<none>") in self.reference_files
        if isinstance(value, type):
            return any(getattr(c, "__module__", None) in self.modules or any(
                self.where(f.__code__) == "reference" or self.where(f.__code__) == "text" and not name.startswith("__")
                for name, f in own_functions(c).items()) for c in value.__mro__ if c.__module__ != "builtins")
        return any(isinstance(f, types.FunctionType) and self.where(f.__code__) in ("reference", "text")
                   for f in wrapper_chain(value))

    def reached(self, function: types.FunctionType, seen: set) -> str | None:
        """The reference code a function uses (through globals, closures, defaults and the notebook's
        own helper functions and classes it calls, not other exercises), if any."""
        if function in seen:
            return None
        seen.add(function)
        names = {name for code in code_objects(function.__code__) for name in code.co_names}
        # `zero_lab.zero3.gather_unit(...)` or `import zero_lab.zero3` in an exercise of lesson 05.
        via_package = function.__globals__.get("zero_lab") is sys.modules["zero_lab"] and "zero_lab" in names
        if own := names & (self.modules | ({m.rpartition(".")[2] for m in self.modules} if via_package else set())):
            return f"zero_lab.{sorted(own)[0].rpartition('.')[2]} (what this lesson builds)"
        values = [function.__globals__[name] for name in names if name in function.__globals__]
        values += [cell.cell_contents for cell in function.__closure__ or () if cell.cell_contents is not cell]
        values += list(function.__defaults__ or ()) + list((function.__kwdefaults__ or {}).values())
        for value in values:
            if any(value is self.namespace.get(name) for name in self.exercises):
                continue  # another exercise: its own tests judge it
            try:
                if self.is_reference(value):
                    return getattr(value, "__qualname__", None) or getattr(value, "__name__", type(value).__name__)
            except ValueError:  # an empty closure cell
                continue
            inner = [value] if isinstance(value, types.FunctionType) else \
                list(own_functions(value).values()) if isinstance(value, type) else []
            for f in inner:
                if self.where(f.__code__) == "cell" and (found := self.reached(f, seen)):
                    return found
        return None

    def function_refusal(self, label: str, function) -> str | None:
        chain = wrapper_chain(function)
        innermost = chain[-1]
        if not isinstance(innermost, types.FunctionType):
            return f"{label} is not a function written in this notebook ({type(innermost).__name__})"
        for level in chain:
            if isinstance(level, types.FunctionType) and self.where(level.__code__) == "reference":
                return f"{label} is the course's reference ({level.__code__.co_filename}): write it here"
        where = self.where(innermost.__code__)
        if where != "cell":
            origin = "text run with exec" if where == "text" else innermost.__code__.co_filename
            return f"{label} is not written in this notebook's cells (its code comes from {origin})"
        seen: set = set()
        for level in chain:
            if isinstance(level, types.FunctionType) and (found := self.reached(level, seen)):
                return f"{label} uses {found}, not your code: write it yourself"
        return None

    def not_written_here(self, name: str, value) -> str | None:
        if not isinstance(value, type):
            return self.function_refusal(f"{name}()", value)
        for base in value.__mro__[1:]:
            if self.is_reference(base):
                return f"class {name} subclasses {base.__module__}.{base.__qualname__}, the course's reference: write it here"
        written = {}
        for method, function in own_functions(value).items():
            where = self.where(function.__code__)
            if where == "library" or where == "text" and method.startswith("__"):
                continue  # made by a decorator (dataclass, total_ordering) from the class body
            if why := self.function_refusal(f"{name}.{method}()", function):
                return why
            written[method] = function
        zero_lab_bases = [b for b in value.__mro__[1:] if b.__module__.split(".")[0] == "zero_lab"]
        if not written and zero_lab_bases:
            base = zero_lab_bases[0]
            return f"class {name} adds nothing to {base.__module__}.{base.__qualname__}: write it here"
        return None


def install(shell, lesson: str, course_root: Path) -> Guard | None:
    """Guard the grading of `lesson` in this kernel (grading_kernel.py calls it at start-up)."""
    source = source_notebook(course_root, lesson)
    if not source.is_file():
        print(f"zero-lab grading: no source notebook {source}; the grading guard is off", file=sys.stderr)
        return None
    guard = Guard(shell, lesson, source)
    guard.install()
    return guard
