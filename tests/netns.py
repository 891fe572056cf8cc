"""An emulated WAN of our own: Linux network namespaces routed through one switch namespace, every
link shaped by tbf and delayed by a userspace relay.

``thin_network(n, mbit, rtt_ms=…)`` (or ``wan_network(n, PROFILE)``) builds, for one test or
benchmark run:

- one *switch* namespace that routes between the nodes (with an address of its own,
  ``switch_address``, so a server such as the swarm's bootstrap can sit on the switch);
- ``n`` *node* namespaces, each with lo up and one link to the switch, and an address in a private
  /24;
- each link is a pair of TUN devices, one in the node (its route to the /24) and one in the switch
  (its route to that node), joined by the delay relay (``tests/delay_relay.py``: one process for
  every link), which holds each packet for a quarter of ``rtt_ms`` before it writes it into the
  other TUN: node → switch → node and back is four crossings, so two nodes see ``rtt_ms`` between
  them (a node and the switch, half of it);
- egress shaping with tbf on both TUNs of every link: the node's limits what it sends (upload),
  the switch's what it receives (download), ``mbit`` Mbit/s each way. A link's MTU is 1500 bytes up
  to 24 Mbit/s, and grows with the rate above (a packet takes at most 0.5 ms to send) so the relay
  keeps up with a 1 Gbit/s link.

Everything is created inside namespaces this module made, so the host's own interfaces, addresses
and routes are never touched; every name carries a random suffix, so parallel runs never collide.
On exit, whatever happens in the body, the relay and the processes still running inside those
namespaces (only ever started there by the caller) are killed and the namespaces deleted, which
deletes their TUNs with them.

Processes run inside a namespace through ``ip netns exec NAME``: ``net.prefix(node)`` is that argv
prefix, ``net.popen_in`` / ``net.run_in`` wrap ``subprocess``.

The kernel here has no netem, hence the relay for delay; tbf's ``latency`` is the longest a packet
may wait in its queue before tbf drops it.
"""

from __future__ import annotations

import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PREFIX = "tl"  # every namespace and interface this module makes starts with it, then the run's suffix
MTU = 1500  # a link's MTU up to 24 Mbit/s; above, what the link sends in 0.5 ms
RELAY = Path(__file__).with_name("delay_relay.py")
RELAY_READY_S = 20.0


@dataclass(frozen=True)
class Profile:
    """A named WAN link: the round-trip time between two nodes and each link's rate (each way)."""

    rtt_ms: float
    mbit: float


PROFILES = {
    "region": Profile(20.0, 1000.0),
    "continent": Profile(100.0, 100.0),
    "planet": Profile(250.0, 20.0),
    "thin": Profile(100.0, 2.0),
}


class NetnsUnavailable(RuntimeError):
    """This machine does not let us build namespaces (the message says why)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


def _tc(ns: str, *args: str) -> None:
    done = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"tc -n {ns} {' '.join(args)}: {done.stderr.strip() or done.returncode}")


def netns_unavailable_reason() -> str | None:
    """Why namespaces with TUN devices shaped by tbf cannot be made here, or None when they can.

    Checked by doing it once: a throwaway namespace with a TUN device and a tbf qdisc, then removed."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux only (this is {sys.platform})"
    if os.geteuid() != 0:
        return "not running as root (ip netns needs CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command (iproute2) on PATH"
    probe = f"{PREFIX}{secrets.token_hex(3)}pr"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    try:
        steps = [
            ["ip", "-n", probe, "tuntap", "add", "dev", "pt", "mode", "tun"],
            ["tc", "-n", probe, "qdisc", "add", "dev", "pt", "root", "tbf"]
            + ["rate", "8mbit", "burst", "16kb", "latency", "50ms"],
        ]
        for argv in steps:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                return f"`{' '.join(argv[:1] + argv[3:])}` failed: {done.stderr.strip() or done.returncode}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


@dataclass(frozen=True)
class Node:
    """One host of the thin network: its namespace, its interface there and its address."""

    index: int
    ns: str
    iface: str
    address: str


