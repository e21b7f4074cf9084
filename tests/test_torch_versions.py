"""A learner on a PyTorch or Python the course is not tested on hears so in one line, from
`import zero_lab` (every notebook, script and `zero-lab` command passes there), without torch imported."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from zero_lab import torch_versions

REPO = Path(__file__).parents[1]


@pytest.mark.parametrize("version", ["2.14.1", "2.14.1+cpu", "2.14.2+cu130"])
@pytest.mark.parametrize("python", [(3, 11), (3, 13)])
def test_the_tested_versions_say_nothing(version, python):
    assert torch_versions.untested(version, python) is None


@pytest.mark.parametrize("version, python, named", [
    ("2.13.0+cpu", (3, 11), "PyTorch 2.13.0+cpu"), ("2.15.0", (3, 12), "PyTorch 2.15.0"),
    ("2.11.0", (3, 11), "PyTorch 2.11.0"), ("2.14.1", (3, 14), "Python 3.14"), ("2.14.1", (3, 10), "Python 3.10"),
    ("2.12.1", (3, 9), "PyTorch 2.12.1 and Python 3.9")])
def test_an_untested_version_is_named_in_one_line_with_the_tested_ones(version, python, named):
    line = torch_versions.untested(version, python)
    assert "\n" not in line and f"this is {named};" in line
    assert f"tested on PyTorch {torch_versions.PINNED} and Python 3.11-3.13" in line
    # and the way to the tested stack
    assert ("PyTorch" in named) == (f"pip install torch=={torch_versions.PINNED}" in line)
    assert ("Python" in named) == ("PYTHON=python3.13 ./quickstart" in line)


def import_zero_lab(tmp_path, torch_version=None, **env):
    """stderr and the loaded modules of `import zero_lab` in a fresh Python, with a stand-in torch
    of that version (one that fails if imported) first on the path."""
    if torch_version:
        (tmp_path / "torch").mkdir()
        (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('import zero_lab imported torch')\n")
        (tmp_path / "torch" / "version.py").write_text(f"__version__ = '{torch_version}'\ndebug = False\n")
    environment = {k: v for k, v in os.environ.items() if k != "RANK"} | env
    environment["PYTHONPATH"] = os.pathsep.join([str(tmp_path), environment.get("PYTHONPATH", "")])
    script = "import sys, zero_lab; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path, env=environment)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "False\n"  # import zero_lab stays light
    return result.stderr


def test_import_zero_lab_names_an_untested_torch_in_one_line_without_importing_it(tmp_path):
    assert import_zero_lab(tmp_path, "2.15.0").splitlines() == [torch_versions.untested("2.15.0")]


def test_under_torchrun_only_rank_0_says_it(tmp_path):
    assert import_zero_lab(tmp_path, "2.15.0", RANK="1") == ""


def test_the_pinned_torch_says_nothing(tmp_path):
    assert torch_versions.installed_torch().split("+")[0] == torch_versions.PINNED
    assert import_zero_lab(tmp_path) == ""


def test_the_readme_states_the_tested_range():
    readme = " ".join((REPO / "README.md").read_text().split())
    oldest, newest = (".".join(map(str, v)) for v in torch_versions.TESTED_PYTHON)
    tested = ".".join(map(str, torch_versions.TESTED_TORCH))
    assert f"Python {oldest}–{newest}" in readme and f"PyTorch {tested}" in readme
