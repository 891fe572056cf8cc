"""The inner optimizer every replica runs between syncs: AdamW, warmup + cosine LR, grad clipping."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from p2p_cocodc.algorithms.devices import Placement
from p2p_cocodc.algorithms.state import expect_tensor


@dataclass(frozen=True)
class InnerSettings:
    lr: float = 1e-3
    warmup: int = 50
    total_steps: int = 1000
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0

    def lr_at(self, step: int) -> float:
        """LR of inner step ``step`` (1-based): linear warmup, then cosine down to min_lr_ratio·lr."""
        if step <= self.warmup:
            return self.lr * step / max(self.warmup, 1)
        progress = min((step - self.warmup) / max(self.total_steps - self.warmup, 1), 1.0)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)

    def decay_between(self, start: int, end: int) -> float:
        """Π (1 − lr·wd) over steps start+1..end: how much decoupled weight decay shrank the params."""
        factor = 1.0
        for step in range(start + 1, end + 1):
            factor *= 1.0 - self.lr_at(step) * self.weight_decay
        return factor


class InnerTrainer:
    """One replica's model and AdamW on ``placement``'s device; forward/backward in its precision
    (parameters and AdamW stay fp32). ``backward`` and ``update`` are split so DDP can average
    grads. ``forward`` is the module the inner steps call: the model, or a wrapper of it (a region
    of several processes wraps it in torch's DistributedDataParallel), compiled with ``torch.compile``
    when asked (``--compile``: every replica of a run on the same hardware compiles the same graph to
    the same kernels, so its peers stay bit-identical to each other).

    A step returns its loss as a 0-dim tensor on the device, not read: reading it (``float``) makes
    the host wait for the device to finish the step, so a driver reads it where it needs the value
    and lets the device run ahead meanwhile. On CUDA, AdamW is torch's fused kernel; elsewhere its
    default (per-tensor loops over lists), whose float ops the golden traces pin."""

    def __init__(
        self,
        model: nn.Module,
        settings: InnerSettings,
        placement: Placement | None = None,
        compile_backend: str = "off",
    ) -> None:
        self.model = model
        self.settings = settings
        self.placement = placement or Placement()
        self.compile_backend = compile_backend
        self.set_forward(model)
        self.reset()

    def set_forward(self, module: nn.Module) -> None:
        """The module the inner steps call (the model, or a wrapper of it), through
        ``torch.compile`` with the trainer's backend unless that is "off"."""
        backend = self.compile_backend
        self.forward = module if backend == "off" else torch.compile(module, backend=backend)  # type: ignore[assignment]

    def reset(self) -> None:
        """A fresh AdamW (no moments): the inner optimizer of a replica that starts anew."""
        s = self.settings
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=s.lr,
            betas=(s.beta1, s.beta2),
            weight_decay=s.weight_decay,
            fused=True if self.placement.device.type == "cuda" else None,
        )

    def backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        x, y = self.placement.batch(x, y)
        with self.placement.autocast():
            logits = self.forward(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        return loss.detach()

    def update(self, step: int) -> None:
        if self.settings.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = self.settings.lr_at(step)
        self.optimizer.step()

    def step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        loss = self.backward(x, y)
        self.update(step)
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The replica's parameters and buffers, and AdamW's state (moments and step count per
        parameter, in ``model.parameters()`` order, keyed "0", "1", …; its hyperparameters). The
        LR schedule keeps no state: ``lr_at`` is a function of the inner step, which the driver
        holds. Tensors are the live ones, not copies."""
        adamw = self.optimizer.state_dict()
        return {
            "model": dict(self.model.state_dict()),
            "adamw": {
                "state": {str(i): dict(s) for i, s in adamw["state"].items()},
                "param_groups": adamw_groups(self.optimizer),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take over a ``state_dict()`` of a trainer of the same model: strict, shapes checked."""
        self.model.load_state_dict(state["model"])
        moments = checked_adamw_state(state["adamw"]["state"], [p.detach() for p in self.model.parameters()])
        # how the update runs (fused, foreach) is this device's choice, not the saved run's
        ours = self.optimizer.param_groups[0]
        how = {k: ours[k] for k in ("fused", "foreach", "capturable") if k in ours}
        groups = [{**g, "betas": tuple(g["betas"]), **how} for g in state["adamw"]["param_groups"]]
        self.optimizer.load_state_dict({"state": moments, "param_groups": groups})


@torch.no_grad()
def evaluate(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], placement: Placement | None = None
) -> float:
    """Mean cross-entropy over fixed validation batches, on ``placement``'s device and precision."""
    placement = placement or Placement()
    model.eval()
    total = 0.0
    for x, y in batches:
        x, y = placement.batch(x, y)
        with placement.autocast():
            logits = model(x)
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)))
    return total / len(batches)


def adamw_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """AdamW's hyperparameters per group, as a trainer state holds them (betas as a list)."""
    return [{**g, "betas": list(g["betas"])} for g in optimizer.state_dict()["param_groups"]]


def checked_adamw_state(state: dict[str, Any], params: list[torch.Tensor]) -> dict[int, Any]:
    """A trainer state's AdamW moments, keyed by parameter index, each checked against its
    parameter's shape and dtype (ValueError naming the first that does not fit)."""
    moments = {}
    for key, saved in state.items():
        i = int(key)
        if not 0 <= i < len(params):
            raise ValueError(f"AdamW state for parameter {i}, but the model has {len(params)}")
        for name in ("exp_avg", "exp_avg_sq"):
            expect_tensor(saved[name], params[i], f"AdamW {name} of parameter {i}")
        moments[i] = saved
    return moments
