"""Log lines of the long-running commands (bootstrap, join): timestamped, on stderr."""

from __future__ import annotations

import logging


def configure_logging(level: int) -> None:
    """Our messages with a timestamp on stderr; hivemind keeps its own handler (it does not propagate)."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
