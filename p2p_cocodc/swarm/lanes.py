"""How a peer's round messages leave it: libp2p streams of its daemon, the sending half of
``FragmentExchange`` (``swarm/exchange.py``).

- A message goes on a stream of its own, a length-prefixed msgpack frame (``swarm/wire.py``). The
  deliveries the round machine asks for at once for one peer and one kind (the pieces of its
  slices: ``algorithms/butterfly.py``) go as consecutive frames of one stream instead. A stream is
  FIFO, so the first piece arrives first, and its owner reduces it and sends its mean back while
  the later ones are on their way. On streams of their own, yamux would interleave them: they
  would all arrive at the end.
- A send that fails is dropped: the machine re-sends what still needs an answer. A message is not
  sent again while the previous copy of it is still being written (a slow link must not pile up
  copies).
- Bulk data (a batch of ``BULK_BYTES`` or more) goes to a peer only after the previous bulk batch
  to it was acknowledged, or its transfer allowance ran out, in the order their rounds asked for
  them: the libp2p connection to a peer also carries the DHT's notice-board traffic, which must not
  queue behind several fragments at once on a thin link. A round's own later batches (its RESULTs,
  behind its PARTs) do not wait for its earlier ones, so that the round's two phases overlap.
- Each acknowledged bulk delivery tells the ``LinkMeter`` how long the link carried it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from p2p_cocodc.algorithms.codecs import Codec
from p2p_cocodc.swarm.messages import Code, Members, Message, payload_bytes
from p2p_cocodc.swarm.records import NONE_YET
from p2p_cocodc.swarm.round_events import Completed, Deadlines
from p2p_cocodc.swarm.wire import close_when_read, transfer_allowance_s, write_end, write_frame

log = logging.getLogger(__name__)

MESSAGE_TIMEOUT_S = 30.0  # opening a stream and writing one small message
BULK_BYTES = 64 * 1024  # a batch this large or larger waits its turn on the link to its peer

LINK_WINDOW = 64  # bulk deliveries the link meter remembers
LANDING_WINDOW = 8  # landing times of this peer's syncs the link meter remembers, per codec

Key = tuple[str, str, int, int]  # (peer, round, kind, slice index): one delivery


@dataclass
class ExchangeStats:
    bytes_sent: int = 0  # tensor bytes of every delivery, once (the butterfly's traffic)
    bytes_resent: int = 0  # the same deliveries sent again after a lost or unacknowledged copy
    bytes_served: int = 0  # averages served to peers left out of a round or recovering from it
    bytes_received: int = 0  # tensor bytes of every message members sent here (copies and averages too)
    rounds_done: int = 0
    rounds_failed: int = 0
    messages_received: int = 0  # frames from other peers, well-formed or not
    messages_rejected: int = 0  # of those, malformed ones (logged and dropped)
    bandwidth_mbps: float = 0.0  # moving average of measured send throughput
    last_round_s: float = NONE_YET  # how long the latest completed all-reduce took here
    rounds_s: float = 0.0  # how long the completed all-reduces took here, summed
    # completed butterflies of two or more members, and their time here from the group's adoption
    # (every member present) to the average: the link's part of a round, without the arrival skew
    butterflies: int = 0
    butterflies_s: float = 0.0

    def record_round(self, completed: Completed, started: float, adopted: float, now: float) -> None:
        """A round completed at ``now``: this peer reached it at ``started``, adopted its group then."""
        self.rounds_done += 1
        self.last_round_s = now - started
        self.rounds_s += self.last_round_s
        if completed.by_butterfly and len(completed.members) > 1:
            self.butterflies += 1
            self.butterflies_s += now - adopted

    def record_send(self, num_bytes: int, seconds: float) -> None:
        """A message of ``num_bytes`` tensor bytes has been written in ``seconds``."""
        if num_bytes >= BULK_BYTES and seconds > 0:
            mbps = 8e-6 * num_bytes / seconds
            self.bandwidth_mbps = mbps if not self.bandwidth_mbps else 0.8 * self.bandwidth_mbps + 0.2 * mbps


class LinkMeter:
    """How long this peer's link is busy per round, from its bulk deliveries: each PART or RESULT
    from the start of its write to the member's acknowledgement. Deliveries to several members
    overlap, so the busy time is the union of those intervals; divided by the number of rounds they
    belong to, it is the link time one round takes here (whatever else shares the link, and however
    much the kernel and the daemon buffer), over the last ``LINK_WINDOW`` deliveries. Rounds of
    each wire codec (``SyncCodecs``) are timed apart: a paced swarm's rounds are smaller.

    It also keeps how long this peer's syncs took to land: from the send to the result, ready to
    apply, less the wait for the others to arrive (``landed``). On a fast link that is round trips
    and arithmetic more than link time, and it is what τ steps must cover (``paced_spacing``). The
    members' skew is left out: a pace that widened for it would leave the faster peers more steps
    to run ahead in, and the next rounds' skew would ask for wider still (on `region`, the pace
    went from 4 steps to 21 in one run)."""

    def __init__(self) -> None:
        self.deliveries: deque[tuple[float, float, str, str]] = deque(maxlen=LINK_WINDOW)
        self.landings: dict[str, deque[float]] = {}

    def record(self, started: float, acked: float, round_id: str, codec: str) -> None:
        self.deliveries.append((started, acked, round_id, codec))

    def rounds(self, codec: str) -> int:
        """The rounds of ``codec`` whose deliveries the window holds."""
        return len({round_id for _, _, round_id, used in self.deliveries if used == codec})

    def round_s(self, codec: Codec, measured: list[Codec], round_bytes: Callable[[Codec], int]) -> float:
        """The link time a round of ``codec`` takes here, from the first of ``measured`` (the codec in
        use first) whose rounds were timed, scaled by the two codecs' ``round_bytes`` (a thin link's
        round time is its bytes); 0.0 with nothing timed."""
        for known in measured:
            if busy := self.busy_per_round_s(known.name):
                return busy * round_bytes(codec) / round_bytes(known)
        return 0.0

    def landed(self, codec: str, seconds: float) -> None:
        """A sync of this peer's in ``codec`` was ready to apply ``seconds`` after its send, not
        counting its wait for the others (``GroupRecord.arrival_wait_s``)."""
        self.landings.setdefault(codec, deque(maxlen=LANDING_WINDOW)).append(seconds)

    def landed_rounds(self, codec: str) -> int:
        """The syncs of ``codec`` whose landing times the meter holds."""
        return len(self.landings.get(codec, ()))

    def landing_medians(self) -> dict[str, float]:
        """The median landing time of each codec's last ``LANDING_WINDOW`` syncs."""
        return {codec: statistics.median(times) for codec, times in self.landings.items()}

    def landing_s(self, codec: Codec, measured: list[Codec], round_bytes: Callable[[Codec], int]) -> float:
        """How long a sync of ``codec`` takes to land here: the median of its last
        ``LANDING_WINDOW`` landings; else, from the first of ``measured`` whose syncs landed, that
        codec's median with its link time per round swapped for this one's (``round_s``); 0.0 with
        nothing landed."""
        for known in [codec, *measured]:
            if known.name in self.landings:
                landing = statistics.median(self.landings[known.name])
                if known.name == codec.name:
                    return landing
                return max(0.0, landing - self.round_s(known, [known], round_bytes)) + self.round_s(
                    codec, [known], round_bytes
                )
        return 0.0

    def busy_per_round_s(self, codec: str) -> float:
        """The link time one round of ``codec`` took here; 0.0 until one of its deliveries was
        acknowledged."""
        rounds = self.rounds(codec)
        if not rounds:
            return 0.0
        busy, reach = 0.0, -math.inf
        for start, end, _, used in sorted(self.deliveries):
            if used == codec and end > reach:
                busy += end - max(start, reach)
                reach = end
        return busy / rounds


