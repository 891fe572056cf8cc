"""Watching a run: the bootstrap's history, health words and page, and ``p2p-cocodc status``.

A real bootstrap process reads real peer records, published by two real DHT nodes in this process
through ``Board``; the status command runs as a subprocess, and the page is rendered by a real
headless browser (Debian's chromium), so a broken script fails the test.
"""

from __future__ import annotations

import asyncio
import json
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass, replace
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from p2p_cocodc.ops.watch import MAX_POINTS, MAX_SERIES, POINT_FIELDS, Endings, History, Series, health
from p2p_cocodc.swarm.dht import fetch_bootstrap_json, p2pd_socket, start_dht, stop_dht
from p2p_cocodc.swarm.records import Board, PeerRecord
from tests.swarm_procs import (
    CLI,
    ENV,
    end_group,
    free_port,
    records,
    run_cli,
    spawn,
    start_bootstrap,
    wait_for,
)
from tests.tiny_options import TWO_PEERS

RUN = "watch"
CHARTS = ("val_ppl", "tokens_per_s", "bytes_sent", "bytes_received", "stall_s")
CHROMIUM_INSTALL = "apt-get update && apt-get install -y chromium (the line in .ci/run)"


def record(**changes: Any) -> PeerRecord:
    return replace(PeerRecord("training", 3, 0, 2, 0.25, 1.0, "f" * 16, [1, 1]), **changes)


# ---- history and health, in this process ----


def test_a_full_series_keeps_the_whole_run_at_an_even_spacing() -> None:
    series = Series("r", 0.0)
    for t in range(4 * MAX_POINTS):  # a read a second
        series.add((float(t), t))
    times = [p[0] for p in series.points]
    assert len(times) <= MAX_POINTS
    assert times[0] == 0 and times[-1] == 4 * MAX_POINTS - 1  # the start and the newest read
    gaps = [b - a for a, b in zip(times[:-1], times[1:], strict=True)]
    assert set(gaps[:-1]) == {series.spacing_s} and gaps[-1] <= series.spacing_s  # the newest moves on
    assert series.spacing_s == 8  # halved three times


def test_the_history_follows_a_bounded_number_of_peers_dropping_the_one_seen_longest_ago() -> None:
    history = History()
    for i in range(MAX_SERIES + 10):
        history.add(RUN, f"peer{i}", record(step=i), now=float(i))
    history.add(RUN, "peer11", record(step=99), now=1000.0)  # seen again: kept
    for i in range(5):
        history.add("other", f"late{i}", record(), now=2000.0)
    runs = history.to_json()["runs"]
    kept = set(runs[RUN]) | set(runs["other"])
    assert len(kept) == MAX_SERIES
    assert "peer11" in kept and {"peer0", "peer12", "peer14"}.isdisjoint(kept)
    assert history.to_json()["fields"] == POINT_FIELDS
    assert runs[RUN]["peer11"]["points"][-1][1] == 99


def test_health_names_what_is_wrong_and_only_that() -> None:
    ok = record(versions=[5, 5], theta_step=8, theta_sha="a" * 16)
    records = {
        "good": ok,
        "behind": replace(ok, versions=[3, 5]),
        "split": replace(ok, theta_sha="b" * 16),
        "odd": replace(ok, fingerprint="other"),
        "guard": replace(ok, refused={"odd": 4}, outliers={"behind": 1}),
        "stale": ok,
        "doubt": replace(ok, theta_doubt=6),
        "resynced": replace(ok, theta_doubt=6, joined_at=7),
    }
    ages = {p: 1.0 for p in records} | {"stale": 5.0}  # ttl 8 s: stale past 4 s
    said = health(records, ages)
    assert said == {
        "good": [],
        "behind": ["behind", "outlier for 1"],
        "split": ["θ̄ differs"],
        "odd": ["other options", "refused by 1"],
        "guard": ["refused 4"],
        "stale": ["stale record 5 s"],
        "doubt": ["θ̄ in doubt"],
        "resynced": [],
    }


# ---- a bootstrap with two peers on its board ----


