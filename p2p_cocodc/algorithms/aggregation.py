"""Checked contributions and robust aggregation: what the owner of a butterfly slice makes of its
members' decoded slices.

Notation: x_1 … x_M ∈ R^n, the members' decoded values of one slice in member order (fp32, CPU).
med(a_1 … a_M) is the middle of the sorted values s_1 ≤ … ≤ s_M: s_{(M+1)/2} for odd M,
½·s_{M/2} + ½·s_{M/2+1} for even M. The coordinate-wise median is med taken per coordinate.

**Screening** (every rule, unless ``screening`` is off; only with M ≥ 3, below that no member can be
told apart from the rest):

    r_i = ‖x_i‖₂,  r̃ = med(r_1 … r_M),  m = coordinate-wise median of x_1 … x_M,
    ρ_i = r_i / r̃   (0 when r_i = 0, ∞ when r̃ = 0 < r_i),
    c_i = ⟨x_i, m⟩ / (r_i·‖m‖)   (1 when r_i·‖m‖ = 0),
    c̄_i = (c_i^(1) + … + c_i^(n)) / n,
    b_i = max(ρ_i / N, (1 − c̄_i) / (1 − C)),   N = outlier_norm ≥ 1, −1 ≤ C = outlier_cosine < 1,

where c_i^(1) … c_i^(n) are member i's last n = min(W, seen) cosines at this slice owner, this slice's
c_i the last of them (W = outlier_window ≥ 1; the owner keeps them in a ``CosineRecord``): a member
new to the owner is judged by c_i alone, and W = 1 judges every slice alone. The norm test judges
each slice alone (an honest norm stays within 2× of the median's); the cosine test judges a member's
recent direction, because one honest slice can point against the group's (down to −0.70 in clean
runs, late in a run) while a sign-flipped member points against it round after round.

Member i is an outlier when b_i > 1, i.e. r_i > N·r̃ or c̄_i < C. Outliers are excluded worst first
(decreasing b_i, ties: lower member index first), at most ⌊(M − 1)/2⌋ of them, so the kept members
are always a strict majority.

**Rules** over the kept members y_1 … y_K (member order):

- ``mean``: ((y_1 + y_2) + … + y_K) / K in fp32 (``codecs.mean_in_order``). With nobody excluded
  this is the butterfly mean bit for bit.
- ``trimmed-mean``: per coordinate, with sorted values s_1 ≤ … ≤ s_K and
  k = min(max(1, ⌊β·K⌋), ⌊(K − 1)/2⌋) (β = trim), (s_{k+1} + … + s_{K−k}) / (K − 2k), summed in
  ascending order.
- ``centered-clip`` (Karimireddy, He & Jaggi 2021): v_0 = coordinate-wise median of the y_i,
  τ = med_i ‖y_i − v_0‖ (fixed for the run of iterations), then L = clip_iterations times
  v ← v + (1/K)·Σ_i d_i·min(1, τ/‖d_i‖) with d_i = y_i − v (factor 1 when ‖d_i‖ = 0), summed in
  member order.

With K < 3 every rule is the mean.

**Determinism.** One owner computes a slice's aggregate and every peer applies its bits, so the
result is a function of the input bits alone, whatever torch's thread count: norms and inner
products are sums over fixed chunks of ``CHUNK`` values (fp32), then sums of those chunk sums
(fp64), never one reduction that torch would split across its threads; the coordinate-wise order
is an odd-even transposition network of elementwise min/max on values whose −0 was made +0 first;
everything else is elementwise fp32, in a fixed order. Before squaring, each vector is scaled by an
exact power of two that brings its largest |value| into [½, 1), so no finite input overflows the
statistics (kept values so large that the rule's own arithmetic overflows fail the round, as the
mean's would).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from p2p_cocodc.algorithms.codecs import mean_in_order

CHUNK = 4096  # values summed together before their sums are summed: a fixed order on any thread count


@dataclass(frozen=True)
class Aggregation:
    """How a slice owner combines its members' slices; the thresholds are those of the screening."""

    rule: str = "mean"  # one of names.AGGREGATES
    outlier_norm: float = 4.0  # N: a member with ‖x_i‖ > N·(median norm) is an outlier
    outlier_cosine: float = 0.0  # C: a member whose recent mean cosine c̄_i to the median is below C is one
    outlier_window: int = 16  # W: c̄_i averages the member's last W cosines at this owner
    trim: float = 0.25  # β of the trimmed mean: about β·K values cut at each end, at least 1
    clip_iterations: int = 3  # L of centered clipping
    screening: bool = True  # False: nobody is left out (ddp: one step's gradients are too noisy to judge)


