"""Which fragment is sent after which inner step. Every peer computes the same answer locally.

Streaming DiLoCo sends fragment p every H steps at fixed offsets; CoCoDC has one send slot every
h = ⌊H/N⌋ steps and picks the fragment adaptively, from data every peer holds identically.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any, NamedTuple, Protocol

import torch

from p2p_cocodc.algorithms.state import expect_list

MAX_PACE_PERIODS = 4  # a paced schedule sends at least once every 4·H steps
PACE_HEADROOM = 1.25  # a paced schedule keeps a link busy at most 1/1.25 = 80 % of the time
PACE_NARROWING_HEADROOM = 1.4  # and goes back to a narrower spacing only at 1/1.4 = 71 % busy there
NARROW_AFTER_ROUNDS = 3  # rounds of a link measured before it may ask for a narrower spacing
PACE_GRAIN = 4  # a paced spacing moves in steps of ⌊H/N⌋ / 4 (at least 1)


class RoundCost(NamedTuple):
    """What a round in one codec costs a peer (measured; 0.0: not yet): ``busy_s``, T, the time its
    link is busy with the round, and ``landing_s``, D, the time a sync takes from its send to its
    result, ready to apply (``paced_spacing``). A plain (busy_s, landing_s) pair reads the same
    (``peer/lobby.py``, which imports no torch, passes one)."""

    busy_s: float
    landing_s: float = 0.0


def pace_grain(base: int) -> int:
    """q = max(1, ⌊base/4⌋) (``PACE_GRAIN``; ``base`` is ⌊H/N⌋): the step a paced spacing moves in."""
    return max(1, base // PACE_GRAIN)


def delta_rms(delta: torch.Tensor) -> float:
    """rms(Δ) = sqrt(Σ Δ² / n), summed in fp64: the size of an averaged outer gradient, which
    CoCoDC's drift score uses. O(n) work on the CPU: a driver computes it off its training thread."""
    return math.sqrt(float(delta.double().square().sum()) / delta.numel())