@dataclass
class Watched:
    boot_addr: str  # the bootstrap's HOST:PORT
    peers: dict[str, PeerRecord]  # peer id -> the record it published last
    workdir: Path


REGIONS = ("us-east", "eu-west")


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Watched]:
    """Two peers, each with two records published one after the other (two points on each chart):
    us-east refused two messages from eu-west, whose first fragment is two syncs behind."""
    workdir = tmp_path_factory.mktemp("watch")
    boot = start_bootstrap(workdir, extra=["--refresh", "0.2"])
    nodes: list[Any] = []
    try:
        for _ in REGIONS:
            nodes.append(start_dht([boot.maddr], "127.0.0.1", 0))
        ids = [d.peer_id.to_base58() for d in nodes]
        first = {
            ids[0]: record(step=3, region="us-east", val_ppl=50.0, tokens_per_s=1000.0, bytes_sent=10**6),
            ids[1]: record(step=2, shard=1, region="eu-west", val_ppl=52.0, tokens_per_s=900.0),
        }
        last = {
            ids[0]: replace(
                first[ids[0]],
                step=6,
                versions=[5, 5],
                val_ppl=41.25,
                tokens_per_s=1234.5,
                bytes_sent=2_500_000,
                bytes_received=3_000_000,
                stall_s=1.5,
                last_round_s=2.5,
                refused={ids[1]: 2},
            ),
            ids[1]: replace(first[ids[1]], step=5, versions=[3, 5], val_ppl=43.5, tokens_per_s=987.0),
        }
        for records in (first, last):
            publish(nodes, records)
            wait_for(lambda r=records: on_history(boot.host_port, r), 30, "the records on /history")
        yield Watched(boot.host_port, last, workdir)
    finally:
        for dht in nodes:
            stop_dht(dht, p2pd_socket(dht))
        end_group(boot.proc)


def publish(nodes: list[Any], records: dict[str, PeerRecord]) -> None:
    async def main() -> None:
        for dht in nodes:
            me = dht.peer_id.to_base58()  # a record's subkey is its writer's id
            await Board(dht, RUN, me, ttl_s=120).publish(records[me], {"algo": "cocodc", "model": "micro"})

    asyncio.run(main())


def get(addr: str, path: str) -> Any:
    with urllib.request.urlopen(f"http://{addr}{path}", timeout=10) as reply:
        return json.loads(reply.read())


def on_history(addr: str, records: dict[str, PeerRecord]) -> bool:
    series = get(addr, "/history")["runs"].get(RUN, {})
    return all(p in series and series[p]["points"][-1][1] == r.step for p, r in records.items())


def test_history_serves_each_peers_points(watched: Watched) -> None:
    history = get(watched.boot_addr, "/history")
    assert history["fields"] == list(POINT_FIELDS)
    series = history["runs"][RUN]
    us, eu = watched.peers
    assert {series[p]["region"] for p in (us, eu)} == set(REGIONS)
    points = [dict(zip(POINT_FIELDS, p, strict=True)) for p in series[us]["points"]]
    assert {(p["step"], p["val_ppl"]) for p in points} == {(3, 50.0), (6, 41.25)}
    assert points[-1]["bytes_received"] == 3_000_000 and points[-1]["tokens_per_s"] == 1234.5


def test_status_json_shows_the_new_fields_and_each_peers_health(watched: Watched) -> None:
    peers = get(watched.boot_addr, "/status")["runs"][RUN]["peers"]
    us, eu = watched.peers
    assert peers[us]["region"] == "us-east" and peers[us]["last_round_s"] == 2.5
    assert peers[us]["health"] == ["refused 2"]
    assert peers[eu]["health"] == ["behind", "refused by 1"]
    assert 0 <= peers[us]["age_s"] < 30


# ---- p2p-cocodc status ----


def status_rows(out: str) -> dict[str, list[str]]:
    """The table's cells (two spaces or more apart) in the row of each region."""
    rows = [re.split(r"\s{2,}", line.strip()) for line in out.splitlines()]
    return {row[0]: row for row in rows if row[0] in REGIONS}


