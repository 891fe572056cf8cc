"""Can other peers reach this one? The bootstrap dials it back and says.

A peer cannot tell from inside whether its announced address is reachable: a firewall, a NAT or a
wrong ``--announce`` only shows when another peer dials it, minutes into a run. ``join --check``
asks the bootstrap instead. The peer connects to the bootstrap's DHT node (so the bootstrap's
libp2p daemon learns the addresses this peer announces) and then asks ``GET /reach/<peer id>`` on
the bootstrap's HTTP server. The bootstrap drops its connection to the peer (a connection the peer
opened proves nothing about who can dial it) and pings it through the DHT, so libp2p dials a fresh
connection to the announced addresses; the answer is ``{"peer_id", "result"}``, result one of
``reachable``, ``unreachable`` or ``unknown`` (no such peer is connected to the bootstrap).

The endpoint is open to strangers, so it must not become a dialler for hire: it takes a peer id,
never an address, dials only a peer that is connected to it right now and only at the addresses
that peer announced itself, one dial-back at a time and at most one per ``MIN_INTERVAL_S``.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import threading
import time
import urllib.error
from functools import partial
from typing import Any

from p2p_cocodc.swarm.dht import DIRECT

REACH_PATH = "/reach/"
MIN_INTERVAL_S = 1.0  # between two dial-backs of the bootstrap, whoever asks
DIAL_TIMEOUT_S = 10.0  # the bootstrap's whole answer: DHT process round trip, disconnect, dial, ping
PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{32,64}")  # base58, as libp2p writes peer ids
REACHABLE, UNREACHABLE, UNKNOWN = "reachable", "unreachable", "unknown"


class DialBack:
    """The bootstrap's side: answers ``/reach/<peer id>`` on an HTTP thread, dials from the event loop.

    The HTTP thread never touches the DHT (hivemind's DHT handle is not thread-safe, and a wedged DHT
    process must not hang the server): it hands the dial to the loop ``attach`` gave and waits for it
    at most ``DIAL_TIMEOUT_S``."""

    def __init__(self, dht: Any) -> None:
        self.dht = dht
        self.loop: asyncio.AbstractEventLoop | None = None
        self.busy = threading.Lock()
        self.last_start = -MIN_INTERVAL_S

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def handle(self, peer_id: str) -> tuple[int, dict[str, Any]]:
        """HTTP status and JSON answer for ``/reach/<peer_id>``."""
        if not PEER_ID.fullmatch(peer_id):
            return 400, {"error": "give a peer id (base58), as /reach/<peer id>"}
        loop = self.loop
        if loop is None:
            return 503, {"error": "starting"}
        if not self.busy.acquire(blocking=False):
            return 429, {"error": "another dial-back is under way; try again in a second"}
        try:
            if time.monotonic() - self.last_start < MIN_INTERVAL_S:
                return 429, {"error": f"at most one dial-back per {MIN_INTERVAL_S:.0f} s; try again"}
            self.last_start = time.monotonic()
            future = asyncio.run_coroutine_threadsafe(self._dial(peer_id), loop)
            try:
                result = future.result(timeout=DIAL_TIMEOUT_S)
            except TimeoutError:
                future.cancel()
                return 504, {"error": f"the bootstrap's DHT did not answer in {DIAL_TIMEOUT_S:.0f} s"}
            except Exception as exc:  # noqa: BLE001 - a dead DHT process, or p2pd refusing a call
                return 502, {"error": f"the dial-back failed: {str(exc)[:200]}"}
            return 200, {"peer_id": peer_id, "result": result}
        finally:
            self.busy.release()

    async def _dial(self, peer_id: str) -> str:
        return await self.dht.run_coroutine(partial(dial_fresh, peer_id), return_future=True)


async def dial_fresh(peer_id: str, dht: Any, node: Any) -> str:
    """In the bootstrap's DHT process: ping a connected peer over a connection the bootstrap dials."""
    from hivemind.p2p import PeerID

    try:
        peer = PeerID.from_base58(peer_id)
    except ValueError:  # base58 characters, but no multihash
        return UNKNOWN
    client = node.p2p._client  # hivemind's P2P has no public connection calls
    if peer not in {info.peer_id for info in await client.list_peers()}:
        return UNKNOWN
    await client.disconnect(peer)
    return REACHABLE if await node.protocol.call_ping(peer) is not None else UNREACHABLE


async def ping_bootstrap(maddrs: list[str], dht: Any, node: Any) -> str | None:
    """In a peer's DHT process: connect to the bootstrap and ping its DHT node. None, or what failed."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    peer_id = Multiaddr(maddrs[0])["p2p"]
    suffix = Multiaddr(f"/p2p/{peer_id}")
    peer = PeerID.from_base58(peer_id)
    try:
        await node.p2p._client.connect(peer, [Multiaddr(m).decapsulate(suffix) for m in maddrs])
    except Exception as exc:  # noqa: BLE001 - p2pd's control errors carry the reason as text
        return f"libp2p cannot connect to it: {' '.join(str(exc).split())}"  # p2pd's lines, as one
    if await node.protocol.call_ping(peer) is None:
        return "its DHT node does not answer a ping"
    return None


def ask_dial_back(status: str, peer_id: str, deadline_s: float) -> str:
    """The peer's side: ask the bootstrap at ``status`` (its HTTP HOST:PORT) to dial ``peer_id`` back.
    Returns the result; raises ConnectionError with a reason when the bootstrap gives none in time."""
    url = f"http://{status}{REACH_PATH}{peer_id}"
    deadline = time.monotonic() + deadline_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ConnectionError(f"{url} gave no answer within {deadline_s:.0f} s")
        try:
            with DIRECT.open(url, timeout=min(left, DIAL_TIMEOUT_S + 5)) as response:
                answer = json.loads(response.read(64 * 1024))
        except urllib.error.HTTPError as exc:
            if exc.code == 429:  # another peer's check is under way: ours comes next
                time.sleep(min(MIN_INTERVAL_S, max(0.0, deadline - time.monotonic())))
                continue
            if exc.code == 404:
                raise ConnectionError(f"{url} is not served: the bootstrap predates dial-backs") from None
            raise ConnectionError(f"{url} answered {exc.code} ({_error_of(exc)})") from None
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
            raise ConnectionError(f"{url} failed ({getattr(exc, 'reason', exc)})") from None
        result = answer.get("result") if isinstance(answer, dict) else None
        if result not in (REACHABLE, UNREACHABLE, UNKNOWN):
            raise ConnectionError(f"{url} answered {str(answer)[:200]!r}")
        return str(result)


def _error_of(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(exc.read(4096))["error"])[:200]
    except (ValueError, KeyError, TypeError, OSError):
        return exc.reason
