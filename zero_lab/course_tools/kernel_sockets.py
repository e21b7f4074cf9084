"""Jupyter kernels on Unix sockets instead of TCP ports, for JupyterLab and for grading.

A kernel on TCP picks five free ports, then binds them a moment later; a rank of
`zero_lab.launch` (gloo picks ports too) can take one in between, and the kernel fails to start.
A Unix socket is a file in a folder of the kernel's own: nothing else can take it. Its path has at
most 104 bytes on macOS (108 on Linux), so the folder is short: in $TMPDIR where the path fits (a
test run's or a grading course's temporary folder holds it then), else in /tmp ($TMPDIR can be long
on macOS). Not on Windows, whose ZeroMQ has no Unix sockets: kernels keep TCP there.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

MAX_SOCKET_PATH = 104  # bytes, macOS's sockaddr_un (Linux: 108)
SOCKET_SUFFIX = "-65535"  # jupyter_client names each socket <ip>-<number>


def use_unix_sockets(c, folder: str | None = None) -> str | None:
    """Set a Jupyter config `c` so its kernels listen on Unix sockets in `folder` (default: a new short folder,
    removed when this process exits); the sockets' path prefix, or None where kernels keep TCP."""
    if os.name != "posix":
        return None
    if folder is None:
        folder = short_folder()
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    prefix = os.path.join(folder, "kernel")  # absolute: a kernel runs in its notebook's folder
    if len((prefix + SOCKET_SUFFIX).encode()) > MAX_SOCKET_PATH:
        raise ValueError(f"{prefix}: too long for a Unix socket's path ({MAX_SOCKET_PATH} bytes)")
    c.KernelManager.transport = "ipc"
    c.KernelManager.ip = prefix
    return prefix


def short_folder() -> str:
    """A new folder whose sockets' paths fit MAX_SOCKET_PATH (the caller removes it)."""
    root = tempfile.gettempdir()
    if len(os.path.join(root, "zl-12345678", "kernel" + SOCKET_SUFFIX).encode()) > MAX_SOCKET_PATH:
        root = "/tmp"
    return tempfile.mkdtemp(prefix="zl-", dir=root)
