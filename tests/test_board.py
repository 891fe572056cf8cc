"""The notice board on real hivemind DHT nodes: what a record carries, that a publish counts only
once another node holds it, and the bounds derived from hivemind's own request path."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from p2p_cocodc.swarm import records
from p2p_cocodc.swarm.dht import p2pd_socket, rpc_timeout_s, start_dht, stop_dht, store_limit_s
from p2p_cocodc.swarm.records import Board, PeerRecord


def record(**changes: Any) -> PeerRecord:
    return replace(PeerRecord("training", 3, 0, 2, 0.25, 1.0, "f" * 16, [1, 2]), **changes)


@pytest.fixture
def dhts():
    first = start_dht([], "127.0.0.1", 0)
    nodes = [first] + [start_dht([str(first.get_visible_maddrs()[0])], "127.0.0.1", 0) for _ in range(2)]
    sockets = [p2pd_socket(d) for d in nodes]
    yield nodes
    for dht, path in zip(reversed(nodes), reversed(sockets), strict=True):
        stop_dht(dht, path)


def private_bytes(pid: int) -> int:
    """A process's unique memory (USS): its private pages, clean and dirty."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]
    )
    return sum(int(fields[k].split()[0]) * 1024 for k in ("Private_Clean", "Private_Dirty"))


def test_the_dht_process_gives_up_the_buffers_its_parent_goes_on_writing() -> None:
    """The DHT runs in a process forked from the peer: without giving them up, a model's pages the
    peer writes after the fork (here 384 MB) would become the DHT process's own copies."""
    buffer = torch.ones(96 << 20)
    dht = start_dht([], "127.0.0.1", 0, left_to_parent=[(buffer.data_ptr(), buffer.nbytes)])
    path = p2pd_socket(dht)
    try:
        buffer.add_(1.0)  # every page written after the fork
        assert private_bytes(dht.pid) < 300 << 20
        assert float(buffer[-1]) == 2.0  # the parent's buffer is whole
    finally:
        stop_dht(dht, path)


def test_the_limit_is_hiveminds_own_request_path() -> None:
    assert rpc_timeout_s() == 3.0  # hivemind 1.1.12's wait_timeout, which start_dht leaves alone
    assert store_limit_s() == 10.0  # 2 search rounds + 1 store round of 3 s, + 1 s


def test_a_record_carries_its_lifetime_and_another_node_holds_it(dhts) -> None:
    me, other = (d.peer_id.to_base58() for d in dhts[1:3])  # a record's subkey is its writer's id
    writer, reader = Board(dhts[1], "r", me, ttl_s=8), Board(dhts[2], "r", other, ttl_s=8)

    async def main() -> dict[str, PeerRecord]:
        await writer.publish(record(), {"algo": "cocodc"})
        return await reader.peers()

    assert asyncio.run(main()) == {me: record(ttl_s=8)}
    assert writer.failed == 0 and writer.timeout == store_limit_s()
    assert len(repr(record(ttl_s=8).to_wire()).encode()) < 15 * 1024


@pytest.mark.parametrize("bad", [0, -1.0, records.MAX_LIFETIME_S + 1, float("nan"), "8"])
def test_a_record_with_a_bad_lifetime_is_dropped(bad: Any) -> None:
    wire = record().to_wire()
    wire["ttl_s"] = bad
    assert PeerRecord.from_wire(wire) is None


class CountingStores:
    """A DHT whose stores are counted by key (everything else is the real node's)."""

    def __init__(self, dht: Any) -> None:
        self.dht = dht
        self.keys: list[str] = []

    def store(self, key: str, *args: Any, **kwargs: Any) -> Any:
        self.keys.append(key)
        return self.dht.store(key, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dht, name)


def test_a_record_goes_out_when_the_others_act_on_a_change_or_its_refresh_is_due(dhts) -> None:
    """On a thin link the board's traffic competes with the fragments: progress figures alone wait
    for the refresh at a quarter of the lifetime; a change others act on goes out at the next beat."""
    me = dhts[1].peer_id.to_base58()
    board = Board(dhts[1], "r", me, ttl_s=8)
    assert board.due(record(), 0.0)  # nothing landed yet
    asyncio.run(board.publish(record(), {"algo": "cocodc"}))
    landed = board.landed_at
    progress = record(step=9, stall_s=1.5, versions=[3, 3], tokens_per_s=99.0, val_ppl=12.0)
    assert not board.due(progress, landed)
    assert not board.due(progress, landed + 8 / records.REFRESHES_PER_LIFETIME - 0.01)
    assert board.due(progress, landed + 8 / records.REFRESHES_PER_LIFETIME)
    for acted_on in (
        record(state="leaving"),
        record(theta_step=3, theta_sha="ab" * 8),
        record(sync_shape=[4, 2]),
        record(shard=1),
        record(joined_at=24),
    ):
        assert board.due(acted_on, landed), acted_on
    assert set(records.ACTED_ON) | records.PROGRESS == set(PeerRecord.__dataclass_fields__)


def test_the_run_info_rides_along_only_with_a_change_of_state_or_when_half_its_life_is_gone(dhts) -> None:
    me, other = (d.peer_id.to_base58() for d in dhts[1:3])
    spy = CountingStores(dhts[1])
    writer, reader = Board(spy, "r", me, ttl_s=8), Board(dhts[2], "r", other, ttl_s=8)

    async def main() -> dict[str, Any]:
        await writer.publish(record(state="waiting"), {"algo": "cocodc"})
        await writer.publish(record(state="waiting", step=4), {"algo": "cocodc"})  # info still young
        await writer.publish(record(), {"algo": "cocodc"})  # waiting -> training
        return await reader.runs()

    assert asyncio.run(main()) == {"r": {"algo": "cocodc"}}
    assert spy.keys == [
        records.peers_key("r"),
        records.RUNS_KEY,
        records.peers_key("r"),
        records.peers_key("r"),
        records.RUNS_KEY,
    ]
