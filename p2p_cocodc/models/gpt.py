"""A decoder-only GPT in one readable file, and its size presets (``models/build.py`` builds any
model the options name: a preset, a Hugging Face model or a plug-in)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from p2p_cocodc.errors import UserError


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int
    n_layer: int
    n_embd: int
    n_head: int


# (n_layer, n_embd, n_head); parameter counts are for the 4096-token BPE vocabulary.
PRESETS: dict[str, tuple[int, int, int]] = {
    "nano": (2, 64, 2),  # ~0.4 M, for fast tests
    "micro": (4, 64, 4),  # ~0.5 M, for benchmarks with many runs
    "tiny": (4, 128, 4),  # ~1.3 M
    "small": (4, 256, 4),  # ~4.2 M
    "base": (8, 384, 6),  # ~15.7 M
}


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.attn_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.mlp_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp_proj(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    """GPT-2 style: learned positions, tied input/output embeddings, GPT-2 init."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise UserError(f"n_embd {cfg.n_embd} must be divisible by n_head {cfg.n_head}")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled down so the residual stream does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith(("attn_proj.weight", "mlp_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds the model's seq_len {self.cfg.seq_len}")
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)

    def fragment_units(self) -> list[list[str]]:
        """Embedding (with the tied head), each block, final norm: the order fragments stride over."""
        units = [["wte.weight", "wpe.weight"]]
        for i, block in enumerate(self.blocks):
            units.append([f"blocks.{i}.{name}" for name, _ in block.named_parameters()])
        units.append(["ln_f.weight", "ln_f.bias"])
        return units
