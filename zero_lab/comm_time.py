# Generated from solutions/18_calculator/18_calculator.ipynb by `zero-lab build`: edit the notebook, not this file.

'''Communication time (lesson 18): an alpha-beta model of ring collectives and of a DDP / ZeRO step; when a step is
compute-bound.

collective_seconds   a ring collective's time: steps * (alpha + piece * beta)
fit_alpha_beta       alpha and beta from timed collectives, by least squares
zero_step_seconds    the communication of one DDP (stage 0) or ZeRO-1/2/3 step (the ZeRO paper's volumes)
critical_tokens      tokens per rank above which data parallelism's communication hides behind the backward
max_tensor_parallel  the tensor-parallel degree above which its communication outlasts its matmuls
'''

from __future__ import annotations

RING_STEPS = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}  # times (world - 1)


def collective_seconds(kind: str, nbytes: float, world: int, alpha: float, beta: float) -> float:
    '''A ring `kind` of nbytes on world ranks: each step sends nbytes / world bytes.'''
    steps = RING_STEPS[kind] * (world - 1)
    return steps * (alpha + nbytes / world * beta)


def fit_alpha_beta(samples) -> tuple[float, float]:
    '''(alpha, beta) minimising the squared error of steps * alpha + sent * beta over (kind, nbytes, world, seconds).'''
    rows = []
    for kind, nbytes, world, seconds in samples:
        steps = RING_STEPS[kind] * (world - 1)
        rows.append((steps, steps * nbytes / world, seconds))
    a11 = sum(s * s for s, _, _ in rows)
    a12 = sum(s * m for s, m, _ in rows)
    a22 = sum(m * m for _, m, _ in rows)
    b1 = sum(s * t for s, _, t in rows)
    b2 = sum(m * t for _, m, t in rows)
    determinant = a11 * a22 - a12 * a12
    return (b1 * a22 - b2 * a12) / determinant, (a11 * b2 - a12 * b1) / determinant


def zero_step_seconds(stage: int, param_bytes: float, world: int, alpha: float, beta: float) -> float:
    '''Communication of one step: stage 0 all-reduces the gradients; 1 and 2 reduce-scatter them and all-gather the
    parameters; 3 all-gathers the parameters twice (forward, backward) and reduce-scatters the gradients.'''
    kinds = {0: ["all_reduce"], 1: ["reduce_scatter", "all_gather"], 2: ["reduce_scatter", "all_gather"],
             3: ["all_gather", "all_gather", "reduce_scatter"]}[stage]
    return sum(collective_seconds(kind, param_bytes, world, alpha, beta) for kind in kinds)


def critical_tokens(flops: float, bandwidth: float, bytes_per_value: int = 2, world: int | None = None,
                    experts: int = 1, active: int = 1) -> float:
    '''Tokens per GPU where the backward's 4 FLOPs per parameter and token (k / E of the tokens per expert parameter)
    take as long as the ring all-reduce's 2 (n - 1) / n values per parameter on the link.'''
    ring = 1 if world is None else (world - 1) / world
    return 2 * bytes_per_value * ring / 4 * (experts / active) * flops / bandwidth


def max_tensor_parallel(ffn: int, flops: float, bandwidth: float) -> float:
    '''The tensor-parallel degree Y below which an MLP's matmuls outlast its activations' collectives: F W / C.'''
    return ffn * bandwidth / flops
