# Generated from solutions/17_parallelism_3d/17_parallelism_3d.ipynb by `zero-lab build`: edit the notebook, not this file.

"""Planning 3D parallelism (lesson 17): which (tp, pp, dp, ZeRO stage, micro-batches) fit, which is cheapest.

model_states_per_gpu     the ZeRO paper's model states (§5.1) of the psi/(tp*pp) parameters one GPU holds
Transformer              the model planned for: parameters and shape
Plan                     one configuration: its bytes per GPU and its step time under the lesson's cost model
activation_bytes         the activation checkpoints the first stage of a 1F1B pipeline keeps
step_seconds             the cost model: compute stretched by the bubble, tp, pp and dp bytes over their links
plan                     every configuration that fits, cheapest first (exercise 6)
tokens_per_step          the tokens a plan's step trains on
training_days            days to train on a number of tokens at the plan's step time
model_flops_utilization  model FLOPs per second (6 psi per token) over the GPUs' peak
"""

from __future__ import annotations

from dataclasses import dataclass


def model_states_per_gpu(psi: float, tp: int, pp: int, dp: int, stage: int, k: int = 12) -> float:
    """Bytes of model states on one GPU: 2 bytes of weights, 2 of gradients, k of optimizer state per parameter
    it holds (psi / (tp * pp)); ZeRO stage 1 shards the optimizer state over dp, 2 the gradients too, 3 all."""
    held = psi / (tp * pp)
    sharded = {0: 0, 1: k, 2: 2 + k, 3: 4 + k}[stage]  # bytes per parameter split over the dp group
    return (4 + k - sharded) * held + sharded * held / dp


@dataclass(frozen=True)
class Transformer:
    """The model planned for: psi parameters in `layers` layers of width `hidden` with `heads` heads, sequences
    of `seq_len` tokens."""
    psi: float
    layers: int
    hidden: int
    heads: int
    seq_len: int


@dataclass(frozen=True)
class Plan:
    tp: int
    pp: int
    dp: int
    stage: int
    micro_batch: int  # sequences per micro-batch
    micro_batches: int  # M, per step and data-parallel rank
    model_states: float  # bytes per GPU
    activations: float  # bytes per GPU (the first pipeline stage's)
    bubble: float  # (P - 1) / (M + P - 1)
    seconds: dict  # the cost model's terms: compute (with the bubble), tp, pp, dp

    @property
    def step_seconds(self) -> float:
        return sum(self.seconds.values())

    def __str__(self) -> str:
        terms = ", ".join(f"{name} {value:.2f}" for name, value in self.seconds.items())
        return (f"tp {self.tp:>2} x pp {self.pp:>2} x dp {self.dp:>4}, ZeRO-{self.stage}, {self.micro_batches:>4} "
                f"micro-batches of {self.micro_batch}: {self.model_states / 1e9:5.1f} GB states + "
                f"{self.activations / 1e9:5.1f} GB activations, bubble {self.bubble:.3f}, "
                f"{self.step_seconds:.2f} s/step ({terms})")


def activation_bytes(model: Transformer, pp: int, micro_batch: int, micro_batches: int) -> float:
    """Full recomputation: each layer keeps its input (micro_batch * seq_len * hidden bf16 elements, whole on every
    tp rank); the first 1F1B stage holds min(pp, M) micro-batches in flight, each over its layers / pp layers."""
    per_layer = 2 * micro_batch * model.seq_len * model.hidden
    return per_layer * (model.layers / pp) * min(pp, micro_batches)


