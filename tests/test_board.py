"""The notice board under a slow DHT: bounds, one publish at a time, local-only stores, lifetimes."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest

from p2p_cocodc.errors import UserError
from p2p_cocodc.peer import Peer, SwarmOptions
from p2p_cocodc.swarm import records
from p2p_cocodc.swarm.dht import rpc_timeout_s, store_limit_s
from p2p_cocodc.swarm.records import Board, PeerRecord


def record(**changes: Any) -> PeerRecord:
    return PeerRecord("training", 3, 0, 2, 0.25, 1.0, "f" * 16, [1, 2], **changes)


class SlowDHT:
    """A hivemind.DHT stand-in: stores take ``delay`` s and answer ``result``; reads see the stores."""

    def __init__(self, delay: float = 0.0, result: bool = True) -> None:
        self.delay = delay
        self.result = result
        self.stores: list[dict[str, Any]] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.board: dict[str, Any] = {}

    def is_alive(self) -> bool:
        return True

    def store(self, key: str, value: Any, expires: float, subkey: Any = None, **kwargs: Any) -> Future[bool]:
        self.stores.append({"key": key, "value": value, "expires": expires, "subkey": subkey, **kwargs})
        mine = key.endswith(".peers")  # in flight at once: this peer's record stores
        self.in_flight += mine
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        future: Future[bool] = Future()

        def land() -> None:
            self.in_flight -= mine
            if self.result and key.endswith(".peers"):
                self.board[subkey] = SimpleNamespace(value=value)
            if not future.cancelled():
                future.set_result(self.result)

        threading.Timer(self.delay, land).start()
        return future

    def get(self, key: str, latest: bool = False, return_future: bool = True) -> Future[Any]:
        future: Future[Any] = Future()
        future.set_result(SimpleNamespace(value=dict(self.board)) if self.board else None)
        return future


def test_the_limit_is_hiveminds_own_request_path() -> None:
    assert rpc_timeout_s() == 3.0  # hivemind 1.1.12's wait_timeout, which start_dht leaves alone
    assert store_limit_s() == 10.0  # 2 search rounds + 1 store round of 3 s, + 1 s
    assert Board(SlowDHT(), "r", "me", ttl_s=8).timeout == store_limit_s()


def test_a_record_carries_its_lifetime_and_is_stored_remotely_only() -> None:
    dht = SlowDHT()
    board = Board(dht, "r", "me", ttl_s=8)
    took = asyncio.run(board.publish(record(), {"algo": "cocodc"}))
    assert took < 1 and board.failed == 0
    peers_store = dht.stores[0]
    assert peers_store["value"]["ttl_s"] == 8
    assert peers_store["exclude_self"] is True and peers_store["await_all_replicas"] is False
    assert PeerRecord.from_wire(peers_store["value"]) == record(ttl_s=8)
    assert len(repr(peers_store["value"]).encode()) < 15 * 1024
    assert asyncio.run(board.peers()) == {"me": record(ttl_s=8)}


def test_a_store_no_other_node_took_is_a_failed_publish() -> None:
    board = Board(SlowDHT(result=False), "r", "me", ttl_s=8)
    landed = board.landed_at
    with pytest.raises(ConnectionError, match="reached no other node"):
        asyncio.run(board.publish(record()))
    assert board.failed == 1 and board.landed_at == landed


def test_a_store_past_the_limit_fails_and_lengthens_the_lifetime() -> None:
    board = Board(SlowDHT(delay=0.5), "r", "me", ttl_s=0.2, timeout=0.1)
    with pytest.raises(ConnectionError, match="took longer than"):
        asyncio.run(board.publish(record()))
    assert board.failed == 1
    assert board.lifetime_s == pytest.approx(records.LIFETIME_FACTOR * 0.1)  # a failure counts as the limit


def test_the_lifetime_follows_the_slowest_recent_publish_and_never_shortens_an_expiry() -> None:
    dht = SlowDHT(delay=0.3)
    board = Board(dht, "r", "me", ttl_s=0.5)
    assert board.lifetime_s == 0.5
    asyncio.run(board.publish(record()))
    assert board.lifetime_s == pytest.approx(3 * 0.3, abs=0.1)
    assert board.give_up_s == records.GIVE_UP_S
    dht.delay = 0.0
    asyncio.run(board.publish(record()))  # still the slow one's lifetime: it is among the recent
    assert dht.stores[-1]["value"]["ttl_s"] == pytest.approx(0.9, abs=0.1)
    board.recent.clear()  # the slow publish has left the window: back to the healthy lifetime
    asyncio.run(board.publish(record()))
    assert dht.stores[-1]["value"]["ttl_s"] == 0.5
    expiries = [s["expires"] for s in dht.stores]
    assert expiries == sorted(expiries) and len(set(expiries)) == len(expiries)  # hivemind keeps the latest


def test_publishes_never_overlap() -> None:
    dht = SlowDHT(delay=0.2)
    board = Board(dht, "r", "me", ttl_s=8)

    async def main() -> None:
        first = asyncio.create_task(board.publish(record()))
        await asyncio.sleep(0.05)
        assert board.publishing
        await asyncio.gather(first, board.publish(record(bytes_sent=4)))  # the second waits for the first
        assert not board.publishing

    asyncio.run(main())
    assert dht.most_in_flight == 1 and len(dht.stores) == 2


@pytest.mark.parametrize("bad", [0, -1.0, records.MAX_LIFETIME_S + 1, float("nan"), "8"])
def test_a_record_with_a_bad_lifetime_is_dropped(bad: Any) -> None:
    wire = record().to_wire()
    wire["ttl_s"] = bad
    assert PeerRecord.from_wire(wire) is None


def bare_peer(heartbeat_s: float) -> Peer:
    peer = Peer.__new__(Peer)
    peer.opts = SwarmOptions(bootstrap="127.0.0.1:1", heartbeat_s=heartbeat_s)
    peer.cfg = SimpleNamespace(algo="cocodc", model="tiny", workers=2)  # type: ignore[assignment]
    peer.view, peer.last_seen = {}, {}
    peer._record = record  # type: ignore[method-assign]
    return peer


def test_the_heartbeat_skips_while_a_publish_is_in_flight_and_keeps_the_writers_lifetime() -> None:
    dht = SlowDHT(delay=0.35)
    board = Board(dht, "r", "me", ttl_s=0.05)
    peer = bare_peer(heartbeat_s=0.05)
    other = record(ttl_s=30.0).to_wire()

    async def main() -> None:
        dht.board["other"] = SimpleNamespace(value=other)
        beat = asyncio.create_task(peer._heartbeat(board))
        await asyncio.sleep(0.2)
        assert "other" in peer.view
        del dht.board["other"]  # its record is missed by our reads: kept for its own lifetime (30 s)
        await asyncio.sleep(0.9)
        beat.cancel()

    asyncio.run(main())
    assert dht.most_in_flight == 1  # never a second store while one is in flight, never cancelled
    assert board.skipped >= 5 and board.failed == 0
    assert "other" in peer.view


def test_the_heartbeat_gives_up_only_after_the_long_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records, "GIVE_UP_S", 0.6)
    board = Board(SlowDHT(result=False), "r", "me", ttl_s=0.05)
    peer = bare_peer(heartbeat_s=0.05)
    started = time.monotonic()
    with pytest.raises(UserError, match="lost the swarm's DHT: no publish reached another node") as err:
        asyncio.run(peer._heartbeat(board))
    assert time.monotonic() - started >= 0.6
    assert "reached no other node" in str(err.value)  # the last error says why


def test_the_heartbeat_gives_up_at_once_when_the_dht_process_dies() -> None:
    dht = SlowDHT()
    dht.is_alive = lambda: False  # type: ignore[method-assign]
    with pytest.raises(UserError, match="lost the swarm's DHT: its process has died"):
        asyncio.run(bare_peer(heartbeat_s=0.01)._heartbeat(Board(dht, "r", "me", ttl_s=8)))
