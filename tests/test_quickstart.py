"""`./quickstart lab` opens the learner's own copy of lesson 00 in a clean JupyterLab (no
nbgrader instructor tools, no news pop-up); `./quickstart instructor` turns nbgrader's tools on.
Runs in a copy of the repo, so the real work/ is never touched."""

import json
import re
import urllib.error
import urllib.request

import pytest

from lab_server import TOKEN, get, quickstart

LESSON_00 = "work/00_collectives/00_collectives.ipynb"


def page_config(base):
    page = get(f"{base}/lab?token={TOKEN}")[1].decode()
    return json.loads(re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>', page, re.S)[1])


def test_quickstart_lab_opens_the_workspace_copy_of_lesson_00_without_instructor_tools(repo_copy):
    repo, env = repo_copy
    with quickstart(repo, env, "lab") as base:
        mine, release = (json.loads((repo / path).read_text()) for path in (LESSON_00, "course/00_collectives/00_collectives.ipynb"))
        assert mine["cells"] == release["cells"]
        status, body = get(f"{base}/api/contents/{LESSON_00}?token={TOKEN}")
        assert status == 200 and json.loads(body)["content"]["cells"]
        config = page_config(base)
        with urllib.request.urlopen(f"{base}/?token={TOKEN}", timeout=10) as start_page:
            assert start_page.url.split("?")[0] == f"{base}/lab/tree/{LESSON_00}"
        assert {"@jupyter/nbgrader", "@jupyterlab/apputils-extension:announcements"} <= set(config["disabledExtensions"])
        with pytest.raises(urllib.error.HTTPError, match="404"):
            get(f"{base}/formgrader?token={TOKEN}")


def test_quickstart_instructor_has_the_formgrader(repo_copy):
    repo, env = repo_copy
    with quickstart(repo, env, "instructor") as base:
        assert "@jupyter/nbgrader" not in page_config(base)["disabledExtensions"]
        status, body = get(f"{base}/formgrader?token={TOKEN}")
        assert status == 200 and b"nbgrader" in body.lower()
    assert not (repo / "work").exists()
