"""Saving the trained model: θ̄ as a safetensors file any PyTorch user can load."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from p2p_cocodc.errors import UserError


def save_global(state: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    """Write θ̄ (tied tensors stored once per name, as safetensors requires separate memory)."""
    tensors = {name: t.detach().to(torch.float32).contiguous().clone() for name, t in state.items()}
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, path, metadata=metadata)
    except OSError as exc:
        raise UserError(f"--save {path}: cannot write it ({exc.strerror})") from None
