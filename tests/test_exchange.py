"""The fragment exchange's transport in one process: real hivemind DHTs and libp2p streams on
127.0.0.1. What the round decides is tested on the pure machine (test_round.py, the model check in
test_round_model.py); here: exact averages over real streams for every codec, a peer left out of a
round, malformed and hostile input (garbage frames, stray rounds, strangers) answered without a
crash and without unbounded state, and messages type-checked at the one decoding point."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

import msgpack
import pytest
import torch

from p2p_cocodc.algorithms.butterfly import (
    MAX_PIECES,
    PIECE_BYTES,
    butterfly_mean,
    pieces_per_member,
    slice_bounds,
)
from p2p_cocodc.algorithms.codecs import CODECS, Codec, get_codec
from p2p_cocodc.swarm import exchange as exchange_module
from p2p_cocodc.swarm import lanes as lanes_module
from p2p_cocodc.swarm.exchange import FragmentExchange, LinkMeter, RoundFailed
from p2p_cocodc.swarm.messages import (
    Code,
    Fetch,
    Join,
    Members,
    Message,
    Part,
    Result,
    parse_members,
    parse_message,
)
from p2p_cocodc.swarm.records import PeerRecord
from p2p_cocodc.swarm.round_events import leader_rank
from p2p_cocodc.swarm.wire import BadMessage, close_when_read, read_frame, write_end, write_frame
from tests.local_dhts import local_dhts


def record(shard: int, step: int = 0) -> PeerRecord:
    return PeerRecord("training", step, shard, 2, 0.01, 0.0, "fp")


@pytest.fixture
def dhts():
    with local_dhts(3) as nodes:
        yield nodes


async def make_pair(dhts, codecs=("fp32", "fp32"), timeout=5.0) -> list[FragmentExchange]:
    """Two exchanges; both see both peers training on the board."""
    p2ps = [await d.replicate_p2p() for d in dhts[:2]]
    ids = [p.peer_id.to_base58() for p in p2ps]
    board = {peer: record(i) for i, peer in enumerate(ids)}
    exchanges = [
        FragmentExchange(p2p, "t", get_codec(codec), i, "fp", lambda: board, timeout, record_ttl_s=4.0)
        for i, (p2p, codec) in enumerate(zip(p2ps, codecs, strict=True))
    ]
    for ex in exchanges:
        await ex.start()
    return exchanges


async def stop_all(exchanges: list[FragmentExchange]) -> None:
    for ex in exchanges:
        await ex.stop()
        await ex.p2p.shutdown()


async def send_raw(p2p, target: FragmentExchange, raw: bytes) -> None:
    """Write raw bytes on one stream to ``target``, close it at once (a frame cut short must end
    where it ends) and wait until ``target`` has taken them in. A stream closed at once may be lost
    (``close_when_read``): one that is not taken in by the server's read deadline is sent again."""
    received = target.stats.messages_received
    allowed = exchange_module.MESSAGE_TIMEOUT_S + 10.0
    for attempt in range(3):
        _, _, writer = await p2p.call_binary_stream_handler(target.p2p.peer_id, target.protocol)
        writer.write(raw)
        await writer.drain()
        writer.close()
        try:
            await until(lambda: target.stats.messages_received > received, "the frame to be read", allowed)
            return
        except AssertionError:
            if attempt == 2:
                raise


async def send(p2p, target: FragmentExchange, message: Message) -> None:
    """Deliver one well-formed message as the exchange does: our end closed once ``target`` read it."""
    received, rejected = target.stats.messages_received, target.stats.messages_rejected
    _, reader, writer = await p2p.call_binary_stream_handler(target.p2p.peer_id, target.protocol)
    await write_frame(writer, message.to_wire())
    await write_end(writer)
    assert await close_when_read(reader, writer, exchange_module.MESSAGE_TIMEOUT_S), "it was not read"
    assert target.stats.messages_received > received and target.stats.messages_rejected == rejected


