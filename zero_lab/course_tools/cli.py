"""The `zero-lab` command: start a lesson in your workspace, grade it, use your own code; build the course."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from zero_lab import stages
from zero_lab.course_tools import questions, workspace
from zero_lab.course_tools.export import REPO, WORK_DIR, BuildError, export_mine, workspace_notebooks
from zero_lab.course_tools.implementation import mine_dir

# build and grading load nbgrader (a second or more): only the commands that use them import them.


def course_errors() -> tuple[type[Exception], ...]:
    """The errors a command reports in one line; grading's and release's once a command has loaded them."""
    errors = [BuildError, workspace.WorkspaceError]
    for name, error in (("grading", "GradingError"), ("release", "ReleaseError")):
        if (module := sys.modules.get(f"zero_lab.course_tools.{name}")) is not None:
            errors.append(getattr(module, error))
    return tuple(errors)


def run_build(args) -> int:
    from zero_lab.course_tools import build

    if args.check:
        problems = build.check(names=args.lessons)
        for problem in problems:
            print(problem, file=sys.stderr)
        print("zero-lab build --check:", f"{len(problems)} problem(s)" if problems else "up to date")
        return 1 if problems else 0
    changed = build.build(names=args.lessons)
    print("\n".join(f"wrote {path}" for path in changed) or "nothing to change")
    return 0


def run_start(args) -> int:
    started = workspace.start(args.lesson, fresh=args.fresh, side_by_side=args.side_by_side)
    print("\n".join(started.messages), file=sys.stderr)
    print(started.notebook.relative_to(REPO))  # the notebook to open (./quickstart lab opens it)
    return 0


class GradingProgress:
    """What `zero-lab grade` shows while nbgrader runs: on a terminal one line rewritten in place
    (and erased at the end, so the table starts at column 1); elsewhere (a log, a notebook's `!`,
    CI) a plain line per test cell, "grading test 3/8: zero3_trains ...", as it starts, or as soon
    as a later one or the end of grading shows that it ran between two polls."""

    RUNNING_TEST = re.compile(r": test ([\w-]+),")  # grading.status_line's "grading LESSON: test ID, N s"
    TEST_CELL = re.compile(r"#\|\s*test\s+([\w-]+)")

    def __init__(self, notebook: Path, stream=sys.stderr):
        from zero_lab.course_tools import build

        cells = build.read_notebook(notebook).cells
        self.tests = [m[1] for c in cells if c.cell_type == "code" and (m := self.TEST_CELL.match(c.source.lstrip()))]
        self.stream, self.on_terminal, self.shown = stream, stream.isatty(), 0  # tests announced so far

    def __call__(self, line: str) -> None:
        if self.on_terminal:
            print(f"\r{line:<78}", end="", file=self.stream, flush=True)
            return
        running = self.RUNNING_TEST.search(line)
        if not running or running[1] not in self.tests[self.shown:]:
            return
        # Test cells run in notebook order; one that took less than a poll of the grader is announced too.
        self.announce(upto=self.tests.index(running[1], self.shown) + 1)

    def announce(self, upto: int) -> None:
        for number in range(self.shown + 1, upto + 1):
            print(f"grading test {number}/{len(self.tests)}: {self.tests[number - 1]} ...", file=self.stream, flush=True)
        self.shown = max(self.shown, upto)

    def done(self) -> None:
        if self.on_terminal:
            print(f"\r{'':<78}\r", end="", file=self.stream, flush=True)
        else:  # the last tests often finish between two polls, after the grader's final one
            self.announce(upto=len(self.tests))


def run_grade(args) -> int:
    from zero_lab.course_tools import grading

    notebook = grading.learner_notebook(workspace.default_notebook(args.lesson))  # a lesson folder -> its notebook
    print(f"grading {notebook} (visible and hidden tests) ...", file=sys.stderr)
    progress = GradingProgress(notebook)
    report = grading.grade(notebook, progress=progress)
    progress.done()
    print(grading.score_table(report))
    return 0


def run_hand_in(args) -> int:
    from zero_lab.course_tools import build, grading

    lesson = build.find_lessons(REPO, [args.lesson])[0]
    folder = grading.hand_in(REPO, lesson, args.student, args.notebook)
    print(f"{args.notebook} -> {folder.relative_to(REPO)}/ (now `nbgrader autograde {lesson}`)")
    return 0


def run_mine(args) -> int:
    from zero_lab.course_tools import grading

    notebooks = ([grading.learner_notebook(workspace.default_notebook(name)) for name in args.lessons]
                 or workspace_notebooks())
    if not notebooks:
        print(f"no lesson notebook in {WORK_DIR}/: `zero-lab start <lesson>` makes one", file=sys.stderr)
        return 1
    for notebook in notebooks:
        written = export_mine(notebook, args.to)
        if not written:
            print(f"{notebook} has no `#| export` cells", file=sys.stderr)
        for path in written:
            unfinished = "  (still raises NotImplementedError somewhere)" if "NotImplementedError" in path.read_text() else ""
            print(f"wrote {path}{unfinished}")
    print(f"Use them with ZERO_LAB_IMPL=mine ZERO_LAB_MINE_DIR={args.to} set before Python (or Jupyter) starts.")
    return 0


def run_stages(args) -> int:
    print(stages.markdown(), end="")
    return 0


def run_release(args) -> int:
    from zero_lab.course_tools import release

    left_out = release.student_release(REPO, args.student, args.keep_modules_before)
    print(f"wrote the student release to {args.student} (left out {len(left_out)} files: solutions/, tests/, "
          "reference modules)")
    return 0


def run_ask(args) -> int:
    print(questions.ask(args.words))
    return 0


def parser() -> argparse.ArgumentParser:
    main_parser = argparse.ArgumentParser(prog="zero-lab", description=__doc__)
    commands = main_parser.add_subparsers(dest="command", required=True)

    build_parser = commands.add_parser(
        "build", help="generate zero_lab/<module>.py and course/ from solutions/",
        description="Export `#| export` cells to zero_lab/, write nbgrader metadata into the "
                    "solution notebooks and generate the learner edition in course/.")
    build_parser.add_argument("--check", action="store_true",
                              help="change nothing; fail if any generated file is out of date or "
                                   "course/ leaks solutions, or a committed notebook has outputs")
    build_parser.add_argument("lessons", nargs="*", metavar="LESSON",
                              help="lessons to build, e.g. 00_collectives (default: all in solutions/)")
    build_parser.set_defaults(run=run_build)

    start_parser = commands.add_parser(
        "start", help="copy a lesson into your workspace work/<lesson>/ (never overwrites your copy)",
        description="Copy course/<lesson>/ to the git-ignored work/<lesson>/ once; print the notebook "
                    "to open. An existing copy is left as it is; a newer release is announced.")
    start_parser.add_argument("lesson", help="e.g. 00_collectives or 00")
    start_parser.add_argument("--fresh", action="store_true",
                              help="start over: move your copy to work/<lesson>.backup-<time>/ first")
    start_parser.add_argument("--side-by-side", action="store_true",
                              help="put a newer release next to your notebook, in work/<lesson>/release-<time>/")
    start_parser.set_defaults(run=run_start)

    grade_parser = commands.add_parser(
        "grade", help="score a notebook with the lesson's visible and hidden tests",
        description="Autograde a notebook with nbgrader in a temporary course; print the points "
                    "per test and why points were lost.")
    grade_parser.add_argument("lesson", help="a lesson (00_collectives or 00: your copy in work/), "
                                             "a lesson folder or a notebook")
    grade_parser.set_defaults(run=run_grade)

    mine_parser = commands.add_parser(
        "mine", help="export your notebooks' modules so later lessons can use your code",
        description="Write the `#| export` cells of your notebooks (default: all in work/) to a "
                    "folder. ZERO_LAB_IMPL=mine does this by itself for work/; use this to export "
                    "elsewhere.")
    mine_parser.add_argument("lessons", nargs="*", metavar="LESSON",
                             help="lessons (your copies in work/), folders or notebooks (default: all in work/)")
    mine_parser.add_argument("--to", type=Path, default=mine_dir(), metavar="DIR",
                             help="destination folder (default: $ZERO_LAB_MINE_DIR or <repo>/mine)")
    mine_parser.set_defaults(run=run_mine)

    hand_in_parser = commands.add_parser(
        "hand-in", help="instructor: place a student's notebook in submitted/ (instead of nbgrader collect)",
        description="Copy a notebook to submitted/<student>/<lesson>/ with the files nbgrader's "
                    "collect would leave there, ready for `nbgrader autograde <lesson>`.")
    hand_in_parser.add_argument("lesson", help="e.g. 00_collectives")
    hand_in_parser.add_argument("student", help="the student's id")
    hand_in_parser.add_argument("notebook", type=Path, help="the student's notebook")
    hand_in_parser.set_defaults(run=run_hand_in)

    release_parser = commands.add_parser(
        "release", help="instructor: the course for a closed assignment, without solutions/ and reference modules",
        description="Copy what git tracks to DIR, less solutions/ (reference solutions, hidden tests), tests/ and "
                    "the zero_lab/ modules the lessons generate. Grade in your own checkout.")
    release_parser.add_argument("--student", type=Path, required=True, metavar="DIR", help="a new or empty folder")
    release_parser.add_argument("--keep-modules-before", metavar="LESSON",
                                help="keep the reference modules of the lessons before this one (e.g. 05_zero3)")
    release_parser.set_defaults(run=run_release)

    ask_parser = commands.add_parser("ask", help="search the interview questions of lesson 08",
                                     description="Print the questions matching WORDS, their short answers and where "
                                                 "their runnable cells are (index: docs/questions.md).")
    ask_parser.add_argument("words", nargs="+", metavar="WORDS")
    ask_parser.set_defaults(run=run_ask)

    stages_parser = commands.add_parser("stages", help="list the ZeRO stages zero_lab.prepare builds",
                                        description="Print the table of stages (zero_lab/stages.py, docs/stages.md): "
                                                    "what each shards, its lesson, module, class and options.")
    stages_parser.set_defaults(run=run_stages)
    return main_parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except course_errors() as error:
        print(f"zero-lab {args.command}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
