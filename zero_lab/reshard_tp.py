# Generated from solutions/16_checkpoints/16_checkpoints.ipynb by `zero-lab build`: edit the notebook, not this file.

"""Tensor-parallel checkpoints resharded t -> t': Megatron's layout written as pieces (lesson 16, section 7).

tp_pieces       the pieces of one parameter that a tensor-parallel rank's local tensor holds
gpt_tp_params   (name, full shape, split) of the course GPT as lesson 17's tensor_parallel_gpt splits it
tp_file_pieces  a rank's pieces in its file: its local tensors end to end, a whole parameter written once (rank 0)
save_tp         every rank writes its local tensors raw
load_tp         every rank of another t reads its local tensors back through load_plan and read_pieces
"""

import math
import os

import torch

SPLITS = ("whole", "rows", "columns", "heads")


def tp_pieces(name: str, shape, split: str, t: int, rank: int) -> list:
    """The pieces of parameter `name` (full `shape`) that tensor-parallel rank `rank` of `t` holds, offsets in its local
    tensor (flattened). split: "whole", "rows" (column-parallel), "columns" (row-parallel) or "heads" (c_attn's
    [q; k; v] rows, the rank's heads in each). Merged where they continue each other; work in proportion to them."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is none of {SPLITS}")

    def part(n: int) -> tuple[int, int]:
        """[low, high) of this rank's part when torch.tensor_split cuts n items into t (the longer parts first)."""
        base, longer = divmod(n, t)
        low = rank * base + min(rank, longer)
        return low, low + base + (rank < longer)

    rows, row = shape[0], math.prod(shape[1:])
    if split == "whole":
        runs = [(0, rows * row)]
    elif split == "rows":
        low, high = part(rows)
        runs = [(low * row, (high - low) * row)]
    elif split == "heads":
        width = rows // 3
        low, high = part(width)
        runs = [((block * width + low) * row, (high - low) * row) for block in range(3)]
    else:
        low, high = part(shape[1])
        runs = [(r * shape[1] + low, high - low) for r in range(rows)]
    pieces, offset = [], 0
    for start, numel in runs:
        if not numel:
            continue
        last = pieces[-1] if pieces else None
        if last and last.start + last.numel == start:  # the local offsets always continue
            pieces[-1] = last._replace(numel=last.numel + numel)
        else:
            pieces.append(Piece(name, tuple(shape), start, numel, offset))
        offset += numel
    return pieces


def gpt_tp_params(model: torch.nn.Module) -> list[tuple[str, tuple, str]]:
    """(name, full shape, split) of each parameter of the course GPT `model` (whole), under the names that lesson 17's
    tensor_parallel_gpt gives them (its MLP is a Sequential: c_fc is mlp.0, c_proj mlp.2), in their order."""
    params = []
    for name, p in model.named_parameters():
        if ".attn.c_attn." in name:
            split = "heads"
        elif name.endswith("c_proj.weight"):
            split = "columns"
        elif ".mlp.c_fc." in name:
            split = "rows"
        else:
            split = "whole"
        params.append((name.replace(".mlp.c_fc.", ".mlp.0.").replace(".mlp.c_proj.", ".mlp.2."), tuple(p.shape), split))
    return params


def tp_file_pieces(params, t: int, rank: int, saved: bool = False) -> list:
    """Rank `rank`'s pieces of every parameter in `params` (gpt_tp_params), offsets in its file: its local tensors end
    to end. saved: what the rank wrote, where a whole parameter, the same on every rank, is written by rank 0 only."""
    pieces, base = [], 0
    for name, shape, split in params:
        if saved and split == "whole" and rank:
            continue
        mine = tp_pieces(name, shape, split, t, rank)
        pieces += [p._replace(offset=base + p.offset) for p in mine]
        base += sum(p.numel for p in mine)
    return pieces


def _local_tensors(model, params) -> list[torch.Tensor]:
    named = dict(model.named_parameters())
    if list(named) != [name for name, _, _ in params]:
        raise ValueError(f"the model's parameters {list(named)[:4]}... are not {[n for n, _, _ in params][:4]}...")
    return [named[name].detach().view(-1) for name, _, _ in params]


def save_tp(model, params, folder) -> None:
    """Every rank of the tensor-parallel group writes its local tensors, end to end, raw, to folder/tp<rank>.bin."""
    import torch.distributed as dist
    rank = dist.get_rank()
    local = [x for x, (_, _, split) in zip(_local_tensors(model, params), params) if rank == 0 or split != "whole"]
    with open(os.path.join(folder, f"tp{rank}.bin"), "wb") as file:
        file.write(memoryview(torch.cat(local).numpy()).cast("B"))


@torch.no_grad()
def load_tp(model, params, folder, saved_t: int, buffer_numel: int = 1 << 16) -> dict:
    """Every rank of a tensor-parallel group of any size reads its local tensors from save_tp's files of saved_t ranks,
    only the byte ranges it needs; returns {"reads", "bytes_read", "local_bytes"}."""
    import torch.distributed as dist
    t, rank = dist.get_world_size(), dist.get_rank()
    saved = [tp_file_pieces(params, saved_t, r, saved=True) for r in range(saved_t)]
    plan = load_plan(saved, tp_file_pieces(params, t, rank))
    segments, offset = [], 0
    for local in _local_tensors(model, params):
        segments.append((offset, local))
        offset += local.numel()
    files = {r: open(os.path.join(folder, f"tp{r}.bin"), "rb") for r in {read.rank for read in plan}}
    try:
        read = read_pieces(plan, files, _put(segments), torch.empty(buffer_numel))
    finally:
        for file in files.values():
            file.close()
    return {"reads": len(plan), "bytes_read": read, "local_bytes": offset * 4}


if __name__ != "__main__":
    from zero_lab.reshard import Piece, _put, load_plan, read_pieces
