"""Lesson 02: the exported zero_lab.ddp against single-process training and PyTorch DDP.

Every rank builds its model from a rank-dependent seed (only the broadcast makes the replicas
agree), trains on its shard of the global batch, and must reproduce the gradients of one
process training on the whole batch (checked step by step: AdamW would hide a gradient that
is N times too large) and its weights after several AdamW steps.
"""

from contextlib import nullcontext
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zero_lab
from zero_lab.data import regression_batches, shard_batch, token_batches
from zero_lab.ddp import (BucketedDDP, MasterWeightOptimizer, all_reduce_gradients,
                          all_reduce_gradients_flat, assign_buckets, broadcast_parameters)
from zero_lab.memory import model_states_per_device
from zero_lab.memory_ledger import model_state_bytes
from zero_lab.models import GPT, MLP, GPTConfig
from zero_lab.pictures import draw_who_holds_what, held_elements

STEPS = 3
LR = 1e-3
# No biases: the attention's key bias has a gradient that is zero up to rounding, which Adam
# would blow up into run-to-run differences.
TINY_GPT = GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=32, block_size=16, bias=False)


class SometimesExpert(nn.Module):
    """An expert layer used only for rows with x[:, 0] > 1.2 (absent from some shards) and a
    spare layer no rank ever uses."""

    def __init__(self, seed=0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.body, self.expert, self.spare = nn.Linear(16, 16), nn.Linear(16, 4), nn.Linear(4, 4)
            self.head = nn.Linear(16, 4)

    def forward(self, x):
        hidden = torch.relu(self.body(x))
        out = self.head(hidden)
        routed = x[:, 0] > 1.2
        if routed.any():
            out = out.index_add(0, routed.nonzero().squeeze(1), self.expert(hidden[routed]))
        return out


def make_model(kind, seed):
    if kind == "mlp":
        return MLP([16, 64, 64, 4], seed=seed)
    if kind == "frozen":
        model = MLP([16, 64, 64, 4], seed=seed)
        model.layers[0].requires_grad_(False)
        return model
    if kind == "expert":
        return SometimesExpert(seed)
    return GPT(TINY_GPT, seed=seed)


def batches(kind, batch_size=24):
    if kind == "gpt":
        return list(token_batches(STEPS, batch_size, TINY_GPT.block_size, TINY_GPT.vocab_size))
    return list(regression_batches(STEPS, batch_size, 16, 4))


def loss_of(kind, model, batch):
    return model(*batch)[1] if kind == "gpt" else F.mse_loss(model(batch[0]), batch[1])


def snapshot(model, attribute):
    return [None if getattr(p, attribute) is None else getattr(p, attribute).detach().clone()
            for p in model.parameters()]


def single_process(kind, batch_size=24):
    model = make_model(kind, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    grads = []
    for batch in batches(kind, batch_size):
        optimizer.zero_grad()
        loss_of(kind, model, batch).backward()
        grads.append(snapshot(model, "grad"))
        optimizer.step()
    return grads, snapshot(model, "data")


def data_parallel(kind, version, bucket_size_bytes=1024, micro_steps=1, batch_size=24, find_unused=False):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = make_model(kind, rank)
    if version == "bucketed":
        ddp_model, sync = BucketedDDP(model, bucket_size_bytes, find_unused_parameters=find_unused), None
    else:
        broadcast_parameters(model)
        ddp_model, sync = model, {"naive": all_reduce_gradients, "flat": all_reduce_gradients_flat}[version]
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    grads, calls, sent, micro_calls = [], [], [], []
    for batch in batches(kind, batch_size):
        shard = shard_batch(batch, rank, world_size)
        optimizer.zero_grad()
        with zero_lab.CommLedger() as ledger:
            for micro_step in range(micro_steps):
                last = micro_step == micro_steps - 1
                with nullcontext() if last else ddp_model.no_sync():
                    (loss_of(kind, ddp_model, shard_batch(shard, micro_step, micro_steps)) / micro_steps).backward()
                if not last:
                    micro_calls.append(ledger.calls())
            if sync:
                sync(model)
        grads.append(snapshot(model, "grad"))
        calls.append(ledger.calls("all_reduce"))
        sent.append(ledger.sent_bytes())
        optimizer.step()
    return dict(grads=grads, params=snapshot(model, "data"), calls=calls, sent=sent, micro_calls=micro_calls)


def check(kind, version, world_size, batch_size=24, **options):
    expected_grads, expected_params = single_process(kind, batch_size)
    results = zero_lab.launch(data_parallel, world_size, kind, version, batch_size=batch_size, timeout=30, **options)
    names = [name for name, _ in make_model(kind, 0).named_parameters()]
    for rank, result in enumerate(results):
        for step, grads in enumerate(result["grads"]):
            for name, grad, expected in zip(names, grads, expected_grads[step]):
                where = f"{version}, {world_size} ranks, rank {rank}, step {step}, {name}"
                if expected is None:
                    assert grad is None, f"{where}: unused on every rank, its gradient must stay None"
                else:
                    # each rank's gradient of its own samples, summed in the bucket's order: a few ulps; atol for cancellations
                    torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6, msg=lambda m: f"{where}: {m}")
        for name, param, expected in zip(names, result["params"], expected_params):
            # SGD adds lr times those gradients: their ulps, plus one rounding of each update per step
            torch.testing.assert_close(param, expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    return results


def ring_bytes(model, world_size):
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return Fraction(2 * (world_size - 1), world_size) * trainable


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("version", ["naive", "flat", "bucketed"])
def test_matches_single_process_and_sends_2_psi(version, world_size):
    results = check("mlp", version, world_size)
    model = make_model("mlp", 0)
    expected_calls = {"naive": len(list(model.parameters())), "flat": 1,
                      "bucketed": len(assign_buckets(list(model.parameters()), 1024))}[version]
    for result in results:
        assert result["calls"] == [expected_calls] * STEPS
        assert result["sent"] == [ring_bytes(model, world_size)] * STEPS


def test_tied_embedding_is_reduced_once():
    gpt = make_model("gpt", 0)
    assert gpt.lm_head.weight is gpt.transformer.wte.weight
    for version in ("naive", "bucketed"):
        results = check("gpt", version, 3, batch_size=12, bucket_size_bytes=4096)
        assert results[0]["sent"] == [ring_bytes(gpt, 3)] * STEPS


@pytest.mark.parametrize("bucket_size_bytes", [1, 10**9])
def test_frozen_parameters_are_not_reduced(bucket_size_bytes):
    results = check("frozen", "bucketed", 3, bucket_size_bytes=bucket_size_bytes)
    assert results[0]["sent"] == [ring_bytes(make_model("frozen", 0), 3)] * STEPS


def test_unused_parameters():
    # Some ranks' shards never reach the expert; no rank reaches the spare layer.
    results = check("expert", "bucketed", 3, bucket_size_bytes=100, find_unused=True)
    names = [name for name, _ in make_model("expert", 0).named_parameters()]
    assert results[0]["grads"][0][names.index("spare.weight")] is None
    with pytest.raises(zero_lab.RankFailed, match="find_unused_parameters=True"):
        zero_lab.launch(data_parallel, 2, "expert", "bucketed", timeout=30)
    with pytest.raises(zero_lab.RankFailed, match="find_unused_parameters=True"):
        zero_lab.launch(data_parallel, 2, "expert", "naive", timeout=30)


def test_some_rank_lacks_the_expert_gradient():
    # The unused-parameter test above only means something if the expert is really missing on
    # some rank in some step while others use it.
    used = [[(shard_batch(x, rank, 3)[:, 0] > 1.2).any().item() for rank in range(3)] for x, _ in batches("expert")]
    assert any(any(step) and not all(step) for step in used)


@pytest.mark.parametrize("world_size, micro_steps, batch_size", [(2, 2, 24), (3, 3, 36)])
def test_gradient_accumulation_with_no_sync(world_size, micro_steps, batch_size):
    results = check("mlp", "bucketed", world_size, batch_size=batch_size, micro_steps=micro_steps)
    assert results[0]["micro_calls"] == [0] * ((micro_steps - 1) * STEPS)
    assert results[0]["sent"] == [ring_bytes(make_model("mlp", 0), world_size)] * STEPS


def test_assign_buckets_reverse_order_and_threshold():
    params = [nn.Parameter(torch.zeros(n)) for n in (10, 20, 30, 40)]
    sizes = [[p.numel() for p in bucket] for bucket in assign_buckets(params, 200)]
    assert sizes == [[40, 30], [20, 10]]


def side_by_side_with_torch_ddp():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ours_model, torch_model = GPT(TINY_GPT, seed=rank), GPT(TINY_GPT, seed=rank)
    ours = BucketedDDP(ours_model, bucket_size_bytes=16 * 1024)
    theirs = nn.parallel.DistributedDataParallel(torch_model, bucket_cap_mb=16 / 1024)
    calls = {}
    for name, model, params in (("ours", ours, ours_model.parameters()), ("torch", theirs, torch_model.parameters())):
        optimizer = torch.optim.AdamW(params, lr=LR)
        for batch in batches("gpt", 12):
            optimizer.zero_grad()
            with zero_lab.CommLedger() as ledger:
                model(*shard_batch(batch, rank, world_size))[1].backward()
            optimizer.step()
        calls[name] = (ledger.calls("all_reduce"), ledger.sent_bytes("all_reduce"))
    identical = all(torch.equal(a, b) for a, b in zip(ours_model.parameters(), torch_model.parameters()))
    return identical, calls


def test_identical_to_torch_ddp_with_two_ranks():
    for identical, calls in zero_lab.launch(side_by_side_with_torch_ddp, 2, timeout=30):
        assert identical, "x/2 + y/2 is exact in fp32: the weights must match PyTorch DDP's bit for bit"
        assert calls["ours"][1] == calls["torch"][1] == ring_bytes(GPT(TINY_GPT), 2)


def mixed_precision(steps=3):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = GPT(TINY_GPT, seed=0).to(torch.bfloat16)
    ddp_model = BucketedDDP(model, bucket_size_bytes=4096)
    optimizer = MasterWeightOptimizer(model.parameters(), torch.optim.AdamW, lr=LR)
    for batch in batches("gpt", 12)[:steps]:
        optimizer.zero_grad()
        with zero_lab.CommLedger() as ledger:
            ddp_model(*shard_batch(batch, rank, world_size))[1].backward()
        optimizer.step()
    return ledger.sent_bytes(), model_state_bytes(model, optimizer).bytes, snapshot(model, "data")


def test_mixed_precision_is_2_2_12_bytes_and_half_the_traffic():
    psi = GPT(TINY_GPT).num_params()
    results = zero_lab.launch(mixed_precision, 2, timeout=30)
    fp32_trained = torch.cat([p.flatten() for p in single_process("gpt", 12)[1]])
    fp32_update = fp32_trained - torch.cat([p.detach().flatten() for p in GPT(TINY_GPT, seed=0).parameters()])
    for sent, memory, params in results:
        assert sent == Fraction(2 * 1, 2) * psi * 2  # 2(N-1)/N * psi * 2 bytes
        assert memory == model_states_per_device(psi, nd=2, stage=0, compute_bytes=2, master_bytes=4)
        assert all(p.dtype == torch.bfloat16 for p in params)
        # The bf16 run follows the fp32 one up to rounding: far closer than the distance travelled.
        bf16_trained = torch.cat([p.float().flatten() for p in params])
        assert (bf16_trained - fp32_trained).norm() < 0.2 * fp32_update.norm()


class OutOfOrder(nn.Module):
    """Registered second layer first: backward completes the buckets out of bucket order."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.second, self.first = nn.Linear(7, 3), nn.Linear(5, 7)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def launches_and_waits(kind, bucket_size_bytes):
    # The order of events in the second backward: "ready" (a gradient is final), "launch" (an
    # async all-reduce starts, with its bytes) and "wait" (someone waits for it).
    model = OutOfOrder(dist.get_rank()) if kind == "out_of_order" else make_model("mlp", dist.get_rank())
    events = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: events.append(("ready", None)))
    ddp_model = BucketedDDP(model, bucket_size_bytes)
    real_all_reduce = dist.all_reduce

    class Logged:
        def __init__(self, work):
            self.work = work

        def wait(self):
            events.append(("wait", None))
            return self.work.wait()

    def all_reduce(tensor, *args, async_op=False, **kwargs):
        if async_op:
            events.append(("launch", tensor.numel()))
            return Logged(real_all_reduce(tensor, *args, async_op=True, **kwargs))
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce
    try:
        for _ in range(2):
            events.clear()
            ddp_model(torch.randn(8, model.first.in_features if kind == "out_of_order" else 16)).square().mean().backward()
    finally:
        dist.all_reduce = real_all_reduce
    return events, [sum(p.numel() for p in bucket.params) for bucket in ddp_model.buckets]


@pytest.mark.parametrize("kind, bucket_size_bytes", [("mlp", 1024), ("out_of_order", 1)])
def test_buckets_launch_in_order_during_backward_and_wait_at_its_end(kind, bucket_size_bytes):
    for events, buckets in zero_lab.launch(launches_and_waits, 2, kind, bucket_size_bytes, timeout=30):
        kinds = [k for k, _ in events]
        last_ready = len(kinds) - 1 - kinds[::-1].index("ready")
        assert [n for k, n in events if k == "launch"] == buckets, "launched once each, in bucket order"
        assert kinds.count("wait") == len(buckets) and kinds.index("wait") > last_ready, "no wait inside backward"
        if kind == "mlp":
            assert kinds.index("launch") < last_ready, "a bucket is launched while backward still computes"


def test_who_holds_what_counts_live_tensors():
    model = MLP([4, 6, 2]).to(torch.bfloat16)
    optimizer = MasterWeightOptimizer(model.parameters(), torch.optim.AdamW)
    model(torch.randn(3, 4, dtype=torch.bfloat16)).float().sum().backward()
    optimizer.step()
    psi = model.num_params()
    assert held_elements(model, optimizer) == dict.fromkeys(("params", "grads", "master", "m", "v"), psi)
    half = {"params": psi, "grads": psi // 2, "master": psi // 2, "m": psi // 2, "v": 0}
    ax = draw_who_holds_what([held_elements(model, optimizer), half], full=dict.fromkeys(half, psi))
    assert [t.get_text() for t in ax.texts][:5] == ["all"] * 5 and [t.get_text() for t in ax.texts][5:] == ["all", "1/2", "1/2", "1/2", "—"]
