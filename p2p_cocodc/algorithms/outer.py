"""The outer optimizer of one fragment: SGD with Nesterov momentum over the averaged outer gradient.

State (θ̄ and the momentum buffer) is fp32 on the CPU whatever and wherever the model trains. Every
peer runs the same float ops on the same averaged Δ, so every peer holds a bit-identical θ̄ after each sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from p2p_cocodc.algorithms.state import expect_tensor


@dataclass(frozen=True)
class OuterSettings:
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    gap_penalty: float = 1.0  # CO2's staleness gap penalty Λ: the outer gradient is divided by it
    momentum_clip: float | None = None  # CO2's outer-momentum clipping φ: buffer clamped to ±φ


@dataclass(frozen=True)
class OuterStep:
    """θ̄ and the momentum buffer after one outer step (``OuterOptimizer.peek``)."""

    global_params: torch.Tensor
    momentum: torch.Tensor


class OuterOptimizer:
    """θ̄ ← θ̄ − η(Δ + μb) with b ← μb + Δ (torch SGD nesterov semantics); Δ = θ̄ − mean θ.

    Double-buffered: ``peek`` writes the next θ̄ and b into a spare pair of buffers, ``take`` makes
    them the state and the old pair the spare, so a sync allocates and frees no fragment-sized
    memory (on a big model, page faults and unmaps that hold the interpreter's lock while the
    training thread wants it). The price: a ``peek``'s tensors hold only until the next ``peek``, and
    θ̄ and b as they were before a ``take`` only until the ``peek`` after it; whoever keeps them
    longer (a checkpoint, a joiner's state) copies them."""

    def __init__(self, initial: torch.Tensor, settings: OuterSettings) -> None:
        self.settings = settings
        self.global_params = initial.detach().to("cpu", torch.float32, copy=True)
        self.momentum = torch.zeros_like(self.global_params)
        self.spare: OuterStep | None = None  # what the next peek writes into (allocated at the first)
        self.changes = 0  # peeks, takes and loads so far: a peek is current while this stays as it left it
        self.scratch: torch.Tensor | None = None  # Nesterov's update, computed before it is applied

    def step(self, delta: torch.Tensor) -> torch.Tensor:
        """Apply one averaged outer gradient; returns θ̄ (the new global fragment)."""
        self.take(self.peek(delta))
        return self.global_params

    def peek(self, delta: torch.Tensor) -> OuterStep:
        """The θ̄ and momentum buffer one outer step with ``delta`` leads to, as new tensors; this
        optimizer is unchanged (a driver may compute them early, off its training thread, and
        ``take`` them when the result is due). The same float ops as in-place: the same bits."""
        s = self.settings
        self.changes += 1
        if self.spare is None:
            self.spare = OuterStep(torch.empty_like(self.global_params), torch.empty_like(self.momentum))
        spare = self.spare
        grad = delta.float() / s.gap_penalty if s.gap_penalty != 1.0 else delta.float()
        momentum = torch.mul(self.momentum, s.momentum, out=spare.momentum).add_(grad)
        if s.momentum_clip is not None:
            momentum.clamp_(-s.momentum_clip, s.momentum_clip)
        update = momentum
        if s.nesterov:
            if self.scratch is None:
                self.scratch = torch.empty_like(self.global_params)
            update = torch.add(grad, momentum, alpha=s.momentum, out=self.scratch)
        return OuterStep(torch.sub(self.global_params, update, alpha=s.lr, out=spare.global_params), momentum)

    def take(self, step: OuterStep) -> None:
        """Make a ``peek`` of this optimizer's current state the state (its buffers become the spare)."""
        old = OuterStep(self.global_params, self.momentum)
        self.global_params, self.momentum = step.global_params, step.momentum
        self.spare = old
        self.changes += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        """θ̄ and the momentum buffer: the live fp32 tensors, not copies (a writer copies them)."""
        return {"global_params": self.global_params, "momentum": self.momentum}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy in θ̄ and the momentum buffer of a ``state_dict()``; shapes must match this fragment."""
        for name, target in self.state_dict().items():
            target.copy_(expect_tensor(state[name], target, name))
        self.changes += 1
