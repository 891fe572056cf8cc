"""Prometheus metrics: ``join --metrics-port`` (a peer) and ``bootstrap --metrics-port`` (a swarm's runs).

Each process keeps its metrics in a registry of its own (not prometheus_client's global one: tests run
several peers in one process) and serves it at ``http://HOST:PORT/metrics`` from daemon threads that
end with the process. A scrape never touches the peer's live state: the peer's event loop hands over a
``PeerSample`` of its own numbers (after every step and record, and every heartbeat), and the scrape
thread reads the latest one; the bootstrap's metrics are read from the same snapshot as its /status.

A peer's metrics are those of its --out records and summary:

| name | type | labels | what |
|---|---|---|---|
| ``p2p_cocodc_peer_info`` | gauge (1) | run_id, region, peer_id, algo | which peer this is |
| ``p2p_cocodc_peer_state`` | gauge (1) | state | waiting, joining, training, leaving or done |
| ``p2p_cocodc_step`` | gauge | | the latest inner step finished (the run's step count) |
| ``p2p_cocodc_inner_steps_total`` | counter | | inner steps this process trained |
| ``p2p_cocodc_tokens_total`` | counter | | tokens this process trained on |
| ``p2p_cocodc_step_seconds`` | gauge | | an inner step's time (moving average) |
| ``p2p_cocodc_tokens_per_second`` | gauge | | training throughput (waits and evaluations left out) |
| ``p2p_cocodc_sent_bytes_total`` | counter | | payload sent, each delivery once (the summary's bytes_sent) |
| ``p2p_cocodc_resent_bytes_total`` | counter | | the same deliveries sent again |
| ``p2p_cocodc_served_bytes_total`` | counter | | averages served to peers left out of a round |
| ``p2p_cocodc_received_bytes_total`` | counter | | exchange payload received from members |
| ``p2p_cocodc_stall_seconds_total`` | counter | | time training waited for a sync's result |
| ``p2p_cocodc_rounds_total`` | counter | outcome (completed, failed) | syncs this peer settled |
| ``p2p_cocodc_round_duration_seconds`` | histogram | | how long each completed sync took |
| ``p2p_cocodc_resyncs_total`` | counter | | times it took the swarm's state again |
| ``p2p_cocodc_refused_total`` | counter | | messages and requests it refused (non-members, limits) |
| ``p2p_cocodc_outliers_total`` | counter | | members' slices it left out of a mean |
| ``p2p_cocodc_board_peers`` | gauge | state | peers on its notice board, by state |
| ``p2p_cocodc_eval_step`` | gauge | | the step of the latest evaluation of θ̄ |
| ``p2p_cocodc_val_loss`` | gauge | | validation loss of θ̄ there (nats per token) |
| ``p2p_cocodc_val_perplexity`` | gauge | | validation perplexity of θ̄ there |
| ``p2p_cocodc_train_loss`` | gauge | | mean training loss of the steps before it |

The bootstrap's come from the notice board, which untrusted peers write: per-peer series are kept for
at most ``MAX_PEER_SERIES`` peers (all runs together, in run and peer id order), and every label value
is checked (run ids and regions by the board's own rules, peer ids as base58):

| name | type | labels | what |
|---|---|---|---|
| ``p2p_cocodc_bootstrap_dht_up`` | gauge | | 1 while its DHT process lives |
| ``p2p_cocodc_bootstrap_board_age_seconds`` | gauge | | since the last good read of the board |
| ``p2p_cocodc_bootstrap_runs`` | gauge | | live runs on the board |
| ``p2p_cocodc_bootstrap_peers`` | gauge | run_id, state | live peers by state |
| ``p2p_cocodc_bootstrap_peer_step`` | gauge | run_id, peer, region | each peer's step |
| ``p2p_cocodc_bootstrap_peer_val_perplexity`` | gauge | run_id, peer, region | its latest perplexity of θ̄ |
| ``p2p_cocodc_bootstrap_peer_tokens_per_second`` | gauge | run_id, peer, region | its throughput |
| ``p2p_cocodc_bootstrap_peer_stall_seconds`` | gauge | run_id, peer, region | its stall so far |
| ``p2p_cocodc_bootstrap_peer_sent_bytes`` | gauge | run_id, peer, region | its bytes sent so far |
| ``p2p_cocodc_bootstrap_peer_received_bytes`` | gauge | run_id, peer, region | its bytes received so far |

(The bootstrap's per-peer totals are gauges: they are what a record says, not counted here.) Both
also serve the standard ``process_*`` metrics of their process (CPU seconds, resident memory, open files).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from p2p_cocodc.errors import UserError, listen_failed

PREFIX = "p2p_cocodc"
# a sync takes a fraction of a second between two processes on one machine, minutes on a thin link
ROUND_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 150.0, 300.0, 600.0)
MAX_PEER_SERIES = 256  # peers with series of their own on the bootstrap (peers are untrusted)
BASE58 = frozenset("123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz")


def own_registry() -> CollectorRegistry:
    """A registry of one process's own, with the usual ``process_*`` metrics (CPU, memory, files)."""
    own = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=own)
    return own


