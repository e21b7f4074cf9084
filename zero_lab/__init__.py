"""zero-lab: build ZeRO yourself. Lessons export their modules here; see README.md."""

from zero_lab.course_tools import implementation

# First, so that every later `import zero_lab.<module>` goes through the reference/mine switch.
implementation.install()

from zero_lab.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from zero_lab.comm_ledger import CommLedger  # noqa: E402
from zero_lab.course_tools import notebook  # noqa: E402
from zero_lab.launcher import RankFailed, RanksHung, init_distributed, launch, launch_restored  # noqa: E402
from zero_lab.prepare import prepare  # noqa: E402

notebook.install()  # in Jupyter: an unfinished exercise says so in one line

__all__ = ["CommLedger", "RankFailed", "RanksHung", "init_distributed", "launch", "launch_restored",
           "load_checkpoint", "prepare", "save_checkpoint"]
