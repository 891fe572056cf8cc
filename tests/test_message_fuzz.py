"""Untrusted bytes at the one decoding point: ``read_frame`` + ``parse_message`` take arbitrary
input without crashing, hanging, or allocating past the announced bound, and every message they
accept is one our own encoder could have written (hypothesis, derandomized so CI is repeatable)."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_cocodc.swarm.messages import Code, Message, parse_message
from p2p_cocodc.swarm.wire import BadMessage, read_frame

FUZZ = settings(max_examples=400, derandomize=True, deadline=None)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=40)
    | st.binary(max_size=64)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
field_names = st.sampled_from(
    [
        "code",
        "round",
        "shard",
        "fingerprint",
        "leader",
        "members",
        "index",
        "numel",
        "data",
        "kind",
        "ask",
        "status",
        "detail",
        "means",
        "codec",
        "observer",
        "average",
    ]
)
bodies = st.dictionaries(field_names, values, max_size=8) | st.builds(
    lambda code, rest: {**rest, "code": code},
    st.sampled_from([int(c) for c in Code] + [0, 99]),
    st.dictionaries(field_names, values, max_size=8),
)


def decode(raw: bytes) -> Message:
    async def read() -> Message:
        reader = asyncio.StreamReader()
        reader.feed_data(raw)
        reader.feed_eof()
        return parse_message(await read_frame(reader, 0.5))

    return asyncio.run(read())


@FUZZ
@given(st.binary(max_size=256))
def test_arbitrary_bytes_are_a_message_or_one_bad_message_error(raw: bytes) -> None:
    try:
        message = decode(raw)
    except BadMessage as exc:
        assert str(exc)
        return
    assert parse_message(message.to_wire()) == message


@FUZZ
@given(bodies)
def test_arbitrary_maps_are_a_message_or_one_bad_message_error(body: dict) -> None:
    try:
        message = parse_message(body)
    except BadMessage as exc:
        assert str(exc)
        return
    assert parse_message(message.to_wire()) == message  # what we accept, we could have sent


def test_an_average_is_slice_means_in_a_known_codec_one_per_member_or_fp32_data_and_asked_of_one() -> None:
    members = [["peer-a", 0], ["peer-b", 1]]
    base = {"code": int(Code.AVERAGE), "round": "f0:5", "members": members, "pace": 0, "numel": 8}
    means = {**base, "data": b"", "means": [b"ab", b"cd"], "codec": "q2"}
    assert parse_message(parse_message(means).to_wire()) == parse_message(means)
    pieces = {**means, "means": [b"ab"] * 8}  # 4 pieces a member (MAX_PIECES)
    assert parse_message(parse_message(pieces).to_wire()) == parse_message(pieces)
    older = parse_message({**base, "data": bytes(32)})  # no means: fp32, as an older peer sends it
    assert older.means == () and older.codec == ""  # type: ignore[attr-defined]
    fetch = {"code": int(Code.FETCH), "round": "f0:5", "ask": 1, "members": [], "pace": 0, "observer": False}
    assert parse_message(fetch).average and not parse_message({**fetch, "average": False}).average  # type: ignore[attr-defined]
    for bad, what in (
        ({**fetch, "average": 1}, "'average' must be a bool"),
        ({**means, "means": [b"ab"]}, "one per slice"),  # 1 for 2 members
        ({**means, "means": [b"ab"] * 3}, "one per slice"),  # 3 for 2 members: not M·C
        ({**means, "means": [b"ab"] * 10}, "one per slice"),  # 5 a member, above MAX_PIECES
        ({**means, "codec": "zip"}, "known 'codec'"),
        ({**means, "data": b"x"}, "no 'data'"),
        ({**means, "means": [b"ab", "cd"]}, "list of bytes"),
        ({**means, "means": b"abcd"}, "list of bytes"),
    ):
        with pytest.raises(BadMessage, match=what):
            parse_message(bad)


@FUZZ
@given(bodies)
def test_framed_maps_decode_like_the_maps_themselves(body: dict) -> None:
    raw = msgpack.packb(body, use_bin_type=True)
    framed = len(raw).to_bytes(4, "big") + raw
    try:
        expected: Message | None = parse_message(msgpack.unpackb(raw, raw=False, strict_map_key=True))
    except Exception:  # noqa: BLE001 - non-string keys and the like: the frame reader must refuse too
        expected = None
    try:
        got: Message | None = decode(framed)
    except BadMessage:
        got = None
    assert got == expected


def test_a_frame_announcing_more_than_the_limit_is_refused_before_it_is_read() -> None:
    raw = (2**31).to_bytes(4, "big") + b"\x00" * 16
    try:
        decode(raw)
    except BadMessage as exc:
        assert "limit" in str(exc)
    else:
        raise AssertionError("a 2 GiB frame was accepted")


def test_a_frame_on_a_slow_link_is_given_the_time_its_size_takes_there() -> None:
    """A body of about 1,250 bytes that arrives 1 s after its header: over the default 10 Mbit/s allowance
    (0.2 s + 1 ms) the read gives up; over a link measured at 0.001 Mbit/s (0.2 s + 10 s) it waits
    for it. Timers fire in deadline order, so the outcome does not depend on this machine's load."""
    payload = b"\x00" * 1230  # any frame of about 1,250 bytes: only its timing matters
    raw_body = msgpack.packb({"code": int(Code.JOIN), "pad": payload})

    async def read(link_mbps: float | None) -> dict | str:
        reader = asyncio.StreamReader()
        reader.feed_data(len(raw_body).to_bytes(4, "big"))
        asyncio.get_running_loop().call_later(1.0, reader.feed_data, raw_body)
        try:
            if link_mbps is None:
                return await read_frame(reader, 0.2)
            return await read_frame(reader, 0.2, link_mbps=link_mbps)
        except BadMessage as exc:
            return str(exc)

    assert asyncio.run(read(None)) == "no complete message within 0 s"
    assert asyncio.run(read(0.001)) == {"code": int(Code.JOIN), "pad": payload}
