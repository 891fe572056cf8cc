"""The fragment exchange: the transport that runs round machines (``swarm/round.py``) over libp2p.

``FragmentExchange.allreduce(round_id, vector, step)`` is the one facade the peer and the
benchmarks call: it starts the round's machine and returns the average, or raises ``RoundFailed``.
Everything the protocol decides is in the pure machine; this module only carries its effects out:

- ``Send``: a message on a libp2p stream of hivemind's daemon (``dht.replicate_p2p()``), a
  length-prefixed msgpack frame (``swarm/wire.py``), never a socket of our own; the pieces the
  machine asks for at once for one peer go as frames of one stream (``Lanes``, ``swarm/lanes.py``:
  batches, turns on each link, acknowledgements awaited, the link meter). A stream carries at
  most ``MAX_PIECES`` messages here.
- ``Compute``: the butterfly's arithmetic runs in a worker thread, and its result is fed back.
- ``Settle``: wakes the caller of ``allreduce``.
- Time: a ticker feeds every open round ``Tick`` and, when the notice board changes, ``ViewChanged``.

Incoming frames are parsed by ``messages.parse_message`` (the one decoding point: sizes bounded,
fields type-checked) and fed to the round's machine with the sender's libp2p-authenticated id. Only
peers of this run on our board are heard (``is_member``: their records are signed, and hold a
membership proof when the run has a swarm key), within per-peer limits (``swarm/limits.py``: rate,
messages and bytes in flight, rounds opened here); anything else gets a REFUSED answer or is
dropped, never an exception, and refusals are counted by peer.
Settled rounds are remembered (``MAX_FINISHED``) to answer late askers; their averages are kept
for the last ``MAX_SERVED`` rounds, after which an asker hears that the average is gone.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from p2p_cocodc.algorithms.aggregation import MEAN, Aggregation, CosineRecord
from p2p_cocodc.algorithms.butterfly import MAX_PIECES
from p2p_cocodc.algorithms.codecs import Codec
from p2p_cocodc.swarm.group_claims import GroupClaims
from p2p_cocodc.swarm.lanes import MESSAGE_TIMEOUT_S, ExchangeStats, Lanes, LinkMeter
from p2p_cocodc.swarm.limits import Limits, PeerLimiter
from p2p_cocodc.swarm.messages import (
    Ack,
    Bye,
    Code,
    Message,
    Part,
    Result,
    Status,
    StatusReply,
    parse_message,
    payload_bytes,
)
from p2p_cocodc.swarm.records import PeerRecord
from p2p_cocodc.swarm.round import RoundMachine
from p2p_cocodc.swarm.round_events import (
    Accuse,
    BoardPeer,
    Completed,
    Compute,
    Deadlines,
    Event,
    Failed,
    Leaving,
    Lost,
    Note,
    Phase,
    Received,
    Send,
    Settle,
    Start,
    Tick,
    Undecided,
    ViewChanged,
    leader_rank,
    run_job,
)
from p2p_cocodc.swarm.trust import OPEN
from p2p_cocodc.swarm.wire import (
    MAX_FRAME,
    MIN_LINK_MBPS,
    SLOWEST_LINK_MBPS,
    BadMessage,
    read_next_frame,
)

log = logging.getLogger(__name__)

# a slice owner's screening memory: each member's earlier cosines at its slices (``CosineRecord``)
ScreeningMemory = dict[str, tuple[float, ...]]

# the round protocol's version: peers of a run share it (``peer.node.shared_options``); 3: a slice in
# pieces, a peer's pieces as frames of one stream
EXCHANGE_PROTOCOL = 3
MAX_OPEN_ROUNDS = 64  # rounds others may open here before this peer reaches them; then refused
PARTS_REMEMBERED = 256  # slice digests kept per member, to catch a slice replayed from an earlier round
BAN_AFTER = 64  # per-peer limits broken this often: the peer is banned from this peer's rounds
OPENING = (Code.JOIN, Code.PROBE, Code.FETCH)  # the only messages that open a round here: questions
MAX_FINISHED = 4096  # settled rounds remembered, to answer late askers
MAX_SERVED = 64  # of those, the most recent whose averages are kept for peers that ask
TICK_S = 0.2
STOP_GRACE_S = 5.0  # how long stop() lets messages being written go out


class RoundFailed(Exception):
    """This round could not complete on this peer; the reason says why."""


class RoundLost(RoundFailed):
    """Other peers completed this round, and its average could not be had here: θ̄ is behind the
    swarm's."""


