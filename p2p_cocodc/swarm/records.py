"""The swarm's notice board: small, expiring DHT records that say who is alive and how far along.

Every peer publishes one record under its run's key (subkey = its peer id): at the next heartbeat
when a field the others act on changed, else once a quarter of its lifetime has passed (``Board.due``:
on a thin link the board's own traffic competes with the fragments). A record that is not refreshed
expires, and that is how the others learn a peer has gone. Values stay far
below the ~15 KiB where hivemind's DHT pipe can wedge (see research/hivemind_probe.md), and every
call has a deadline, because a wedged DHT process would otherwise hang its caller forever.
Records from other peers are untrusted: a malformed one is dropped, never raised into the loop.

A record's lifetime follows how long this peer's publishes take (see docs/thin-link.md): 8 heartbeats
on a healthy link, longer while fragment transfers slow the DHT's requests down; each record says
its lifetime, so readers keep the writer in their views exactly that long after they last read it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from p2p_cocodc.errors import UserError
from p2p_cocodc.swarm.agreement import DIGEST_CHARS, PUBLISHED
from p2p_cocodc.swarm.dht import store_limit_s
from p2p_cocodc.swarm.trust import OPEN

log = logging.getLogger(__name__)

RUNS_KEY = "p2p-cocodc.runs"
STATES = ("waiting", "joining", "training", "done", "leaving")
MAX_FRAGMENTS = 4096
LIFETIME_FACTOR = 3  # a record lives 3x the slowest recent publish: the next one lands before it lapses
RECENT_PUBLISHES = 30  # the publishes that set the lifetime (about the last 30-60 s)
MAX_LIFETIME_S = 120.0  # a longer lifetime is not believed from a record, nor written
GIVE_UP_S = 60.0  # with no publish landing for max(this, 4 lifetimes), the peer has lost the DHT
GIVE_UP_LIFETIMES = 4
REFRESHES_PER_LIFETIME = 4  # a record nothing acted on changed in goes out again after 1/4 of its lifetime
REGION_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
MAX_REGION = 32
MAX_SYNC_SHAPE = 1 << 20  # τ and N are below --inner-steps
NONE_YET = -1.0  # val_ppl and last_round_s of a peer that has no evaluation, or no completed sync, yet


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
    joined_at: int = 0  # the step whose end it took the swarm's state at (0: it started the run)
    resume_step: int = -1  # the step of the checkpoint it resumes from with --resume (-1: none)
    ttl_s: float = 8.0  # the record's lifetime: how long readers keep this peer after they last read it
    key_id: str = OPEN  # the public id of the run's swarm key its writer holds ("open": none)
    refused: dict[str, int] = field(default_factory=dict)  # peers it refused most (non-members, limits)
    outliers: dict[str, int] = field(default_factory=dict)  # members whose slices it left out most
    theta_step: int = -1  # the step of its latest θ̄ digest (-1: none yet; swarm/agreement.py)
    theta_sha: str = ""  # the first 16 hex digits of sha256(θ̄) at that step
    theta_earlier: list[list[Any]] = field(default_factory=list)  # [step, digest] of the ones before
    theta_doubt: int = -1  # its θ̄ is in doubt from this step on, until it took the swarm's state (-1: none)
    region: str = ""  # the name operators see (--region, else the peer id's start; "": none given)
    tokens_per_s: float = 0.0  # training throughput so far, waits for peers and evaluations left out
    val_ppl: float = NONE_YET  # the latest evaluation of θ̄
    bytes_received: int = 0  # tensor bytes its exchange took in from members
    last_round_s: float = NONE_YET  # how long its latest completed sync took
    proposed_shape: list[int] = field(default_factory=list)  # [τ, N] it worked out (or its checkpoint's)
    sync_shape: list[int] = field(default_factory=list)  # [τ, N] it trains with ([] until it starts)
    starting_pace: int = 0  # the send-slot spacing its declared link asks a run to start with (0: none)

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    def differs_for_others(self, other: PeerRecord) -> bool:
        """Whether a field the other peers act on differs (``ACTED_ON``): not only the progress
        figures, which operators see and peers read as approximate."""
        return any(getattr(self, name) != getattr(other, name) for name in ACTED_ON)

    @classmethod
    def from_wire(cls, value: Any) -> PeerRecord | None:
        """The record, or None when a peer sent something that is not one."""
        if not isinstance(value, dict) or set(value) != {f for f in cls.__dataclass_fields__}:
            return None
        v = value
        ints = (v["step"], v["num_shards"], v["bytes_sent"], v["joined_at"], v["bytes_received"])
        floats = (v["step_time_s"], v["bandwidth_mbps"], v["stall_s"], v["ttl_s"], v["tokens_per_s"])
        ok = (
            v["state"] in STATES
            and all(_is_int(i) and i >= 0 for i in ints)
            and _is_int(v["resume_step"])
            and v["resume_step"] >= -1
            and (v["shard"] is None or (_is_int(v["shard"]) and 0 <= v["shard"] < v["num_shards"]))
            and all(_is_number(x) and x >= 0 for x in floats)
            and all(_is_number(x) and (x >= 0 or x == NONE_YET) for x in (v["val_ppl"], v["last_round_s"]))
            and is_region(v["region"])
            and 0 < v["ttl_s"] <= MAX_LIFETIME_S
            and isinstance(v["fingerprint"], str)
            and len(v["fingerprint"]) <= 64
            and isinstance(v["versions"], list)
            and len(v["versions"]) <= MAX_FRAGMENTS
            and isinstance(v["key_id"], str)
            and 0 < len(v["key_id"]) <= 16
            and _is_tally(v["refused"])
            and _is_tally(v["outliers"])
            and _is_int(v["theta_step"])
            and v["theta_step"] >= -1
            and isinstance(v["theta_sha"], str)
            and len(v["theta_sha"]) <= 16
            and _is_digests(v["theta_earlier"])
            and _is_int(v["theta_doubt"])
            and v["theta_doubt"] >= -1
            and all(_is_int(x) and x >= 0 for x in v["versions"])
            and _is_shape(v["proposed_shape"])
            and _is_shape(v["sync_shape"])
            and _is_int(v["starting_pace"])
            and 0 <= v["starting_pace"] <= MAX_SYNC_SHAPE
        )
        return cls(**v) if ok else None


# Fields shown to operators (status page, metrics) or read as approximate (a joiner's target step
# has a margin and is asked again further ahead; --inner-share auto's step times): a change in them
# alone waits for the record's next refresh. Every other field is acted on, and goes out at once.
PROGRESS = frozenset(
    {
        "step", "step_time_s", "bandwidth_mbps", "versions", "stall_s", "bytes_sent", "bytes_received",
        "tokens_per_s", "val_ppl", "last_round_s", "ttl_s", "refused", "outliers",
    }
)  # fmt: skip
ACTED_ON = tuple(name for name in PeerRecord.__dataclass_fields__ if name not in PROGRESS)


def is_region(x: Any) -> bool:
    """A peer's name as a record may carry it: a few letters, digits and '-_.' (or none)."""
    return isinstance(x, str) and len(x) <= MAX_REGION and set(x) <= REGION_CHARS


