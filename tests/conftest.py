"""Shared fixtures. `graded` grades each edition of each lesson once per test run.

    def test_mutant_loses_points(graded):
        report = graded("00_collectives", "learner")      # or "solution"
        assert report.by_id["test_ring_all_reduce"].earned == 0

Both editions of a lesson are graded in one nbgrader run (one gradebook, two students), two
lessons at a time in the background: the lessons the selected tests name (a `lesson`
parameter) start right after collection, while other tests run.

Every temporary file of a run (the tests', their ranks', nbgrader's and its kernels') goes to one fresh
folder, the run's TMPDIR: anything still in it when the run ends fails the run, by name.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from zero_lab import perturb_sums
from zero_lab.course_tools import build, grading
from zero_lab.course_tools.implementation import REPO

EDITIONS = {"solution": build.SOURCE_DIR, "learner": build.COURSE_DIR}
GRADING_TIMEOUT = 1800  # a test may wait for the queue of lessons ahead of it
PARALLEL = 2


def edition_notebook(lesson: str, edition: str) -> Path:
    return REPO / EDITIONS[edition] / lesson / f"{lesson}.ipynb"


class Graded:
    """graded(lesson, edition) -> grading.Report, computed once per lesson and cached."""

    def __init__(self, lessons: list[str]):
        self.pool = ThreadPoolExecutor(PARALLEL, thread_name_prefix="grading")
        self.futures = {}
        for lesson in lessons:
            self.submit(lesson)

    def submit(self, lesson: str):
        if lesson not in self.futures:
            notebooks = {edition: edition_notebook(lesson, edition) for edition in EDITIONS}
            self.futures[lesson] = self.pool.submit(grading.grade_many, lesson, notebooks)
        return self.futures[lesson]

    def __call__(self, lesson: str, edition: str) -> grading.Report:
        assert edition in EDITIONS, f"edition is one of {list(EDITIONS)}"
        return self.submit(lesson).result()[edition]


# Tests whose floats depend on the CPU's math kernels: training equal to one process or to torch, bit for bit or
# within a tolerance (frozen_and_tied: the GPT with groups, whose key biases train on rounding noise). .ci/run runs
# them a second time under other kernels, with every sum rounded as another CPU might (`-m numerics`).
NUMERICS = re.compile(r"one_process|single_process|matches|bit_for_bit|identical|equals?_|_is_torch|like_|as_stage|"
                      r"same_way|as_never_stopping|as_without|stays_close|last_bit|frozen_and_tied")


def pytest_configure(config):
    perturb_sums.install()  # under ZERO_LAB_PERTURB_SUMS: this process's sums round as another CPU's might
    config.addinivalue_line("markers", "numerics: compares floats that another CPU's math kernels may round otherwise")
    use_own_temporary_folder(config)


def use_own_temporary_folder(config):
    """The run's temporary files go to a fresh folder: tempfile's default here, TMPDIR for every process the
    run starts (ranks, nbgrader, kernels). What is kept between runs stays where it is: pytest's tmp_path
    folders (the last three runs') and torch's compile cache (made when torch._dynamo is imported)."""
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    config.temporary_folder = tempfile.mkdtemp(prefix="zero-lab-tests-")
    config.outer_temporary = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = config.temporary_folder


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """What the run left in its temporary folder fails it, once every test and grading has ended."""
    config = session.config
    if hasattr(config, "grader"):
        config.grader.pool.shutdown(cancel_futures=True)  # waits for a grading under way
    config.leftovers = sorted(os.listdir(config.temporary_folder))
    if config.leftovers and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if config.leftovers and not config.pluginmanager.has_plugin("terminalreporter"):
        print(leftovers_line(config), file=sys.stderr)


def pytest_terminal_summary(terminalreporter, config):
    if getattr(config, "leftovers", None):
        terminalreporter.write_line(leftovers_line(config), red=True, bold=True)


def leftovers_line(config) -> str:
    left = [os.path.join(config.temporary_folder, name) for name in config.leftovers]
    more = f" and {len(left) - 20} more" if len(left) > 20 else ""
    return f"temporary files left behind ({len(left)}), a leak to fix: {', '.join(left[:20])}{more}"


def pytest_collection_modifyitems(items):
    for item in items:
        if NUMERICS.search(item.originalname):
            item.add_marker(pytest.mark.numerics)


def pytest_collection_finish(session):
    """Tests that use `graded` may wait for grading: a longer timeout; queue their lessons. This runs
    after `-k`/`-m` deselected tests, so a run that selects no graded test queues no grading."""
    config, lessons = session.config, []
    for item in session.items:
        if "graded" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(GRADING_TIMEOUT))
            lesson = getattr(item, "callspec", None) and item.callspec.params.get("lesson")
            if lesson and lesson not in lessons:
                lessons.append(lesson)
    if lessons and not config.option.collectonly:
        config.grader = Graded(lessons)


def pytest_unconfigure(config):
    if hasattr(config, "grader"):
        config.grader.pool.shutdown(cancel_futures=True)
    if hasattr(config, "temporary_folder"):
        shutil.rmtree(config.temporary_folder, ignore_errors=True)
        tmpdir, tempfile.tempdir = config.outer_temporary
        if tmpdir is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = tmpdir


@pytest.fixture(scope="session")
def graded(request):
    if not hasattr(request.config, "grader"):
        request.config.grader = Graded([])
    return request.config.grader


COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "work", "mine", "__pycache__", ".pytest_cache", "*.egg-info",
                                     ".zero-lab", "gradebook.db", "exchange", "submitted", "autograded", "feedback")


@pytest.fixture
def repo_copy(tmp_path):
    """(copy, env): the working tree in a temporary folder, and an environment in which
    ./quickstart and `zero-lab` there use this venv but the copy's files (its own work/)."""
    # The copy's ./quickstart installs (`pip install -e` of the copy, into this venv) when the venv's install
    # predates pyproject.toml or constraints.txt: this venv's zero_lab would then be a temporary folder's.
    stamp = Path(sys.prefix) / ".zero-lab-installed"
    wanted = (REPO / "pyproject.toml").read_bytes() + (REPO / "constraints.txt").read_bytes()
    if not stamp.is_file() or stamp.read_bytes() != wanted:
        pytest.fail(f"{sys.prefix}'s install is older than pyproject.toml/constraints.txt (or not quickstart's): run "
                    f"the tests with `ZERO_LAB_VENV={sys.prefix} ./quickstart test`, which brings it up to date first")
    copy = tmp_path / "zero-lab"
    shutil.copytree(REPO, copy, ignore=COPY_IGNORE)
    env = dict(os.environ, ZERO_LAB_VENV=sys.prefix, PYTHONPATH=str(copy), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    return copy, env


@pytest.fixture(scope="module")
def built_repo(tmp_path_factory):
    """A repository holding only the fixture lesson (tests/fixtures/99_fixture), built."""
    repo = tmp_path_factory.mktemp("repo")
    shutil.copytree(Path(__file__).parent / "fixtures" / "99_fixture", repo / "solutions" / "99_fixture")
    build.build(repo)
    return repo


@pytest.fixture
def repo(built_repo, tmp_path):
    """A copy of the built fixture repository that a test may change."""
    shutil.copytree(built_repo, tmp_path / "repo")
    return tmp_path / "repo"
