"""Lesson 18, a training calculator: the Megatron-LM README's ten configurations (April 2021) and its MFU / HFU
columns (May 2022), 34 / 84 days by 8TP/(nX), selective recomputation's 70 % / 65 %, the scaling book's 2200 / 2475
tokens, the course GPT's parameters, FLOPs and bytes saved for backward equal to what PyTorch counts, and the cheapest
recomputation that fits a budget; typical wrong answers fail their graded cells. No assert here reads a clock."""

LESSON = "18_calculator"

from decimal import ROUND_HALF_UP, Decimal

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from graded_cells import assert_mutant_fails, assert_reference_full_and_learner_zero
from zero_lab.calculator import (RECOMPUTE, activation_bytes, gpt_flops, gpt_parameters, gpt_saved_bytes,
                                 hardware_flops, model_flops, recompute_plan, training_days, transformer_parameters,
                                 utilisation)
from zero_lab.comm_time import collective_seconds, critical_tokens, fit_alpha_beta, zero_step_seconds
from zero_lab.models import GPT, GPTConfig


def printed(value, digits):
    """value at a source's printed digit, rounded half up."""
    return Decimal(repr(float(value))).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP)


# The Megatron-LM README of April 2021 (images/cases_april2021.png, Narayanan et al.'s runs): billions of parameters,
# hidden size, layers (V = 51,200, s = 2048)
TABLE_1 = [(1.7, 2304, 24), (3.6, 3072, 30), (7.5, 4096, 36), (18.4, 6144, 40), (39.1, 8192, 48), (76.1, 10240, 60),
           (145.6, 12288, 80), (310.1, 16384, 96), (529.6, 20480, 105), (1008.0, 25600, 128)]


@pytest.mark.parametrize("billions, hidden, layers", TABLE_1)
def test_the_parameter_count_gives_the_readmes_ten_configurations(billions, hidden, layers):
    assert printed(transformer_parameters(layers, hidden, 51200, 2048) / 1e9, 1) == Decimal(str(billions))


def test_8tp_over_nx_gives_34_and_84_days():
    assert printed(training_days(300e9, 175e9, 1024, 140e12), 0) == 34  # 175B, 300B tokens
    assert printed(training_days(450e9, 1008.0e9, 3072, 163e12), 0) == 84  # the README's 1T: 3072 GPUs at 163 TFLOP/s


@pytest.mark.parametrize("config, batch, seq_len", [
    (GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=32, block_size=16), 3, 12),
    (GPTConfig(vocab_size=40, n_layer=1, n_head=4, n_embd=16, block_size=9, bias=False), 2, 9)])
