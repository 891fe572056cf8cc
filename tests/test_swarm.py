"""The swarm end to end: a real bootstrap and real peers as OS processes on 127.0.0.1.

The central check: three peers reach the θ̄ that ``simulate`` reaches with three workers, so the
distributed pipeline computes the algorithm itself, not something near it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.swarm_procs import (
    descendants,
    end_group,
    evals,
    free_port,
    records,
    run_cli,
    sigkill_like_a_crash,
    simulate_here,
    spawn,
    start_bootstrap,
    wait_for,
)
from tests.tiny_options import TINY


@pytest.mark.parametrize(
    ("algo", "codec", "shares", "ending"),
    [("streaming", "topk2", "1", ["--no-final-sync"]), ("cocodc", "fp32", "1,1,0.5", [])],
)
def test_three_peers_equal_the_simulator(
    tmp_path: Path, algo: str, codec: str, shares: str, ending: list[str]
) -> None:
    """Streaming with a top-k codec and error feedback, ending without closing rounds; cocodc
    lossless with uneven regions (peer 2 trains half the steps, --inner-share 0.5, the simulator's
    worker 2 likewise) and closing rounds after the last step: the same θ̄ as the simulator."""
    share = shares.split(",") * 3 if "," not in shares else shares.split(",")
    boot = start_bootstrap(tmp_path)
    peers = []
    try:
        for i in range(3):
            # peer 0 joins by multiaddr, the others by the host:port the bootstrap printed
            address = boot.maddr if i == 0 else boot.host_port
            # --codec after TINY, whose own --codec fp32 would otherwise be the one taken
            args = ["join", "--bootstrap", address, "--algo", algo, *TINY, "--codec", codec]
            if algo == "cocodc" or i == 0:  # streaming: peers 1 and 2 pick the free shards themselves
                args += ["--shard", f"{i}/3"]
            args += ["--out", f"peer{i}.jsonl", "--save", f"peer{i}-model", "--run-id", f"t-{algo}"]
            args += ["--verbose", "--pace", "fixed"]  # the simulator's timetable, however loaded this machine
            args += ["--inner-share", share[i], *ending]
            peers.append(spawn(args, tmp_path, f"peer{i}.log"))
        sim = simulate_here(
            [
                "--algo",
                algo,
                *TINY,
                "--codec",
                codec,
                "--out",
                "sim.jsonl",
                "--save",
                "sim-model",
                "--inner-share",
                shares,
                *ending,
            ],
            tmp_path,
        )
        assert sim.returncode == 0, sim.stderr
        for i, peer in enumerate(peers):
            code = peer.wait(timeout=180)
            assert code == 0, (tmp_path / f"peer{i}.log").read_text()[-3000:]
        ended = [records(tmp_path / f"peer{i}.jsonl")[-1] for i in range(3)]
        wait_for(lambda: watched_to_the_end(boot.host_port, f"t-{algo}", ended), 30, "the last records")
    finally:
        for proc in [*peers, boot.proc]:
            end_group(proc)

    summaries = [records(tmp_path / f"peer{i}.jsonl")[-1] for i in range(3)]
    expected = records(tmp_path / "sim.jsonl")[-1]
    assert all(s["kind"] == "summary" for s in summaries)
    assert sorted(s["shard"] for s in summaries) == [0, 1, 2]
    # a region of share 1/2 trains 16 of the 32 steps, and its θ̄ is everyone's
    trained = {s["shard"]: (s["steps_trained"], s["inner_share"]) for s in summaries}
    assert trained == {i: (round(32 * float(share[i])), float(share[i])) for i in range(3)}
    # every fragment synced several times, every round complete on every peer
    assert all(s["rounds_done"] >= 6 and s["rounds_failed"] == 0 for s in summaries)
    # the sync work between steps (snapshots, merges) is timed, apart from the waits for results
    assert all(0 < s["sync_boundary_s"] < s["wall_time_s"] for s in summaries)
    assert all(0 < s["sync_boundary_share"] < 1 for s in summaries)
    # the end's wait for the last syncs is apart from the training time that tokens/s counts
    assert all(0 < s["finish_s"] < s["wall_time_s"] for s in summaries)
    assert all(0 < s["mean_round_s"] < s["wall_time_s"] for s in summaries)  # arrival to average
    # the butterflies' own time (adoption to average) is within the rounds' (arrival to average)
    assert all(0 < s["butterflies"] <= s["rounds_done"] for s in summaries)
    assert all(
        0 < s["mean_butterfly_s"] * s["butterflies"] <= s["mean_round_s"] * s["rounds_done"]
        for s in summaries
    )
    # every sync's time to land (send to result, the wait for the others left out) is timed
    assert all(list(s["sync_landing_s"]) == [codec] for s in summaries)
    assert all(0 < s["sync_landing_s"][codec] < s["wall_time_s"] for s in summaries)
    assert len({s["global_params_sha256"] for s in summaries}) == 1
    assert all(s["final_val_ppl"] < s["initial_val_ppl"] * 0.8 for s in summaries)
    # the simulator models what a member sends on average: (M−1)/M of the slices and of their means
    # (a top-k codec's means are larger than its slices, so members whose slice is larger send more)
    sent = sum(s["bytes_sent"] for s in summaries) / 3
    assert sent == pytest.approx(expected["bytes_sent"], rel=1e-4)

    reference = load_file(tmp_path / "sim-model" / "model.safetensors")
    for i in range(3):
        got = load_file(tmp_path / f"peer{i}-model" / "model.safetensors")
        assert list(got) == list(reference)
        worst = max(float((got[k] - reference[k]).abs().max()) for k in reference)
        assert worst <= 1e-5, f"peer {i}: θ̄ differs from the simulator's by {worst}"

    rounds = [r for r in records(tmp_path / "peer0.jsonl") if r["kind"] == "round"]
    closing = sorted(r["round"] for r in rounds if r["round"].endswith(":32"))
    # closing rounds: each fragment not sent after step 32 syncs once more then, applied at once
    assert all(r["step"] == 32 for r in rounds if r["round"].endswith(":32"))
    assert closing == ([] if ending else ["f0:32", "f1:32"])
    evals = [r for r in records(tmp_path / "peer0.jsonl") if r["kind"] == "eval"]
    assert [e["step"] for e in evals] == [0, 8, 16, 24, 32]
    assert all("wall_time_s" in e and "sim_time_s" not in e for e in evals)


def watched_to_the_end(boot_status: str, run_id: str, summaries: list[dict]) -> bool:
    """The bootstrap's history of each peer ends on the perplexity its summary gives: the record a
    peer publishes carries what operators watch (its name, θ̄'s perplexity, throughput, bytes)."""
    with urllib.request.urlopen(f"http://{boot_status}/history", timeout=10) as reply:
        history = json.load(reply)
    series = history["runs"].get(run_id, {})
    for summary in summaries:
        peer = series.get(summary["peer_id"])
        if peer is None:
            return False
        last = dict(zip(history["fields"], peer["points"][-1], strict=True))
        if last["val_ppl"] != summary["final_val_ppl"]:
            return False
        assert peer["region"] == summary["peer_id"][:12]  # no --region: the peer id's start
        assert last["tokens_per_s"] > 0 and last["bytes_received"] > 0 and last["bytes_sent"] > 0
    return True


def test_join_without_a_bootstrap_ends_with_a_clear_message(tmp_path: Path) -> None:
    dead_port = free_port()
    peer_id = "12D3KooWMGTq8jsqsJk2uuVpvnWNWFm2R6dV5vpintmM9zGzJHkp"
    for address in (f"/ip4/127.0.0.1/tcp/{dead_port}/p2p/{peer_id}", f"127.0.0.1:{dead_port}"):
        started = time.monotonic()
        done = run_cli(["join", "--bootstrap", address, *TINY], tmp_path, timeout=90)
        assert done.returncode != 0
        assert time.monotonic() - started < 60
        lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "bootstrap" in lines[0], done.stderr
        assert "Traceback" not in done.stderr


def test_the_socket_files_of_daemons_that_gave_up_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    """A p2pd that could not reach the bootstrap exits by itself and leaves its socket file behind
    (hivemind removes it only when it stops p2pd): ``start_dht`` removes the new files nobody listens
    on, and keeps one a process listens on. Real unix sockets in a folder of this test's own."""
    import socket as sockets

    from p2p_cocodc.swarm.dht import remove_dead_sockets

    dead, live = tmp_path / "hivemind-p2pd-dead.sock", tmp_path / "hivemind-p2pd-live.sock"
    with sockets.socket(sockets.AF_UNIX) as gone:
        gone.bind(str(dead))  # bound, never listened on, then closed: the file of a daemon that exited
    with sockets.socket(sockets.AF_UNIX) as listening:
        listening.bind(str(live))
        listening.listen()
        remove_dead_sockets({dead, live}, settle_s=0.5)
        assert not dead.exists() and live.exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--shard", "3/3"], "--shard 3/3"),
        (["--shard", "x"], "--shard 'x'"),
        (["--shard", "0/2"], "must equal --max-peers"),
        (["--run-id", "a b"], "--run-id"),
    ],
)
def test_join_rejects_bad_options(tmp_path: Path, extra: list[str], message: str) -> None:
    done = run_cli(["join", "--bootstrap", "127.0.0.1:9", *TINY, *extra], tmp_path, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


def test_killed_peer_leaves_no_process_behind(tmp_path: Path) -> None:
    boot = start_bootstrap(tmp_path)
    peer = spawn(["join", "--bootstrap", boot.maddr, *TINY, "--workers", "2"], tmp_path, "peer.log")
    try:
        # a peer waiting for its partner has its DHT process and p2pd running
        wait_for(lambda: len(descendants(peer.pid)) >= 2, 60, "helpers")
        helpers = sigkill_like_a_crash(peer.pid)  # fails unless the helpers die with the peer
        assert len(helpers) >= 2
        peer.wait(timeout=10)
    finally:
        end_group(peer)
        end_group(boot.proc)


@contextmanager
def training_alone(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, Path]]:
    """A one-peer run (no partner to wait for) that trains until stopped, ended whatever happens."""
    boot = start_bootstrap(tmp_path)
    args = ["join", "--bootstrap", boot.maddr, *TINY, "--workers", "1", "--steps", "100000"]
    peer = spawn(args + ["--out", "peer.jsonl", "--save", "model"], tmp_path, "peer.log")
    try:
        out = tmp_path / "peer.jsonl"
        wait_for(lambda: evals(out) >= 2, 90, "training to start")
        yield peer, out
    finally:
        end_group(peer)
        end_group(boot.proc)