@dataclass
class ThinNet:
    suffix: str
    mbit: float
    rtt_ms: float
    switch: str  # the switch namespace
    switch_address: str | None
    mtu: int
    latency_ms: float  # tbf's: the longest a packet waits in a link's queue
    nodes: list[Node] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)  # every namespace made, in order
    interfaces: list[str] = field(default_factory=list)  # every interface made (any namespace)
    started: list[subprocess.Popen] = field(default_factory=list)  # by ``popen_in``, ended at the end

    @staticmethod
    def _ns(where: Node | str) -> str:
        return where.ns if isinstance(where, Node) else where

    def prefix(self, where: Node | str) -> list[str]:
        """argv prefix that runs a command inside ``where`` (a Node or a namespace name)."""
        return ["ip", "netns", "exec", self._ns(where)]

    def popen_in(self, where: Node | str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``where``; ``ip netns exec`` execs it, so the pid is the command's.
        The network ends it when it is removed: listing the namespace's pids alone would miss a
        process still in ``ip netns exec``, not yet inside, which then enters and outlives it."""
        proc = subprocess.Popen([*self.prefix(where), *argv], **kwargs)
        self.started.append(proc)
        return proc

    def run_in(self, where: Node | str, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix(where), *argv], **kwargs)

    def reshape(self, mbit: float) -> None:
        """Every link to ``mbit`` Mbit/s each way from now on, while the processes on it run (the
        links keep their MTU and delay)."""
        if mbit <= 0:
            raise ValueError(f"mbit must be positive, got {mbit}")
        for node in self.nodes:
            _shape(node.ns, node.iface, mbit, self.latency_ms, self.mtu, "change")
            _shape(self.switch, self.port_of(node), mbit, self.latency_ms, self.mtu, "change")
        self.mbit = mbit

    def port_of(self, node: Node) -> str:
        """The switch's interface of ``node``'s link."""
        return f"{PREFIX}{self.suffix}s{node.index}"


def link_mtu(mbit: float) -> int:
    """1500 bytes, or what ``mbit`` Mbit/s sends in 0.5 ms where that is more (at most 65000)."""
    return min(65000, max(MTU, int(mbit * 1e6 / 8 * 0.0005)))


def _shape(ns: str, iface: str, mbit: float, latency_ms: float, mtu: int, verb: str = "add") -> None:
    """tbf on ``iface``'s egress: ``mbit`` Mbit/s, a burst of a few ms (at least a few packets of
    ``mtu`` bytes), packets dropped after ``latency_ms`` in the queue; ``verb`` "change" re-shapes a
    link that has one."""
    rate_bytes = mbit * 1e6 / 8
    burst = max(int(rate_bytes * 0.004), 4 * (mtu + 14))
    _tc(
        ns, *f"qdisc {verb} dev {iface} root tbf rate {mbit}mbit burst {burst} latency {latency_ms}ms".split()
    )


def _tun(ns: str, name: str, mtu: int) -> None:
    _ip("-n", ns, "tuntap", "add", "dev", name, "mode", "tun")
    _ip("-n", ns, "link", "set", name, "mtu", str(mtu), "up")


def _start_relay(net: ThinNet, links: list[str]) -> None:
    """The delay relay for every link, once it has attached to all their TUNs."""
    proc = subprocess.Popen(
        [sys.executable, str(RELAY), str(net.rtt_ms / 4 / 1000), *links],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    net.started.append(proc)
    assert proc.stdout is not None
    with selectors.DefaultSelector() as waiting:  # its first line, within a deadline
        waiting.register(proc.stdout, selectors.EVENT_READ)
        line = proc.stdout.readline() if waiting.select(RELAY_READY_S) else ""
    if line.strip() != "ready":
        proc.kill()
        _, err = proc.communicate(timeout=10)
        why = err.strip()[-1000:]
        raise RuntimeError(f"the delay relay did not start within {RELAY_READY_S:.0f} s: {why}")


def pids_in(ns: str) -> list[int]:
    done = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()] if done.returncode == 0 else []


def _kill_inside(namespaces: list[str], timeout: float = 10.0) -> None:
    """SIGKILL what still runs inside our namespaces (the caller started it there), and wait for it."""
    deadline = time.monotonic() + timeout
    while True:
        pids = [p for ns in namespaces for p in pids_in(ns)]
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def leftovers(suffix: str) -> list[str]:
    """Namespaces and host interfaces whose names carry ``suffix`` (empty after a clean exit)."""
    found = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if suffix in line]
    for line in _ip("-o", "link").stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if suffix in name:
            found.append(name)
    return found


@contextmanager
def thin_network(
    n: int,
    mbit: float,
    *,
    rtt_ms: float = 0.0,
    subnet: str = "10.213.0",
    latency_ms: float = 50.0,
    switch_address: bool = True,
) -> Iterator[ThinNet]:
    """``n`` namespaces routed through a switch, every link shaped to ``mbit`` Mbit/s each way and
    delayed so that two nodes see ``rtt_ms`` of round trip (see the module docstring). Node ``i``
    has ``{subnet}.{i + 1}``, the switch ``{subnet}.254``. Raises NetnsUnavailable, before making
    anything, when this machine cannot do it."""
    if not 1 <= n <= 200:
        raise ValueError(f"n must be in [1, 200], got {n}")
    if mbit <= 0:
        raise ValueError(f"mbit must be positive, got {mbit}")
    if not 0 <= rtt_ms <= 10_000:
        raise ValueError(f"rtt_ms must be in [0, 10000], got {rtt_ms}")
    reason = netns_unavailable_reason()
    if reason is not None:
        raise NetnsUnavailable(reason)
    suffix = secrets.token_hex(3)
    base = f"{PREFIX}{suffix}"  # 8 characters; interface names below stay within 15
    net = ThinNet(
        suffix=suffix,
        mbit=mbit,
        rtt_ms=rtt_ms,
        switch=f"{base}sw",
        switch_address=f"{subnet}.254" if switch_address else None,
        mtu=link_mtu(mbit),
        latency_ms=latency_ms,
    )
    mtu = net.mtu
    try:
        _ip("netns", "add", net.switch)
        net.namespaces.append(net.switch)
        _ip("-n", net.switch, "link", "set", "lo", "up")
        if net.switch_address:
            _ip("-n", net.switch, "addr", "add", f"{net.switch_address}/32", "dev", "lo")
        forwarding = [*net.prefix(net.switch), "sysctl", "-qw", "net.ipv4.ip_forward=1"]
        done = subprocess.run(forwarding, capture_output=True, text=True)  # the switch routes between links
        if done.returncode != 0:
            raise RuntimeError(f"sysctl net.ipv4.ip_forward=1 in {net.switch}: {done.stderr.strip()}")
        links = []
        for i in range(n):
            node = Node(i, f"{base}n{i}", f"{base}e{i}", f"{subnet}.{i + 1}")
            port = net.port_of(node)
            _ip("netns", "add", node.ns)
            net.namespaces.append(node.ns)
            _ip("-n", node.ns, "link", "set", "lo", "up")
            _tun(node.ns, node.iface, mtu)
            _tun(net.switch, port, mtu)
            net.interfaces += [port, node.iface]
            _ip("-n", node.ns, "addr", "add", f"{node.address}/24", "dev", node.iface)
            _ip("-n", net.switch, "route", "add", f"{node.address}/32", "dev", port)
            _shape(node.ns, node.iface, mbit, latency_ms, mtu)  # what the node sends
            _shape(net.switch, port, mbit, latency_ms, mtu)  # what the node receives
            links += [node.ns, node.iface, net.switch, port]
            net.nodes.append(node)
        _start_relay(net, links)
        yield net
    finally:
        for proc in net.started:  # ours, by pid: ended whether or not it is inside yet
            if proc.poll() is None:
                with suppress(ProcessLookupError):
                    proc.kill()
                with suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
        _kill_inside(net.namespaces)
        failures = []
        for ns in reversed(net.namespaces):
            done = _ip("netns", "del", ns, check=False)
            if done.returncode != 0:
                failures.append(f"{ns}: {done.stderr.strip()}")
        if failures and sys.exc_info()[0] is None:
            raise RuntimeError(f"could not remove namespaces: {'; '.join(failures)}")


def wan_network(n: int, profile: str, **options: Any) -> Any:
    """``thin_network`` over the links of a named profile (``PROFILES``)."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}: use one of {', '.join(PROFILES)}")
    link = PROFILES[profile]
    return thin_network(n, link.mbit, rtt_ms=link.rtt_ms, **options)


