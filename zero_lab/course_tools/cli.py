"""The `zero-lab` command: build the course, grade a notebook, switch to your own code."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zero_lab.course_tools import build, grading, questions
from zero_lab.course_tools.implementation import mine_dir


def run_build(args) -> int:
    if args.check:
        problems = build.check(names=args.lessons)
        for problem in problems:
            print(problem, file=sys.stderr)
        print("zero-lab build --check:", f"{len(problems)} problem(s)" if problems else "up to date")
        return 1 if problems else 0
    changed = build.build(names=args.lessons)
    print("\n".join(f"wrote {path}" for path in changed) or "nothing to change")
    return 0


def run_grade(args) -> int:
    print(grading.score_table(grading.grade(args.path)))
    return 0


def run_mine(args) -> int:
    notebook = grading.learner_notebook(args.path)
    written = build.export_mine(notebook, args.to)
    if not written:
        print(f"{notebook} has no `#| export` cells", file=sys.stderr)
        return 1
    for path in written:
        unfinished = "  (still raises NotImplementedError somewhere)" if "NotImplementedError" in path.read_text() else ""
        print(f"wrote {path}{unfinished}")
    print("Run later lessons on it with ZERO_LAB_IMPL=mine set before Python (or Jupyter) starts.")
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

    grade_parser = commands.add_parser(
        "grade", help="score a notebook with the lesson's visible and hidden tests",
        description="Autograde a learner notebook with nbgrader in a temporary course and print "
                    "the points per test.")
    grade_parser.add_argument("path", type=Path, help="a lesson folder (course/00_collectives) or its notebook")
    grade_parser.set_defaults(run=run_grade)

    mine_parser = commands.add_parser(
        "mine", help="export your notebook's modules so later lessons can use your code",
        description="Write the `#| export` cells of your notebook to a folder; with "
                    "ZERO_LAB_IMPL=mine, `import zero_lab.<module>` then loads them.")
    mine_parser.add_argument("path", type=Path, help="a lesson folder (course/00_collectives) or its notebook")
    mine_parser.add_argument("--to", type=Path, default=mine_dir(), metavar="DIR",
                             help="destination folder (default: $ZERO_LAB_MINE_DIR or <repo>/mine)")
    mine_parser.set_defaults(run=run_mine)

    ask_parser = commands.add_parser("ask", help="search the interview questions of lesson 08",
                                     description="Print the questions matching WORDS, their short answers and where "
                                                 "their runnable cells are (index: docs/questions.md).")
    ask_parser.add_argument("words", nargs="+", metavar="WORDS")
    ask_parser.set_defaults(run=run_ask)
    return main_parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except (build.BuildError, grading.GradingError) as error:
        print(f"zero-lab {args.command}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
