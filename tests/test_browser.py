"""A real browser (headless Chromium through selenium): `./quickstart lab` opens the learner's
copy of lesson 00 (every exercise answered) unmodified, Run All reaches the last cell with
figures drawn; in instructor
mode the Formgrader loads. Screenshots go to the test's temporary folder. CI installs Chromium
(.ci/run); elsewhere the test skips when it is missing."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat

import pytest
from lab_server import TOKEN, quickstart

webdriver = pytest.importorskip("selenium.webdriver")

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
if not (CHROMIUM and DRIVER):
    if os.environ.get("ZERO_LAB_REQUIRE_BROWSER"):  # set by .ci/run
        raise RuntimeError("no Chromium: apt-get install chromium chromium-driver")
    pytestmark = pytest.mark.skip(reason="no Chromium: apt-get install chromium chromium-driver")
RUN_ALL_TIMEOUT = 900
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1400,1000"]


@pytest.fixture
def browser(tmp_path):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))
    yield driver
    driver.quit()


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(1)
    return value


# The open notebook: the current widget, or (a headless window without focus has none) the main area's first.
NOTEBOOK = ("const shell = window.jupyterapp.shell; "
            "const panel = shell.currentWidget || Array.from(shell.widgets('main'))[0]; ")
STATE = "if (!window.jupyterapp) return null; " + NOTEBOOK + """
    if (!panel || !panel.content || !panel.sessionContext.session) return null;
    const cells = Array.from(panel.content.model.cells).filter(c => c.type === 'code');
    return {
        path: panel.context.path,
        status: panel.sessionContext.session.kernel.status,
        dirty: panel.content.model.dirty,
        counts: cells.map(c => c.executionCount),
        images: cells.filter(c => JSON.stringify(c.outputs.toJSON()).includes('image/png')).length,
    };"""


def answer_everything(repo, env, lesson="00_collectives"):
    """The learner's copy (made by `zero-lab start`), with every exercise answered as in the reference."""
    subprocess.run([Path(sys.prefix) / "bin" / "zero-lab", "start", lesson], cwd=repo, env=env, check=True)
    mine = repo / "work" / lesson / f"{lesson}.ipynb"
    nb = nbformat.read(mine, as_version=4)
    nb.cells = nbformat.read(repo / "solutions" / lesson / f"{lesson}.ipynb", as_version=4).cells
    nbformat.write(nb, mine)


@pytest.mark.timeout(RUN_ALL_TIMEOUT + 300)
def test_run_all_in_the_learners_copy_of_lesson_00(repo_copy, browser, tmp_path):
    repo, env = repo_copy
    answer_everything(repo, env)
    with quickstart(repo, env, "lab", "--LabApp.expose_app_in_browser=True") as base:
        browser.get(f"{base}/?token={TOKEN}")
        state = wait_for(lambda: (s := browser.execute_script(STATE)) and s["status"] == "idle" and s, 180,
                         "lesson 00 open with an idle kernel")
        assert not state["dirty"], "the committed notebook shows as modified when opened"
        assert state["path"] == "work/00_collectives/00_collectives.ipynb"
        browser.save_screenshot(str(tmp_path / "opened.png"))
        # activate it first: Run All acts on the notebook that has focus
        browser.execute_script(NOTEBOOK + "shell.activateById(panel.id); "
                               "window.jupyterapp.commands.execute('notebook:run-all-cells');")
        state = wait_for(lambda: (s := browser.execute_script(STATE)) and None not in s["counts"]
                         and s["status"] == "idle" and s, RUN_ALL_TIMEOUT, "Run All reaching the last cell")
        browser.execute_script(NOTEBOOK + "panel.content.activeCellIndex = panel.content.widgets.length - 1;"
                               "panel.content.scrollToItem(panel.content.widgets.length - 1);")
        time.sleep(1)
        browser.save_screenshot(str(tmp_path / "after-run-all.png"))
        assert state["counts"][-1] is not None and state["images"] >= 1, state
        print(f"screenshots in {tmp_path}; {len(state['counts'])} code cells ran, {state['images']} with figures")


def test_formgrader_loads_in_instructor_mode(repo_copy, browser, tmp_path):
    repo, env = repo_copy
    with quickstart(repo, env, "instructor") as base:
        browser.get(f"{base}/formgrader?token={TOKEN}")
        wait_for(lambda: "Loading, please wait" not in browser.page_source and "00_collectives" in browser.page_source,
                 120, "the Formgrader's list of lessons")
        browser.save_screenshot(str(tmp_path / "formgrader.png"))
        assert "Manage Assignments" in browser.page_source and "exchange directory" not in browser.page_source
