"""docs/performance.md is written by several benchmarks: each replaces its own section only."""

from __future__ import annotations

import re
from pathlib import Path

PERFORMANCE = Path(__file__).resolve().parent.parent / "docs" / "performance.md"


def write_section(title: str, body: str, path: Path = PERFORMANCE) -> None:
    """Put ``body`` under ``## title`` in ``path``, replacing that section (up to the next ``## ``)
    if it is there, else appending it; the other sections are kept as they are."""
    text = path.read_text(encoding="utf-8") if path.exists() else "# Performance\n"
    section = f"## {title}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section
    path.write_text(text, encoding="utf-8")
