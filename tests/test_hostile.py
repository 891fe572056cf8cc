"""Hostile peers against real honest peers on 127.0.0.1 (``tests/hostile_peer.py``): the honest
peers finish with one θ̄, close to the clean run's perplexity, and their reports name the culprits."""

from __future__ import annotations

from pathlib import Path

from p2p_cocodc.swarm.trust import keygen
from tests.swarm_procs import HOSTILE, end_group, records, run_cli, spawn, start_bootstrap
from tests.tiny_options import TINY_MODEL, TINY_SYNCS

PEERS = 5  # three honest peers and two hostile members
OPTIONS = [*TINY_MODEL, "--workers", str(PEERS), "--steps", "32", *TINY_SYNCS, "--threads", "1", "--quiet"]
PPL_BOUND = 1.10  # honest peers end within 10% of the clean run's final perplexity


def peer_ids_by_shard(path: Path) -> dict[int, str]:
    return {r["shard"]: r["peer"] for r in records(path) if r["kind"] == "join"}


def test_a_stranger_is_shut_out_a_flipping_member_screened_and_a_flooding_one_banned(tmp_path: Path) -> None:
    key = tmp_path / "swarm.key"
    keygen(str(key))
    boot = start_bootstrap(tmp_path, extra=["--swarm-key-file", str(key)])
    join = ["join", "--bootstrap", boot.host_port, "--run-id", "trust", *OPTIONS, "--pace", "fixed"]
    keyed = [*join, "--swarm-key-file", str(key), "--round-timeout", "10"]
    procs = []
    try:
        for i in range(3):
            procs.append(
                spawn(
                    [*keyed, "--shard", f"{i}/{PEERS}", "--out", f"peer{i}.jsonl"], tmp_path, f"peer{i}.log"
                )
            )
        for i, mode in ((3, "flip"), (4, "flood")):
            args = [mode, *keyed, "--shard", f"{i}/{PEERS}", "--out", f"peer{i}.jsonl"]
            procs.append(spawn(args, tmp_path, f"peer{i}.log", command=HOSTILE))
        # a stranger without the key: the keyed bootstrap and peers never take its record
        stranger = run_cli([*join, "--out", "stranger.jsonl"], tmp_path, timeout=120)
        clean = run_cli(["simulate", *OPTIONS, "--out", "clean.jsonl"], tmp_path, timeout=300)
        assert clean.returncode == 0, clean.stderr
        for i in range(3):
            assert procs[i].wait(timeout=400) == 0, (tmp_path / f"peer{i}.log").read_text()[-3000:]
    finally:
        for proc in [*procs, boot.proc]:
            end_group(proc)

    assert stranger.returncode != 0
    error = stranger.stderr.strip().splitlines()[-1]
    assert error.startswith("error: ") and "--swarm-key-file" in error and "Traceback" not in stranger.stderr

    summaries = [records(tmp_path / f"peer{i}.jsonl")[-1] for i in range(3)]
    assert all(s["kind"] == "summary" for s in summaries)
    assert len({s["global_params_sha256"] for s in summaries}) == 1
    reference = records(tmp_path / "clean.jsonl")[-1]["final_val_ppl"]
    assert all(s["final_val_ppl"] <= PPL_BOUND * reference for s in summaries), (
        [s["final_val_ppl"] for s in summaries],
        reference,
    )
    ids = peer_ids_by_shard(tmp_path / "peer0.jsonl")
    flipper, flooder = ids[3], ids[4]
    for s in summaries:  # each honest slice owner left the flipper out, and refused the flooder
        assert flipper in s["outliers"], s["outliers"]
        assert flooder in s["refused"], s["refused"]
        assert not set(s["outliers"]) - {flipper}  # no honest peer was taken for an outlier
        assert s["theta_disputed"] == {}
