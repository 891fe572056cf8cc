"""Starting a hivemind DHT node safely, and turning what a user typed into bootstrap multiaddrs.

hivemind owns discovery, identity and transport. What this module adds is what the probe showed we
must: ``nat_port_map`` always off, helper processes that die with their parent, and every failure
to reach a bootstrap turned into one clear line instead of a hang or a traceback.
"""

from __future__ import annotations

import ctypes
import http.client
import ipaddress
import json
import logging
import os
import re
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from contextlib import suppress
from pathlib import Path
from typing import Any

from p2p_cocodc.errors import UserError, listen_failed
from p2p_cocodc.swarm.trust import BoardValidator, EphemeralIdentity, Identity, Membership

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
MADV_DONTNEED = 4
P2PD_SOCKET_DIR = Path("/tmp")  # where hivemind's P2P puts its daemon's control socket
P2PD_SOCKET_GLOB = "hivemind-p2pd-*.sock"
_pdeathsig_installed = False
# the page ranges (start, length) a process forked while the DHT starts gives up at once (``start_dht``)
_left_to_parent: list[tuple[int, int]] = []


def install_pdeathsig() -> None:
    """Make every process forked from here on die with its parent (hivemind's DHT child and p2pd).

    Without it, SIGKILL of a peer leaves its DHT process and p2pd running forever. Call it from the
    main thread before creating any hivemind object: the signal fires when the forking thread ends.
    """
    global _pdeathsig_installed
    if _pdeathsig_installed:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def _die_with_parent() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        for start, length in _left_to_parent:
            libc.madvise(start, length, MADV_DONTNEED)

    os.register_at_fork(after_in_child=_die_with_parent)
    _pdeathsig_installed = True