def test_status_once_prints_a_row_per_peer(watched: Watched) -> None:
    args = ["status", "--bootstrap", watched.boot_addr, "--run-id", RUN, "--once"]
    done = run_cli(args, watched.workdir, 30)
    assert done.returncode == 0, done.stderr
    assert "\x1b[" not in done.stdout  # plain: no colours, no cursor codes
    assert f"run {RUN}: algo cocodc, model micro" in done.stdout
    us, eu = watched.peers
    # region, state, health, step, tokens/s, val ppl, versions, last round, MB in, MB out, stall, peer
    assert status_rows(done.stdout) == {
        "us-east": ["us-east", "training", "refused 2", "6", "1,234", "41.25", "5 5", "2.5 s"]
        + ["3.00", "2.50", "1.5 s", us[:12]],
        "eu-west": ["eu-west", "training", "behind, refused by 1", "5", "987", "43.50", "3 5", "-"]
        + ["0.00", "0.00", "0.0 s", eu[:12]],
    }


def test_status_prints_once_when_output_is_not_a_terminal(watched: Watched) -> None:
    done = run_cli(["status", "--bootstrap", watched.boot_addr], watched.workdir, 30)  # stdout: a pipe
    assert done.returncode == 0, done.stderr
    assert set(status_rows(done.stdout)) == set(REGIONS)


def test_status_names_a_run_that_is_not_on_the_board(watched: Watched) -> None:
    done = run_cli(["status", "--bootstrap", watched.boot_addr, "--run-id", "nope"], watched.workdir, 30)
    assert done.returncode == 0, done.stderr
    assert f"run nope: no peer of it is on the board (runs there: {RUN})" in done.stdout


def test_status_on_a_terminal_refreshes_until_ctrl_c(watched: Watched) -> None:
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [*CLI, "status", "--bootstrap", watched.boot_addr, "--refresh", "0.2"],
        stdin=follower,
        stdout=follower,
        stderr=follower,
        env={**ENV, "TERM": "xterm", "COLUMNS": "200"},
        start_new_session=True,
    )
    os.close(follower)
    seen = b""
    try:
        deadline = time.monotonic() + 30
        while seen.count(b"eu-west") < 3:  # drawn, then drawn again in place
            assert time.monotonic() < deadline, seen.decode(errors="replace")[-2000:]
            if select.select([leader], [], [], 1)[0]:
                seen += os.read(leader, 65536)
        proc.send_signal(signal.SIGINT)
        # keep reading: a child whose last redraw fills the terminal's buffer blocks until it is read
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            if select.select([leader], [], [], 0.2)[0]:
                with suppress(OSError):  # EIO once the child has closed its end
                    seen += os.read(leader, 65536)
        assert proc.wait(timeout=1) == 0
    finally:
        if proc.poll() is None:
            end_group(proc)
        os.close(leader)
    assert b"us-east" in seen and b"\x1b[" in seen  # styled, redrawn with cursor codes


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("127.0.0.1:{dead}", "no p2p-cocodc bootstrap answers at http://127.0.0.1:{dead}/status"),
        ("127.0.0.1:99999", "give the HOST:PORT that `p2p-cocodc bootstrap` printed"),
        ("/ip4/127.0.0.1/tcp/4001/p2p/12D3KooW", "not a multiaddr"),
    ],
)
def test_status_without_a_bootstrap_is_one_line_and_exit_2(tmp_path: Path, address: str, message: str):
    dead = free_port()
    started = time.monotonic()
    done = run_cli(["status", "--bootstrap", address.format(dead=dead)], tmp_path, 30)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert message.format(dead=dead) in lines[0]
    assert time.monotonic() - started < 15


def test_status_rejects_bad_options(tmp_path: Path) -> None:
    for args, message in ((["--refresh", "0"], "--refresh"), (["--run-id", "a b"], "--run-id")):
        done = run_cli(["status", "--bootstrap", "127.0.0.1:9", *args], tmp_path, 30)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


