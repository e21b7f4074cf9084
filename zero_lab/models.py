"""Small models for the lessons: a GPT-style decoder and a plain MLP.

    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=32, block_size=32), seed=0)
    logits, loss = model(tokens, targets)            # tokens, targets: (batch, time) int64

    model = MLP(sizes=[16, 64, 64, 4], seed=0)
    prediction = model(x)                            # x: (batch, 16)

Both are built deterministically from `seed` (the same seed gives the same weights on every
rank and every run) without touching the global random state. The defaults are small enough
that a CPU training step takes milliseconds.

The GPT follows nanoGPT (github.com/karpathy/nanoGPT) minus dropout: token + position
embeddings, pre-LayerNorm blocks of causal self-attention and MLP, a final LayerNorm and a
language-model head whose weight is the token embedding's (weight tying: one tensor, two
uses). Attention is written out instead of calling `scaled_dot_product_attention`, so the
(time x time) attention matrix is an ordinary tensor saved for backward: lesson 01 measures it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    block_size: int = 32  # longest sequence the position embedding covers
    bias: bool = True  # biases in Linear layers and LayerNorms


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be a multiple of n_head"
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        causal_mask = torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool))
        self.register_buffer("causal_mask", causal_mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_size)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(~self.causal_mask[:T, :T], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again
        return self.c_proj(y)


class FeedForward(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig | None = None, seed: int = 0):
        super().__init__()
        self.config = config = config or GPTConfig()
        with torch.random.fork_rng(devices=[]):  # seed our init, leave the caller's RNG alone
            torch.manual_seed(seed)
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            ))
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
            self.lm_head.weight = self.transformer.wte.weight  # weight tying
            self.apply(self._init_weights)
            # GPT-2: scale the projections into the residual stream by 1/sqrt(2 * n_layer).
            for name, param in self.named_parameters():
                if name.endswith("c_proj.weight"):
                    nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        """Parameters counted once each (`parameters()` already skips the tied head)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        assert T <= self.config.block_size, f"sequence of {T} tokens, block_size is {self.config.block_size}"
        positions = torch.arange(T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(positions)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


class MLP(nn.Module):
    """Linear layers of the given widths with ReLU between them: sizes=[in, hidden..., out]."""

    def __init__(self, sizes: list[int] = (16, 64, 64, 4), seed: int = 0):
        super().__init__()
        assert len(sizes) >= 2, "sizes needs at least an input and an output width"
        self.sizes = list(sizes)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            layers: list[nn.Module] = []
            for width_in, width_out in zip(sizes[:-1], sizes[1:]):
                layers += [nn.Linear(width_in, width_out), nn.ReLU()]
            self.layers = nn.Sequential(*layers[:-1])  # no ReLU after the output layer

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
