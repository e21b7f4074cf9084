"""The stages `zero_lab.prepare` builds, in one table: where each comes from and what it takes.

    STAGES[1].module, STAGES[1].optimizer   # "zero_lab.zero1", "Zero1Optimizer"

`prepare`, `python -m zero_lab.train --stage`, `zero-lab stages`, docs/stages.md and each
lesson's "where this lives" cell (`prepare_arguments`) read it. A new stage is one row here (and its lesson). No
torch here: the command line reads the table without loading it.
"""

from __future__ import annotations

from dataclasses import dataclass

OFFLOAD_LESSON, OFFLOAD_MODULE = "06_offload", "zero_lab.offload"
OFFLOAD_OPTIONS = frozenset({"offload", "dpu_warmup_steps", "cpu_adam", "adam_threads"})
# Stage 3 with offload="nvme" (lesson 10): ZeRO-Infinity's optimizer states on a simulated NVMe tier.
NVME_LESSON, NVME_MODULE = "10_infinity", "zero_lab.infinity"
NVME_OPTIONS = frozenset({"offload", "nvme_dir", "nvme_bandwidth", "nvme_quota", "nvme_chunk_numel"})
# Stage 3 on nodes of ranks_per_node ranks (lesson 09): ZeRO++ (qwz, hpz, qgz) or HSDP.
NODE_OPTIONS = frozenset({"ranks_per_node", "qwz", "hpz", "qgz", "replicate_across_nodes", "weights_block",
                          "grads_block"})
# Stage 1 with torch.optim.Muon (lesson 12): the update needs whole matrices; muon_sharding= picks how.
MUON_LESSON, MUON_MODULE = "12_muon", "zero_lab.muon"
MUON_OPTIONS = frozenset({"muon_sharding", "adamw"})
# Stage 3 with torch.optim.Muon (lesson 12, part 2): owners orthogonalise whole matrices; adamw= as at stage 1.
MUON_ZERO3_MODULE, MUON_ZERO3_OPTIONS = "zero_lab.muon_zero3", frozenset({"adamw"})
# Stages 1-3 over a process group, not all ranks (lesson 17): the data-parallel group of a mesh.
GROUP_OPTIONS = frozenset({"group"})
# Stages 1-2 with param groups that name their own process group ("process_group" key; lesson 19's experts over
# their expert-data-parallel group): one optimizer of the stage per process group, stepped together.
PROCESS_GROUP_KEY, PROCESS_GROUPS_LESSON, PROCESS_GROUPS_MODULE = "process_group", "19_moe", "zero_lab.moe_zero"
PROCESS_GROUPS_STAGES = (1, 2)


@dataclass(frozen=True)
class Variant:
    """Where a stage's optimizer comes from when an option asks for another lesson's version of it."""
    lesson: str
    module: str
    builds: str


@dataclass(frozen=True)
class Stage:
    name: str  # the paper's name for what it shards
    partitions: tuple[str, ...]  # the model states each rank holds 1/N of (memory.py's categories)
    lesson: str  # the lesson whose `#| export` cells write `module`
    module: str
    builds: str  # the class prepare makes: an optimizer, or for DDP the model's wrapper
    options: frozenset[str]  # prepare's options for this stage, besides the optimizer's own
    offload: str | None = None  # with offload="cpu": this class of OFFLOAD_MODULE instead (ZeRO-Offload)
    wraps_model: bool = False  # prepare returns builds(model) and the user's optimizer (DDP)
    nodes: Variant | None = None  # with ranks_per_node=: this class instead (ZeRO++ and HSDP)
    nvme: str | None = None  # with offload="nvme": this class of NVME_MODULE instead (ZeRO-Infinity)
    muon: Variant | None = None  # with torch.optim.Muon: this class instead (whole-matrix updates, lesson 12)

    @property
    def shards_parameters(self) -> bool:
        return "parameters" in self.partitions


