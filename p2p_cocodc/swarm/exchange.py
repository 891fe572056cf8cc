"""The fragment exchange: one averaging round of a flat fp32 vector among the live peers of a run.

A round (say fragment 2 sent after inner step 96, id ``f2:96``) runs in two phases, all over
streams of hivemind's libp2p daemon (``dht.replicate_p2p()``), never sockets of our own:

1. **Group.** Every peer sends ``join`` to the round's leader, the live peer with the smallest id.
   The leader waits until every peer the notice board shows training has joined, or until a
   deadline derived from their published step and step time, then answers every joiner with the
   same ordered member list (by data shard, the simulator's worker order). A peer that misses the
   deadline is left out of that round.
2. **Butterfly all-reduce.** The vector is cut into one slice per member, on codec block edges.
   Each member sends slice j, encoded with the run's codec, to member j; member j averages the
   slices it received in member order (the simulator's order, so fp32 results are bit-equal to it),
   encodes the mean and sends it to every member. Everyone decodes the same bytes, so every peer
   ends the round with a bit-identical average, and each link carries 2(M−1)/M of the vector.

3. **Recovery.** A peer whose all-reduce fails (a member died or went silent, a payload was bad)
   asks the other members for the round's average before it gives up: if any member completed the
   round (an owner died after sending its averaged slice to only some members), every live member
   ends with that same average. A peer left out by the leader catches up the same way. Only when no
   member completed does the round fail, and then it fails for every member alike.

Every wait has a deadline; a round that cannot complete raises ``RoundFailed`` on its own, and the
peer decides what to do. Received payloads are decoded in one place, ``_decode``.
"""

from __future__ import annotations

import asyncio
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
MAX_FINISHED = 4096  # finished round ids remembered, to answer late deliveries
MAX_SERVED = 64  # recent averages kept for peers left out of their round or failed in it
STOP_GRACE_S = 5.0  # how long stop() lets answers in progress finish
EXACT = get_codec("fp32")  # averages served to another member (fetch): bit-exact


class RoundFailed(Exception):
    """This round could not complete on this peer; the reason says why."""


