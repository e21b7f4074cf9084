"""Lesson 09, ZeRO++ and hierarchical sharding on simulated nodes: bytes between nodes, parity, errors."""

import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zero_lab
from graded_cells import assert_mutant_fails
from sharded_training import TINY_GPT, assert_close, gpt_batches, gpt_loss, key_bias_noise, train, weights
from zero_lab import launch
from zero_lab.data import shard_batch, token_batches
from zero_lab.memory_ledger import model_state_bytes
from zero_lab.models import GPT, Block, GPTConfig
from zero_lab.course_tools.implementation import REPO
from zero_lab.prepare import prepare
from zero_lab.zeropp import (NodeLayout, NodeLedger, dequantize_blocks, hierarchical_reduce_scatter, node_groups,
                             quantize_blocks, split_sent_bytes)

ADAMW = dict(lr=1e-2, weight_decay=0.1)


class TiedTwice(nn.Module):
    """A Linear called twice, a head tied to it, a frozen layer, a one-element parameter: uneven units."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.first, self.twice = nn.Linear(6, 9), nn.Linear(9, 9)
            self.frozen = nn.Linear(9, 9).requires_grad_(False)
            self.tied = nn.Linear(9, 9, bias=False)
            self.tied.weight = self.twice.weight
            self.gain = nn.Parameter(torch.tensor(1.5))
            self.last = nn.Linear(9, 5)

    def forward(self, x):
        x = torch.tanh(self.twice(torch.tanh(self.first(x))))
        x = torch.tanh(self.twice(x * self.gain))
        return self.last(self.frozen(x) + self.tied(x))


def tied_batches(steps=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(12, 6, generator=g), torch.randn(12, 5, generator=g)) for _ in range(steps)]


def tied_loss(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


MODELS = {"gpt": (lambda: GPT(TINY_GPT, seed=0), gpt_batches, gpt_loss),
          "tied": (TiedTwice, tied_batches, tied_loss)}


def _single(name):
    make, batches, loss = MODELS[name]
    model = make()
    train(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **ADAMW), batches(), loss)
    return weights(model)


def _distributed(name, options):
    make, batches, loss = MODELS[name]
    model = make()
    params = [p for p in model.parameters() if p.requires_grad]
    model, optimizer = prepare(model, torch.optim.AdamW, stage=3, params=params, **ADAMW, **options)
    train(model, optimizer, batches(), loss)
    optimizer.unshard_model()
    return weights(model)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("options", [dict(ranks_per_node=2, hpz=True), dict(ranks_per_node=2, replicate_across_nodes=True),
                                     dict(ranks_per_node=1, hpz=True)], ids=["hpz", "hsdp", "hpz-1-per-node"])
def test_hpz_and_hsdp_match_single_process_adamw(model, options):
    # The GPT's key biases have a zero exact gradient, their rounding noise moves within AdamW's drift (key_bias_noise);
    # the rest, as every weight of "tied", within assert_close's default (hpZ is bit for bit stage 3, below)
    assert_close(launch(_distributed, 4, model, options, timeout=120), _single(model), noise=key_bias_noise(ADAMW["lr"]))


@pytest.mark.parametrize("model", MODELS)
def test_hpz_is_bit_for_bit_stage_3(model):
    stage3 = launch(_distributed, 4, model, {}, timeout=120)
    assert_close(launch(_distributed, 4, model, dict(ranks_per_node=2, hpz=True), timeout=120), stage3[0], atol=0, rtol=0)


def test_hsdp_with_three_ranks_per_node_matches():
    assert_close(launch(_distributed, 6, "tied", dict(ranks_per_node=3, replicate_across_nodes=True), timeout=120),
                 _single("tied"), atol=1e-5, rtol=1e-5)  # another order of 6 ranks' sums, through Adam: see above


def _hsdp_full_weights(name):
    """After HSDP training: the whole weights through lesson 05's exits (sharded over the node)."""
    make, batches, loss = MODELS[name]
    model = make()
    params = [p for p in model.parameters() if p.requires_grad]
    model, optimizer = prepare(model, torch.optim.AdamW, stage=3, params=params, ranks_per_node=2,
                               replicate_across_nodes=True, **ADAMW)
    train(model, optimizer, batches(), loss)
    state = model.state_dict()
    with optimizer.gathered_parameters():
        gathered = weights(model)
    return {name: state[name] for name in gathered}, gathered


