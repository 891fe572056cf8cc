"""The round protocol's messages: one code enum, one frozen dataclass per message, one parser.

Every message is one-way and about one round; answers are messages too. On the wire a message is
a msgpack map ``{"code": int, "round": str, ...fields}`` (framed by ``swarm/wire.py``).
``parse_message`` is the only way bytes from another peer become a message: every field is
type-checked and bounded, and anything else is a ``BadMessage`` naming what was wrong.

| code | fields | meaning |
|---|---|---|
| JOIN | shard, fingerprint, pace | "list me in this round; my link keeps up at this send-slot spacing" |
| PROBE | shard, fingerprint, pace | "what do you know of this round?" (to a peer that has not joined) |
| LEADER | leader | "I take this peer for the round's leader" (answer to JOIN / PROBE) |
| GROUP | members, pace | "the round's group is this list, with this pace" (from its leader, or any holder) |
| PART | members, pace, index, numel, data, trained, window | my slice ``index``, for its owner (†) |
| RESULT | members, pace, index, numel, data | the owner's encoded mean of slice ``index`` |
| ACK | kind, index | a PART or RESULT arrived |
| FETCH | ask, members, pace, observer, average | "give me the average" (``average`` false: "hold it?") |
| AVERAGE | members, pace, numel, data, means, codec | the round's average (‡) |
| STATUS | status, detail, ask | where the round stands here, when that is the whole answer (see ``Status``) |
| BYE | | the sender is leaving the run (round "-"): it joins no new group, finishes what it is in |

(†) and ``trained``: how many of the last ``window`` steps the sender trained (``--inner-share``;
0 and 0: every step), which weighs its slice in the owner's mean (``algorithms/inner_share.py``).
(‡) either ``means``, one per slice in slice order (M·C: ``algorithms/butterfly.py``), the slice
means its members' RESULTs carried in ``codec`` (the round's: the fetcher assembles the average
from them as the members did, at the codec's size rather than fp32's), or, with ``means`` empty,
``data``: the average in fp32, bit-exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any, ClassVar

from p2p_cocodc.algorithms.butterfly import MAX_PIECES
from p2p_cocodc.names import CODEC_NAMES
from p2p_cocodc.swarm.wire import BadMessage, is_index

MAX_ROUND_ID = 64
MAX_PEER_ID = 128
MAX_MEMBERS = 1024
MAX_DETAIL = 200
MAX_PACE = 1 << 24  # a send-slot spacing in inner steps (0: none asked or agreed)

Members = tuple[tuple[str, int], ...]  # (peer id, data shard), in member order


class Code(IntEnum):
    JOIN = 1
    PROBE = 2
    LEADER = 3
    GROUP = 4
    PART = 5
    RESULT = 6
    ACK = 7
    FETCH = 8
    AVERAGE = 9
    STATUS = 10
    BYE = 11


class Status(IntEnum):
    """What a peer can say of a round when it has no list, slice or average to send."""

    BUSY = 1  # still forming or all-reducing: it may yet complete the round itself
    WAITING = 2  # no average, and it will take part in no group of the round: it is recovering too
    FAILED = 3  # settled without an average: it will never apply this round
    GONE = 4  # it completed the round long ago and no longer holds the average
    REFUSED = 5  # the message was refused (wrong config, not a peer of this run, too many rounds)
    HOLDS = 6  # it completed the round and holds the average (to a FETCH that did not ask for it)


@dataclass(frozen=True)
class Message:
    round_id: str

    code: ClassVar[Code] = Code.STATUS  # overridden by each message class

    def fields(self) -> dict[str, Any]:
        return {}

    def to_wire(self) -> dict[str, Any]:
        return {"code": int(self.code), "round": self.round_id, **self.fields()}


@dataclass(frozen=True)
class Join(Message):
    shard: int = 0
    fingerprint: str = ""
    pace: int = 0  # the send-slot spacing this peer's link keeps up with (0: it asks for none)
    code: ClassVar[Code] = Code.JOIN

    def fields(self) -> dict[str, Any]:
        return {"shard": self.shard, "fingerprint": self.fingerprint, "pace": self.pace}


@dataclass(frozen=True)
class Probe(Join):
    code: ClassVar[Code] = Code.PROBE


@dataclass(frozen=True)
class Leader(Message):
    leader: str = ""
    code: ClassVar[Code] = Code.LEADER

    def fields(self) -> dict[str, Any]:
        return {"leader": self.leader}


@dataclass(frozen=True)
class Group(Message):
    members: Members = ()
    pace: int = 0  # the spacing the group agreed on: the largest its members asked for (0: none)
    code: ClassVar[Code] = Code.GROUP

    def fields(self) -> dict[str, Any]:
        return {"members": [list(m) for m in self.members], "pace": self.pace}


@dataclass(frozen=True)
class Part(Group):
    index: int = 0
    numel: int = 0
    data: bytes = b""
    trained: int = 0  # PART: the sender trained this many of the last ``window`` steps (--inner-share)
    window: int = 0  # 0: every step (weight 1); a RESULT carries 0 and 0
    code: ClassVar[Code] = Code.PART

    def fields(self) -> dict[str, Any]:
        slice_ = {"index": self.index, "numel": self.numel, "data": self.data}
        return {**super().fields(), **slice_, "trained": self.trained, "window": self.window}

    def weight(self) -> tuple[int, int]:
        return self.trained, self.window

    def piece(self) -> int:
        """Which of its owner's pieces this slice is: slice ``index`` belongs to member index mod M."""
        return self.index // len(self.members)