class RoundUndecided(RoundLost):
    """This peer could not learn whether the round completed (``Undecided``): θ̄ may be behind."""


@dataclass(frozen=True)
class GroupRecord:
    """A round this peer completed: its members' data shards (in member order), its pace, and how
    long this peer waited in it for the others to arrive (from its start to the group's adoption:
    the members' skew)."""

    shards: tuple[int, ...]
    pace: int
    arrival_wait_s: float = 0.0
    cosines: tuple[tuple[str, float], ...] = ()  # each member's c_i at this peer's slice (screened)

    @classmethod
    def of(cls, completed: Completed, arrival_wait_s: float) -> GroupRecord:
        shards = tuple(shard for _, shard in completed.members)
        return cls(shards, completed.pace, max(0.0, arrival_wait_s), completed.cosines)


class PartsSeen:
    """The digests of the last ``PARTS_REMEMBERED`` PARTs each member sent this peer, by round."""

    def __init__(self) -> None:
        self.seen: dict[str, OrderedDict[bytes, str]] = {}  # member -> slice digest -> its round

    def replayed(self, sender: str, message: Message) -> bool:
        """Whether a PART's bytes are ones ``sender`` already sent this peer in another round: an
        honest outer gradient never repeats bit for bit (a re-sent copy is of the same round)."""
        if not isinstance(message, Part) or isinstance(message, Result):
            return False
        digest = hashlib.sha256(message.data).digest()[:16]
        seen = self.seen.setdefault(sender, OrderedDict())
        first = seen.setdefault(digest, message.round_id)
        seen.move_to_end(digest)
        if len(seen) > PARTS_REMEMBERED:
            seen.popitem(last=False)
        return first != message.round_id


def not_member_detail(key_id: str) -> str:
    """What a peer that is not a member of this run on our board is told."""
    if key_id == OPEN:
        return "you are not a peer of this run on my board (no record of yours with our options)"
    return f"this run requires its swarm key (key id {key_id}): pass --swarm-key-file"


def unopened_lie(me: str, sender: str, message: Message, may_be_earlier: bool) -> str:
    """Why a message for a round this peer never opened (so never joined: it joins only rounds it
    reached) is a lie, or "": a GROUP that names this peer, from the list's own leader
    (``group_claims.py``), unless an earlier process of this peer may have joined
    (``may_be_earlier``: it is taking the swarm's state, or promised to stay out of the round).
    The message is dropped either way."""
    if message.code != Code.GROUP:
        return ""
    claims = GroupClaims(me, partial(leader_rank, message.round_id))
    return claims.judge(sender, message, None, may_be_earlier=may_be_earlier).why


