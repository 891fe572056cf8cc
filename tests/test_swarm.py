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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.swarm_procs import (
    Bootstrap,
    descendants,
    end_group,
    free_port,
    records,
    run_cli,
    sigkill_like_a_crash,
    spawn,
    start_bootstrap,
    wait_for,
)
from tests.tiny_options import TINY_MODEL, TINY_SYNCS

TINY = [
    *TINY_MODEL,
    "--workers",
    "3",
    "--steps",
    "32",
    *TINY_SYNCS,
    "--threads",
    "1",
    "--codec",
    "fp32",
    "--quiet",
]


def evals(path: Path) -> int:
    """How many evaluations of θ̄ a peer has written: how far its training has come."""
    return sum(r["kind"] == "eval" for r in records(path)) if path.exists() else 0


@pytest.mark.parametrize("algo", ["streaming", "cocodc"])
def test_three_peers_equal_the_simulator(tmp_path: Path, algo: str) -> None:
    boot = start_bootstrap(tmp_path)
    peers = []
    try:
        for i in range(3):
            # peer 0 joins by multiaddr, the others by the host:port the bootstrap printed
            address = boot.maddr if i == 0 else boot.host_port
            args = ["join", "--bootstrap", address, "--algo", algo, *TINY]
            if algo == "cocodc" or i == 0:  # streaming: peers 1 and 2 pick the free shards themselves
                args += ["--shard", f"{i}/3"]
            args += ["--out", f"peer{i}.jsonl", "--save", f"peer{i}-model", "--run-id", f"t-{algo}"]
            args += ["--verbose", "--pace", "fixed"]  # the simulator's timetable, however loaded this machine
            peers.append(spawn(args, tmp_path, f"peer{i}.log"))
        sim = run_cli(
            ["simulate", "--algo", algo, *TINY, "--out", "sim.jsonl", "--save", "sim-model"],
            tmp_path,
            timeout=120,
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
    # every fragment synced several times, every round complete on every peer
    assert all(s["rounds_done"] >= 6 and s["rounds_failed"] == 0 for s in summaries)
    assert len({s["global_params_sha256"] for s in summaries}) == 1
    assert all(s["final_val_ppl"] < s["initial_val_ppl"] * 0.8 for s in summaries)
    # the simulator models the butterfly as 2(M−1)/M of the payload; real slices differ by rounding
    assert summaries[0]["bytes_sent"] == pytest.approx(expected["bytes_sent"], rel=1e-4)

    reference = load_file(tmp_path / "sim-model" / "model.safetensors")
    for i in range(3):
        got = load_file(tmp_path / f"peer{i}-model" / "model.safetensors")
        assert list(got) == list(reference)
        worst = max(float((got[k] - reference[k]).abs().max()) for k in reference)
        assert worst <= 1e-5, f"peer {i}: θ̄ differs from the simulator's by {worst}"

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


def round_leader_shard(boot_status: str, run_id: str) -> int:
    """The shard of the peer with the smallest id on the bootstrap's /status (it leads about a third
    of the rounds: the line is a hash of round and id), once /status lists the run."""

    def peers() -> dict | None:
        with urllib.request.urlopen(f"http://{boot_status}/status", timeout=10) as reply:
            return json.load(reply)["runs"].get(run_id, {}).get("peers")

    found = wait_for(peers, 30, f"run {run_id} on the bootstrap's /status")
    return found[min(found)]["shard"]


def start_three_training(
    tmp_path: Path, boot: Bootstrap, run_id: str, steps: int, peers: list[subprocess.Popen], *extra: str
) -> list[Path]:
    """Three cocodc peers on shards 0-2 (appended to ``peers`` as they start, so the caller ends
    them whatever happens), returned once each has written a few records: training is under way.
    ``extra`` options may name the peer's index as {i}. They keep the configured send pace (on this
    loaded machine, slow acknowledgements can pace a run): the tests count the syncs done."""
    for i in range(3):
        args = ["join", "--bootstrap", boot.maddr, "--algo", "cocodc", *TINY, "--steps", str(steps)]
        args += ["--shard", f"{i}/3", "--out", f"peer{i}.jsonl", "--run-id", run_id, "--verbose"]
        args += ["--pace", "fixed"]
        args += [option.format(i=i) for option in extra]
        peers.append(spawn(args, tmp_path, f"peer{i}.log"))
    outs = [tmp_path / f"peer{i}.jsonl" for i in range(3)]
    wait_for(lambda: all(evals(o) >= 2 for o in outs), 120, "training to be under way")
    return outs


def test_survivors_of_a_peer_killed_mid_run_finish_with_the_same_global_model(tmp_path: Path) -> None:
    """The region leading rounds drops out (SIGKILL, as a crash or the OOM killer would): rounds it
    was in fail alike on the others, later rounds form without it (under the next leader) once its
    record lapses, and nobody hangs. (A member that is not the leader is killed in
    test_a_peer_joins_a_run_in_progress_and_a_crashed_one_comes_back.)"""
    boot = start_bootstrap(tmp_path)
    peers = []
    try:
        start_three_training(tmp_path, boot, "drop", 96, peers)
        dead = round_leader_shard(boot.host_port, "drop")
        survivors = [i for i in range(3) if i != dead]
        sigkill_like_a_crash(peers[dead].pid)
        for i in survivors:
            assert peers[i].wait(timeout=180) == 0, (tmp_path / f"peer{i}.log").read_text()[-3000:]
    finally:
        for proc in [*peers, boot.proc]:
            end_group(proc)

    summaries = [records(tmp_path / f"peer{i}.jsonl")[-1] for i in survivors]
    assert all(s["kind"] == "summary" and s["steps"] == 96 for s in summaries)
    rounds = "\n".join((tmp_path / f"peer{i}.log").read_text()[-6000:] for i in survivors)
    assert summaries[0]["global_params_sha256"] == summaries[1]["global_params_sha256"], rounds
    assert summaries[0]["rounds_failed"] == summaries[1]["rounds_failed"] <= 2
    assert all(s["rounds_done"] >= 16 and s["final_val_ppl"] < s["initial_val_ppl"] * 0.8 for s in summaries)


def test_a_peer_that_leaves_mid_run_is_not_waited_for(tmp_path: Path) -> None:
    """The round leader is stopped with SIGTERM mid-run: it says "leaving" on the board at once,
    finishes the rounds it is in, writes a checkpoint of its last step and exits 0; the others
    form later rounds without it at once (not after its record lapses) and end with the same θ̄."""
    boot = start_bootstrap(tmp_path)
    peers = []
    try:
        start_three_training(tmp_path, boot, "leave", 96, peers, "--checkpoint-dir", "ck{i}")
        leaver = round_leader_shard(boot.host_port, "leave")
        stayers = [i for i in range(3) if i != leaver]
        peers[leaver].send_signal(signal.SIGTERM)
        left = peers[leaver].wait(timeout=60)
        assert left == 128 + signal.SIGTERM, (tmp_path / f"peer{leaver}.log").read_text()[-3000:]
        for i in stayers:
            assert peers[i].wait(timeout=180) == 0, (tmp_path / f"peer{i}.log").read_text()[-3000:]
    finally:
        for proc in [*peers, boot.proc]:
            end_group(proc)

    summaries = [records(tmp_path / f"peer{i}.jsonl")[-1] for i in stayers]
    logs = "\n".join((tmp_path / f"peer{i}.log").read_text()[-6000:] for i in stayers)
    assert summaries[0]["global_params_sha256"] == summaries[1]["global_params_sha256"], logs
    assert all(s["steps"] == 96 and s["rounds_done"] >= 16 for s in summaries)
    left_at = records(tmp_path / f"peer{leaver}.jsonl")[-1]["steps"]  # SIGTERM checkpointed its last step
    assert left_at < 96 and (tmp_path / f"ck{leaver}" / f"step-{left_at:08d}.json").exists()
    assert summaries[0]["rounds_failed"] == summaries[1]["rounds_failed"] <= 1, logs
    # nobody waited for the leaver's record to lapse: the rounds sent from two syncs after its last
    # step on formed without it and completed (a group still counting it would fail at the deadline)
    for i in stayers:
        later = [r for r in records(tmp_path / f"peer{i}.jsonl") if r["kind"] == "round"]
        later = [r for r in later if int(r["round"].split(":")[1]) > left_at + 16]
        assert later and all(r["completed"] and leaver not in r["members"] for r in later), logs
    # the simulator replays the rounds a survivor recorded (groups without the leaver) to the same θ̄
    replay = ["simulate", "--algo", "cocodc", *TINY, "--steps", "96", "--events", f"peer{stayers[0]}.jsonl"]
    sim = run_cli([*replay, "--out", "replay.jsonl"], tmp_path, timeout=120)
    assert sim.returncode == 0, sim.stderr
    replayed = records(tmp_path / "replay.jsonl")[-1]
    assert replayed["global_params_sha256"] == summaries[0]["global_params_sha256"]


JOIN_STEPS = 1024  # the founders must still train when the crashed peer is back (~15 s, ~150 steps, after)


def test_a_peer_joins_a_run_in_progress_and_a_crashed_one_comes_back(tmp_path: Path) -> None:
    """A fourth peer joins a three-peer run under way (--max-peers 4): it takes θ̄, the outer
    momentum and the schedule from the others at the end of a step and trains from there; a fifth
    is refused (the run is full). Then a founder is killed (SIGKILL, a crash) and started again with
    the same command, --identity and --resume: its checkpoint is behind the swarm, so it rejoins
    like a joiner, on its old data shard. Every peer ends with one θ̄, and the simulator replays a
    founder's records (rounds and joins) to the same θ̄."""
    boot = start_bootstrap(tmp_path)
    # the configured pace: the founders must still be training when the crashed peer comes back,
    # and a run paced by this loaded machine's slow acknowledgements can go twice as fast
    common = ["join", "--bootstrap", boot.maddr, "--algo", "cocodc", *TINY, "--steps", str(JOIN_STEPS)]
    common += ["--pace", "fixed", "--max-peers", "4", "--run-id", "elastic", "--verbose"]

    def start(name: str, identity: str, *extra: str) -> subprocess.Popen:
        args = [*common, "--identity", identity, "--out", f"{name}.jsonl", *extra]
        return spawn(args, tmp_path, f"{name}.log")

    def joined(name: str) -> dict | None:  # the join record a peer writes for itself once it has the state
        path = tmp_path / f"{name}.jsonl"
        mine = [r for r in records(path) if r["kind"] == "join"] if path.exists() else []
        return next((r for r in mine if r["step"] > 0), None)

    peers: dict[str, subprocess.Popen] = {}
    try:
        for i in range(3):
            peers[f"peer{i}"] = start(
                f"peer{i}", f"peer{i}.id", "--checkpoint-dir", f"ck{i}", "--checkpoint-every", "16"
            )
        outs = [tmp_path / f"peer{i}.jsonl" for i in range(3)]
        wait_for(lambda: all(evals(o) >= 1 for o in outs), 120, "training to be under way")
        peers["joiner"] = start("joiner", "joiner.id")
        wait_for(lambda: joined("joiner"), 120, "the joiner to take the swarm's state")
        peers["fifth"] = start("fifth", "fifth.id")
        assert peers["fifth"].wait(timeout=60) == 2
        sigkill_like_a_crash(peers["peer1"].pid)
        peers["peer1-again"] = start(
            "peer1-again", "peer1.id", "--checkpoint-dir", "ck1", "--checkpoint-every", "16", "--resume"
        )
        wait_for(lambda: joined("peer1-again"), 120, "the restarted peer to take the swarm's state")
        finishers = ["peer0", "peer2", "joiner", "peer1-again"]
        for name in finishers:
            assert peers[name].wait(timeout=240) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        for proc in [*peers.values(), boot.proc]:
            end_group(proc)

    refused = (tmp_path / "fifth.log").read_text()
    assert "is full: its peers read all 4 data shards" in refused and "Traceback" not in refused, refused
    assert "not its checkpoint of step" in (tmp_path / "peer1-again.log").read_text()
    summaries = {name: records(tmp_path / f"{name}.jsonl")[-1] for name in finishers}
    logs = "\n".join((tmp_path / f"{name}.log").read_text()[-4000:] for name in finishers)
    hashes = {name: s["global_params_sha256"] for name, s in summaries.items()}
    assert len(set(hashes.values())) == 1, (hashes, logs)
    assert all(s["kind"] == "summary" and s["steps"] == JOIN_STEPS for s in summaries.values())
    assert summaries["joiner"]["joined_at"] > 0 and summaries["peer1-again"]["joined_at"] > 0
    assert summaries["joiner"]["shard"] == 3  # the one shard the founders left free
    assert sorted(s["shard"] for s in summaries.values()) == [0, 1, 2, 3]  # peer1 took its old one back
    assert summaries["peer0"]["rounds_failed"] <= 2, logs
    # the donors' training waited only to copy their state (a memcpy of θ̄ and the momentum)
    assert all(summaries[n]["state_copy_s"] < 1.0 for n in ("peer0", "peer2")), summaries
    # the joiner took part in rounds: its shard is among the members of later rounds
    members = [r["members"] for r in records(tmp_path / "peer0.jsonl") if r["kind"] == "round"]
    assert any(3 in m for m in members) and any(1 in m for m in members[-4:]), members
    replay = ["simulate", "--algo", "cocodc", *TINY, "--steps", str(JOIN_STEPS), "--max-peers", "4"]
    sim = run_cli([*replay, "--events", "peer0.jsonl", "--out", "replay.jsonl"], tmp_path, timeout=180)
    assert sim.returncode == 0, sim.stderr
    assert records(tmp_path / "replay.jsonl")[-1]["global_params_sha256"] == hashes["peer0"]


def test_a_whole_swarm_killed_and_resumed_ends_with_the_uninterrupted_global_model(tmp_path: Path) -> None:
    """Three peers checkpoint every 16 steps; all are killed (SIGKILL, a power cut) mid-run and
    started again with --resume. They agree on the newest step all of them hold a checkpoint of,
    run again the syncs that were in flight there, and end with the θ̄ of the uninterrupted run
    (the simulator's, with the same options), bit for bit."""
    boot = start_bootstrap(tmp_path)
    common = [
        "join",
        "--bootstrap",
        boot.maddr,
        "--algo",
        "cocodc",
        *TINY,
        "--steps",
        "400",
        "--pace",
        "fixed",
    ]
    common += ["--run-id", "resumed", "--checkpoint-every", "16", "--verbose"]

    def start(i: int, *extra: str) -> subprocess.Popen:
        args = [*common, "--identity", f"peer{i}.id", "--checkpoint-dir", f"ck{i}", "--out", f"peer{i}.jsonl"]
        return spawn([*args, *extra], tmp_path, f"peer{i}{'-resumed' if extra else ''}.log")

    def checkpoints(i: int) -> int:
        folder = tmp_path / f"ck{i}"
        return len(list(folder.glob("step-*.json"))) if folder.exists() else 0

    peers: list[subprocess.Popen] = []
    try:
        peers += [start(i) for i in range(3)]
        wait_for(lambda: all(checkpoints(i) >= 2 for i in range(3)), 120, "two checkpoints on every peer")
        for proc in peers:
            sigkill_like_a_crash(proc.pid)
        # started again at once: the dead peers' records still say "training" past the checkpoint
        # (for a record lifetime); a resuming peer must wait them out, not join them or refuse them
        peers += [start(i, "--resume") for i in range(3)]
        for i, proc in enumerate(peers[3:]):
            assert proc.wait(timeout=180) == 0, (tmp_path / f"peer{i}-resumed.log").read_text()[-3000:]
    finally:
        for proc in [*peers, boot.proc]:
            end_group(proc)

    logs = "\n".join((tmp_path / f"peer{i}-resumed.log").read_text() for i in range(3))
    assert logs.count("resuming the run after step") == 3, logs[-6000:]
    summaries = [records(tmp_path / f"peer{i}.jsonl")[-1] for i in range(3)]
    assert all(s["kind"] == "summary" and s["steps"] == 400 for s in summaries)
    hashes = {s["global_params_sha256"] for s in summaries}
    assert len(hashes) == 1, logs[-6000:]
    assert evals(tmp_path / "peer0.jsonl") == 400 // 8 + 1  # --out as an uninterrupted run's
    sim = run_cli(
        ["simulate", "--algo", "cocodc", *TINY, "--steps", "400", "--out", "sim.jsonl"], tmp_path, 120
    )
    assert sim.returncode == 0, sim.stderr
    assert records(tmp_path / "sim.jsonl")[-1]["global_params_sha256"] in hashes


def board_peers(boot_status: str, run_id: str) -> dict:
    with urllib.request.urlopen(f"http://{boot_status}/status", timeout=10) as reply:
        return json.load(reply)["runs"].get(run_id, {}).get("peers", {})


def test_a_peer_stopped_longer_than_its_record_lives_never_splits_the_swarm(tmp_path: Path) -> None:
    """The round leader is frozen (SIGSTOP: a suspended VM, swap, a debugger) until its record has
    lapsed, then resumed: the others go on without it, and it notices on waking that it was away,
    takes the swarm's state again like a joiner and trains on with the others, instead of leading
    rounds alone and ending with another θ̄."""
    boot = start_bootstrap(tmp_path)
    peers = []
    try:
        outs = start_three_training(tmp_path, boot, "frozen", 600, peers)
        frozen = round_leader_shard(boot.host_port, "frozen")
        others = [i for i in range(3) if i != frozen]
        peers[frozen].send_signal(signal.SIGSTOP)
        try:

            def lapsed() -> bool:  # the others are listed, the frozen one no more
                listed = {p["shard"] for p in board_peers(boot.host_port, "frozen").values()}
                return set(others) <= listed and frozen not in listed

            wait_for(lapsed, 60, "the frozen peer's record to lapse from the board")
            at_lapse = [evals(outs[i]) for i in others]
            wait_for(  # the others go on without it
                lambda: all(evals(outs[i]) >= n + 2 for i, n in zip(others, at_lapse, strict=True)),
                120,
                "the others to train on",
            )
        finally:
            peers[frozen].send_signal(signal.SIGCONT)
        frozen_code = peers[frozen].wait(timeout=180)
        for i in others:
            assert peers[i].wait(timeout=180) == 0, (tmp_path / f"peer{i}.log").read_text()[-3000:]
    finally:
        for proc in [*peers, boot.proc]:
            end_group(proc)

    frozen_log = (tmp_path / f"peer{frozen}.log").read_text()
    assert frozen_code == 0 and "was stopped for" in frozen_log, frozen_log[-3000:]
    assert "taking the swarm's state again" in frozen_log, frozen_log[-3000:]
    resumed = records(outs[frozen])[-1]
    assert resumed["resyncs"] == 1 and resumed["joined_at"] > 0, resumed
    summaries = [records(tmp_path / f"peer{i}.jsonl")[-1] for i in others]
    logs = "\n".join((tmp_path / f"peer{i}.log").read_text()[-6000:] for i in others)
    assert summaries[0]["global_params_sha256"] == summaries[1]["global_params_sha256"], logs
    assert resumed["global_params_sha256"] == summaries[0]["global_params_sha256"], frozen_log[-3000:]
    assert all(s["kind"] == "summary" and s["steps"] == 600 for s in summaries)
    assert summaries[0]["rounds_failed"] == summaries[1]["rounds_failed"] <= 2, logs
    # they waited for the frozen leader until its record lapsed from their boards (a lifetime, 8 s),
    # and on a round under way until it had been silent for answer_s (16 s), for at most two rounds
    assert all(s["stall_s"] < 2 * (8 + 16) for s in summaries), [s["stall_s"] for s in summaries]


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

    done = run_cli(["simulate", *TINY, "--steps", "8", "--save", "theta"], tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    model = build_model("nano", 256, 32)
    state = load_file(tmp_path / "theta" / "model.safetensors")
    model.load_state_dict(state)
    assert all(torch.isfinite(t).all() for t in state.values())


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
