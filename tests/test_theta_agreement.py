"""Peers that know: a θ̄ that split off is caught on every peer, mid-run or at the end, and never
reported as a success. A member whose θ̄ moves right before an evaluation (``tests/hostile_peer.py``
``drift``, ``drift-early``: a split no round sees) is the minority of three, or one side of a split
of two."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.swarm_procs import HOSTILE, end_group, records, spawn, start_bootstrap
from tests.tiny_options import TINY_MODEL, TINY_SYNCS

STEPS = 24
EARLY = 8  # the first evaluation (TINY_SYNCS: --eval-every 8)


def run_swarm(
    tmp_path: Path, peers: int, run_id: str, drift: str = "drift", steps: int = STEPS
) -> list[tuple[int, str, dict]]:
    """``peers`` peers, the last one drifting: (exit code, stderr's last lines, summary) of each."""
    boot = start_bootstrap(tmp_path)
    options = [*TINY_MODEL, *TINY_SYNCS, "--workers", str(peers), "--steps", str(steps), "--threads", "1"]
    join = ["join", "--bootstrap", boot.host_port, "--run-id", run_id, *options, "--pace", "fixed", "--quiet"]
    procs: list[subprocess.Popen] = []
    try:
        for i in range(peers):
            args = [*join, "--shard", f"{i}/{peers}", "--out", f"peer{i}.jsonl"]
            drifter = i == peers - 1
            procs.append(
                spawn(
                    [drift, *args] if drifter else args,
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
        assert "finished with the majority's θ̄ after a split" in log  # not the success line
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


def test_a_split_of_two_mid_run_stops_both_peers_at_once(tmp_path: Path) -> None:
    """The split happens at the first evaluation (step 8); once both digests of a step are on the
    board no majority can form: both peers stop with the line naming the split, instead of training
    on to the end as two swarms."""
    long = 400  # long enough that the board's digests are compared well before the end
    ends = run_swarm(tmp_path, 2, "early", "drift-early", long)
    assert [code for code, _, _ in ends] == [2, 2], "".join(log[-2000:] for _, log, _ in ends)
    for _, log, summary in ends:
        assert summary["steps"] < long, summary["steps"]
        assert re.match(r"θ̄ after step \d+ split with no majority", summary["failure"]), summary["failure"]
        last = log.strip().splitlines()[-1]
        assert last.startswith(f"error: stopped after step {summary['steps']}: θ̄ after step "), last
        assert "final val ppl" not in log


def test_the_minority_of_three_mid_run_takes_the_majoritys_state_and_says_so(tmp_path: Path) -> None:
    """The drifter splits off at step 8 and is outvoted: it takes the swarm's state at once, and all
    three end with one θ̄; every peer names the split, and none ends with the success line."""
    ends = run_swarm(tmp_path, 3, "mend", "drift-early", 400)  # resynced by ~160 (a board read lags)
    (_, _, honest0), (_, _, honest1), (_, log2, drifter) = ends
    assert [code for code, _, _ in ends] == [0, 0, 0], "".join(log[-2000:] for _, log, _ in ends)
    assert len({summary["global_params_sha256"] for _, _, summary in ends}) == 1
    # it is outvoted at the first step whose digests it reads (8, or a later one it drifted at too)
    assert drifter["resyncs"] >= 1 and re.search(r"θ̄ after step \d+ differs from the one a majority", log2)
    for summary in (honest0, honest1):
        assert set(summary["theta_disputed"]) == {drifter["peer_id"]}, summary["theta_disputed"]
        assert summary["theta_disputed"][drifter["peer_id"]] >= EARLY
    assert set(drifter["theta_disputed"]) == {honest0["peer_id"], honest1["peer_id"]}
    for _, log, _ in ends:
        assert "finished with the majority's θ̄ after a split" in log, log[-2000:]
