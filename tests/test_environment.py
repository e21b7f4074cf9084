"""pip (pyproject.toml) and conda (environment.yml) users get the same pinned stack."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pyproject_pins():
    # Every quoted "name==version" string (tomllib would need Python 3.11).
    return set(re.findall(r'"([A-Za-z0-9_.\-]+==[^"]+)"', (ROOT / "pyproject.toml").read_text()))


def _environment_pins():
    text = (ROOT / "environment.yml").read_text()
    pip_section = text.split("- pip:", 1)[1]
    return set(re.findall(r"^\s+- (\S+==\S+)\s*$", pip_section, flags=re.M))


def test_environment_yml_pins_exactly_what_pyproject_pins():
    assert _environment_pins() == _pyproject_pins()


def test_every_dependency_is_pinned():
    assert all("==" in pin for pin in _pyproject_pins())
