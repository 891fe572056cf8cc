"""A libp2p connection to every peer on the board, opened from the lobby on and kept.

A round's messages travel on libp2p streams, and a stream to a peer this one is not connected to
first dials it: the daemon looks the peer's addresses up in libp2p's DHT, then connects. The
board's own traffic connects only some pairs of peers, so on a thin link the first round used to
pay for the others' dials while every member's uplink was busy with its slices: a dropped SYN
costs 1 s, then 2 s more, a lookup through the bootstrap a few round trips, and a dial that fails
leaves libp2p refusing to dial that peer again for a while ("dial backoff"). On `thin`
(`docs/thin-link.md`) such a dial took 8 s in one run of two, and in one run the pair never
connected at all.

So a peer dials every other peer of its run as soon as it sees it on the board, while the links
are idle (the lobby waits for the others anyway), and again whenever a connection is gone. The
dial is the daemon's own connect (p2pd's CONNECT, which looks the addresses up and tries them
within ``DIAL_DEADLINE_S``, resending SYNs as the kernel does), not a request with a short timeout
of its own: cancelling a dial half-way only turns it into a failure and a backoff.

``DialPlan`` is the policy, pure and driven by the caller's clock: which peers to dial now, and
when to try a failed one again (after ``FIRST_RETRY_S``, doubling to ``MAX_RETRY_S``).
``Connections`` is its transport: it asks the daemon which peers it is connected to once every
``CHECK_S``, and dials the ones the plan names.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

DIAL_DEADLINE_S = 60.0  # p2pd's own deadline for a CONNECT with no timeout of its own
FIRST_RETRY_S = 2.0  # a failed dial's first retry (libp2p's dial backoff starts at 5 s: the
MAX_RETRY_S = 30.0  # retries that fall inside it fail at once and cost nothing)
CHECK_S = 1.0  # how often the daemon is asked which peers it is connected to
SLOW_DIAL_S = 2.0  # a dial that took longer is logged at INFO: it would have stalled a round


@dataclass
class DialPlan:
    """When to dial which peer. ``due`` names the peers to dial now; ``dialled`` takes each result."""

    first_retry_s: float = FIRST_RETRY_S
    max_retry_s: float = MAX_RETRY_S
    dialling: set[str] = field(default_factory=set)
    failures: dict[str, int] = field(default_factory=dict)  # peer -> failed dials since its last success
    retry_at: dict[str, float] = field(default_factory=dict)  # peer -> not before this time

    def due(self, wanted: Iterable[str], connected: Collection[str], now: float) -> list[str]:
        """The wanted peers that are not connected, not being dialled, and past their retry time
        (in the order of ``wanted``); each is counted as being dialled from now on. Peers no longer
        wanted are forgotten."""
        wanted = list(dict.fromkeys(wanted))
        for gone in set(self.retry_at) - set(wanted):
            del self.retry_at[gone]
            self.failures.pop(gone, None)
        due = [
            p
            for p in wanted
            if p not in connected and p not in self.dialling and now >= self.retry_at.get(p, now)
        ]
        self.dialling.update(due)
        return due

    def dialled(self, peer: str, ok: bool, now: float) -> None:
        """The result of a dial ``due`` named."""
        self.dialling.discard(peer)
        if ok:
            self.failures.pop(peer, None)
            self.retry_at.pop(peer, None)
            return
        failures = self.failures[peer] = self.failures.get(peer, 0) + 1
        self.retry_at[peer] = now + min(self.max_retry_s, self.first_retry_s * 2 ** (failures - 1))


class Connections:
    """Keeps this peer connected to the peers ``start`` names, until ``stop``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.p2p: Any = None
        self.peers: Callable[[], Iterable[str]] = list
        self.clock = clock
        self.plan = DialPlan()
        self.task: asyncio.Task | None = None
        self.dials: set[asyncio.Task] = set()
        self.seen: dict[str, float] = {}  # peer -> when it was first wanted, for the log

    def start(self, p2p: Any, peers: Callable[[], Iterable[str]]) -> None:
        """Keep this peer connected to ``peers()`` (base58 peer ids) through ``p2p``'s daemon."""
        self.p2p, self.peers = p2p, peers
        self.task = asyncio.create_task(self._keep(), name="connections")

    async def stop(self) -> None:
        tasks = [t for t in (self.task, *self.dials) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def connected(self) -> set[str]:
        """The peers the daemon holds a connection to now."""
        return {info.peer_id.to_base58() for info in await self.p2p._client.list_peers()}

    async def check(self) -> list[str]:
        """Start a dial to every peer the plan says is due; returns them."""
        wanted = list(self.peers())
        now = self.clock()
        for peer in wanted:
            self.seen.setdefault(peer, now)
        due = self.plan.due(wanted, await self.connected(), now)
        for peer in due:
            task = asyncio.create_task(self._dial(peer), name=f"dial {peer[:12]}")
            self.dials.add(task)
            task.add_done_callback(self.dials.discard)
        return due

    async def _keep(self) -> None:
        while True:
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the daemon busy or gone: the round will say so
                log.debug("could not list this peer's connections: %s", exc)
            await asyncio.sleep(CHECK_S)

    async def _dial(self, peer: str) -> None:
        from hivemind.p2p import PeerID

        started = self.clock()
        try:
            await asyncio.wait_for(
                self.p2p._client.connect(PeerID.from_base58(peer), []), DIAL_DEADLINE_S + 5
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - p2pd's control errors carry the reason as text
            self.plan.dialled(peer, False, self.clock())
            log.log(  # once is often a peer that has just ended; twice in a row is worth a line
                logging.INFO if self.plan.failures[peer] > 1 else logging.DEBUG,
                "could not connect to peer %s yet (%s); trying again in %.0f s",
                peer[:12],
                " ".join(str(exc).split())[:200],
                self.plan.retry_at[peer] - self.clock(),
            )
            return
        took = self.clock() - started
        self.plan.dialled(peer, True, self.clock())
        log.log(
            logging.INFO if took > SLOW_DIAL_S else logging.DEBUG,
            "connected to peer %s in %.1f s (%.1f s after it showed up)",
            peer[:12],
            took,
            self.clock() - self.seen.get(peer, started),
        )