async def until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def test_a_sender_closes_its_end_of_a_stream_only_once_the_receiver_has_read_it(dhts) -> None:
    """p2pd resets a stream whose local end closes (its reading half fails), and a reset drops what
    the far daemon has not yet handed to its handler: between two loaded daemons here, closing at
    once lost 3-10 of 3000 small messages without an error on either side, and every peer of a
    swarm waited 2 s for its round every 15-40 s (benchmarks/lost_messages.py). Every write of the
    exchange and the state transfer ends with ``close_when_read``: our end stays open until the
    receiver has read and closed its own, or the deadline passes."""

    async def main():
        p2ps = [await d.replicate_p2p() for d in dhts[:2]]
        read, release = asyncio.Event(), asyncio.Event()

        async def serve(info, reader, writer) -> None:
            await read_frame(reader, 10.0)
            read.set()
            await release.wait()
            writer.close()

        await p2ps[1].add_binary_stream_handler("hold", serve)
        try:
            _, reader, writer = await p2ps[0].call_binary_stream_handler(p2ps[1].peer_id, "hold")
            await write_frame(writer, {"x": 1})
            closing = asyncio.ensure_future(close_when_read(reader, writer, 30.0))
            await asyncio.wait_for(read.wait(), 10.0)
            held = not closing.done() and not writer.is_closing()  # the receiver has not closed yet
            release.set()
            closed_in_time = await closing
            release.clear()
            _, reader, writer = await p2ps[0].call_binary_stream_handler(p2ps[1].peer_id, "hold")
            await write_frame(writer, {"x": 2})  # the receiver reads it and keeps its end open
            gave_up = await close_when_read(reader, writer, 0.5)
            return held, closed_in_time, gave_up, writer.is_closing()
        finally:
            release.set()
            for p2p in p2ps:
                await p2p.shutdown()

    held, closed_in_time, gave_up, closed = asyncio.run(main())
    assert held and closed_in_time
    assert not gave_up and closed  # a receiver that never closes: ours is closed at the deadline


def test_two_peers_get_the_same_average_with_every_codec(dhts) -> None:
    async def main():
        exchanges = await make_pair(dhts)
        torch.manual_seed(0)
        vectors = [torch.randn(1000), torch.randn(1000)]
        results = {}
        try:
            for codec in CODECS:
                for ex in exchanges:
                    ex.codec = get_codec(codec)
                results[codec] = await asyncio.gather(
                    *(ex.allreduce(f"r-{codec}", v, 1) for ex, v in zip(exchanges, vectors, strict=True))
                )
        finally:
            await stop_all(exchanges)
        return vectors, results, [ex.stats for ex in exchanges]

    vectors, results, stats = asyncio.run(main())
    exact = (vectors[0] + vectors[1]) / 2
    for codec, (a, b) in results.items():
        assert torch.equal(a, b), codec  # bit-identical on both peers, whatever the codec
        assert torch.equal(a, butterfly_mean(vectors, get_codec(codec))[0]), codec  # the simulator's
        if not codec.startswith("topk"):  # a top-k codec keeps 8 of 256 values: error feedback's job
            tolerance = {"fp32": 0.0, "bf16": 0.02, "int8": 0.05, "fp4": 2.0, "q2": 3.0, "q1": 3.0}[codec]
            assert float((a - exact).abs().max()) <= tolerance, codec
    assert all(s.rounds_done == len(CODECS) and s.rounds_failed == 0 for s in stats)


