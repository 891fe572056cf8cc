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

    identity: str | None = opt(
        None,
        "private key file, created on first run; keeps the peer id (and so the join address) stable",
        metavar="FILE",
        shown="STATE_DIR/bootstrap.id",
    )
    host: str = opt("127.0.0.1", "address to listen on (0.0.0.0: all)")
    port: int = opt(31337, "libp2p port; fixed so restarts keep the address")
    announce: str | None = opt(None, "public address peers dial", metavar="HOST", shown="--host")
    address_file: str | None = opt(
        None, "write the join addresses here (JSON)", metavar="FILE", shown="STATE_DIR/bootstrap.json"
    )
    state_dir: str | None = opt(
        None,
        "folder of the identity and address files not given otherwise (created if missing, mode 700)",
        metavar="DIR",
        shown="$XDG_STATE_HOME/p2p-cocodc, else ~/.local/state/p2p-cocodc",
    )
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

    @property
    def state(self) -> str:
        """The state folder: --state-dir, else the user's (``default_state_dir``)."""
        return self.state_dir or default_state_dir()

    @property
    def identity_path(self) -> str:
        return self.identity or os.path.join(self.state, IDENTITY_FILE)

    @property
    def address_path(self) -> str:
        return self.address_file or os.path.join(self.state, ADDRESS_FILE)

    def uses_state_dir(self) -> bool:
        return self.identity is None or self.address_file is None

    def make_state_dir(self) -> None:
        """Create the state folder (mode 700: it holds the private key) where a file goes there."""
        if not self.uses_state_dir():
            return
        try:
            os.makedirs(self.state, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise UserError(f"--state-dir {self.state}: cannot create it ({exc.strerror or exc})") from None

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
        if self.uses_state_dir():  # created only once the ports are bound (``make_state_dir``)
            _check_creatable_dir("--state-dir", self.state)
        _check_writable_file("--identity", self.identity_path, self.identity is None)
        _check_writable_file("--address-file", self.address_path, self.address_file is None)
        return self


BOOTSTRAP = Schema(BootstrapOptions)
IDENTITY_FILE = "bootstrap.id"
ADDRESS_FILE = "bootstrap.json"
APP = "p2p-cocodc"


def default_state_dir() -> str:
    """Where the bootstrap keeps its files unless told: $XDG_STATE_HOME/p2p-cocodc, else
    ~/.local/state/p2p-cocodc (the XDG base directories: a relative $XDG_STATE_HOME is ignored)."""
    base = os.environ.get("XDG_STATE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, APP)


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


def _check_writable_file(flag: str, path: str, in_state_dir: bool = False) -> None:
    """``path`` can be read or created; ``in_state_dir``: its folder is the state folder, which
    ``_check_creatable_dir`` checked and ``make_state_dir`` creates."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UserError(f"{flag} {path} is a directory; give a file name")
    if not os.path.isdir(parent):
        if in_state_dir:
            return
        raise UserError(f"{flag} {path}: the directory {parent} does not exist")
    if os.path.exists(path) and not os.access(path, os.R_OK):
        raise UserError(f"{flag} {path} exists but cannot be read")
    if not os.path.exists(path) and not os.access(parent, os.W_OK):
        raise UserError(f"{flag} {path} cannot be created: {parent} is not writable")


def _check_creatable_dir(flag: str, path: str) -> None:
    """``path`` is a folder, or the nearest folder above it that exists is one we may write in."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise UserError(f"{flag} {path} is a file, not a folder")
        return
    above = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above) or not os.access(above, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path} cannot be created: {above} is not a writable folder")
