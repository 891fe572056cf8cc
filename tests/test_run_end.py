"""A finished run says so: a peer that comes after a run's peers are done stops with one line, at
once, instead of waiting for peers that will never come (``peer/lobby.py``, "Ended")."""

from __future__ import annotations

from pathlib import Path

from tests.swarm_procs import end_group, records, spawn, start_bootstrap
from tests.tiny_options import TWO_PEERS


def test_a_peer_that_comes_after_the_run_finished_is_told_so_at_once(tmp_path: Path) -> None:
    boot = start_bootstrap(tmp_path)
    join = ["join", "--bootstrap", boot.host_port, "--run-id", "over", *TWO_PEERS, "--pace", "fixed"]
    peers = []
    try:
        for i in range(2):
            peers.append(spawn([*join, "--out", f"peer{i}.jsonl"], tmp_path, f"peer{i}.log"))
        for i, peer in enumerate(peers):
            assert peer.wait(timeout=240) == 0, (tmp_path / f"peer{i}.log").read_text()[-3000:]
        steps = records(tmp_path / "peer0.jsonl")[-1]["steps"]
        late = spawn([*join, "--out", "late.jsonl", "--verbose"], tmp_path, "late.log")
        peers.append(late)
        # the deadline is the hang guard: the peer must not wait --wait-peers (300 s) for a run that ended
        code = late.wait(timeout=90)
    finally:
        for proc in [*peers, boot.proc]:
            end_group(proc)
    said = (tmp_path / "late.log").read_text()
    assert code == 2, said[-3000:]
    assert said.strip().splitlines()[-1] == (
        f"error: run 'over' finished at step {steps}: choose a new --run-id (a finished run's id stays "
        "taken for 2 minutes)"
    ), said[-3000:]
    assert "Traceback" not in said
