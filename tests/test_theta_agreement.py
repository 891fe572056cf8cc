"""Peers that know: a θ̄ that split off is caught at the end of the run on every peer, never reported
as a success. A member whose θ̄ moves right before its last evaluation (``tests/hostile_peer.py``
``drift``: a split no round sees) is the minority of three, or one side of a split of two."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.swarm_procs import HOSTILE, end_group, records, spawn, start_bootstrap
from tests.tiny_options import TINY_MODEL, TINY_SYNCS

STEPS = 24


def run_swarm(tmp_path: Path, peers: int, run_id: str) -> list[tuple[int, str, dict]]:
    """``peers`` peers, the last one drifting: (exit code, stderr's last lines, summary) of each."""
    boot = start_bootstrap(tmp_path)
    options = [*TINY_MODEL, *TINY_SYNCS, "--workers", str(peers), "--steps", str(STEPS), "--threads", "1"]
    join = ["join", "--bootstrap", boot.host_port, "--run-id", run_id, *options, "--pace", "fixed", "--quiet"]
    procs: list[subprocess.Popen] = []
    try:
        for i in range(peers):
            args = [*join, "--shard", f"{i}/{peers}", "--out", f"peer{i}.jsonl"]
            drifter = i == peers - 1
            procs.append(
                spawn(
                    ["drift", *args] if drifter else args,
                    tmp_path,
                    f"peer{i}.log",
                    **({"command": HOSTILE} if drifter else {}),
                )
            )
        codes = [proc.wait(timeout=240) for proc in procs]
    finally:
        for proc in [*procs, boot.proc]:
            end_group(proc)
    ends = []
    for i, code in enumerate(codes):
        log = (tmp_path / f"peer{i}.log").read_text()
        ends.append((code, log, records(tmp_path / f"peer{i}.jsonl")[-1]))
    return ends


def test_the_minority_of_three_is_told_and_the_majority_names_it(tmp_path: Path) -> None:
    (code0, log0, honest0), (code1, log1, honest1), (code2, log2, drifter) = run_swarm(
        tmp_path, 3, "minority"
    )
    assert code0 == code1 == 0, log0[-2000:] + log1[-2000:]
    assert (
        honest0["global_params_sha256"] == honest1["global_params_sha256"] != drifter["global_params_sha256"]
    )
    for summary, log in ((honest0, log0), (honest1, log1)):
        assert summary["theta_disputed"] == {drifter["peer_id"]: STEPS}, summary["theta_disputed"]
        assert f"warning: θ̄ differed between this peer and {drifter['peer_id']} (after step {STEPS})" in log
    assert code2 == 2, log2[-2000:]
    assert drifter["theta_behind_step"] == STEPS
    last = log2.strip().splitlines()[-1]
    assert last.startswith("error: θ̄ after step 24 differs from the one a majority of the peers hold"), last


def test_a_split_of_two_stops_both_peers_naming_it(tmp_path: Path) -> None:
    (code0, log0, honest), (code1, log1, drifter) = run_swarm(tmp_path, 2, "split")
    assert code0 == code1 == 2, log0[-2000:] + log1[-2000:]
    digests = {honest["global_params_sha256"], drifter["global_params_sha256"]}
    assert len(digests) == 2
    for summary, log in ((honest, log0), (drifter, log1)):
        assert summary["theta_unsettled_step"] == STEPS
        assert len(summary["theta_split"]) == 2 and sorted(map(len, summary["theta_split"].values())) == [
            1,
            1,
        ]
        last = log.strip().splitlines()[-1]
        assert last.startswith(f"error: θ̄ after step {STEPS} split with no majority"), last
        assert "this peer" in last and all(digest in last for digest in summary["theta_split"]), last
        assert "final val ppl" not in log  # never the success line