def test_hsdp_state_dict_and_gathered_parameters_give_the_whole_weights():
    expected = _single("tied")
    for from_state_dict, from_gathered in launch(_hsdp_full_weights, 4, "tied", timeout=120):
        assert_close([from_state_dict, from_gathered], expected, atol=1e-5, rtol=1e-5)


def test_quantized_training_stays_close_to_exact():
    exact = _single("tied")
    got = launch(_distributed, 4, "tied", dict(ranks_per_node=2, qwz=True, hpz=True, qgz=True), timeout=120)[0]
    for name, value in exact.items():
        assert (got[name] - value).norm() <= 0.1 * value.norm() + 1e-3, name


def _step_bytes(options):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer = prepare(GPT(GPTConfig(), seed=0), torch.optim.AdamW, stage=3, ranks_per_node=2,
                               units=(Block,), param_dtype=torch.bfloat16, lr=1e-3, **options)
    batches = list(token_batches(2, 8, 32, 64, seed=0))
    for step, batch in enumerate(batches):
        ledger = NodeLedger(2)
        with ledger:
            model(*shard_batch(batch, rank, world_size))[1].backward()
            optimizer.step()
            optimizer.zero_grad()
    shards = [unit.layout.shard_numel for unit in optimizer.units]
    return float(ledger.inter_bytes()), float(ledger.intra_bytes()), shards


