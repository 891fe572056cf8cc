"""Stops that stop: SIGINT or SIGTERM, to a peer's main process (``kill PID``) or to its whole
process group (systemd's default KillMode, supervisord's stopasgroup, a shell's job control),
while it waits for peers or while it trains. The peer ends, by convention with 128 + the signal,
leaves no process of its group behind, and a training peer writes its summary and its --save."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.swarm_procs import Bootstrap, end_group, group_members, records, spawn, start_bootstrap, wait_for
from tests.tiny_options import TINY_MODEL, TINY_SYNCS

PEER = [*TINY_MODEL, *TINY_SYNCS, "--threads", "1"]
STOPS = [
    (signal.SIGINT, "pid"),
    (signal.SIGTERM, "pid"),
    (signal.SIGINT, "group"),
    (signal.SIGTERM, "group"),
]
# a hang guard, not a speed target: a stopped peer takes about 5-9 s here, its DHT's shutdown included
ENDS_WITHIN_S = 30


@pytest.fixture(scope="module")
def boot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bootstrap]:
    boot = start_bootstrap(tmp_path_factory.mktemp("boot"))
    try:
        yield boot
    finally:
        end_group(boot.proc)


def stop(peer: subprocess.Popen, sig: signal.Signals, target: str) -> int:
    if target == "group":
        os.killpg(peer.pid, sig)
    else:
        peer.send_signal(sig)
    code = peer.wait(timeout=ENDS_WITHIN_S)
    wait_for(lambda: not group_members(peer.pid), 10, "the peer's DHT process and p2pd to end")
    return code


@pytest.mark.parametrize(("sig", "target"), STOPS, ids=[f"{s.name}-{t}" for s, t in STOPS])
def test_a_waiting_peer_stops(boot: Bootstrap, tmp_path: Path, sig: signal.Signals, target: str) -> None:
    run = f"wait-{sig.name}-{target}"
    peer = spawn(
        ["join", "--bootstrap", boot.host_port, "--run-id", run, *PEER, "--workers", "2"], tmp_path, "p.log"
    )
    try:
        wait_for(lambda: "waiting for peers 1/2" in (tmp_path / "p.log").read_text(), 90, "the peer to wait")
        assert stop(peer, sig, target) == 128 + sig, (tmp_path / "p.log").read_text()[-2000:]
    finally:
        end_group(peer)
    last = (tmp_path / "p.log").read_text().strip().splitlines()[-1]
    assert last == f"stopped by {sig.name} while waiting for peers, before training", last


@pytest.mark.parametrize(("sig", "target"), STOPS, ids=[f"{s.name}-{t}" for s, t in STOPS])
def test_a_training_peer_stops_with_its_summary_and_model(
    boot: Bootstrap, tmp_path: Path, sig: signal.Signals, target: str
) -> None:
    run = f"train-{sig.name}-{target}"
    args = [
        "join",
        "--bootstrap",
        boot.host_port,
        "--run-id",
        run,
        *PEER,
        "--workers",
        "1",
        "--steps",
        "100000",
    ]
    peer = spawn([*args, "--out", "p.jsonl", "--save", "model"], tmp_path, "p.log")
    out = tmp_path / "p.jsonl"
    try:
        wait_for(lambda: out.exists() and sum(r["kind"] == "eval" for r in records(out)) >= 2, 90, "training")
        assert stop(peer, sig, target) == 128 + sig, (tmp_path / "p.log").read_text()[-2000:]
    finally:
        end_group(peer)
    summary = records(out)[-1]
    assert summary["kind"] == "summary" and summary["stopped_by"] == sig.name
    assert (
        summary["saved"] == f"model.partial-step-{summary['steps']}"
        and (tmp_path / summary["saved"]).is_dir()
    )
    assert f"left the swarm after step {summary['steps']} of 100000" in (tmp_path / "p.log").read_text()
