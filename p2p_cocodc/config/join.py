"""How a peer finds and joins the swarm: ``join``'s own options, beside the training options
(``config/train.py``), declared in the one option schema (``config/schema.py``): from the command
line, the environment or a profile's [swarm] table."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2p_cocodc.config.schema import REQUIRED, Schema, opt
from p2p_cocodc.errors import UserError


def parse_shard(text: str) -> tuple[int, int]:
    index, sep, count = text.partition("/")
    if not sep or not index.isdigit() or not count.isdigit():
        raise UserError(f"--shard {text!r}: write it as I/N, for example 0/3")
    return int(index), int(count)


@dataclass(frozen=True)
class SwarmOptions:
    """How this peer finds and joins the swarm. None of it changes what is computed, except that
    ``pace="link"`` lets this peer ask the swarm to send less when its link cannot keep up: a change
    every peer takes at the same step (``Peer._pace_wish``), recorded for ``simulate --events``."""

    bootstrap: str = opt(
        REQUIRED,
        "the bootstrap's HOST:PORT as it printed it (HOST alone: port 31338), or its multiaddr",
        metavar="HOST:PORT|MULTIADDR",
    )
    run_id: str = opt("default", "runs sharing one DHT stay apart")
    host: str = opt("127.0.0.1", "address this peer listens on", metavar="HOST")
    port: int = opt(0, "libp2p port", shown="0, any free one")
    announce: str | None = opt(None, "address other peers dial", metavar="HOST", shown="--host")
    shard: tuple[int, int] | None = opt(
        None, "read data shard I of N", metavar="I/N", shown="a free one", parse=parse_shard
    )
    identity: str | None = opt(
        None,
        "private key file, created if missing: a restarted peer keeps its id",
        metavar="FILE",
        shown="a new id each run",
    )
    swarm_key_file: str | None = opt(
        None,
        "admit only holders of this key (made by `p2p-cocodc keygen`)",
        metavar="FILE",
        shown="an open run",
    )
    owner: str | None = opt(
        None,
        "admit only peers certified by this owner (the id `p2p-cocodc keygen --owner` printed)",
        metavar="OWNER_ID",
    )
    certificate: str | None = opt(
        None,
        "with --owner: this peer's certificate (from the owner's `p2p-cocodc admit`; needs --identity)",
        metavar="FILE",
    )
    wait_peers_s: float = opt(300.0, "seconds to wait for --workers peers", shown="300", flag="wait-peers")
    round_timeout_s: float = opt(
        60.0,
        "seconds a sync may take beyond what measured step times predict",
        shown="60",
        flag="round-timeout",
    )
    heartbeat_s: float = 1.0  # not an option: how often the board is read and written
    pace: str = opt(
        "link",
        "link: when this peer's link cannot carry cocodc's sends, ask the swarm to send less "
        "(every peer takes the pace a round agreed); fixed: never ask",
        ("link", "fixed"),
    )
    region_parallel: str = opt(
        "ddp",
        "under torchrun, how the region's ranks hold its replica: ddp (each rank all of it), fsdp "
        "(FSDP2: parameters, gradients and AdamW sharded across the ranks; rank 0 keeps a whole copy "
        "on its host for the syncs)",
        ("ddp", "fsdp"),
    )
    # a slower region emulated: each inner step takes at least this long (the rest slept)
    min_step_s: float = opt(
        0.0,
        "each inner step takes at least this many seconds, the rest slept: a slower region "
        "emulated for tests and benchmarks (uneven regions); 0: as fast as it trains",
        shown="0",
        flag="min-step-time",
    )
    # the name operators see (bars, status, metrics); None: the peer id
    region: str | None = opt(
        None,
        "this peer's name in progress bars, status and metrics",
        metavar="NAME",
        shown="the --config profile's file name, else the peer id",
    )
    # serve Prometheus metrics here (``ops/monitoring.py``); None: none
    metrics_port: int | None = opt(
        None,
        "serve Prometheus metrics at http://HOST:PORT/metrics, HOST being --host (docs/monitoring.md)",
    )
    # not an option: the --config profile whose [swarm] table set --port (None: the command line, the
    # environment or the default did): taken, that port most likely means this region's peer runs
    port_profile: str | None = None

    def __post_init__(self) -> None:
        """Raise UserError naming the option to fix: a bad address now, not after the model is built."""
        from p2p_cocodc.swarm.dht import listen_maddrs
        from p2p_cocodc.swarm.records import check_run_id

        check_run_id(self.run_id)
        check_region(self.region)
        if self.pace not in ("link", "fixed"):
            raise UserError(f"--pace {self.pace!r}: use 'link' or 'fixed'")
        if self.region_parallel not in ("ddp", "fsdp"):
            raise UserError(f"--region-parallel {self.region_parallel!r}: use 'ddp' or 'fsdp'")
        if self.shard is not None and not 0 <= self.shard[0] < self.shard[1]:
            raise UserError(f"--shard {self.shard[0]}/{self.shard[1]}: need 0 ≤ I < N")
        if self.port and self.port == self.metrics_port:
            raise UserError(f"--port and --metrics-port are both {self.port}: they must differ")
        if not 0 <= self.min_step_s <= 3600:
            raise UserError(f"--min-step-time {self.min_step_s}: use 0 to 3600 seconds")
        for name in ("wait_peers_s", "round_timeout_s", "heartbeat_s"):
            if not getattr(self, name) > 0:
                raise UserError(f"--{name.replace('_s', '').replace('_', '-')} must be > 0 seconds")
        listen_maddrs(self.host, self.port)
        if self.announce is not None:
            listen_maddrs(self.announce, self.port, "--announce")

    def port_taken(self) -> str | None:
        """The line for a taken --port that the profile set (None where it did not): the region's own
        peer most likely holds it, and another --port would start a second peer of the region."""
        if self.port_profile is None:
            return None
        unit = Path(self.port_profile).stem  # the unit reads /etc/p2p-cocodc/<its instance>.toml
        status = self.bootstrap if not self.bootstrap.strip().startswith("/") else "HOST:PORT"
        return (
            f"--port {self.port} is in use on {self.host}: it is the port {self.port_profile} sets, so "
            f"this region's peer ({self.region or unit}) is probably running already; check with "
            f"`p2p-cocodc status --bootstrap {status} --run-id {self.run_id}` or its unit "
            f"(`systemctl status p2p-cocodc-peer@{unit}`); for a second peer here, give it another --port"
        )

    def check_shard(self, data_shards: int) -> None:
        if self.shard is not None and self.shard[1] != data_shards:
            raise UserError(
                f"--shard {self.shard[0]}/{self.shard[1]}: N must equal --max-peers {data_shards} "
                "(the number of shards the run's data is cut into; by default --workers)"
            )


SWARM = Schema(SwarmOptions)


def swarm_options(
    file_values: dict[str, Any], cli_values: dict[str, Any], profile: str | None = None
) -> SwarmOptions:
    """Defaults, then the profile's [swarm] table, then the command line (and the environment),
    by key (``wait_peers``, as click names it); None on the command line: not given. ``profile``:
    the file the table is from, named where a port it sets is taken (``port_taken``)."""
    from_file = SWARM.read_table(file_values, "[swarm] table")
    merged = {**from_file, **SWARM.given({k: v for k, v in cli_values.items() if v is not None})}
    if "bootstrap" not in merged:
        raise UserError(
            "join needs --bootstrap (the bootstrap's HOST:PORT or multiaddr), or bootstrap in [swarm]"
        )
    if profile is not None and merged.get("port") and from_file.get("port") == merged["port"]:
        merged["port_profile"] = profile
    return SwarmOptions(**merged)


def check_region(region: str | None) -> None:
    from p2p_cocodc.swarm.records import REGION_CHARS

    if region is not None and not (0 < len(region) <= 32 and set(region) <= REGION_CHARS):
        raise UserError(f"--region {region!r}: use 1-32 letters, digits, '-', '_' or '.'")