@dataclass
class RoundState:
    """What has arrived for one round; handlers fill it, the round's own task consumes it."""

    joins: dict[str, int] = field(default_factory=dict)  # leader only: peer id -> shard
    members: asyncio.Future[list[tuple[str, int]]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    parts: dict[str, tuple[int, int, bytes]] = field(default_factory=dict)  # sender -> (slice, n, data)
    results: dict[str, tuple[int, int, bytes]] = field(default_factory=dict)
    outcome: asyncio.Future[torch.Tensor | None] = field(  # the average here; None if the round failed
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    recovering: bool = False  # our all-reduce failed: we have no average to serve, we are asking

    def settled(self) -> bool:
        """Whether this peer can say what it got from the round: an average, or nothing."""
        return self.outcome.done() or self.recovering

    def notify(self) -> None:
        self.changed.set()

    async def wait_until(
        self,
        ready: Callable[[], bool],
        deadline: float,
        what: str,
        hopeless: Callable[[], str | None] = lambda: None,
    ) -> None:
        """Wait for ``ready``; fail at the deadline, or as soon as ``hopeless`` names a reason."""
        while not ready():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RoundFailed(f"timed out waiting for {what}")
            if reason := hopeless():
                raise RoundFailed(f"{reason} while waiting for {what}")
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), min(remaining, 0.5))
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
        self.finished: dict[str, None] = {}  # recent rounds, oldest first
        self.served: dict[str, tuple[list[tuple[str, int]], torch.Tensor]] = {}  # members, average
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
            if self.peer_id not in [p for p, _ in members]:
                why = "left out of the round (too late for its leader)"
                averaged = await self._fetch_average(round_id, members, vector.numel(), why)
            else:
                try:
                    averaged = await self._butterfly(round_id, state, members, vector)
                except RoundFailed as exc:
                    state.recovering = True
                    state.notify()
                    averaged = await self._fetch_average(round_id, members, vector.numel(), str(exc))
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
            self.finished[round_id] = None
            if len(self.finished) > MAX_FINISHED:
                del self.finished[next(iter(self.finished))]
        self.stats.rounds_done += 1
        return averaged

    async def _fetch_average(
        self, round_id: str, members: list[tuple[str, int]], numel: int, why: str
    ) -> torch.Tensor:
        """The mean a member completed, from whichever member answers first (asked all at once: some
        may have finished and left, some may have failed too)."""
        log.warning("round %s: %s; asking its members for their average", round_id, why)

        async def ask(peer: str) -> torch.Tensor:
            reply = await self._call(peer, Request("fetch", round_id), self.round_timeout_s * 2)
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

    def _leader(self, exclude: set[str]) -> str:
        candidates = (set(self._live_training()) | {self.peer_id}) - exclude
        return min(candidates)

    async def _form_group(self, round_id: str, state: RoundState, step: int) -> list[tuple[str, int]]:
        tried: set[str] = set()
        leader = self._leader(tried)
        while True:
            if leader == self.peer_id:
                return await self._lead(state, step)
            reply = await self._join_via(leader, round_id)
            tried.add(leader)
            if reply is None:  # the leader is gone: the next smallest id leads
                leader = self._leader(tried)
                continue
            if "redirect" in reply:  # the leader knows a smaller live id than this peer does
                target = reply["redirect"]
                if not isinstance(target, str) or target in tried:
                    raise RoundFailed(f"leader {leader[:12]} sent a bad redirect")
                leader = target
                continue
            if not reply.get("ok"):
                raise RoundFailed(f"leader {leader[:12]} refused: {reply.get('error', '?')}")
            try:
                members = parse_members(reply)
            except BadMessage as exc:
                raise RoundFailed(f"leader {leader[:12]} sent a bad member list: {exc}") from None
            return members

    async def _join_via(self, leader: str, round_id: str) -> dict[str, Any] | None:
        """Ask ``leader`` for the round's members; None once it has left the board.

        A join is idempotent, so a broken stream is retried while the leader is still live."""
        request = Request("join", round_id, shard=self.shard, fingerprint=self.fingerprint)
        give_up = time.monotonic() + self.round_timeout_s * 4
        while True:
            call = asyncio.ensure_future(self._call(leader, request, self.round_timeout_s * 4))
            try:
                while not call.done():
                    await asyncio.wait({call}, timeout=0.5)
                    if not call.done() and leader not in self._live_training():
                        call.cancel()
                        return None
                return call.result()
            except ConnectionError as exc:
                if leader not in self._live_training():
                    return None
                if time.monotonic() > give_up:
                    raise RoundFailed(f"leader {leader[:12]} is live but does not answer: {exc}") from None
                log.info("join via %s failed (%s); retrying", leader[:12], exc)
                await asyncio.sleep(RETRY_PAUSE_S)

    async def _lead(self, state: RoundState, step: int) -> list[tuple[str, int]]:
        """Wait for the expected peers to join, then publish the ordered member list."""
        state.joins[self.peer_id] = self.shard
        deadline = time.monotonic() + self._arrival_eta(step) * 2 + self.round_timeout_s

        def everyone_joined() -> bool:
            return set(self._live_training()) <= set(state.joins)

        try:
            await state.wait_until(everyone_joined, deadline, "peers to join")
        except RoundFailed:
            missing = set(self._live_training()) - set(state.joins)
            log.warning("round forms without %s (not at the step in time)", [m[:12] for m in missing])
        members = sorted(state.joins.items(), key=lambda item: (item[1], item[0]))
        state.members.set_result(members)
        return members

    def _arrival_eta(self, step: int) -> float:
        """Seconds until the slowest live peer reaches ``step``, from the board."""
        etas = [max(step - r.step, 0) * r.step_time_s for r in self._live_training().values()]
        return max(etas, default=0.0)

    async def _butterfly(
        self, round_id: str, state: RoundState, members: list[tuple[str, int]], vector: torch.Tensor
    ) -> torch.Tensor:
        peers = [p for p, _ in members]
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
        state.parts[self.peer_id] = (me, sizes[me], encoded[me])
        others = [j for j in range(len(peers)) if j != me]
        await self._send_all(
            round_id, "part", {peers[j]: (j, sizes[j], encoded[j]) for j in others}, deadline
        )
        await self._wait_for_all(state, state.parts, peers, deadline, "slices from every member")

        def average_own_slice() -> bytes:
            received = [self._decode(state.parts, p, me, sizes[me]) for p in peers]
            return self.codec.encode(mean_in_order(received))

        mean_bytes = await asyncio.to_thread(average_own_slice)
        state.results[self.peer_id] = (me, sizes[me], mean_bytes)
        await self._send_all(
            round_id, "result", {peers[j]: (me, sizes[me], mean_bytes) for j in others}, deadline
        )
        await self._wait_for_all(state, state.results, peers, deadline, "averaged slices")
        return await asyncio.to_thread(
            lambda: torch.cat([self._decode(state.results, p, j, sizes[j]) for j, p in enumerate(peers)])
        )

    async def _wait_for_all(
        self, state: RoundState, box: dict[str, Any], peers: list[str], deadline: float, what: str
    ) -> None:
        """Wait until every member's delivery is in ``box``; fail early once a missing member left."""

        def missing() -> list[str]:
            return [p for p in peers if p not in box]

        await state.wait_until(lambda: not missing(), deadline, what, lambda: self._left_swarm(missing()))

    def _decode(
        self, box: dict[str, tuple[int, int, bytes]], sender: str, index: int, numel: int
    ) -> torch.Tensor:
        """The one place received payloads are checked: right slice, right size, finite values."""
        got_index, got_numel, data = box[sender]
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
        self, round_id: str, kind: str, slices: dict[str, tuple[int, int, bytes]], deadline: float
    ) -> None:
        """Deliver slices to their peers. A delivery is idempotent, so a broken stream is retried
        until the round's deadline (streams do break now and then on a loaded host)."""

        async def send(peer: str, index: int, numel: int, data: bytes) -> None:
            request = Request(kind, round_id, slice_index=index, numel=numel, data=data)
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
        try:
            request = parse_request(await read_frame(reader, MESSAGE_TIMEOUT_S))
            reply = await self._dispatch(sender, request)
        except BadMessage as exc:
            log.warning("bad message from %s: %s", sender[:12], exc)
            reply = {"ok": False, "error": str(exc)}
        try:
            sending = MESSAGE_TIMEOUT_S + transfer_allowance_s(len(reply.get("data", b"")))
            await asyncio.wait_for(write_frame(writer, reply), sending)
        except (OSError, TimeoutError):
            log.debug("could not answer %s", sender[:12])
        finally:
            writer.close()

    async def _serve_average(self, round_id: str) -> dict[str, Any]:
        """A round's average for a peer that was left out of it or failed in it, once this peer has
        it; a peer that is itself recovering says so at once, so two of them never wait on each other."""
        if round_id not in self.served:
            state = self.rounds.get(round_id)
            if state is None:
                return {"ok": False, "error": f"no average of round {round_id} here"}
            try:
                await state.wait_until(state.settled, time.monotonic() + self.round_timeout_s, "the round")
            except RoundFailed:
                return {"ok": False, "error": f"round {round_id} is still running here"}
            if round_id not in self.served:
                return {"ok": False, "error": f"round {round_id} failed here"}
        average = self.served[round_id][1]
        return {"ok": True, "numel": average.numel(), "data": EXACT.encode(average)}

    async def _dispatch(self, sender: str, request: Request) -> dict[str, Any]:
        if request.kind == "fetch":
            return await self._serve_average(request.round_id)
        if request.round_id in self.finished:
            if request.kind != "join":  # a retried delivery this peer no longer needs
                return {"ok": True}
            if request.round_id in self.served:  # a late joiner: it learns it was left out
                return {"ok": True, "members": [list(m) for m in self.served[request.round_id][0]]}
            return {"ok": False, "error": f"round {request.round_id} is over here"}
        state = self._round(request.round_id)
        if request.kind != "join":
            box = state.parts if request.kind == "part" else state.results
            box[sender] = (request.slice_index, request.numel, request.data)
            state.notify()
            return {"ok": True}
        if request.fingerprint != self.fingerprint:
            return {"ok": False, "error": "your config differs from this run's (fingerprint mismatch)"}
        leader = self._leader(exclude=set())
        if leader != self.peer_id:
            return {"redirect": leader}
        state.joins[sender] = request.shard
        state.notify()
        try:
            members = await asyncio.wait_for(asyncio.shield(state.members), self.round_timeout_s * 4)
        except TimeoutError:
            return {"ok": False, "error": "this leader never reached the round"}
        return {"ok": True, "members": [list(m) for m in members]}
