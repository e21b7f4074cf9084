"""Lesson 01's module reproduces the ZeRO paper's Table 1 and Table 2 (theoretical) cell by cell.

The expected values are transcribed from the paper (arXiv 1910.02054, Tables 1 and 2; Table 1 lives
in zero_lab.scale, which lesson 13 counts against), not computed, so a change to the formulas or the
rounding rule that moves any printed cell fails.
"""

from fractions import Fraction

import pytest

from zero_lab import memory
from zero_lab.scale import PAPER_TABLE1  # (model, Nd) -> GB per device for P_os, P_os+g, P_os+g+p, as printed

# (MP, GPUs) -> theoretical max model size with 32 GB devices: DP, P_os, P_os+g, P_os+g+p.
PAPER_TABLE2 = {
    (1, 64): ("2B", "7.6B", "14.4B", "128B"),
    (2, 128): ("4B", "15.2B", "28.8B", "256B"),
    (4, 256): ("8B", "30.4B", "57.6B", "0.5T"),
    (8, 512): ("16B", "60.8B", "115.2B", "1T"),
    (16, 1024): ("32B", "121.6B", "230.4B", "2T"),
}


@pytest.mark.parametrize("key", sorted(PAPER_TABLE1, key=str))
def test_table1_cell(key):
    assert memory.table1()[key] == PAPER_TABLE1[key]


def test_table1_has_exactly_the_papers_cells():
    assert set(memory.table1()) == set(PAPER_TABLE1)


@pytest.mark.parametrize("row", sorted(PAPER_TABLE2))
def test_table2_theoretical_row(row):
    sizes = memory.table2_theoretical()[row]
    assert tuple(memory.paper_size_label(b) for b in sizes) == PAPER_TABLE2[row]


def test_table2_uses_nd_of_one_mp_group_not_the_gpu_count():
    # Nd = GPUs / MP = 64 in every row; with Nd = 1024 the MP = 16 row would be far larger.
    assert memory.max_trainable_params(32e9, 64, 3, mp=16) == 2_048_000_000_000
    assert memory.max_trainable_params(32e9, 1024, 3, mp=16) == 32_768_000_000_000


def test_paper_formulas_exactly():
    psi, nd = 7_500_000_000, 64
    assert memory.total_bytes_per_device(psi, nd, 0) == 16 * psi
    assert memory.total_bytes_per_device(psi, nd, 1) == 4 * psi + Fraction(12 * psi, nd)
    assert memory.total_bytes_per_device(psi, nd, 2) == 2 * psi + Fraction(14 * psi, nd)
    assert memory.total_bytes_per_device(psi, nd, 3) == Fraction(16 * psi, nd)
    assert memory.adam_k(2, 4) == 12 and memory.adam_k(4, 4) == 8


def test_paper_rounding_rule():
    # Halves go up below 100 GB (where Python's round() would go to even) ...
    assert memory.paper_round(Fraction(4125, 100)) == 41.3
    assert memory.paper_round(Fraction(1875, 1000)) == 1.88
    # ... and from 100 GB on, the paper cuts to whole GB.
    assert memory.paper_round(Fraction(5135, 10)) == 513
    assert memory.paper_round(Fraction(41875, 10)) == 4187


def test_communication_volume_per_stage():
    psi = 1000
    assert [memory.communication_volume(psi, s) for s in range(4)] == [2 * psi, 2 * psi, 2 * psi, 3 * psi]
    assert memory.communication_volume(psi, 3, nd=4) == Fraction(3 * psi * 3, 4)


def test_deepspeed_convention():
    psi, gpus = 7_500_000_000, 64
    assert memory.deepspeed_zero2_bytes(psi, gpus) == 17_109_375_000  # 17.11e9
    assert memory.total_bytes_per_device(psi, gpus, 2) == 16_640_625_000  # the paper's 16.64e9
    assert memory.deepspeed_zero2_bytes(psi, gpus, cpu_offload=True) == 2 * psi
    assert memory.deepspeed_zero3_bytes(psi, 10**8, gpus) == 4 * 10**8 + 18 * psi // gpus
    assert memory.deepspeed_gb(2**30) == 1.0


def test_max_trainable_params_is_exact_where_floats_round_down():
    # 32e9 / (4 + 12/22) is exactly 7.04e9; with the bytes per parameter as a float
    # (4.545454545454546, rounded up in the last bit) the quotient is 7039999999.999999.
    assert 32e9 / float(memory.total_bytes_per_device(1, 22, 1)) < 7_040_000_000
    assert memory.max_trainable_params(32e9, 22, 1) == 7_040_000_000