def page_ranges(buffers: Iterable[tuple[int, int]], least: int = 1 << 20) -> list[tuple[int, int]]:
    """The whole memory pages inside each buffer (address, bytes) of at least ``least`` bytes, once
    each: what a forked process may give up without touching memory that is not the buffer's."""
    page = os.sysconf("SC_PAGE_SIZE")
    ranges = set()
    for address, size in buffers:
        start, end = -(-address // page) * page, (address + size) // page * page
        if size >= least and end > start:
            ranges.add((start, end - start))
    return sorted(ranges)


def parse_bootstrap(addr: str, timeout: float = 10.0) -> tuple[list[str], str | None]:
    """Multiaddrs of a bootstrap given as a full multiaddr or as the ``host:port`` it printed, and
    the key id of the runs it admits (``swarm/trust.py``; None: not known, for a multiaddr).

    ``host:port`` is the bootstrap's HTTP status address; its ``/address`` answer lists the
    multiaddrs (libp2p cannot dial a peer without knowing its id). A host alone means the default
    status port; the bootstrap's libp2p port works too where its status port is the default one or
    the next one (``_status_port_beside``).
    """
    addr = addr.strip()
    if addr.startswith("/"):
        _check_multiaddr(addr)
        return [addr], None
    _, maddrs, key_id = find_bootstrap(addr, timeout)
    return maddrs, key_id


def find_bootstrap(addr: str, timeout: float = 10.0) -> tuple[str, list[str], str | None]:
    """The HOST:PORT of the bootstrap's HTTP server that answered, the multiaddrs it gave, and the
    key id it admits by (None if it did not say)."""
    status, answer = _fetch(addr, "/address", timeout, multiaddr_ok=True)
    maddrs = answer.get("maddrs") if isinstance(answer, dict) else None
    if not isinstance(maddrs, list) or not maddrs or not all(isinstance(m, str) for m in maddrs):
        raise UserError(f"--bootstrap {addr}: its /address did not answer with a bootstrap address")
    for m in maddrs:
        _check_multiaddr(m)
    key_id = answer.get("key_id")
    return status, maddrs, key_id if isinstance(key_id, str) and 0 < len(key_id) <= 16 else None


def bootstrap_endings(addr: str, timeout: float = 10.0) -> dict[str, Any]:
    """The runs the bootstrap saw end (its ``/ended``: {run id: {"step", "steps", "at"}}); none from a
    bootstrap given as a multiaddr, or one too old to say (then the board alone tells)."""
    if addr.strip().startswith("/"):
        return {}
    try:
        ended = fetch_bootstrap_json(addr, "/ended", timeout)
    except UserError:
        return {}
    return ended if isinstance(ended, dict) else {}


def fetch_bootstrap_json(
    addr: str, path: str, timeout: float, multiaddr_ok: bool = False, max_bytes: int = 64 * 1024
) -> Any:
    """GET ``path`` as JSON from the bootstrap's HTTP server, given as the HOST:PORT it printed;
    every way that fails is one line saying what to check (``multiaddr_ok``: the caller also takes
    a multiaddr). ``timeout`` bounds the connection and each read."""
    return _fetch(addr, path, timeout, multiaddr_ok, max_bytes)[1]


STATUS_PORT = 31338  # the bootstrap's --status-port unless told otherwise: what HOST alone means
# The bootstrap's HTTP server is asked directly, never through $http_proxy: libp2p dials it directly
# too, and a proxy (a corporate one, or none listening) would make a reachable bootstrap look dead.
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class _Libp2pPort(Exception):
    """The port answered with libp2p's greeting (``/multistream/1.0.0``): the bootstrap's --port."""


def _fetch(
    addr: str, path: str, timeout: float, multiaddr_ok: bool = False, max_bytes: int = 64 * 1024
) -> tuple[str, Any]:
    """(HOST:PORT that answered, its JSON answer). Given the bootstrap's libp2p port, its status
    port is found beside it (``_status_port_beside``), so that either port works."""
    host, port = split_host_port(addr, multiaddr_ok)
    try:
        return _host_port(host, port), _get_json(addr, host, port, path, timeout, max_bytes)
    except _Libp2pPort:
        found = _status_port_beside(host, port, timeout)
        if found is None:
            raise UserError(
                f"--bootstrap {addr} is the bootstrap's libp2p port: give its "
                f"status port, {STATUS_PORT} by default"
                f"{', or the full multiaddr it printed' if multiaddr_ok else ''}"
            ) from None
        log.info("%s is the bootstrap's libp2p port; its status port is %d", addr, found)
        return _host_port(host, found), _get_json(addr, host, found, path, timeout, max_bytes)


def split_host_port(addr: str, multiaddr_ok: bool = False) -> tuple[str, int]:
    """HOST:PORT, [IPv6]:PORT, or a host alone (the default status port)."""
    text = addr.strip()
    bare_ip6 = text.count(":") > 1 and not text.startswith("[")
    host, sep, port = ("", "", "") if bare_ip6 else text.rpartition(":")
    if not sep or "]" in port:
        host, port = text, str(STATUS_PORT)
    host = host.removeprefix("[").removesuffix("]")
    if not host or "/" in host or not port.isdigit() or not 0 < int(port) < 65536:
        multiaddr = "a multiaddr (/ip4/HOST/tcp/PORT/p2p/ID) or " if multiaddr_ok else ""
        raise UserError(
            f"--bootstrap {addr!r}: give {multiaddr}the HOST:PORT that `p2p-cocodc bootstrap` printed"
        )
    return host, int(port)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _get_json(addr: str, host: str, port: int, path: str, timeout: float, max_bytes: int) -> Any:
    url = f"http://{_host_port(host, port)}{path}"
    try:
        with DIRECT.open(url, timeout=timeout) as response:
            return json.loads(response.read(max_bytes))
    except http.client.BadStatusLine as exc:
        if "/multistream/" in str(exc):
            raise _Libp2pPort from None
        raise UserError(
            f"--bootstrap {addr}: port {port} answers, but not as the bootstrap's status server (HTTP): "
            "is that the HOST:PORT it printed?"
        ) from None
    except http.client.HTTPException:
        raise UserError(f"--bootstrap {addr}: port {port} answers, but not in HTTP as a bootstrap") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(exc, urllib.error.HTTPError):
            reason = f"HTTP {exc.code} {exc.reason}"
        elif isinstance(reason, TimeoutError):
            reason = f"no answer within {timeout:.0f} s"
        elif isinstance(reason, socket.gaierror):
            reason = f"cannot resolve {host}"
        elif isinstance(reason, OSError) and reason.strerror:
            reason = reason.strerror.lower()
        raise UserError(
            f"--bootstrap {addr}: no p2p-cocodc bootstrap answers at {url} ({reason}); is it running, "
            "and is that the HOST:PORT it printed?"
        ) from None
    except ValueError:
        raise UserError(f"--bootstrap {addr}: {url} did not answer with JSON, as a bootstrap does") from None


def _status_port_beside(host: str, libp2p_port: int, timeout: float) -> int | None:
    """The status port of the bootstrap whose libp2p port is ``libp2p_port``, where it is the default
    one or the next port; taken only if its ``/address`` lists a multiaddr on ``libp2p_port``."""
    for port in dict.fromkeys(p for p in (STATUS_PORT, libp2p_port + 1) if p != libp2p_port and p < 65536):
        try:
            answer = _get_json("", host, port, "/address", min(timeout, 3.0), 64 * 1024)
        except (UserError, _Libp2pPort):
            continue
        maddrs = answer.get("maddrs") if isinstance(answer, dict) else None
        if isinstance(maddrs, list) and any(f"/tcp/{libp2p_port}/" in str(m) for m in maddrs):
            return port
    return None


def _check_multiaddr(addr: str) -> None:
    from hivemind.utils.multiaddr import Multiaddr

    try:
        parsed = Multiaddr(addr)
    except Exception:  # noqa: BLE001 - the multiaddr parser raises many types for bad text
        raise UserError(f"--bootstrap {addr!r} is not a valid multiaddr") from None
    if "p2p" not in [p.name for p in parsed.protocols()]:
        raise UserError(f"--bootstrap {addr!r} lacks the peer id: it must end in /p2p/<peer id>")


HOST_NAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9-]{1,63})*\.?")


