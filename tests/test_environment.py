"""pip (pyproject.toml) and conda (environment.yml) users get the same pinned stack."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _requirements(*lists):
    # The quoted strings of the named dependency lists of pyproject.toml (tomllib would need
    # Python 3.11): "dependencies", or an extra of [project.optional-dependencies].
    text = (ROOT / "pyproject.toml").read_text()
    blocks = re.findall(r"^(\w+) = \[(.*?)\]", text, flags=re.M | re.S)
    return {req for name, block in blocks if name in lists for req in re.findall(r'"([^"]+)"', block)}


def _environment_pins():
    text = (ROOT / "environment.yml").read_text()
    pip_section = text.split("- pip:", 1)[1]
    return set(re.findall(r"^\s+- (\S+==\S+)\s*$", pip_section, flags=re.M))


def test_environment_yml_pins_exactly_what_pyproject_pins():
    # The required and test dependencies; the deepspeed extra is optional and not in environment.yml.
    assert _environment_pins() == _requirements("dependencies", "test")


def test_every_dependency_is_pinned():
    requirements = _requirements("dependencies", "test", "deepspeed")
    assert requirements and all("==" in req for req in requirements), requirements


def test_the_installed_versions_are_the_pinned_ones():
    # The pins above are only text: check what this Python really imports. A local build label
    # counts as the pinned version (torch 2.13.0+cpu, PyTorch's CPU-only build, is torch 2.13.0).
    from importlib.metadata import PackageNotFoundError, version

    wrong = {}
    for requirement in _requirements("dependencies", "test"):
        name, pinned = requirement.split("==")
        name = name.split("[")[0]
        try:
            installed = version(name)
        except PackageNotFoundError:
            installed = "not installed"
        if installed.split("+")[0] != pinned:
            wrong[name] = f"{installed} installed, {pinned} pinned"
    assert not wrong, f"{wrong}: run `./quickstart` again (it reinstalls when pyproject.toml changed) or delete .venv"