def test_a_peer_carries_a_round_from_its_group_to_its_last_acknowledged_slice(dhts) -> None:
    """``carrying()`` (the board's reads and publishes wait while it holds, ``peer/presence.py``):
    false before a round, true while its slices are on the link, false again once every slice
    this peer sent has been acknowledged."""

    async def main():
        exchanges = await make_pair(dhts)
        seen: list[tuple[bool, bool]] = []
        try:
            before = [ex.carrying() for ex in exchanges]
            vectors = [torch.randn(1 << 21), torch.randn(1 << 21)]  # 4 MB slices: milliseconds on the link
            rounds = asyncio.gather(
                *(ex.allreduce("r", v, 1) for ex, v in zip(exchanges, vectors, strict=True))
            )
            while not rounds.done():
                seen.append(tuple(ex.carrying() for ex in exchanges))
                await asyncio.sleep(0.001)
            await rounds
            await until(lambda: not any(ex.carrying() for ex in exchanges), "every slice to be acknowledged")
        finally:
            await stop_all(exchanges)
        return before, seen

    before, seen = asyncio.run(main())
    assert before == [False, False]
    assert any(a for a, _ in seen) and any(b for _, b in seen), "a peer was never seen carrying the round"


def test_slices_in_pieces_go_as_frames_of_one_stream_and_average_bit_for_bit(dhts) -> None:
    """A vector whose slices are cut in pieces (``pieces_per_member``): the pieces for one peer go
    as consecutive frames of one stream (``swarm/lanes.py``), each fed to the machine as it is read,
    and the average is the butterfly's, bit for bit, with every codec's pieces."""

    async def main():
        exchanges = await make_pair(dhts)
        results = {}
        try:
            for codec in ("fp32", "q2"):
                numel = 4 * PIECE_BYTES * 8 // {"fp32": 32, "q2": 2}[codec]  # about two pieces a member
                for ex in exchanges:
                    ex.codec = get_codec(codec)
                vectors = [torch.randn(numel), torch.randn(numel)]
                pieces = pieces_per_member(numel, 2, get_codec(codec))
                received = [ex.stats.messages_received for ex in exchanges]
                averages = await asyncio.gather(
                    *(ex.allreduce(f"r-{codec}", v, 1) for ex, v in zip(exchanges, vectors, strict=True))
                )
                frames = [ex.stats.messages_received - r for ex, r in zip(exchanges, received, strict=True)]
                results[codec] = vectors, averages, pieces, frames
        finally:
            await stop_all(exchanges)
        return results

    for codec, (vectors, (a, b), pieces, frames) in asyncio.run(main()).items():
        assert pieces >= 2, codec
        assert torch.equal(a, b) and torch.equal(a, butterfly_mean(vectors, get_codec(codec))[0]), codec
        assert min(frames) >= 2 * pieces, (codec, frames)  # every piece of a PART and of a RESULT


def test_a_stream_carries_at_most_max_pieces_messages_and_the_rest_is_refused(dhts) -> None:
    """A peer that writes more messages on one stream than a round's pieces need: the first
    ``MAX_PIECES`` are taken (each admitted within the per-peer limits), the next is counted
    against the sender and nothing after it is read."""

    async def main():
        a, b = await make_pair(dhts)
        try:
            _, reader, writer = await a.p2p.call_binary_stream_handler(b.p2p.peer_id, b.protocol)
            for i in range(MAX_PIECES + 2):
                await write_frame(writer, Join(f"j{i}", 0, "fp").to_wire())
            await write_end(writer)
            await close_when_read(reader, writer, exchange_module.MESSAGE_TIMEOUT_S)
            await until(lambda: b.strikes[a.peer_id] >= 1, "the message too many to be refused")
            return set(b.open)
        finally:
            await stop_all([a, b])

    opened = asyncio.run(main())
    assert opened == {f"j{i}" for i in range(MAX_PIECES)}, opened


