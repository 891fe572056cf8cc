"""The swarm's notice board: small, expiring DHT records that say who is alive and how far along.

Every peer publishes one record under its run's key (subkey = its peer id) every heartbeat; a record
that is not refreshed expires, and that is how the others learn a peer has gone. Values stay far
below the ~15 KiB where hivemind's DHT pipe can wedge (see research/hivemind_probe.md), and every
call has a deadline, because a wedged DHT process would otherwise hang its caller forever.
Records from other peers are untrusted: a malformed one is dropped, never raised into the loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from p2p_cocodc.errors import UserError

log = logging.getLogger(__name__)

RUNS_KEY = "p2p-cocodc.runs"
STATES = ("waiting", "training", "done", "leaving")
MAX_FRAGMENTS = 4096


def peers_key(run_id: str) -> str:
    return f"p2p-cocodc.{run_id}.peers"


def check_run_id(run_id: str) -> str:
    if not run_id or len(run_id) > 64 or not all(c.isalnum() or c in "-_" for c in run_id):
        raise UserError(f"--run-id {run_id!r}: use 1-64 letters, digits, '-' or '_'")
    return run_id


@dataclass(frozen=True)
class PeerRecord:
    """What one peer tells the others about itself; every field is checked when read back."""

    state: str
    step: int
    shard: int | None
    num_shards: int
    step_time_s: float
    bandwidth_mbps: float
    fingerprint: str
    versions: list[int] = field(default_factory=list)
    stall_s: float = 0.0
    bytes_sent: int = 0

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, value: Any) -> PeerRecord | None:
        """The record, or None when a peer sent something that is not one."""
        if not isinstance(value, dict) or set(value) != {f for f in cls.__dataclass_fields__}:
            return None
        v = value
        ints = (v["step"], v["num_shards"], v["bytes_sent"])
        floats = (v["step_time_s"], v["bandwidth_mbps"], v["stall_s"])
        ok = (
            v["state"] in STATES
            and all(_is_int(i) and i >= 0 for i in ints)
            and (v["shard"] is None or (_is_int(v["shard"]) and 0 <= v["shard"] < v["num_shards"]))
            and all(_is_number(x) and x >= 0 for x in floats)
            and isinstance(v["fingerprint"], str)
            and len(v["fingerprint"]) <= 64
            and isinstance(v["versions"], list)
            and len(v["versions"]) <= MAX_FRAGMENTS
            and all(_is_int(x) and x >= 0 for x in v["versions"])
        )
        return cls(**v) if ok else None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return (_is_int(x) or isinstance(x, float)) and math.isfinite(x)


class Board:
    """Publish this peer's record and read everyone's, each call bounded by ``timeout``."""

    def __init__(self, dht: Any, run_id: str, peer_id: str, ttl_s: float, timeout: float = 5.0) -> None:
        self.dht = dht
        self.run_id = run_id
        self.peer_id = peer_id
        self.ttl_s = ttl_s
        self.timeout = timeout

    async def publish(self, record: PeerRecord, run_info: dict[str, Any] | None = None) -> None:
        from hivemind.utils import get_dht_time

        expires = get_dht_time() + self.ttl_s
        stores = [(peers_key(self.run_id), self.peer_id, record.to_wire())]
        if run_info is not None:
            stores.append((RUNS_KEY, self.run_id, run_info))
        await asyncio.gather(
            *(
                self._bounded(
                    self.dht.store(key, value, expires, subkey=subkey, return_future=True), f"store {key}"
                )
                for key, subkey, value in stores
            )
        )

    async def peers(self) -> dict[str, PeerRecord]:
        """Live peers of the run (this one included once it has published), by peer id."""
        found = await self._get(peers_key(self.run_id))
        records = {}
        for peer, value in found.items():
            record = PeerRecord.from_wire(value)
            if record is None:
                log.warning("ignoring a malformed record from peer %s", peer[:16])
            else:
                records[peer] = record
        return records

    async def runs(self) -> dict[str, Any]:
        return await self._get(RUNS_KEY)

    async def _get(self, key: str) -> dict[str, Any]:
        future = self.dht.get(key, latest=True, return_future=True)
        found = await self._bounded(future, f"get {key}")
        if found is None or not isinstance(found.value, dict):
            return {}
        return {str(sub): item.value for sub, item in found.value.items() if hasattr(item, "value")}

    async def _bounded(self, future: Any, what: str) -> Any:
        if not self.dht.is_alive():
            raise ConnectionError("the DHT process has died")
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout)
        except TimeoutError:
            future.cancel()
            raise ConnectionError(f"DHT {what} took longer than {self.timeout:.0f} s") from None
