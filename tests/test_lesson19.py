"""Lesson 19, mixture of experts: the MoE GPT over 2, 3 and 4 expert-parallel ranks equals one process; a stage-3 run
whose MoE block skips idle experts is named (the bare all-gather version hangs and the launcher names it), the
leaf-unit fix alone trains wrong while experts are skipped; lesson 15's canary flags an expert averaged over the
wrong group; typical wrong answers fail their graded cells."""

LESSON = "19_moe"

import pytest
import torch
import torch.distributed as dist

import zero_lab
from graded_cells import assert_mutant_fails, assert_reference_full_and_learner_zero
from zero_lab.canary import update_error
from zero_lab.models import GPTConfig
from zero_lab.moe_dispatch import moe_balance_loss, moe_gpt
from zero_lab.moe_router import expert_loads, route
from zero_lab.moe_scale import count_moe_states, deepseek_v3_parameters
from zero_lab.moe_zero import make_expert_groups, moe_block_units, moe_param_groups, moe_state_bytes

CONFIG = GPTConfig(vocab_size=16, n_layer=2, n_head=2, n_embd=8, block_size=4)


def test_worked_examples_of_the_router():
    logits = torch.tensor([[3.0, 1.0, 0.0], [2.0, 0.5, 0.0], [4.0, 0.0, 1.0], [0.0, 2.0, 1.0], [0.0, 1.0, 3.0]])
    assert route(logits, 1, 1.0).kept.reshape(-1).tolist() == [True, True, False, True, True]
    assert route(logits, 2, None).kept.all()


def tokens(rank, seed=0):
    g = torch.Generator().manual_seed(100 * seed + rank)
    rows = 1 + rank  # uneven batches: 1 .. 4 sequences
    return torch.randint(16, (rows, 4), generator=g), torch.randint(16, (rows, 4), generator=g)


def named(model, grads=True):
    """Parameters (and gradients) by one-process name (local expert j of a layer is expert first_expert + j)."""
    out = {}
    for name, p in model.named_parameters():
        if ".experts." in name:
            layer, rest = name.split(".experts.")
            j, tail = rest.split(".", 1)
            name = f"{layer}.experts.{model.get_submodule(layer).first_expert + int(j)}.{tail}"
        out[name] = (p.detach().clone(), p.grad.clone()) if grads else p.detach().clone()
    return out


EP_SIZES, RANKS = (2, 3, 4), 4


def ep_blocks(size):
    """The world's ranks in consecutive expert-parallel groups of `size` (size 3 of 4: [0, 1, 2] and [3])."""
    return [list(range(start, min(start + size, RANKS))) for start in range(0, RANKS, size)]


def expert_parallel_gpt(capacity_factor):
    """One launch for every expert-parallel size: per size, this rank's loss and parameters with their gradients."""
    results = {}
    for size in EP_SIZES:
        groups = {tuple(block): dist.new_group(block) for block in ep_blocks(size)}  # collective: every rank, in order
        group = next(g for block, g in groups.items() if dist.get_rank() in block)
        model = moe_gpt(CONFIG, 2 * size, 2, capacity_factor, group, seed=3).double()
        _, loss = model(*tokens(dist.get_rank()))
        (loss + 0.01 * moe_balance_loss(model)).backward()
        results[size] = loss.item(), named(model)
    return results


def test_moe_gpt_over_expert_parallel_ranks_equals_one_process():
    got = zero_lab.launch(expert_parallel_gpt, RANKS, 0.75, timeout=60)
    for size in EP_SIZES:
        one = moe_gpt(CONFIG, 2 * size, 2, 0.75, None, seed=3).double()
        per_rank, dropped, idle = [], 0, 0
        for rank in range(RANKS):  # each rank's batch apart: its own routing and capacity, its own loss
            one.zero_grad(set_to_none=True)
            _, loss = one(*tokens(rank))
            (loss + 0.01 * moe_balance_loss(one)).backward()
            routings = [m.routing for m in one.modules() if hasattr(m, "routing")]
            dropped += sum((~r.kept).sum().item() for r in routings)
            idle += sum((expert_loads(r) == 0).sum().item() for r in routings)  # experts this rank sends nothing
            per_rank.append((loss.item(), named(one)))
        assert dropped > 0 and idle > 0, "the check must cover dropped assignments and experts without tokens"
        for block in ep_blocks(size):
            expert_sums = {}  # an expert's gradient holds every token its expert-parallel group sent it
            for rank in block:
                for name, (_, grad) in per_rank[rank][1].items():
                    if ".experts." in name:
                        expert_sums[name] = expert_sums.get(name, 0) + grad
            for rank in block:
                loss, params = got[rank][size]
                want_loss, want = per_rank[rank]
                # float64, sums in another order: differences far under 1e-12
                assert abs(loss - want_loss) < 1e-12, (size, rank, loss, want_loss)
                for name, (value, grad) in params.items():
                    assert torch.equal(value, want[name][0]), (size, name)
                    expected = expert_sums[name] if ".experts." in name else want[name][1]
                    assert torch.allclose(grad, expected, rtol=0, atol=1e-12), (size, rank, name)


