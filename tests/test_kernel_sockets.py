"""JupyterLab's kernels, like grading's, listen on Unix sockets in a short folder (course_tools/kernel_sockets.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from traitlets.config import Config

from zero_lab.course_tools import kernel_sockets

REPO = Path(__file__).resolve().parents[1]
LOAD = """import os
from traitlets.config.loader import PyFileConfigLoader
c = PyFileConfigLoader("jupyter_server_config.py", path={folder!r}).load_config()
print(c.KernelManager.transport, c.KernelManager.ip, os.path.isdir(os.path.dirname(c.KernelManager.ip)))
"""


@pytest.mark.skipif(os.name != "posix", reason="ZeroMQ has no Unix sockets on Windows: kernels keep TCP there")
@pytest.mark.parametrize("face", ["learner", "instructor"])
def test_jupyterlabs_kernels_get_unix_sockets_in_a_short_folder_removed_at_exit(face):
    # Loaded as the server loads it, in a process of its own: the folder must be gone once that process ends.
    loaded = subprocess.run([sys.executable, "-c", LOAD.format(folder=str(REPO / "jupyter" / face))],
                            capture_output=True, text=True, check=True, cwd=REPO).stdout.split()
    transport, prefix, existed = loaded[-3:]
    assert (transport, existed) == ("ipc", "True"), loaded
    assert len((prefix + kernel_sockets.SOCKET_SUFFIX).encode()) <= kernel_sockets.MAX_SOCKET_PATH, prefix
    assert not Path(prefix).parent.exists(), prefix


@pytest.mark.skipif(os.name != "posix", reason="ZeroMQ has no Unix sockets on Windows: kernels keep TCP there")
def test_a_folder_too_long_for_a_socket_path_is_refused(tmp_path):
    c = Config()
    assert kernel_sockets.use_unix_sockets(c, str(tmp_path)) == str(tmp_path / "kernel")
    with pytest.raises(ValueError, match="too long for a Unix socket"):
        kernel_sockets.use_unix_sockets(Config(), str(tmp_path / ("x" * 100)))
