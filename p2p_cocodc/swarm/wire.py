"""Framing of the messages peers exchange: length-prefixed msgpack, nothing else.

Every frame a peer receives passes through ``read_frame`` here: its size is bounded before memory
is allocated and every read has a deadline, so a malformed or hostile frame ends as one
``BadMessage`` naming what was wrong, never as a crash or a hang. ``messages.parse_message`` then
type-checks the fields.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgpack

HEADER = 4
MAX_FRAME = 1 << 30  # 1 GiB: a slice of a fragment of a multi-billion-parameter model in fp32
SLOWEST_LINK_MBPS = 10.0  # deadlines for moving N bytes allow for a link this slow
MIN_LINK_MBPS = 1.0  # deadlines never assume a slower link (a measurement may catch a stall)


def transfer_allowance_s(num_bytes: int, link_mbps: float = SLOWEST_LINK_MBPS) -> float:
    """Seconds to allow for moving ``num_bytes`` over a ``link_mbps`` link (by default the slowest
    link we plan for without a measurement)."""
    return 8.0 * num_bytes / (link_mbps * 1e6)


def is_index(x: Any) -> bool:
    """A count, size or index another peer sent: an int (not a bool), 0 ≤ x < 2^40."""
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 40


class BadMessage(Exception):
    """A peer sent something that is not a valid message of our protocol."""


async def write_frame(writer: asyncio.StreamWriter, body: dict[str, Any]) -> int:
    """Send one message; returns the bytes written."""
    raw = msgpack.packb(body, use_bin_type=True)
    writer.write(len(raw).to_bytes(HEADER, "big"))
    writer.write(raw)
    await writer.drain()
    return HEADER + len(raw)


async def write_end(writer: asyncio.StreamWriter) -> None:
    """Say that no more messages follow on this stream: an empty frame (no message is empty)."""
    writer.write(bytes(HEADER))
    await writer.drain()


async def close_when_read(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: float) -> bool:
    """Close our end of a p2pd stream once the far end has closed its own (it has read what we
    wrote), or after ``timeout``; whether it closed in time. The daemon resets a stream whose local
    end closes (``doStreamPipe``: its reading half then fails), and a reset drops whatever the far
    daemon has not yet handed to its handler: closing at once lost 26 of 36,000 small messages
    between two loaded daemons on 127.0.0.1, silently (``benchmarks/lost_messages.py``). Whatever
    the far end still sends (a request we refuse unread) is read and dropped meanwhile."""
    try:
        async with asyncio.timeout(timeout):
            while await reader.read(1 << 16):
                pass
        return True
    except (TimeoutError, OSError, ConnectionError):
        return False
    finally:
        writer.close()


async def read_frame(
    reader: asyncio.StreamReader,
    timeout: float,
    max_size: int = MAX_FRAME,
    reserve: Callable[[int], None] | None = None,
    link_mbps: float = SLOWEST_LINK_MBPS,
) -> dict[str, Any]:
    """One message; ``timeout`` for the header, plus time for the announced size on a ``link_mbps``
    link. ``max_size``: the largest message the caller can expect; ``reserve(size)`` is called with
    the announced size before the body is read, and may refuse it by raising BadMessage."""
    body = await read_next_frame(reader, timeout, max_size, reserve, link_mbps)
    if body is None:
        raise BadMessage("stream closed in the middle of a message")
    return body


async def read_next_frame(
    reader: asyncio.StreamReader,
    timeout: float,
    max_size: int = MAX_FRAME,
    reserve: Callable[[int], None] | None = None,
    link_mbps: float = SLOWEST_LINK_MBPS,
) -> dict[str, Any] | None:
    """The next message of a stream that may carry several (``read_frame``), or None at its end:
    an empty frame (``write_end``), or the stream closed before another frame begins."""
    try:
        header = await asyncio.wait_for(reader.readexactly(HEADER), timeout)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise BadMessage("stream closed in the middle of a message") from None
    except TimeoutError:
        raise BadMessage(f"no complete message within {timeout:.0f} s") from None
    size = int.from_bytes(header, "big")
    if size == 0:
        return None
    try:
        if size > min(max_size, MAX_FRAME):
            raise BadMessage(f"frame of {size} bytes exceeds the {min(max_size, MAX_FRAME)}-byte limit")
        if reserve is not None:
            reserve(size)
        timeout += transfer_allowance_s(size, link_mbps)
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