def sent_behind_an_unacknowledged_delivery(
    dhts, second: Callable[[Members, int, bytes], Message]
) -> set[tuple[int, int]]:
    """Peer a sends b a bulk PART of a round b never opened (so b never acknowledges it), then
    ``second(members, numel, data)``; once b has read both, the (kind, index) of the deliveries a
    still awaits an acknowledgement of. The re-send period is an hour: a second delivery that
    waited for the first one's acknowledgement would never leave."""

    async def main():
        a, b = await make_pair(dhts)
        a.deadlines = replace(a.deadlines, resend_s=3600.0)
        to = b.p2p.peer_id.to_base58()
        members = ((a.p2p.peer_id.to_base58(), 0), (to, 1))
        numel = lanes_module.BULK_BYTES // 4  # fp32: one bulk message each
        data = bytes(4 * numel)
        try:
            received = b.stats.messages_received
            a.lanes.send(to, [Part("unopened", members, 0, 1, numel, data)])  # never acknowledged
            await until(lambda: b.stats.messages_received > received, "the first delivery")
            a.lanes.send(to, [second(members, numel, data)])
            await until(lambda: b.stats.messages_received >= received + 2, "the delivery after it", 30.0)
            return {(kind, index) for _, _, kind, index in a.lanes.acks_awaited}
        finally:
            await stop_all([a, b])

    return asyncio.run(main())


def test_a_rounds_results_do_not_wait_behind_its_own_unacknowledged_parts(dhts) -> None:
    """A bulk delivery holds its peer's link until it is acknowledged, so that a later round's
    slices wait their turn, but a round's own RESULTs go while its PARTs to that peer are still
    unacknowledged (its owner sends them back while later pieces arrive: ``swarm/lanes.py``)."""
    awaited = sent_behind_an_unacknowledged_delivery(
        dhts, lambda members, numel, data: Result("unopened", members, 0, 0, numel, data)
    )
    assert (int(Code.PART), 1) in awaited  # the PART's wait holds on: the RESULT went beside it


def test_a_delivery_of_a_group_left_does_not_hold_up_the_link(dhts) -> None:
    """A bulk delivery waits for its acknowledgement before the next one to that peer is written.
    One of a group this peer has left (a lying leader's private pair, ``RoundMachine._on_group``)
    is never acknowledged: a delivery of the same round and kind with another index (the new
    group's) releases that wait and goes at once (in a real swarm: every round the forger led
    waited 2 s, and so did the next bulk delivery to it, of any round)."""
    awaited = sent_behind_an_unacknowledged_delivery(
        dhts, lambda members, numel, data: Part("unopened", members[::-1], 0, 0, numel, data)
    )
    assert (int(Code.PART), 1) not in awaited  # the left group's wait was released


def test_a_peer_sending_payloads_of_the_wrong_size_fails_the_round_not_the_peer(dhts) -> None:
    async def main():
        # the second peer speaks bf16 where the run uses fp32: every payload has the wrong size
        exchanges = await make_pair(dhts, ("fp32", "bf16"), timeout=2.0)
        vector = torch.ones(512)
        try:
            results = await asyncio.gather(
                *(ex.allreduce("bad", vector, 1) for ex in exchanges), return_exceptions=True
            )
            # and the same exchanges still average correctly afterwards
            exchanges[1].codec = get_codec("fp32")
            good = await asyncio.gather(*(ex.allreduce("good", vector * 3, 2) for ex in exchanges))
        finally:
            await stop_all(exchanges)
        return results, good

    results, good = asyncio.run(main())
    assert all(isinstance(r, RoundFailed) for r in results), results
    assert all(torch.equal(g, torch.full((512,), 3.0)) for g in good)


def test_a_peer_left_out_of_a_round_takes_the_members_average(dhts) -> None:
    async def main():
        exchanges = await make_pair(dhts, timeout=0.5)
        leader, late = sorted(exchanges, key=lambda ex: leader_rank("late", ex.peer_id))
        try:
            # the leader waits its deadline for the other peer (the board says it is at the step),
            # probes it, and averages alone; the late peer then reaches the round, finds it was left
            # out, and must still end with that average
            first = await leader.allreduce("late", torch.full((300,), 2.0), 1)
            second = await late.allreduce("late", torch.full((300,), 7.0), 1)
            return first, second, late.stats
        finally:
            await stop_all(exchanges)

    first, second, stats = asyncio.run(main())
    assert torch.equal(first, torch.full((300,), 2.0))
    assert torch.equal(second, first) and stats.rounds_done == 1 and stats.rounds_failed == 0


