"""zero-lab: build ZeRO yourself. Lessons export their modules here; see README.md."""

from zero_lab import implementation
from zero_lab.comm_ledger import CommLedger
from zero_lab.launcher import RankFailed, RanksHung, init_distributed, launch

implementation.install()  # ZERO_LAB_IMPL=mine: later lessons import the learner's own modules

__all__ = ["CommLedger", "RankFailed", "RanksHung", "init_distributed", "launch"]
