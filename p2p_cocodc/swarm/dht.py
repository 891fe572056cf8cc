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

from p2p_cocodc.errors import UserError
from p2p_cocodc.swarm.trust import BoardValidator, EphemeralIdentity, Identity, Membership

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
P2PD_SOCKET_DIR = Path("/tmp")  # where hivemind's P2P puts its daemon's control socket
P2PD_SOCKET_GLOB = "hivemind-p2pd-*.sock"
_pdeathsig_installed = False


def install_pdeathsig() -> None:
    """Make every process forked from here on die with its parent (hivemind's DHT child and p2pd).

    Without it, SIGKILL of a peer leaves its DHT process and p2pd running forever. Call it from the
    main thread before creating any hivemind object: the signal fires when the forking thread ends.
    """
    global _pdeathsig_installed
    if _pdeathsig_installed:
        return
    libc = ctypes.CDLL(None, use_errno=True)

    def _die_with_parent() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    os.register_at_fork(after_in_child=_die_with_parent)
    _pdeathsig_installed = True


def parse_bootstrap(addr: str, timeout: float = 10.0) -> list[str]:
    """Multiaddrs of a bootstrap given as a full multiaddr or as the ``host:port`` it printed.

    ``host:port`` is the bootstrap's HTTP status address; its ``/address`` answer lists the
    multiaddrs (libp2p cannot dial a peer without knowing its id).
    """
    addr = addr.strip()
    if addr.startswith("/"):
        _check_multiaddr(addr)
        return [addr]
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(
            f"--bootstrap {addr!r}: give a multiaddr (/ip4/HOST/tcp/PORT/p2p/ID) or the HOST:PORT "
            "that `p2p-cocodc bootstrap` printed"
        )
    url = f"http://{host}:{port}/address"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            answer: Any = json.loads(response.read(64 * 1024))
    except http.client.HTTPException:  # something answered, not in HTTP: libp2p's port, most likely
        raise UserError(
            f"--bootstrap {addr}: port {port} answers, but not as the bootstrap's status server (HTTP); "
            "if it is the bootstrap's libp2p --port, give its --status-port instead (the HOST:PORT it "
            "printed), or its full multiaddr"
        ) from None
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UserError(
            f"--bootstrap {addr}: no p2p-cocodc bootstrap answers at {url} ({reason}); is it running, "
            "and is that the HOST:PORT it printed?"
        ) from None
    except ValueError:
        raise UserError(f"--bootstrap {addr}: {url} did not answer with a bootstrap address") from None
    maddrs = answer.get("maddrs") if isinstance(answer, dict) else None
    if not isinstance(maddrs, list) or not maddrs or not all(isinstance(m, str) for m in maddrs):
        raise UserError(f"--bootstrap {addr}: {url} did not answer with a bootstrap address")
    for m in maddrs:
        _check_multiaddr(m)
    return maddrs


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
    kind = "dns"
    if ":" in host or host.replace(".", "").isdigit():
        try:
            kind = "ip6" if ipaddress.ip_address(host).version == 6 else "ip4"
        except ValueError:
            raise UserError(f"{flag} {host!r} is not a valid IP address") from None
    elif not HOST_NAME.fullmatch(host):
        raise UserError(f"{flag} {host!r} is not an IP address or host name")
    return [f"/{kind}/{host}/tcp/{port}"]


def start_dht(
    initial_peers: list[str],
    host: str,
    port: int,
    announce: str | None = None,
    identity_path: str | None = None,
    membership: Membership | None = None,
    protected: Iterable[str] | None = (),
) -> Any:
    """A running hivemind.DHT, or UserError naming the address that failed.

    Every node signs its records and accepts only records signed by the peer their subkey names
    (``trust.BoardValidator``); under the DHT keys in ``protected`` (None: every key), only records
    of ``membership``'s members. ``identity_path``: the node's key, created there if missing;
    None: a fresh key."""
    install_pdeathsig()
    import hivemind
    from hivemind.p2p import P2P
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

    kwargs: dict[str, Any] = {"host_maddrs": listen_maddrs(host, port), "nat_port_map": False}
    if announce:
        if not port:
            raise UserError("--announce needs a fixed --port: the announced address must be dialable")
        kwargs["announce_maddrs"] = listen_maddrs(announce, port, "--announce")
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


def stop_dht(dht: Any, socket_path: str | None) -> None:
    """Shut the DHT down, and remove p2pd's socket file.

    The DHT may already be gone: systemd's control-group kill signals it too. hivemind removes the socket
    only if it stops p2pd itself, so a p2pd that died first left the file behind in /tmp.
    """
    try:
        dht.shutdown()
    except (OSError, EOFError) as exc:
        log.debug("DHT shutdown: %s", exc)
    if socket_path and not dht.is_alive():
        with suppress(OSError):
            os.remove(socket_path)
