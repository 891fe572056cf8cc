"""Fragments: groups of model units that are synchronised together, each seen as one flat vector."""

from __future__ import annotations

import torch
from torch import nn

from p2p_cocodc.errors import UserError

PATTERNS = ("strided", "sequential")


def assign_units(num_units: int, num_fragments: int, pattern: str) -> list[list[int]]:
    """Unit indices of each fragment. Strided: unit i -> fragment i mod K; sequential: contiguous."""
    if pattern not in PATTERNS:
        raise UserError(f"unknown fragment pattern {pattern!r}: use one of {', '.join(PATTERNS)}")
    if not 1 <= num_fragments <= num_units:
        raise UserError(
            f"--fragments {num_fragments} must be between 1 and the model's {num_units} units "
            "(embedding, each block, final norm)"
        )
    if pattern == "strided":
        return [list(range(k, num_units, num_fragments)) for k in range(num_fragments)]
    bounds = [round(k * num_units / num_fragments) for k in range(num_fragments + 1)]
    return [list(range(bounds[k], bounds[k + 1])) for k in range(num_fragments)]


class Fragment:
    """The live parameters of one fragment, read and written as one flat fp32 vector."""

    def __init__(self, index: int, names: list[str], params: list[nn.Parameter]) -> None:
        self.index = index
        self.names = names
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.numel = sum(self.sizes)

    def read(self) -> torch.Tensor:
        """A new fp32 vector holding the fragment's current values."""
        return torch.cat([p.detach().reshape(-1).float() for p in self.params])

    def write(self, flat: torch.Tensor) -> None:
        """Copy a fragment-shaped vector into the live parameters (one list copy for them all)."""
        with torch.no_grad():
            chunks = [chunk.view_as(p) for p, chunk in zip(self.params, flat.split(self.sizes), strict=True)]
            torch._foreach_copy_(self.params, chunks)

    def per_tensor(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Views of a fragment-shaped vector, one per parameter tensor."""
        return flat.split(self.sizes)


def make_fragments(model: nn.Module, num_fragments: int, pattern: str) -> list[Fragment]:
    """Split the model's fragment units into fragments; parameter order is unit order everywhere."""
    units: list[list[str]] = model.fragment_units()
    by_name = dict(model.named_parameters())
    fragments = []
    for k, unit_ids in enumerate(assign_units(len(units), num_fragments, pattern)):
        names = [name for u in unit_ids for name in units[u]]
        fragments.append(Fragment(k, names, [by_name[n] for n in names]))
    return fragments
