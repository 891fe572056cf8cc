"""``p2p-cocodc status``: a run's peers as the bootstrap's notice board shows them (its ``/status``),
in a table that refreshes in place, or printed once as plain text (``--once``, or output that is not
a terminal, for scripts and logs).

Every string in the table was written by an untrusted peer: cells are ``rich.text.Text``, which
never reads markup, so a peer cannot restyle or hide what the operator sees.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from p2p_cocodc.errors import UserError
from p2p_cocodc.swarm.dht import fetch_bootstrap_json
from p2p_cocodc.swarm.records import check_run_id

TIMEOUT_S = 5.0  # for connecting to the bootstrap, and for each read of its answer
MAX_STATUS_BYTES = 16 << 20
MAX_VERSIONS_SHOWN = 8
PLAIN_WIDTH = 400  # columns of plain output: a row is never wrapped
# health first after the name: on a narrow terminal the columns on the right give way
COLUMNS = (
    "region",
    "state",
    "health",
    "step",
    "tokens/s",
    "val ppl",
    "versions",
    "last round",
    "MB in",
    "MB out",
    "stall",
    "peer",
)


def watch_status(bootstrap: str, run_id: str | None, once: bool, refresh_s: float) -> None:
    """Print the table once (``once``, or stdout not a terminal), or keep it live until Ctrl-C."""
    if run_id is not None:
        check_run_id(run_id)
    if not (math.isfinite(refresh_s) and 0.2 <= refresh_s <= 3600):
        raise UserError(f"--refresh must be in [0.2, 3600] seconds, got {refresh_s}")
    status = fetch_status(bootstrap)  # a dead or wrong bootstrap is one line and exit 2, before any table
    if once or not sys.stdout.isatty():
        console = Console(width=PLAIN_WIDTH, no_color=True, highlight=False)
        with console.capture() as table:
            console.print(render(status, run_id, plain=True))
        print("\n".join(line.rstrip() for line in table.get().splitlines()))
        return
    console = Console(highlight=False)
    failing: str | None = None
    try:
        with Live(render(status, run_id, fit=console), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(refresh_s)
                try:
                    status, failing = fetch_status(bootstrap), None
                except UserError as exc:  # keep showing the last answer, and why it is not fresh
                    failing = failing or f"{time.strftime('%H:%M:%S')}: {exc}"
                live.update(render(status, run_id, failing=failing, fit=console), refresh=True)
    except KeyboardInterrupt:
        return


def fetch_status(bootstrap: str) -> dict[str, Any]:
    """The bootstrap's /status, or one line saying what to check."""
    if bootstrap.strip().startswith("/"):
        raise UserError(
            f"--bootstrap {bootstrap}: status reads the bootstrap's HTTP server; give the HOST:PORT it "
            "printed (its --status-port), not a multiaddr"
        )
    status = fetch_bootstrap_json(bootstrap, "/status", TIMEOUT_S, max_bytes=MAX_STATUS_BYTES)
    if not isinstance(status, dict) or not isinstance(status.get("runs"), dict):
        raise UserError(f"--bootstrap {bootstrap}: its /status is not a p2p-cocodc bootstrap's")
    return status


def render(
    status: dict[str, Any],
    run_id: str | None,
    plain: bool = False,
    failing: str | None = None,
    fit: Console | None = None,
) -> RenderableType:
    """A table per run (``run_id``'s alone when given), each run that ended with a line saying how,
    then when the board was read; ``fit``: the terminal whose width the tables must fit."""
    runs = status["runs"]
    ended = status.get("ended") if isinstance(status.get("ended"), dict) else {}
    parts: list[RenderableType] = []
    if failing is not None:
        parts.append(Text(f"the bootstrap stopped answering at {failing}; showing its last answer", "red"))
    for run in [run_id] if run_id is not None else sorted(runs.keys() | ended.keys()):
        end = ended.get(run) if isinstance(ended.get(run), dict) else None
        if end is not None:
            parts.append(end_line(run, end))
        board = runs.get(run) if isinstance(runs.get(run), dict) else None
        if end is not None and (board is None or not board.get("peers")):  # its records left the board
            board = {"info": end.get("info"), "peers": end.get("peers")}
        if board is not None:
            parts.append(run_table(run, board, plain, fit))
        else:
            live = ", ".join(sorted(map(str, runs))) or "none"
            parts.append(Text(f"run {run}: no peer of it is on the board (runs there: {live})"))
    if not runs and not ended and run_id is None:
        parts.append(Text("no run on the board yet"))
    updated = status.get("updated_at")
    read = time.strftime("%H:%M:%S", time.localtime(updated)) if isinstance(updated, int | float) else "never"
    note = f"board read at {read}"
    if status.get("error"):
        note += f"; the bootstrap cannot read it now: {status['error']}"
    parts.append(Text(note, "dim" if not status.get("error") else "red"))
    return Group(*parts)


