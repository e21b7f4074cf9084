# Generated from solutions/07_benchmarks/07_benchmarks.ipynb by `zero-lab build`: edit the notebook, not this file.

"""Lesson 07's two analyses of a measured training step, used by benchmarks/memory_vs_formula.py.

decompose_residual  peak - formula, split into activations, gathered parameters, gradient
                    buckets, optimizer states and temporaries, at the step's largest reading
largest_that_fits   the largest GPT of a depth x width family that completes a step under a
                    budget, with a binary search over the widths of each depth
"""

from zero_lab.memory_ledger import CATEGORIES

RESIDUAL_PARTS = ("activations", "gathered parameters", "gradient buckets", "optimizer states", "temporaries")


def decompose_residual(samples: list[dict], formula: dict, peak) -> dict:
    """Split `peak - sum(formula.values())` into RESIDUAL_PARTS (bytes, summing to exactly that).

    samples: readings taken during one step, each with the bytes of every category of CATEGORIES
    (the memory ledger's) and "activations" (bytes saved for backward, still alive); other keys
    are ignored. formula: the paper's bytes per category. peak: the step's measured peak.
    The parts are read at the sample with the most bytes (model states + activations):
      activations          its activations
      gathered parameters  its parameters minus the formula's (stage 3: layers gathered; else padding)
      gradient buckets     its gradients minus the formula's (buckets being reduced; negative
                           when the formula's gradients do not exist at that moment)
      optimizer states     its master params + optimizer states minus the formula's (padding)
      temporaries          peak minus that sample's total: what no reading names
    """
    def total(sample):
        return sum(sample[category] for category in CATEGORIES) + sample["activations"]

    at_peak = max(samples, key=total)
    return {
        "activations": at_peak["activations"],
        "gathered parameters": at_peak["parameters"] - formula["parameters"],
        "gradient buckets": at_peak["gradients"] - formula["gradients"],
        "optimizer states": sum(at_peak[c] - formula[c] for c in ("master_params", "optimizer_states")),
        "temporaries": peak - total(at_peak),
    }


def largest_that_fits(depths, widths, fits, num_params):
    """The (depth, width) with the most parameters among those that fit, or None if none does.

    widths ascend, and for a fixed depth fitting is monotone: if a width fits, every smaller one
    does. fits(depth, width) -> bool runs a training step, so it is expensive: binary search the
    widths of each depth, calling fits at most ceil(log2(len(widths) + 1)) times per depth.
    num_params(depth, width) -> int ranks the candidates; on a tie the first found is kept.
    """
    best = None
    for depth in depths:
        lo, hi = 0, len(widths)  # widths[:lo] fit, widths[hi:] do not
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(depth, widths[mid]):
                lo = mid + 1
            else:
                hi = mid
        if lo and (best is None or num_params(depth, widths[lo - 1]) > num_params(*best)):
            best = (depth, widths[lo - 1])
    return best