def listen_maddrs(host: str, port: int, flag: str = "--host") -> list[str]:
    """libp2p listen multiaddrs for a host given as IPv4, IPv6 or a name; anything else is refused
    here (hivemind's daemon would fail on it in a child process and leave the parent waiting)."""
    if not 0 <= port < 65536:
        raise UserError(f"--port must be in [0, 65535], got {port}")
    if flag == "--announce" and not port:
        raise UserError("--announce needs a fixed --port: the announced address must be dialable")
    kind = "dns"
    if ":" in host or host.replace(".", "").isdigit():
        try:
            kind = "ip6" if ipaddress.ip_address(host).version == 6 else "ip4"
        except ValueError:
            raise UserError(f"{flag} {host!r} is not a valid IP address") from None
    elif not HOST_NAME.fullmatch(host):
        raise UserError(f"{flag} {host!r} is not an IP address or host name")
    return [f"/{kind}/{host}/tcp/{port}"]


def check_listen_address(host: str, port: int, in_use: str | None = None) -> str:
    """Bind ``host``:``port`` as p2pd will (and let go at once): a taken port or an address this
    machine does not have is refused here, in one line (``in_use``: that line for a taken port, where
    the caller knows better than "another program"). p2pd itself would not refuse a port another
    p2pd holds (both set SO_REUSEPORT): two peers would share it and each would dial itself."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # a restarted peer's old connections linger in TIME_WAIT on its port: they do not hold it
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
            probe.listen()
        except socket.gaierror:
            raise UserError(f"--host {host}: cannot resolve it to an address of this machine") from None
        except OSError as exc:
            raise listen_failed(
                exc,
                in_use=in_use
                or f"--port {port} is in use on {host}: another peer, bootstrap or program listens "
                "there; give each one on a machine its own --port (the peer profiles use 31401-31403)",
                not_here=f"--host {host} is not an address of this machine: listen on 0.0.0.0 and give the "
                "address other peers dial as --announce",
                other=f"cannot listen on {host}:{port} ({{reason}}): pick another --port",
            ) from None
    return f"{host}:{port} is free" if port else f"{host} is an address of this machine (--port 0: any port)"


def start_dht(
    initial_peers: list[str],
    host: str,
    port: int,
    announce: str | None = None,
    identity_path: str | None = None,
    membership: Membership | None = None,
    protected: Iterable[str] | None = (),
    left_to_parent: Iterable[tuple[int, int]] = (),
) -> Any:
    """A running hivemind.DHT, or UserError naming the address that failed.

    Every node signs its records and accepts only records signed by the peer their subkey names
    (``trust.BoardValidator``); under the DHT keys in ``protected`` (None: every key), only records
    of ``membership``'s members. ``identity_path``: the node's key, created there if missing;
    None: a fresh key.

    The DHT runs in a process forked from this one, which starts with this one's memory shared
    copy-on-write. Buffers this process will write or free (a model's tensors, θ̄: the pages of
    each, ``left_to_parent``) would become the DHT process's own copies, gigabytes of a big model
    counted twice; so the DHT process gives them up as it starts (it never reads them)."""
    install_pdeathsig()
    import hivemind
    from hivemind.p2p import P2P
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

    kwargs: dict[str, Any] = {"host_maddrs": listen_maddrs(host, port), "nat_port_map": False}
    # libp2p dials from its listening port by default. Two peers that dial each other at once (both
    # see the other on the board at the same heartbeat) then send SYNs with the same two ports: TCP
    # makes one connection of the two, both ends start the security handshake as its initiator, both
    # dials fail, and libp2p will not dial that peer again for a while ("dial backoff"). On `thin`
    # that left a pair of peers unconnected until their first round (docs/thin-link.md). p2pd
    # inherits this process's environment (an explicit LIBP2P_TCP_REUSEPORT is kept).
    os.environ.setdefault("LIBP2P_TCP_REUSEPORT", "false")
    if announce:
        kwargs["announce_maddrs"] = listen_maddrs(announce, port, "--announce")
    check_listen_address(host, port)
    fresh = EphemeralIdentity() if identity_path is None else None
    key_path = fresh.path if fresh is not None else identity_path
    assert key_path is not None
    try:
        if not os.path.exists(key_path):
            try:
                P2P.generate_identity(key_path)
            except (OSError, FileNotFoundError) as exc:
                raise UserError(f"--identity {key_path}: cannot create it ({exc})") from None
        identity = Identity.from_file(key_path)
        validator = BoardValidator(identity, membership or Membership(), protected)
        before = set(P2PD_SOCKET_DIR.glob(P2PD_SOCKET_GLOB))
        _left_to_parent[:] = page_ranges(left_to_parent)
        try:
            return hivemind.DHT(
                initial_peers=initial_peers or None,
                start=True,
                identity_path=key_path,
                check_if_identity_free=fresh is None,  # a fresh key is nobody else's
                record_validators=[validator],
                **kwargs,
            )
        except P2PDaemonError as exc:
            remove_dead_sockets(set(P2PD_SOCKET_DIR.glob(P2PD_SOCKET_GLOB)) - before)
            detail = str(exc).split(": ", 1)[-1].strip()
            if fresh is None and "already taken" in str(exc):
                raise UserError(
                    f"--identity {identity_path}: a running peer of this swarm already uses this identity; "
                    "give each process its own file (a restarted peer may reuse its file once the old "
                    "process has ended)"
                ) from None
            if initial_peers:
                raise UserError(
                    f"cannot join the swarm through {', '.join(initial_peers)} ({detail}): is the bootstrap "
                    "running and reachable from here?"
                ) from None
            raise UserError(f"cannot start the DHT on {host}:{port} ({detail}): is the port free?") from None
    finally:
        _left_to_parent.clear()  # forked: later forks must not give up memory those buffers no longer own
        if fresh is not None:  # p2pd has read the key; the validator holds it in memory
            fresh.close()


SEARCH_ROUNDS = 2  # a search asks the nodes it knows, then those they name (all known, in a small swarm)
STORE_ROUNDS = 1  # then the nearest nodes store in parallel (num_replicas covers every node here)
PIPE_MARGIN_S = 1.0  # the DHT process's pipe and event loop


def rpc_timeout_s() -> float:
    """hivemind's per-request timeout (``DHTNode.create``'s ``wait_timeout``; start_dht keeps it)."""
    import inspect

    from hivemind.dht.node import DHTNode

    default = inspect.signature(DHTNode.create).parameters["wait_timeout"].default
    return float(default) if isinstance(default, (int, float)) else 3.0


def store_limit_s() -> float:
    """How long hivemind itself may take for one store or get before it gives up on every replica.

    A store (hivemind 1.1.12 ``DHTNode.store_many``) first runs a beam search (``rpc_find``, rounds
    of parallel requests, each bounded by ``wait_timeout``) and then ``rpc_store`` to the nearest
    nodes in parallel, also bounded by ``wait_timeout``; a get is the same search. So 2 search rounds
    + 1 store round of 3 s, + 1 s for the DHT process's pipe: 10 s. Cancelling earlier throws away
    a store that would still land; see docs/thin-link.md."""
    return (SEARCH_ROUNDS + STORE_ROUNDS) * rpc_timeout_s() + PIPE_MARGIN_S


def remove_dead_sockets(paths: set[Path], settle_s: float = 5.0) -> None:
    """Remove the socket files among ``paths`` once nobody listens on them.

    A p2pd that exits by itself (it could not reach the bootstrap) leaves its socket file in /tmp,
    because hivemind only removes it when it stops p2pd; hivemind reports the failure while that
    p2pd may still be exiting, so a file that still answers is probed again for up to ``settle_s``.
    A file someone listens on after that is kept: it may be another process's daemon."""
    deadline = time.monotonic() + settle_s
    pending = set(paths)
    while True:
        for path in [p for p in pending if not _listened_on(p)]:
            with suppress(OSError):
                path.unlink()
            pending.discard(path)
        if not pending:
            return
        if time.monotonic() >= deadline:
            log.debug("keeping socket files still in use: %s", sorted(map(str, pending)))
            return
        time.sleep(0.1)


