"""CoCoDC's Taylor delay compensation: fold a stale averaged fragment into a replica that moved on.

When fragment p's sync arrives τ steps after it was sent, the replica has made local progress
g = snap − θ(now) around the old point snap, but the new global point is z. A first-order Taylor
expansion with DC-ASGD's diagonal Hessian (≈ g⊙g) estimates the progress the replica would have
made from z: g + λ·g⊙g⊙(z − snap). The replica continues from z minus that compensated progress.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

EPS = 1e-8


def compensate_per_tensor(
    z: Sequence[torch.Tensor],
    snap: Sequence[torch.Tensor],
    now: Sequence[torch.Tensor],
    lam0: float,
) -> list[torch.Tensor]:
    """The CoCoDC authors' rule, per tensor: λ = λ0‖g‖/(‖c‖+ε), θ ← z − (g + λc), c = g⊙g⊙(z − snap).

    The correction λc therefore has norm λ0‖g‖ (up to ε) and the direction of c. Computed with
    torch's list ops (``_foreach_*``): on a GPU a handful of kernels for all the tensors, not a
    dozen per tensor; on the CPU the same float ops, tensor by tensor, as the plain loop.
    """
    g = torch._foreach_sub(list(snap), list(now))
    c = torch._foreach_mul(torch._foreach_mul(g, g), torch._foreach_sub(list(z), list(snap)))
    lam = torch.stack(torch._foreach_norm(g)).mul_(lam0).div_(torch.stack(torch._foreach_norm(c)).add_(EPS))
    correction = torch._foreach_add(g, torch._foreach_mul(c, list(lam.unbind())))
    return torch._foreach_sub(list(z), correction)


def compensate_per_step(
    z: Sequence[torch.Tensor],
    snap: Sequence[torch.Tensor],
    now: Sequence[torch.Tensor],
    lam0: float,
    steps: int,
    lam_max: float = 10.0,
    decay: float | None = None,
) -> list[torch.Tensor]:
    """The authors' later rule: work with the mean per-step update u = g/τ and cap λ.

    λ = min(λ0‖u‖/(‖c‖+ε), λ_max) over the whole fragment, c = u⊙u⊙(z − snap), θ ← z − τ(u + λc).
    ``decay`` = Π(1 − lr·wd) over the overlap: decoupled weight decay shrank the replica, not z, so
    the decay part snap·(1 − ρ) is taken out of u and applied to z instead (z ← ρz).
    """
    tau = max(steps, 1)
    rho = 1.0 if decay is None else decay
    zs = [z_i * rho for z_i in z]
    us = [(s - n - s * (1.0 - rho)) / tau for s, n in zip(snap, now, strict=True)]
    cs = [u * u * (z_i - s) for u, z_i, s in zip(us, zs, snap, strict=True)]
    u_norm = torch.sqrt(sum((u * u).sum() for u in us))
    c_norm = torch.sqrt(sum((c * c).sum() for c in cs))
    lam = torch.clamp(lam0 * u_norm / (c_norm + EPS), max=lam_max)
    return [z_i - tau * (u + lam * c) for z_i, u, c in zip(zs, us, cs, strict=True)]
