# Generated from solutions/01_memory/01_memory.ipynb by `zero-lab build`: edit the notebook, not this file.

"""Model-state memory of data parallelism and ZeRO's stages (ZeRO paper, §5 and Tables 1-2).

Byte counts are exact `Fraction`s: the paper's per-device formulas divide by Nd, and a test
can then compare a formula with a measurement to the byte. GB means 1e9 bytes, as in the paper.
"""

import math
from fractions import Fraction


STAGES = {0: "DP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}  # ZeRO-1/2/3 are stages 1/2/3
CATEGORIES = ("parameters", "gradients", "master_params", "optimizer_states")


def adam_k(compute_bytes: int = 2, master_bytes: int = 4) -> int:
    """K, the optimizer-state bytes per parameter for Adam (the paper's K = 12 is adam_k(2, 4)).

    Momentum and variance are kept in the master dtype; a separate master copy of the
    parameters exists only when the compute dtype differs from it (mixed precision).
    """
    master_copy = master_bytes if compute_bytes != master_bytes else 0
    return master_copy + 2 * master_bytes


def model_states_per_device(psi: int, nd: int, stage: int, compute_bytes: int = 2, master_bytes: int = 4) -> dict:
    """Model-state bytes on one of `nd` data-parallel devices, per category, as exact Fractions.

    `stage` is 0 for plain DP, 1 for P_os, 2 for P_os+g, 3 for P_os+g+p.
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {list(STAGES)}, got {stage}")
    psi = Fraction(psi)
    master_copy = master_bytes if compute_bytes != master_bytes else 0
    full = {
        "parameters": compute_bytes * psi,
        "gradients": compute_bytes * psi,
        "master_params": master_copy * psi,
        "optimizer_states": 2 * master_bytes * psi,
    }
    # Each stage partitions one more category over the nd devices.
    partitioned_from_stage = {"master_params": 1, "optimizer_states": 1, "gradients": 2, "parameters": 3}
    return {
        category: full[category] / nd if stage >= partitioned_from_stage[category] else full[category]
        for category in CATEGORIES
    }


def total_bytes_per_device(psi: int, nd: int, stage: int, compute_bytes: int = 2, master_bytes: int = 4) -> Fraction:
    return sum(model_states_per_device(psi, nd, stage, compute_bytes, master_bytes).values(), Fraction(0))


GB = 10**9  # the paper's GB


def paper_round(gigabytes: Fraction) -> float:
    """Round a GB figure the way Tables 1 and 2 of the paper print it (see lesson 01)."""
    gigabytes = Fraction(gigabytes)
    if gigabytes >= 100:
        return float(math.floor(gigabytes))
    decimals = 1 if gigabytes >= 10 else 2
    return math.floor(gigabytes * 10**decimals + Fraction(1, 2)) / 10**decimals


TABLE1_MODELS = {"7.5B": 7_500_000_000, "128B": 128_000_000_000, "1T": 1_000_000_000_000}
TABLE1_ND = (1, 4, 16, 64, 256, 1024)


def table1() -> dict:
    """{(model, Nd): (P_os, P_os+g, P_os+g+p) in GB as the paper prints them}, K = 12."""
    return {
        (model, nd): tuple(paper_round(total_bytes_per_device(psi, nd, stage) / GB) for stage in (1, 2, 3))
        for model, psi in TABLE1_MODELS.items()
        for nd in TABLE1_ND
    }


def max_trainable_params(device_bytes, nd: int, stage: int, mp: int = 1, compute_bytes: int = 2, master_bytes: int = 4) -> int:
    """Largest Ψ whose model states fit in `device_bytes` per device (MP-way model parallel, Nd-way ZeRO)."""
    bytes_per_param = total_bytes_per_device(1, nd, stage, compute_bytes, master_bytes)
    return math.floor(Fraction(device_bytes) * mp / bytes_per_param)


TABLE2_ROWS = ((1, 64), (2, 128), (4, 256), (8, 512), (16, 1024))  # (MP, GPUs)


def table2_theoretical(device_bytes=32e9) -> dict:
    """{(MP, GPUs): max params (billions) for DP, P_os, P_os+g, P_os+g+p} as the paper's Table 2 prints them."""
    table = {}
    for mp, gpus in TABLE2_ROWS:
        nd = gpus // mp
        # The paper rounds the MP = 1 size to 0.1 B, then scales by MP (integer tenths stay exact).
        tenths = [math.floor(Fraction(max_trainable_params(device_bytes, nd, s), 10**8) + Fraction(1, 2)) for s in STAGES]
        table[(mp, gpus)] = tuple(t * mp / 10 for t in tenths)
    return table


def paper_size_label(billions: float) -> str:
    """'7.6B', or '0.5T' / '1T' / '2T' from 500B on (the paper's one-significant-figure T)."""
    return f"{billions:g}B" if billions < 500 else f"{billions / 1000:.1g}T"


def communication_volume(psi: int, stage: int, nd: int | None = None) -> Fraction:
    """Elements one device sends per step (§7). With `nd`, the ring algorithm's exact (nd-1)/nd."""
    collectives = 3 if stage == 3 else 2  # each a reduce-scatter or all-gather of Ψ elements
    ring_factor = Fraction(nd - 1, nd) if nd else Fraction(1)
    return collectives * Fraction(psi) * ring_factor


def deepspeed_zero2_bytes(total_params: int, total_gpus: int, cpu_offload: bool = False) -> int:
    """DeepSpeed's ZeRO-2 per-GPU estimate of model states (estimate_zero2_model_states_mem_needs)."""
    if cpu_offload:
        return 2 * total_params
    return 2 * total_params + int(18 * total_params / total_gpus)


def deepspeed_zero3_bytes(total_params: int, largest_layer_params: int, total_gpus: int) -> int:
    """DeepSpeed's ZeRO-3 per-GPU estimate without offload (estimate_zero3_model_states_mem_needs)."""
    return 4 * largest_layer_params + int(18 * total_params / total_gpus)


def deepspeed_gb(num_bytes) -> float:
    """What DeepSpeed prints as "GB": bytes / 2**30."""
    return num_bytes / 2**30
