"""A test run fails when it leaves a temporary file behind (tests/conftest.py gives each run its own TMPDIR)."""

import os
import re
import subprocess
import sys
from pathlib import Path

LEAKY_TEST = """
import tempfile


def test_forgets_its_folder():
    tempfile.mkdtemp(prefix="left-on-purpose-")
"""


def test_a_run_that_leaves_a_temporary_folder_fails_and_names_it(tmp_path):
    (tmp_path / "test_leaky.py").write_text(LEAKY_TEST)
    tests = str(Path(__file__).parent)  # this suite's conftest.py, loaded as a plugin by the run in tmp_path
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                          str(tmp_path / "test_leaky.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 1 and "1 passed" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
    left = re.search(r"temporary files left behind \(1\), a leak to fix: (\S+)", run.stdout)
    assert left and Path(left[1]).name.startswith("left-on-purpose-"), run.stdout[-2000:]
    assert not Path(left[1]).parent.exists(), "the run's temporary folder outlived it"