# A one-shot TCP sink and source for checking a link's rate (run with ``python -c``).
SINK = """
import socket, sys, time
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], int(sys.argv[2]))); srv.listen(1); srv.settimeout(float(sys.argv[3]))
conn, _ = srv.accept(); conn.settimeout(float(sys.argv[3])); got = 0
while chunk := conn.recv(1 << 16):
    got += len(chunk)
conn.sendall(str(got).encode()); conn.close()
"""

SOURCE = """
import socket, sys, time
host, port, nbytes, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
deadline = time.monotonic() + timeout
while True:  # the sink may not listen yet: retry until the deadline
    try:
        conn = socket.create_connection((host, port), timeout=timeout); break
    except ConnectionRefusedError:
        if time.monotonic() > deadline: raise
        time.sleep(0.02)
start = time.monotonic(); block = b"x" * (1 << 16); left = nbytes
while left > 0:
    left -= conn.send(block[: min(left, len(block))])
conn.shutdown(socket.SHUT_WR); got = int(conn.recv(64)); took = time.monotonic() - start
print(got, took)
"""


def tcp_throughput(
    net: ThinNet, src: Node, dst: Node, nbytes: int, port: int = 5201, timeout: float = 60.0
) -> tuple[float, int]:
    """Send ``nbytes`` over TCP from ``src`` to ``dst``; returns (Mbit/s, bytes the sink received),
    timed at the source from connect until the sink confirms it has everything."""
    sink = net.popen_in(
        dst,
        [sys.executable, "-c", SINK, dst.address, str(port), str(timeout)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        done = net.run_in(
            src,
            [sys.executable, "-c", SOURCE, dst.address, str(port), str(nbytes), str(timeout)],
            capture_output=True,
            text=True,
            timeout=timeout + 10,
        )
        if done.returncode != 0:
            raise RuntimeError(f"TCP source failed: {done.stderr.strip()[-1000:]}")
        got, took = done.stdout.split()
        return nbytes * 8 / float(took) / 1e6, int(got)
    finally:
        if sink.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(sink.pid, signal.SIGKILL)
        sink.wait(timeout=10)
