"""A peer's presence in the swarm: its record on the notice board, its view of the others, the θ̄
agreement, and the watch for a lapse.

- The **heartbeat** reads the board every ``--heartbeat`` seconds, and publishes this peer's record
  when it is due (``Board.due``: a field the others act on changed, or a quarter of its lifetime
  passed), never waiting on a slow DHT call (a publish or read still in flight is skipped, not cancelled),
  and gives up only when no publish has reached another node, or no read has succeeded, for
  ``Board.give_up_s``: long after the others dropped this peer.
- The **view** keeps a peer for its record's lifetime after it was last read: a DHT read under load
  can miss a live record, and a leader must not form a round without a peer that is still there.
- **θ̄ agreement** (``swarm/agreement.py``): the digests on the board are compared with ours; a
  strict majority holding another θ̄ means this peer takes the swarm's state again.
- The **lapse watch** notices that this process was stopped (SIGSTOP, a suspended VM) for longer than
  its record lives: the others have gone on without it, so it takes the swarm's state again.

The heartbeat and the watch end only with an error; ``check`` raises it where the peer trains.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from p2p_cocodc.errors import UserError
from p2p_cocodc.run.loop import Rejoin, SyncsFailing
from p2p_cocodc.swarm.agreement import Agreement, Reported, Verdict, in_doubt, split_line
from p2p_cocodc.swarm.records import Board, PeerRecord

log = logging.getLogger(__name__)

FIRST_PUBLISH_S = 15.0  # a new peer's DHT may need a few seconds to know another node
LAST_PUBLISH_S = 10.0  # a peer that is done tries this long to say so before it shuts its DHT down
HOLD_LIFETIMES = 0.5  # a round in flight holds the heartbeat's reads and publishes this long at most


def held_back(carrying: bool, now: float, last_ok: float, lifetime_s: float) -> bool:
    """Whether the heartbeat holds a read or a due publish back: while a round's slices are on the
    link (``carrying``), until ``HOLD_LIFETIMES`` of a record's lifetime has passed since the last
    one of its kind succeeded (``last_ok``)."""
    return carrying and now - last_ok < HOLD_LIFETIMES * lifetime_s


class Hearing:
    """How long this peer has gone unheard (no publish reached another node) and blind (no read of
    the board succeeded), counted in the time it ran: a process stopped for a while (SIGSTOP, a
    suspended VM, swap) does not count its sleep, so on waking it takes the swarm's state again (the
    lapse watch) instead of giving the DHT up; a DHT silent while the process runs is given up after
    ``Board.give_up_s`` as before. Pure: the heartbeat hands it the times."""

    def __init__(self, now: float, frozen_after_s: float) -> None:
        self.frozen_after_s = frozen_after_s  # a beat this late means the process was stopped
        self.last_beat = now
        self.woke_at = now  # the start, or the latest wake from a stop
        self.read_ok = now

    def beat(self, now: float) -> bool:
        """A heartbeat at ``now``: True if the process was stopped since the last one."""
        frozen = now - self.last_beat > self.frozen_after_s
        if frozen:
            self.woke_at = now
        self.last_beat = now
        return frozen

    def read(self, now: float) -> None:
        self.read_ok = now

    def silent_s(self, now: float, landed_at: float) -> float:
        return now - max(landed_at, self.woke_at)

    def blind_s(self, now: float) -> float:
        return now - max(self.read_ok, self.woke_at)


class Presence:
    """This peer on the board (``record()`` is what it publishes, ``run_info`` beside it) and the
    others as it sees them. ``on_records`` sees every fresh read of the board; ``on_lapse`` is
    called when the watch finds this peer lapsed (before the peer notices ``Rejoin``).

    While ``carrying()`` is true (the exchange moves a round's slices over this peer's link), the
    heartbeat's reads and publishes wait, each until half a record's lifetime has passed since the
    last one that succeeded (``HOLD_LIFETIMES``). A read, and the search a publish begins with, is answered by
    several nodes with every peer's record; on a 2 Mbit/s link that traffic took about an eighth
    of each uplink, in the seconds a round is timed by. All members of a round hold theirs at
    once, so the nodes that would answer are quiet too. A record still lands well within its
    lifetime, and a change of state (``announce``) goes out at once."""

    def __init__(
        self,
        board: Board,
        same_run: Callable[[PeerRecord], bool],
        record: Callable[[], PeerRecord],
        run_info: dict[str, Any],
        heartbeat_s: float,
        on_records: Callable[[dict[str, PeerRecord]], None],
        on_lapse: Callable[[], None],
        can_rejoin: bool,
        carrying: Callable[[], bool] = lambda: False,
    ) -> None:
        self.board = board
        self.carrying = carrying
        self.peer_id = board.peer_id
        self.same_run = same_run
        self.record = record
        self.run_info = run_info
        self.heartbeat_s = heartbeat_s
        self.on_records = on_records
        self.on_lapse = on_lapse
        self.can_rejoin = can_rejoin
        self.view: dict[str, PeerRecord] = {}
        self.last_seen: dict[str, float] = {}  # peer id -> when its record was last read
        self.agreement = Agreement()  # this peer's θ̄ digests, compared with the others'
        self.disputed: dict[str, int] = {}  # peer -> the latest step where its θ̄ differed from ours
        self.distrusted: set[str] = set()  # peers whose θ̄ split off from the majority's: never donors
        self.split_from: Verdict | None = None  # a majority holds another θ̄: take the swarm's state
        self.unsettled: Verdict | None = None  # the latest disagreement no majority could settle
        self.heartbeat: asyncio.Task[None] | None = None
        self.watchdog: asyncio.Task[None] | None = None

    # ---- the board ----

    async def first_refresh(self, key_id: str) -> None:
        """The first record: a DHT that has just started may not know another node yet (a store then
        reaches nobody), so it is tried for ``FIRST_PUBLISH_S`` before the DHT counts as silent."""
        deadline = time.monotonic() + FIRST_PUBLISH_S
        while True:
            try:
                await self.refresh()
                return
            except ConnectionError as exc:
                if time.monotonic() > deadline:
                    raise UserError(
                        f"no other DHT node took this peer's record in {FIRST_PUBLISH_S:.0f} s ({exc}): "
                        "nodes that require a swarm key or an owner's certificate refuse records without "
                        f"it; check --swarm-key-file, or --owner and --certificate (this peer: {key_id})"
                    ) from None
                log.info("first board publish failed (%s); trying again", exc)
                await asyncio.sleep(self.heartbeat_s)

    def start(self) -> None:
        """The heartbeat, from the first record on."""
        self.heartbeat = asyncio.create_task(self._heartbeat())

    def watch(self) -> None:
        """(Re)start the lapse watch: once the peer trains, and after it ended with a ``Rejoin``."""
        if self.watchdog is None or self.watchdog.done():
            self.watchdog = asyncio.create_task(self._watch_for_lapse())

    def stop(self) -> None:
        for task in (self.heartbeat, self.watchdog):
            if task is not None:
                task.cancel()

    def guards(self) -> set[asyncio.Task[None]]:
        """The tasks whose end (always an error) must interrupt a wait."""
        return {t for t in (self.heartbeat, self.watchdog) if t is not None}

    def check(self) -> None:
        """Raise what ended the heartbeat or the lapse watch (they end only with an error)."""
        for task in (self.heartbeat, self.watchdog):
            if task is not None and task.done() and not task.cancelled():
                task.result()

    async def announce(self, state: str, last: bool = False) -> None:
        """Publish a change of this peer's state at once. A store the DHT does not take (a miss
        under load, or a DHT that knows no other node yet) is not fatal here: the heartbeat
        publishes the record again within a beat, and ends the peer if the DHT stays silent. The
        ``last`` record (done: the heartbeat is about to stop) is tried again for up to
        ``LAST_PUBLISH_S``: a late peer learns from it that the run ended."""
        deadline = time.monotonic() + (LAST_PUBLISH_S if last else 0.0)
        while True:
            try:
                await self.refresh()
                return
            except ConnectionError as exc:
                if time.monotonic() >= deadline:
                    log.warning("could not announce %r on the board (%s)%s", state, exc, "" if last else
                                "; the heartbeat will")  # fmt: skip
                    return
            await asyncio.sleep(min(self.heartbeat_s, 1.0))

    async def refresh(self, publish: bool = True, read: bool = True) -> None:
        """Publish this peer's record and update the view of the others. A peer stays in the view
        for its record's lifetime (the one it published, at least ours) after it was last read."""
        board = self.board
        if publish:
            await board.publish(self.record(), self.run_info)
        if not read:
            return
        fresh = await board.peers()
        now = time.monotonic()
        self.last_seen.update(dict.fromkeys(fresh, now))
        view = {**self.view, **fresh}
        self.view = {p: r for p, r in view.items() if now - self.last_seen[p] <= max(board.ttl_s, r.ttl_s)}
        self._compare_theta()
        self.on_records(fresh)

    async def look(self, pause_s: float) -> None:
        """Wait ``pause_s``, then read the board: for a peer in the lobby, waiting for the others'
        records to show up or to say "training". On the heartbeat's reads alone each of those waits
        took up to a second more (docs/hivemind-baseline.md, join → first step). A read that fails
        is left to the heartbeat."""
        await asyncio.sleep(pause_s)
        try:
            await self.refresh(publish=False)
        except ConnectionError as exc:
            log.info("board read failed while waiting for the others (%s)", exc)

    def fastest_step_s(self) -> float:
        """The shortest inner step time a training peer of this run publishes (0: none measured yet):
        what ``--inner-share auto`` compares this peer's own with."""
        times = [
            r.step_time_s
            for r in self.view.values()
            if self.same_run(r) and r.state == "training" and r.step_time_s > 0
        ]
        return min(times, default=0.0)

    def swarm_step(self) -> tuple[int, float] | None:
        """The furthest step a training peer of this run (not this one) publishes, and the slowest
        step time among them: where a joiner catches up to (``SwarmReplica.catching_up``); None
        when no such peer is on the board (a joiner then goes on catching up: training alone, it
        would average rounds the swarm completed without it)."""
        training = self._others("training").values()
        if not training:
            return None
        return max(r.step for r in training), max(r.step_time_s for r in training)

    def run_finished(self) -> bool:
        """A peer of this run says it is done: the run has ended (or is ending)."""
        return bool(self._others("done"))

    def _others(self, *states: str) -> dict[str, PeerRecord]:
        """The records of this run's other peers on the board in one of ``states``, by peer id."""
        view = self.view.items()
        return {p: r for p, r in view if p != self.peer_id and self.same_run(r) and r.state in states}

    def name_of(self, peer: str) -> str:
        """Another peer as operators see it: the region its record names, else its peer id's start."""
        record = self.view.get(peer)
        return record.region if record is not None and record.region else peer[:12]

    # ---- θ̄ agreement ----

    def _compare_theta(self) -> None:
        """Compare our θ̄ digests with those on the board: name the peers that disagree, and take the
        swarm's state again when a strict majority holds another θ̄ (``swarm/agreement.py``)."""
        others = {
            p: Reported(
                r.step,
                {**dict(r.theta_earlier), r.theta_step: r.theta_sha},
                r.joined_at,
                r.state == "training",
                r.theta_doubt,
            )
            for p, r in self._others("training", "done", "leaving").items()
        }
        for verdict in self.agreement.compare(others):
            new = [p for p in verdict.disputed if self.disputed.get(p, -1) < verdict.step]
            for peer in verdict.disputed:
                self.disputed[peer] = max(self.disputed.get(peer, -1), verdict.step)
            if verdict.behind:
                self.split_from = verdict
                outcome = (
                    "the peers not in doubt hold another θ̄: this peer takes the swarm's state again"
                    if verdict.by_doubt
                    else "a majority holds another θ̄: this peer takes the swarm's state again"
                )
            elif verdict.before_resync:  # what it held then; it has taken the swarm's state since
                outcome = "this peer has taken the swarm's state since"
            elif verdict.settled:  # split off from the majority: never a donor (one in doubt resyncs)
                self.distrusted.update(set(verdict.disputed) - set(verdict.in_doubt))
                outcome = "the peers not in doubt hold this peer's θ̄" if verdict.by_doubt else (
                    "a majority holds this peer's θ̄")  # fmt: skip
            elif verdict.final:
                outcome = "no majority: nobody can tell which θ̄ is the swarm's"
            else:
                outcome = "no majority yet: the vote of peers not at that step is still to come"
            if verdict.final and not verdict.settled and not verdict.before_resync:
                self.unsettled = verdict  # the run stops (``check_split``)
            if new:
                who = ", ".join(p[:12] for p in new)
                log.warning("θ̄ after step %d differs here and on %s (%s)", verdict.step, who, outcome)

    async def agree_at(self, step: int, within_s: float) -> list[str]:
        """At the end of a run: wait until every other training peer of the run on the board has
        published its θ̄ digest of ``step`` (the last one) or left the board, comparing as they come,
        so that every peer's verdict rests on every peer's last θ̄, never on a board read before the
        slowest peer got there. Returns the peers whose digest did not come within ``within_s``."""
        deadline = time.monotonic() + within_s
        while True:
            try:
                await self.refresh()  # ours published (its digest of ``step``), theirs read and compared
            except ConnectionError as exc:
                log.info("board unreachable while comparing the last θ̄ (%s); trying again", exc)
            missing = sorted(
                p
                for p, r in self.view.items()
                if p != self.peer_id and self.same_run(r) and r.state == "training" and r.theta_step < step
            )
            if not missing or time.monotonic() > deadline:
                return missing
            await asyncio.sleep(min(self.heartbeat_s, 0.5))

    def check_split(self) -> None:
        """``Rejoin`` when a majority of the peers holds another θ̄ than this peer's; ``SyncsFailing``
        when every vote is in and no majority holds one θ̄ (nobody can tell which is the swarm's)."""
        if self.unsettled is not None:
            raise SyncsFailing(split_line(self.unsettled.step, dict(self.unsettled.holders)))
        if self.split_from is not None:
            verdict, self.split_from = self.split_from, None
            holding = "the peers not in doubt" if verdict.by_doubt else "a majority of the peers"
            raise Rejoin(
                f"θ̄ after step {verdict.step} differs from the one {holding} hold (this "
                f"peer's disagrees with {', '.join(p[:12] for p in verdict.disputed)})"
            )

    def doubt(self, step: int) -> None:
        """This peer went on past a sync it could not learn the outcome of: its θ̄ from ``step`` on is
        in doubt (published as ``theta_doubt``) until the digests confirm it (``swarm/agreement.py``)."""
        self.agreement.doubt_from(step)

    def took_state(self, donors: list[str], step: int) -> None:
        """This peer took the swarm's state of ``step`` from ``donors``: a donor that holds its θ̄ of
        that step in doubt (its record says so) passes the doubt on."""
        records = [self.view[d] for d in donors if d in self.view]
        if any(in_doubt(r.theta_doubt, r.joined_at, step) for r in records):
            self.doubt(step)

    def resyncing(self) -> None:
        """This peer is about to take the swarm's state: its digests so far are history, its verdicts void."""
        self.agreement.resynced()
        self.split_from = self.unsettled = None

    # ---- the tasks ----

    async def _watch_for_lapse(self) -> None:
        """Notice that this process was stopped (SIGSTOP, a suspended VM, swap) for longer than its
        record lives: the others have taken it for gone and gone on without it, so it must not
        carry on as if it were still in their rounds: it takes the swarm's state again."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.heartbeat_s)
            now = time.monotonic()
            if now - last > self.board.ttl_s - self.heartbeat_s:  # its last record may have lapsed
                what = (
                    f"this peer was stopped for {now - last:.0f} s, longer than its board record lives "
                    f"({self.board.ttl_s:.0f} s): the swarm has gone on without it"
                )
                if not self.can_rejoin:
                    raise UserError(f"{what}, and a ddp peer cannot take the swarm's state again; it stops")
                self.on_lapse()  # the next heartbeat must not say "training" any more
                raise Rejoin(what)
            last = now

    async def _heartbeat(self) -> None:
        """Keep this peer on the board and its view fresh without ever waiting on a slow DHT call."""
        board = self.board
        publishing: asyncio.Task[None] | None = None
        reading: asyncio.Task[None] | None = None
        hearing = Hearing(time.monotonic(), frozen_after_s=board.ttl_s - self.heartbeat_s)
        last_error = "none"
        summary_at = time.monotonic()
        lapsed_warned = False
        try:
            while True:
                await asyncio.sleep(self.heartbeat_s)
                if hearing.beat(time.monotonic()):
                    log.warning("this process was stopped since its last beat: that silence is not the DHT's")
                if not board.dht.is_alive():  # not congestion: nothing will answer again
                    raise UserError(
                        "lost the swarm's DHT: its process has died; this peer can no longer train with "
                        "the others"
                    )
                for task in (publishing, reading):
                    if task is not None and task.done() and (exc := task.exception()) is not None:
                        if not isinstance(exc, ConnectionError):
                            raise exc
                        last_error = str(exc)
                        log.warning("notice board unreachable: %s", exc)
                    elif task is reading and task is not None and task.done():
                        hearing.read(time.monotonic())
                if publishing is not None and publishing.done():
                    publishing = None
                if reading is not None and reading.done():
                    reading = None
                now = time.monotonic()
                carrying = self.carrying()  # a round's slices are on the link: the board waits a little
                ttl = board.ttl_s
                if publishing is not None or board.publishing:
                    board.skipped += 1
                elif board.due(self.record(), now) and not held_back(carrying, now, board.landed_at, ttl):
                    publishing = asyncio.create_task(self.refresh(read=False))
                if reading is None and not held_back(carrying, now, hearing.read_ok, ttl):
                    reading = asyncio.create_task(self.refresh(publish=False))
                silent, blind = hearing.silent_s(now, board.landed_at), hearing.blind_s(now)
                if max(silent, blind) > board.give_up_s:
                    what = (
                        f"no publish reached another node for {silent:.0f} s"
                        if silent > board.give_up_s
                        else f"no read of the board succeeded for {blind:.0f} s"
                    )
                    raise UserError(
                        f"lost the swarm's DHT: {what} (the limit is max(60 s, 4 record lifetimes) = "
                        f"{board.give_up_s:.0f} s; last error: {last_error}); the others no longer see "
                        "this peer, so it can no longer train with them"
                    )
                if silent > board.landed_lifetime_s and not lapsed_warned:
                    log.warning(
                        "no publish reached another node for %.0f s: this peer's record (lifetime %.0f s) "
                        "has probably lapsed on the others' boards",
                        silent,
                        board.landed_lifetime_s,
                    )
                lapsed_warned = silent > board.landed_lifetime_s
                if now - summary_at >= 30:
                    log.info("notice board: %s", board.stats())
                    summary_at = now
        finally:
            for task in (publishing, reading):
                if task is not None:
                    task.cancel()
            log.info("notice board: %s", board.stats())