def _is_shape(x: Any) -> bool:
    """[τ, N], or none: [] (τ ≥ 0, N ≥ 1)."""
    if not isinstance(x, list) or x == []:
        return isinstance(x, list)
    return len(x) == 2 and all(_is_int(i) and i <= MAX_SYNC_SHAPE for i in x) and x[0] >= 0 and x[1] >= 1


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_digests(x: Any) -> bool:
    """At most ``PUBLISHED - 1`` [step, digest] pairs: a step ≥ 0 and up to 16 characters."""
    return (
        isinstance(x, list)
        and len(x) < PUBLISHED
        and all(
            isinstance(pair, list)
            and len(pair) == 2
            and _is_int(pair[0])
            and pair[0] >= 0
            and isinstance(pair[1], str)
            and len(pair[1]) <= DIGEST_CHARS
            for pair in x
        )
    )


MAX_TALLY = 8  # peers a record names in one of its tallies


def _is_tally(x: Any) -> bool:
    """{peer id: count}: a few peers, each named by a short string."""
    return (
        isinstance(x, dict)
        and len(x) <= MAX_TALLY
        and all(isinstance(k, str) and 0 < len(k) <= 64 and _is_int(c) and c >= 0 for k, c in x.items())
    )


def _is_number(x: Any) -> bool:
    """A finite float, or an int of at most 64 bits (what msgpack carries)."""
    return (_is_int(x) and -(1 << 63) <= x < 1 << 64) or (isinstance(x, float) and math.isfinite(x))


