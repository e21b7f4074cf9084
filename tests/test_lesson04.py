"""Lesson 04, ZeRO stage 2: gradients reduce-scattered during backward, only the shard kept."""

import contextlib
import io
import time
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from sharded_training import (ADAMW, SIZES, TINY_GPT, assert_close, bytes_per_step, gpt_batches, gpt_groups,
                              gpt_groups_noise, gpt_loss, gpt_with_groups, gpt_with_groups_single_process, mlp_batches,
                              mlp_loss, single_process, train, weights)
import zero_lab
from zero_lab import launch
from zero_lab.data import shard_batch
from zero_lab.memory_ledger import model_state_bytes
from zero_lab.models import GPT, MLP
from zero_lab.prepare import prepare
from zero_lab.pictures import draw_comm_timeline
from zero_lab.timeline import backward_timeline, record_gradients_ready, recording_collectives
from zero_lab.zero1 import ShardLayout
from zero_lab.zero2 import bucket_ranges, rank_slices

def _train_mlp(stage=2, micro_steps=1, **options):
    model, optimizer = prepare(MLP(SIZES, seed=0), torch.optim.AdamW, stage=stage, **ADAMW, **options)
    norms = []
    for batch in mlp_batches():
        train(model, optimizer, [batch], mlp_loss, micro_steps)
        norms.append(getattr(optimizer, "last_grad_norm", None))
    return weights(model), norms, type(optimizer).__name__


@pytest.mark.parametrize("world_size, bucket_numel", [(1, 9), (2, 1), (3, 9), (3, 50), (4, 1000)])
def test_matches_single_process_adamw(world_size, bucket_numel):
    """Bucket smaller than every parameter (1), equal to a bias (9), in between (50), larger than the model."""
    results = launch(_train_mlp, world_size, bucket_numel=bucket_numel, timeout=60)
    assert all(kind == "Zero2Optimizer" for _, _, kind in results)
    assert_close([w for w, _, _ in results], single_process()[0])


@pytest.mark.parametrize("world_size, micro_steps", [(2, 3), (4, 3), (3, 2)])
def test_accumulation_is_one_step_on_the_whole_batch(world_size, micro_steps):
    results = launch(_train_mlp, world_size, micro_steps=micro_steps, bucket_numel=9, timeout=60)
    assert_close([w for w, _, _ in results], single_process()[0])


def test_matches_stage_1():
    zero1 = launch(_train_mlp, 3, stage=1, micro_steps=2, timeout=60)
    zero2 = launch(_train_mlp, 3, stage=2, micro_steps=2, bucket_numel=20, timeout=60)
    assert_close([w for w, _, _ in zero2], zero1[0][0])