def test_sigterm_stops_a_peer_cleanly(tmp_path: Path) -> None:
    with training_alone(tmp_path) as (peer, out):
        peer.send_signal(signal.SIGTERM)
        assert peer.wait(timeout=30) == 128 + signal.SIGTERM, (tmp_path / "peer.log").read_text()[-2000:]
        summary = records(out)[-1]
        assert summary["kind"] == "summary" and 8 <= summary["steps"] < 100000
        assert descendants(peer.pid) == []
        said = (tmp_path / "peer.log").read_text()  # a leave, not the line of a finished run
        assert f"left the swarm after step {summary['steps']} of 100000" in said
        assert "final val ppl" not in said
        # its θ̄ is saved, but never under the name a finished run's takes
        assert summary["saved"] == f"model.partial-step-{summary['steps']}"
        assert not (tmp_path / "model").exists()
        saved = json.loads((tmp_path / summary["saved"] / "p2p-cocodc.json").read_text())
        assert saved["run"]["finished"] is False
        assert saved["global_params_sha256"] == summary["global_params_sha256"]


def test_global_parameters_file_loads_into_the_model(tmp_path: Path) -> None:
    """--save writes θ̄ in a folder whose model.safetensors torch loads back into the preset model."""
    from p2p_cocodc.models.build import build_model

    done = simulate_here([*TINY, "--steps", "8", "--save", "theta"], tmp_path)
    assert done.returncode == 0, done.stderr
    model = build_model("nano", 256, 32)
    state = load_file(tmp_path / "theta" / "model.safetensors")
    model.load_state_dict(state)
    assert all(torch.isfinite(t).all() for t in state.values())


