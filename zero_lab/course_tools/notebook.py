"""In a notebook, an unfinished exercise says so in one line instead of a traceback.

`import zero_lab` in an IPython kernel installs the handler. A cell that calls an exercise
still raising NotImplementedError (directly, or inside a rank: `RankFailed`) still fails —
Run All goes on past it because the learner edition tags such cells `raises-exception`, and
nbgrader still sees an error — but shows one line naming the function to write.
"""

from __future__ import annotations

import re
import sys

from zero_lab.launcher import RankFailed

FRAME = re.compile(r'File "[^"]*", line \d+, in (\S+)')


def unfinished(error: BaseException) -> tuple[str, str] | None:
    """(function, where) when `error` is an exercise's NotImplementedError, else None."""
    if isinstance(error, NotImplementedError):
        tb = error.__traceback__
        while tb and tb.tb_next:
            tb = tb.tb_next
        return (tb.tb_frame.f_code.co_name if tb else "<module>"), ""
    if isinstance(error, RankFailed):
        lines = error.rank_traceback.strip().splitlines()
        if lines and lines[-1].startswith("NotImplementedError"):
            frames = FRAME.findall(error.rank_traceback)
            return (frames[-1] if frames else "<module>"), f" on rank {error.rank}"
    return None


def one_line(error: BaseException) -> str | None:
    found = unfinished(error)
    if found is None:
        return None
    function, where = found
    if function.startswith("<"):
        return f"NotImplementedError{where}: this cell is an exercise still to do: write it, then run it again."
    return (f"NotImplementedError{where}: {function}() is not written yet: finish that exercise, "
            "then run this cell again.")


def show(shell, etype, value, tb, tb_offset=None):
    """IPython custom exception handler: one line for an unfinished exercise, else the usual."""
    line = one_line(value)
    if line is None:
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
        return None
    shell._showtraceback(etype, value, [f"\x1b[0;33m{line}\x1b[0m"])  # sends the error output Jupyter shows
    return [line]


def install() -> None:
    """Install the handler in a running IPython kernel (nothing to do elsewhere)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython else None
    if shell is not None and hasattr(shell, "kernel"):
        shell.set_custom_exc((NotImplementedError, RankFailed), show)
