"""A decoder-only GPT in one readable file, its size presets, and the plug-in path for other models.

The trainer needs two things from a model: ``model(idx) -> logits`` and ``fragment_units()``, the
parameter names grouped into units in order (embedding, each block, final norm / head). Units are
what fragments are made of, so a plug-in model only has to declare them.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from p2p_cocodc.errors import UserError
from p2p_cocodc.names import HF_PREFIX


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


@runtime_checkable
class FragmentedModel(Protocol):
    """What the trainer needs from any model: logits from token ids, and its fragment units."""

    def __call__(self, idx: torch.Tensor) -> torch.Tensor: ...

    def fragment_units(self) -> list[list[str]]: ...


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


def build_model(spec: str, vocab_size: int, seq_len: int) -> nn.Module:
    """A preset name (``tiny``), a Hugging Face causal LM ``hf:PATH_OR_NAME`` (p2p_cocodc.hf), or a
    plug-in ``module:factory`` called as factory(vocab_size, seq_len)."""
    if spec in PRESETS:
        n_layer, n_embd, n_head = PRESETS[spec]
        try:
            return GPT(GPTConfig(vocab_size, seq_len, n_layer, n_embd, n_head))
        except (RuntimeError, MemoryError) as exc:  # torch's allocator says so in a RuntimeError
            if "alloc" not in str(exc).lower():
                raise
            raise UserError(
                f"model {spec!r} with --seq-len {seq_len} does not fit in this machine's memory: "
                "lower --seq-len"
            ) from None
    if spec.startswith(HF_PREFIX):
        from p2p_cocodc.hf import build_hf_model  # torch only; transformers is imported when building

        return build_hf_model(spec, vocab_size, seq_len)
    if ":" not in spec:
        raise UserError(
            f"unknown model {spec!r}: use a preset ({', '.join(PRESETS)}), hf:PATH or module:factory"
        )
    module_name, _, factory_name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), factory_name)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"cannot load model factory {spec!r}: {exc}") from exc
    try:
        model = factory(vocab_size, seq_len)
    except Exception as exc:  # noqa: BLE001 - a plug-in may fail in any way; say which and how
        raise UserError(
            f"model factory {spec!r} failed when called as factory(vocab_size={vocab_size}, "
            f"seq_len={seq_len}): {type(exc).__name__}: {exc}"
        ) from None
    check_fragment_units(model, spec)
    return model


def check_fragment_units(model: nn.Module, spec: str) -> None:
    """Every trainable parameter must sit in exactly one unit, or fragments would miss or repeat it."""
    if not isinstance(model, nn.Module) or not isinstance(model, FragmentedModel):
        raise UserError(f"model {spec!r} must be a torch.nn.Module with a fragment_units() method")
    declared = [name for unit in model.fragment_units() for name in unit]
    params = [name for name, p in model.named_parameters() if p.requires_grad]
    if not declared or any(not unit for unit in model.fragment_units()):
        raise UserError(f"model {spec!r}: fragment_units() must return non-empty units")
    if sorted(declared) != sorted(params):
        missing = sorted(set(params) - set(declared))
        extra = sorted(set(declared) - set(params))
        repeated = sorted({n for n in declared if declared.count(n) > 1})
        raise UserError(
            f"model {spec!r}: fragment_units() must list each trainable parameter exactly once "
            f"(missing {missing[:5]}, unknown {extra[:5]}, repeated {repeated[:5]})"
        )


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
