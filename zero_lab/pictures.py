"""Pictures the lessons share: who holds what of the model states, drawn from live tensors.

    held = zero_lab.launch(lambda: held_elements(model, optimizer), world_size)  # on every rank
    draw_who_holds_what(held, title="DDP, 2 ranks")

The input of `draw_who_holds_what` is one dict per rank, {row: elements that rank holds},
with the rows of `ROWS`, plus `full` = {row: elements of the whole model}. When `full` is
left out, the largest count of each row over the ranks is taken as the whole, which is right
as long as some rank holds all of it; a sharded optimizer, where nobody does, passes `full`.
A cell is coloured "all" when the rank holds the whole row, "shard" when it holds part of it
(the cell says which fraction), "nothing" when it holds none. `held_elements` fills the dict
for a model and any optimizer that exposes torch's `param_groups` and `state` (Adam's
`exp_avg` is m, `exp_avg_sq` is v); an optimizer that keeps its tensors elsewhere can build
the dict itself.

    draw_comm_timeline(ax, rank, timeline)  # one rank's backward and its collectives, lessons 02-04

draws what a rank recorded around one backward pass: when each gradient became final, each
collective from launch to completion, and the time the rank spent waiting for communication.
Hand-written, not exported from a lesson.
"""

from __future__ import annotations

from fractions import Fraction

import matplotlib.pyplot as plt
import torch

ROWS = ("params", "grads", "master", "m", "v")
LABELS = {"params": "params\n(compute dtype)", "grads": "grads", "master": "fp32 master", "m": "Adam m", "v": "Adam v"}
COLOURS = {"all": "#2b6cb0", "shard": "#90cdf4", "nothing": "#ffffff"}


def _elements(tensors) -> int:
    # Elements of distinct tensors: a tensor reached twice (a tied weight) counts once. Views
    # count what they show, so a shard that is a view into a full buffer counts as a shard.
    seen, total = set(), 0
    for t in tensors:
        key = (t.data_ptr(), t.numel(), str(t.device))
        if t.numel() and t.untyped_storage().nbytes() and key not in seen:
            seen.add(key)
            total += t.numel()
    return total


def held_elements(model: torch.nn.Module, optimizer=None) -> dict[str, int]:
    """{row: elements this rank holds} for the model's parameters and the optimizer's tensors."""
    params = list(model.parameters())
    model_ptrs = {p.data_ptr() for p in params}
    groups = optimizer.param_groups if optimizer is not None else []
    master = [t for g in groups for t in g["params"] if t.data_ptr() not in model_ptrs]
    states = list(optimizer.state.values()) if optimizer is not None else []
    return {
        "params": _elements(params),
        "grads": _elements(p.grad for p in params if p.grad is not None),
        "master": _elements(master),
        "m": _elements(s["exp_avg"] for s in states if "exp_avg" in s),
        "v": _elements(s["exp_avg_sq"] for s in states if "exp_avg_sq" in s),
    }


def holding(count: int, whole: int) -> str:
    """'all', 'shard' or 'nothing'."""
    return "nothing" if count == 0 else "all" if count >= whole else "shard"


def draw_who_holds_what(held: list[dict[str, int]], full: dict[str, int] | None = None, ax=None, title: str = ""):
    """Ranks (columns) x model-state rows, each cell coloured all / shard / nothing."""
    full = full or {row: max(h.get(row, 0) for h in held) for row in ROWS}
    if ax is None:
        _, ax = plt.subplots(figsize=(1.2 + 1.1 * len(held), 2.8))
    for col, rank_held in enumerate(held):
        for row, name in enumerate(ROWS):
            count, whole = rank_held.get(name, 0), full.get(name, 0)
            kind = holding(count, whole) if whole else "nothing"
            ax.add_patch(plt.Rectangle((col, row), 1, 1, facecolor=COLOURS[kind], edgecolor="0.4"))
            text = {"all": "all", "nothing": "—", "shard": f"{Fraction(count, whole).limit_denominator(64)}"}[kind]
            ax.text(col + 0.5, row + 0.5, text, ha="center", va="center", fontsize=8,
                    color="white" if kind == "all" else "black")
    ax.set_xlim(0, len(held))
    ax.set_ylim(len(ROWS), 0)
    ax.set_xticks([c + 0.5 for c in range(len(held))], [f"rank {r}" for r in range(len(held))])
    ax.set_yticks([r + 0.5 for r in range(len(ROWS))], [LABELS[name] for name in ROWS], fontsize=8)
    ax.tick_params(length=0)
    ax.set_title(title, fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="0.4") for c in COLOURS.values()]
    ax.legend(handles, ["all of it", "a shard (fraction)", "nothing"], loc="upper left",
              bbox_to_anchor=(1.01, 1), fontsize=7)
    return ax


def draw_comm_timeline(ax, rank: int, timeline: dict, collective: str = "all-reduce", message: str = "bucket",
                       span: str = "inside loss.backward()"):
    """One rank's backward pass and its collectives, on the rank's own clock (ms since backward()).

    timeline = {"backward_ms": when backward() returned, "events": [(ms, kind, bytes), ...]} with
    kinds "ready" (a gradient is final), "launch" and "done" (a collective started, completed),
    "wait" and "waited" (the rank started and stopped waiting for it); a collective's later
    events are matched to it by its bytes (zero_lab.timeline records them). Each wait is a red
    bar; `span` names the grey span from 0 to timeline["backward_ms"]. Returns (when the last
    gradient was final, ms spent waiting, summed over the waits).
    """
    events, launched = timeline["events"], []
    for t, kind, nbytes in events:
        if kind == "launch":
            launched.append({"launch": t, "bytes": nbytes})
        elif kind in ("done", "wait", "waited"):  # completions and waits come in launch order
            next(c for c in launched if c["bytes"] == nbytes and kind not in c)[kind] = t
    ready = [t for t, kind, _ in events if kind == "ready"]
    ax.axvspan(0, timeline["backward_ms"], color="0.93", label=span)
    ax.plot(ready, [-1] * len(ready), "|", color="k", markersize=12, label="a gradient is final (compute)")
    for i, c in enumerate(launched):
        ax.barh(i, c["done"] - c["launch"], left=c["launch"], height=0.6, color="tab:blue",
                label=f"{collective} in flight: launch to completion" if i == 0 else None)
        ax.text(c["done"], i, f" {c['bytes'] / 1024:.0f} KiB", va="center", fontsize=7)
    waits = [(c["wait"], c["waited"]) for c in launched if "wait" in c]
    for i, (begin, end) in enumerate(waits):
        ax.barh(len(launched), end - begin, left=begin, height=0.6, color="tab:red",
                label="waiting for communication (not hidden)" if i == 0 else None)
    ax.set_yticks([-1, *range(len(launched)), len(launched)],
                  ["gradients", *[f"{message} {i}" for i in range(len(launched))], "wait"])
    ax.invert_yaxis()
    ax.set_title(f"rank {rank}", fontsize=9, loc="left")
    return max(ready, default=0.0), sum(end - begin for begin, end in waits)
