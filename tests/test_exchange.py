"""The fragment exchange in one process: real hivemind DHTs and libp2p streams on 127.0.0.1.

Checks what the multi-process tests cannot reach cheaply: exact averages for every codec, and
malformed or hostile messages answered with an error while the exchange keeps working.
"""

from __future__ import annotations

import asyncio
import math
import struct
from collections.abc import Callable

import msgpack
import pytest
import torch

from p2p_cocodc.codecs import CODECS, get_codec
from p2p_cocodc.swarm.dht import p2pd_socket, start_dht, stop_dht
from p2p_cocodc.swarm.exchange import FragmentExchange, RoundFailed, slice_bounds
from p2p_cocodc.swarm.records import PeerRecord
from p2p_cocodc.swarm.wire import BadMessage, Request, parse_members, parse_request, read_frame


def record(shard: int, step: int = 0) -> PeerRecord:
    return PeerRecord("training", step, shard, 2, 0.01, 0.0, "fp")


@pytest.fixture
def dhts():
    """Two fresh DHT nodes per test: a P2P replica is bound to the event loop that first used it."""
    first = start_dht([], "127.0.0.1", 0)
    second = start_dht([str(first.get_visible_maddrs()[0])], "127.0.0.1", 0)
    sockets = [p2pd_socket(d) for d in (first, second)]
    yield first, second
    for dht, path in zip((second, first), reversed(sockets), strict=True):
        stop_dht(dht, path)


async def make_pair(
    dhts,
    codecs=("fp32", "fp32"),
    timeout=5.0,
    kinds=(FragmentExchange, FragmentExchange),
    views: Callable[[list[str]], list[dict[str, PeerRecord]]] | None = None,
) -> list[FragmentExchange]:
    """Two exchanges; by default both see both peers training on the board, ``views`` overrides."""
    p2ps = [await d.replicate_p2p() for d in dhts]
    ids = [p.peer_id.to_base58() for p in p2ps]
    boards = views(ids) if views else [{peer: record(i) for i, peer in enumerate(ids)}] * 2
    exchanges = [
        kind(p2p, "t", get_codec(codec), i, "fp", lambda board=board: board, timeout)
        for i, (p2p, codec, kind, board) in enumerate(zip(p2ps, codecs, kinds, boards, strict=True))
    ]
    for ex in exchanges:
        await ex.start()
    return exchanges


async def stop_all(exchanges: list[FragmentExchange]) -> None:
    for ex in exchanges:
        await ex.stop()
        await ex.p2p.shutdown()


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
        return vectors, results

    vectors, results = asyncio.run(main())
    exact = (vectors[0] + vectors[1]) / 2
    for codec, (a, b) in results.items():
        assert torch.equal(a, b), codec  # bit-identical on both peers, whatever the codec
        tolerance = {"fp32": 0.0, "bf16": 0.02, "int8": 0.05, "fp4": 2.0}[codec]
        assert float((a - exact).abs().max()) <= tolerance, codec


def test_a_peer_sending_malformed_payloads_fails_the_round_not_the_peer(dhts) -> None:
    async def main():
        # the second peer speaks bf16 where the run uses fp32: every payload has the wrong size
        exchanges = await make_pair(dhts, ("fp32", "bf16"), timeout=3.0)
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
    assert all(isinstance(r, RoundFailed) for r in results)
    assert any("bad payload" in str(r) for r in results)
    assert all(torch.equal(g, torch.full((512,), 3.0)) for g in good)


GARBAGE = [
    b"\x00\x00\x00\x05garbage",  # not msgpack
    struct.pack(">I", 0xFFFFFFFF),  # a header announcing 4 GiB
    b"\x00\x00\x00\x03" + msgpack.packb([1, 2]),  # not a map
    b"\x00\x00\x00\x00",  # empty body
    b"\x00\x00\x00\x0b" + msgpack.packb({"kind": "join"}),  # a join without a round
]


def test_garbage_on_the_stream_gets_an_error_reply_and_changes_nothing(dhts) -> None:
    async def main():
        exchanges = await make_pair(dhts)
        replies = []
        try:
            for raw in GARBAGE:
                _, reader, writer = await exchanges[1].p2p.call_binary_stream_handler(
                    exchanges[0].p2p.peer_id, exchanges[0].protocol
                )
                writer.write(raw)
                await writer.drain()
                replies.append(await read_frame(reader, 10))
                writer.close()
            # a stream that ends inside the header: nobody to answer, nothing may break
            _, reader, writer = await exchanges[1].p2p.call_binary_stream_handler(
                exchanges[0].p2p.peer_id, exchanges[0].protocol
            )
            writer.write(b"\x00\x00")
            await writer.drain()
            writer.close()
            average = await asyncio.gather(*(ex.allreduce("after", torch.ones(8), 1) for ex in exchanges))
        finally:
            await stop_all(exchanges)
        return replies, average, exchanges[0].rounds

    replies, average, open_rounds = asyncio.run(main())
    assert all(r["ok"] is False and r["error"] for r in replies), replies
    assert all(torch.equal(a, torch.ones(8)) for a in average)
    assert open_rounds == {}