# ---- the HTTP server ----


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress never holds up the process's exit


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(WSGIRequestHandler):
    timeout = 10  # a client that connects and sends nothing frees its thread after this

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's signature
        """Scrapes are not worth a line each."""


@dataclass
class MetricsServer:
    """A registry served at /metrics on a daemon thread; ``port`` is the one bound (0 picks one)."""

    host: str
    port: int
    server: WSGIServer

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"


def serve(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Bind ``host:port`` and serve ``registry`` from now on, or UserError naming --metrics-port."""
    if not 0 <= port < 65536:
        raise UserError(f"--metrics-port must be in [0, 65535], got {port}")
    server_class = _Server6 if ":" in host else _Server
    try:
        server = make_server(host, port, make_wsgi_app(registry), server_class, handler_class=_Handler)
    except OSError as exc:
        raise listen_failed(
            exc,
            in_use=f"--metrics-port {port} is in use on {host}: is another peer or bootstrap serving its "
            "metrics there? Stop it or pick a free port",
            other=f"--metrics-port {port}: cannot listen on {host} ({{reason}})",
        ) from None
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return MetricsServer(host, server.server_address[1], server)


# ---- a peer ----


@dataclass(frozen=True)
class PeerSample:
    """A peer's numbers at one moment, taken on its event loop; what a scrape reads."""

    state: str = "waiting"
    step: int = 0
    inner_steps: int = 0
    tokens: int = 0
    step_seconds: float = 0.0
    tokens_per_second: float = 0.0
    stall_seconds: float = 0.0
    sent_bytes: int = 0
    resent_bytes: int = 0
    served_bytes: int = 0
    received_bytes: int = 0
    rounds_completed: int = 0
    rounds_failed: int = 0
    resyncs: int = 0
    refused: int = 0
    outliers: int = 0
    board: dict[str, int] = field(default_factory=dict)  # peers on its board, by state


COUNTERS = {  # PeerSample field -> (metric name, help)
    "inner_steps": ("inner_steps", "inner steps this process trained"),
    "tokens": ("tokens", "tokens this process trained on"),
    "sent_bytes": ("sent_bytes", "exchange payload bytes sent, each delivery once"),
    "resent_bytes": ("resent_bytes", "exchange payload bytes sent again after a lost copy"),
    "served_bytes": ("served_bytes", "averages served to peers left out of a round"),
    "received_bytes": ("received_bytes", "exchange payload bytes received from members"),
    "stall_seconds": ("stall_seconds", "time training waited for a sync's result"),
    "resyncs": ("resyncs", "times this peer took the swarm's state again"),
    "refused": ("refused", "messages and requests this peer refused"),
    "outliers": ("outliers", "members' slices left out of a mean as outliers"),
}
GAUGES = {
    "step": ("step", "the latest inner step finished"),
    "step_seconds": ("step_seconds", "an inner step's time (moving average)"),
    "tokens_per_second": ("tokens_per_second", "training throughput, waits and evaluations left out"),
}
EVAL_GAUGES = {  # eval record field -> (metric name, help)
    "step": ("eval_step", "the step of the latest evaluation of the global parameters"),
    "val_loss": ("val_loss", "validation loss of the global parameters (nats per token)"),
    "val_ppl": ("val_perplexity", "validation perplexity of the global parameters"),
    "train_loss": ("train_loss", "mean training loss of the steps before the latest evaluation"),
}


class PeerMetrics(Collector):
    """One peer's metrics: the latest sample and evaluation, and a histogram of sync durations."""

    def __init__(self) -> None:
        self.registry = own_registry()
        self.sample = PeerSample()
        self.evaluation: dict[str, float] = {}
        self.info: dict[str, str] = {}
        self.round_seconds = Histogram(
            f"{PREFIX}_round_duration_seconds",
            "how long each completed sync took",
            buckets=ROUND_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(self)

    def identify(self, **labels: str) -> None:
        self.info = dict(labels)

    def record(self, record: dict[str, Any]) -> None:
        """Take what a run record says (an evaluation's numbers)."""
        if record["kind"] == "eval":
            self.evaluation = {k: float(record[k]) for k in EVAL_GAUGES if record.get(k) is not None}

    def collect(self) -> Iterator[Metric]:
        sample, evaluation = self.sample, self.evaluation  # each swapped whole by the event loop
        if self.info:
            info = GaugeMetricFamily(f"{PREFIX}_peer_info", "which peer this is", labels=sorted(self.info))
            info.add_metric([self.info[k] for k in sorted(self.info)], 1)
            yield info
        state = GaugeMetricFamily(f"{PREFIX}_peer_state", "this peer's state (1)", labels=["state"])
        state.add_metric([sample.state], 1)
        yield state
        for attr, (name, text) in COUNTERS.items():
            yield CounterMetricFamily(f"{PREFIX}_{name}", text, value=getattr(sample, attr))
        for attr, (name, text) in GAUGES.items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", text, value=getattr(sample, attr))
        rounds = CounterMetricFamily(f"{PREFIX}_rounds", "syncs this peer settled", labels=["outcome"])
        rounds.add_metric(["completed"], sample.rounds_completed)
        rounds.add_metric(["failed"], sample.rounds_failed)
        yield rounds
        board = GaugeMetricFamily(f"{PREFIX}_board_peers", "peers on this peer's board", labels=["state"])
        for peer_state, count in sorted(sample.board.items()):
            board.add_metric([peer_state], count)
        yield board
        for key, (name, text) in EVAL_GAUGES.items():
            if key in evaluation:
                yield GaugeMetricFamily(f"{PREFIX}_{name}", text, value=evaluation[key])


def serve_peer_metrics(host: str, port: int) -> tuple[PeerMetrics, MetricsServer]:
    metrics = PeerMetrics()
    return metrics, serve(metrics.registry, host, port)


# ---- the bootstrap ----

PEER_GAUGES = {  # /status peer field -> (metric name, help)
    "step": ("peer_step", "the peer's latest inner step"),
    "val_ppl": ("peer_val_perplexity", "the peer's latest validation perplexity of the global parameters"),
    "tokens_per_s": ("peer_tokens_per_second", "the peer's training throughput"),
    "stall_s": ("peer_stall_seconds", "time the peer's training waited for syncs"),
    "bytes_sent": ("peer_sent_bytes", "exchange payload bytes the peer sent"),
    "bytes_received": ("peer_received_bytes", "exchange payload bytes the peer received"),
}


class BootstrapMetrics(Collector):
    """The swarm's runs as the bootstrap reads them: from ``snapshot`` (bootstrap.Snapshot), once set."""

    def __init__(self) -> None:
        self.registry = own_registry()
        self.snapshot: Any = None
        self.registry.register(self)

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        up = GaugeMetricFamily(f"{PREFIX}_bootstrap_dht_up", "1 while the DHT process lives")
        up.add_metric([], 1 if snap is not None and snap.dht_alive else 0)
        yield up
        if snap is None:
            return
        if snap.refreshed is not None:
            age = time.monotonic() - snap.refreshed
            yield GaugeMetricFamily(
                f"{PREFIX}_bootstrap_board_age_seconds", "since the last good read of the board", value=age
            )
        runs = json.loads(snap.status)["runs"]
        yield GaugeMetricFamily(f"{PREFIX}_bootstrap_runs", "live runs on the board", value=len(runs))
        states = GaugeMetricFamily(
            f"{PREFIX}_bootstrap_peers", "live peers of a run by state", labels=["run_id", "state"]
        )
        per_peer = {
            key: GaugeMetricFamily(f"{PREFIX}_bootstrap_{name}", text, labels=["run_id", "peer", "region"])
            for key, (name, text) in PEER_GAUGES.items()
        }
        listed = 0
        for run_id, run in sorted(runs.items()):
            counts: dict[str, int] = {}
            for peer, view in sorted(run["peers"].items()):
                counts[view["state"]] = counts.get(view["state"], 0) + 1
                if listed >= MAX_PEER_SERIES or not _is_peer_id(peer):
                    continue
                listed += 1
                for key, gauge in per_peer.items():
                    value = view[key]
                    if value is not None and value >= 0:  # -1: none yet (no evaluation)
                        gauge.add_metric([run_id, peer, view["region"]], value)
            for peer_state, count in sorted(counts.items()):
                states.add_metric([run_id, peer_state], count)
        yield states
        yield from per_peer.values()


def _is_peer_id(peer: str) -> bool:
    return 0 < len(peer) <= 64 and set(peer) <= BASE58


def serve_bootstrap_metrics(host: str, port: int) -> tuple[BootstrapMetrics, MetricsServer]:
    metrics = BootstrapMetrics()
    return metrics, serve(metrics.registry, host, port)
