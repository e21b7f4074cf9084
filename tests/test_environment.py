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
