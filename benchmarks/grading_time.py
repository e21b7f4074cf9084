"""How long grading takes, per lesson: what a learner waits for and what the test suite spends.

    python benchmarks/grading_time.py [LESSON ...] [--parallel 2]

For each lesson (default: all in solutions/): `zero-lab grade` of the learner edition alone
(what a learner runs), then both editions in one autograde run (what tests/conftest.py's
`graded` fixture does), and finally every lesson's pair with `--parallel` lessons at a time, as
the test suite grades them. Wall-clock seconds; the machine's load average is printed beside
them, since grading time follows it closely (a shared 2-core machine can double the figures).
No GPU needed: grading runs each notebook's cells as a learner's machine would (their ranks go
where zero_lab.launch puts them, on the CPU without a GPU).
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor

from zero_lab.course_tools import build, grading
from zero_lab.course_tools.implementation import REPO


def editions(lesson):
    return {"solution": build.source_notebook(REPO, lesson), "learner": REPO / build.COURSE_DIR / lesson}


def timed(fn, *args):
    started = time.monotonic()
    fn(*args)
    return time.monotonic() - started


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     epilog="No GPU needed: the notebooks' ranks run on the CPU without one.")
    parser.add_argument("lessons", nargs="*")
    parser.add_argument("--parallel", type=int, default=2)
    args = parser.parse_args(argv)
    lessons = build.find_lessons(REPO, args.lessons)
    print(f"{'lesson':<16} {'grade learner':>14} {'both editions':>14}   load average")
    for lesson in lessons:
        alone = timed(grading.grade, editions(lesson)["learner"])
        both = timed(grading.grade_many, lesson, editions(lesson))
        print(f"{lesson:<16} {alone:>12.0f} s {both:>12.0f} s   {os.getloadavg()[0]:.1f}")
    with ThreadPoolExecutor(args.parallel) as pool:
        started = time.monotonic()
        list(pool.map(lambda lesson: grading.grade_many(lesson, editions(lesson)), lessons))
        total = time.monotonic() - started
    print(f"all {len(lessons)} lessons, both editions, {args.parallel} at a time: {total:.0f} s "
          f"(load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
