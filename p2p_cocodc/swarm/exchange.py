"""The fragment exchange: one averaging round of a flat fp32 vector among the live peers of a run.

A round (say fragment 2 sent after inner step 96, id ``f2:96``) runs in two phases, all over
streams of hivemind's libp2p daemon (``dht.replicate_p2p()``), never sockets of our own:

1. **Group.** Every peer sends ``join`` to the round's leader: the smallest id among the peers it
   knows to be live (the notice board, plus any peer that has messaged it about the round). The
   leader waits until every live peer has joined, or until a deadline derived from their published
   step and step time, then answers every joiner with the same ordered member list (by data shard,
   the simulator's worker order). A peer that misses the deadline is left out of that round.
   Views of the board differ for a few seconds when a peer dies, so two peers may both start to
   lead: a leader yields as soon as it learns of a smaller live id, and ``probe``s a peer that does
   not join in time; any peer that already holds the round's member list answers a join or probe
   with it, and the asker adopts that list. So one group forms per round, not two that both finish.
2. **Butterfly all-reduce.** The vector is cut into one slice per member, on codec block edges.
   Each member sends slice j, encoded with the run's codec, to member j; member j averages the
   slices it received in member order (the simulator's order, so fp32 results are bit-equal to it),
   encodes the mean and sends it to every member. Everyone decodes the same bytes, so every peer
   ends the round with a bit-identical average, and each link carries 2(M−1)/M of the vector.
   Deliveries carry a tag of their member list, so a slice meant for another group is never used.

3. **Recovery.** A peer whose all-reduce fails (a member died or went silent, a payload was bad)
   asks the other members for the round's average before it gives up: if any member completed the
   round (an owner died after sending its averaged slice to only some members), every live member
   ends with that same average. A peer left out by the leader catches up the same way. A peer asked
   for an average it does not have yet answers once its own round has settled, and no longer waits
   for the asker to join. Only when no member completed does the round fail, and then it fails for
   every member alike.

Every wait has a deadline; a round that cannot complete raises ``RoundFailed`` on its own, and the
peer decides what to do. Received payloads are decoded in one place, ``_decode``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from p2p_cocodc.codecs import Codec, get_codec, mean_in_order
from p2p_cocodc.errors import UserError
from p2p_cocodc.swarm.records import PeerRecord
from p2p_cocodc.swarm.wire import (
    BadMessage,
    Request,
    parse_members,
    parse_request,
    read_frame,
    transfer_allowance_s,
    write_frame,
)

log = logging.getLogger(__name__)

MAX_OPEN_ROUNDS = 256  # rounds other peers may open here before this peer reaches them
MESSAGE_TIMEOUT_S = 30.0  # one message (not a whole round) must arrive within this
RETRY_PAUSE_S = 0.2
PROBE_EVERY_S = 2.0  # a leader asks a peer that should have joined by now at most this often
MAX_FINISHED = 4096  # finished round ids remembered, to answer late deliveries
MAX_SERVED = 64  # recent averages kept for peers left out of their round or failed in it
STOP_GRACE_S = 5.0  # how long stop() lets answers in progress finish
EXACT = get_codec("fp32")  # averages served to another member (fetch): bit-exact

Members = list[tuple[str, int]]  # (peer id, data shard), in member order


class RoundFailed(Exception):
    """This round could not complete on this peer; the reason says why."""


def group_tag(members: Members) -> str:
    """A short name for one member list: deliveries carry it, so none is used in another group."""
    text = "|".join(f"{peer}:{shard}" for peer, shard in members)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class RoundState:
    """What has arrived for one round; handlers fill it, the round's own task consumes it."""

    joins: dict[str, int] = field(default_factory=dict)  # while leading: peer id -> shard
    members: asyncio.Future[Members] = field(  # the round's group, once known here
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    heard: set[str] = field(default_factory=set)  # peers that messaged us about this round: live
    gave_up: set[str] = field(default_factory=set)  # peers that asked for the average: won't join
    parts: dict[str, tuple[str, int, int, bytes]] = field(default_factory=dict)  # sender -> delivery
    results: dict[str, tuple[str, int, int, bytes]] = field(default_factory=dict)
    outcome: asyncio.Future[torch.Tensor | None] = field(  # the average here; None if the round failed
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    recovering: bool = False  # we have no average to serve yet, and are asking for one
    failed_at: str | None = None  # a live peer that has already failed the round (found by a probe)

    def settled(self) -> bool:
        """Whether this peer can say what it got from the round: an average, or nothing."""
        return self.outcome.done() or self.recovering

    def notify(self) -> None:
        self.changed.set()

    def learn_members(self, members: Members) -> None:
        """Fix the round's group here (first list wins: a peer takes part in one group per round)."""
        if not self.members.done():
            self.members.set_result(members)
            self.notify()

    async def wait_until(
        self,
        ready: Callable[[], bool],
        deadline: float,
        what: str,
        hopeless: Callable[[], str | None] = lambda: None,
    ) -> None:
        """Wait for ``ready``; fail at the deadline, or as soon as ``hopeless`` names a reason."""
        while not ready():
            if time.monotonic() >= deadline:
                raise RoundFailed(f"timed out waiting for {what}")
            if reason := hopeless():
                raise RoundFailed(f"{reason} while waiting for {what}")
            await self.pause(deadline)

    async def pause(self, deadline: float) -> None:
        """Sleep until something arrives for the round: at most 0.5 s, and never past ``deadline``."""
        self.changed.clear()
        try:
            await asyncio.wait_for(self.changed.wait(), max(0.0, min(deadline - time.monotonic(), 0.5)))
        except TimeoutError:
            pass


def slice_bounds(numel: int, parts: int, block: int) -> list[int]:
    """Element offsets cutting ``numel`` values into ``parts`` slices on multiples of ``block``."""
    blocks = -(-numel // block)
    return [min(numel, block * (blocks * i // parts)) for i in range(parts + 1)]


@dataclass
class ExchangeStats:
    bytes_sent: int = 0
    rounds_done: int = 0
    rounds_failed: int = 0
    bandwidth_mbps: float = 0.0  # moving average of measured send throughput

    def record_send(self, num_bytes: int, seconds: float) -> None:
        self.bytes_sent += num_bytes
        if num_bytes >= 64 * 1024 and seconds > 0:
            mbps = 8e-6 * num_bytes / seconds
            self.bandwidth_mbps = mbps if not self.bandwidth_mbps else 0.8 * self.bandwidth_mbps + 0.2 * mbps


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
    ) -> None:
        self.p2p = p2p
        self.peer_id = p2p.peer_id.to_base58()
        self.protocol = f"p2p-cocodc/{run_id}/exchange/1"
        self.codec = codec
        self.shard = shard
        self.fingerprint = fingerprint
        self.board_view = board_view
        self.round_timeout_s = round_timeout_s
        self.rounds: dict[str, RoundState] = {}
        self.finished: dict[str, bool] = {}  # recent rounds, oldest first: did each complete here?
        self.served: dict[str, tuple[Members, torch.Tensor]] = {}  # members, average
        self.stats = ExchangeStats()
        self.serving: set[asyncio.Task[Any]] = set()  # answers being written to other peers

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.protocol, self._serve)

    async def stop(self) -> None:
        """Stop serving, once the answers being written have gone out: the last peer to finish a
        round must still get our reply to its last delivery."""
        if self.serving:
            await asyncio.wait(self.serving, timeout=STOP_GRACE_S)
        try:
            await self.p2p.remove_binary_stream_handler(self.protocol)
        except Exception:  # noqa: BLE001 - the daemon may already be gone at shutdown
            log.debug("could not remove the stream handler", exc_info=True)

    # ---- running a round ----

    async def allreduce(self, round_id: str, vector: torch.Tensor, step: int) -> torch.Tensor:
        """The mean of ``vector`` over this round's members. A peer the leader left out (it came
        after the deadline), or whose own all-reduce failed, gets the mean a member completed
        instead, so its θ̄ stays the same as theirs."""
        state = self._round(round_id)
        averaged = None
        try:
            members = await self._form_group(round_id, state, step)
            log.info("round %s: group %s", round_id, [f"{p[:12]}:{s}" for p, s in members])
            if self.peer_id not in [p for p, _ in members]:
                why = "not in the round's group (too late for its leader, or the group formed without us)"
                averaged = await self._recover(round_id, state, members, vector.numel(), why)
            else:
                try:
                    averaged = await self._butterfly(round_id, state, members, vector)
                except RoundFailed as exc:
                    averaged = await self._recover(round_id, state, members, vector.numel(), str(exc))
            self.served[round_id] = (members, averaged)
            if len(self.served) > MAX_SERVED:
                del self.served[next(iter(self.served))]
        except RoundFailed:
            self.stats.rounds_failed += 1
            raise
        finally:
            if not state.outcome.done():
                state.outcome.set_result(averaged)
                state.notify()
            self.rounds.pop(round_id, None)
            self.finished[round_id] = averaged is not None
            if len(self.finished) > MAX_FINISHED:
                del self.finished[next(iter(self.finished))]
        self.stats.rounds_done += 1
        return averaged

    async def _recover(
        self, round_id: str, state: RoundState, members: Members, numel: int, why: str
    ) -> torch.Tensor:
        """The mean a member completed, from whichever member answers first (asked all at once: some
        may have finished and left, some may have failed too). Meanwhile this peer tells those who
        ask it that it has none, so two recovering peers never wait on each other."""
        state.recovering = True
        state.notify()
        log.warning("round %s: %s; asking its members for their average", round_id, why)

        async def ask(peer: str) -> torch.Tensor:
            request = Request("fetch", round_id)
            reply = await self._call(peer, request, self._fetch_wait_s() + MESSAGE_TIMEOUT_S)
            if not (reply.get("ok") and reply.get("numel") == numel and isinstance(reply.get("data"), bytes)):
                raise ConnectionError(f"{peer[:12]} has no average: {reply.get('error', 'bad reply')}")
            try:
                return EXACT.decode(reply["data"], numel)
            except UserError as exc:
                raise ConnectionError(f"{peer[:12]} served a bad average: {exc}") from None

        asks = [asyncio.ensure_future(ask(peer)) for peer, _ in members if peer != self.peer_id]
        try:
            for next_answer in asyncio.as_completed(asks):
                try:
                    return await next_answer
                except ConnectionError as exc:
                    log.info("cannot fetch round %s: %s", round_id, exc)
        finally:
            for task in asks:
                task.cancel()
        raise RoundFailed(f"{why}, and no member completed the round")

    def _fetch_wait_s(self) -> float:
        """How long a peer asked for an average it does not have yet waits for its own round to
        settle: the whole life of a round here (forming, all-reduce, recovery), not one step of it."""
        return self.round_timeout_s * 3

    def _has_finished(self, peer: str) -> bool:
        """A peer says "done" only once all its rounds are complete (see the peer's shutdown)."""
        record = self.board_view().get(peer)
        return record is not None and record.state == "done"

    def _left_swarm(self, peers: list[str]) -> str | None:
        """Why waiting on ``peers`` is hopeless: one has dropped off the notice board (its record
        expired: it died or lost the network), so the round's deadline need not run out."""
        view = self.board_view()
        gone = [p for p in peers if p != self.peer_id and p not in view]
        return f"member {gone[0][:12]} left the swarm" if gone else None

    def _live_training(self) -> dict[str, PeerRecord]:
        view = self.board_view()
        return {p: r for p, r in view.items() if r.state == "training" and r.fingerprint == self.fingerprint}

    def _leader(self, state: RoundState) -> str:
        """The smallest id this peer knows to be live for the round, and not recovering from it:
        views of the board lag a few seconds behind each other, and a peer that messaged us about
        the round is live whatever our view says, so every peer's choice converges on the same one."""
        return min((set(self._live_training()) | state.heard | {self.peer_id}) - state.gave_up)

    async def _form_group(self, round_id: str, state: RoundState, step: int) -> Members:
        give_up = time.monotonic() + self.round_timeout_s * 4 + self._arrival_eta(step) * 2
        while not state.members.done():
            if time.monotonic() > give_up:
                raise RoundFailed("the peers did not settle on a leader for the round")
            leader = self._leader(state)
            if leader == self.peer_id:
                await self._lead(round_id, state, step)  # returns when the group is known or on a yield
                continue
            reply = await self._join_via(leader, round_id, state)
            if reply is None:  # it left, or a smaller live id turned up: choose again
                await asyncio.sleep(RETRY_PAUSE_S)
                continue
            if "redirect" in reply:  # it knows a smaller live id than this peer does
                target = reply["redirect"]
                if not isinstance(target, str) or not 0 < len(target) <= 128:
                    raise RoundFailed(f"leader {leader[:12]} sent a bad redirect")
                if target != self.peer_id:
                    state.heard.add(target)
                if self._leader(state) == leader:  # views still disagree: do not spin
                    await asyncio.sleep(RETRY_PAUSE_S)
                continue
            if not reply.get("ok"):
                raise RoundFailed(f"leader {leader[:12]} refused: {reply.get('error', '?')}")
            try:
                state.learn_members(parse_members(reply))
            except BadMessage as exc:
                raise RoundFailed(f"leader {leader[:12]} sent a bad member list: {exc}") from None
        return state.members.result()

    async def _join_via(self, leader: str, round_id: str, state: RoundState) -> dict[str, Any] | None:
        """Ask ``leader`` for the round's members; None once it is no longer this peer's choice of
        leader (it left the board, or a smaller live id turned up).

        A join is idempotent, so a broken stream is retried while the leader is on the board."""
        request = Request("join", round_id, shard=self.shard, fingerprint=self.fingerprint)
        give_up = time.monotonic() + self.round_timeout_s * 4
        state.heard.add(leader)  # a record missing from one board read must not end a live join
        retrying = False
        while True:
            call = asyncio.ensure_future(self._call(leader, request, self.round_timeout_s * 4))
            try:
                while not call.done():
                    await asyncio.wait({call}, timeout=0.5)
                    if not call.done() and self._leader(state) != leader:
                        call.cancel()
                        return None
                return call.result()
            except ConnectionError as exc:
                if leader not in self._live_training():
                    state.heard.discard(leader)  # unreachable and off the board: gone
                    return None
                if time.monotonic() > give_up:
                    raise RoundFailed(f"leader {leader[:12]} is live but does not answer: {exc}") from None
                if not retrying:
                    log.info("join via %s failed (%s); retrying while it is on the board", leader[:12], exc)
                retrying = True
                await asyncio.sleep(RETRY_PAUSE_S)

    async def _lead(self, round_id: str, state: RoundState, step: int) -> None:
        """Wait for the expected peers to join, then publish the ordered member list; stop early
        when a smaller live id turns up (yield to it) or another peer's list is adopted. Peers that
        should have joined by now, and peers that sent us slices, are probed: they may already
        hold the round's group, or lead it themselves without seeing us."""
        state.joins[self.peer_id] = self.shard
        deadline = time.monotonic() + self._arrival_eta(step) * 2 + self.round_timeout_s
        probes: dict[str, asyncio.Task[None]] = {}
        last_probe: dict[str, float] = {}

        def missing() -> set[str]:
            return set(self._live_training()) - state.gave_up - set(state.joins)

        def decided() -> bool:
            yielded = self._leader(state) != self.peer_id
            return state.members.done() or yielded or state.failed_at is not None or not missing()

        def probe_overdue() -> None:
            view, now = self._live_training(), time.monotonic()
            senders = (set(state.parts) | set(state.results)) - set(state.joins)
            due = {p for p in missing() if view[p].step >= step} | senders
            for peer in due:
                if peer not in probes and now - last_probe.get(peer, -PROBE_EVERY_S) >= PROBE_EVERY_S:
                    last_probe[peer] = now
                    probes[peer] = asyncio.ensure_future(self._probe(peer, round_id, state))
                    probes[peer].add_done_callback(lambda _, peer=peer: probes.pop(peer, None))

        try:
            while not decided() and time.monotonic() < deadline:
                probe_overdue()
                await state.pause(deadline)
            if not decided():  # deadline: last, ask every missing peer once before forming without it
                await asyncio.gather(*(self._probe(p, round_id, state) for p in missing()))
        finally:
            for task in list(probes.values()):
                task.cancel()
        if state.members.done():
            return
        if state.failed_at is not None:
            raise RoundFailed(f"peer {state.failed_at[:12]} already failed the round")
        if self._leader(state) != self.peer_id:
            log.info("round %s: yielding the lead to %s", round_id, self._leader(state)[:12])
            state.joins = {}  # our joiners are sent to the new leader (see _dispatch)
            state.notify()
            return
        if left_out := missing():
            log.warning("round forms without %s (not at the step in time)", [m[:12] for m in left_out])
        state.learn_members(sorted(state.joins.items(), key=lambda item: (item[1], item[0])))

    async def _probe(self, peer: str, round_id: str, state: RoundState) -> None:
        """Ask ``peer`` what it knows of the round: its member list (adopted here), or who it takes
        for the leader (a smaller id than ours is live: we yield to it)."""
        request = Request("probe", round_id, shard=self.shard, fingerprint=self.fingerprint)
        try:
            reply = await self._call(peer, request)
        except ConnectionError as exc:
            log.info("probe of %s failed: %s", peer[:12], exc)
            return
        if reply.get("ok") and "members" in reply:
            try:
                state.learn_members(parse_members(reply))
            except BadMessage as exc:
                log.warning("peer %s answered a probe with a bad member list: %s", peer[:12], exc)
        elif isinstance(reply.get("leader"), str) and reply["leader"] != self.peer_id:
            state.heard.add(reply["leader"])
            state.notify()
        elif reply.get("failed") is True:  # it will never apply the round: nobody else may either
            state.failed_at = peer
            state.notify()

    def _arrival_eta(self, step: int) -> float:
        """Seconds until the slowest live peer reaches ``step``, from the board."""
        etas = [max(step - r.step, 0) * r.step_time_s for r in self._live_training().values()]
        return max(etas, default=0.0)

    async def _butterfly(
        self, round_id: str, state: RoundState, members: Members, vector: torch.Tensor
    ) -> torch.Tensor:
        peers = [p for p, _ in members]
        group = group_tag(members)
        me = peers.index(self.peer_id)
        numel = vector.numel()
        bounds = slice_bounds(numel, len(peers), self.codec.block)
        sizes = [bounds[j + 1] - bounds[j] for j in range(len(peers))]
        encoded = await asyncio.to_thread(
            lambda: [self.codec.encode(vector[bounds[j] : bounds[j + 1]]) for j in range(len(peers))]
        )
        # --round-timeout on top of two transfers of the whole encoded vector over a slow link
        wire = sum(len(e) for e in encoded)
        deadline = time.monotonic() + self.round_timeout_s + 2 * transfer_allowance_s(wire)
        state.parts[self.peer_id] = (group, me, sizes[me], encoded[me])
        others = [j for j in range(len(peers)) if j != me]
        await self._send_all(
            round_id, "part", group, {peers[j]: (j, sizes[j], encoded[j]) for j in others}, deadline
        )
        parts = await self._wait_for_all(state, state.parts, group, peers, deadline, "every member's slice")

        def average_own_slice() -> bytes:
            received = [self._decode(parts, p, group, me, sizes[me]) for p in peers]
            return self.codec.encode(mean_in_order(received))

        mean_bytes = await asyncio.to_thread(average_own_slice)
        state.results[self.peer_id] = (group, me, sizes[me], mean_bytes)
        await self._send_all(
            round_id, "result", group, {peers[j]: (me, sizes[me], mean_bytes) for j in others}, deadline
        )
        results = await self._wait_for_all(state, state.results, group, peers, deadline, "averaged slices")
        return await asyncio.to_thread(
            lambda: torch.cat([self._decode(results, p, group, j, sizes[j]) for j, p in enumerate(peers)])
        )

    async def _wait_for_all(
        self,
        state: RoundState,
        box: dict[str, tuple[str, int, int, bytes]],
        group: str,
        peers: list[str],
        deadline: float,
        what: str,
    ) -> dict[str, tuple[str, int, int, bytes]]:
        """Every member's delivery for this group, once all are in ``box`` (a copy, for decoding
        off the event loop); fail early once a missing member has left the swarm."""

        def missing() -> list[str]:
            return [p for p in peers if p not in box or box[p][0] != group]

        await state.wait_until(lambda: not missing(), deadline, what, lambda: self._left_swarm(missing()))
        return {p: box[p] for p in peers}

    def _decode(
        self, box: dict[str, tuple[str, int, int, bytes]], sender: str, group: str, index: int, numel: int
    ) -> torch.Tensor:
        """The one place received payloads are checked: right group and slice, right size, finite."""
        got_group, got_index, got_numel, data = box[sender]
        if got_group != group:
            raise RoundFailed(f"peer {sender[:12]} sent a slice for another group of the round")
        if got_index != index or got_numel != numel:
            raise RoundFailed(
                f"peer {sender[:12]} sent slice {got_index} of {got_numel} values, expected slice "
                f"{index} of {numel}"
            )
        try:
            return self.codec.decode(data, numel)
        except UserError as exc:
            raise RoundFailed(f"peer {sender[:12]} sent a bad payload: {exc}") from None

    async def _send_all(
        self, round_id: str, kind: str, group: str, slices: dict[str, tuple[int, int, bytes]], deadline: float
    ) -> None:
        """Deliver slices to their peers. A delivery is idempotent, so a broken stream is retried
        until the round's deadline (streams do break now and then on a loaded host)."""

        async def send(peer: str, index: int, numel: int, data: bytes) -> None:
            request = Request(kind, round_id, group=group, slice_index=index, numel=numel, data=data)
            while True:
                started = time.perf_counter()
                try:
                    reply = await self._call(peer, request)
                    break
                except ConnectionError as exc:
                    if self._has_finished(peer):
                        return  # it said "done" after its last round: it had everything it needed
                    if reason := self._left_swarm([peer]):
                        raise RoundFailed(f"{reason}: {exc}") from None
                    if time.monotonic() + RETRY_PAUSE_S >= deadline:
                        raise RoundFailed(f"a member is unreachable: {exc}") from None
                    log.info("retrying %s: %s", kind, exc)
                    await asyncio.sleep(RETRY_PAUSE_S)
            if not reply.get("ok"):
                raise RoundFailed(f"peer {peer[:12]} refused our {kind}: {reply.get('error', '?')}")
            self.stats.record_send(len(data), time.perf_counter() - started)

        results = await asyncio.gather(
            *(send(p, *item) for p, item in slices.items()), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _call(self, peer: str, request: Request, timeout: float = MESSAGE_TIMEOUT_S) -> dict[str, Any]:
        """One request and its reply; every failure of the transport becomes ConnectionError."""
        from hivemind.p2p import PeerID

        writer = None
        try:
            _, reader, writer = await asyncio.wait_for(
                self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), self.protocol),
                MESSAGE_TIMEOUT_S,
            )
            sending = MESSAGE_TIMEOUT_S + transfer_allowance_s(len(request.data))
            await asyncio.wait_for(write_frame(writer, request.to_wire()), sending)
            return await read_frame(reader, timeout)
        except (BadMessage, OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            raise ConnectionError(f"{request.kind} to {peer[:12]}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - p2pd client errors have no common base
            raise ConnectionError(f"{request.kind} to {peer[:12]}: {type(exc).__name__}: {exc}") from None
        finally:
            if writer is not None:
                writer.close()

    # ---- serving other peers ----

    def _round(self, round_id: str) -> RoundState:
        state = self.rounds.get(round_id)
        if state is None:
            if len(self.rounds) >= MAX_OPEN_ROUNDS:
                raise BadMessage("too many open rounds")
            state = self.rounds[round_id] = RoundState()
        return state

    async def _serve(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.serving.add(task)
        try:
            await self._answer(info, reader, writer)
        finally:
            self.serving.discard(task)

    async def _answer(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sender = info.peer_id.to_base58()  # authenticated by libp2p; never taken from the payload
        hang_up = None
        try:
            request = parse_request(await read_frame(reader, MESSAGE_TIMEOUT_S))
            # the asker sends nothing more: the stream ending means it stopped waiting for us
            hang_up = asyncio.ensure_future(reader.read(1))
            reply = await self._dispatch(sender, request, hang_up)
        except BadMessage as exc:
            log.warning("bad message from %s: %s", sender[:12], exc)
            reply = {"ok": False, "error": str(exc)}
        finally:
            if hang_up is not None:
                hang_up.cancel()
        try:
            sending = MESSAGE_TIMEOUT_S + transfer_allowance_s(len(reply.get("data", b"")))
            await asyncio.wait_for(write_frame(writer, reply), sending)
        except (OSError, TimeoutError):
            log.debug("could not answer %s", sender[:12])
        finally:
            writer.close()

    async def _serve_average(self, sender: str, round_id: str) -> dict[str, Any]:
        """A round's average for a peer that was left out of it or failed in it, once this peer has
        it. The asker will not join the round any more, so a leader here stops waiting for it; a
        peer that is itself recovering says so at once, so two of them never wait on each other."""
        if round_id not in self.served:
            if round_id in self.finished:
                return {"ok": False, "error": f"round {round_id} failed here"}
            state = self._round(round_id)
            state.gave_up.add(sender)
            state.notify()
            try:
                await state.wait_until(state.settled, time.monotonic() + self._fetch_wait_s(), "the round")
            except RoundFailed:
                return {"ok": False, "error": f"round {round_id} is still running here"}
            if round_id not in self.served:
                return {"ok": False, "error": f"round {round_id} failed here"}
        average = self.served[round_id][1]
        return {"ok": True, "numel": average.numel(), "data": EXACT.encode(average)}

    async def _dispatch(
        self, sender: str, request: Request, hang_up: asyncio.Future[bytes]
    ) -> dict[str, Any]:
        if request.kind == "fetch":
            return await self._serve_average(sender, request.round_id)
        if request.round_id in self.finished:
            return self._answer_finished(request)
        state = self._round(request.round_id)
        state.heard.add(sender)  # it is live, whatever our view of the board says
        state.notify()
        if request.kind in ("part", "result"):
            if state.members.done() and request.group != group_tag(state.members.result()):
                return {"ok": False, "error": "this peer is in another group of the round"}
            box = state.parts if request.kind == "part" else state.results
            box[sender] = (request.group, request.slice_index, request.numel, request.data)
            return {"ok": True}
        if request.fingerprint != self.fingerprint:
            return {"ok": False, "error": "your config differs from this run's (fingerprint mismatch)"}
        if request.kind == "join" and not state.members.done() and self._leader(state) == self.peer_id:
            state.joins[sender] = request.shard
            state.notify()
            hang_up.add_done_callback(lambda _: state.notify())

            def answered() -> bool:  # group out, round over, or we yielded the lead (dropping joiners)
                yielded = self._leader(state) != self.peer_id or sender not in state.joins
                return state.members.done() or state.outcome.done() or yielded

            def gone() -> str | None:
                return "the joiner hung up" if hang_up.done() else None

            deadline = time.monotonic() + self.round_timeout_s * 4
            try:
                await state.wait_until(answered, deadline, "the group", gone)
            except RoundFailed:
                if not state.members.done():
                    state.joins.pop(sender, None)  # it went elsewhere or gave up: never list it
                return {"ok": False, "error": "this leader never reached the round"}
            if state.outcome.done() and not state.members.done():
                return {"ok": False, "failed": True, "error": f"round {request.round_id} failed here"}
        if state.members.done():  # the round's group is settled: anyone who asks gets it
            return {"ok": True, "members": [list(m) for m in state.members.result()]}
        if request.kind == "probe":
            return {"ok": True, "leader": self._leader(state)}
        return {"redirect": self._leader(state)}

    def _answer_finished(self, request: Request) -> dict[str, Any]:
        """Messages about a round this peer is done with: its group for late joiners and probes;
        a delivery for its own group is acknowledged (a retry it no longer needs); if the round
        failed here, every asker learns so, and fails it too rather than apply it without us."""
        served = self.served.get(request.round_id)  # None for a failed round, or one long done
        if not self.finished[request.round_id]:  # we will never apply it: neither may the asker
            return {"ok": False, "failed": True, "error": f"round {request.round_id} failed here"}
        if request.kind in ("part", "result"):
            if served is not None and request.group != group_tag(served[0]):
                return {"ok": False, "error": "this peer was in another group of the round"}
            return {"ok": True}
        if served is not None:  # a late joiner learns it was left out, a prober adopts the group
            return {"ok": True, "members": [list(m) for m in served[0]]}
        return {"ok": False, "error": f"round {request.round_id} is long over here"}