def test_the_end_of_a_run_outlives_its_done_records_and_the_status_says_how_it_ended() -> None:
    """The bootstrap keeps what it saw when every peer of a run was done: once the board forgets the
    run (its done records live 2 minutes), ``status`` still says it finished and what its peers
    said, instead of "no run on the board yet"; a new run under the same id replaces it."""
    from rich.console import Console

    from p2p_cocodc.ops.status_view import render

    endings = Endings()
    info = {"algo": "cocodc", "options": {"--steps": 24}}
    done = {
        "a": record(state="done", step=24, region="us-east", val_ppl=148.58, theta_sha="b52a47d1f9d178d1"),
        "b": record(state="done", step=24, region="eu-west", val_ppl=148.58, theta_sha="b52a47d1f9d178d1"),
    }
    views = {p: {"region": r.region, "state": r.state, "step": r.step, "val_ppl": r.val_ppl,
                 "theta_sha": r.theta_sha} for p, r in done.items()}  # fmt: skip
    endings.read(RUN, {"a": record(state="done", step=24)}, info, {}, 100.0)
    endings.read(RUN, {**done, "c": record(state="training")}, info, views, 101.0)
    assert endings.to_json() == {}  # a peer still trains
    endings.read(RUN, done, info, views, 102.0)
    endings.read(RUN, {}, info, {}, 103.0)  # the records left the board
    assert endings.to_json()[RUN]["step"] == 24 and endings.to_json()[RUN]["at"] == 102.0
    status = {"runs": {}, "ended": endings.to_json(), "updated_at": 103.0, "error": None}
    console = Console(width=400, no_color=True)
    with console.capture() as shown:
        console.print(render(status, None, plain=True))
    text = shown.get()
    assert f"run {RUN} finished at step 24 (seen at " in text
    assert "): 2 peers done (eu-west, us-east); val ppl 148.58; θ̄ sha256 b52a47d1f9d178d1" in text
    assert "no run on the board yet" not in text and set(status_rows(text)) == set(REGIONS)
    endings.read(RUN, {"d": record(state="waiting")}, info, {}, 104.0)  # the id taken again
    assert endings.to_json() == {}


# ---- the page, in a real browser ----


class PageParser(HTMLParser):
    """What the rendered page shows: each chart's series and legend, the table's rows."""

    def __init__(self) -> None:
        super().__init__()
        self.chart: str | None = None
        self.series: dict[str, list[dict[str, str]]] = {}
        self.legend: dict[str, list[str]] = {}
        self.rows: list[list[str]] = []
        self.text: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "figure":
            self.chart = a.get("data-metric")
        elif tag == "path" and "series" in a.get("class", "").split() and self.chart:
            self.series.setdefault(self.chart, []).append(a)
        elif tag == "li" and self.chart:
            self.text = []
        elif tag == "tr" and "data-peer" in a:
            self.rows.append([])
        elif tag == "td" and self.rows:
            self.text = []

    def handle_data(self, data: str) -> None:
        if self.text is not None:
            self.text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "figure":
            self.chart = None
        elif tag == "li" and self.chart and self.text is not None:
            self.legend.setdefault(self.chart, []).append("".join(self.text).strip())
            self.text = None
        elif tag == "td" and self.text is not None:
            self.rows[-1].append("".join(self.text).strip())
            self.text = None


