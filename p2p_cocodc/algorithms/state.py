"""Checks for ``load_state_dict`` of the core's objects: a state from elsewhere must fit exactly.

The core's ``state_dict()`` methods return nested dicts and lists of tensors and plain values
(int, float, bool, str, None); the drivers decide how to store them. Loading checks every tensor
against the one it replaces, so a state of another model or fragment split fails with a message
instead of training on garbage.
"""

from __future__ import annotations

from typing import Any

import torch


def expect_tensor(value: Any, like: torch.Tensor, what: str) -> torch.Tensor:
    """``value`` if it is a tensor of ``like``'s shape and dtype, else ValueError naming ``what``."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{what} is {type(value).__name__}, not a tensor")
    if value.shape != like.shape or value.dtype != like.dtype:
        raise ValueError(
            f"{what} is {value.dtype} {list(value.shape)}, expected {like.dtype} {list(like.shape)}"
        )
    return value


def expect_list(value: Any, length: int, kind: type, what: str) -> list[Any]:
    """``value`` if it is a list of ``length`` items of ``kind``, else ValueError naming ``what``."""
    if not isinstance(value, list) or len(value) != length:
        raise ValueError(f"{what} must be a list of {length} values, got {value!r}")
    for item in value:
        # bool is an int to Python; a list of flags must not pass for step numbers, nor the reverse
        if not isinstance(item, kind) or (kind is not bool and isinstance(item, bool)):
            raise ValueError(f"{what} must hold {kind.__name__} values, got {item!r}")
    return list(value)