def test_screening_judges_by_the_rounds_applied_before_the_send_as_the_simulator_does(tmp_path: Path) -> None:
    """Rounds overlap (τ = 6 steps, a send every 4) and the cosine test is strict (0.9), so slice
    owners leave honest members out by their earlier cosines. A round is judged by the cosines of the
    rounds applied before its send, on every peer and in the simulator, whichever rounds happened to
    have landed when its messages came: the swarm's θ̄ is the simulator's. (Before, a peer judged by
    the rounds whose results it held when the round opened, and the two ended apart.)"""
    strict = ["--overlap", "6", "--outlier-cosine", "0.9", "--steps", "48"]
    boot = start_bootstrap(tmp_path)
    peers = []
    try:
        for i in range(3):
            args = ["join", "--bootstrap", boot.host_port, "--algo", "cocodc", *TINY, *strict]
            args += ["--shard", f"{i}/3", "--out", f"peer{i}.jsonl", "--run-id", "strict", "--pace", "fixed"]
            peers.append(spawn(args, tmp_path, f"peer{i}.log"))
        sim = simulate_here(["--algo", "cocodc", *TINY, *strict, "--out", "sim.jsonl"], tmp_path)
        assert sim.returncode == 0, sim.stderr
        for i, peer in enumerate(peers):
            assert peer.wait(timeout=180) == 0, (tmp_path / f"peer{i}.log").read_text()[-3000:]
    finally:
        for proc in [*peers, boot.proc]:
            end_group(proc)
    simulated = records(tmp_path / "sim.jsonl")
    left_out = [r for r in simulated if r["kind"] == "exclusion"]
    assert len(left_out) >= 3, left_out  # the screening was in play, round after round
    hashes = {records(tmp_path / f"peer{i}.jsonl")[-1]["global_params_sha256"] for i in range(3)}
    assert hashes == {simulated[-1]["global_params_sha256"]}