GARBAGE = [
    b"\x00\x00\x00\x05garbage",  # not msgpack
    (0xFFFFFFFF).to_bytes(4, "big"),  # a header announcing 4 GiB
    b"\x00\x00\x00\x03" + msgpack.packb([1, 2]),  # not a map
    b"\x00\x00\x00\x00",  # empty body
    b"\x00\x00\x00\x0b" + msgpack.packb({"code": 1}),  # a join without a round
    b"\x00\x00",  # a stream that ends inside the header
]


def test_garbage_on_the_stream_is_dropped_and_changes_nothing(dhts) -> None:
    async def main():
        exchanges = await make_pair(dhts)
        try:
            for raw in GARBAGE:
                await send_raw(exchanges[1].p2p, exchanges[0], raw)
            opened = dict(exchanges[0].open)
            rejected = exchanges[0].stats.messages_rejected
            average = await asyncio.gather(*(ex.allreduce("after", torch.ones(8), 1) for ex in exchanges))
        finally:
            await stop_all(exchanges)
        return opened, rejected, average

    opened, rejected, average = asyncio.run(main())
    assert opened == {} and rejected == len(GARBAGE)
    assert all(torch.equal(a, torch.ones(8)) for a in average)


def test_stray_rounds_are_bounded_refused_and_forgotten(dhts, monkeypatch) -> None:
    monkeypatch.setattr(exchange_module, "MAX_OPEN_ROUNDS", 8)

    async def main():
        exchanges = await make_pair(dhts, timeout=0.5)
        target, member = exchanges
        stranger = await dhts[2].replicate_p2p()  # a peer of no run: not on anyone's board
        try:
            for i in range(20):  # a member opening rounds without end: capped, never an exception
                await send(member.p2p, target, Join(f"stray-{i}", 1, "fp"))
            after_member = len(target.open)
            for i in range(10):  # a stranger gets fewer still
                await send(stranger, target, Fetch(f"strange-{i}", 1))
            after_stranger = len(target.open)
            # our own rounds are never refused, whatever strays are open
            average = await asyncio.gather(*(ex.allreduce("mine", torch.ones(8), 1) for ex in exchanges))
            # strays this peer never reaches are forgotten after their expiry
            target.round_timeout_s, target.record_ttl_s = 0.1, 0.05  # what its deadlines follow
            target.deadlines = target.current_deadlines()
            await until(lambda: not target._not_reached(), "the stray rounds to expire")
        finally:
            await stop_all(exchanges)
            await stranger.shutdown()
        return after_member, after_stranger, average

    after_member, after_stranger, average = asyncio.run(main())
    assert after_member == 8 and after_stranger == 8  # full: the stranger opened none
    assert all(torch.equal(a, torch.ones(8)) for a in average)


def test_a_stranger_is_refused_and_counted_and_a_member_opens_only_so_many_rounds(dhts) -> None:
    async def main():
        exchanges = await make_pair(dhts)
        target, member = exchanges
        stranger = await dhts[2].replicate_p2p()
        try:
            for i in range(10):  # a peer with no record on the board: heard on nothing
                await send(stranger, target, Join(f"strange-{i}", 0, "fp"))
            opened_by_stranger = len(target.open)
            limit = target.limiter.limits.open_rounds
            for i in range(limit + 5):  # a member opening rounds without end
                await send(member.p2p, target, Join(f"flood-{i}", 1, "fp"))
            return opened_by_stranger, len(target.open), limit, target.limiter.refused, stranger.peer_id
        finally:
            await stop_all(exchanges)
            await stranger.shutdown()

    opened_by_stranger, opened, limit, refused, stranger_id = asyncio.run(main())
    assert opened_by_stranger == 0
    assert refused[stranger_id.to_base58()] == 10
    assert opened == limit  # the member's rounds past the limit were refused, and counted
    assert sum(refused.values()) == 10 + 5


