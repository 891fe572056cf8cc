"""``join --check``: everything a peer needs from its machine and network, checked in seconds.

A peer that cannot be reached, or that listens on a taken port, otherwise finds out minutes into a
run (after its model and data are set up, and while the others wait for it). The checks run in the
order a join needs them, each one only when the ones it rests on passed: the files the options
name, the listen address, the bootstrap's HTTP server, p2pd on ``--host``/``--port``, the
bootstrap's DHT node, and last whether another peer can dial this one at the address it announces
(the bootstrap dials it back: ``swarm/dial_back.py``). Each failure is one line that says what to
fix. The checks use a fresh identity: a peer running with ``--identity`` is not disturbed.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from p2p_cocodc.config.join import SwarmOptions
from p2p_cocodc.config.train import TrainConfig
from p2p_cocodc.errors import UserError
from p2p_cocodc.swarm.dht import (
    STATUS_PORT,
    check_listen_address,
    find_bootstrap,
    p2pd_socket,
    parse_bootstrap,
    start_dht,
    stop_dht,
)
from p2p_cocodc.swarm.dial_back import REACHABLE, UNKNOWN, ask_dial_back, ping_bootstrap
from p2p_cocodc.swarm.trust import Membership, check_identity

JOIN_TIMEOUT_S = 15.0  # the bootstrap's DHT node: libp2p's dial, then a DHT ping
DIAL_BACK_DEADLINE_S = 30.0  # the bootstrap's answer, turns of other peers' checks included


def run_checks(cfg: TrainConfig, opts: SwarmOptions, say: Callable[[bool | None, str], None]) -> bool:
    """Run every check that can run, ``say`` (passed, line) for each (None: a check that could not
    run, and why); True if none failed."""
    passed = True

    def check(step: Callable[[], str]) -> bool:
        nonlocal passed
        try:
            say(True, step())
            return True
        except UserError as exc:
            say(False, str(exc))
            passed = False
            return False

    check(lambda: check_files(cfg, opts))
    listening = check(lambda: check_listen_address(opts.host, opts.port, opts.port_taken()))
    found: dict[str, Any] = {}
    bootstrap_up = check(lambda: locate_bootstrap(opts.bootstrap, found))
    if bootstrap_up and found["key_id"] is not None:
        check(lambda: admitted(opts, found["key_id"]))
    if not listening:
        return False
    try:
        dht = start_dht([], opts.host, opts.port, opts.announce)
    except UserError as exc:
        say(False, f"p2pd cannot start: {exc}")
        return False
    socket_path = p2pd_socket(dht)
    try:
        addresses = [str(m).split("/p2p/")[0] for m in dht.get_visible_maddrs()]
        say(True, f"p2pd listens and announces {', '.join(addresses)}")
        if not bootstrap_up or not check(lambda: join_bootstrap(dht, found["maddrs"])):
            return False
        if found["status"] is None:
            say(None, found["skipped"])
            return passed
        check(lambda: reachable(found["status"], dht.peer_id.to_base58(), opts, addresses))
        return passed
    finally:
        stop_dht(dht, socket_path)


def check_files(cfg: TrainConfig, opts: SwarmOptions) -> str:
    """What a join checks before it starts: the shard against the run's, key, certificate, identity."""
    opts.check_shard(cfg.data_shards)
    membership = Membership.from_options(opts.swarm_key_file, opts.owner, opts.certificate, opts.identity)
    if opts.identity is not None:
        check_identity(opts.identity)
    return f"options and files ({'an open run' if membership.is_open else membership.key_id})"


def admitted(opts: SwarmOptions, bootstrap_key_id: str) -> str:
    """Whether the bootstrap admits by the key (or owner) this peer holds."""
    membership = Membership.from_options(opts.swarm_key_file, opts.owner, opts.certificate, opts.identity)
    membership.check_admitted(bootstrap_key_id, f"--bootstrap {opts.bootstrap}")
    return f"the bootstrap admits this peer ({bootstrap_key_id})"


def locate_bootstrap(addr: str, found: dict[str, Any]) -> str:
    """The bootstrap's multiaddrs into ``found["maddrs"]``, and its HTTP HOST:PORT into
    ``found["status"]`` (None, with the reason in ``found["skipped"]``, if it cannot be found)."""
    if not addr.strip().startswith("/"):
        found["status"], found["maddrs"], found["key_id"] = find_bootstrap(addr)
        return f"the bootstrap's status server answers at {found['status']}"
    found["maddrs"], found["key_id"] = parse_bootstrap(addr)
    parts = addr.strip().split("/")  # /ip4/HOST/tcp/PORT/p2p/ID: its status server, where it is the default
    try:
        status, maddrs, _ = find_bootstrap(f"[{parts[2]}]:{STATUS_PORT}", timeout=3.0)
    except UserError:
        status, maddrs = None, []
    peer_id = addr.strip().rstrip("/").split("/")[-1]
    found["status"] = status if any(m.endswith(f"/p2p/{peer_id}") for m in maddrs) else None
    found["skipped"] = (
        "not checked whether other peers can reach this one: the bootstrap's status server is not on "
        f"{parts[2]}:{STATUS_PORT}; give --bootstrap as its HOST:PORT, and the bootstrap dials this peer back"
    )
    return f"--bootstrap {addr} is a multiaddr"


def join_bootstrap(dht: Any, maddrs: list[str]) -> str:
    """Connect to the bootstrap's DHT node through libp2p and ping it."""
    try:
        answer = dht.run_coroutine(partial(ping_bootstrap, maddrs), return_future=True)
        failure = answer.result(JOIN_TIMEOUT_S)
    except TimeoutError:
        failure = f"no answer within {JOIN_TIMEOUT_S:.0f} s"
    if failure is not None:
        raise UserError(
            f"the bootstrap's DHT node at {maddrs[0]} does not answer ({failure}): is its libp2p port "
            "open to this machine, and is the address it announces the one it has?"
        )
    return f"the bootstrap's DHT node answers at {maddrs[0]}"


def reachable(status: str, peer_id: str, opts: SwarmOptions, addresses: list[str]) -> str:
    """Ask the bootstrap to dial this peer back at the addresses it announces."""
    try:
        result = ask_dial_back(status, peer_id, DIAL_BACK_DEADLINE_S)
    except ConnectionError as exc:
        raise UserError(f"could not check whether other peers can reach this one: {exc}") from None
    if result == REACHABLE:
        return f"the bootstrap reached this peer at {' or '.join(addresses)}: other peers can"
    if result == UNKNOWN:
        raise UserError("the bootstrap lost this peer's connection before it could dial back: check again")
    hint = "open the port in your firewall or set --announce to your public address"
    if opts.host.startswith("127.") or opts.host in ("localhost", "::1"):
        hint = f"--host {opts.host} takes connections from this machine only: use --host 0.0.0.0 and {hint}"
    raise UserError(f"other peers cannot reach you at {' or '.join(addresses)}: {hint}")