def test_peers_with_different_options_refuse_to_train_together(tmp_path: Path) -> None:
    boot = start_bootstrap(tmp_path)
    peers = [
        spawn(
            ["join", "--bootstrap", boot.maddr, *TINY, "--workers", "2", "--seed", str(seed)],
            tmp_path,
            f"p{seed}.log",
        )
        for seed in (0, 1)
    ]
    try:
        codes = [p.wait(timeout=120) for p in peers]
    finally:
        for proc in [*peers, boot.proc]:
            end_group(proc)
    logs = [(tmp_path / f"p{seed}.log").read_text() for seed in (0, 1)]
    assert codes == [2, 2], logs
    assert all("trains with other options" in log and "Traceback" not in log for log in logs)
    # each names the option that differs, with both values
    assert "--seed 1 there, 0 here" in logs[0] and "--seed 0 there, 1 here" in logs[1], logs


def run_three_peers(tmp_path: Path, boot: Any, argv: Callable[[int], list[str]]) -> list[str]:
    """Peers 0-2 (``argv(i)``: peer i's command line) run to their end; then every process, the
    bootstrap's too, is ended. Their logs, once each exited 0."""
    peers = []
    try:
        for i in range(3):
            peers.append(spawn(argv(i), tmp_path, f"peer{i}.log"))
        codes = [peer.wait(timeout=180) for peer in peers]
    finally:
        for proc in [*peers, boot.proc]:
            end_group(proc)
    logs = [(tmp_path / f"peer{i}.log").read_text() for i in range(3)]
    assert codes == [0, 0, 0], [log[-3000:] for log in logs]
    return logs


def test_peers_that_work_auto_out_differently_train_together_with_the_swarms_overlap_and_sends(
    tmp_path: Path,
) -> None:
    """--overlap auto --transmissions auto: each peer works τ and N out from its own link and step
    time (here --step-time 0.02, 0.03 and 0.05 s on a 1 ms, 50 Mbit/s link: (3, 3), (2, 4) and
    (2, 7)) and they used to refuse each other for it. They train together with the largest τ and
    the fewest N, (3, 3), say so, and reach the simulator's θ̄ for those numbers."""
    cut = TINY.index("--overlap")
    fixed = [*TINY[:cut], *TINY[cut + 2 :]]  # TINY without its --overlap
    auto = [
        *fixed,
        "--overlap",
        "auto",
        "--transmissions",
        "auto",
        "--latency-ms",
        "1",
        "--bandwidth-mbps",
        "50",
    ]
    step_times = ["0.02", "0.03", "0.05"]
    boot = start_bootstrap(tmp_path)

    def peer(i: int) -> list[str]:
        args = ["join", "--bootstrap", boot.maddr, "--algo", "cocodc", *auto, "--step-time", step_times[i]]
        return [*args, "--shard", f"{i}/3", "--out", f"peer{i}.jsonl", "--run-id", "auto", "--pace", "fixed"]

    logs = run_three_peers(tmp_path, boot, peer)
    agreed = ["--overlap", "3", "--transmissions", "3"]
    sim = simulate_here(["--algo", "cocodc", *fixed, *agreed, "--out", "sim.jsonl"], tmp_path)
    assert sim.returncode == 0, sim.stderr
    summaries = [records(tmp_path / f"peer{i}.jsonl")[-1] for i in range(3)]
    assert [(s["overlap"], s["transmissions"]) for s in summaries] == [(3, 3)] * 3
    assert "syncs with --overlap 3 --transmissions 3 (this peer worked out" not in logs[0]
    assert "the swarm syncs with --overlap 3 --transmissions 3 (this peer worked out 2 and 4)" in logs[1]
    assert "the swarm syncs with --overlap 3 --transmissions 3 (this peer worked out 2 and 7)" in logs[2]
    expected = records(tmp_path / "sim.jsonl")[-1]["global_params_sha256"]
    assert {s["global_params_sha256"] for s in summaries} == {expected}