def test_a_frame_larger_than_the_runs_largest_message_is_refused_before_it_is_read(dhts) -> None:
    async def main():
        p2ps = [await d.replicate_p2p() for d in dhts[:2]]
        ids = [p.peer_id.to_base58() for p in p2ps]
        board = {peer: record(i) for i, peer in enumerate(ids)}
        codec = get_codec("fp32")
        target = FragmentExchange(p2ps[0], "t", codec, 0, "fp", lambda: board, 5.0, max_frame=1000)
        await target.start()
        try:
            await send_raw(p2ps[1], target, (1001).to_bytes(4, "big") + b"x" * 16)
            return target.stats.messages_rejected, target.limiter.buffered
        finally:
            await target.stop()
            for p2p in p2ps:
                await p2p.shutdown()

    rejected, buffered = asyncio.run(main())
    assert rejected == 1 and not buffered  # refused at the header: nothing held for it


@pytest.mark.parametrize(
    "body",
    [
        {"code": 99, "round": "r"},
        {"code": int(Code.PART), "round": "r", "members": [["a", 0]], "index": 0, "numel": 3, "data": "text"},
        {"code": int(Code.PART), "round": "r", "members": [["a", 0]], "index": True, "numel": 3, "data": b""},
        {"code": int(Code.PART), "round": "r", "members": [["a", 0]], "index": 0, "numel": -1, "data": b""},
        {"code": int(Code.PART), "round": "r", "members": [["a", 0]], "index": 4, "numel": 3, "data": b""},
        {"code": int(Code.RESULT), "round": "r", "index": 0, "numel": 3, "data": b""},
        {"code": int(Code.PROBE), "round": "r", "shard": -1, "fingerprint": "x"},
        {"code": int(Code.JOIN), "round": "", "shard": 0, "fingerprint": "x"},
        {"code": int(Code.JOIN), "round": "r" * 65, "shard": 0, "fingerprint": "x"},
        {"code": int(Code.JOIN), "round": "r", "shard": 0.5, "fingerprint": "x"},
        {"code": int(Code.LEADER), "round": "r", "leader": ""},
        {"code": int(Code.JOIN), "round": "r", "shard": 0, "fingerprint": "x", "pace": -1},
        {"code": int(Code.JOIN), "round": "r", "shard": 0, "fingerprint": "x"},  # no pace
        {"code": int(Code.GROUP), "round": "r", "members": [["a", 0]], "pace": "6"},
        {"code": int(Code.GROUP), "round": "r", "members": [["a", 0]], "pace": 1 << 30},
        {"code": int(Code.GROUP), "round": "r", "members": [["a", 0]], "pace": True},
        {"code": int(Code.FETCH), "round": "r"},
        {"code": int(Code.STATUS), "round": "r", "status": 42, "detail": "", "ask": 0},
        {"code": int(Code.ACK), "round": "r", "kind": int(Code.JOIN), "index": 0},
        [1, 2, 3],
    ],
)
def test_messages_are_type_checked(body) -> None:
    with pytest.raises(BadMessage):
        parse_message(body)


@pytest.mark.parametrize(
    "members",
    [None, [], [["a", 0], ["a", 1]], [["a", -1]], [[1, 0]], [["a", 0, "extra"]], [["", 0]]],
)
def test_member_lists_are_checked(members) -> None:
    with pytest.raises(BadMessage):
        parse_members(members)


@pytest.mark.parametrize(("numel", "parts", "block"), [(10, 3, 1), (1000, 3, 256), (5, 4, 64), (0, 2, 1)])
def test_slices_cover_the_vector_on_block_edges(numel: int, parts: int, block: int) -> None:
    bounds = slice_bounds(numel, parts, block)
    assert bounds[0] == 0 and bounds[-1] == numel and len(bounds) == parts + 1
    assert all(a <= b for a, b in zip(bounds, bounds[1:], strict=False))
    assert all(b % block == 0 for b in bounds[:-1])


