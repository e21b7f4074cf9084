"""Lesson 17, ZeRO with model parallelism: ranks on a mesh match init_device_mesh, Megatron's tensor-parallel GPT
equals one process at TP = 2 and 3 with Megatron's all-reduces, and so does torch.distributed.tensor.parallel on the
same model; typical wrong answers fail their graded cells."""

LESSON = "17_parallelism_3d"

import contextlib
import sys
import types

import pytest
import torch
import torch.distributed as dist

from graded_cells import assert_mutant_fails, assert_reference_full_and_learner_zero
from zero_lab import launch
from zero_lab.comm_ledger import CommLedger
from zero_lab.mesh import AxisLedger, Mesh, mesh_coordinates, mesh_groups
from zero_lab.models import GPT, GPTConfig
from zero_lab.tensor_parallel import tensor_parallel_gpt, torch_tensor_parallel_gpt

CONFIG = GPTConfig(vocab_size=32, n_layer=2, n_head=6, n_embd=24, block_size=8)


def test_worked_examples_of_the_mesh():
    assert mesh_coordinates(4, (2, 3)) == (1, 1) and mesh_coordinates(2, (2, 3)) == (0, 2)
    assert mesh_groups((2, 3), 1) == [[0, 1, 2], [3, 4, 5]] and mesh_groups((2, 3), 0) == [[0, 3], [1, 4], [2, 5]]
    assert mesh_coordinates(5, (2, 2, 2)) == (1, 0, 1) and mesh_groups((2, 2, 2), 1) == [[0, 2], [1, 3], [4, 6], [5, 7]]