def test_peers_on_a_declared_thin_link_start_paced_and_the_simulator_replays_it(tmp_path: Path) -> None:
    """Peers whose declared link (--bandwidth-mbps 1) cannot carry a sync every H/N = 4 steps agree
    in the lobby on a starting pace, so that their first syncs are paced too (before, the first
    round's result paced only the later ones, and on a thin link the first rounds stalled). The
    pace is recorded, and ``simulate --events`` replays the run to the same θ̄; without that record
    the replay's first sync has no round to follow."""
    options = [*TINY, "--steps", "64", "--step-time", "0.02", "--bandwidth-mbps", "1"]
    boot = start_bootstrap(tmp_path)

    def peer(i: int) -> list[str]:
        args = ["join", "--bootstrap", boot.maddr, "--algo", "cocodc", *options, "--run-id", "paced"]
        return [*args, "--shard", f"{i}/3", "--out", f"peer{i}.jsonl", "--verbose"]

    logs = run_three_peers(tmp_path, boot, peer)
    outs = [records(tmp_path / f"peer{i}.jsonl") for i in range(3)]
    starts = {r["pace"] for out in outs for r in out if r["kind"] == "start"}
    assert len(starts) == 1 and 4 < (pace := starts.pop()) <= 32, starts
    assert all(f"the swarm starts sending a fragment every {pace} steps" in log for log in logs)
    first = min((int(r["round"].split(":")[1]), r) for r in outs[0] if r["kind"] == "round")
    assert first[0] == pace  # no sync went out at the schedule's own slots 4, 8, ... before it
    assert first[1]["codec"] == "q2", first  # paced: --paced-codec auto's q2, not fp4, and replayed so
    theta = {out[-1]["global_params_sha256"] for out in outs}
    assert len(theta) == 1
    replay = ["--algo", "cocodc", *options, "--events", "peer0.jsonl", "--out", "replay.jsonl"]
    sim = simulate_here(replay, tmp_path)
    assert sim.returncode == 0, sim.stderr
    assert records(tmp_path / "replay.jsonl")[-1]["global_params_sha256"] in theta
    unpaced = [line for line in (tmp_path / "peer0.jsonl").read_text().splitlines() if '"start"' not in line]
    (tmp_path / "unpaced.jsonl").write_text("\n".join(unpaced) + "\n")
    sim = simulate_here(
        [*replay[:-4], "--events", "unpaced.jsonl", "--out", "unpaced-replay.jsonl"], tmp_path
    )
    assert sim.returncode != 0 and "no record of round" in sim.stderr, sim.stderr


def test_a_peer_whose_dht_dies_ends_with_a_clear_message(tmp_path: Path) -> None:
    with training_alone(tmp_path) as (peer, _):
        own = Path(f"/proc/{peer.pid}/cmdline").read_bytes()
        # hivemind forks its DHT process from the peer: same command line, a child of the peer
        dht = [p for p in descendants(peer.pid) if Path(f"/proc/{p}/cmdline").read_bytes() == own]
        assert len(dht) == 1
        sigkill_like_a_crash(dht[0])
        assert peer.wait(timeout=60) == 2
        log = (tmp_path / "peer.log").read_text()
        assert "lost the swarm's DHT" in log and "Traceback" not in log, log[-2000:]
