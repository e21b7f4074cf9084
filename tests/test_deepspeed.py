"""Our ZeRO stage 1 trains exactly like DeepSpeed's, and the ledger sees DeepSpeed's collectives; lesson 19's MoE
layer computes what DeepSpeed's MoE layer computes.

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


def test_lesson19_moe_layer_matches_deepspeeds_moe_layer():
    """Lesson 19's MoE layer beside deepspeed.moe.layer.MoE on 2 ranks, same router, experts and tokens (top-1)."""
    from zero_lab.moe_beside_deepspeed import compare_with_deepspeed
    from zero_lab.moe_dispatch import Expert, MoELayer

    for rank in compare_with_deepspeed(MoELayer, Expert, capacity_factor=4.0):  # capacity 8: nothing dropped
        assert all(rank["kept_ours"]) and all(rank["kept_theirs"]), rank
        # fp32, sums of a few products of size < 10 in another order: ulps, far under these bounds
        assert rank["output_gap"] < 1e-6 and rank["gradient_gap"] < 1e-5, rank
        assert rank["balance_losses"][0] == pytest.approx(rank["balance_losses"][1], rel=1e-6), rank
    for rank in compare_with_deepspeed(MoELayer, Expert, capacity_factor=1.0):  # capacity 2: drops
        kept = lambda mask: sorted(e for e, k in zip(rank["experts"], mask) if k)
        assert kept(rank["kept_ours"]) == kept(rank["kept_theirs"]), rank  # as many per expert, maybe other tokens
        assert rank["output_gap"] < 1e-6, rank