def test_the_course_gpt_parameters_and_flops_are_what_torch_counts(config, batch, seq_len):
    model = GPT(config, seed=0)
    assert gpt_parameters(config) == model.num_params()
    idx = torch.randint(config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(idx, idx)[1].backward()
    assert gpt_flops(config, batch, seq_len) == counter.get_total_flops()
    # the same count as model_flops at the course GPT's shape (its V term counts the tied head)
    expected = model_flops(batch, config.n_layer, seq_len, config.n_embd, config.vocab_size)
    assert gpt_flops(config, batch, seq_len) == pytest.approx(expected, rel=1e-12)


def saved_by_the_blocks(config, batch, seq_len):
    """Bytes of distinct storages the whole GPT's blocks save for backward (model states left out), per block."""
    model = GPT(config, seed=0)
    model_states = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    per_block, current = [{} for _ in model.transformer.h], []

    def pack(tensor):
        storage = tensor.untyped_storage()
        if current and storage.data_ptr() not in model_states:
            per_block[current[-1]][storage.data_ptr()] = storage.nbytes()
        return tensor

    def leave(module, args, out):
        current.pop()  # returns None: the block's output stays as it is

    for i, block in enumerate(model.transformer.h):
        block.register_forward_pre_hook(lambda module, args, i=i: current.append(i))
        block.register_forward_hook(leave)
    idx = torch.randint(config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(idx, idx)[1].backward()
    return [sum(saved.values()) for saved in per_block]


@pytest.mark.parametrize("config, batch, seq_len", [
    (GPTConfig(vocab_size=64, n_layer=3, n_head=2, n_embd=32, block_size=16), 3, 16),
    (GPTConfig(vocab_size=32, n_layer=2, n_head=3, n_embd=24, block_size=16, bias=False), 2, 11)])
def test_every_block_of_the_gpt_saves_what_the_formula_says(config, batch, seq_len):
    assert saved_by_the_blocks(config, batch, seq_len) == [gpt_saved_bytes(config, batch, seq_len)] * config.n_layer


def test_selective_recomputation_saves_70_and_65_percent():
    for hidden, heads, percent in ((12288, 96, 70), (20480, 128, 65)):  # GPT-3, the README's 530B with 128 heads
        for tp in (1, 8):
            full = activation_bytes(2048, 1, hidden, heads, tp=tp, sequence_parallel=True)
            kept = activation_bytes(2048, 1, hidden, heads, tp=tp, sequence_parallel=True, recompute="selective")
            assert printed(100 * (1 - kept / full), 0) == percent
    assert activation_bytes(2048, 1, 12288, 96) == 2048 * 12288 * (34 + 80)


@pytest.mark.parametrize("layers, hidden, mfu, hfu", [(96, 12288, 51.4, 52.8), (105, 20480, 56.0, 57.0),
                                                    (128, 25600, 56.3, 57.0)])
def test_the_readmes_hfu_over_mfu_is_selective_recomputations_flops(layers, hidden, mfu, hfu):
    # HFU / MFU of one run is its hardware over its model FLOPs; two figures printed to 0.1 % bound it
    low, high = (hfu - 0.05) / (mfu + 0.05), (hfu + 0.05) / (mfu - 0.05)
    ratio = {form: hardware_flops(1, layers, 2048, hidden, 51200, form) / model_flops(1, layers, 2048, hidden, 51200)
             for form in RECOMPUTE}
    assert [form for form in RECOMPUTE if low <= ratio[form] <= high] == ["selective"]
    assert utilisation(3e12, 2.0, 4, 1e12) == 0.375


def test_the_cheapest_recomputation_that_fits():
    gpt3 = dict(seq_len=2048, batch=1, hidden=12288, heads=96, tp=8, sequence_parallel=True)  # the worked example
    assert recompute_plan(40e9, 96, **gpt3) == ({"none": 96, "selective": 0, "full": 0}, 0)
    counts, flops = recompute_plan(20e9, 96, **gpt3)
    assert counts == {"none": 38, "selective": 58, "full": 0} and flops == pytest.approx(58 * 12 * 2048 ** 2 * 12288)
    counts, flops = recompute_plan(8e9, 96, **gpt3)
    full_layer = 24 * 2048 * 12288 ** 2 * (1 + 2048 / (6 * 12288))  # a layer's forward again
    assert counts == {"none": 0, "selective": 73, "full": 23}
    assert flops == pytest.approx(73 * 12 * 2048 ** 2 * 12288 + 23 * full_layer)
    with pytest.raises(ValueError):
        recompute_plan(0.5e9, 96, **gpt3)  # 96 inputs of 6.3 MB


def test_the_scaling_books_critical_tokens():
    assert critical_tokens(990e12, 450e9) == 2200 and critical_tokens(990e12, 400e9) == 2475
    assert critical_tokens(990e12, 400e9, world=2) == 1237.5 and critical_tokens(990e12, 400e9, experts=128, active=4) == 79200


def test_alpha_beta_fit_recovers_the_model_and_prices_the_zero_stages():
    alpha, beta = 3e-5, 2e-9
    samples = [(kind, n, w, collective_seconds(kind, n, w, alpha, beta))
               for kind in ("all_reduce", "all_gather") for n in (1e3, 1e6) for w in (2, 3)]
    assert fit_alpha_beta(samples) == pytest.approx((alpha, beta), rel=1e-9)
    ddp, zero3 = (zero_step_seconds(stage, 1e6, 4, 0, beta) for stage in (0, 3))
    assert zero_step_seconds(1, 1e6, 4, 0, beta) == pytest.approx(ddp) and zero3 == pytest.approx(1.5 * ddp)


MUTANTS = {
    "parameters without the embeddings": (
        "(1 + 13 / (12 * hidden) + (vocab + seq_len) / (12 * layers * hidden))", "(1 + 13 / (12 * hidden))",
        "calculator_days"),
    "6 FLOPs per parameter and token instead of 8 (recomputation forgotten)": (
        "return 8 * tokens * parameters", "return 6 * tokens * parameters", "calculator_days"),
    "days of 3600 s": ("/ (gpus * flops_per_gpu) / SECONDS_PER_DAY", "/ (gpus * flops_per_gpu) / 3600", "calculator_days"),
    "the tied head counted twice": (
        "C * (config.vocab_size + config.block_size)", "C * (2 * config.vocab_size + config.block_size)", "calculator_gpt"),
    "backward as cheap as forward": ("    return 3 * forward  #", "    return 2 * forward  #", "calculator_gpt"),
    "attention products forgotten": ("+ 2 * 2 * tokens * seq_len * C  #", "  #", "calculator_gpt"),
    "tensor parallelism splits the LayerNorms too": (
        "return sbh * (10 + 24 / tp + attention / tp)", "return sbh * (34 + attention) / tp", "calculator_activations"),
    "selective recomputation keeps the attention matrices": (
        "        attention = 0\n", "        pass\n", "calculator_activations"),
    "sequence parallelism forgets to split": ("return sbh / tp * (34 + attention)", "return sbh * (34 + attention)",
                                              "calculator_activations"),
    "the softmax output counted twice": (
        "return 4 * (width + scores + layer_norm_stats)", "return 4 * (width + 2 * scores + layer_norm_stats)",
        "calculator_saved"),
    "the causal mask forgotten": ("layer_norm_stats) + seq_len ** 2", "layer_norm_stats)", "calculator_saved"),
    "2-byte activations, as in Korthikanti's count": (
        "return 4 * (width + scores + layer_norm_stats)", "return 2 * (width + scores + layer_norm_stats)",
        "calculator_saved"),
    "all-reduce with n steps": ('RING_STEPS[kind] * (world - 1)\n    return', 'RING_STEPS[kind] * world\n    return',
                                "comm_time_model"),
    "whole buffer per step": ("return steps * (alpha + nbytes / world * beta)", "return steps * (alpha + nbytes * beta)",
                              "comm_time_model"),
    "ZeRO-3 with one all-gather": ('3: ["all_gather", "all_gather", "reduce_scatter"]', '3: ["all_gather", "reduce_scatter"]',
                                   "comm_time_model"),
    "fit: beta through the origin, alpha ignored": (
        "return (b1 * a22 - b2 * a12) / determinant, (a11 * b2 - a12 * b1) / determinant",
        "return 0.0, b2 / a22", "comm_time_model"),
    "critical tokens without the ring's (n - 1) / n": (
        "ring = 1 if world is None else (world - 1) / world", "ring = 1", "comm_time_critical"),
    "MoE factor inverted": ("* (experts / active) *", "* (active / experts) *", "comm_time_critical"),
    "critical tokens twice too many (backward 2 FLOPs)": ("* ring / 4 *", "* ring / 2 *", "comm_time_critical"),
    "model FLOPs without the attention term": ("(1 + seq_len / (6 * hidden) + vocab / (12 * hidden * layers))",
                                         "(1 + vocab / (12 * hidden * layers))", "calculator_mfu"),
    "selective recomputation costs nothing": ("72 * layer_part * (1 + seq_len / (3 * hidden))",
                                              "72 * layer_part * (1 + seq_len / (6 * hidden))", "calculator_mfu"),
    "full recomputation recomputes the logits too": (
        "96 * layer_part * (1 + seq_len / (6 * hidden)) + logits", "96 * layer_part * (1 + seq_len / (6 * hidden)) + 4 / 3 * logits",
        "calculator_mfu"),
    "utilisation of one GPU": ("return flops / (seconds * gpus * peak)", "return flops / (seconds * peak)", "calculator_mfu"),
    "one selective layer too few (floor, not ceil)": (
        "selective = max(0, math.ceil(over", "selective = max(0, math.floor(over", "calculator_recompute"),
    "the bytes of one tensor-parallel rank forgotten": (
        "activation_bytes(seq_len, batch, hidden, heads, tp, sequence_parallel, form)",
        "activation_bytes(seq_len, batch, hidden, heads, 1, sequence_parallel, form)", "calculator_recompute"),
    "every recomputation priced as a whole layer's": (
        "hardware_flops(batch, 1, seq_len, hidden, 0, form) - model_flops",
        'hardware_flops(batch, 1, seq_len, hidden, 0, "full" if form != "none" else form) - model_flops',
        "calculator_recompute"),
    "nothing fits: every layer recomputed in full instead of refused": (
        "    if best is None:\n        raise ValueError(",
        '    if best is None:\n        return {"none": 0, "selective": 0, "full": layers}, layers * added["full"]\n'
        "        raise ValueError(", "calculator_recompute"),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_typical_mistakes_fail_their_graded_cell(mutant):
    assert_mutant_fails(LESSON, *MUTANTS[mutant])


def test_hidden_tests_are_worth_points(graded):
    assert_reference_full_and_learner_zero(graded, LESSON, 18)
