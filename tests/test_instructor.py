"""docs/grading.md's instructor sequence, verbatim, in a copy of the repo (the fixture lesson instead
of lesson 00 to stay quick): build, generate, two hand-placed students, autograde, the
Formgrader, feedback without hidden tests, release_feedback, export; nothing outside the repo."""

import csv
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lab_server import get, quickstart

from zero_lab.course_tools.implementation import REPO

FIXTURE = Path(__file__).parent / "fixtures" / "99_fixture"
HIDDEN_LINES = ["assert double(-1.5) == -3.0", "launch(summed_on_every_rank, 3"]


GRADING_DOC = REPO / "docs" / "grading.md"  # the README links to it


def readme_instructor_commands():
    """The shell block under **As an instructor.** in docs/grading.md, as lines."""
    text = GRADING_DOC.read_text()
    block = re.search(r"\*\*As an instructor\.\*\*.*?```bash\n(.*?)```", text, re.S)[1]
    return [line for line in block.splitlines() if line.strip()]


def run(script, repo, env):
    started = time.monotonic()
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=repo, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{script}\n{result.stdout}\n{result.stderr}"
    print(f"{time.monotonic() - started:.0f} s: {script}")
    return result.stdout + result.stderr


@pytest.mark.timeout(1200)
def test_readme_instructor_sequence(repo_copy, tmp_path):
    repo, env = repo_copy
    (repo / ".venv").symlink_to(sys.prefix)  # what the sequence's first line creates
    shutil.copytree(FIXTURE, repo / "solutions" / "99_fixture")
    students = tmp_path / "students"
    students.mkdir()
    # alice hands in the reference, bob the untouched learner edition (built below).
    commands = [line.replace("00_collectives", "99_fixture").replace("path/to/", f"{students}/")
                for line in readme_instructor_commands()]
    # ./quickstart instructor runs until Ctrl-C: the page starts it in a second terminal, not in the block.
    assert not any(line.startswith("./quickstart instructor") for line in commands)
    assert "**second terminal**, from the repository root: `./quickstart instructor`" in GRADING_DOC.read_text()
    formgrader = next(i for i, line in enumerate(commands) if line.startswith("nbgrader generate_feedback"))
    hand_in = next(i for i, line in enumerate(commands) if line.startswith("zero-lab hand-in"))
    home = tmp_path / "home"
    home.mkdir()
    script_env = {k: v for k, v in env.items() if k != "JUPYTER_RUNTIME_DIR"} | {"HOME": str(home)}

    activate = commands[1]
    assert activate.startswith("source .venv/bin/activate")
    run("\n".join(commands[:hand_in]), repo, script_env)
    shutil.copy(repo / "solutions/99_fixture/99_fixture.ipynb", students / "alice.ipynb")
    shutil.copy(repo / "course/99_fixture/99_fixture.ipynb", students / "bob.ipynb")
    log = run("\n".join([activate, *commands[hand_in:formgrader]]), repo, script_env)
    assert "Traceback" not in log, log

    with quickstart(repo, env, "instructor") as base:
        status, body = get(f"{base}/formgrader/api/submissions/99_fixture")
        submissions = {s["student"]: s for s in json.loads(body)}
        assert status == 200 and submissions["alice"]["score"] == 3 and submissions["bob"]["score"] == 0
        assert get(f"{base}/formgrader/manage_submissions/99_fixture")[0] == 200

    log = run("\n".join([activate, *commands[formgrader:], "zero-lab build --check 99_fixture"]), repo, script_env)
    noise = re.search(r"\*\*Harmless noise.*?\n\n", GRADING_DOC.read_text(), re.S)[0]
    warnings = [re.sub(r"\d+", "N", line.split("] ", 1)[1]).rstrip(".") for line in log.splitlines() if "| WARNING]" in line]
    assert all(" ".join(w.split()) in " ".join(noise.split()) for w in warnings), (warnings, "docs/grading.md's Harmless noise")
    for student in "alice", "bob":
        html = (repo / "feedback" / student / "99_fixture" / "99_fixture.html").read_text()
        assert "HIDDEN TESTS" not in html and not any(line in html for line in HIDDEN_LINES), student
    assert "not attempted: double() raises NotImplementedError" in (repo / "feedback/bob/99_fixture/99_fixture.html").read_text()
    assert list((repo / "exchange" / "zero-lab" / "feedback").iterdir())  # released inside the repo
    with open(repo / "grades.csv") as f:
        grades = {row["student_id"]: float(row["raw_score"]) for row in csv.DictReader(f)}
    assert grades == {"alice": 3.0, "bob": 0.0}
    assert list(home.iterdir()) == []  # nothing written outside the repo