def _blocks(numel, block=256):
    return -(-numel // block)


def test_inter_node_bytes_are_the_formula_exactly():
    """Per node and step, on 2 x 2 with bf16: counted bytes against the formula with the ring factors,
    the quantized payloads padded to whole blocks of 256 and one fp32 scale per block."""
    ring, a2a = Fraction(3, 4), Fraction(1, 2)
    results = {name: launch(_step_bytes, 4, options, timeout=120) for name, options in
               {"stage3": {}, "qwz": dict(qwz=True), "hpz": dict(hpz=True), "qgz": dict(qgz=True),
                "all": dict(qwz=True, hpz=True, qgz=True), "hsdp": dict(replicate_across_nodes=True)}.items()}
    shards = results["stage3"][0][2]
    m = sum(2 * 4 * s for s in shards)  # the padded model in bf16
    qwz = sum(4 * (_blocks(s) * 256 + 4 * _blocks(s)) for s in shards)  # int8 payloads + scales, 4 ranks
    hop2 = sum(2 * (_blocks(s) * 128 + 4 * _blocks(s)) for s in shards)  # 2 rows of s values in int4 + scales

    def per_node(name):
        return sum(inter for inter, _, _ in results[name][:2])

    assert per_node("stage3") == 3 * ring * m
    assert per_node("qwz") == ring * qwz + 2 * ring * m
    assert per_node("hpz") == 2 * ring * m
    assert per_node("qgz") == 2 * ring * m + 2 * a2a * hop2
    assert per_node("all") == ring * qwz + 2 * a2a * hop2
    hsdp_shards = results["hsdp"][0][2]  # units laid out over the 2 ranks of a node
    assert per_node("hsdp") == sum(2 * 2 * a2a * 2 * s for s in hsdp_shards)  # all-reduce of a bf16 shard, 2 ranks
    assert per_node("stage3") / per_node("all") > 4  # > the paper's 4x: qgZ's inter hop has factor 1/2 here
    intra = {name: sum(intra for _, intra, _ in results[name][:2]) for name in ("stage3", "all")}
    assert intra["all"] / (intra["all"] + per_node("all")) > intra["stage3"] / (intra["stage3"] + per_node("stage3")), \
        "ZeRO++ shifts the mix of bytes towards the node's own links"


def _memory(options, k):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer = prepare(GPT(GPTConfig(), seed=0), torch.optim.AdamW, stage=3, ranks_per_node=k,
                               units=(Block,), param_dtype=torch.bfloat16, lr=1e-3, **options)
    batch = next(iter(token_batches(1, 8, 32, 64, seed=0)))
    model(*shard_batch(batch, rank, world_size))[1].backward()
    optimizer.step()
    model(*shard_batch(batch, rank, world_size))
    padded = sum(unit.layout.padded_numel for unit in optimizer.units)
    return model_state_bytes(model, optimizer).total, padded


@pytest.mark.parametrize("name", ["stage3", "hpz", "hsdp"])
def test_memory_per_rank_is_the_formula(name):
    options = {"stage3": {}, "hpz": dict(hpz=True), "hsdp": dict(replicate_across_nodes=True)}[name]
    for measured, padded in launch(_memory, 4, options, 2, timeout=120):
        shards = 2 if name == "hsdp" else 4
        assert measured == 16 * padded // shards + (2 * padded // 2 if name == "hpz" else 0)


def _hierarchical_vs_flat(seed, k):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    layout = NodeLayout(world_size, k)
    node_group, peer_group = node_groups(layout)
    v = torch.randint(-7, 8, (16 * world_size,), generator=torch.Generator().manual_seed(seed)).float()
    v[::8] = 7  # a full-scale value in every row quantized: int4 is exact on integer multiples
    grad = v * (rank + 1)
    flat = torch.empty(16)
    dist.reduce_scatter_single(flat, grad.clone())
    return hierarchical_reduce_scatter(grad, layout, node_group, peer_group).tolist(), flat.tolist()


@pytest.mark.parametrize("world_size,k", [(4, 2), (6, 3), (6, 2), (4, 4), (3, 1)])
def test_hierarchical_reduce_scatter_has_the_layout_of_a_flat_one(world_size, k):
    seed = int.from_bytes(os.urandom(3), "little")
    for hierarchical, flat in launch(_hierarchical_vs_flat, world_size, seed, k, timeout=60):
        assert hierarchical == flat


def test_split_rule_per_node_reproduces_the_papers_ring_volume():
    """Summed over a node's k ranks, a global ring all-gather sends (G-1)/G M across the node boundary."""
    for nodes, k in [(2, 2), (2, 3), (4, 8)]:
        group = list(range(nodes * k))
        sent = Fraction(len(group) - 1, len(group)) * 1000
        per_node = sum(split_sent_bytes("all_gather", sent, group, r, k)[1] for r in range(k))
        assert per_node == sent


def test_quantization_error_is_bounded_and_grows_with_the_block():
    x = torch.randn(1 << 14, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 1 << 14)
    errors = {}
    for bits in (8, 4):
        for block in (16, 256, 4096):
            back = dequantize_blocks(*quantize_blocks(x, bits, block), bits, block, x.numel())
            errors[bits, block] = ((back - x).norm() / x.norm()).item()
        assert errors[bits, 16] < errors[bits, 256] < errors[bits, 4096]
    assert errors[8, 256] < 0.01 < errors[4, 256]


def test_bad_input_names_the_fix():
    def setups():
        model = nn.Linear(4, 4)
        messages = []
        for options in [dict(stage=3, ranks_per_node=3), dict(stage=3, qwz=True), dict(stage=2, qwz=True),
                        dict(stage=3, ranks_per_node=2, qwz=True, replicate_across_nodes=True),
                        dict(stage=3, ranks_per_node=2, hpz=True, prefetch=1),
                        dict(stage=3, ranks_per_node=2, replicate_across_nodes=True, max_grad_norm=1.0)]:
            try:
                prepare(model, torch.optim.AdamW, **options)
                messages.append(None)
            except (TypeError, ValueError) as error:
                messages.append(str(error))
        return messages

    messages = launch(setups, 4, timeout=60)[0]
    assert "does not divide" in messages[0] and "divisor of the world size" in messages[0]
    assert "need ranks_per_node" in messages[1]
    assert "needs stage 3" in messages[2]
    assert "none of qwz, hpz, qgz" in messages[3]
    assert "prefetch" in messages[4]
    assert "max_grad_norm" in messages[5]
    with pytest.raises(ValueError, match="bits must be 8"):
        quantize_blocks(torch.ones(4), bits=2)
    with pytest.raises(ValueError, match="even number"):
        quantize_blocks(torch.ones(4), bits=4, block=3)


def test_train_runs_zeropp_and_hsdp_like_stage_3():
    from zero_lab.train import train as train_gpt

    stage3 = launch(train_gpt, 4, 3, 4, 12, 3e-3, timeout=120)[0]
    hsdp = launch(train_gpt, 4, 3, 4, 12, 3e-3, ranks_per_node=2, replicate_across_nodes=True, timeout=120)[0]
    zeropp = launch(train_gpt, 4, 3, 4, 12, 3e-3, ranks_per_node=2, qwz=True, hpz=True, qgz=True, timeout=120)[0]
    assert hsdp == pytest.approx(stage3, rel=1e-5)
    assert zeropp == pytest.approx(stage3, rel=1e-2) and zeropp[0] == pytest.approx(stage3[0], rel=1e-3)


def test_train_command_under_torchrun(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run(
        [str(torchrun), "--nproc-per-node", "4", "-m", "zero_lab.train", "--stage", "3", "--steps", "2",
         "--ranks-per-node", "2", "--zeropp", "qwz,hpz,qgz"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path)))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "qwz=True hpz=True qgz=True ranks_per_node=2" in result.stdout and "all_to_all" in result.stdout


def test_train_command_checks_its_options():
    from zero_lab.train import main

    for argv in (["--stage", "3", "--zeropp", "qwz"], ["--stage", "3", "--ranks-per-node", "2", "--zeropp", "qwx"]):
        with pytest.raises(SystemExit):
            main(argv)


# Typical wrong answers to the exercises: each must fail the graded test cell named with it.
MUTANTS = {
    "node and peer groups swapped": ("    return node_group, peer_group\n", "    return peer_group, node_group\n",
                                     "node_groups"),
    "a group spanning nodes charged wholly inter-node": (
        "        inter = sent * Fraction(len(nodes), size)\n", "        inter = sent\n", "split_bytes"),
    "all-to-all charged like a ring": ('    elif kind == "all_to_all":\n', '    elif False:\n', "split_bytes"),
    "one scale for the whole tensor": ("    scales = padded.abs().amax(dim=1) / qmax\n",
                                       "    scales = padded.abs().amax().expand(blocks) / qmax\n", "quantize"),
    "int4 halves swapped": ("    return pairs[:, 0] | (pairs[:, 1] << 4), scales\n",
                            "    return pairs[:, 1] | (pairs[:, 0] << 4), scales\n", "quantize"),
    "qwZ with one scale for the whole shard": (
        "    payload, scales = quantize_blocks(shard, 8, block)\n",
        "    payload, scales = quantize_blocks(shard, 8, block := 2 * -(-numel // 2))\n", "qwz_all_gather"),
    "qwZ uses its own scales for every rank": (
        "    dist.all_gather_single(all_scales, scales, group=group)\n",
        "    all_scales.copy_(scales.repeat(size))\n", "qwz_all_gather"),
    "qgZ without slice reordering": (
        "    by_local_rank = flat_grad.reshape(nodes, k, shard).transpose(0, 1).reshape(k, nodes * shard)\n",
        "    by_local_rank = flat_grad.reshape(k, nodes * shard)\n", "qgz_reduce_scatter"),
    "qgZ's second hop not summed": (
        "    return quantized_all_to_all(node_sum.view(nodes, shard), peer_group, bits, block).sum(dim=0)\n",
        "    return quantized_all_to_all(node_sum.view(nodes, shard), peer_group, bits, block)[0]\n",
        "qgz_reduce_scatter"),
    "pads and scales in the input's dtype (bf16 scales for bf16 weights)": (
        "    padded = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)\n",
        "    padded = torch.zeros(blocks * block, dtype=x.dtype, device=x.device)\n", "quantize"),
    "qgZ in one quantized hop over all ranks (k x the inter-node bytes, the same total)": (
        "    node_sum = quantized_all_to_all(by_local_rank, node_group, bits, block).sum(dim=0)\n"
        "    return quantized_all_to_all(node_sum.view(nodes, shard), peer_group, bits, block).sum(dim=0)\n",
        "    return quantized_all_to_all(flat_grad.view(layout.world_size, shard), None, bits, block).sum(dim=0)\n",
        "qgz_reduce_scatter"),
    "qgZ quantizes the stacked rows as one tensor (blocks straddle rows)": (
        "    quantized = [quantize_blocks(row, bits, block) for row in rows]\n"
        "    payloads = torch.stack([p for p, _ in quantized])\n"
        "    scales = torch.stack([s for _, s in quantized])\n",
        "    payloads, scales = quantize_blocks(rows.reshape(-1), bits, block)\n"
        "    payloads, scales = payloads.view(len(rows), -1), scales.view(len(rows), -1)\n",
        "qgz_reduce_scatter"),
    "hpZ's secondary is a view, not a copy": ("    return flat[local * part:(local + 1) * part].clone()\n",
                                              "    return flat[local * part:(local + 1) * part]\n", "hpz_hsdp"),
    "HSDP divides by the node's size": ("    return shard.div_(dist.get_world_size())\n",
                                        "    return shard.div_(dist.get_world_size(node_group))\n", "hpz_hsdp"),
    "HSDP never all-reduces across nodes": ("    dist.all_reduce(shard, group=peer_group)\n", "", "hpz_hsdp"),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_typical_mistakes_fail_their_graded_cell(mutant):
    assert_mutant_fails("09_zeropp", *MUTANTS[mutant])


def test_hidden_tests_are_worth_points(graded):
    report = graded("09_zeropp", "solution")
    assert report.total == (21, 21), report.scores
    assert all(s.earned == 0 for s in graded("09_zeropp", "learner").scores)