def _listened_on(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
        return True
    except OSError:  # refused: a dead socket file; not found: already gone
        return False
    finally:
        probe.close()


def p2pd_socket(dht: Any) -> str | None:
    """Path of p2pd's unix socket in /tmp, or None if hivemind will not say."""
    from hivemind import DHT

    try:
        return str(dht.run_coroutine(DHT._get_p2p_daemon_listen_maddr)["unix"])
    except Exception as exc:  # noqa: BLE001 - only a cleanup aid; a hivemind without it must still run
        log.debug("no p2pd socket path: %s", exc)
        return None


DHT_TERMINATE_S = 1.0  # after hivemind's own shutdown and SIGTERM, how long before SIGKILL


def stop_dht(dht: Any, socket_path: str | None) -> None:
    """Shut the DHT down, and remove p2pd's socket file.

    The DHT may already be gone: systemd's control-group kill signals it too. hivemind removes the socket
    only if it stops p2pd itself, so a p2pd that died first left the file behind in /tmp. A DHT process
    whose p2pd is gone (the group's signal ended it) cannot shut down cleanly: it would only sit out
    hivemind's grace (3 s) and ours, so it is ended at once.
    """
    if socket_path and dht.is_alive() and not _listened_on(Path(socket_path)):
        log.info("the DHT's p2pd has ended: ending the DHT process")
        dht.kill()
    else:
        try:
            dht.shutdown()
        except (OSError, EOFError) as exc:
            log.debug("DHT shutdown: %s", exc)
    # hivemind then only sends SIGTERM; a DHT process that got the group's signal already may sit on
    # (in epoll) through it, and the interpreter's exit would wait on it for ever: end it for good
    dht.join(DHT_TERMINATE_S)
    if dht.is_alive():
        log.warning("the DHT process did not end on SIGTERM within %.0f s; killing it", DHT_TERMINATE_S)
        dht.kill()
        dht.join(DHT_TERMINATE_S)
    if socket_path and not dht.is_alive():
        with suppress(OSError):
            os.remove(socket_path)
