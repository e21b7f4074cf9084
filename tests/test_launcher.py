"""The launcher: results per rank, errors named by rank, hangs reported, no leftovers."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from zero_lab import RankFailed, RanksHung, launch


def _rank_and_size():
    return dist.get_rank(), dist.get_world_size(), dist.get_backend()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_rank_reports_back_in_order(world_size):
    results = launch(_rank_and_size, world_size)
    assert results == [(rank, world_size, "counted") for rank in range(world_size)]


def _sum_of_ranks(scale, offset=0):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return {"sum": t.item() * scale + offset, "tensor": t}


def test_args_kwargs_and_tensors_come_back():
    results = launch(_sum_of_ranks, 3, 2.0, offset=1)
    assert [r["sum"] for r in results] == [7.0, 7.0, 7.0]
    assert torch.equal(results[0]["tensor"], torch.tensor([3.0]))


def test_functions_defined_inline_work():
    assert launch(lambda: dist.get_rank() * 10, 2) == [0, 10]


def _fail_on_rank(bad_rank):
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    dist.barrier()  # the healthy ranks block here until they are killed


def test_exception_names_rank_and_traceback_quickly():
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        launch(_fail_on_rank, 3, 2, timeout=60)
    assert time.monotonic() - start < 10
    assert info.value.rank == 2
    assert "rank 2 of 3 failed" in str(info.value)
    assert "deliberate failure on rank 2" in info.value.rank_traceback
    assert "_fail_on_rank" in info.value.rank_traceback


def _die_hard():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def test_a_rank_that_dies_without_exception_is_reported():
    with pytest.raises(RankFailed, match="exit code 3") as info:
        launch(_die_hard, 2, timeout=60)
    assert info.value.rank == 1


def _skip_collective_on_rank_one():
    if dist.get_rank() != 1:
        dist.all_reduce(torch.ones(4))


def test_hang_names_stuck_ranks_and_collective():
    start = time.monotonic()
    with pytest.raises(RanksHung) as info:
        launch(_skip_collective_on_rank_one, 3, timeout=2)
    assert time.monotonic() - start < 8
    assert sorted(info.value.stuck) == [0, 2]
    assert "all_reduce" in info.value.stuck[0]
    assert "_skip_collective_on_rank_one" in info.value.stacks[2]


def _my_pid():
    return os.getpid()


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A reaped child is gone; a zombie would still answer kill(0), so check its state.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


@pytest.mark.parametrize("outcome", ["ok", "error", "hang"])
def test_no_child_survives(outcome, tmp_path):
    pid_file = tmp_path / "pids"

    def work():
        with open(pid_file, "a") as f:
            f.write(f"{os.getpid()}\n")
        if outcome == "error" and dist.get_rank() == 0:
            raise RuntimeError("x")
        if outcome == "hang" and dist.get_rank() == 0:
            dist.barrier()
        return 0

    try:
        launch(work, 3, timeout=2)
    except (RankFailed, RanksHung):
        pass
    pids = [int(line) for line in pid_file.read_text().split()]
    assert pids and not any(_alive(pid) for pid in pids)


def test_starting_four_ranks_is_fast():
    launch(_rank_and_size, 4)  # warm-up
    start = time.monotonic()
    launch(_rank_and_size, 4)
    assert time.monotonic() - start < 1.0


def test_bad_world_size_is_refused():
    with pytest.raises(ValueError, match="world_size"):
        launch(_rank_and_size, 0)


def _matmul():
    return float((torch.ones(256, 256) @ torch.ones(256, 256)).sum())


def test_ranks_compute_after_the_parent_used_its_thread_pool():
    # A parent that already ran a parallel matmul used to leave forked ranks deadlocked
    # on its OpenMP pool.
    _matmul()
    assert launch(_matmul, 1, timeout=20) == [256.0**3]
