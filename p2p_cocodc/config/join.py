"""How a peer finds and joins the swarm: ``join``'s own options, beside the training options
(``config/train.py``), from the command line or a profile's [swarm] table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from p2p_cocodc.errors import UserError
from p2p_cocodc.swarm.dht import listen_maddrs
from p2p_cocodc.swarm.records import REGION_CHARS, check_run_id


@dataclass(frozen=True)
class SwarmOptions:
    """How this peer finds and joins the swarm. None of it changes what is computed, except that
    ``pace="link"`` lets this peer ask the swarm to send less when its link cannot keep up: a change
    every peer takes at the same step (``Peer._pace_wish``), recorded for ``simulate --events``."""

    bootstrap: str
    run_id: str = "default"
    host: str = "127.0.0.1"
    port: int = 0
    announce: str | None = None
    shard: tuple[int, int] | None = None
    identity: str | None = None
    swarm_key_file: str | None = None
    owner: str | None = None
    certificate: str | None = None
    wait_peers_s: float = 300.0
    round_timeout_s: float = 60.0
    heartbeat_s: float = 1.0
    pace: str = "link"
    region: str | None = None  # the name operators see (bars, status, metrics); None: the peer id
    metrics_port: int | None = None  # serve Prometheus metrics here (``monitoring.py``); None: none

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        check_region(self.region)
        if self.pace not in ("link", "fixed"):
            raise UserError(f"pace {self.pace!r}: use 'link' or 'fixed'")
        if self.shard is not None and not 0 <= self.shard[0] < self.shard[1]:
            raise UserError(f"--shard {self.shard[0]}/{self.shard[1]}: need 0 ≤ I < N")
        if self.port and self.port == self.metrics_port:
            raise UserError(f"--port and --metrics-port are both {self.port}: they must differ")
        for name in ("wait_peers_s", "round_timeout_s", "heartbeat_s"):
            if not getattr(self, name) > 0:
                raise UserError(f"--{name.replace('_s', '').replace('_', '-')} must be > 0 seconds")
        listen_maddrs(self.host, self.port)  # a bad address now, not after the model is built
        if self.announce is not None:
            listen_maddrs(self.announce, self.port, "--announce")

    def check_shard(self, data_shards: int) -> None:
        if self.shard is not None and self.shard[1] != data_shards:
            raise UserError(
                f"--shard {self.shard[0]}/{self.shard[1]}: N must equal --max-peers {data_shards} "
                "(the number of shards the run's data is cut into; by default --workers)"
            )


SWARM_KEYS = {
    "bootstrap": str,
    "run_id": str,
    "host": str,
    "port": int,
    "announce": str,
    "shard": str,
    "identity": str,
    "swarm_key_file": str,
    "owner": str,
    "certificate": str,
    "wait_peers": float,
    "round_timeout": float,
    "pace": str,
    "region": str,
    "metrics_port": int,
}


def swarm_options(file_values: dict[str, Any], cli_values: dict[str, Any]) -> SwarmOptions:
    """Defaults, then the profile's [swarm] table, then the command line."""
    merged: dict[str, Any] = {}
    for key, value in file_values.items():
        name = key.replace("-", "_")
        kind = SWARM_KEYS.get(name)
        if kind is None:
            raise UserError(f"[swarm] table: unknown key {key!r}; valid keys: {', '.join(SWARM_KEYS)}")
        allowed = (int, float) if kind is float else (kind,)
        if not isinstance(value, allowed) or isinstance(value, bool):
            expected = {str: "a string", int: "an integer", float: "a number"}[kind]
            raise UserError(f"[swarm] {key} must be {expected}, got {value!r}")
        merged[name] = value
    merged.update({k: v for k, v in cli_values.items() if v is not None})
    if "bootstrap" not in merged:
        raise UserError(
            "join needs --bootstrap (the bootstrap's HOST:PORT or multiaddr), or bootstrap in [swarm]"
        )
    shard = merged.pop("shard", None)
    renamed = {"wait_peers": "wait_peers_s", "round_timeout": "round_timeout_s"}
    return SwarmOptions(
        shard=parse_shard(shard) if shard is not None else None,
        **{renamed.get(k, k): (float(v) if k in renamed else v) for k, v in merged.items()},
    )


def check_region(region: str | None) -> None:
    if region is not None and not (0 < len(region) <= 32 and set(region) <= REGION_CHARS):
        raise UserError(f"--region {region!r}: use 1-32 letters, digits, '-', '_' or '.'")


def parse_shard(text: str) -> tuple[int, int]:
    index, sep, count = text.partition("/")
    if not sep or not index.isdigit() or not count.isdigit():
        raise UserError(f"--shard {text!r}: write it as I/N, for example 0/3")
    return int(index), int(count)