def rendered(url: str) -> str:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail(f"chromium is not installed: the status page is tested in it. Run {CHROMIUM_INSTALL}")
    with tempfile.TemporaryDirectory() as profile:
        args = [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            "--virtual-time-budget=8000",
            "--dump-dom",
            url,
        ]
        done = subprocess.run(args, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.parametrize("path", ["/", "/status.html"])
def test_the_page_charts_each_peer_and_lists_them(watched: Watched, path: str) -> None:
    page = PageParser()
    page.feed(rendered(f"http://{watched.boot_addr}{path}"))
    for chart in CHARTS:  # one line per peer on every chart, named by its region
        assert sorted(s["data-region"] for s in page.series.get(chart, [])) == sorted(REGIONS), chart
        assert all(s["d"].startswith("M") and "L" in s["d"] for s in page.series[chart]), chart
    assert sorted(page.legend["val_ppl"]) == ["eu-west: 43.50", "us-east: 41.25"]
    assert sorted(page.legend["bytes_received"]) == ["eu-west: 0.00", "us-east: 3.00"]
    us, eu = watched.peers
    rows = {row[0]: row for row in page.rows}  # the columns of `p2p-cocodc status`
    assert rows["us-east"] == ["us-east", "training", "refused 2", "6", "1235", "41.25", "5 5", "2.5 s"] + [
        "3.00",
        "2.50",
        "1.5 s",
        us[:12],
    ]
    assert rows["eu-west"][:3] == ["eu-west", "training", "behind, refused by 1"]


def test_the_page_runs_only_its_own_script(watched: Watched) -> None:
    with urllib.request.urlopen(f"http://{watched.boot_addr}/", timeout=10) as reply:
        policy = reply.headers["Content-Security-Policy"]
        assert reply.headers["Content-Type"].startswith("text/html")
    assert "script-src 'self'" in policy and "default-src 'none'" in policy


# ---- a real run's end (after the page's tests: the watched records must stay fresh for them) ----


def test_status_after_a_real_run_says_it_finished(tmp_path: Path) -> None:
    """Two real peers train to the end; ``status`` asked afterwards says the run finished, at which
    step, and what the done peers' records say: the θ̄ each peer's summary names."""
    boot = start_bootstrap(tmp_path, extra=["--refresh", "0.2"])
    peers = []
    try:
        for region in REGIONS:
            out = str(tmp_path / f"{region}.jsonl")
            args = ["join", "--bootstrap", boot.host_port, "--run-id", "ended", "--region", region]
            peers.append(spawn([*args, *TWO_PEERS, "--out", out], tmp_path, f"{region}.log"))
        for region, peer in zip(REGIONS, peers, strict=True):
            assert peer.wait(timeout=300) == 0, (tmp_path / f"{region}.log").read_text()[-3000:]

        def said() -> str | None:
            shown = run_cli(["status", "--bootstrap", boot.host_port, "--once"], tmp_path, 30).stdout
            return shown if "run ended finished" in shown else None

        text = wait_for(said, 60, "status to say the run finished")
        # a peer that comes late is told by the bootstrap, before it sets anything up (issue 19: it
        # used to wait for peers for good); 60 s: a hang guard (a loaded machine imports torch slowly)
        late = ["join", "--bootstrap", boot.host_port, "--run-id", "ended", "--region", "late", *TWO_PEERS]
        refused = run_cli(late, tmp_path, 60)
        ended = fetch_bootstrap_json(boot.host_port, "/ended", 10)
    finally:
        for peer in peers:
            end_group(peer)
        end_group(boot.proc)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert (
        refused.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "error: run 'ended' finished at step 24: choose a new --run-id, or --resume from a checkpoint"
        )
    ), refused.stderr
    assert "waiting for peers" not in refused.stderr
    assert {k: ended["ended"][k] for k in ("step", "steps")} == {"step": 24, "steps": 24}, ended
    theta = {records(tmp_path / f"{r}.jsonl")[-1]["global_params_sha256"][:16] for r in REGIONS}
    assert len(theta) == 1
    line = next(line for line in text.splitlines() if line.startswith("run ended finished"))
    assert line.startswith("run ended finished at step 24 (seen at "), line
    assert "2 peers done (eu-west, us-east); val ppl " in line and line.endswith(f"θ̄ sha256 {theta.pop()}")
    assert "no run on the board yet" not in text


def test_the_readme_updates_the_package_lists_before_it_installs_chromium() -> None:
    """On a fresh machine (a new container, a CI image) the package lists are empty or stale, and
    `apt-get install chromium` alone fails: "Unable to locate package"."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    lines = [line for line in readme.splitlines() if "apt-get install" in line and "chromium" in line]
    assert lines and all(
        re.match(r"\s*apt-get update && apt-get install -y chromium\b", line) for line in lines
    )
    assert CHROMIUM_INSTALL.startswith("apt-get update && apt-get install -y chromium")
