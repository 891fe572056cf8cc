"""Any model the options name, built: a GPT preset, a Hugging Face causal LM (``hf:PATH``) or a
plug-in ``module:factory``.

What the trainer needs of a model is in ``models/units.py``.
"""

from __future__ import annotations

import importlib

from torch import nn

from p2p_cocodc.errors import UserError
from p2p_cocodc.models.gpt import GPT, PRESETS, GPTConfig
from p2p_cocodc.models.units import check_fragment_units
from p2p_cocodc.names import HF_PREFIX


def build_model(spec: str, vocab_size: int, seq_len: int) -> nn.Module:
    """A preset name (``tiny``), a Hugging Face causal LM ``hf:PATH_OR_NAME`` (p2p_cocodc.models.hf), or a
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
        from p2p_cocodc.models.hf import build_hf_model  # torch only; transformers is imported when building

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


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
