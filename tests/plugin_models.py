"""Plug-in models for the ``--model module:factory`` tests: one valid, two broken."""

from __future__ import annotations

import torch
from torch import nn


class TwoLayerLM(nn.Module):
    """An MLP language model that looks at one token: the smallest model with two units."""

    def __init__(self, vocab_size: int, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 32)
        self.head = nn.Linear(32, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(idx)))

    def fragment_units(self) -> list[list[str]]:
        return [["embed.weight"], ["head.weight", "head.bias"]]


class MissingUnitLM(TwoLayerLM):
    def fragment_units(self) -> list[list[str]]:
        return [["embed.weight"], ["head.weight"]]


def two_layer(vocab_size: int, seq_len: int) -> nn.Module:
    return TwoLayerLM(vocab_size, seq_len)


def missing_unit(vocab_size: int, seq_len: int) -> nn.Module:
    return MissingUnitLM(vocab_size, seq_len)


def no_units(vocab_size: int, seq_len: int) -> nn.Module:
    return nn.Linear(4, 4)