@pytest.mark.parametrize(
    "body",
    [
        {"kind": "spam", "round": "r"},
        {"kind": "part", "round": "r", "group": "g", "slice": 0, "numel": 3, "data": "text"},
        {"kind": "part", "round": "r", "group": "g", "slice": True, "numel": 3, "data": b""},
        {"kind": "part", "round": "r", "group": "g", "slice": 0, "numel": -1, "data": b""},
        {"kind": "part", "round": "r", "slice": 0, "numel": 3, "data": b""},
        {"kind": "result", "round": "r", "group": "g" * 33, "slice": 0, "numel": 3, "data": b""},
        {"kind": "probe", "round": "r", "shard": -1, "fingerprint": "x"},
        {"kind": "join", "round": "", "shard": 0, "fingerprint": "x"},
        {"kind": "join", "round": "r" * 65, "shard": 0, "fingerprint": "x"},
        {"kind": "join", "round": "r", "shard": 0.5, "fingerprint": "x"},
    ],
)
def test_requests_are_type_checked(body: dict) -> None:
    with pytest.raises(BadMessage):
        parse_request(body)


def test_received_nan_is_refused(dhts) -> None:
    async def main():
        exchanges = await make_pair(dhts)
        await stop_all(exchanges)
        return exchanges[0]

    ex = asyncio.run(main())
    nan = struct.pack("<3f", 1.0, math.nan, 2.0)
    with pytest.raises(RoundFailed, match="NaN"):
        ex._decode({"peer": ("g", 0, 3, nan)}, "peer", "g", 0, 3)
    with pytest.raises(RoundFailed, match="expected slice 1"):
        ex._decode({"peer": ("g", 0, 3, nan)}, "peer", "g", 1, 3)
    ones = struct.pack("<3f", 1.0, 1.0, 1.0)
    with pytest.raises(RoundFailed, match="another group"):  # a slice meant for another member list
        ex._decode({"peer": ("other", 0, 3, ones)}, "peer", "g", 0, 3)


@pytest.mark.parametrize(("numel", "parts", "block"), [(10, 3, 1), (1000, 3, 256), (5, 4, 64), (0, 2, 1)])
def test_slices_cover_the_vector_on_block_edges(numel: int, parts: int, block: int) -> None:
    bounds = slice_bounds(numel, parts, block)
    assert bounds[0] == 0 and bounds[-1] == numel and len(bounds) == parts + 1
    assert all(a <= b for a, b in zip(bounds, bounds[1:], strict=False))
    assert all(b % block == 0 for b in bounds[:-1])


@pytest.mark.parametrize(
    "reply",
    [
        {"ok": True},
        {"ok": True, "members": []},
        {"ok": True, "members": [["a", 0], ["a", 1]]},
        {"ok": True, "members": [["a", -1]]},
        {"ok": True, "members": [[1, 0]]},
        {"ok": True, "members": [["a", 0, "extra"]]},
    ],
)
def test_member_lists_from_a_leader_are_checked(reply: dict) -> None:
    with pytest.raises(BadMessage):
        parse_members(reply)


def test_a_peer_left_out_of_a_round_takes_the_members_average(dhts) -> None:
    async def main():
        exchanges = await make_pair(dhts, timeout=0.5)
        leader, late = sorted(exchanges, key=lambda ex: ex.peer_id)
        try:
            # the leader waits 0.5 s for the other peer (the board says it is at the step), then
            # averages alone; the late peer arrives after that and must still end with that average
            first = asyncio.ensure_future(leader.allreduce("late", torch.full((300,), 2.0), 1))
            await asyncio.sleep(2.0)
            second = await late.allreduce("late", torch.full((300,), 7.0), 1)
            return await first, second, late.stats.rounds_done
        finally:
            await stop_all(exchanges)

    leaders, lates, done = asyncio.run(main())
    assert torch.equal(leaders, torch.full((300,), 2.0))
    assert torch.equal(lates, leaders) and done == 1


class LosesItsAveragedSlice(FragmentExchange):
    """A member whose averaged slice never reaches the others, as when it dies halfway through
    sending it: the network fault is injected here, everything else is the real exchange."""

    async def _send_all(self, round_id, kind, group, slices, deadline) -> None:
        if kind != "result":
            await super()._send_all(round_id, kind, group, slices, deadline)


def test_a_member_missing_an_averaged_slice_takes_the_average_another_member_completed(dhts) -> None:
    async def main():
        kinds = (FragmentExchange, LosesItsAveragedSlice)
        exchanges = await make_pair(dhts, timeout=1.0, kinds=kinds)
        vectors = [torch.full((700,), 1.0), torch.full((700,), 4.0)]
        try:
            results = await asyncio.gather(
                *(ex.allreduce("lost", v, 1) for ex, v in zip(exchanges, vectors, strict=True))
            )
            return results, [(ex.stats.rounds_done, ex.stats.rounds_failed) for ex in exchanges]
        finally:
            await stop_all(exchanges)

    (missing, complete), counts = asyncio.run(main())
    # without recovery the first peer would fail the round while the second applied it: a split θ̄
    assert torch.equal(complete, torch.full((700,), 2.5))
    assert torch.equal(missing, complete)
    assert counts == [(1, 0), (1, 0)]