def _train_with_no_sync(micro_steps, frozen_first_layer=False):
    """Every backward but a step's last inside optimizer.no_sync(): weights, reduce-scatter bytes per step."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = MLP(SIZES, seed=0)
    if frozen_first_layer:
        model.layers[0].requires_grad_(False)
    model, optimizer = prepare(model, torch.optim.AdamW, stage=2, bucket_numel=9, **ADAMW)
    sent = []
    for batch in mlp_batches():
        micro_batches = list(zip(*(t.chunk(micro_steps) for t in shard_batch(batch, rank, world_size))))
        with zero_lab.CommLedger() as ledger:
            for i, micro_batch in enumerate(micro_batches):
                with optimizer.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
                    (mlp_loss(model, micro_batch) / micro_steps).backward()
        sent.append(ledger.sent_bytes("reduce_scatter"))
        optimizer.step()
        optimizer.zero_grad()
    with pytest.raises(RuntimeError, match="inside optimizer.no_sync"), optimizer.no_sync():
        optimizer.step()
    return weights(model), sent, optimizer.require_gradient_sync


@pytest.mark.parametrize("world_size, micro_steps", [(1, 3), (2, 3), (3, 2), (4, 3)])
def test_no_sync_accumulates_locally_and_reduce_scatters_once(world_size, micro_steps):
    results = launch(_train_with_no_sync, world_size, micro_steps, timeout=60)
    assert_close([w for w, _, _ in results], single_process()[0])
    padded = ShardLayout(MLP(SIZES).num_params(), world_size).padded_numel
    for _, sent, sync_after in results:
        assert set(sent) == {Fraction(world_size - 1, world_size) * padded * 4} and sync_after  # one backward's worth


def test_no_sync_with_a_frozen_layer_is_plain_accumulation():
    with_no_sync = launch(_train_with_no_sync, 3, 2, True, timeout=60)
    plain = launch(_train_mlp_frozen, 3, timeout=60)
    assert_close([w for w, _, _ in with_no_sync], plain[0])


def _train_mlp_frozen():
    model = MLP(SIZES, seed=0)
    model.layers[0].requires_grad_(False)
    model, optimizer = prepare(model, torch.optim.AdamW, stage=2, bucket_numel=9, **ADAMW)
    train(model, optimizer, mlp_batches(), mlp_loss, micro_steps=2)
    return weights(model)


@pytest.mark.parametrize("world_size", [2, 3])
def test_clipping_uses_the_global_norm(world_size):
    expected, expected_norms = single_process(max_grad_norm=0.5)
    assert max(expected_norms) > 0.5, "the test must actually clip"
    results = launch(_train_mlp, world_size, max_grad_norm=0.5, bucket_numel=9, timeout=60)
    assert_close([w for w, _, _ in results], expected)
    for _, norms, _ in results:
        assert [n.item() for n in norms] == pytest.approx(expected_norms, rel=1e-5)


def test_bucket_ranges_tile_the_buffer_in_backward_order():
    assert bucket_ranges([54, 9, 45, 5], 114, 10) == [(63, 114, [2, 3]), (0, 63, [0, 1])]
    assert bucket_ranges([54, 9, 45, 5], 114, 9) == [(63, 114, [2, 3]), (54, 63, [1]), (0, 54, [0])]
    assert bucket_ranges([54, 9, 45, 5], 114, 1000) == [(0, 114, [0, 1, 2, 3])]
    assert rank_slices(63, 114, ShardLayout(113, 3)) == [(63, 63), (63, 76), (76, 114)]


def test_param_groups_frozen_and_tied_parameters():
    expected, frozen_before = gpt_with_groups_single_process()
    results = launch(gpt_with_groups, 3, 2, bucket_numel=64, timeout=60)
    # The key biases' gradient is rounding noise: within AdamW's drift (gpt_groups_noise); the rest, assert_close's default.
    assert_close([w for w, _, _ in results], expected, noise=gpt_groups_noise())
    padded = [ShardLayout(sum(p.numel() for p in g["params"]), 3).padded_numel for g in gpt_groups(GPT(TINY_GPT))]
    for w, tied, memory in results:
        assert tied, "the LM head must still share the embedding's tensor"
        assert torch.equal(w["transformer.wpe.weight"], frozen_before), "a frozen parameter changed"
        # Gradient shards and Adam states for the trainable elements only, sharded.
        assert memory["gradients"] == 4 * sum(padded) // 3 and memory["optimizer_states"] == 8 * sum(padded) // 3


def _partly_unused(stage):
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(dict(used=torch.nn.Linear(4, 3), unused=torch.nn.Linear(3, 3)))
    model, optimizer = prepare(model, torch.optim.AdamW, stage=stage, lr=0.1, find_unused_parameters=True,
                               **({"bucket_numel": 5} if stage == 2 else {}))
    x = shard_batch(torch.linspace(-1, 1, 24).reshape(6, 4), dist.get_rank(), dist.get_world_size())
    for _ in range(3):
        model["used"](x).pow(2).mean().backward()  # the second Linear never gets a gradient
        optimizer.step()
        optimizer.zero_grad()
    return weights(model)


def test_unused_parameters_stay_as_they_are_like_stage_1():
    stage1 = launch(_partly_unused, 3, 1, timeout=60)[0]
    assert_close(launch(_partly_unused, 3, 2, timeout=60), stage1)
    torch.manual_seed(0)
    torch.nn.Linear(4, 3)
    unused = torch.nn.Linear(3, 3)  # as _partly_unused made it: torch.optim never updates it
    assert torch.equal(stage1["unused.weight"], unused.weight.detach()) and torch.equal(stage1["unused.bias"], unused.bias.detach())


def _train_with_checkpoint(stop_after, param_dtype):
    batches = mlp_batches()

    def fresh(seed):
        return prepare(MLP(SIZES, seed=seed), torch.optim.AdamW, stage=2, param_dtype=param_dtype,
                       bucket_numel=20, max_grad_norm=1.0, **ADAMW)

    model, optimizer = fresh(seed=0)
    if stop_after is None:  # never stopping
        train(model, optimizer, batches, mlp_loss)
        return weights(model), [g.master.clone() for g in optimizer.groups], None
    train(model, optimizer, batches[:stop_after], mlp_loss)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    model, optimizer = fresh(seed=123)  # a fresh start from other weights: all must come from the checkpoint
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    train(model, optimizer, batches[stop_after:], mlp_loss)
    return weights(model), [g.master.clone() for g in optimizer.groups], optimizer.consolidated_state_dict(dst=0)


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_resume_is_the_same_as_never_stopping(param_dtype):
    straight = launch(_train_with_checkpoint, 3, None, param_dtype, timeout=60)
    resumed = launch(_train_with_checkpoint, 3, 4, param_dtype, timeout=60)
    for (w_straight, m_straight, _), (w_resumed, m_resumed, _) in zip(straight, resumed):
        for name in w_straight:
            assert torch.equal(w_straight[name], w_resumed[name]), name
        for a, b in zip(m_straight, m_resumed):
            assert torch.equal(a, b), "fp32 masters differ after resuming"
    full = resumed[0][2]
    assert all(r[2] is None for r in resumed[1:]), "consolidated on rank 0 only"
    # The fp32 weights are the concatenated masters of the ranks, and load into plain torch.
    masters = torch.cat([m for _, ms, _ in resumed for m in ms])
    assert torch.equal(torch.cat([v.reshape(-1) for v in full["model"].values()]), masters[:MLP(SIZES).num_params()])
    model = MLP(SIZES)
    model.load_state_dict(full["model"])
    torch.optim.AdamW(model.parameters(), **ADAMW).load_state_dict(full["optimizer"])


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_communication_is_ddp_s_two_psi(world_size):
    sizes = [6, 10, 6]  # 136 parameters: 60, 10, 60, 6
    psi = MLP(sizes).num_params()
    padded = ShardLayout(psi, world_size).padded_numel
    ring = Fraction(world_size - 1, world_size) * 4  # bytes a rank sends per fp32 element, per half
    ddp, _, _ = launch(bytes_per_step, world_size, 0, sizes, None, timeout=60)[0]
    assert sum(kind["sent_bytes"] for kind in ddp.values()) == float(2 * ring * psi)
    for bucket_numel, buckets in [(1, 4), (10, 3), (70, 2), (1000, 1)]:
        zero2, _, count = launch(bytes_per_step, world_size, 2, sizes, bucket_numel, timeout=60)[0]
        assert set(zero2) == {"reduce_scatter", "all_gather"}
        assert count == buckets and zero2["reduce_scatter"]["calls"] == buckets, "one reduce-scatter per bucket"
        assert zero2["all_gather"]["calls"] == 1
        assert zero2["reduce_scatter"]["sent_bytes"] == zero2["all_gather"]["sent_bytes"] == ring * padded
        if psi % world_size == 0:
            assert sum(kind["sent_bytes"] for kind in zero2.values()) == float(2 * ring * psi), "exactly DDP's bytes"


def _memory(bucket_numel):
    model = GPT(TINY_GPT, seed=0)
    model, optimizer = prepare(model, torch.optim.AdamW, stage=2, param_dtype=torch.bfloat16, bucket_numel=bucket_numel, lr=1e-3)
    during = []
    for p in model.parameters():  # after the optimizer's hooks: what is left once each gradient is handled
        p.register_post_accumulate_grad_hook(lambda _: during.append(model_state_bytes(model, optimizer).bytes["gradients"]))
    batch = shard_batch(gpt_batches(1)[0], dist.get_rank(), dist.get_world_size())
    gpt_loss(model, batch).backward()
    after_backward = model_state_bytes(model, optimizer).bytes
    leftover = [name for name, p in model.named_parameters() if p.grad is not None]
    optimizer.step()
    largest_bucket = max(b.stop - b.start for b in optimizer.buckets)
    return model_state_bytes(model, optimizer).bytes, after_backward, max(during), leftover, largest_bucket


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_memory_is_2psi_plus_14psi_over_nd(world_size):
    psi = GPT(TINY_GPT).num_params()
    padded = ShardLayout(psi, world_size).padded_numel
    for after_step, after_backward, peak, leftover, largest_bucket in launch(_memory, world_size, 100, timeout=60):
        assert after_step == {"parameters": 2 * padded, "gradients": 2 * padded // world_size,
                              "master_params": 4 * padded // world_size, "optimizer_states": 8 * padded // world_size}
        assert sum(after_step.values()) == 2 * padded + 14 * padded // world_size
        assert 2 * psi + Fraction(14 * psi, world_size) <= sum(after_step.values())
        assert not leftover and after_backward["gradients"] == 2 * padded // world_size, "only the shard after backward"
        # During backward: the shard, a bucket being filled, the staging copy and piece of the one in flight.
        assert peak <= 2 * padded // world_size + 3 * 2 * largest_bucket


def _gradient_memory_stage_1_vs_2(stage):
    model = MLP([32] * 9, seed=0)  # 8 layers of 1,056 elements
    model, optimizer = prepare(model, torch.optim.AdamW, stage=stage, lr=1e-3, **({"bucket_numel": 1000} if stage == 2 else {}))
    during = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _: during.append(model_state_bytes(model, optimizer).bytes["gradients"]))
    x = shard_batch(torch.randn(12, 32), dist.get_rank(), dist.get_world_size())
    model(x).pow(2).mean().backward()
    return max(during)


def test_peak_gradient_memory_is_bounded_by_the_bucket_size():
    layer_bytes, full = 1056 * 4, 8 * 1056 * 4
    stage1 = launch(_gradient_memory_stage_1_vs_2, 2, 1, timeout=60)
    stage2 = launch(_gradient_memory_stage_1_vs_2, 2, 2, timeout=60)
    assert all(peak == full for peak in stage1), "stage 1 holds the full gradient"
    for peak in stage2:  # the shard + one layer filling + one in flight (staging + piece)
        assert peak <= full // 2 + 3 * layer_bytes < full


def _prepare_errors():
    with pytest.raises(ValueError, match="bucket_numel"):
        prepare(MLP(SIZES), torch.optim.AdamW, stage=2, bucket_numel=0, lr=1e-3)
    with pytest.raises(TypeError, match="stage 2"):
        prepare(MLP(SIZES), torch.optim.AdamW, stage=1, bucket_numel=10, lr=1e-3)
    return True


def test_prepare_checks_the_bucket_size():
    assert launch(_prepare_errors, 1, timeout=60) == [True]


def _backward_events(stage):
    model = MLP([16, 32, 32, 32, 4], seed=0)
    events = []
    record_gradients_ready(model, events)  # before the optimizer's hooks
    model, optimizer = prepare(model, torch.optim.AdamW, stage=stage, lr=1e-3, **({"bucket_numel": 600} if stage == 2 else {}))
    loss = model(shard_batch(torch.randn(8, 16), dist.get_rank(), dist.get_world_size())).pow(2).mean()
    with recording_collectives(events, "reduce_scatter", "reduce_scatter_single"):
        start = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        optimizer.reduce_gradients()  # stage 1 reduce-scatters here
    return backward_timeline(events, start, end)


def test_timeline_stage_2_reduces_during_backward_stage_1_after():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    for stage in (1, 2):
        for timeline in launch(_backward_events, 2, stage, timeout=60):
            kinds = [kind for _, kind, _ in timeline["events"]]
            last_ready = len(kinds) - 1 - kinds[::-1].index("ready")
            launches = [i for i, kind in enumerate(kinds) if kind == "launch"]
            assert kinds.count("done") == len(launches), "every collective is marked done"
            if stage == 1:  # one blocking reduce-scatter, after backward: the rank waits for all of it
                assert len(launches) == 1 and launches[0] > last_ready and kinds.count("wait") == 1
            else:  # one per bucket (MLP layers of 544, 1056, 1056, 132 elements: 3 buckets), the first during backward
                assert len(launches) == 3 and launches[0] < last_ready and kinds.count("wait") == 3
            _, ax = plt.subplots()
            last_gradient, waited = draw_comm_timeline(ax, 0, timeline, collective="reduce-scatter")
            assert 0 <= last_gradient <= timeline["backward_ms"] and waited >= 0
            plt.close("all")


# Typical wrong versions of the stage's algorithm (exercises 4-7): each must fail a graded test cell.
_HOOK_QUEUE = """        if not self.final_callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self.final_callback_queued = True
"""
_HOOK_LOOP = """        while self.next_bucket < len(self.buckets) and self._is_complete(self.buckets[self.next_bucket]):
            self._launch(self.buckets[self.next_bucket])
            self.next_bucket += 1
