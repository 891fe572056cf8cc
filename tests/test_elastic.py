"""An elastic swarm, end to end with real processes on 127.0.0.1: peers that crash, leave, join a
run under way, come back, are stopped for a while, or all die at once; the others finish, and
every survivor ends with one θ̄ (the simulator replays their records to it)."""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.request
from pathlib import Path

from tests.swarm_procs import (
    Bootstrap,
    end_group,
    evals,
    records,
    run_cli,
    sigkill_like_a_crash,
    spawn,
    start_bootstrap,
    wait_for,
)
from tests.tiny_options import TINY


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
