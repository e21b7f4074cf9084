"""The GPU path, its CPU half: where ranks run (a stand-in GPU count), the transports by device,
point to point through host memory, results back on the host, older torch names, prepare's device."""

import types

import pytest
import torch
import torch.distributed as dist

import zero_lab
from zero_lab import comm_ledger, launch, torch_versions
from zero_lab.rank_placement import DEVICE_VARIABLE, Placement


@pytest.mark.parametrize("world_size, gpus, devices, transport, text", [
    (4, 1, ["cuda:0"] * 4, "gloo", "4 ranks on 1 GPU (cuda:0), gloo"),
    (3, 2, ["cuda:0", "cuda:1", "cuda:0"], "gloo", "3 ranks on 2 GPUs (cuda:0, cuda:1), gloo"),
    (2, 2, ["cuda:0", "cuda:1"], "nccl", "2 ranks on 2 GPUs (cuda:0, cuda:1), nccl"),
    (2, 8, ["cuda:0", "cuda:1"], "nccl", "2 ranks on 2 GPUs (cuda:0, cuda:1), nccl"),
    (1, 1, ["cuda:0"], "nccl", "1 rank on 1 GPU (cuda:0), nccl"),
])
def test_ranks_share_gpus_round_robin_over_gloo_and_get_their_own_over_nccl(world_size, gpus, devices, transport, text):
    placement = Placement.choose(world_size, visible_gpus=gpus)  # a GPU is visible: ranks go there by default
    assert [str(placement.device(rank)) for rank in range(world_size)] == devices
    assert placement.cuda_transport == transport
    assert str(placement) == text


def test_the_cpu_is_chosen_without_gpus_or_when_asked(monkeypatch):
    assert str(Placement.choose(4, visible_gpus=0)) == "4 ranks on CPU, gloo"
    assert Placement.choose(4, visible_gpus=0).cuda_transport is None
    assert Placement.choose(2, "cpu", visible_gpus=1).device(1) == torch.device("cpu")
    monkeypatch.setenv(DEVICE_VARIABLE, "cpu")
    assert Placement.choose(2, visible_gpus=1).gpus == 0
    monkeypatch.setenv(DEVICE_VARIABLE, "cuda")
    assert Placement.choose(2, visible_gpus=1).gpus == 1
    assert Placement.choose(2, "cpu", visible_gpus=1).gpus == 0  # the argument wins over the variable


def test_a_bad_device_choice_names_the_fix(monkeypatch):
    with pytest.raises(ValueError, match="no GPU is visible.*use 'cpu'"):
        Placement.choose(2, "cuda", visible_gpus=0)
    with pytest.raises(ValueError, match="must be 'cpu' or 'cuda'.*got 'gpu'"):
        Placement.choose(2, "gpu", visible_gpus=1)
    monkeypatch.setenv(DEVICE_VARIABLE, "tpu")
    with pytest.raises(ValueError, match="ZERO_LAB_DEVICE"):
        launch(lambda: None, 2)  # refused in the caller, before any rank starts


def _where():
    import os

    joined_again = zero_lab.init_distributed()  # as zero_lab.train does inside a rank: the same placement
    return (str(zero_lab.placement()), str(zero_lab.rank_device()), str(joined_again), comm_ledger._cuda_transport,
            os.environ[DEVICE_VARIABLE])


def test_launch_tells_each_rank_where_it_runs():
    results = launch(_where, 3, device="cpu")
    assert results == [("3 ranks on CPU, gloo", "cpu", "cpu", None, "cpu")] * 3
    assert str(zero_lab.placement(3, "cpu")) == "3 ranks on CPU, gloo"


