# Generated from solutions/16_checkpoints/16_checkpoints.ipynb by `zero-lab build`: edit the notebook, not this file.

"""How big a checkpoint is and how often to write one (lesson 16, section 8).

checkpoint_schedule  a model's checkpoint bytes (AdamW), one save's seconds, the first-order best interval, its waste
"""

import math


def checkpoint_schedule(psi: float, write_bytes_per_second: float, mtbf_seconds: float) -> dict:
    """{"bytes", "save_seconds", "interval_seconds", "lost_fraction"} of a model of `psi` parameters trained with AdamW,
    its checkpoint written at `write_bytes_per_second`, failing every `mtbf_seconds` on average (first-order model)."""
    size = 12 * psi  # fp32 masters, exp_avg, exp_avg_sq: the 16-bit weights are the masters rounded, gradients are not kept
    save = size / write_bytes_per_second
    interval = math.sqrt(2 * save * mtbf_seconds)  # where d/dτ (δ/τ + τ/2M) = 0
    return {"bytes": size, "save_seconds": save, "interval_seconds": interval,
            "lost_fraction": save / interval + interval / (2 * mtbf_seconds)}