MEAN = Aggregation()


class Screening(NamedTuple):
    """Who a slice owner left out of one slice (positions, ascending), and each member's c_i there."""

    excluded: tuple[int, ...]
    cosines: tuple[float, ...]


def aggregate(
    values: Sequence[torch.Tensor],
    aggregation: Aggregation = MEAN,
    earlier: Sequence[Sequence[float]] = (),
    weights: Sequence[float] = (),
) -> tuple[torch.Tensor, Screening]:
    """The slice's aggregate and its screening; ``earlier[i]``: member i's earlier cosines at this
    owner, oldest first (none given: members new to it). ``weights[i]``: the share of the window's
    steps member i trained (``inner_share.py``; none given, or all equal: every member alike). The
    kept members' values are scaled by w_i·n / Σ w (n kept) before the rule, so the mean is the
    weighted mean Σ w_i x_i / Σ w_i; screening judges the values as sent."""
    screening = screen(values, aggregation, earlier)
    index = [i for i in range(len(values)) if i not in screening.excluded]
    kept = [values[i] for i in index]
    if weights and len({weights[i] for i in index}) > 1:
        total = math.fsum(weights[i] for i in index)
        kept = [value * (weights[i] * len(index) / total) for value, i in zip(kept, index, strict=True)]
    return combine(kept, aggregation), screening


