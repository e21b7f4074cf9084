"""ZERO_LAB_PERTURB_SUMS (zero_lab/perturb_sums.py): every sum one ulp off, the same way wherever it is computed,
exact sums left exact; and the bound it exists for: AdamW's drift of an element whose gradient is rounding noise."""

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from sharded_training import adamw_drift
from zero_lab import launch
from zero_lab.perturb_sums import VARIABLE, PerturbedSums, perturbed


def test_inexact_values_move_one_ulp_the_same_way_each_time_and_exact_ones_stay():
    values = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    moved = perturbed(values, salt=1)
    ulps = (moved.view(torch.int32) - values.view(torch.int32)).abs()
    inexact = (values.view(torch.int32) & 7) != 0
    assert ulps[inexact].eq(1).all() and ulps[~inexact].eq(0).all() and inexact.float().mean() > 0.8
    assert torch.equal(perturbed(values, salt=1), moved) and not torch.equal(perturbed(values, salt=2), moved)
    exact = torch.tensor([0.0, -0.0, 3.0, 1e6, 5 * 2.0 ** -21, float("inf"), float("-inf")])
    assert torch.equal(perturbed(exact, salt=1), exact)
    assert perturbed(torch.tensor([float("nan")]), salt=1).isnan().all()


def test_the_mode_moves_reductions_not_elementwise_ops():
    a, b = (torch.randn(8, 8, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    with _disable_current_modes():  # this machine's own rounding, even when pytest runs under the variable
        plain = a @ b, a.sum(), a * b
        with PerturbedSums(1):
            product, again, total, elementwise = a @ b, a @ b, a.sum(), a * b
    assert torch.equal(product, again) and torch.equal(elementwise, plain[2])
    assert not torch.equal(product, plain[0])
    assert (product - plain[0]).abs().max() <= torch.finfo().eps * plain[0].abs().max()  # one ulp at most
    assert total.item() != plain[1].item()


def _sums():
    rank = dist.get_rank()
    inexact = torch.randn(64, generator=torch.Generator().manual_seed(rank))
    integers = torch.arange(64, dtype=torch.float32) * (rank + 1)
    plain = inexact.clone()
    dist.all_reduce(inexact)
    dist.all_reduce(integers)
    return inexact, integers, plain


def test_collectives_sum_moved_inputs_and_every_rank_gets_the_same_bits(monkeypatch):
    monkeypatch.setenv(VARIABLE, "1")  # each rank installs it at start
    results = launch(_sums, 3)
    exact = sum(plain.double() for _, _, plain in results)
    for inexact, integers, _ in results:
        assert torch.equal(inexact, results[0][0]), "ranks disagree"
        assert torch.equal(integers, torch.arange(64, dtype=torch.float32) * 6), "an exact sum moved"
    error = (results[0][0].double() - exact).abs()
    inputs_ulp = sum(plain.abs().double() for _, _, plain in results) * 2.0 ** -23
    assert error.max() > 0 and (error <= 2 * inputs_ulp).all()


def test_adamw_drift_bounds_a_noise_gradient_s_walk():
    # A gradient of pure rounding noise (random sign, 1e-6 >> eps): AdamW walks ~lr a step; two such runs part by
    # at most adamw_drift, and by more than half of it when the noise points opposite ways.
    steps, lr = 10, 1e-2
    ends = []
    for sign in (1, -1):
        weight = torch.nn.Parameter(torch.zeros(1))
        optimizer = torch.optim.AdamW([weight], lr=lr, weight_decay=0.0)
        for _ in range(steps):
            weight.grad = torch.full((1,), sign * 1e-6)
            optimizer.step()
        ends.append(weight.item())
    assert adamw_drift([lr] * steps) / 2 < abs(ends[0] - ends[1]) <= adamw_drift([lr] * steps)
