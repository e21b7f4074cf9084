"""Our ZeRO stage 1 trains exactly like DeepSpeed's, and the ledger sees DeepSpeed's collectives.

Skipped unless DeepSpeed is installed (optional: DS_BUILD_OPS=0 pip install -e '.[deepspeed]').
"""

from fractions import Fraction

import pytest

pytest.importorskip("deepspeed", reason="optional: DS_BUILD_OPS=0 pip install -e '.[deepspeed]'")

from zero_lab import side_by_side  # noqa: E402

RANKS, STEPS = 2, 3


def test_stage1_matches_deepspeed_and_the_ledger_counts_it():
    comparison = side_by_side.compare(stages=(1,), ranks=RANKS, steps=STEPS, warmup=1, versions=("DeepSpeed",))
    ours, deepspeed = comparison["results"][1, side_by_side.OURS], comparison["results"][1, "DeepSpeed"]
    assert len(deepspeed["losses"]) == STEPS
    assert deepspeed["max_loss_diff"] < 1e-5, (ours["losses"], deepspeed["losses"])
    # Every step went through the "counted" process group ...
    assert all(sent > 0 for sent in deepspeed["ledger_per_step"]), deepspeed["ledger_per_step"]
    # ... with DeepSpeed 0.19.8's defaults: the whole gradient all-reduced (its bucketed
    # "reduce_scatter" path, stage_1_and_2.py: average_tensor), then the parameters all-gathered.
    psi_bytes = 4 * comparison["psi"]
    ring = Fraction(RANKS - 1, RANKS)
    assert deepspeed["collectives"]["all_reduce"][1] >= 2 * ring * psi_bytes
    assert deepspeed["collectives"]["all_gather"][1] >= ring * psi_bytes
    assert ours["sent_bytes"] == 2 * ring * psi_bytes  # ours: reduce-scatter + all-gather, Psi = 28,544 is even
