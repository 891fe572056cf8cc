"""The bootstrap node's options (``p2p-cocodc bootstrap``, served by ``ops/bootstrap.py``), declared in
the one option schema (``config/schema.py``): from the command line, the environment or a --config
file of the same keys."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from p2p_cocodc.config.schema import Schema, opt
from p2p_cocodc.errors import UserError


@dataclass(frozen=True)
class BootstrapOptions:
    """The ``p2p-cocodc bootstrap`` options; ``status_host`` None means ``host``."""

    identity: str = opt(
        "bootstrap.id",
        "private key file, created on first run; keeps the peer id (and so the join address) stable",
    )
    host: str = opt("127.0.0.1", "address to listen on (0.0.0.0: all)")
    port: int = opt(31337, "libp2p port; fixed so restarts keep the address")
    announce: str | None = opt(None, "public address peers dial", metavar="HOST", shown="--host")
    address_file: str = opt("bootstrap.json", "write the join addresses here (JSON)")
    status_host: str | None = opt(None, "address of the HTTP server", metavar="HOST", shown="--host")
    status_port: int = opt(
        31338, "HTTP port serving /address (for join --bootstrap HOST:PORT), /status and /health"
    )
    refresh_s: float = opt(1.0, "seconds between reads of swarm status", flag="refresh")
    swarm_key_file: str | None = opt(
        None,
        "accept records only from holders of this key (made by `p2p-cocodc keygen`)",
        metavar="FILE",
        shown="open",
    )
    owner: str | None = opt(
        None,
        "accept records only from peers this owner certified (`p2p-cocodc keygen --owner`)",
        metavar="OWNER_ID",
    )
    # Prometheus metrics on the status host (ops/monitoring.py); None: none
    metrics_port: int | None = opt(
        None,
        "serve Prometheus metrics of the swarm's runs at http://HOST:PORT/metrics, HOST being "
        "--status-host (docs/monitoring.md)",
    )

    def validate(self) -> BootstrapOptions:
        """Reject bad values before anything starts, each with the flag to fix; return self."""
        from p2p_cocodc.swarm.dht import listen_maddrs

        for flag, port in (("--port", self.port), ("--status-port", self.status_port)):
            if not 0 <= port < 65536:
                raise UserError(f"{flag} must be in [0, 65535], got {port}")
        listen_maddrs(self.host, self.port)
        if self.announce:
            listen_maddrs(self.announce, self.port, "--announce")
        if not (math.isfinite(self.refresh_s) and 0.1 <= self.refresh_s <= 3600):
            raise UserError(f"--refresh must be in [0.1, 3600] seconds, got {self.refresh_s}")
        if self.port and self.port == self.status_port:
            raise UserError(f"--port and --status-port are both {self.port}: they must differ")
        for flag, port in (("--port", self.port), ("--status-port", self.status_port)):
            if port and port == self.metrics_port:
                raise UserError(f"{flag} and --metrics-port are both {port}: they must differ")
        _check_writable_file("--identity", self.identity)
        _check_writable_file("--address-file", self.address_file)
        return self


BOOTSTRAP = Schema(BootstrapOptions)


def bootstrap_options(
    file_values: dict[str, Any], cli_values: dict[str, Any], where: str
) -> BootstrapOptions:
    """Defaults, then the file's keys (``where``: the file, for messages), then the command line
    (and the environment), by key (``refresh``, as click names it); None: not given. Checked by
    ``validate``, which ``run_bootstrap`` calls first."""
    merged = {
        **BOOTSTRAP.read_table(file_values, where),
        **BOOTSTRAP.given({k: v for k, v in cli_values.items() if v is not None}),
    }
    return BootstrapOptions(**merged)


def _check_writable_file(flag: str, path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UserError(f"{flag} {path} is a directory; give a file name")
    if not os.path.isdir(parent):
        raise UserError(f"{flag} {path}: the directory {parent} does not exist")
    if os.path.exists(path) and not os.access(path, os.R_OK):
        raise UserError(f"{flag} {path} exists but cannot be read")
    if not os.path.exists(path) and not os.access(parent, os.W_OK):
        raise UserError(f"{flag} {path} cannot be created: {parent} is not writable")
