# JupyterLab's kernels on Unix sockets: no port for a rank of zero_lab.launch to take first (kernel_sockets.py).
from zero_lab.course_tools.kernel_sockets import use_unix_sockets

use_unix_sockets(c)  # noqa: F821 (c: the config, provided by Jupyter when it loads this file)
