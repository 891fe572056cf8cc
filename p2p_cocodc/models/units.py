"""What the trainer needs from any model: ``model(idx) -> logits`` and ``fragment_units()``, the
parameter names grouped into units in order (embedding, each block, final norm / head). Units are
what fragments are made of, so a plug-in model only has to declare them.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from p2p_cocodc.errors import UserError


@runtime_checkable
class FragmentedModel(Protocol):
    """What the trainer needs from any model: logits from token ids, and its fragment units."""

    def __call__(self, idx: torch.Tensor) -> torch.Tensor: ...

    def fragment_units(self) -> list[list[str]]: ...


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