def test_deepseek_v3_sized_states_in_the_fake_world_equal_the_formula():
    dense, routed = deepseek_v3_parameters()
    assert (dense + routed) // 10**9 == 671 and routed // 10**9 == 653  # the model card's 671B total, from the shapes
    world, ep = 40, 8  # both groups padded: dense % 40 == 24, (routed / 8) % 5 == 2
    for (stage, rank), counted in count_moe_states(world, ep).items():
        assert counted == moe_state_bytes(dense, routed, world, ep, stage, 12), (stage, rank)


def bare_hang():
    rank = dist.get_rank()
    for expert in range(4 - rank):  # rank 1's tokens skip expert 3: rank 0 waits in its all-gather
        whole = torch.empty(4)
        dist.all_gather_single(whole, torch.full((2,), float(expert)))


def test_the_bare_expert_all_gathers_hang_and_the_launcher_names_it():
    with pytest.raises(zero_lab.RanksHung) as hung:
        zero_lab.launch(bare_hang, 2, timeout=2)
    assert "rank 0" in str(hung.value)


def stage_3(skip_idle, whole, seed=0, steps=2):
    model = moe_gpt(CONFIG, 4, 1, None, None, seed, skip_idle=skip_idle)
    units = moe_block_units(model) if whole else None
    model, optimizer = zero_lab.prepare(model, torch.optim.SGD, 3, units=units, lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batches = [tuple(torch.randint(16, (1, 2), generator=g) for _ in "xy") for _ in range(2)]
        model(*batches[dist.get_rank()])[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.float() for k, v in model.state_dict().items() if v.is_floating_point()}


def test_stage_3_with_skipped_experts_is_named_and_leaf_units_alone_train_wrong():
    with pytest.raises(zero_lab.RankFailed, match="ran different units"):
        zero_lab.launch(stage_3, 2, True, False, timeout=30)
    one = moe_gpt(CONFIG, 4, 1, None, None, 0)
    optimizer = torch.optim.SGD(one.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        batches = [tuple(torch.randint(16, (1, 2), generator=g) for _ in "xy") for _ in range(2)]
        (sum(one(*b)[1] for b in batches) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
    state = zero_lab.launch(stage_3, 2, True, True, timeout=30)[0]
    # the lesson's claim: one unit per block but experts still skipped trains silently wrong (far beyond rounding)
    assert max((state[k] - v).abs().max().item() for k, v in one.state_dict().items() if k in state) > 1e-4


def canary_runs(seed=0):
    """One SGD step at stage 1 over the expert-data-parallel groups, right and with the expert mean over the
    wrong group (ep times too large): this rank's parameters before and after, by one-process name."""
    ep_group, edp_group = make_expert_groups(2)
    model = moe_gpt(CONFIG, 4, 2, 1.0, ep_group, seed)
    with pytest.raises(ValueError, match="built for stages"):  # stage 3 takes no per-group process groups
        zero_lab.prepare(model, torch.optim.SGD, 3, params=moe_param_groups(model, edp_group), lr=0.1)
    runs = {}
    for wrong in (False, True):
        model = moe_gpt(CONFIG, 4, 2, 1.0, ep_group, seed)
        if wrong:
            for p in moe_param_groups(model, edp_group)[1]["params"]:
                p.register_hook(lambda grad: grad * 2)
        before = named(model, grads=False)
        model, optimizer = zero_lab.prepare(model, torch.optim.SGD, 1, params=moe_param_groups(model, edp_group), lr=0.1)
        _, loss = model(*tokens(dist.get_rank(), seed))
        loss.backward()
        optimizer.step()
        runs[wrong] = before, named(model, grads=False)
    return runs


def test_the_canary_flags_an_expert_averaged_over_the_wrong_group():
    runs = zero_lab.launch(canary_runs, 4, timeout=60)
    shadow = moe_gpt(CONFIG, 4, 2, 1.0, None, 0)
    optimizer = torch.optim.SGD(shadow.parameters(), lr=0.1)
    sum(shadow(*tokens(rank))[1] for rank in range(4)).div(4).backward()
    optimizer.step()
    after = {n: p.detach() for n, p in shadow.named_parameters()}
    for rank, by_run in enumerate(runs):
        right, wrong = (update_error(before, made, {n: after[n] for n in before}) for before, made in
                        (by_run[False], by_run[True]))
        assert right < 1e-4, (rank, right)  # fp32 ulps (lesson 15's FP32_TOLERANCE)
        assert 0.5 < wrong < 2, (rank, wrong)  # the experts' update is twice the shadow's: relative error ~1


MUTANTS = {
    "top-k of the logits' negatives (the k smallest)": (
        "    experts = choice.topk(k, dim=-1).indices\n", "    experts = (-choice).topk(k, dim=-1).indices\n", "route"),
    "the bias added to the weights too": (
        "    weights = probs.gather(-1, experts)\n", "    weights = choice.gather(-1, experts)\n", "route"),
    "capacity without k": ("    capacity = math.ceil(capacity_factor * tokens * k / num_experts)\n",
                           "    capacity = math.ceil(capacity_factor * tokens / num_experts)\n", "route"),
    "token-major queue (second choices before later first choices)": (
        "    queue = experts.t().reshape(-1)", "    queue = experts.reshape(-1)", "route"),
    "balance loss without the factor E": ("    return num_experts * (fraction * routing.probs.mean(dim=0)).sum()\n",
                                          "    return (fraction * routing.probs.mean(dim=0)).sum()\n", "balance"),
    "f_i over the tokens, not the assignments": (
        "minlength=num_experts) / routing.experts.numel()", "minlength=num_experts) / routing.experts.shape[0]", "balance"),
    "bias rule backwards (overloaded experts raised)": (
        "    return bias + rate * torch.sign(loads.float().mean() - loads.float())\n",
        "    return bias - rate * torch.sign(loads.float().mean() - loads.float())\n", "balance"),
    "expert-data-parallel groups consecutive": (
        "    replicas = [list(range(place, world_size, ep)) for place in range(ep)]\n",
        "    replicas = [list(range(place * ep, place * ep + world_size // ep)) for place in range(ep)]\n", "expert_zero"),
    "stage 1's gradient buffer unpadded": ("        gradients = 4 * shard * (ranks if stage == 1 else 1)\n",
                                           "        gradients = 4 * (params if stage == 1 else shard)\n", "state_bytes"),
    "experts sharded over the whole world": ("    return group(dense, world) + group(expert // ep, world // ep)\n",
                                             "    return group(dense, world) + group(expert // ep, world)\n", "state_bytes"),
    "every expert on every rank": ("    return group(dense, world) + group(expert // ep, world // ep)\n",
                                   "    return group(dense, world) + group(expert, world // ep)\n", "state_bytes"),
    "all-to-all bytes: forward only": ("    return off_rank * (num_experts * 8 + 2 * (sent + received) * d * element_size)\n",
                                       "    return off_rank * (num_experts * 8 + (sent + received) * d * element_size)\n",
                                       "all_to_all_bytes"),
    "all-to-all bytes: the counts forgotten": (
        "    return off_rank * (num_experts * 8 + 2 * (sent + received) * d * element_size)\n",
        "    return off_rank * 2 * (sent + received) * d * element_size\n", "all_to_all_bytes"),
    "all-to-all bytes: every byte counted, none stays on the rank": (
        "    off_rank = (ep - 1) / ep\n", "    off_rank = 1\n", "all_to_all_bytes"),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_typical_mistakes_fail_their_graded_cell(mutant):
    assert_mutant_fails(LESSON, *MUTANTS[mutant])


def test_hidden_tests_are_worth_points(graded):
    assert_reference_full_and_learner_zero(graded, LESSON, 25)
