"""What every peer of a run must share, and which of it differs when a peer's fingerprint does not match.

A peer publishes the options its fingerprint covers (flattened to option names, as ``--lr`` or
``--overlap``) next to its run info on the board, so that a peer refused for "another configuration"
can say which options differ. What another peer published is untrusted: it is compared key by key
with our own and shown cut short, never evaluated.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

# nested names of the shared options that are not the option's own name
FLAG_NAMES = {
    "algo.outer.lr": "outer-lr",
    "algo.outer.momentum": "outer-momentum",
    "inner.total_steps": "steps",
    "aggregation.rule": "aggregate",
    "data_shards": "max-peers",
    "vocab": "tokenizer (its vocabulary size)",
    "data": "data (its content)",
    "model": "model (its architecture)",
    "exchange": "round protocol (the p2p-cocodc release)",
}
SHOWN_CHARS = 40  # a value from another peer is shown at most this long
SHOWN_DIFFERENCES = 4


def fingerprint(shared: dict[str, Any]) -> str:
    """32 hex digits over the shared options: peers with equal fingerprints train the same run."""
    return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:32]


def option_view(shared: dict[str, Any]) -> dict[str, Any]:
    """The shared options by option name ({"--lr": 0.001, ...}), what a peer publishes."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else key, item)
            return
        name = FLAG_NAMES.get(prefix, prefix.rsplit(".", 1)[-1])
        plain = isinstance(value, str | int | float | bool) or value is None
        flat["--" + name.replace("_", "-")] = value if plain else str(value)

    walk("", shared)
    return flat


def differences(ours: dict[str, Any], theirs: Any) -> list[str]:
    """'--lr: 0.002 there, 0.001 here' for each option that differs (at most a few), from another
    peer's published view; empty when it published none (or nothing we can read)."""
    if not isinstance(theirs, dict):
        return []
    found = []
    for name, value in ours.items():
        if name in theirs and theirs[name] != value:
            found.append(f"{name} {_shown(theirs[name])} there, {_shown(value)} here")
    return found[:SHOWN_DIFFERENCES]


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 1] + "…"