STAGES = {
    0: Stage("DDP", (), "02_ddp", "zero_lab.ddp", "BucketedDDP", frozenset({"param_dtype", "find_unused_parameters"}), wraps_model=True),
    1: Stage("P_os", ("master_params", "optimizer_states"), "03_zero1", "zero_lab.zero1", "Zero1Optimizer",
             frozenset({"param_dtype", "max_grad_norm", "find_unused_parameters", *GROUP_OPTIONS, *OFFLOAD_OPTIONS,
                        *MUON_OPTIONS}),
             offload="Zero1Offload", muon=Variant(MUON_LESSON, MUON_MODULE, "MuonZero1")),
    2: Stage("P_os+g", ("master_params", "optimizer_states", "gradients"), "04_zero2", "zero_lab.zero2",
             "Zero2Optimizer", frozenset({"param_dtype", "max_grad_norm", "bucket_numel", "find_unused_parameters",
                                          *GROUP_OPTIONS, *OFFLOAD_OPTIONS}),
             offload="Zero2Offload"),
    3: Stage("P_os+g+p", ("master_params", "optimizer_states", "gradients", "parameters"), "05_zero3",
             "zero_lab.zero3", "Zero3Optimizer",
             frozenset({"param_dtype", "max_grad_norm", "units", "prefetch", "max_live_numel", "reshard_last", "init_fn",
                        *GROUP_OPTIONS, *NODE_OPTIONS, *NVME_OPTIONS, *MUON_ZERO3_OPTIONS}),
             nodes=Variant("09_zeropp", "zero_lab.zeropp", "ZeroPPOptimizer"), nvme="Zero3Infinity",
             muon=Variant(MUON_LESSON, MUON_ZERO3_MODULE, "MuonZero3")),
}


def prepare_arguments(lesson: str) -> list[str]:
    """How prepare reaches a lesson's code, one entry per stage: 'stage=1 (param_dtype=, max_grad_norm=)'."""
    def entry(call: str, options) -> str:
        return call + (f" ({', '.join(f'{name}=' for name in sorted(options))})" if options else "")
    found = []
    for number, stage in STAGES.items():
        if stage.lesson == lesson:
            found.append(entry(f"stage={number}", stage.options - OFFLOAD_OPTIONS - NODE_OPTIONS - NVME_OPTIONS
                               - MUON_OPTIONS))
        if stage.nodes and lesson == stage.nodes.lesson:
            found.append(entry(f"stage={number}, ranks_per_node=N", stage.options & NODE_OPTIONS - {"ranks_per_node"}))
        if stage.offload and lesson == OFFLOAD_LESSON:
            found.append(entry(f'stage={number}, offload="cpu"', stage.options - {"offload"} - NVME_OPTIONS - MUON_OPTIONS
                               - GROUP_OPTIONS))
        if stage.nvme and lesson == NVME_LESSON:
            found.append(entry(f'stage={number}, offload="nvme"', stage.options - {"offload"} - NODE_OPTIONS - GROUP_OPTIONS
                               - MUON_OPTIONS))
        if stage.muon and lesson == stage.muon.lesson:
            found.append(entry(f"stage={number} with torch.optim.Muon", MUON_OPTIONS & stage.options))
    return found


def markdown() -> str:
    """The table for docs/stages.md and `zero-lab stages`."""
    rows = ["# The stages of `zero_lab.prepare`", "",
            "Generated by `zero-lab build` from `zero_lab/stages.py`, the table `prepare` reads; do not edit.", "",
            "    model, optimizer = zero_lab.prepare(model, torch.optim.AdamW, stage=N, lr=3e-4, **options)", "","| stage | name | each rank holds 1/N of | lesson | prepare builds | options besides the optimizer's |",
            "|---|---|---|---|---|---|"]
    for number, stage in STAGES.items():
        builds = f"`{stage.module}.{stage.builds}`"
        if stage.offload:
            builds += f"; offload=\"cpu\": `{OFFLOAD_MODULE}.{stage.offload}` ({OFFLOAD_LESSON})"
        if stage.nodes:
            builds += f"; ranks_per_node=: `{stage.nodes.module}.{stage.nodes.builds}` ({stage.nodes.lesson})"
        if stage.nvme:
            builds += f"; offload=\"nvme\": `{NVME_MODULE}.{stage.nvme}` ({NVME_LESSON})"
        if stage.muon:
            builds += f"; torch.optim.Muon: `{stage.muon.module}.{stage.muon.builds}` ({stage.muon.lesson})"
        options = ", ".join(f"`{option}`" for option in sorted(stage.options))
        rows.append(f"| {number} | {stage.name} | {', '.join(stage.partitions) or 'nothing (replicated)'} "
                    f"| {stage.lesson} | {builds} | {options} |")
    return "\n".join(rows) + "\n"
