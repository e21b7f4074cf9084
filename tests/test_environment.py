"""pip (pyproject.toml, constraints.txt) and conda (environment.yml) users get the same pinned stack."""

import os
import platform
import re
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def _requirements(*lists):
    # The quoted strings of the named dependency lists of pyproject.toml (tomllib would need
    # Python 3.11): "dependencies", or an extra of [project.optional-dependencies].
    text = (ROOT / "pyproject.toml").read_text()
    blocks = re.findall(r"^(\w+) = \[(.*?)\]", text, flags=re.M | re.S)
    return {double or single for name, block in blocks if name in lists
            for double, single in re.findall(r'"([^"]+)"|\'([^\']+)\'', block)}


def _environment_pins():
    text = (ROOT / "environment.yml").read_text()
    pip_section = text.split("- pip:", 1)[1]
    return set(re.findall(r"^\s+- (\S+==\S+)\s*$", pip_section, flags=re.M))


def _constraints(python=None):
    """The pins of constraints.txt; with python ("3.11"), only those whose marker holds there, without it."""
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    pins = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    if python is None:
        return pins
    return {str(Requirement(pin)).split(";")[0] for pin in pins
            if Requirement(pin).marker is None or Requirement(pin).marker.evaluate({"python_version": python})}


def test_environment_yml_pins_exactly_the_constraints():
    python = re.search(r"^\s+- python=(\S+)$", (ROOT / "environment.yml").read_text(), flags=re.M).group(1)
    assert _environment_pins() == _constraints(python)


def test_every_python_from_3_10_gets_one_pin_of_each_package():
    for python in ("3.11", "3.12", "3.13"):
        names = [pin.split("==")[0] for pin in _constraints(python)]
        assert len(names) == len(set(names)) == len({pin.split("==")[0] for pin in _constraints()}), python


def test_pyproject_pins_the_constraints_and_torch_is_a_range_that_holds_its_pin():
    # The required and test dependencies; the deepspeed extra is optional and not in the constraints.
    requirements = _requirements("dependencies", "test")
    torch_range = {req for req in requirements if req.startswith("torch")}
    assert torch_range == {"torch>=2.11"}
    assert requirements - torch_range == _constraints() - {"torch==2.14.1"}
    assert "torch==2.14.1" in _constraints()
    assert all("==" in req for req in _requirements("deepspeed"))


def test_the_installed_versions_are_the_pinned_ones():
    # The pins above are only text: check what this Python really imports. A local build label
    # counts as the pinned version (torch 2.14.1+cpu, PyTorch's CPU-only build, is torch 2.14.1).
    from importlib.metadata import PackageNotFoundError, version

    wrong = {}
    for requirement in _constraints(platform.python_version()):
        name, pinned = requirement.split("==")
        name = name.split("[")[0]
        try:
            installed = version(name)
        except PackageNotFoundError:
            installed = "not installed"
        kept = name == "torch" and os.environ.get("ZERO_LAB_TORCH") == "installed"  # the machine's own, >= 2.11
        if installed.split("+")[0] != pinned and not (kept and installed != "not installed"):
            wrong[name] = f"{installed} installed, {pinned} pinned"
    assert not wrong, f"{wrong}: run `./quickstart` again (it reinstalls when pyproject.toml changed) or delete .venv"