def test_a_round_no_member_completed_fails_on_every_member(dhts) -> None:
    async def main():
        kinds = (LosesItsAveragedSlice, LosesItsAveragedSlice)
        exchanges = await make_pair(dhts, timeout=1.0, kinds=kinds)
        try:
            return await asyncio.gather(
                *(ex.allreduce("none", torch.ones(300), 1) for ex in exchanges), return_exceptions=True
            )
        finally:
            await stop_all(exchanges)

    results = asyncio.run(main())
    assert all(isinstance(r, RoundFailed) for r in results), results
    assert all("no member completed the round" in str(r) for r in results)


def smaller_id_hidden_from_the_larger(ids: list[str], step: int = 0) -> list[dict[str, PeerRecord]]:
    """Views of the board that disagree, as for a few seconds after a peer dies: the peer with the
    larger id does not see the smaller one; the smaller sees both (the larger at ``step``)."""
    small, big = sorted(ids)
    full = {small: record(ids.index(small)), big: record(ids.index(big), step)}
    return [full if peer == small else {big: full[big]} for peer in ids]


def test_a_peer_that_led_alone_unseen_is_followed_not_split_from(dhts) -> None:
    async def main():
        exchanges = await make_pair(dhts, timeout=1.0, views=smaller_id_hidden_from_the_larger)
        small, big = sorted(exchanges, key=lambda ex: ex.peer_id)
        try:
            # the larger id sees nobody else: it leads its own group of one and finishes; the
            # smaller one waits for it, then asks it, adopts that group and takes its average
            alone = await big.allreduce("unseen", torch.full((300,), 5.0), 1)
            follower = await small.allreduce("unseen", torch.full((300,), 1.0), 1)
            return alone, follower, [(ex.stats.rounds_done, ex.stats.rounds_failed) for ex in exchanges]
        finally:
            await stop_all(exchanges)

    alone, follower, counts = asyncio.run(main())
    # before: the smaller id formed its own group of one at its deadline, a split θ̄
    assert torch.equal(alone, torch.full((300,), 5.0))
    assert torch.equal(follower, alone)
    assert counts == [(1, 0), (1, 0)]


def test_a_peer_that_hears_from_a_smaller_unseen_id_yields_the_lead_to_it(dhts) -> None:
    async def main():
        views = lambda ids: smaller_id_hidden_from_the_larger(ids, step=1)  # noqa: E731
        exchanges = await make_pair(dhts, timeout=5.0, views=views)
        small, big = sorted(exchanges, key=lambda ex: ex.peer_id)
        try:
            # the smaller id leads and sees the larger one past the round's step: it asks it; the
            # larger one, on reaching the round, joins that leader instead of leading alone
            first = asyncio.ensure_future(small.allreduce("heard", torch.full((300,), 1.0), 1))
            await asyncio.sleep(1.0)
            second = await big.allreduce("heard", torch.full((300,), 5.0), 1)
            return await first, second
        finally:
            await stop_all(exchanges)

    first, second = asyncio.run(main())
    assert torch.equal(first, torch.full((300,), 3.0))  # one group of both: the true mean
    assert torch.equal(second, first)


def test_a_leader_asked_for_the_average_stops_waiting_for_the_asker(dhts) -> None:
    async def main():
        exchanges = await make_pair(dhts, timeout=30.0)
        leader, asker = sorted(exchanges, key=lambda ex: ex.peer_id)
        try:
            # the asker failed its own group of the round and asks the leader, which is still
            # waiting for it to join: it must form without the asker and serve it the result
            led = asyncio.ensure_future(leader.allreduce("asked", torch.full((300,), 4.0), 1))
            await asyncio.sleep(0.5)
            reply = await asker._call(leader.peer_id, Request("fetch", "asked"), 60)
            return await led, reply, leader.served["asked"][0]
        finally:
            await stop_all(exchanges)

    average, reply, members = asyncio.run(main())
    assert reply["ok"], reply  # before: "still running here" after 30 s, and the leader formed alone later
    assert torch.equal(get_codec("fp32").decode(reply["data"], 300), average)
    assert len(members) == 1 and torch.equal(average, torch.full((300,), 4.0))


def test_a_leader_fails_a_round_a_live_peer_has_already_failed(dhts) -> None:
    async def main():
        exchanges = await make_pair(dhts, timeout=0.5)
        leader, early = sorted(exchanges, key=lambda ex: ex.peer_id)
        try:
            # the larger id reaches the round first and gives up waiting for its leader; when the
            # leader gets there it must not average alone what the other peer will never apply
            runs = []
            for ex in (early, leader):
                runs += await asyncio.gather(ex.allreduce("gone", torch.ones(300), 1), return_exceptions=True)
                await asyncio.sleep(0.5)  # the leader arrives a moment later
            return runs
        finally:
            await stop_all(exchanges)

    gave_up, late = asyncio.run(main())
    assert isinstance(gave_up, RoundFailed), gave_up
    assert isinstance(late, RoundFailed) and "already failed the round" in str(late), late
