# Generated from solutions/19_moe/19_moe.ipynb by `zero-lab build`: edit the notebook, not this file.

"""A DeepSeek-V3-sized mixture of experts counted in lesson 13's fake world (lesson 19): model states per GPU with
expert x data parallelism, from the course's own ZeRO code, on thousands of ranks that cost nothing.

DEEPSEEK_V3             the published shapes (deepseek-ai/DeepSeek-V3, inference/configs/config_671B.json)
deepseek_v3_parameters  (dense, routed experts) parameter counts of those shapes, as its inference/model.py builds them
DeepSeekV3Shaped        those counts as two flat tensors: the dense parameters and this rank's 1/ep of the experts
count_moe_states        model-state bytes on ranks of a fake world, stages 1-2, sharded as lesson 19 shards experts
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor  # private API, as in lesson 13

from zero_lab.prepare import prepare
from zero_lab.scale import BigLinears, in_fake_world

if __name__ != "__main__":
    from zero_lab.moe_zero import make_expert_groups

DEEPSEEK_V3 = dict(vocab_size=129280, dim=7168, inter_dim=18432, moe_inter_dim=2048, n_layers=61, n_dense_layers=3,
                   n_heads=128, n_routed_experts=256, n_shared_experts=1, q_lora_rank=1536, kv_lora_rank=512,
                   qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def deepseek_v3_parameters(c: dict = DEEPSEEK_V3) -> tuple[int, int]:
    """(dense, routed experts): every parameter that is not a routed expert (attention, norms, the first dense FFNs,
    shared experts, routers with their balancing bias, embedding and head), and all routed experts together."""
    d, heads, qk = c["dim"], c["n_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    attention = (d * c["q_lora_rank"] + c["q_lora_rank"] + c["q_lora_rank"] * heads * qk  # low-rank queries
                 + d * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) + c["kv_lora_rank"]  # compressed keys, values
                 + c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["v_head_dim"]) + heads * c["v_head_dim"] * d)
    layer = attention + 2 * d  # and two RMSNorms
    ffn = lambda hidden: 3 * d * hidden  # SwiGLU: w1, w2, w3, no biases
    moe_layers = c["n_layers"] - c["n_dense_layers"]
    router = c["n_routed_experts"] * d + c["n_routed_experts"]  # its weight and its balancing bias
    dense = (c["n_layers"] * layer + c["n_dense_layers"] * ffn(c["inter_dim"])
             + moe_layers * (ffn(c["n_shared_experts"] * c["moe_inter_dim"]) + router) + 2 * c["vocab_size"] * d + d)
    return dense, moe_layers * c["n_routed_experts"] * ffn(c["moe_inter_dim"])


class DeepSeekV3Shaped(nn.Module):
    """DeepSeek-V3's parameter counts on one rank of ep-way expert parallelism: `dense` (all of them) and `experts`
    (1/ep of the routed experts), one flat tensor each. Stages 1-2 flatten each param group into one buffer, so the
    shapes inside a group change no byte of the count. Made in FakeTensorMode it costs nothing."""

    _apply = BigLinears._apply  # lesson 13's: keep fake parameters when prepare() moves the model

    def __init__(self, ep: int):
        super().__init__()
        if not isinstance(torch.empty(0), FakeTensor):
            raise RuntimeError("DeepSeekV3Shaped holds 671B parameters: build it in the fake world (count_moe_states)")
        dense, routed = deepseek_v3_parameters()
        if routed % ep:
            raise ValueError(f"the routed experts' {routed} parameters do not split over ep = {ep}")
        self.dense = nn.Parameter(torch.empty(dense))
        self.experts = nn.Parameter(torch.empty(routed // ep))

    def forward(self):
        return self.dense.sum() + self.experts.sum()


def _count_step(ep: int, stage: int) -> int:
    """Inside the fake world: the expert groups, prepare() with the dense group over the world and the experts over
    their expert-data-parallel group, one fp32 AdamW step; the bytes of the tensors the optimizer holds."""
    _, expert_data_group = make_expert_groups(ep)
    model = DeepSeekV3Shaped(ep)
    groups = [{"params": [model.dense]}, {"params": [model.experts], "process_group": expert_data_group}]
    model, optimizer = prepare(model, torch.optim.AdamW, stage, params=groups, lr=1e-4)
    model().backward()
    optimizer.step()
    tensors = {id(t): t for held in optimizer.model_state_tensors().values() for t in held}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def count_moe_states(world: int, ep: int, stages=(1, 2), ranks=(0,), timeout: float = 300.0) -> dict:
    """{(stage, rank): model-state bytes} of DeepSeekV3Shaped on those ranks of a `world`-rank fake world."""
    jobs = [(stage, rank) for stage in stages for rank in ranks]
    runs = in_fake_world([(world, rank, _count_step, (ep, stage)) for stage, rank in jobs], timeout)
    return {job: run.value for job, run in zip(jobs, runs)}