@dataclass(frozen=True)
class Result(Part):
    code: ClassVar[Code] = Code.RESULT


@dataclass(frozen=True)
class Ack(Message):
    kind: Code = Code.PART
    index: int = 0
    code: ClassVar[Code] = Code.ACK

    def fields(self) -> dict[str, Any]:
        return {"kind": int(self.kind), "index": self.index}


@dataclass(frozen=True)
class Fetch(Message):
    ask: int = 0  # numbers the asker's FETCHes; the STATUS answering it repeats the number
    members: Members = ()  # the asker's group of the round, if it has one
    pace: int = 0  # that group's pace
    observer: bool = False  # the asker only wants the average (it joined the run after the round)
    average: bool = True  # send the average if you hold it (else say HOLDS): one peer at a time is asked
    code: ClassVar[Code] = Code.FETCH

    def fields(self) -> dict[str, Any]:
        members = [list(m) for m in self.members]
        return {"ask": self.ask, "members": members, "pace": self.pace, "observer": self.observer} | (
            {} if self.average else {"average": False}
        )


@dataclass(frozen=True)
class Average(Group):
    numel: int = 0
    data: bytes = b""  # the average in fp32 (empty with ``means``)
    means: tuple[bytes, ...] = ()  # or each member's slice mean in ``codec``, in member order
    codec: str = ""  # the codec of ``means``
    code: ClassVar[Code] = Code.AVERAGE

    def fields(self) -> dict[str, Any]:
        means = {"means": list(self.means), "codec": self.codec} if self.means else {}
        return {**super().fields(), "numel": self.numel, "data": self.data, **means}


@dataclass(frozen=True)
class StatusReply(Message):
    status: Status = Status.WAITING
    detail: str = ""
    ask: int = 0  # the FETCH this answers (0: not an answer to a FETCH)
    code: ClassVar[Code] = Code.STATUS

    def fields(self) -> dict[str, Any]:
        return {"status": int(self.status), "detail": self.detail, "ask": self.ask}


@dataclass(frozen=True)
class Bye(Message):
    code: ClassVar[Code] = Code.BYE


def payload_bytes(message: Message) -> int:
    """Bytes of tensor data a message carries (what deadlines allow transfer time for)."""
    return len(getattr(message, "data", b"")) + sum(map(len, getattr(message, "means", ())))


