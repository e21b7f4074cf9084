"""Start `./quickstart lab|instructor` on a free port for a test, and stop it with everything it started."""

import os
import signal
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager

TOKEN = "zero-lab-test"


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get(url):
    request = urllib.request.Request(url, headers={"Authorization": f"token {TOKEN}"})  # survives redirects
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status, response.read()


@contextmanager
def quickstart(repo, env, command="lab", *args, startup=180):
    """Yield the server's base URL (the token goes in `?token=`) once it answers."""
    port = free_port()
    server = subprocess.Popen(
        ["./quickstart", command, *args, "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
         f"--IdentityProvider.token={TOKEN}"],
        cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup
        while True:
            assert server.poll() is None, server.stdout.read().decode()
            try:
                get(f"{base}/api/status?token={TOKEN}")
                break
            except OSError:
                assert time.monotonic() < deadline, f"JupyterLab did not answer within {startup} s"
                time.sleep(0.5)
        yield base
    finally:
        stop(server)


def stop(server):
    """SIGTERM the server's whole session (kernels included), SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, None)):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            pass
        try:
            server.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