def step_seconds(model: Transformer, tp: int, pp: int, dp: int, stage: int, micro_batch: int, micro_batches: int,
                 flops: float, intra_node: float, inter_node: float) -> dict:
    """The lesson's cost model, seconds per step on one GPU, nothing overlapped: compute stretched by the bubble;
    tp all-reduces over the intra-node links (bytes/s); pp sends and ZeRO's dp collectives over the inter-node."""
    gpus, tokens = tp * pp * dp, dp * micro_batches * micro_batch * model.seq_len
    compute = 8 * model.psi * tokens / (gpus * flops) * (micro_batches + pp - 1) / micro_batches
    activation = 2 * micro_batch * model.seq_len * model.hidden  # bytes of one layer's input, bf16
    ring = lambda n: 2 * (n - 1) / n  # what a rank sends of an all-reduced buffer
    tp_bytes = 6 * (model.layers / pp) * micro_batches * activation * ring(tp)
    pp_bytes = 2 * micro_batches * activation if pp > 1 else 0
    held = 2 * model.psi / (tp * pp)  # bf16 bytes of this GPU's slice
    rounds = {0: 2, 1: 2, 2: micro_batches + 1, 3: 3 * micro_batches}[stage]  # halves of a ring all-reduce
    dp_bytes = rounds * held * ring(dp) / 2
    return {"compute": compute, "tp": tp_bytes / intra_node, "pp": pp_bytes / inter_node, "dp": dp_bytes / inter_node}


def tokens_per_step(model: Transformer, plan: Plan) -> int:
    return plan.dp * plan.micro_batches * plan.micro_batch * model.seq_len


def training_days(model: Transformer, plan: Plan, tokens: float) -> float:
    """Days to train on `tokens` at the plan's step time: 8TP/(nX) (8P flops per token: forward, backward and
    the recomputed forward), with the
    throughput X per GPU that the cost model gives (8 psi flops per token over the step's GPU-seconds)."""
    return tokens / tokens_per_step(model, plan) * plan.step_seconds / 86400


def model_flops_utilization(model: Transformer, plan: Plan, peak_flops: float) -> float:
    """Model FLOPs per second over the GPUs' peak: 6 psi per token (forward 2, backward 4), not the recomputed
    forward, which the step pays for but the model does not need."""
    gpus = plan.tp * plan.pp * plan.dp
    return 6 * model.psi * tokens_per_step(model, plan) / plan.step_seconds / (gpus * peak_flops)


def plan(model: Transformer, gpus: int, memory_per_gpu: float, global_batch: int, *, flops: float,
         intra_node: float, inter_node: float, gpus_per_node: int = 8, micro_batch_sizes=(1, 2, 4),
         stages=(0, 1, 2, 3), reserve: float = 0.0, k: int = 12, zero23_with_pipeline: bool = False) -> list[Plan]:
    """Every valid (tp, pp, dp, ZeRO stage, micro-batch size) on `gpus` whose model states and activations fit
    memory_per_gpu - reserve bytes, cheapest step first (equal steps: the lighter first). tp divides gpus_per_node
    and the heads, pp the layers; M = global_batch / (dp * micro-batch size) is whole; ZeRO-2/3 with a pipeline
    only if zero23_with_pipeline (DeepSpeed refuses them)."""
    divisors = lambda n: [d for d in range(1, n + 1) if n % d == 0]
    plans = []
    for tp in divisors(gpus_per_node):
        for pp in divisors(model.layers):
            if model.heads % tp or gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            for stage in stages:
                if stage >= 2 and pp > 1 and not zero23_with_pipeline:
                    continue
                for micro_batch in micro_batch_sizes:
                    if global_batch % (dp * micro_batch):
                        continue
                    m = global_batch // (dp * micro_batch)
                    states = model_states_per_gpu(model.psi, tp, pp, dp, stage, k)
                    activations = activation_bytes(model, pp, micro_batch, m)
                    if states + activations > memory_per_gpu - reserve:
                        continue
                    seconds = step_seconds(model, tp, pp, dp, stage, micro_batch, m, flops, intra_node, inter_node)
                    plans.append(Plan(tp, pp, dp, stage, micro_batch, m, states, activations, (pp - 1) / (m + pp - 1),
                                      seconds))
    return sorted(plans, key=lambda p: (p.step_seconds, p.model_states + p.activations))