def parse_message(body: Any) -> Message:
    """A message from a decoded msgpack map; raises BadMessage on anything malformed."""
    if not isinstance(body, dict):
        raise BadMessage("a message must be a map")
    try:
        code = Code(body.get("code"))
    except ValueError:
        raise BadMessage(f"unknown message code {body.get('code')!r}") from None
    round_id = body.get("round")
    if not isinstance(round_id, str) or not 0 < len(round_id) <= MAX_ROUND_ID:
        raise BadMessage("'round' must be a short string")
    if code in (Code.JOIN, Code.PROBE):
        shard, fingerprint = body.get("shard"), body.get("fingerprint")
        if not is_index(shard) or not isinstance(fingerprint, str) or len(fingerprint) > 64:
            raise BadMessage(f"{code.name} needs an int 'shard' ≥ 0 and a short string 'fingerprint'")
        return (Join if code == Code.JOIN else Probe)(round_id, shard, fingerprint, _pace(body))
    if code == Code.BYE:
        return Bye(round_id)
    if code == Code.LEADER:
        return Leader(round_id, _peer_id(body.get("leader"), "leader"))
    if code == Code.FETCH:
        ask, members, observer = body.get("ask"), body.get("members"), body.get("observer")
        average = body.get("average", True)  # absent: an older peer's, which always asks for it
        if not is_index(ask) or not isinstance(members, list) or not isinstance(observer, bool):
            raise BadMessage(
                "FETCH needs an int 'ask', a 'members' list (empty without a group) and a bool 'observer'"
            )
        if not isinstance(average, bool):
            raise BadMessage("FETCH's 'average' must be a bool")
        return Fetch(round_id, ask, parse_members(members) if members else (), _pace(body), observer, average)
    if code == Code.ACK:
        kind, index = body.get("kind"), body.get("index")
        if kind not in (Code.PART, Code.RESULT) or not is_index(index):
            raise BadMessage("ACK needs 'kind' PART or RESULT and an int 'index'")
        return Ack(round_id, Code(kind), index)
    if code == Code.STATUS:
        status, detail, ask = body.get("status"), body.get("detail"), body.get("ask")
        if status not in set(Status) or not isinstance(detail, str) or len(detail) > MAX_DETAIL:
            raise BadMessage("STATUS needs a known 'status' and a short string 'detail'")
        if not is_index(ask):
            raise BadMessage("STATUS needs an int 'ask'")
        return StatusReply(round_id, Status(status), detail, ask)
    members, pace = parse_members(body.get("members")), _pace(body)
    if code == Code.GROUP:
        return Group(round_id, members, pace)
    numel, data = body.get("numel"), body.get("data")
    if not is_index(numel) or not isinstance(data, bytes):
        raise BadMessage(f"{code.name} needs an int 'numel' ≥ 0 and bytes 'data'")
    if code == Code.AVERAGE:
        means, codec = body.get("means", []), body.get("codec", "")  # absent: an older peer's, fp32
        if not isinstance(means, list) or not all(isinstance(m, bytes) for m in means):
            raise BadMessage("AVERAGE's 'means' must be a list of bytes")
        if means and (len(means) % len(members) or len(means) > MAX_PIECES * len(members)):
            raise BadMessage(f"AVERAGE's 'means' need one per slice: 1 to {MAX_PIECES} per member")
        if means and (data or codec not in CODEC_NAMES):
            raise BadMessage("AVERAGE's 'means' need a known 'codec' and no 'data'")
        return Average(round_id, members, pace, numel, data, tuple(means), codec if means else "")
    index = body.get("index")
    if not is_index(index) or index >= MAX_PIECES * len(members):
        raise BadMessage(f"{code.name} needs an int 'index' below {MAX_PIECES} times the number of members")
    trained, window = body.get("trained", 0), body.get("window", 0)  # absent (an older peer): every step
    if not is_index(trained) or not is_index(window) or window > MAX_PACE or trained > window:
        raise BadMessage(f"{code.name} needs ints 0 ≤ 'trained' ≤ 'window' ≤ {MAX_PACE}")
    return (Part if code == Code.PART else Result)(
        round_id, members, pace, index, numel, data, trained, window
    )


def parse_members(members: Any) -> Members:
    """An ordered member list: [[peer id, shard], ...], no peer twice."""
    if not isinstance(members, list) or not 0 < len(members) <= MAX_MEMBERS:
        raise BadMessage("'members' must be a non-empty list")
    parsed = []
    for item in members:
        if not isinstance(item, list | tuple) or len(item) != 2 or not is_index(item[1]):
            raise BadMessage("each member must be [peer id, shard]")
        parsed.append((_peer_id(item[0], "member"), item[1]))
    if len({peer for peer, _ in parsed}) != len(parsed):
        raise BadMessage("a peer appears twice in the member list")
    return tuple(parsed)


def _pace(body: dict) -> int:
    pace = body.get("pace")
    if not is_index(pace) or pace > MAX_PACE:
        raise BadMessage(f"'pace' must be an int in [0, {MAX_PACE}]")
    return pace


def _peer_id(value: Any, what: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_PEER_ID:
        raise BadMessage(f"'{what}' must be a peer id")
    return value