class FragmentExchange:
    """Serves and runs averaging rounds for one peer of one run."""

    def __init__(
        self,
        p2p: Any,
        run_id: str,
        codec: Codec,
        shard: int,
        fingerprint: str,
        board_view: Callable[[], dict[str, PeerRecord]],
        round_timeout_s: float,
        record_ttl_s: float = 8.0,
        link_mbps: float = SLOWEST_LINK_MBPS,
        round_bytes: int = 0,
        key_id: str = OPEN,
        max_frame: int = MAX_FRAME,
        limits: Limits | None = None,
        aggregation: Aggregation = MEAN,
        cosines: CosineRecord | None = None,
    ) -> None:
        self.p2p = p2p
        self.peer_id = p2p.peer_id.to_base58()
        self.protocol = f"p2p-cocodc/{run_id}/exchange/{EXCHANGE_PROTOCOL}"
        self.codec = codec
        self.aggregation = aggregation
        # the members' c_i at this peer's slices (a resumed peer's: as its checkpoint kept them)
        self.cosines = CosineRecord(aggregation.outlier_window) if cosines is None else cosines
        self.shard = shard
        self.fingerprint = fingerprint
        self.key_id = key_id  # the run's swarm key ("open": none): only its holders are peers of ours
        self.board_view = board_view
        self.round_timeout_s = round_timeout_s
        self.record_ttl_s = record_ttl_s
        self.link_mbps = link_mbps  # the run's declared link (--bandwidth-mbps)
        self.round_bytes = round_bytes  # what one peer sends in the largest round
        self.stats = ExchangeStats()
        self.link = LinkMeter()
        self.deadlines = self.current_deadlines()
        self.lanes = Lanes(p2p, self.protocol, self.stats, self.link, lambda: self.deadlines, self._codec_of)
        self.open: dict[str, RoundMachine] = {}
        self.finished: OrderedDict[str, RoundMachine] = OrderedDict()
        self.waiting: dict[str, asyncio.Future[Any]] = {}
        self.groups: dict[str, GroupRecord] = {}  # completed rounds, with their groups
        self.tasks: set[asyncio.Task[Any]] = set()
        self.view: dict[str, BoardPeer] = {}
        self.said_bye: set[str] = set()  # peers that told us they are leaving the run
        self.outliers: Counter[str] = Counter()  # members whose slices this peer left out of its mean
        self.strikes: Counter[str] = Counter()  # per-peer limits broken, by peer
        self.accused: Counter[str] = Counter()  # messages no honest peer sends (forged lists), by peer
        self.parts_seen = PartsSeen()  # to catch a slice replayed from an earlier round
        self.banned: set[str] = set()  # peers that broke them BAN_AFTER times: heard no more
        self.leaving = False  # this peer is leaving: it joins no new group
        self.joining = False  # this peer is taking the swarm's state: it joins no group of a round opened now
        self.opened_by: dict[str, set[str]] = {}  # peer -> rounds it opened here that we have not reached
        self.limiter = PeerLimiter(replace(limits or Limits(), buffered_bytes=2 * max_frame))
        self.max_frame = max_frame  # the largest message of this run
        self.promised: OrderedDict[str, bool] = OrderedDict()  # expired rounds we promised to stay out of
        self.ticker: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.view = self._board()
        await self.p2p.add_binary_stream_handler(self.protocol, self._serve)
        self.ticker = asyncio.create_task(self._tick())

    async def stop(self) -> None:
        """Stop serving once the rounds this peer took part in are settled and delivered, or after
        ``STOP_GRACE_S``: the other members still need our slices and acknowledgements."""
        grace_ends = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < grace_ends and (self.lanes.sending or self._owing()):
            await asyncio.sleep(0.05)
        if self.ticker is not None:
            self.ticker.cancel()
        for task in list(self.tasks):
            task.cancel()
        try:
            await self.p2p.remove_binary_stream_handler(self.protocol)
        except Exception:  # noqa: BLE001 - the daemon may already be gone at shutdown
            log.debug("could not remove the stream handler", exc_info=True)

    async def say_bye(self) -> None:
        """Tell every peer on the board that this one is leaving (the board says so too, but a
        record takes a heartbeat or more to reach every reader): new rounds form without it."""
        self.leaving = True
        for round_id, machine in list(self.open.items()):
            self._feed(round_id, machine, Leaving())
        sends = [asyncio.ensure_future(self.lanes.write(peer, [Bye("-")])) for peer in self._board()]
        if sends:
            await asyncio.wait(sends, timeout=MESSAGE_TIMEOUT_S / 10)

    def screening_memory(self) -> ScreeningMemory:
        """The members' earlier cosines at this peer's slices, as the rounds applied so far left them:
        what a round sent now is judged by (``Start.earlier``), whenever its messages come."""
        return dict(self.cosines.cosines)

    def applied(self, round_id: str) -> None:
        """A completed round is being applied: the cosines this peer measured at its slice join its
        screening memory (so a round's judgment never depends on which rounds happened to have
        landed by then: the simulator records them at the same step)."""
        cosines = self.groups[round_id].cosines
        self.cosines.add([p for p, _ in cosines], [c for _, c in cosines])

    def set_joining(self, joining: bool) -> None:
        """While taking the swarm's state, stay out of every round not reached (a state for it is yet
        to come) and forget the screening memory, as a restarted peer does (so does the replay)."""
        self.joining = joining
        if joining:
            self.cosines.cosines.clear()
        for machine in self.open.values():
            if joining and machine.phase == Phase.IDLE:
                machine.gave_round_up = True

    # ---- the facade ----

    async def allreduce(
        self,
        round_id: str,
        vector: torch.Tensor,
        step: int,
        take_part: bool = True,
        pace: int = 0,
        recent: tuple[int, int] = (0, 0),
        codec: Codec | None = None,
        earlier: ScreeningMemory | None = None,
    ) -> torch.Tensor:
        """The mean of ``vector`` over this round's group; a peer left out of the group, or whose
        all-reduce failed, gets the average another peer completed, bit for bit. ``pace``: the
        send-slot spacing this peer asks for (``paced_spacing``); the round's agreed pace is in
        ``groups[round_id]`` once it completed. ``recent``: (trained, window), the steps ``vector``
        covers (``inner_share.recent_steps``), which weighs it in the mean; ``codec``: its wire codec;
        ``earlier``: the screening memory at its send (``screening_memory``; None: as it is now, for a
        round that no other is in flight beside, as a gradient round).

        ``take_part=False``: this peer only wants the round's average (it joined the run after the
        round was sent, or is coming back to it): it promises to join no group of the round and asks
        the others for the average; ``vector`` only gives its size. A round this peer already
        started (before a resync) is waited on instead."""
        if round_id in self.waiting:
            raise RoundFailed(f"round {round_id} is already being run here")
        started = time.monotonic()
        machine = self._machine(round_id)
        outcome: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiting[round_id] = outcome
        try:
            if machine.phase == Phase.IDLE:
                if not take_part:
                    machine.observe()
                # a machine opened by another peer's message holds the board as of then, and a
                # tick may not have passed since: it must not lead with a view older than ours
                self._feed(round_id, machine, ViewChanged(self._board()))
                memory = self.screening_memory() if earlier is None else earlier
                self._feed(round_id, machine, Start(step, vector, pace, recent, codec, memory))
            elif take_part:
                raise RoundFailed(f"round {round_id} was already run here")
            result = machine.outcome if machine.outcome is not None else await outcome
        finally:
            self.waiting.pop(round_id, None)
        if isinstance(result, Completed):
            self.stats.record_round(result, started, machine.adopted_at, time.monotonic())
            if result.screened_out:
                self.outliers.update(result.screened_out)
                log.warning(
                    "round %s: left %s out of my slice's mean: their outer gradients are outliers (norm or "
                    "direction far from the others')",
                    round_id,
                    ", ".join(p[:12] for p in result.screened_out),
                )
            self.groups[round_id] = GroupRecord.of(result, arrival_wait_s=machine.adopted_at - started)
            if len(self.groups) > MAX_FINISHED:
                del self.groups[next(iter(self.groups))]
            return result.average
        self.stats.rounds_failed += 1
        if isinstance(result, Undecided):
            raise RoundUndecided(result.reason)
        if isinstance(result, Lost):
            raise RoundLost(result.reason)
        assert isinstance(result, Failed)
        raise RoundFailed(result.reason)

    # ---- driving machines ----

    def current_deadlines(self) -> Deadlines:
        """The deadlines of a round opened now. Transfers are allowed time at the slowest of the
        run's declared link (--bandwidth-mbps), the send rate measured so far on bulk messages and
        ``SLOWEST_LINK_MBPS``, never below ``MIN_LINK_MBPS``. A member's small answers share its
        connections with its fragment data and may wait behind two rounds of it (a sync in flight
        overlaps the next), so ``answer_s`` has that transfer time on top."""
        measured = self.stats.bandwidth_mbps or math.inf
        link = max(MIN_LINK_MBPS, min(self.link_mbps, measured, SLOWEST_LINK_MBPS))
        queued_s = 8.0 * 2 * self.round_bytes / (link * 1e6)
        return Deadlines(
            round_s=self.round_timeout_s,
            answer_s=max(2 * self.record_ttl_s, self.round_timeout_s / 4) + queued_s,
            heard_s=self.record_ttl_s,
            slowest_link_mbps=link,
        )

    def carrying(self) -> bool:
        """Whether a round's slices are on this peer's link: a butterfly, or a delivery not ACKed."""
        return self.lanes.awaiting() or any(m.phase == Phase.RUNNING for m in self.open.values())

    def _codec_of(self, round_id: str) -> str:
        return (self.open.get(round_id) or self.finished.get(round_id) or self).codec.name

    def _board(self) -> dict[str, BoardPeer]:
        return {
            peer: BoardPeer(
                record.step,
                record.step_time_s,
                leaving=record.state == "leaving" or peer in self.said_bye,
                done=record.state == "done",
            )
            for peer, record in self.board_view().items()
            if record.state in ("training", "leaving", "done")
            and self._same_run(record)
            and peer != self.peer_id
            and peer not in self.banned
        }

    def _same_run(self, record: PeerRecord) -> bool:
        return record.fingerprint == self.fingerprint and record.key_id == self.key_id

    def is_member(self, peer: str) -> bool:
        """Whether ``peer`` has a record of this run on our board, in any state (a joiner fetching
        averages says "joining"). The DHT stores and returns a record only with its writer's
        signature, and with a membership proof when the run has a swarm key (``swarm/trust.py``):
        this is the one admission check of the exchange. A member that broke the per-peer limits
        ``BAN_AFTER`` times is banned: heard no more, and no longer a peer of any round here."""
        record = self.board_view().get(peer)
        return record is not None and self._same_run(record) and peer not in self.banned

    def _machine(self, round_id: str) -> RoundMachine:
        machine = self.open.get(round_id) or self.finished.get(round_id)
        if machine is None:
            self.deadlines = self.current_deadlines()
            # as the board is now, not at the last tick; the tick still compares with the view the
            # other machines have, so they learn of the change too
            machine = RoundMachine(
                self.peer_id,
                round_id,
                self.shard,
                self.fingerprint,
                self.codec,
                self.deadlines,
                self._board(),
                time.monotonic(),
                self.aggregation,
            )
            machine.gave_round_up = round_id in self.promised or self.leaving or self.joining
            self.open[round_id] = machine
        return machine

    def _owing(self) -> list[str]:
        """Rounds this peer reached that are not settled, or whose results are not yet delivered."""
        now = time.monotonic()
        return [r for r, m in self.open.items() if m.phase != Phase.IDLE and not m.quiescent(now)]

    def _not_reached(self) -> list[str]:
        """Open rounds other peers opened here that this peer has not reached."""
        return [r for r, m in self.open.items() if m.phase == Phase.IDLE]

    def _feed(self, round_id: str, machine: RoundMachine, event: Event) -> None:
        deliveries: dict[tuple[str, Code], list[Message]] = {}  # the pieces for one peer: one stream
        for effect in machine.handle(event, time.monotonic()):
            if isinstance(effect, Send) and effect.message.code in (Code.PART, Code.RESULT):
                deliveries.setdefault((effect.to, effect.message.code), []).append(effect.message)
            elif isinstance(effect, Send):
                self.lanes.send(effect.to, [effect.message])
            elif isinstance(effect, Compute):
                self._spawn(self._compute(round_id, machine, effect))
            elif isinstance(effect, Settle):
                waiter = self.waiting.get(round_id)
                if waiter is not None and not waiter.done():
                    waiter.set_result(effect.outcome)
            elif isinstance(effect, Note):
                log.info("%s", effect.text)
            elif isinstance(effect, Accuse):
                self._accuse(round_id, effect.peer, effect.why)
        for (to, _), messages in deliveries.items():
            self.lanes.send(to, messages)
        if round_id in self.open and machine.quiescent(time.monotonic()):
            self._finish(round_id, machine)

    def _finish(self, round_id: str, machine: RoundMachine) -> None:
        del self.open[round_id]
        self.lanes.forget(round_id)
        not_reached = set(self._not_reached())
        for peer in [p for p, rounds in self.opened_by.items() if not rounds & not_reached]:
            del self.opened_by[peer]
        self.finished[round_id] = machine
        if len(self.finished) > MAX_FINISHED:
            self.finished.popitem(last=False)
        if len(self.finished) > MAX_SERVED:
            old = list(self.finished.values())[-MAX_SERVED - 1]
            old.forget_average()

    async def _compute(self, round_id: str, machine: RoundMachine, effect: Compute) -> None:
        result = await asyncio.to_thread(run_job, effect.job, machine.codec)
        self._feed(round_id, machine, result)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            view = self._board()
            changed = view != self.view
            self.view = view
            now = time.monotonic()
            for round_id in self._not_reached():  # never reached here: a stray, or long over
                machine = self.open[round_id]
                if now - machine.created_at > self.deadlines.idle_expiry_s():
                    del self.open[round_id]
                    if machine.gave_round_up:  # the promise outlives the machine
                        self.promised[round_id] = True
                        if len(self.promised) > MAX_FINISHED:
                            self.promised.popitem(last=False)
            for round_id, machine in list(self.open.items()):
                if changed:
                    self._feed(round_id, machine, ViewChanged(view))
                self._feed(round_id, machine, Tick())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # ---- the wire (sending: ``swarm/lanes.py``) ----

    async def _serve(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One stream: a message, or up to ``MAX_PIECES`` of them (``swarm/lanes.py``), each admitted
        within the per-peer limits and fed to its round's machine as soon as it is read."""
        sender = info.peer_id.to_base58()  # authenticated by libp2p; never taken from the payload
        try:
            for n in range(MAX_PIECES + 1):  # the last: the end of the stream, or one frame too many
                why = self.limiter.admit(sender, time.monotonic())
                if why is not None:
                    self.stats.messages_received += 1
                    self._note_refusal(sender, why, strike=True)
                    return
                message = await self._read(sender, reader, first=n == 0)
                if message is None:
                    return
                if n == MAX_PIECES:
                    self._note_refusal(sender, f"more than {MAX_PIECES} messages on one stream", strike=True)
                    return
                self.receive(sender, message)
        finally:
            writer.close()

    async def _read(self, sender: str, reader: asyncio.StreamReader, first: bool) -> Message | None:
        """The next message of a stream (admitted: released here), or None at its end or a bad one."""
        reserved = 0

        def reserve(size: int) -> None:
            nonlocal reserved
            if (over := self.limiter.reserve(sender, size)) is not None:
                self._note_refusal(sender, over, strike=True)
                raise BadMessage(over)
            reserved = size

        link = self.current_deadlines().slowest_link_mbps  # measured or declared: a slow one's time
        ended = False
        try:
            frame = await read_next_frame(reader, MESSAGE_TIMEOUT_S, self.max_frame, reserve, link)
            if frame is None and first:
                raise BadMessage("stream closed in the middle of a message")
            ended = frame is None
            return None if frame is None else parse_message(frame)
        except BadMessage as exc:
            log.warning("bad message from %s: %s", sender[:12], exc)
            self.stats.messages_rejected += 1
            return None
        finally:
            self.stats.messages_received += not ended
            self.limiter.done(sender, reserved)

    def receive(self, sender: str, message: Message) -> None:
        """Feed one message to its round's machine. Only a peer of this run on our board is heard
        (``is_member``), and a round is opened on its word only within ``limits``."""
        if not self.is_member(sender):
            self._note_refusal(sender, "not a member of this run on my board")
            if not isinstance(message, StatusReply | Ack | Bye) and self.limiter.refused[sender] <= 3:
                self._refuse(sender, message.round_id, not_member_detail(self.key_id))
            return
        if isinstance(message, Bye):  # not about a round: every open round learns it at once
            if sender not in self.said_bye and sender in self._board():
                self.said_bye.add(sender)
                self.view = self._board()
                for round_id, machine in list(self.open.items()):
                    self._feed(round_id, machine, ViewChanged(self.view))
            return
        self.stats.bytes_received += payload_bytes(message)
        round_id = message.round_id
        if isinstance(message, Ack):
            self.lanes.acknowledged(sender, round_id, int(message.kind), message.index)
        if round_id not in self.open and round_id not in self.finished:
            if message.code not in OPENING:  # an answer or a delivery for a round we never asked about
                earlier = self.joining or round_id in self.promised
                if why := unopened_lie(self.peer_id, sender, message, earlier):
                    self._accuse(round_id, sender, why)
                return
            if len(self._not_reached()) >= MAX_OPEN_ROUNDS:
                self._refuse(sender, round_id, f"{MAX_OPEN_ROUNDS} rounds opened by others are open here")
                return
            opened = self.opened_by.setdefault(sender, set())
            opened &= set(self._not_reached())
            if len(opened) >= self.limiter.limits.open_rounds:
                self._note_refusal(
                    sender, f"more than {self.limiter.limits.open_rounds} open rounds", strike=True
                )
                self._refuse(sender, round_id, "too many rounds opened here that this peer has not reached")
                return
            opened.add(round_id)
        replayed = self.parts_seen.replayed(sender, message)
        self._feed(round_id, self._machine(round_id), Received(sender, message, replayed))

    def _accuse(self, round_id: str, peer: str, why: str) -> None:
        self.accused[peer] += 1
        log.warning("round %s: %s sent %s", round_id, peer[:12], why)

    def _note_refusal(self, sender: str, why: str, strike: bool = False) -> None:
        """Count a refusal (and log some); a ``strike`` broke a per-peer limit: enough of them, and a
        member is banned for the rest of the run."""
        if self.limiter.refuse(sender):
            log.warning(
                "refusing messages from %s: %s (%d so far)", sender[:12], why, self.limiter.refused[sender]
            )
        if strike:
            self.strikes[sender] += 1
            if self.strikes[sender] == BAN_AFTER:
                self.banned.add(sender)
                log.warning(
                    "banning %s from this peer's rounds: it broke the per-peer limits %d times (%s)",
                    sender[:12],
                    BAN_AFTER,
                    why,
                )
                self.view = self._board()
                for round_id, machine in list(self.open.items()):
                    self._feed(round_id, machine, ViewChanged(self.view))

    def _refuse(self, to: str, round_id: str, why: str) -> None:
        log.info("refusing round %s from %s: %s", round_id, to[:12], why)
        self.lanes.send(to, [StatusReply(round_id, Status.REFUSED, why)])
