"""The swarm's bootstrap node: a DHT with a stable address that peers join through. It trains nothing.

A peer can only enter the DHT by dialling a multiaddr that ends in a peer id. The bootstrap keeps that
address stable across restarts (fixed ``--port``, identity file), prints the exact join commands, writes
them to a JSON file for scripts, and serves them over HTTP, so a peer can join with just HOST:PORT
(``parse_bootstrap`` in swarm/dht.py fetches ``/address``). The same server shows operators the swarm's
notice board (``/status``, with each peer's health), each peer's history (``/history``) and a page
charting both (``/``; its files are in web/). The HTTP thread never calls the DHT: a wedged DHT process
would hang it. It serves bytes that the main thread's event loop refreshes, where a wedged DHT costs a
timeout and a warning. ``/reach/<peer id>`` (``join --check``) dials a connected peer back: the HTTP
thread hands that dial to the event loop and waits for it a bounded time (``swarm/dial_back.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from contextlib import ExitStack, suppress
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from p2p_cocodc.config.bootstrap import BootstrapOptions
from p2p_cocodc.errors import UserError, listen_failed
from p2p_cocodc.ops.logs import configure_logging
from p2p_cocodc.ops.monitoring import serve_bootstrap_metrics
from p2p_cocodc.ops.watch import Endings, History, health, page_files
from p2p_cocodc.swarm.dht import p2pd_socket, start_dht, stop_dht
from p2p_cocodc.swarm.dial_back import REACH_PATH, DialBack
from p2p_cocodc.swarm.records import Board, PeerRecord, check_run_id
from p2p_cocodc.swarm.trust import Membership

log = logging.getLogger(__name__)

BOARD_TTL_S = 30.0  # the bootstrap only reads the board; Board wants a TTL for publishing
MAX_RUNS = 256  # run ids come from untrusted peers: bound what /status lists
# After the DHT process dies, /health answers 503 this long; then we exit 1 and systemd starts a fresh one.
DEAD_GRACE_S = 5.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
WILDCARDS = ("0.0.0.0", "::", "")
JSON = "application/json"
PAGE_POLICY = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'"
PEER_FIELDS = (
    "state",
    "step",
    "shard",
    "num_shards",
    "step_time_s",
    "bandwidth_mbps",
    "versions",
    "stall_s",
    "bytes_sent",
    "joined_at",
    "resume_step",
    "key_id",
    "refused",
    "outliers",
    "theta_step",
    "theta_sha",
    "theta_earlier",
    "theta_doubt",
    "region",
    "tokens_per_s",
    "val_ppl",
    "bytes_received",
    "last_round_s",
    "proposed_shape",
    "sync_shape",
    "starting_pace",
)


class Snapshot:
    """What the HTTP thread serves. The main thread swaps whole values in; each assignment is atomic."""

    def __init__(self, address: dict[str, Any]) -> None:
        self.started = time.monotonic()
        self.address = _dumps({k: address[k] for k in ("maddrs", "peer_id", "key_id") if k in address})
        self.status = _dumps({"runs": {}, "ended": {}, "updated_at": None, "error": None})
        self.ended = _dumps({})  # /ended: {run id: {"step", "steps", "at"}}, what a late peer asks
        self.history = _dumps(History().to_json())
        self.page = page_files()
        self.refreshed: float | None = None  # monotonic time of the last good read of the board
        self.dht_alive = True

    def health(self) -> tuple[int, bytes]:
        age = None if self.refreshed is None else round(time.monotonic() - self.refreshed, 1)
        body = {
            "ok": self.dht_alive,
            "dht_alive": self.dht_alive,
            "uptime_s": round(time.monotonic() - self.started, 1),
            "status_age_s": age,
        }
        return (200 if self.dht_alive else 503), _dumps(body)


class StatusServer(ThreadingHTTPServer):
    """GET /health, /address, /status from a Snapshot; daemon threads, so a stuck client cannot block exit."""

    daemon_threads = True

    def __init__(self, host: str, port: int) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.snapshot: Snapshot | None = None
        self.dial_back: DialBack | None = None  # /reach/<peer id>: join --check's dial-back
        super().__init__((host, port), _Handler)

    def route(self, path: str) -> tuple[int, bytes, str]:
        """(HTTP status, body, content type) of a GET of ``path``."""
        snap = self.snapshot
        if snap is None:
            return 503, _dumps({"error": "starting"}), JSON
        if path == "/health":
            return *snap.health(), JSON
        if path == "/address":
            return 200, snap.address, JSON
        if path == "/status":
            return 200, snap.status, JSON
        if path == "/ended":
            return 200, snap.ended, JSON
        if path.startswith(REACH_PATH) and self.dial_back is not None:
            code, answer = self.dial_back.handle(path[len(REACH_PATH) :])
            return code, _dumps(answer), JSON
        if path == "/history":
            return 200, snap.history, JSON
        name = "status.html" if path == "/" else path[1:]
        if name in snap.page:
            kind, body = snap.page[name]
            return 200, body, kind
        pages = "/, /health, /address, /status, /ended or /history"
        return 404, _dumps({"error": f"no such page {path!r}; try {pages}"}), JSON

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up mid-answer is not worth a traceback on stderr."""
        log.debug("HTTP request from %s failed", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server: StatusServer
    timeout = 10  # a client that connects and sends nothing frees its thread after this
    server_version = "p2p-cocodc-bootstrap"

    def do_GET(self) -> None:  # noqa: N802 - the name http.server dispatches to
        code, body, kind = self.server.route(urlsplit(self.path).path.rstrip("/") or "/")
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        # the page shows what untrusted peers wrote: it runs our script alone and talks to us alone
        self.send_header("Content-Security-Policy", PAGE_POLICY)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's signature
        log.debug("%s " + format, self.address_string(), *args)


def run_bootstrap(opts: BootstrapOptions) -> int:
    """Serve until SIGINT/SIGTERM (exit code 0) or until the DHT process dies (exit code 1)."""
    configure_logging(logging.INFO)
    opts.validate()
    membership = Membership.from_options(opts.swarm_key_file, opts.owner)
    status_host = opts.status_host or opts.host
    with ExitStack() as stack:
        # Bound before the DHT starts, so a taken port fails in a second, before anything is started.
        # The forked DHT process inherits this socket but never accepts on it, and dies with us.
        server = bind_status_server(status_host, opts.status_port)
        stack.callback(server.server_close)
        metrics = None
        if opts.metrics_port is not None:
            metrics, metrics_server = serve_bootstrap_metrics(status_host, opts.metrics_port)
            stack.callback(metrics_server.close)
            print(f"metrics {metrics_server.url}", flush=True)
        opts.make_state_dir()
        dht = start_dht(
            [], opts.host, opts.port, opts.announce, opts.identity_path, membership, protected=None
        )
        stack.callback(stop_dht, dht, p2pd_socket(dht))
        # Set only now: a Python handler installed before the fork would also run in the DHT process.
        signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            address = describe(dht, opts, status_host, server.server_address[1])
            address["key_id"] = membership.key_id  # a peer with another key is told so at once
            server.snapshot = snapshot = Snapshot(address)
            if metrics is not None:
                metrics.snapshot = snapshot
            server.dial_back = dial_back = DialBack(dht)
            threading.Thread(target=server.serve_forever, name="status-http", daemon=True).start()
            stack.callback(server.shutdown)
            write_address_file(opts.address_path, address)
            announce_join(address, opts, membership)
            import uvloop

            return uvloop.run(watch(dht, address["peer_id"], snapshot, opts.refresh_s, dial_back))
        except KeyboardInterrupt:
            log.warning("stopping: the DHT shuts down")
            return 0
        finally:
            _ignore_stop_signals()


def bind_status_server(host: str, port: int) -> StatusServer:
    """The HTTP server bound and listening (it serves once its thread starts), or a UserError."""
    try:
        return StatusServer(host, port)
    except OSError as exc:
        raise listen_failed(
            exc,
            in_use=f"--status-port {port} is in use: is another bootstrap running on {host}? "
            "Stop it or pick a free port",
            other=f"cannot serve HTTP on {host}:{port} ({{reason}}): check --status-host",
        ) from None


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _on_stop_signal(task: asyncio.Task[int], signum: int, frame: Any) -> None:
    """SIGINT's and SIGTERM's handler while ``watch`` serves: the serving task is cancelled on its
    loop. A Python handler, not the loop's ``add_signal_handler``: removing that one puts the
    default action back (for SIGTERM: the process ends by the signal) until ``_ignore_stop_signals``
    replaces it, and a second signal in that gap ended the bootstrap with -15."""
    task.get_loop().call_soon_threadsafe(_stop_serving, signal.Signals(signum), task)


def _stop_serving(sig: signal.Signals, task: asyncio.Task[int]) -> None:
    if task.cancelling():
        log.warning("%s: already stopping", sig.name)
    else:
        log.warning("stopping on %s: the DHT shuts down", sig.name)
    task.cancel()


def _ignore_stop_signals() -> None:
    """The stop is under way: a second SIGINT or SIGTERM (an impatient operator, a supervisor that
    signals the whole group) must not cut the shutdown short, nor the interpreter's exit after it
    (about a second with torch loaded): the process ends anyway. Never restored: Python's exit
    puts the default action back for handlers written in Python, and a signal then ended the
    bootstrap by the signal (exit status -2, -15 instead of 0); a second SIGTERM after one that
    came before the serving loop raised KeyboardInterrupt in the shutdown (130)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def describe(dht: Any, opts: BootstrapOptions, status_host: str, status_port: int) -> dict[str, Any]:
    """The bootstrap's addresses: what the address file holds and what a peer needs to join."""
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    host = join_host(opts.announce, status_host, maddrs)
    host_port = f"[{host}]:{status_port}" if ":" in host else f"{host}:{status_port}"
    return {
        "peer_id": str(dht.peer_id),
        "maddrs": maddrs,
        "status_url": f"http://{host_port}/status",
        "join": host_port,
    }


def join_host(announce: str | None, status_host: str, maddrs: list[str]) -> str:
    """The host other machines reach the HTTP server at: --announce, else a concrete listen address."""
    if announce:
        return announce
    if status_host not in WILDCARDS:
        return status_host
    for m in maddrs:  # listening on every interface: prefer one other machines can reach
        parts = m.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6") and not parts[2].startswith(("127.", "::1")):
            return parts[2]
    return "127.0.0.1"


def write_address_file(path: str, address: dict[str, Any]) -> None:
    """Write atomically, so a script polling for the file never reads half of it."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(address, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as exc:
        with suppress(OSError):
            os.unlink(tmp)
        raise UserError(f"--address-file {path}: cannot write it ({exc.strerror or exc})") from None


def announce_join(address: dict[str, Any], opts: BootstrapOptions, membership: Membership) -> None:
    """Print what peers must run; notes about reachability and openness go to stderr."""
    key = ""
    if opts.swarm_key_file is not None:
        key = f" --swarm-key-file {opts.swarm_key_file}"
    elif opts.owner is not None:
        key = f" --owner {opts.owner} --identity ID_FILE --certificate CERT_FILE"
    lines = [
        f"bootstrap peer id {address['peer_id']} (identity {opts.identity_path})",
        f"status page http://{address['join']}/; addresses written to {opts.address_path}",
        "peers join with any of:",
        f"  p2p-cocodc join --bootstrap {address['join']}{key}",
        *(f"  p2p-cocodc join --bootstrap {m}{key}" for m in address["maddrs"]),
    ]
    print("\n".join(lines), flush=True)
    if membership.is_open:
        print(
            "note: open: any peer that reaches this bootstrap may join its runs and send updates; to "
            "admit only your peers, create a key (p2p-cocodc keygen swarm.key) and pass "
            "--swarm-key-file swarm.key here and to every join",
            file=sys.stderr,
            flush=True,
        )
    else:
        print(
            f"only holders of swarm key {membership.key_id} may publish here or take part in runs"
            if membership.owner is None
            else f"only peers certified by owner {membership.owner} may publish here or take part in runs",
            file=sys.stderr,
            flush=True,
        )
    if opts.host in WILDCARDS and not opts.announce:
        print(
            "note: no --announce: peers behind NAT may not reach the addresses above",
            file=sys.stderr,
            flush=True,
        )
    elif opts.host.startswith("127.") or opts.host in ("localhost", "::1"):
        print(
            f"note: --host {opts.host} accepts peers on this machine only; "
            "on a public machine use --host 0.0.0.0 --announce PUBLIC_IP",
            file=sys.stderr,
            flush=True,
        )


async def watch(
    dht: Any, peer_id: str, snapshot: Snapshot, refresh_s: float, dial_back: DialBack | None = None
) -> int:
    """Refresh the status snapshot every ``refresh_s`` until a signal (0) or the DHT's death (1); run
    ``dial_back``'s dials on this loop, the one thread that calls the DHT."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    if dial_back is not None:
        dial_back.attach(loop)
    for sig in STOP_SIGNALS:
        signal.signal(sig, partial(_on_stop_signal, task))
    dead_since: float | None = None
    failing = False
    history, endings = History(), Endings()
    try:
        while True:
            if task.cancelling():  # a stop signal whose cancel a DHT call swallowed (3.11's wait_for can)
                return 0  # the DHT may be gone by the same signal (sent to the group): not a death
            snapshot.dht_alive = dht.is_alive()
            if not snapshot.dht_alive:
                if dead_since is None:
                    log.error("the DHT process has died; exiting in %.0f s", DEAD_GRACE_S)
                    dead_since = time.monotonic()
                elif time.monotonic() - dead_since > DEAD_GRACE_S:
                    return 1
            else:
                failing = await refresh(dht, peer_id, snapshot, history, failing, endings)
            await asyncio.sleep(refresh_s)
    except asyncio.CancelledError:
        return 0
    finally:
        _ignore_stop_signals()  # the shutdown follows


async def refresh(
    dht: Any, peer_id: str, snapshot: Snapshot, history: History, failing: bool, endings: Endings
) -> bool:
    """Read the board into the snapshot, the history and the runs seen to end (``endings``); on a
    timeout keep the last ones. Returns whether the read failed."""
    try:
        board = await read_board(dht, peer_id)
    except ConnectionError as exc:
        if not failing:
            log.warning("cannot read the swarm's board (%s); serving the last snapshot", exc)
        last = json.loads(snapshot.status)
        snapshot.status = _dumps({**last, "error": str(exc)})
        return True
    if failing:
        log.info("reading the swarm's board again")
    from hivemind.utils import get_dht_time  # the clock records are written by

    now = get_dht_time()
    runs = {}
    for run_id, (info, found) in board.items():
        records = {p: record for p, (record, _) in found.items()}
        ages = {p: max(0.0, now - written) for p, (_, written) in found.items()}
        words = health(records, ages)
        views = {
            p: {**_peer_view(r), "age_s": round(ages[p], 1), "health": words[p]} for p, r in records.items()
        }
        runs[run_id] = {"info": _jsonable(info), "peers": views}
        for p, record in records.items():
            history.add(run_id, p, record, now)
        endings.read(run_id, records, runs[run_id]["info"], views, time.time())
    status = {"runs": runs, "ended": endings.to_json(), "updated_at": time.time(), "error": None}
    snapshot.status = _dumps(status)
    snapshot.ended = _dumps({r: {k: e[k] for k in ("step", "steps", "at")} for r, e in endings.runs.items()})
    snapshot.history = _dumps(history.to_json())
    snapshot.refreshed = time.monotonic()
    return False


async def read_board(dht: Any, peer_id: str) -> dict[str, tuple[Any, dict[str, tuple[PeerRecord, float]]]]:
    """{run_id: (its info, {peer: (record, when written)})} of every live run; raises ConnectionError
    when the DHT times out."""
    infos = await Board(dht, "bootstrap", peer_id, BOARD_TTL_S).runs()
    run_ids = sorted(r for r in infos if _valid_run_id(r))[:MAX_RUNS]
    boards = [Board(dht, r, peer_id, BOARD_TTL_S) for r in run_ids]
    peers = await asyncio.gather(*(b.peers_written() for b in boards))
    return {run_id: (infos[run_id], found) for run_id, found in zip(run_ids, peers, strict=True)}


def _valid_run_id(run_id: str) -> bool:
    try:
        check_run_id(run_id)
    except UserError:
        return False
    return True


def _peer_view(record: PeerRecord) -> dict[str, Any]:
    return {name: getattr(record, name) for name in PEER_FIELDS}


def _jsonable(value: Any) -> Any:
    """A peer's run info as JSON can carry it; anything else (bytes, NaN) as a short repr."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return repr(value)[:1000]
    return value


def _dumps(value: Any) -> bytes:
    return json.dumps(value, allow_nan=False).encode()
