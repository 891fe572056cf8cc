"""Framing and checking of the messages peers exchange: length-prefixed msgpack, nothing else.

Everything a peer receives passes through ``read_request``/``read_reply`` here: sizes are bounded
before memory is allocated, and every field is type-checked, so a malformed or hostile message ends
as one ``BadMessage`` naming what was wrong, never as a crash or a hang (reads have deadlines).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import msgpack

HEADER = 4
MAX_FRAME = 1 << 30  # 1 GiB: a slice of a fragment of a multi-billion-parameter model in fp32
MAX_ROUND_ID = 64
MAX_GROUP_TAG = 32
SLOWEST_LINK_MBPS = 10.0  # deadlines for moving N bytes allow for a link this slow


def transfer_allowance_s(num_bytes: int) -> float:
    """Seconds to allow for moving ``num_bytes`` over the slowest link we plan for."""
    return 8.0 * num_bytes / (SLOWEST_LINK_MBPS * 1e6)


KINDS = ("join", "probe", "part", "result", "fetch")
GROUPING = ("join", "probe")  # messages that carry the sender's shard and config fingerprint


class BadMessage(Exception):
    """A peer sent something that is not a valid message of our protocol."""


@dataclass(frozen=True)
class Request:
    kind: str
    round_id: str
    shard: int = 0  # join/probe: the sender's data shard (member order)
    fingerprint: str = ""  # join/probe: the sender's config fingerprint
    group: str = ""  # part/result: which member list of the round this delivery belongs to
    slice_index: int = 0  # part/result: which slice of the vector
    numel: int = 0  # part/result: values in that slice
    data: bytes = b""  # part/result: codec-encoded values

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {"kind": self.kind, "round": self.round_id}
        if self.kind in GROUPING:
            body.update(shard=self.shard, fingerprint=self.fingerprint)
        elif self.kind != "fetch":
            body.update(group=self.group, slice=self.slice_index, numel=self.numel, data=self.data)
        return body


async def write_frame(writer: asyncio.StreamWriter, body: dict[str, Any]) -> int:
    """Send one message; returns the bytes written."""
    raw = msgpack.packb(body, use_bin_type=True)
    writer.write(len(raw).to_bytes(HEADER, "big"))
    writer.write(raw)
    await writer.drain()
    return HEADER + len(raw)


async def read_frame(reader: asyncio.StreamReader, timeout: float) -> dict[str, Any]:
    """One message; ``timeout`` for the header, plus time for the announced size on a slow link."""
    try:
        header = await asyncio.wait_for(reader.readexactly(HEADER), timeout)
        size = int.from_bytes(header, "big")
        if size > MAX_FRAME:
            raise BadMessage(f"frame of {size} bytes exceeds the {MAX_FRAME}-byte limit")
        timeout += transfer_allowance_s(size)
        raw = await asyncio.wait_for(reader.readexactly(size), timeout)
    except asyncio.IncompleteReadError:
        raise BadMessage("stream closed in the middle of a message") from None
    except TimeoutError:
        raise BadMessage(f"no complete message within {timeout:.0f} s") from None
    try:
        body = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=MAX_FRAME)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types on garbage
        raise BadMessage(f"not msgpack ({type(exc).__name__})") from None
    if not isinstance(body, dict):
        raise BadMessage("a message must be a map")
    return body


def parse_request(body: dict[str, Any]) -> Request:
    kind, round_id = body.get("kind"), body.get("round")
    if kind not in KINDS:
        raise BadMessage(f"unknown message kind {kind!r}")
    if not isinstance(round_id, str) or not 0 < len(round_id) <= MAX_ROUND_ID:
        raise BadMessage("'round' must be a short string")
    if kind in GROUPING:
        shard, fingerprint = body.get("shard"), body.get("fingerprint")
        if not _is_index(shard) or not isinstance(fingerprint, str) or len(fingerprint) > 64:
            raise BadMessage(f"{kind} needs an int 'shard' ≥ 0 and a string 'fingerprint'")
        return Request(kind, round_id, shard=shard, fingerprint=fingerprint)
    if kind == "fetch":  # a left-out or failed member asks for the round's average
        return Request(kind, round_id)
    group, index, numel, data = body.get("group"), body.get("slice"), body.get("numel"), body.get("data")
    if not isinstance(group, str) or not 0 < len(group) <= MAX_GROUP_TAG:
        raise BadMessage(f"{kind} needs a short string 'group'")
    if not _is_index(index) or not _is_index(numel) or not isinstance(data, bytes):
        raise BadMessage(f"{kind} needs int 'slice' and 'numel' ≥ 0 and bytes 'data'")
    return Request(kind, round_id, group=group, slice_index=index, numel=numel, data=data)


def parse_members(body: dict[str, Any]) -> list[tuple[str, int]]:
    """The answer to a join or probe from a peer that knows the round's group: its ordered members."""
    members = body.get("members")
    if not isinstance(members, list) or not members:
        raise BadMessage("the answer has no 'members' list")
    parsed = []
    for item in members:
        if (
            not isinstance(item, list | tuple)
            or len(item) != 2
            or not isinstance(item[0], str)
            or not _is_index(item[1])
        ):
            raise BadMessage("each member must be [peer id, shard]")
        parsed.append((item[0], item[1]))
    if len({peer for peer, _ in parsed}) != len(parsed):
        raise BadMessage("a peer appears twice in the member list")
    return parsed


def _is_index(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 40