def end_line(run_id: str, end: dict[str, Any]) -> Text:
    """How a run ended, from what the bootstrap saw (``ops/watch.py`` ``Endings``): the step, whether
    that was its --steps, and what its peers' last records say (perplexity, θ̄ digest)."""
    step, steps, at = end.get("step"), end.get("steps"), end.get("at")
    peers = end.get("peers") if isinstance(end.get("peers"), dict) else {}
    views = {_name(p, v): v for p, v in peers.items() if isinstance(v, dict)}
    when = f" (seen at {time.strftime('%H:%M:%S', time.localtime(at))})" if _number(at) else ""
    if not _number(step):
        return Text(f"run {run_id} ended{when}")
    tail = []
    if not _number(steps):
        head = f"run {run_id} ended at step {step}{when}"
    elif step >= steps:
        head = f"run {run_id} finished at step {step}{when}"
    else:
        head = f"run {run_id} ended at step {step} of --steps {steps}{when}, its peers left early"
        tail = ["to go on, start them again with --resume and their --checkpoint-dir"]
    said = [f"{len(views)} peer{'s' if len(views) != 1 else ''} done ({', '.join(sorted(views))})"]
    ppl = {n: v.get("val_ppl") for n, v in views.items() if _number(v.get("val_ppl")) and v["val_ppl"] >= 0}
    if ppl:
        said.append("val ppl " + _alike({n: f"{x:.2f}" for n, x in ppl.items()}))
    digests = {n: v.get("theta_sha") for n, v in views.items() if isinstance(v.get("theta_sha"), str)}
    if any(digests.values()):
        said.append("θ̄ sha256 " + _alike({n: d for n, d in digests.items() if d}))
    return Text(f"{head}: {'; '.join(said + tail)}")


def _alike(values: dict[str, str]) -> str:
    """One value where every peer says the same, else each with the peers that say it."""
    by_value: dict[str, list[str]] = {}
    for name, value in sorted(values.items()):
        by_value.setdefault(value, []).append(name)
    if len(by_value) == 1:
        return next(iter(by_value))
    return ", ".join(f"{value} ({', '.join(names)})" for value, names in by_value.items())


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def run_table(run_id: str, run: dict[str, Any], plain: bool, fit: Console | None = None) -> Table:
    """The run's table; with ``fit``, only as many columns from the left as fit its width (rich
    would squeeze every column into a few letters instead)."""
    columns = list(COLUMNS)
    while True:
        table = _table(run_id, run, plain, columns)
        if fit is None or len(columns) <= 3 or _natural_width(fit, table) <= fit.width:
            break
        columns.pop()
    if len(columns) < len(COLUMNS):
        table.caption = Text(f"{', '.join(COLUMNS[len(columns) :])}: not shown, for want of width")
        table.caption_justify = "left"
    return table


def _table(run_id: str, run: dict[str, Any], plain: bool, columns: list[str]) -> Table:
    info = run.get("info") if isinstance(run.get("info"), dict) else {}
    described = ", ".join(f"{k} {str(info[k])[:40]}" for k in ("algo", "model", "workers") if k in info)
    table = Table(
        title=Text(f"run {run_id}" + (f": {described}" if described else "")),
        title_justify="left",
        box=None if plain else box.SIMPLE_HEAD,
        header_style="" if plain else "bold",
        pad_edge=False,
        collapse_padding=not plain,  # plain: two spaces between cells, one inside them
    )
    for name in columns:
        left = name in ("region", "peer", "state", "health")
        table.add_column(name, justify="left" if left else "right", no_wrap=True)
    peers = run.get("peers") if isinstance(run.get("peers"), dict) else {}
    for peer, view in sorted(peers.items(), key=lambda item: _name(*item)):
        cells = _cells(peer, view if isinstance(view, dict) else {}, plain)
        table.add_row(*(cells[name] for name in columns))
    return table


def _name(peer: str, view: Any) -> str:
    region = view.get("region") if isinstance(view, dict) else None
    return region if isinstance(region, str) and region else peer[:12]


def _cells(peer: str, view: dict[str, Any], plain: bool) -> dict[str, Text]:
    """One row, by column; a value missing or of the wrong type (another version's bootstrap) reads '?'."""

    def number(key: str, fmt: str, scale: int | float = 1) -> str:
        value = view.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool):
            return "?"
        return "-" if value < 0 else fmt.format(value * scale)  # -1: none yet

    versions = view.get("versions")
    if isinstance(versions, list):
        shown = " ".join(map(str, versions[:MAX_VERSIONS_SHOWN]))
        versions_cell = shown + (" …" if len(versions) > MAX_VERSIONS_SHOWN else "")
    else:
        versions_cell = "?"
    words = view.get("health")
    health = (", ".join(map(str, words)) or "ok") if isinstance(words, list) else "?"
    return {
        "region": Text(_name(peer, view)),
        "state": Text(str(view.get("state", "?"))),
        "health": Text(health, "" if plain else "green" if health == "ok" else "red"),
        "step": Text(number("step", "{}")),
        "tokens/s": Text(number("tokens_per_s", "{:,.0f}")),
        "val ppl": Text(number("val_ppl", "{:.2f}")),
        "versions": Text(versions_cell),
        "last round": Text(number("last_round_s", "{:.1f} s")),
        "MB in": Text(number("bytes_received", "{:.2f}", 1e-6)),
        "MB out": Text(number("bytes_sent", "{:.2f}", 1e-6)),
        "stall": Text(number("stall_s", "{:.1f} s")),
        "peer": Text(peer[:12]),
    }


def _natural_width(console: Console, table: Table) -> int:
    """The columns ``table`` takes with no terminal edge in its way."""
    return Measurement.get(console, console.options.update_width(1 << 16), table).maximum