def key_of(to: str, message: Message) -> Key:
    return (to, message.round_id, int(message.code), getattr(message, "index", 0))


class Lanes:
    """This peer's messages to the others: batches, turns on each link, acknowledgements awaited."""

    def __init__(
        self,
        p2p: Any,
        protocol: str,
        stats: ExchangeStats,
        link: LinkMeter,
        deadlines: Callable[[], Deadlines],
        codec_of: Callable[[str], str],
    ) -> None:
        self.p2p = p2p
        self.protocol = protocol
        self.stats = stats
        self.link = link
        self.deadlines = deadlines  # the current ones: they follow the measured link
        self.codec_of = codec_of  # a round's wire codec, by round id (the link meter times them apart)
        self.sending: dict[Key, asyncio.Task[None]] = {}
        self.sent_once: dict[str, set[Key]] = {}  # round -> deliveries sent
        self.turns: dict[str, asyncio.Lock] = {}  # peer -> whose turn it is to send it bulk data
        self.holder: dict[str, str] = {}  # peer -> the round whose bulk batch holds its turn
        self.acks_awaited: dict[Key, tuple[asyncio.Event, Members]] = {}

    def send(self, to: str, messages: Sequence[Message]) -> None:
        """Send ``messages`` (one round's, of one kind) to ``to``, as one batch on one stream."""
        fresh = [m for m in messages if key_of(to, m) not in self.sending]  # the others: being written
        if not fresh:
            return
        for message in fresh:
            key = key_of(to, message)
            first = key not in self.sent_once.setdefault(message.round_id, set())
            self.sent_once[message.round_id].add(key)
            if message.code == Code.AVERAGE:
                self.stats.bytes_served += payload_bytes(message)
            elif first:
                self.stats.bytes_sent += payload_bytes(message)
            else:
                self.stats.bytes_resent += payload_bytes(message)
        keys = [key_of(to, m) for m in fresh]
        task = asyncio.ensure_future(self._send(to, fresh, keys))
        for key in keys:
            self.sending[key] = task

        def done(_: object) -> None:
            for key in keys:
                if self.sending.get(key) is task:
                    del self.sending[key]

        task.add_done_callback(done)

    def acknowledged(self, sender: str, round_id: str, kind: int, index: int) -> None:
        awaited = self.acks_awaited.get((sender, round_id, kind, index))
        if awaited is not None:
            awaited[0].set()

    def forget(self, round_id: str) -> None:
        self.sent_once.pop(round_id, None)

    def awaiting(self) -> bool:
        return bool(self.acks_awaited)

    async def _send(self, to: str, messages: list[Message], keys: list[Key]) -> None:
        members = getattr(messages[0], "members", ())
        for other in [k for k in self.acks_awaited if k[:3] in {key[:3] for key in keys} and k not in keys]:
            if self.acks_awaited[other][1] != members:
                # a delivery of a group this peer has left for another (``RoundMachine._on_group``):
                # its member never acknowledges it, and no later delivery may wait behind it
                self.acks_awaited.pop(other)[0].set()
        size = sum(payload_bytes(m) for m in messages)
        if size < BULK_BYTES:
            await self.write(to, messages)
            return
        round_id = messages[0].round_id
        if self.holder.get(to) == round_id:  # the round's own earlier batch holds the turn
            await self._deliver(to, messages, keys, size)
            return
        async with self.turns.setdefault(to, asyncio.Lock()):
            self.holder[to] = round_id
            try:
                await self._deliver(to, messages, keys, size)
            finally:
                if self.holder.get(to) == round_id:
                    del self.holder[to]

    async def _deliver(self, to: str, messages: list[Message], keys: list[Key], size: int) -> None:
        """Write a bulk batch and wait for its deliveries' acknowledgements (within the allowance)."""
        deliveries = [k for k, m in zip(keys, messages, strict=True) if m.code in (Code.PART, Code.RESULT)]
        awaited = {k: asyncio.Event() for k in deliveries}
        for key, event in awaited.items():
            self.acks_awaited[key] = (event, getattr(messages[0], "members", ()))
        started = time.monotonic()
        codec = self.codec_of(messages[0].round_id)
        try:
            if await self.write(to, messages) and awaited:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.deadlines().resend_after(size)):
                        for key, event in awaited.items():
                            await event.wait()
                            if self.acks_awaited.get(key, (None,))[0] is event:  # acknowledged, not given up
                                self.link.record(started, time.monotonic(), key[1], codec)
        finally:
            for key, event in awaited.items():
                if self.acks_awaited.get(key, (None,))[0] is event:
                    del self.acks_awaited[key]

    async def write(self, to: str, messages: Sequence[Message]) -> bool:
        """Write ``messages`` as consecutive frames of one stream, and close it once the far end has
        read them; whether they were written."""
        from hivemind.p2p import PeerID

        size = sum(payload_bytes(m) for m in messages)
        started = time.perf_counter()
        allowance = transfer_allowance_s(size, self.deadlines().slowest_link_mbps)
        writer = None
        try:
            _, reader, writer = await asyncio.wait_for(
                self.p2p.call_binary_stream_handler(PeerID.from_base58(to), self.protocol), MESSAGE_TIMEOUT_S
            )
            async with asyncio.timeout(MESSAGE_TIMEOUT_S + allowance):
                for message in messages:
                    await write_frame(writer, message.to_wire())
                await write_end(writer)
        except Exception as exc:  # noqa: BLE001 - p2pd client errors have no common base; the machine re-sends
            names = "+".join(m.code.name for m in messages)
            log.debug("%s to %s failed: %s: %s", names, to[:12], type(exc).__name__, exc)
            if writer is not None:
                writer.close()
            return False
        self.stats.record_send(size, time.perf_counter() - started)
        await close_when_read(reader, writer, MESSAGE_TIMEOUT_S + allowance)  # closing now may lose it
        return True