def losses(way, tp_group_of_mesh, steps=2, batch=2):
    """AdamW steps of the course GPT, one process or split over the tp group (ours or torch's DTensor)."""
    model = GPT(CONFIG, seed=0)
    ledger = None
    if way != "one process":
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", tp_group_of_mesh, mesh_dim_names=("dp", "tp"))
        model = (tensor_parallel_gpt(model, mesh.get_group("tp")) if way == "ours"
                 else torch_tensor_parallel_gpt(model, mesh["tp"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    generator, result = torch.Generator().manual_seed(0), []
    for _ in range(steps):
        idx, targets = (torch.randint(CONFIG.vocab_size, (batch, CONFIG.block_size), generator=generator) for _ in "xy")
        if way != "one process":
            ledger = CommLedger().__enter__()
        _, loss = model(idx, targets)
        loss.backward()
        if ledger:
            ledger.__exit__(None, None, None)
        optimizer.step()
        optimizer.zero_grad()
        result.append(loss.item())
    return result, ledger.summary() if ledger else None


@pytest.mark.parametrize("mesh_shape", [(1, 3), (2, 2)])
def test_ours_and_torch_tensor_parallel_train_like_one_process(mesh_shape):
    expected, _ = losses("one process", None)
    b_s_h = 2 * CONFIG.block_size * CONFIG.n_embd
    for way in ("ours", "torch"):
        for rank, (got, ledger) in enumerate(launch(losses, mesh_shape[0] * mesh_shape[1], way, mesh_shape, timeout=120)):
            # tensor-parallel partial sums in another order, through 2 AdamW steps: a few ulps of fp32
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=f"{way}, rank {rank}")
            # Megatron: 2 all-reduces of b*s*h per layer forward, 2 backward, all within the tp group
            assert ledger == {"all_reduce": {"calls": 4 * CONFIG.n_layer, "elements": 4 * CONFIG.n_layer * b_s_h,
                                             "bytes": 16 * CONFIG.n_layer * b_s_h,
                                             "sent_bytes": 2 * (mesh_shape[1] - 1) / mesh_shape[1] * 16 * CONFIG.n_layer * b_s_h}}, \
                (way, rank, ledger)


def axis_bytes():
    mesh = Mesh((2, 2), ("dp", "tp"))
    with AxisLedger(mesh) as ledger:
        dist.all_reduce(torch.ones(10), group=mesh.group("tp"))
        dist.all_reduce(torch.ones(6), group=mesh.group("dp"))
        dist.all_reduce(torch.ones(4))
    return ledger.sent_by_axis(), mesh.ranks("dp"), mesh.ranks("tp"), mesh.coordinate("dp"), mesh.size("tp")


def test_the_axis_ledger_counts_each_axis_apart():
    for rank, (sent, dp, tp, dp_coordinate, tp_size) in enumerate(launch(axis_bytes, 4, timeout=60)):
        assert sent == {"tp": 2 * 1 / 2 * 40, "dp": 2 * 1 / 2 * 24, "world": 2 * 3 / 4 * 16}
        assert (dp, tp, dp_coordinate, tp_size) == ([rank % 2, rank % 2 + 2], [rank // 2 * 2, rank // 2 * 2 + 1],
                                                     rank // 2, 2)


def refusals():
    import zero_lab
    group = dist.new_group([0, 1])
    found = []
    for stage, options in ((1, {"max_grad_norm": 1.0}), (1, {"offload": "cpu"}), (1, {"find_unused_parameters": True}),
                           (2, {"offload": "cpu"}), (2, {"max_grad_norm": 1.0}), (3, {"max_grad_norm": 1.0})):
        try:
            zero_lab.prepare(GPT(CONFIG), torch.optim.AdamW, stage, group=group, **options)
            found.append(None)
        except NotImplementedError as error:
            found.append(str(error))
    # stage 3 over a group: what would gather over, or broadcast to, every rank is refused too
    model, optimizer = zero_lab.prepare(GPT(CONFIG), torch.optim.AdamW, 3, group=group)
    for call in (optimizer.consolidated_state_dict, lambda: optimizer.gathered_parameters(modifier_rank=0).__enter__()):
        try:
            call()
            found.append(None)
        except NotImplementedError as error:
            found.append(str(error))
    return found


def test_group_is_refused_where_it_is_not_built():
    for rank, found in enumerate(launch(refusals, 2, timeout=60)):
        assert all(f and "group=" in f for f in found), (rank, found)


def stage_1_over_a_group():
    """Stage 1 over the dp group of a 2 x 2 mesh, every tp rank holding the same (whole) MLP: each dp group trains
    like one process on its ranks' batches, and no collective leaves it."""
    mesh = Mesh((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.GELU(), torch.nn.Linear(7, 3))
    import zero_lab
    model, optimizer = zero_lab.prepare(model, torch.optim.SGD, 1, group=mesh.group("dp"), lr=0.1)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(mesh.coordinate("dp") + 10 * mesh.coordinate("tp")))
    with AxisLedger(mesh) as ledger:
        model(x).pow(2).mean().backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], ledger.sent_by_axis(), optimizer.rank, optimizer.world_size


def test_stage_1_over_a_group_averages_within_it():
    results = launch(stage_1_over_a_group, 4, timeout=60)
    for rank, (params, sent, group_rank, group_size) in enumerate(results):
        tp = rank % 2
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.GELU(), torch.nn.Linear(7, 3))
        xs = [torch.randn(4, 5, generator=torch.Generator().manual_seed(dp + 10 * tp)) for dp in (0, 1)]
        sum(model(x).pow(2).mean() for x in xs).div(2).backward()  # the mean over the dp group's two batches
        with torch.no_grad():
            expected = [p - 0.1 * p.grad for p in model.parameters()]
        for got, want in zip(params, expected):
            torch.testing.assert_close(got, want)  # a sum of two in another order: a few ulps at most
        assert set(sent) == {"dp"} and (group_rank, group_size) == (rank // 2, 2), (sent, group_rank, group_size)


def stages_2_and_3_on_a_mesh(stage, batch=4, steps=2):
    """The course GPT on a 2 x 2 (dp x tp) mesh, stage 2 or 3 over the dp group: parameters after `steps` SGD steps
    (tp slices), the last step's bytes per axis, this rank's model states and the slice's size."""
    from zero_lab.memory_ledger import model_state_bytes
    from zero_lab.tensor_parallel import my_rows, zero_on_mesh
    mesh = Mesh((2, 2), ("dp", "tp"))
    model, optimizer = zero_on_mesh(GPT(CONFIG, seed=0), mesh, torch.optim.SGD, stage, lr=0.1, momentum=0.9)
    held = sum(p.numel() for p in model.parameters()) if stage == 2 else sum(u.layout.numel for u in optimizer.units)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        idx, targets = (torch.randint(CONFIG.vocab_size, (batch, CONFIG.block_size), generator=generator) for _ in "xy")
        rows = my_rows(batch, mesh)
        with AxisLedger(mesh) as ledger:
            model(idx[rows], targets[rows])[1].backward()
            optimizer.step()
            optimizer.zero_grad()
    states = dict(model_state_bytes(model, optimizer).bytes)
    with optimizer.gathered_parameters() if stage == 3 else contextlib.nullcontext():
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
    padded = ([u.layout.padded_numel for u in optimizer.units] if stage == 3 else [g.layout.padded_numel
                                                                                  for g in optimizer.groups])
    return params, ledger.sent_by_axis(), states, held, padded


def tp_slice(name, whole, width, t, tp):
    """Rank tp's slice of the whole GPT's parameter that the tensor-parallel one `name` is (Megatron's split)."""
    full = whole[name.replace("mlp.0.", "mlp.c_fc.").replace("mlp.2.", "mlp.c_proj.")].detach()
    mine = torch.arange(width).tensor_split(t)[tp]
    if name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):  # the q, k and v of this rank's heads
        return full[torch.cat([mine, mine + width, mine + 2 * width])]
    if name.endswith(("attn.c_proj.weight", "mlp.2.weight")):  # row-parallel: its input features
        return full.tensor_split(t, 1)[tp]
    if name.endswith(("mlp.0.weight", "mlp.0.bias")):  # column-parallel: its output features
        return full.tensor_split(t, 0)[tp]
    return full  # embeddings, LayerNorms, the row-parallel biases: whole on every rank


@pytest.mark.parametrize("stage", [2, 3])
def test_stages_2_and_3_over_the_dp_group_train_like_one_process(stage):
    batch, steps, (d, t) = 4, 2, (2, 2)
    reference = GPT(CONFIG, seed=0)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        idx, targets = (torch.randint(CONFIG.vocab_size, (batch, CONFIG.block_size), generator=generator) for _ in "xy")
        reference(idx, targets)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    whole = dict(reference.named_parameters())
    for rank, (params, sent, states, held, padded) in enumerate(launch(stages_2_and_3_on_a_mesh, d * t, stage,
                                                                        timeout=120)):
        tp = rank % t
        for name, got in params.items():
            want = tp_slice(name, whole, CONFIG.n_embd, t, tp)
            # tp partial sums in another order, then 2 linear (SGD) updates: a few ulps
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=f"stage {stage}, rank {rank}, {name}")
        assert 0 <= sum(padded) - held < d * len(padded) and all(p % d == 0 for p in padded)  # padded to N_d each
        shard = sum(padded) // d  # elements of this rank's 1/N_d of the slice (each flat buffer padded to N_d)
        # fp32 SGD with momentum: weights (whole at stage 2), gradient shard, momentum shard; an fp32 master is the
        # weights' own shard, not a copy
        assert states == {"parameters": 4 * (held if stage == 2 else shard), "gradients": 4 * shard,
                          "master_params": 0, "optimizer_states": 4 * shard}, (rank, states)
        b_s_h = batch // d * CONFIG.block_size * CONFIG.n_embd
        tp_bytes = 4 * CONFIG.n_layer * b_s_h * 4 * 2 * (t - 1) / t  # Megatron's 2 + 2 all-reduces per layer
        # stage 2: a reduce-scatter and an all-gather of the slice; stage 3: a reduce-scatter, an all-gather in forward and
        # one in backward, and the tied embedding (vocab x h), used twice in forward (tokens and head), gathered again
        gathered = 2 * shard * d if stage == 2 else 3 * shard * d + CONFIG.vocab_size * CONFIG.n_embd
        dp_bytes = gathered * 4 * (d - 1) / d
        assert sent == {"dp": dp_bytes, "tp": tp_bytes}, (stage, rank, sent, dp_bytes, tp_bytes)


MUTANTS = {
    "coordinates with the first axis fastest (column-major)": (
        "    for size in reversed(shape):\n        rank, coordinate = divmod(rank, size)\n        coordinates.append(coordinate)\n"
        "    return tuple(reversed(coordinates))\n",
        "    for size in shape:\n        rank, coordinate = divmod(rank, size)\n        coordinates.append(coordinate)\n"
        "    return tuple(coordinates)\n", "mesh_groups"),
    "a group along an axis = ranks equal in that coordinate (the other axis' groups)": (
        "        elsewhere = mesh_coordinates(rank, shape)[:dim] + mesh_coordinates(rank, shape)[dim + 1:]\n",
        "        elsewhere = mesh_coordinates(rank, shape)[dim]\n", "mesh_groups"),
    "a rank off the mesh not refused": (
        "    if not 0 <= rank < math.prod(shape):\n", "    if False:\n", "mesh_groups"),
    "f and g swapped": (
        "        return F.linear(CopyToTensorParallel.apply(x, self.group), self.weight, self.bias)\n",
        "        return F.linear(ReduceFromTensorParallel.apply(x, self.group), self.weight, self.bias)\n", "tp_linear"),
    "f's backward without its all-reduce": (
        "        grad = grad.contiguous().clone()\n        dist.all_reduce(grad, group=ctx.group)\n",
        "        grad = grad.contiguous().clone()\n", "tp_linear"),
    "f's all-reduce over the whole world (wrong group)": (
        "        dist.all_reduce(grad, group=ctx.group)\n", "        dist.all_reduce(grad)\n", "tp_linear"),
    "g's all-reduce over the whole world (wrong group)": (
        "        dist.all_reduce(x, group=group)\n", "        dist.all_reduce(x)\n", "tp_linear"),
    "g's backward all-reduces again": (
        "        ### BEGIN SOLUTION\n        return grad, None\n",
        "        ### BEGIN SOLUTION\n        grad = grad.clone()\n        dist.all_reduce(grad)\n        return grad, None\n",
        "tp_linear"),
    "the row-parallel bias added before the sum (t times)": (
        "        out = ReduceFromTensorParallel.apply(F.linear(x, self.weight), self.group)\n",
        "        out = ReduceFromTensorParallel.apply(F.linear(x, self.weight, self.bias), self.group)\n", "tp_linear"),
    "column-parallel slices the input features": (
        "        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())\n",
        "        self.weight = nn.Parameter(linear.weight.detach()[:, rows].clone())\n", "tp_linear"),
    "even split by floor division (uneven widths lose features)": (
        "            rows = torch.arange(linear.out_features).tensor_split(dist.get_world_size(group))[dist.get_rank(group)]\n",
        "            per_rank = linear.out_features // dist.get_world_size(group)\n"
        "            rows = torch.arange(per_rank * dist.get_rank(group), per_rank * (dist.get_rank(group) + 1))\n",
        "tp_linear"),
    "uneven heads not refused": ("        if attn.n_head % size:\n", "        if False:\n", "tp_attention"),
    "q, k, v rows: one contiguous range of c_attn (the q of some heads, the k of others)": (
        "rows=torch.cat([mine, mine + width, mine + 2 * width])",
        "rows=torch.arange(3 * width).tensor_split(size)[rank]", "tp_attention"),
    "all heads kept in the local view (n_head not divided)": (
        "        self.n_head = attn.n_head // size\n", "        self.n_head = attn.n_head\n", "tp_attention"),
    "scale by the whole width's head size": (
        "        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))\n        att = F.softmax(",
        "        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1) * self.n_head)\n        att = F.softmax(",
        "tp_attention"),
    "ZeRO over every rank, not the dp group": (
        '    return zero_lab.prepare(model, optimizer_class, stage, group=mesh.group("dp"), **options)\n',
        '    return zero_lab.prepare(model, optimizer_class, stage, **options)\n', "zero_on_mesh"),
    "the stage not passed on (always stage 1)": (
        '    return zero_lab.prepare(model, optimizer_class, stage, group=mesh.group("dp"), **options)\n',
        '    return zero_lab.prepare(model, optimizer_class, 1, group=mesh.group("dp"), **options)\n', "zero_on_mesh"),
    "ZeRO over the tp group": (
        '    return zero_lab.prepare(model, optimizer_class, stage, group=mesh.group("dp"), **options)\n',
        '    return zero_lab.prepare(model, optimizer_class, stage, group=mesh.group("tp"), **options)\n', "zero_on_mesh"),
    "the model split over the dp group": ('    model = tensor_parallel_gpt(model, mesh.group("tp"))\n',
                                          '    model = tensor_parallel_gpt(model, mesh.group("dp"))\n', "zero_on_mesh"),
    "the batch split by the tp coordinate (tp and dp mixed up)": (
        '    return torch.arange(batch_size).tensor_split(mesh.size("dp"))[mesh.coordinate("dp")]\n',
        '    return torch.arange(batch_size).tensor_split(mesh.size("tp"))[mesh.coordinate("tp")]\n', "zero_on_mesh"),
    "the batch split over every rank": (
        '    return torch.arange(batch_size).tensor_split(mesh.size("dp"))[mesh.coordinate("dp")]\n',
        '    return torch.arange(batch_size).tensor_split(dist.get_world_size())[dist.get_rank()]\n', "zero_on_mesh"),
    "1F1B's warm-up one forward too long (P - p)": (
        "    warmup = min(stage.p - stage.rank - 1, stage.m)\n", "    warmup = min(stage.p - stage.rank, stage.m)\n",
        "pipeline_schedules"),
    "1F1B's warm-up without the cap at M": (
        "    warmup = min(stage.p - stage.rank - 1, stage.m)\n", "    warmup = stage.p - stage.rank - 1\n",
        "pipeline_schedules"),
    "GPipe's backwards in reverse order (the neighbours disagree on which gradient travels)": (
        "    for m in range(stage.m):\n        stage.backward(m)\n", "    for m in reversed(range(stage.m)):\n        stage.backward(m)\n",
        "pipeline_schedules"),
    "1F1B's steady state: backward before forward": (
        "        forward(m)\n        stage.backward(m - warmup)\n", "        stage.backward(m - warmup)\n        forward(m)\n",
        "pipeline_schedules"),
    "1F1B's drain counted from the warm-up, not from M - warm-up": (
        "    for m in range(stage.m - warmup, stage.m):\n", "    for m in range(warmup, stage.m):\n", "pipeline_schedules"),
    "tp bound by the heads only, not by the node": ("    for tp in divisors(gpus_per_node):\n",
                                                     "    for tp in divisors(model.heads):\n", "planner_search"),
    "pp bound by the GPUs, not by the layers": ("        for pp in divisors(model.layers):\n",
                                                "        for pp in divisors(gpus):\n", "planner_search"),
    "DeepSpeed's rule ignored (ZeRO-2/3 in a pipeline by default)": (
        "                if stage >= 2 and pp > 1 and not zero23_with_pipeline:\n", "                if False:\n",
        "planner_search"),
    "ZeRO-2/3 in a pipeline refused even when allowed": (
        "                if stage >= 2 and pp > 1 and not zero23_with_pipeline:\n",
        "                if stage >= 2 and pp > 1:\n", "planner_search"),
    "the reserve forgotten": ("                    if states + activations > memory_per_gpu - reserve:\n",
                              "                    if states + activations > memory_per_gpu:\n", "planner_search"),
    "activations not counted": ("                    if states + activations > memory_per_gpu - reserve:\n",
                                "                    if states > memory_per_gpu - reserve:\n", "planner_search"),
    "a batch that dp * micro-batch does not divide kept (M floored)": (
        "                    if global_batch % (dp * micro_batch):\n",
        "                    if global_batch < dp * micro_batch:\n", "planner_search"),
    "k not passed on": ("model_states_per_gpu(model.psi, tp, pp, dp, stage, k)",
                        "model_states_per_gpu(model.psi, tp, pp, dp, stage)", "planner_search"),
    "ranked by compute alone": (
        "    return sorted(plans, key=lambda p: (p.step_seconds, p.model_states + p.activations))\n",
        "    return sorted(plans, key=lambda p: p.seconds[\"compute\"])\n", "planner_search"),
    "a batch that dp does not divide split unevenly": (
        "    if batch_size % mesh.size(\"dp\"):\n", "    if False:\n", "zero_on_mesh"),
    "a Linear without bias not handled": (
        "        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach()[rows].clone())\n",
        "        self.bias = nn.Parameter(linear.bias.detach()[rows].clone())\n", "tp_linear"),
    "no causal mask": ("        att = F.softmax(att.masked_fill(~self.causal_mask[:T, :T], float(\"-inf\")), dim=-1)\n        return self.c_proj(",
                       "        att = F.softmax(att, dim=-1)\n        return self.c_proj(", "tp_attention"),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_typical_mistakes_fail_their_graded_cell(mutant, monkeypatch):
    # the planner's dataclasses look up their module (the cells' namespace, lesson_17_...) in sys.modules
    monkeypatch.setitem(sys.modules, f"lesson_{LESSON}", types.ModuleType(f"lesson_{LESSON}"))
    assert_mutant_fails(LESSON, *MUTANTS[mutant])


def test_hidden_tests_are_worth_points(graded):
    assert_reference_full_and_learner_zero(graded, LESSON, 22)


def subgroup_is_fake():
    group = dist.new_group([0, 1])
    return type(dist.distributed_c10d._get_default_group().inner).__name__, dist.get_world_size(group)


def test_subgroups_of_the_fake_world_are_fake_too():
    from zero_lab.scale import in_fake_world
    # a new_group's store comes back from C++ as a plain Store: the counted backend must still not open gloo
    assert in_fake_world([(1024, 0, subgroup_is_fake, ())])[0].value == ("FakeProcessGroup", 2)


def test_table_2_at_mp_2_counted_on_rank_0_of_128():
    from zero_lab.scale import in_fake_world
    from zero_lab.tensor_parallel import largest_on_mesh
    got = in_fake_world([(128, 0, largest_on_mesh, (2,))], timeout=120)[0].value
    psi, shard = got["psi"], -(-got["psi"] // 2 // 64)
    # the paper's P_os per rank with Psi/MP: bf16 weights and gradients whole (the flat buffer padded to 64 shards),
    # fp32 master and AdamW's moments on 1/64
    assert got["bytes"] == {"parameters": 2 * 64 * shard, "gradients": 2 * 64 * shard, "master_params": 4 * shard,
                            "optimizer_states": 8 * shard}
    assert sum(got["bytes"].values()) <= 32e9 and got["width"] % 2 == 0
    wider = 2 * 2 * (got["width"] + 2) ** 2  # the next width that splits over MP = 2 does not fit
    assert 4 * wider / 2 + 12 * wider / (2 * 64) > 32e9
    assert round(psi / 1e9, 1) == 15.3  # the paper prints 15.2B: 7.6B rounded, times 2


def test_table_2_other_columns_at_mp_2_counted_on_rank_0_of_128():
    from zero_lab.scale import in_fake_world
    from zero_lab.tensor_parallel import largest_on_mesh
    stage_2, stage_3 = (run.value for run in in_fake_world([(128, 0, largest_on_mesh, (2, 64, 32e9, 2, stage))
                                                             for stage in (2, 3)], timeout=120))
    shard = -(-stage_2["psi"] // 2 // 64)  # P_os+g: bf16 weights whole (padded to 64 shards), the rest on 1/64
    assert stage_2["bytes"] == {"parameters": 2 * 64 * shard, "gradients": 2 * shard, "master_params": 4 * shard,
                                "optimizer_states": 8 * shard}
    shard = 4 * -(-stage_3["width"] ** 2 // 2 // 64)  # P_os+g+p: four Linears, each its own unit padded to 64 shards
    assert stage_3["bytes"] == {"parameters": 2 * shard, "gradients": 2 * shard, "master_params": 4 * shard,
                                "optimizer_states": 8 * shard}
    for got, per_parameter in ((stage_2, 2 + 14 / 64), (stage_3, 16 / 64)):  # bytes per parameter of Psi / MP
        wider = 2 * 2 * (got["width"] + 2) ** 2  # the next width that splits over MP = 2 does not fit
        assert sum(got["bytes"].values()) <= 32e9 < per_parameter * wider / 2
    # the paper prints 28.8B (14.4B rounded, times 2) and 256B
    assert (round(stage_2["psi"] / 1e9, 1), round(stage_3["psi"] / 1e9)) == (28.8, 256)


def pipeline_grads(way, kind, micro_batches=4, rows=2):
    """This stage's gradients after one step of the MLP cut into world-size stages: our schedule or torch's."""
    from zero_lab.models import MLP
    from zero_lab.pipeline import PipeStage, gpipe, one_f_one_b, stage_of, torch_schedule
    layers = stage_of(MLP([6, 10, 10, 10, 3], seed=0).layers, dist.get_world_size(), dist.get_rank())
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(rows, 6, generator=generator) for _ in range(micro_batches)]
    targets = [torch.randn(rows, 3, generator=generator) for _ in range(micro_batches)]
    if way == "torch":
        torch_schedule(layers, micro_batches, kind, inputs, targets, torch.nn.functional.mse_loss)
    else:
        stage = PipeStage(layers, micro_batches, torch.nn.functional.mse_loss)
        (gpipe if kind == "gpipe" else one_f_one_b)(stage, inputs, targets)
        stage.flush()
    return [p.grad for p in layers.parameters()]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_our_schedules_and_torch_pipelining_give_one_process_gradients(kind):
    from zero_lab.models import MLP
    from zero_lab.pipeline import stage_of
    model = MLP([6, 10, 10, 10, 3], seed=0)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.cat([torch.randn(2, 6, generator=generator) for _ in range(4)])
    targets = torch.cat([torch.randn(2, 3, generator=generator) for _ in range(4)])
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    for way in ("ours", "torch"):
        for rank, grads in enumerate(launch(pipeline_grads, 3, way, kind, timeout=60)):
            for got, want in zip(grads, [p.grad for p in stage_of(model.layers, 3, rank).parameters()]):
                # 4 micro-batches' partial means summed in another order than one batch: a few ulps of fp32
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=f"{way}, {kind}, stage {rank}")


GPT3 = dict(psi=175e9, layers=96, hidden=12288, heads=96, seq_len=2048)  # Megatron-LM's examples/gpt3 script
CLUSTER = dict(flops=300e12, intra_node=200e9, inter_node=25e9)  # assumed figures: the tests check the arithmetic


def test_every_plan_fits_splits_the_world_and_is_ranked_by_its_cost():
    from zero_lab.planner import Transformer, activation_bytes, model_states_per_gpu, plan
    model = Transformer(**GPT3)
    plans = plan(model, 1024, 80e9, 1536, reserve=8e9, **CLUSTER)
    assert plans, "175B on 1024 GPUs of 80 GB: some configuration fits"
    for p in plans:
        assert p.tp * p.pp * p.dp == 1024 and p.tp <= 8 and model.heads % p.tp == 0 and model.layers % p.pp == 0
        assert p.dp * p.micro_batch * p.micro_batches == 1536
        assert p.stage < 2 or p.pp == 1, "DeepSpeed refuses ZeRO-2/3 with a pipeline"
        assert p.model_states == model_states_per_gpu(model.psi, p.tp, p.pp, p.dp, p.stage)
        assert p.activations == activation_bytes(model, p.pp, p.micro_batch, p.micro_batches)
        assert p.model_states + p.activations <= 72e9
        assert p.bubble == (p.pp - 1) / (p.micro_batches + p.pp - 1)
    costs = [p.step_seconds for p in plans]
    assert costs == sorted(costs)
    assert any((p.tp, p.pp, p.dp, p.stage) == (8, 16, 8, 0) for p in plans), "Megatron-LM's t = 8, p = 16 fits"
    assert plan(model, 1024, 4e9, 1536, **CLUSTER) == [], "nothing fits 4 GB per GPU"


def test_the_cost_model_terms_follow_their_formulas():
    from zero_lab.planner import Transformer, step_seconds
    model = Transformer(**GPT3)
    got = step_seconds(model, tp=8, pp=16, dp=8, stage=1, micro_batch=1, micro_batches=192, **CLUSTER)
    activation = 2 * 2048 * 12288  # one layer's input for one sequence, bf16 bytes
    tokens = 8 * 192 * 2048
    assert got["compute"] == pytest.approx(8 * 175e9 * tokens / (1024 * 300e12) * (192 + 15) / 192)
    assert got["tp"] == pytest.approx(6 * 6 * 192 * activation * 2 * 7 / 8 / 200e9)  # 6 all-reduces, 6 layers
    assert got["pp"] == pytest.approx(2 * 192 * activation / 25e9)
    assert got["dp"] == pytest.approx(2 * 175e9 / 128 * 2 * 7 / 8 / 25e9)  # ZeRO-1: 2 psi' on the ring, bf16
    stage_3 = step_seconds(model, tp=8, pp=1, dp=128, stage=3, micro_batch=1, micro_batches=4, **CLUSTER)
    # ZeRO-3 with 4 micro-batches: two all-gathers and a reduce-scatter of psi' bf16 elements each
    assert stage_3["dp"] == pytest.approx(3 * 4 * 2 * 175e9 / 8 * 127 / 128 / 25e9)


def test_days_and_mfu_follow_the_step_time():
    from zero_lab.planner import Plan, Transformer, model_flops_utilization, plan, training_days
    model = Transformer(**GPT3)
    # 8TP/(nX): GPT-3 175B on 300B tokens, 1024 GPUs at 140 TFLOP/s each, about 34 days
    tokens = 8 * 192 * 1 * 2048  # dp * M * micro-batch * sequence
    step = 8 * 175e9 * tokens / (1024 * 140e12)  # the step that X = 140 TFLOP/s per GPU gives
    paper = Plan(8, 16, 8, 1, 1, 192, 0.0, 0.0, 15 / 207, {"compute": step})
    assert round(training_days(model, paper, 300e9)) == 34
    best = plan(model, 1024, 80e9, 1536, reserve=8e9, micro_batch_sizes=(1,), **CLUSTER)[0]
    bubble = best.micro_batches / (best.micro_batches + best.pp - 1)
    # 6 of the 8 psi flops per token are the model's; the bubble and the other terms take the rest
    assert model_flops_utilization(model, best, CLUSTER["flops"]) == pytest.approx(
        6 / 8 * bubble * best.seconds["compute"] / best.step_seconds)


def test_zero_2_and_3_in_a_pipeline_are_planned_when_allowed():
    from zero_lab.planner import Transformer, plan, step_seconds
    model = Transformer(**GPT3)
    plans = plan(model, 1024, 80e9, 1536, reserve=8e9, micro_batch_sizes=(1,), zero23_with_pipeline=True, **CLUSTER)
    piped = [p for p in plans if p.stage == 3 and p.pp > 1]
    assert piped, "ZeRO-3 with a pipeline fits somewhere once allowed"
    for p in piped:  # all-gathered twice and reduce-scattered once per micro-batch
        assert p.seconds == step_seconds(model, p.tp, p.pp, p.dp, 3, 1, p.micro_batches, **CLUSTER)


def clipped_on_a_mesh(stage, max_norm, batch=4):
    """One SGD step of the GPT on a 2 x 2 mesh, clipped by clip_grad_norm_on_mesh: the norm and the parameters."""
    from zero_lab.tensor_parallel import clip_grad_norm_on_mesh, my_rows, zero_on_mesh
    mesh = Mesh((2, 2), ("dp", "tp"))
    model, optimizer = zero_on_mesh(GPT(CONFIG, seed=0), mesh, torch.optim.SGD, stage, lr=0.1)
    generator = torch.Generator().manual_seed(1)
    idx, targets = (torch.randint(CONFIG.vocab_size, (batch, CONFIG.block_size), generator=generator) for _ in "xy")
    rows = my_rows(batch, mesh)
    model(idx[rows], targets[rows])[1].backward()
    norm = clip_grad_norm_on_mesh(model, optimizer, mesh, max_norm)
    optimizer.step()
    return float(norm), {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [1, 2])
def test_clipping_on_a_mesh_is_one_process_clipping(stage):
    batch, whole = 4, GPT(CONFIG, seed=0)
    generator = torch.Generator().manual_seed(1)
    idx, targets = (torch.randint(CONFIG.vocab_size, (batch, CONFIG.block_size), generator=generator) for _ in "xy")
    whole(idx, targets)[1].backward()
    norm = float(torch.nn.utils.clip_grad_norm_(whole.parameters(), float("inf")))
    max_norm = norm / 3  # so that clipping binds: every gradient scaled by about 1/3
    torch.nn.utils.clip_grad_norm_(whole.parameters(), max_norm)
    with torch.no_grad():
        for p in whole.parameters():
            p -= 0.1 * p.grad
    params = dict(whole.named_parameters())
    for rank, (got_norm, got) in enumerate(launch(clipped_on_a_mesh, 4, stage, max_norm, timeout=120)):
        # sums of squares in another order over 4 ranks: a relative ulp or few of fp32
        assert got_norm == pytest.approx(norm, rel=1e-5), (rank, got_norm, norm)
        for name, value in got.items():
            # tp partial sums in another order, then one clipped SGD update: a few ulps
            torch.testing.assert_close(value, tp_slice(name, params, CONFIG.n_embd, 2, rank % 2), atol=1e-5,
                                       rtol=1e-4, msg=f"stage {stage}, rank {rank}, {name}")
