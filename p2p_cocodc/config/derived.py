"""Values derived from the options: τ (--overlap) and N (--transmissions), in one place.

Each algorithm has its own default τ (H/4 where syncs overlap the next steps, 0 where they block),
N defaults to K, and 'auto' makes each the number the link allows. The simulator and a peer both
get theirs from here (``TrainConfig.algo_settings``), so a peer's 'auto' is the simulator's for
the same link and step time. Pure arithmetic: the caller measures what 'auto' rests on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from p2p_cocodc.config.schema import AUTO
from p2p_cocodc.errors import UserError

BLOCKING = ("ddp", "diloco")  # algorithms that wait for every sync: no overlap


@dataclass(frozen=True)
class Link:
    """What 'auto' is worked out from: the bytes one replica puts on the wire for each sync (one per
    fragment for streaming and cocodc, the whole model for ddp and diloco), the link's one-way
    latency and bandwidth, and the seconds of one inner step."""

    wire_bytes: Sequence[int]
    latency_s: float
    bandwidth_bps: float
    step_time: float
    paced: bool = False  # a cocodc peer, whose sends the swarm spaces out when the link lags behind
    asks_pace: bool = False  # a paced peer that asks the swarm for the pace its link carries (--pace link)


# the share of a declared link's rate that a round gets: the declared rate is the line's, TCP's
# headers and the notice board take the rest (on `thin`: 1.82 of 2 Mbit/s of TCP goodput, the board
# about a tenth). At the full rate a starting pace sat on the edge of one slot there, and a start a
# slot too narrow stalled every peer until the first rounds had measured the link.
DECLARED_SHARE = 0.8


def declared_busy_s(round_bytes: int, mbps: float) -> float:
    """T before any delivery was measured: the seconds a link of ``mbps`` (as declared) is busy
    with one round's ``round_bytes``, at ``DECLARED_SHARE`` of its rate."""
    return 8.0 * round_bytes / (DECLARED_SHARE * mbps * 1e6)


def sync_shape(
    algo: str,
    inner_steps: int,
    fragments: int,
    overlap: int | str | None,
    transmissions: int | str | None,
    link: Link | None = None,
) -> tuple[int, int]:
    """(τ, N) as the core gets them: the numbers given, each algorithm's defaults for None, and for
    'auto' the smallest τ that hides the slowest transfer and the most sends per H steps the link
    carries (``link``: what they are worked out from; ValueError without it). A transfer longer
    than H − 1 steps is a UserError, but on a paced link (a cocodc peer: the swarm widens its send
    pace to what the link carries), where τ becomes H − 1.

    Where the peer asks for that pace itself (``--pace link``, the default), N is at least K: ⌊H/N⌋
    is only the narrowest slot spacing there, and the pace the swarm measures and agrees on sets the
    rest (``AdaptiveSchedule``). An N worked out before the start from the declared link and the
    step time is a guess, and a pace only widens the slots from ⌊H/N⌋: on `thin` (2 Mbit/s, steps
    of 0.3 s) N = 1 kept a send every 24 to 30 steps where q2's rounds fit every 8 to 10, and the
    swarm synced 10 rounds in 192 steps instead of 21 to 22 (``docs/thin-link.md``, "Slots every
    ⌊H/K⌋ steps under a pace")."""
    if AUTO in (overlap, transmissions):
        if link is None:
            raise ValueError("'auto' is worked out from the link and the step time: pass link")
        times = [link.latency_s + 8.0 * w / link.bandwidth_bps for w in link.wire_bytes]
        if overlap == AUTO:
            overlap = math.ceil(max(times) / link.step_time - 1e-9)
            if overlap >= inner_steps and link.paced:  # the most it can hide; the pace does the rest
                overlap = inner_steps - 1
            if overlap >= inner_steps:
                raise UserError(
                    f"--overlap auto: a fragment transfer takes {max(times):.2f} s = {overlap} inner "
                    f"steps, not less than --inner-steps {inner_steps}; raise --inner-steps, "
                    "--fragments or --bandwidth-mbps, or pick a smaller --codec"
                )
        if transmissions == AUTO:
            mean_time = sum(times) / len(times)
            fitting = math.floor(inner_steps * link.step_time / mean_time)
            transmissions = min(inner_steps, max(1, fitting))
            if link.paced and link.asks_pace:  # slots every ⌊H/K⌋ steps at least: the pace widens them
                transmissions = max(transmissions, min(fragments, inner_steps))
    if overlap is None:  # each algorithm's own default
        overlap = 0 if algo in BLOCKING else inner_steps // 4
    return int(overlap), fragments if transmissions is None else int(transmissions)


def check_sync(
    algo: str, inner_steps: int, fragments: int, overlap: int | str | None, transmissions: int | str | None
) -> None:
    """What the options alone say against τ and N, before any link is known (the core's own checks,
    ``AlgoSettings``, follow on the numbers)."""
    if algo == "ddp" and overlap not in (None, 0):
        raise UserError(
            f"--overlap {overlap}: ddp averages every step's gradients before the next step, "
            "nothing overlaps; leave --overlap out"
        )
    if algo == "cocodc" and transmissions is None and fragments > inner_steps:
        raise UserError(
            f"--fragments {fragments} must be ≤ --inner-steps {inner_steps} for cocodc "
            "(--transmissions defaults to --fragments)"
        )