class Schedule(Protocol):
    scores_results: bool  # record_result wants rms(averaged Δ_p) (``delta_rms``); else it gets None

    def select(self, step: int, in_flight: Collection[int]) -> list[int]: ...

    def record_send(self, fragment: int, step: int) -> None: ...

    def record_result(self, fragment: int, rms: float | None) -> None: ...

    def set_spacing(self, spacing: int, step: int | None = None) -> None: ...

    def bandwidth_paced(self) -> bool: ...

    def overlap(self, configured: int) -> int: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class FixedSchedule:
    """Fragment p is sent at steps (p+1)·H/K + k·H: round robin, each fragment every H steps.

    These offsets are what CoCoDC's adaptive schedule produces at N = K, so the two compare on the
    same timetable. K = 1 sends the whole model every H steps: DiLoCo.
    """

    scores_results = False

    def __init__(self, inner_steps: int, num_fragments: int) -> None:
        self.period = inner_steps
        self.spacing = inner_steps // num_fragments
        self.num_fragments = num_fragments

    def select(self, step: int, in_flight: Collection[int]) -> list[int]:
        if step <= 0 or step % self.spacing:
            return []
        p = (step // self.spacing - 1) % self.num_fragments
        return [] if p in in_flight else [p]

    def record_send(self, fragment: int, step: int) -> None:
        """Fixed offsets need no memory of past sends."""

    def record_result(self, fragment: int, rms: float | None) -> None:
        """Fixed offsets ignore the results."""

    def set_spacing(self, spacing: int, step: int | None = None) -> None:
        raise ValueError("a fixed timetable cannot be paced: only CoCoDC's adaptive schedule can")

    def bandwidth_paced(self) -> bool:
        return False

    def overlap(self, configured: int) -> int:
        """τ as configured: a fixed timetable is never paced."""
        return configured

    def state_dict(self) -> dict[str, Any]:
        """Nothing: the timetable is a function of the step and the settings."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"a fixed schedule has no state, got keys {sorted(state)}")


class AdaptiveSchedule:
    """CoCoDC's adaptive transmission, in the variant a peer-to-peer swarm can agree on silently.

    One slot every h = ⌊H/N⌋ steps, counted from the last send: a slot at step t when
    t − (the last step any fragment was sent) is a positive multiple of h (at first, the multiples
    of h; after a narrowing that came too late for its first slot, see ``set_spacing``). At a
    slot, among fragments not in flight: the fragment sent longest ago if it was not sent for
    ≥ H steps (staleness bound; ties: the first); else the first never-sent fragment; else the
    highest drift score rms(last averaged Δ_p) · (steps since p's last send) / (length of p's last
    interval). The score uses only averaged results and send steps, identical on every peer.

    The spacing may be widened while the run goes on (``set_spacing``: "send less"), from a value
    every replica learns at the same step (in a swarm, with a round's average; see ``paced_spacing``);
    it is never narrower than ⌊H/N⌋, and it is part of the state. Slots counted from the last send
    keep two sends at least the spacing apart across a change of it (the multiples of a new spacing
    may lie a step after the last send).
    """

    scores_results = True

    def __init__(self, inner_steps: int, num_fragments: int, transmissions: int) -> None:
        self.inner_steps = inner_steps
        self.base_spacing = max(inner_steps // transmissions, 1)
        self.spacing = self.base_spacing
        self.last_send = [0] * num_fragments  # 0: synchronised at initialisation
        self.prev_send = [0] * num_fragments
        self.sent = [False] * num_fragments
        self.last_rms = [0.0] * num_fragments
        self.slots_from = 0  # the step slots are counted from: the last send (or see ``set_spacing``)

    def select(self, step: int, in_flight: Collection[int]) -> list[int]:
        last = self.slots_from
        if step <= last or (step - last) % self.spacing:
            return []
        free = [p for p in range(len(self.sent)) if p not in in_flight]
        if not free:
            return []
        stale = [p for p in free if step - self.last_send[p] >= self.inner_steps]
        if stale:  # the one sent longest ago: a paced schedule (slots ≥ H apart) goes round them all
            return [min(stale, key=lambda p: (self.last_send[p], p))]
        for p in free:
            if not self.sent[p]:
                return [p]
        return [max(free, key=lambda p: (self._drift(p, step), -p))]

    def _drift(self, p: int, step: int) -> float:
        interval = max(self.last_send[p] - self.prev_send[p], 1)
        return self.last_rms[p] * (step - self.last_send[p]) / interval

    def record_send(self, fragment: int, step: int) -> None:
        self.prev_send[fragment] = self.last_send[fragment]
        self.last_send[fragment] = step
        self.sent[fragment] = True
        self.slots_from = step

    def record_result(self, fragment: int, rms: float | None) -> None:
        """Remember the size of the averaged outer gradient (``delta_rms``): the drift estimate for
        the score."""
        if rms is None:
            raise ValueError("an adaptive schedule scores fragments by rms(Δ): record_result needs it")
        self.last_rms[fragment] = rms

    def set_spacing(self, spacing: int, step: int | None = None) -> None:
        """Send slots every ``spacing`` steps from the last send on, kept within [⌊H/N⌋, 4·H]: a pace
        asked for by a faulty or hostile peer can slow a swarm no further. ``step``: the step it is
        set at (with a round's result, before that step's sends). A narrower spacing whose first
        slot has passed by then gives a slot at ``step`` itself, and the spacing counts from there:
        on `thin` the result that narrowed the pace from 42 steps to 31 landed 41 steps after the
        last send, and waiting for the next multiple of 31 (62 steps) cost a round."""
        if not isinstance(spacing, int) or isinstance(spacing, bool) or spacing < 1:
            raise ValueError(f"a send-slot spacing must be an int ≥ 1, got {spacing!r}")
        was = self.spacing
        self.spacing = min(max(spacing, self.base_spacing), MAX_PACE_PERIODS * self.inner_steps)
        if step is not None and self.spacing < was and step - self.slots_from > self.spacing:
            self.slots_from = step - self.spacing

    def bandwidth_paced(self) -> bool:
        """A link's bandwidth paces the swarm: the send slots are wider than ⌊H/N⌋ + q
        (``coarse_spacing``), which gives a round its whole slot instead of τ steps.
        ``SyncCodecs.paced`` is then the codec of a sync sent."""
        return self.spacing >= coarse_spacing(self.base_spacing)

    def overlap(self, configured: int) -> int:
        """τ of a sync sent now. Paced (h > ⌊H/N⌋), a sync gets its whole slot: τ' = h − 1 steps, so
        it lands the step before the next one is sent. The pace asked for 1.25× the link's busy time
        per round and 1.25× the time a sync takes to land, plus a step (``paced_spacing``); the rest
        of the slot covers what those leave out: the round's messages before and between the
        transfers, and the members' skew. Not τ where τ is longer: τ was worked out before the start
        for the steady codec's rounds; in the simulator, `thin`'s q2 syncs every 8 steps applied 17
        steps after their sends ended 1 % higher in perplexity than applied after 7
        (``docs/thin-link.md``, "Slots every ⌊H/K⌋ steps under a pace")."""
        if self.spacing == self.base_spacing:
            return configured
        return self.spacing - 1

    def state_dict(self) -> dict[str, Any]:
        """The slot spacing and the step slots count from; send steps, sent flags and drift
        estimates per fragment (plain Python values)."""
        return {
            "spacing": self.spacing,
            "slots_from": self.slots_from,
            "last_send": list(self.last_send),
            "prev_send": list(self.prev_send),
            "sent": list(self.sent),
            "last_rms": list(self.last_rms),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take over a ``state_dict()`` of a schedule with as many fragments."""
        k = len(self.sent)
        self.set_spacing(state["spacing"])
        self.last_send = expect_list(state["last_send"], k, int, "last_send")
        self.prev_send = expect_list(state["prev_send"], k, int, "prev_send")
        self.sent = expect_list(state["sent"], k, bool, "sent")
        self.last_rms = expect_list(state["last_rms"], k, float, "last_rms")
        slots_from = state.get("slots_from", max(self.last_send))  # absent before 2026-11-28: the last send
        if not isinstance(slots_from, int) or isinstance(slots_from, bool) or slots_from < 0:
            raise ValueError(f"slots_from must be an int ≥ 0, got {slots_from!r}")
        self.slots_from = slots_from


def paced_spacing(
    base: int,
    inner_steps: int,
    busy_s: float,
    step_time_s: float,
    current: int = 0,
    settled: bool = True,
    overlap: int | None = None,
    landing_s: float = 0.0,
) -> int:
    """The send-slot spacing a peer asks for so that its link keeps up: the least multiple of
    q = max(1, ⌊base/4⌋) (``PACE_GRAIN``; ``base`` is ⌊H/N⌋) at or above 1.25 · T / s, where T is the
    time its link is busy per round (measured) and s its inner step time; at least ``base``, at most
    4·H. This is CoCoDC's N = ⌊H·s/T⌋ (``--transmissions auto``) from measurements taken while the
    run goes on, with h = H/N; the headroom leaves a fifth of the link to the notice board and the
    protocol's small messages. Whole multiples of q keep a noisy measurement from moving the slots
    by a step or two; q is a quarter of ⌊H/N⌋, not all of it, because on `thin` (N = 1, H = 24) whole
    multiples of H left a wish just over 48 steps only 72 to choose, a link idle a third of the time
    and a run with 6 rounds where 10 fit. With nothing measured yet (T or s ≤ 0) the answer is ``base``.

    ``current``: the spacing the swarm keeps now. A narrower one is asked for only where it leaves
    the link 1.4× the busy time (``PACE_NARROWING_HEADROOM``), not 1.25×, and only once T is
    ``settled`` (measured over ``NARROW_AFTER_ROUNDS`` rounds). On `thin` a round's busy time sat
    near the edge of one slot, and the pace went back and forth between one and two slots every few
    rounds, the rounds at the narrow pace waiting up to a second each; and a first round, on links
    idle until then, once asked for half the spacing the later ones needed.

    ``overlap``: τ, which a sync sent at ``base`` gets to land (``AdaptiveSchedule.overlap``: paced,
    it gets its whole slot). Where τ + 1 steps fall short of the headroom, ``base`` is not asked
    for: the spacing is at least ``base + q``. On `thin` with q2 (τ = 17, ⌊H/N⌋ = 24) the pace went
    from 30 steps to 24, and the round sent at 24 had 17 steps instead of 29: one peer's largest
    stall of the run, 1.8 s (``docs/thin-link.md``).

    ``landing_s``: D, the time a sync of this peer's takes from its send to its result, ready to
    apply (measured; 0: not yet). A sync gets τ steps to land at ``base`` and h − 1 paced, so the
    spacing is also at least 1.25 · D / s + 1, and ``base`` only where τ ≥ 1.25 · D / s. On a link
    whose bandwidth a round hardly uses, D is round trips and arithmetic, which T leaves out: on
    `region` (1 Gbit/s, 20 ms) a pace sized from T alone stalled the peers 13–18 % of the run, and
    with D 7–10 % (``docs/thin-link.md``). D leaves out the wait for the other members to arrive
    (``LinkMeter``)."""
    if (busy_s <= 0 and landing_s <= 0) or step_time_s <= 0:
        return base
    grain = pace_grain(base)

    tau = base - 1 if overlap is None else overlap

    def spacing(headroom: float) -> int:
        link = headroom * busy_s / step_time_s  # steps the link is busy per round
        land = headroom * landing_s / step_time_s  # steps a sync takes to land
        if link <= min(base, tau + 1) + 1e-9 and land <= tau + 1e-9:
            return base
        need = max(link, land + 1 if landing_s > 0 else 0.0)  # paced: τ' = h − 1 steps to land in
        wanted = max(base, min(grain * math.ceil(need / grain - 1e-9), MAX_PACE_PERIODS * inner_steps))
        return base + grain if wanted == base else wanted

    wanted = spacing(PACE_HEADROOM)
    if wanted >= current:
        return wanted
    return min(current, spacing(PACE_NARROWING_HEADROOM)) if settled else current


def coarse_spacing(base: int) -> int:
    """The narrowest send-slot spacing whose syncs take the paced codec (``SyncCodecs``):
    ⌊H/N⌋ + q + 1 (``base`` is ⌊H/N⌋, q = max(1, ⌊base/4⌋)). ⌊H/N⌋ + q is what a steady round asks
    for where τ steps are too few to land it (``paced_spacing``): a matter of latency, which fewer
    bytes do not help. One step more, not a grain more: on `thin` q2's rounds fit in ⌊H/N⌋ + q = 30
    steps, and a floor of ⌊H/N⌋ + 2q = 36 synced 13 rounds where 16 fit."""
    return base + pace_grain(base) + 1


def paced_codec_spacing(
    base: int,
    inner_steps: int,
    steady: RoundCost,
    coarse: RoundCost,
    step_time_s: float,
    current: int,
    settled: bool,
    overlap: int | None,
) -> int:
    """``paced_spacing`` for a swarm whose syncs take a coarser codec while a link's bandwidth
    paces it (``SyncCodecs``): the spacing itself says which codec a sync uses (at least
    ``coarse_spacing(base)``: the coarser one), so the pace every member takes from a round carries
    the codec too. ``steady`` and ``coarse``: what a round of each codec costs (``RoundCost``).

    The steady codec where its rounds fit in ⌊H/N⌋, or in ⌊H/N⌋ + q where τ is too short to land
    them (``paced_spacing`` says which, from the spacing in use; coming back from the coarser codec
    takes the narrowing headroom, 1.4×, and a settled measurement). Else the coarser codec's
    ``paced_spacing``, at least ``coarse_spacing(base)``. On `thin` (2 Mbit/s) q2 synced 14–16 rounds
    in a run where fp4 synced 6–10, and ended 2.3 % lower in perplexity (``docs/thin-link.md``)."""
    if max(steady) <= 0 or step_time_s <= 0:  # neither the link's time nor a landing measured
        return base
    coarse_from = coarse_spacing(base)
    coarse_now = current >= coarse_from
    wider = MAX_PACE_PERIODS * inner_steps + 1  # than any spacing asked for: come back only when settled

    def spacing(cost: RoundCost, current: int) -> int:
        busy, landing = cost
        return paced_spacing(base, inner_steps, busy, step_time_s, current, settled, overlap, landing)

    steady_spacing = spacing(steady, wider if coarse_now else current)
    if steady_spacing < coarse_from:
        return steady_spacing
    return max(spacing(coarse, current), coarse_from)
