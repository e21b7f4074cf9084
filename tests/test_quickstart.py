"""The README's first command opens the course: start JupyterLab as it does, fetch lesson 00, stop."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LESSON_00 = "course/00_collectives/00_collectives.ipynb"


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url):
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.status, response.read()


def test_quickstart_lab_serves_lesson_00(tmp_path):
    port, token = _free_port(), "zero-lab-test"
    env = dict(os.environ, ZERO_LAB_VENV=sys.prefix, JUPYTER_RUNTIME_DIR=str(tmp_path))
    server = subprocess.Popen(
        ["./quickstart", "lab", "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
         f"--IdentityProvider.token={token}"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}/api/contents/{LESSON_00}?token={token}"
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stdout.read().decode()
            try:
                status, body = _get(url)
                break
            except OSError:
                assert time.monotonic() < deadline, "JupyterLab did not answer within 120 s"
                time.sleep(0.5)
        assert status == 200
        notebook = json.loads(body)["content"]
        assert notebook["cells"], "lesson 00 is empty"
        assert _get(f"http://127.0.0.1:{port}/lab?token={token}")[0] == 200
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
