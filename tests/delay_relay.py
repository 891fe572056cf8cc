"""The delay half of an emulated WAN link: a userspace relay that holds every packet for the link's
one-way delay (this kernel has no netem).

Each link of ``tests/netns.py``'s network is two TUN devices: one in the node's namespace (its only
route out) and one in the switch's (its route back to the node). tbf on each TUN's egress sets the
link's rate; this relay reads what tbf lets out of one TUN and writes it into the other ``delay_s``
later, in order: a packet crosses the link after its transmission at the shaped rate *and* the
propagation delay, as on a real long link, and the link holds a bandwidth-delay product of bytes in
flight.

Run by the harness as root, in the host's namespace:

    python -m tests.delay_relay DELAY_S NODE_NS NODE_TUN SWITCH_NS SWITCH_TUN [...]

(one quadruple per link). It enters each namespace (``setns``) only to attach to its TUN by name,
prints ``ready`` once attached to all, and runs until killed or until a TUN goes away (its
namespace was deleted).
"""

from __future__ import annotations

import ctypes
import fcntl
import heapq
import os
import selectors
import struct
import sys
import time
from collections import deque

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
CLONE_NEWNET = 0x40000000
MAX_PACKET = 1 << 16


def setns(path: str) -> None:
    """Move this (single-threaded) process into the network namespace at ``path``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {path}")
    finally:
        os.close(fd)


def attach(name: str) -> int:
    """A non-blocking fd on the existing TUN device ``name`` of the current namespace."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def relay(delay_s: float, pairs: list[tuple[int, int]]) -> None:
    """Forward every packet read from one fd of a pair to the other, ``delay_s`` after it was read."""
    selector = selectors.DefaultSelector()
    queues: dict[int, deque[tuple[float, bytes]]] = {}  # destination fd -> (due, packet), in order
    for a, b in pairs:
        selector.register(a, selectors.EVENT_READ, b)
        selector.register(b, selectors.EVENT_READ, a)
        queues[a], queues[b] = deque(), deque()
    due: list[tuple[float, int]] = []  # (due, destination fd) of each queue's head
    while True:
        now = time.monotonic()
        timeout = max(0.0, due[0][0] - now) if due else None
        for key, _ in selector.select(timeout):
            source, destination = key.fd, key.data
            while True:
                try:
                    packet = os.read(source, MAX_PACKET)
                except BlockingIOError:
                    break
                if not packet:
                    return
                queue = queues[destination]
                at = time.monotonic() + delay_s
                if not queue:
                    heapq.heappush(due, (at, destination))
                queue.append((at, packet))
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, destination = heapq.heappop(due)
            queue = queues[destination]
            while queue and queue[0][0] <= now:
                _, packet = queue.popleft()
                try:
                    os.write(destination, packet)
                except BlockingIOError:
                    pass  # the receiving side's queue is full: the packet is lost, as on a real link
            if queue:
                heapq.heappush(due, (queue[0][0], destination))


def main(argv: list[str]) -> None:
    delay_s = float(argv[0])
    links = argv[1:]
    if delay_s < 0 or not links or len(links) % 4:
        sys.exit("usage: python -m tests.delay_relay DELAY_S NODE_NS NODE_TUN SWITCH_NS SWITCH_TUN [...]")
    home = f"/proc/{os.getpid()}/ns/net"
    home_fd = os.open(home, os.O_RDONLY)  # to come back to between namespaces
    pairs = []
    for i in range(0, len(links), 4):
        node_ns, node_tun, switch_ns, switch_tun = links[i : i + 4]
        fds = []
        for ns, tun in ((node_ns, node_tun), (switch_ns, switch_tun)):
            setns(f"/var/run/netns/{ns}")
            fds.append(attach(tun))
            setns(f"/proc/self/fd/{home_fd}")
        pairs.append((fds[0], fds[1]))
    print("ready", flush=True)
    try:
        relay(delay_s, pairs)
    except OSError:  # a TUN went away with its namespace: the network is being removed
        return


if __name__ == "__main__":
    main(sys.argv[1:])