def _ring_through_host():
    comm_ledger.HOST_DEVICES = ()  # stand-in: CPU tensors take the way gloo makes a CUDA tensor take
    rank, world_size = dist.get_rank(), dist.get_world_size()
    received = torch.zeros(3)
    pending = dist.irecv(received, (rank - 1) % world_size)  # posted before the send: must not block
    sent = torch.full((3,), float(rank))
    dist.send(sent, (rank + 1) % world_size)
    sent.fill_(-1.0)  # the send took its own host copy
    pending.wait()
    from_anyone, source = torch.zeros(2), None
    if rank == 0:
        source = dist.recv(from_anyone)
    elif rank == world_size - 1:
        dist.send(torch.tensor([7.0, 8.0]), 0)
    return received.tolist(), from_anyone.tolist(), source, type(pending).__name__


def test_point_to_point_goes_through_host_buffers_where_the_transport_needs_them():
    results = launch(_ring_through_host, 3)
    assert [r[0] for r in results] == [[2.0] * 3, [0.0] * 3, [1.0] * 3]
    assert results[0][1:3] == ([7.0, 8.0], 2)
    assert {r[3] for r in results} == {"_CopiedOnWait"}


def test_results_come_back_as_they_were_with_tensors_on_the_host():
    result = launch(lambda: {"a": [torch.ones(2), (3, "x")], "b": None}, 2)[1]
    assert torch.equal(result["a"][0], torch.ones(2)) and result["a"][1] == (3, "x") and result["b"] is None


def test_older_torch_gets_the_new_collective_names_from_one_place():
    old = types.SimpleNamespace(all_gather_into_tensor=object(), reduce_scatter_tensor=object())
    assert torch_versions.bridge_collective_names(old) == ["all_gather_single", "reduce_scatter_single"]
    assert old.all_gather_single is old.all_gather_into_tensor
    assert old.reduce_scatter_single is old.reduce_scatter_tensor
    assert torch_versions.bridge_collective_names(old) == []  # once
    assert torch_versions.bridge_collective_names(dist) == []  # this torch has them
    torch_versions.check("2.11.0+cu130")
    with pytest.raises(ImportError, match=r"needs PyTorch 2\.11 or newer, this is 2\.10\.1.*pip install torch=="):
        torch_versions.check("2.10.1")


def test_the_supported_range_is_what_pyproject_says():
    import pathlib
    import tomllib

    pyproject = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert f"torch>={'.'.join(map(str, torch_versions.OLDEST))}" in pyproject["project"]["dependencies"]
    assert torch.__version__.split("+")[0] == torch_versions.PINNED


def _prepare_on(device, stage, meta):
    from zero_lab.models import MLP
    from zero_lab.zero3 import meta_parameters

    if meta:
        with meta_parameters():
            model = MLP([4, 6, 3])
        options = {"init_fn": lambda name, tensor: torch.nn.init.normal_(tensor, generator=torch.Generator(
            tensor.device).manual_seed(1))}
    else:
        model, options = MLP([4, 6, 3]), {}
    model, optimizer = zero_lab.prepare(model, torch.optim.AdamW, stage=stage, device=device, **options)
    loss = model(torch.ones(2, 4, device=zero_lab.rank_device())).sum()
    loss.backward()
    optimizer.step()
    return sorted({str(p.device) for p in model.parameters()}), loss.item()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_prepare_puts_the_model_on_the_device_asked_for_or_keeps_it_where_the_group_carries_it(stage):
    assert launch(_prepare_on, 2, "cpu", stage, False)[0][0] == ["cpu"]
    assert launch(_prepare_on, 2, None, stage, False)[1][0] == ["cpu"]


def test_a_meta_model_is_made_on_the_device_asked_for():
    assert launch(_prepare_on, 2, "cpu", 3, True)[0][0] == ["cpu"]


def _prepare_on_a_missing_gpu():
    from zero_lab.models import MLP

    zero_lab.prepare(MLP([4, 3]), torch.optim.AdamW, stage=1, device="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_prepare_on_a_gpu_that_is_not_there_names_the_fix():
    with pytest.raises(zero_lab.RankFailed, match="no GPU is visible: use device='cpu'"):
        launch(_prepare_on_a_missing_gpu, 2)
