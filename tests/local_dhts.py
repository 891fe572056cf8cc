"""Real hivemind DHT nodes on 127.0.0.1 for tests that run peers in one process."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from p2p_cocodc.swarm.dht import p2pd_socket, start_dht, stop_dht


@contextmanager
def local_dhts(count: int) -> Iterator[list[Any]]:
    """``count`` fresh nodes, the first one everyone's bootstrap; shut down (with their p2pd socket
    files) in reverse order. Fresh per test: a P2P replica is bound to the event loop that first
    used it."""
    first = start_dht([], "127.0.0.1", 0)
    nodes = [
        first,
        *(start_dht([str(first.get_visible_maddrs()[0])], "127.0.0.1", 0) for _ in range(count - 1)),
    ]
    sockets = [p2pd_socket(d) for d in nodes]
    try:
        yield nodes
    finally:
        for dht, path in zip(reversed(nodes), reversed(sockets), strict=True):
            stop_dht(dht, path)