def test_deadlines_follow_the_declared_and_the_measured_link(dhts) -> None:
    """At 2 Mbit/s a member's answers wait behind seconds of fragment data: the round's deadlines
    allow for the slowest of the declared link, the measured send rate and 10 Mbit/s, and for two
    rounds of data queued ahead of an answer; on a fast link they are what they always were."""

    async def main() -> None:
        p2p = await dhts[0].replicate_p2p()
        thin = FragmentExchange(p2p, "t", get_codec("fp32"), 0, "fp", dict, 60.0, 8.0, 2.0, 4_000_000)
        fast = FragmentExchange(p2p, "t", get_codec("fp32"), 0, "fp", dict, 60.0, 8.0, 50.0, 0)
        try:
            declared = thin.current_deadlines()
            assert declared.slowest_link_mbps == 2.0
            assert declared.answer_s == pytest.approx(16.0 + 8 * 2 * 4e6 / 2e6)  # + 32 s of queued data
            thin.stats.bandwidth_mbps = 1.5  # measured slower than declared
            assert thin.current_deadlines().slowest_link_mbps == 1.5
            thin.stats.bandwidth_mbps = 0.01  # a stalled measurement: never below 1 Mbit/s
            assert thin.current_deadlines().slowest_link_mbps == 1.0
            assert fast.current_deadlines() == exchange_module.Deadlines(60.0, answer_s=16.0, heard_s=8.0)
        finally:
            await p2p.shutdown()

    asyncio.run(main())


def test_the_link_meter_counts_overlapping_deliveries_once_per_round() -> None:
    meter = LinkMeter()
    assert meter.busy_per_round_s("fp4") == 0.0  # nothing measured: no wish
    # round a: slices to two members at once (0-4 s and 1-5 s) and results (6-8 s); round b: 10-11 s
    for start, end, round_id in [(0, 4, "a"), (1, 5, "a"), (6, 8, "a"), (6, 7.5, "a"), (10, 11, "b")]:
        meter.record(start, end, round_id, "fp4")
    meter.record(12, 12.25, "c", "q2")  # a paced round, smaller: timed apart
    assert meter.busy_per_round_s("fp4") == pytest.approx((5 + 2 + 1) / 2) and meter.rounds("fp4") == 2
    assert meter.busy_per_round_s("q2") == pytest.approx(0.25) and meter.rounds("q2") == 1
    for i in range(lanes_module.LINK_WINDOW):  # old deliveries leave the window
        meter.record(20 + i, 20.5 + i, f"r{i}", "fp4")
    assert meter.busy_per_round_s("fp4") == pytest.approx(0.5) and meter.busy_per_round_s("q2") == 0.0


def test_the_link_meter_times_a_sync_from_its_send_to_its_result() -> None:
    """A sync's landing time (``paced_spacing``'s D): the median of the last ``LANDING_WINDOW`` of its
    codec; for a codec not landed yet, another codec's with the link time per round swapped."""
    meter = LinkMeter()
    fp32, q2 = get_codec("fp32"), get_codec("q2")

    def size(codec: Codec) -> int:
        return {"fp32": 1600, "q2": 100}[codec.name]

    assert meter.landing_s(fp32, [q2], size) == 0.0 and meter.landed_rounds("fp32") == 0
    meter.record(0, 0.8, "a", "fp32")  # fp32's rounds keep the link busy 0.8 s
    for seconds in (1.0, 3.0, 1.2):
        meter.landed("fp32", seconds)
    assert meter.landing_s(fp32, [q2], size) == pytest.approx(1.2) and meter.landed_rounds("fp32") == 3
    # q2, not landed yet: fp32's 1.2 s less its 0.8 s on the link, plus q2's 0.05 s (1/16 the bytes)
    assert meter.landing_s(q2, [fp32], size) == pytest.approx(0.45)
    for _ in range(lanes_module.LANDING_WINDOW):  # old landings leave the window
        meter.landed("fp32", 0.5)
    assert meter.landing_s(fp32, [], size) == pytest.approx(0.5)