"""
_LAUNCH_WAITS = """        if self.in_flight is not None:  # one bucket in flight: gradient memory stays bounded
            self._accumulate(self.in_flight)
"""
_NO_SYNC_RETURN = """        if not self.require_gradient_sync:  # no_sync(): the gradient stays whole in param.grad, and adds up
            return
"""
MUTANTS = {
    "the end-of-backward callback is never queued": ([(_HOOK_QUEUE, "")], {"gradient_hook", "gradient_shards"}),
    "every bucket launched at the end of backward": ([(_HOOK_LOOP, "        pass\n")], {"gradient_hook", "gradient_shards"}),
    "the bucket in flight is not finished first": ([(_LAUNCH_WAITS, "")], {"bucket_launch", "gradient_shards"}),
    "ready sets never cleared": ([("        bucket.ready.clear()\n        ### END SOLUTION", "        ### END SOLUTION")],
                                {"bucket_launch", "gradient_shards"}),
    # exercise 7
    "no_sync() still sends: the hook does not return": ([(_NO_SYNC_RETURN, "")], {"no_sync"}),
    "no_sync() marks the parameter ready before returning": (
        [(_NO_SYNC_RETURN, ""), ("        self.bucket_of[param].ready.add(param)\n",
                                 "        self.bucket_of[param].ready.add(param)\n" + _NO_SYNC_RETURN)], {"no_sync"}),
    "no_sync() not switched back when its block raises": (
        [("        try:\n            yield\n        finally:\n            self.require_gradient_sync = True\n",
          "        yield\n        self.require_gradient_sync = True\n")], {"no_sync"}),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_wrong_algorithms_fail_graded_cells(mutant):
    """The lesson's export and test cells run as grading runs them, with one method broken."""
    import nbformat

    from zero_lab.course_tools.implementation import REPO

    replacements, must_fail = MUTANTS[mutant]
    cells = nbformat.read(REPO / "solutions" / "04_zero2" / "04_zero2.ipynb", as_version=4).cells
    namespace, failed = {"__name__": "lesson04"}, set()
    for cell in cells:
        source, tags = cell.source, cell.metadata.get("tags", [])
        if cell.cell_type != "code" or tags or "with needs_exercises()" in source:
            continue  # demo cells and worked examples
        if "class Zero2Optimizer" in source:
            for old, new in replacements:
                assert old in source, f"the mutant {mutant!r} no longer applies to the notebook"
                source = source.replace(old, new)
        test_id = source.split()[2] if source.startswith("#| test ") else None
        if test_id in (None, "bucket_launch", "gradient_hook", "finish_backward", "gradient_shards") or test_id in must_fail:
            try:
                exec(compile(source, test_id or "cell", "exec"), namespace)
            except (AssertionError, zero_lab.RankFailed):
                failed.add(test_id)
        if test_id == ("no_sync" if "no_sync" in must_fail else "gradient_shards"):
            break
    assert must_fail <= failed, f"{mutant}: only {sorted(failed)} failed"
