# Generated from solutions/18_calculator/18_calculator.ipynb by `zero-lab build`: edit the notebook, not this file.

'''A training calculator (lesson 18): parameters, FLOPs, activation bytes, utilisation and days from a model's shape.

transformer_parameters  a GPT's parameters from layers, width, vocabulary, sequence (Narayanan et al. 2021's models)
training_days           8TP/(nX) seconds, in days: 8 FLOPs per parameter and token, recomputation included
gpt_parameters          the course GPT's parameters from its GPTConfig (what num_params() counts)
gpt_flops               the course GPT's matmul FLOPs of one forward and backward (what FlopCounterMode counts)
activation_bytes        activation bytes per layer (Korthikanti et al. 2022), tensor/sequence parallel, recomputation
gpt_saved_bytes         the bytes one course GPT block saves for backward (fp32, no dropout)
model_flops             the FLOPs of one iteration the model needs: 72BLsh^2 (1 + s / (6h) + V / (12hL))
hardware_flops          the FLOPs the hardware runs: model FLOPs plus what recomputation repeats
utilisation             FLOPs per second over the peak of all GPUs (MFU from model FLOPs, HFU from hardware FLOPs)
recompute_plan          which layers keep their activations whole, selective or full: a budget, the fewest FLOPs
'''

from __future__ import annotations

import math

SECONDS_PER_DAY = 86_400


def transformer_parameters(layers: int, hidden: int, vocab: int, seq_len: int) -> float:
    '''12 l h^2 (1 + 13 / (12 h) + (V + s) / (12 l h)): weights, biases and LayerNorms, embeddings.'''
    return 12 * layers * hidden ** 2 * (1 + 13 / (12 * hidden) + (vocab + seq_len) / (12 * layers * hidden))


def training_days(tokens: float, parameters: float, gpus: int, flops_per_gpu: float) -> float:
    '''8 T P / (n X) seconds, in days.'''
    return 8 * tokens * parameters / (gpus * flops_per_gpu) / SECONDS_PER_DAY


def gpt_parameters(config) -> int:
    '''Parameters of GPT(config), the tied head counted once: what num_params() returns.'''
    C, bias = config.n_embd, int(config.bias)
    per_block = 12 * C * C + 9 * C * bias + 2 * C * (1 + bias)  # 4 C^2 + 8 C^2 weights; Linear biases; 2 LayerNorms
    return config.n_layer * per_block + C * (config.vocab_size + config.block_size) + C * (1 + bias)


def gpt_flops(config, batch: int, seq_len: int) -> int:
    '''Matmul FLOPs of one forward and backward of GPT(config) on batch x seq_len tokens (FlopCounterMode's count).'''
    tokens, C = batch * seq_len, config.n_embd
    per_block = 2 * tokens * C * (3 * C + C + 4 * C + 4 * C) + 2 * 2 * tokens * seq_len * C  # 4 Linears; q.k^T, att.v
    forward = config.n_layer * per_block + 2 * tokens * C * config.vocab_size  # the head
    return 3 * forward  # backward: a gradient for each operand of every product


def activation_bytes(seq_len: int, batch: int, hidden: int, heads: int, tp: int = 1, sequence_parallel: bool = False,
                     recompute: str = "none") -> float:
    '''Korthikanti et al. 2022: bytes one layer keeps for backward (2-byte activations, 1-byte dropout masks).'''
    sbh = seq_len * batch * hidden
    attention = 5 * heads * seq_len / hidden  # the a s^2 b terms over s b h
    if recompute == "full":
        return 2 * sbh / (tp if sequence_parallel else 1)
    if recompute == "selective":
        attention = 0
    elif recompute != "none":
        raise ValueError(f"recompute is 'none', 'selective' or 'full', not {recompute!r}")
    if sequence_parallel:
        return sbh / tp * (34 + attention)
    return sbh * (10 + 24 / tp + attention / tp)


def gpt_saved_bytes(config, batch: int, seq_len: int) -> int:
    '''Bytes one block of GPT(config) saves for backward on batch x seq_len tokens: fp32 activations, no dropout.'''
    tokens, C = batch * seq_len, config.n_embd
    width = 16 * tokens * C  # x, ln_1 out, q, k, v, y; x + attn, ln_2 out; GeLU in and out (4C each)
    scores = batch * config.n_head * seq_len ** 2  # softmax output, saved by softmax and by att @ v: one storage
    layer_norm_stats = 2 * 2 * tokens  # mean and 1/std of each LayerNorm
    return 4 * (width + scores + layer_norm_stats) + seq_len ** 2  # + the bool mask ~causal_mask makes


def model_flops(batch: int, layers: int, seq_len: int, hidden: int, vocab: int) -> float:
    '''72 B L s h^2 (1 + s / (6 h) + V / (12 h L)): forward and backward of the layers and the logits.'''
    return 72 * batch * layers * seq_len * hidden ** 2 * (1 + seq_len / (6 * hidden) + vocab / (12 * hidden * layers))


def hardware_flops(batch: int, layers: int, seq_len: int, hidden: int, vocab: int, recompute: str = "none") -> float:
    '''The FLOPs run: model FLOPs, plus the attention scores again (selective) or every layer's forward again (full).'''
    layer_part = batch * layers * seq_len * hidden ** 2
    logits = 6 * batch * seq_len * hidden * vocab
    if recompute == "none":
        return model_flops(batch, layers, seq_len, hidden, vocab)
    if recompute == "selective":
        return 72 * layer_part * (1 + seq_len / (3 * hidden)) + logits
    if recompute == "full":
        return 96 * layer_part * (1 + seq_len / (6 * hidden)) + logits
    raise ValueError(f"recompute is 'none', 'selective' or 'full', not {recompute!r}")


def utilisation(flops: float, seconds: float, gpus: int, peak: float) -> float:
    '''flops run in `seconds` on `gpus` GPUs of `peak` FLOP/s each, as a fraction of what they could run.'''
    return flops / (seconds * gpus * peak)


RECOMPUTE = ("none", "selective", "full")  # the forms a layer's activations can take (exercise 3)


def recompute_plan(budget: float, layers: int, seq_len: int, batch: int, hidden: int, heads: int, tp: int = 1,
                   sequence_parallel: bool = False) -> tuple[dict, float]:
    '''How many of `layers` layers keep each form in RECOMPUTE so that their activation bytes fit `budget` with the
    fewest recomputed FLOPs (HFU's count); ({form: layers}, added FLOPs). ValueError if nothing fits.'''
    kept = {form: activation_bytes(seq_len, batch, hidden, heads, tp, sequence_parallel, form) for form in RECOMPUTE}
    added = {form: hardware_flops(batch, 1, seq_len, hidden, 0, form) - model_flops(batch, 1, seq_len, hidden, 0)
             for form in RECOMPUTE}
    best = None
    for full in range(layers + 1):
        over = (layers - full) * kept["none"] + full * kept["full"] - budget  # what selective layers must free
        selective = max(0, math.ceil(over / (kept["none"] - kept["selective"])))
        flops = selective * added["selective"] + full * added["full"]
        if selective <= layers - full and (best is None or flops < best[1]):
            best = ({"none": layers - full - selective, "selective": selective, "full": full}, flops)
    if best is None:
        raise ValueError(f"{layers} layers keep {layers * kept['full']:,.0f} bytes even when all are recomputed in "
                         f"full: more than the budget of {budget:,.0f}")
    return best