def screen(
    values: Sequence[torch.Tensor], aggregation: Aggregation = MEAN, earlier: Sequence[Sequence[float]] = ()
) -> Screening:
    """The outliers to leave out, ascending: b_i > 1, worst first, at most ⌊(M − 1)/2⌋; and every
    member's c_i (empty when nothing is screened: fewer than 3 members, or screening off)."""
    members = len(values)
    if members < 3 or not aggregation.screening:
        return Screening((), ())
    ratios, cosines = similarity(values)
    recent = [
        mean_cosine([*(earlier[i] if i < len(earlier) else ()), c], aggregation.outlier_window)
        for i, c in enumerate(cosines)
    ]
    badness = [
        max(rho / aggregation.outlier_norm, (1.0 - c) / (1.0 - aggregation.outlier_cosine))
        for rho, c in zip(ratios, recent, strict=True)
    ]
    worst_first = sorted((i for i in range(members) if badness[i] > 1.0), key=lambda i: (-badness[i], i))
    return Screening(tuple(sorted(worst_first[: (members - 1) // 2])), tuple(cosines))


def mean_cosine(cosines: Sequence[float], window: int) -> float:
    """c̄: the mean of the last ``window`` of a member's ``cosines`` (oldest first, at least one)."""
    latest = cosines[-window:]
    return math.fsum(latest) / len(latest)


class CosineRecord:
    """One slice owner's memory for the cosine test: each member's last ``window`` − 1 cosines (the
    test adds the slice's own), for at most ``members`` members, the least recently judged forgotten
    first. Members are any hashable ids (peer ids in a swarm, data shards in the simulator)."""

    def __init__(self, window: int, members: int = 4096) -> None:
        self.window = window
        self.members = members
        self.cosines: OrderedDict[Hashable, tuple[float, ...]] = OrderedDict()

    def earlier(self, members: Sequence[Hashable]) -> tuple[tuple[float, ...], ...]:
        return tuple(self.cosines.get(member, ()) for member in members)

    def add(self, members: Sequence[Hashable], cosines: Sequence[float]) -> None:
        """Each member's cosine in one more slice of this owner."""
        keep = self.window - 1
        for member, c in zip(members, cosines, strict=False):  # no cosines: nothing was screened
            self.cosines[member] = (*self.cosines.pop(member, ()), c)[-keep:] if keep else ()
        while len(self.cosines) > self.members:
            self.cosines.popitem(last=False)

    def state_dict(self) -> dict[str, Any]:
        return {"members": memory_entries(self.cosines)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take over a ``state_dict()``; ValueError if it is not one."""
        cosines: OrderedDict[Hashable, tuple[float, ...]] = OrderedDict()
        for entry in state["members"]:
            member, values = entry
            if not isinstance(member, (int, str)) or not all(isinstance(c, float) for c in values):
                raise ValueError(f"a cosine record holds {entry!r}")
            cosines[member] = tuple(values)[-(self.window - 1) :] if self.window > 1 else ()
        self.cosines = cosines


def memory_entries(cosines: Mapping[Hashable, Sequence[float]]) -> list[list[Any]]:
    """Members' earlier cosines (a ``CosineRecord``'s, or a copy of them) as its state lists them."""
    return [[member, list(c)] for member, c in cosines.items()]


def similarity(values: Sequence[torch.Tensor]) -> tuple[list[float], list[float]]:
    """Each member's ρ_i (norm over the median norm) and c_i (cosine to the coordinate-wise median)."""
    x, exponents = _normalized(torch.stack(values))
    scaled_norms = _row_sums(x * x).sqrt_().tolist()
    m = _normalized(_middle(_sorted_rows(values))[None])[0]
    length = math.sqrt(float(_row_sums(m * m)[0]))
    dots = _row_sums(x.mul_(m)).tolist()
    norms = [math.ldexp(r, e) for r, e in zip(scaled_norms, exponents, strict=True)]
    median_norm = _median(norms)
    ratios = [0.0 if r == 0 else (r / median_norm if median_norm > 0 else math.inf) for r in norms]
    cosines = [
        dot / (r * length) if r * length > 0 else 1.0 for dot, r in zip(dots, scaled_norms, strict=True)
    ]
    return ratios, cosines


def combine(values: Sequence[torch.Tensor], aggregation: Aggregation = MEAN) -> torch.Tensor:
    """The rule's aggregate of ``values`` (no screening); the mean for fewer than 3 values."""
    if aggregation.rule == "mean" or len(values) < 3:
        return mean_in_order(values)
    if aggregation.rule == "trimmed-mean":
        k = min(max(1, int(aggregation.trim * len(values))), (len(values) - 1) // 2)
        return mean_in_order(_sorted_rows(values)[k : len(values) - k])
    if aggregation.rule == "centered-clip":
        return _centered_clip(values, aggregation.clip_iterations)
    raise ValueError(f"unknown aggregation rule {aggregation.rule!r}")


def _centered_clip(values: Sequence[torch.Tensor], iterations: int) -> torch.Tensor:
    v = _middle(_sorted_rows(values))
    tau = _median([_norm(value - v) for value in values])
    for _ in range(iterations):
        step = torch.zeros_like(v)
        for value in values:
            d = value - v
            distance = _norm(d)
            step.add_(d if distance <= tau else d.mul_(tau / distance))
        v = v + step.div_(len(values))
    return v


def _sorted_rows(values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Row j holds every coordinate's j-th smallest value (odd-even transposition network)."""
    rows = [value + 0.0 for value in values]  # −0 → +0: min and max never choose between two zeros
    for r in range(len(rows)):
        for i in range(r % 2, len(rows) - 1, 2):
            rows[i], rows[i + 1] = torch.minimum(rows[i], rows[i + 1]), torch.maximum(rows[i], rows[i + 1])
    return rows


def _middle(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """The coordinate-wise median from sorted rows."""
    half = len(rows) // 2
    return rows[half].clone() if len(rows) % 2 else rows[half - 1] * 0.5 + rows[half] * 0.5


def _median(numbers: Sequence[float]) -> float:
    s = sorted(numbers)
    half = len(s) // 2
    return s[half] if len(s) % 2 else 0.5 * s[half - 1] + 0.5 * s[half]


def _norm(x: torch.Tensor) -> float:
    scaled, (exponent,) = _normalized(x[None])
    return math.ldexp(math.sqrt(float(_row_sums(scaled * scaled)[0])), exponent)


def _normalized(x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The rows of a 2-D fp32 tensor, row i times 2^−e_i with max|row i| = f·2^e_i, f in [½, 1) (e_i
    kept in [−126, 126]), and the e_i: exact scalings that keep squares and products of any finite
    fp32 values far from overflow, and a row's small values as far from underflow as its largest."""
    if x.shape[1] == 0:
        return x.clone(), [0] * x.shape[0]
    amax = torch.maximum(x.amax(1), -x.amin(1)).tolist()
    exponents = [min(max(math.frexp(a)[1], -126), 126) for a in amax]
    scales = torch.tensor([math.ldexp(1.0, -e) for e in exponents], dtype=torch.float32)
    return x * scales[:, None], exponents


def _row_sums(x: torch.Tensor) -> torch.Tensor:
    """Each row's sum of a 2-D tensor in a fixed order: sums of CHUNK values (fp32), then of those
    (fp64), never one long reduction that torch would split across its threads."""
    x = _chunk_sums(x).double()
    while x.shape[1] > CHUNK:
        x = _chunk_sums(x)
    return x.sum(1)


def _chunk_sums(x: torch.Tensor) -> torch.Tensor:
    whole = x.shape[1] - x.shape[1] % CHUNK
    heads = x[:, :whole].reshape(x.shape[0], -1, CHUNK).sum(2)
    return torch.cat([heads, x[:, whole:].sum(1, keepdim=True)], dim=1)
