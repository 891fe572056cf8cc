"""Uneven regions: a region slower than the others trains a share of the swarm's inner steps.

The swarm is step-locked: round ``f{p}:{s}`` averages fragment p as every member holds it after inner
step s, so a region that takes twice as long per step makes every other region wait half the run
for its sends. Instead, a region of share k/H (``--inner-share``) trains k of every H steps and only
counts the others: at step s it trains iff

    ⌊s·k/H⌋ > ⌊(s−1)·k/H⌋

which picks exactly k of the H steps of every window (m·H, (m+1)·H], spread evenly (k = H: every
step). On a step it does not train it reads no batch and makes no update; its sends, merges and
evaluations happen at the same steps as everyone else's.

Its Δ_p then covers fewer tokens, and the round weighs it so: a send after step s tells the slice
owners (trained_i, window_i), the steps it trained among the last window_i = min(H, s)
(``recent_steps``; (0, 0) for a region that trains every step; under auto, each step at the k it was
trained at: ``RegionShare.recent``), and each owner's mean is

    Σ_i w_i Δ_i / Σ_i w_i,   w_i = trained_i / window_i

(``aggregation.aggregate``; with equal weights it is the plain mean, bit for bit; a robust rule
runs on the values scaled by w_i·n / Σ w). On the simulator (nano, 3 workers, one at share 1/2),
this weighting ended 1-2 % below the plain mean of the same Δ_i, and about 2 % below Σ Δ_i / Σ w_i.

This is Dynamic Local Updates (DyLU) of Liu et al. 2024, *Asynchronous Local-SGD Training for
Language Modeling* (arXiv 2401.09135): each worker runs local steps in proportion to its speed,
H_i = H·v_i / v_max, so all finish a round together. ``auto`` takes v_i / v_max from the step times
the peers publish: share = t_fastest / (1.1 · t_own), rounded to k = round(share·H) ≥ 1. The 10 %
spare lets the region catch up with steps it lost (its first ones, trained before the board showed
the others' speed, or a hiccup) instead of trailing the others by as much for the rest of the run.
A region within ``FULL_WITHIN`` of the fastest trains every step, so equal hardware whose measured
times differ by noise is left alone. A peer chooses its share again before every step, so it
follows a region that slows down or speeds up mid-run. t_own is the median of its last H step
times, so one slow step (a sync's merge at a boundary, a busy machine) does not move it: an average
that one such step raised past 10 % made equal regions skip steps (2-5 of 768 between the equal
peers of ``benchmarks/uneven_regions.py``, both fast peers at once after a boundary).

Nothing here is agreed by the swarm: a region's share changes only which steps it trains and the
weight its PARTs carry, never which rounds it takes part in, so peers with different shares train
one run, and the simulator (``--inner-share`` per worker) reproduces the swarm bit for bit.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable

from p2p_cocodc.errors import UserError

FULL_WITHIN = 0.9  # auto: a region at least 0.9 × as fast as the fastest trains every step
CATCH_UP = 1.1  # auto: a slower region trains 1/1.1 of what its speed allows, so it catches up


def share_steps(share: float, inner_steps: int) -> int:
    """k: the steps of every H a region of ``share`` trains (at least 1, at most H)."""
    if not 0.0 < share <= 1.0 or not math.isfinite(share):
        raise UserError(f"--inner-share {share}: use a number in (0, 1], or auto")
    return max(1, min(inner_steps, round(share * inner_steps)))


def trains(step: int, share_steps: int, inner_steps: int) -> bool:
    """Whether a region training ``share_steps`` of every ``inner_steps`` steps trains step ``step``
    (steps count from 1)."""
    return step * share_steps // inner_steps > (step - 1) * share_steps // inner_steps


def auto_share(own_step_s: float, fastest_step_s: float) -> float:
    """The share of a region whose steps take ``own_step_s`` where the fastest live region's take
    ``fastest_step_s`` (0 or less: not measured yet, so every step)."""
    if own_step_s <= 0 or fastest_step_s <= 0:
        return 1.0
    ratio = fastest_step_s / own_step_s
    return 1.0 if ratio >= FULL_WITHIN else ratio / CATCH_UP


def parse_shares(text: str, workers: int) -> list[float] | None:
    """``--inner-share`` as given: None for auto, else one share per worker (one value: everyone's).
    UserError, naming the option, on anything else."""
    if text.strip() == "auto":
        return None
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise UserError(f"--inner-share {text!r}: use a number in (0, 1], a comma list, or auto") from None
    if len(values) not in (1, workers):
        raise UserError(f"--inner-share {text!r}: give one share, or one per worker ({workers})")
    for value in values:
        if not 0.0 < value <= 1.0 or not math.isfinite(value):
            raise UserError(f"--inner-share {text!r}: every share must be in (0, 1]")
    return values * workers if len(values) == 1 else values


def recent_steps(step: int, share_steps: int, inner_steps: int) -> tuple[int, int]:
    """(trained, window): the steps a region of ``share_steps`` per ``inner_steps`` trained among the
    last ``window`` = min(H, step) steps up to ``step``; (0, 0) for a region that trains every step.
    What its Δ_p of a send after ``step`` covers, as its PART tells the slice owners."""
    if share_steps == inner_steps:
        return 0, 0
    start = max(0, step - inner_steps)
    return step * share_steps // inner_steps - start * share_steps // inner_steps, step - start


def weight(trained: int, window: int) -> float:
    """w_i = trained / window of a member's (trained, window); 1.0 for (0, 0), a full region."""
    return 1.0 if window == 0 else trained / window


class RegionShare:
    """One region's --inner-share as it trains: a fixed share, or auto (``share`` None), chosen
    again before every step from its own step time and the fastest one on the board."""

    def __init__(self, share: float | None, inner_steps: int, trial_step_s: float | None = None) -> None:
        self.inner_steps = inner_steps
        self.auto = share is None
        self.steps = inner_steps if share is None else share_steps(share, inner_steps)  # k
        self.times: deque[float] = deque(maxlen=inner_steps)  # auto: its last H step times
        # auto: (step, k) of its last 2H steps. A sync sent after step s asks ``recent(s)`` when its
        # round starts, after its outer gradient: at most τ < H steps later (the sync is applied after
        # step s + τ, before step s + τ + 1 trains), so the window (s − H, s] is still here
        self.k_at: deque[tuple[int, int]] = deque(maxlen=2 * inner_steps)
        if trial_step_s:  # a step measured before step 1 (``node.first_step_time``)
            self.times.append(trial_step_s)

    def measured(self, step_s: float) -> None:
        """One step took ``step_s`` here."""
        self.times.append(step_s)

    def choose(self, fastest_step_s: Callable[[], float]) -> bool:
        """Auto: k for the median of its last H step times and the fastest on the board
        (``fastest_step_s``, asked only then); True if it changed."""
        if not self.auto:
            return False
        own = statistics.median(self.times) if self.times else 0.0
        chosen = share_steps(auto_share(own, fastest_step_s()), self.inner_steps)
        changed, self.steps = chosen != self.steps, chosen
        return changed

    def trains(self, step: int) -> bool:
        """Whether it trains ``step`` at its k now (auto: the k is kept for ``recent``)."""
        if self.auto:
            self.k_at.append((step, self.steps))
        return trains(step, self.steps, self.inner_steps)

    def recent(self, step: int) -> tuple[int, int]:
        """(trained, window) up to ``step`` (``recent_steps``). Auto: each step of the window counted
        at the k it was trained at; a step not asked of ``trains`` here (before a resume or a join)
        at the k now."""
        if not self.auto:
            return recent_steps(step, self.steps, self.inner_steps)
        start, known = max(0, step - self.inner_steps), dict(self.k_at)
        ks = {t: known.get(t, self.steps) for t in range(start + 1, step + 1)}
        if all(k == self.inner_steps for k in ks.values()):
            return 0, 0
        return sum(trains(t, k, self.inner_steps) for t, k in ks.items()), step - start

    @property
    def fraction(self) -> float:
        return self.steps / self.inner_steps

    def __str__(self) -> str:
        return f"{self.steps} of every {self.inner_steps} steps"