class Board:
    """Publish this peer's record and read everyone's.

    Every call is bounded by ``timeout``, which by default is hivemind's own worst case for a store
    or a get (``store_limit_s``), so a call is cancelled only once hivemind itself would have given
    up. At most one publish runs at a time (``publishing``): a caller that publishes while one is in
    flight waits for it, and the heartbeat skips a beat instead. A publish counts only once a node
    other than this one accepted the record: hivemind reports a copy kept only locally as success.
    """

    def __init__(
        self, dht: Any, run_id: str, peer_id: str, ttl_s: float, timeout: float | None = None
    ) -> None:
        self.dht = dht
        self.run_id = run_id
        self.peer_id = peer_id
        self.ttl_s = ttl_s  # the record lifetime on a healthy link (the shortest one)
        self.timeout = store_limit_s() if timeout is None else timeout
        self.recent: deque[float] = deque(maxlen=RECENT_PUBLISHES)  # seconds; a failure counts as timeout
        self.took: list[float] = []  # every publish's duration in this run, failures included
        self.failed = 0
        self.skipped = 0  # heartbeats that found a publish still in flight
        self.landed_at = time.monotonic()  # when a publish last reached another node (start: now)
        self.landed_lifetime_s = ttl_s  # the lifetime that publish carried
        self._lock: asyncio.Lock | None = None
        self._expires = 0.0  # the DHT expiration of the latest record sent
        self._landed: PeerRecord | None = None  # the last record that landed
        self._info_expires = 0.0  # the DHT expiration of the last run info that landed

    @property
    def lifetime_s(self) -> float:
        """The lifetime the next record carries: max(base, 3x the slowest of the recent publishes)."""
        slowest = max(self.recent, default=0.0)
        return min(MAX_LIFETIME_S, max(self.ttl_s, LIFETIME_FACTOR * slowest))

    @property
    def give_up_s(self) -> float:
        """With no publish landing for this long, the others no longer see this peer: it stops."""
        return max(GIVE_UP_S, GIVE_UP_LIFETIMES * self.lifetime_s)

    def due(self, record: PeerRecord, now: float) -> bool:
        """Whether the heartbeat publishes ``record`` now (``now``: time.monotonic()): a field the
        others act on differs from the last record that landed, or that one has lived a quarter of
        its lifetime (2 s on a healthy link). Measured over 2 Mbit/s links, publishing every
        heartbeat was most of the 40 kB/s each peer sent between rounds (docs/thin-link.md)."""
        landed = self._landed
        if landed is None or now - self.landed_at >= self.landed_lifetime_s / REFRESHES_PER_LIFETIME:
            return True
        return record.differs_for_others(landed)

    @property
    def publishing(self) -> bool:
        return self._lock is not None and self._lock.locked()

    async def publish(self, record: PeerRecord, run_info: dict[str, Any] | None = None) -> float:
        """Store the record (with its lifetime) on the board; seconds it took, or ConnectionError."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            return await self._publish(record, run_info)

    async def _publish(self, record: PeerRecord, run_info: dict[str, Any] | None) -> float:
        from hivemind.utils import get_dht_time

        # a peer that is done lives on the board as long as a record may: the run's id stays taken
        # that long after its last peer ended (a late peer is told the run ended, ``peer/lobby.py``)
        lifetime = MAX_LIFETIME_S if record.state == "done" else self.lifetime_s
        record = replace(record, ttl_s=lifetime)
        # hivemind keeps a subkey's value with the latest expiration: a record must never expire
        # before the one it replaces, or the store is rejected (when the lifetime shrinks)
        expires = max(get_dht_time() + lifetime, self._expires + 1e-3)
        self._expires = expires
        # a change of state (training, leaving, done) must reach every replica before the call
        # returns: a peer that leaves shuts its DHT down right after, which would cut the stores
        # still going on in the background, and readers would see "training" until it lapsed
        everywhere = self._landed is None or record.state != self._landed.state
        stores = [(peers_key(self.run_id), self.peer_id, record.to_wire())]
        # the run info (never changes in a run, and carries every option) rides along with a change
        # of state, and when less than half its lifetime is left: not with every record
        info_old = get_dht_time() >= self._info_expires - lifetime / 2
        with_info = run_info is not None and (everywhere or info_old)
        if with_info:  # under our own subkey too: a record names its writer (swarm/trust.py)
            stores.append((RUNS_KEY, self.peer_id, {**run_info, "run": self.run_id}))
        started = time.monotonic()
        try:
            # exclude_self: the result then says whether another node took the record. A
            # heartbeat's search and stores end at the first replica that accepted it (the others
            # go on in the DHT process, each bounded by hivemind's request timeout), so one replica
            # behind a congested connection does not hold the heartbeat back.
            results = await asyncio.gather(
                *(
                    self._bounded(
                        self.dht.store(
                            key,
                            value,
                            expires,
                            subkey=subkey,
                            return_future=True,
                            exclude_self=True,
                            await_all_replicas=everywhere,
                            await_all_tasks=everywhere,
                        ),
                        f"store {key}",
                    )
                    for key, subkey, value in stores
                )
            )
        except ConnectionError:
            self._count(self.timeout, ok=False)
            raise
        took = time.monotonic() - started
        self._count(took, ok=bool(results[0]))
        if not results[0]:
            raise ConnectionError(
                f"DHT store {peers_key(self.run_id)} reached no other node in {took:.1f} s (at most a "
                "local copy was kept)"
            )
        self.landed_at = time.monotonic()
        self.landed_lifetime_s = lifetime
        self._landed = record
        if with_info and results[1]:
            self._info_expires = expires
        log.info("board publish: %.2f s, ok, lifetime %.0f s", took, lifetime)
        return took

    def _count(self, took: float, ok: bool) -> None:
        self.recent.append(took)
        self.took.append(took)
        if not ok:
            self.failed += 1
            log.info("board publish: %.2f s, failed, lifetime %.0f s", took, self.lifetime_s)

    def stats(self) -> str:
        """Publish latency percentiles so far, for the log."""
        took = sorted(self.took)
        if not took:
            return "no publishes yet"

        def pct(q: float) -> float:
            return took[min(len(took) - 1, int(q * len(took)))]

        return (
            f"{len(took)} publishes, p50 {pct(0.5):.2f} s, p90 {pct(0.9):.2f} s, p99 {pct(0.99):.2f} s, "
            f"max {took[-1]:.2f} s, {self.failed} failed, {self.skipped} heartbeats skipped; record "
            f"lifetime {self.lifetime_s:.0f} s"
        )

    async def peers(self) -> dict[str, PeerRecord]:
        """Live peers of the run (this one included once it has published), by peer id."""
        return {peer: record for peer, (record, _) in (await self.peers_written()).items()}

    async def peers_written(self) -> dict[str, tuple[PeerRecord, float]]:
        """Live peers of the run, each with when it wrote its record (DHT time, the writer's clock)."""
        found = await self._get_expiring(peers_key(self.run_id))
        records = {}
        for peer, (value, expiration) in found.items():
            record = PeerRecord.from_wire(value)
            if record is None:
                log.warning("ignoring a malformed record from peer %s", peer[:16])
            else:
                records[peer] = (record, expiration - record.ttl_s)
        return records

    async def runs(self) -> dict[str, dict[str, Any]]:
        """{run id: the info one of its peers published}, for the bootstrap's /status."""
        runs: dict[str, dict[str, Any]] = {}
        for info in (await self._get(RUNS_KEY)).values():
            if isinstance(info, dict) and isinstance(info.get("run"), str):
                runs[info["run"]] = {k: v for k, v in info.items() if k != "run"}
        return runs

    async def run_infos(self) -> dict[str, dict[str, Any]]:
        """{peer id: the run info it published} of this run's peers (untrusted values)."""
        return {
            peer: info
            for peer, info in (await self._get(RUNS_KEY)).items()
            if isinstance(info, dict) and info.get("run") == self.run_id
        }

    async def _get(self, key: str) -> dict[str, Any]:
        return {sub: value for sub, (value, _) in (await self._get_expiring(key)).items()}

    async def _get_expiring(self, key: str) -> dict[str, tuple[Any, float]]:
        """{subkey: (value, its expiration time)} under ``key``."""
        future = self.dht.get(key, latest=True, return_future=True)
        found = await self._bounded(future, f"get {key}")
        if found is None or not isinstance(found.value, dict):
            return {}
        return {
            str(sub): (item.value, float(item.expiration_time))
            for sub, item in found.value.items()
            if hasattr(item, "value")
        }

    async def _bounded(self, future: Any, what: str) -> Any:
        if not self.dht.is_alive():
            raise ConnectionError("the DHT process has died")
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout)
        except TimeoutError:
            future.cancel()
            raise ConnectionError(f"DHT {what} took longer than {self.timeout:.0f} s") from None
