"""Metrics a run exposes: Prometheus on a peer and on the bootstrap, scraped over HTTP from real
processes, and --log-to TensorBoard and W&B files read back with their own readers; every value
checked against the run's own --out records."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import urllib.request
import zlib
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import uvloop
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from p2p_cocodc.config.join import SwarmOptions
from p2p_cocodc.config.train import build_config, load_toml
from p2p_cocodc.errors import UserError
from p2p_cocodc.ops.bootstrap import Snapshot
from p2p_cocodc.ops.monitoring import MAX_PEER_SERIES, BootstrapMetrics, serve_peer_metrics
from p2p_cocodc.peer.node import Peer
from p2p_cocodc.run.records import RunLog
from tests.swarm_procs import (
    CLI,
    ENV,
    end_group,
    free_ports,
    records,
    run_cli,
    spawn,
    start_bootstrap,
    wait_for,
)
from tests.tiny_options import TWO_PEERS

# TWO_PEERS as the fields of TrainConfig, for a peer run in this process
TINY = {
    "model": "nano",
    "tokenizer": "byte",
    "seq_len": 32,
    "batch_size": 4,
    "workers": 2,
    "steps": 24,
    "inner_steps": 8,
    "fragments": 2,
    "overlap": 2,
    "eval_every": 8,
    "eval_batches": 2,
    "threads": 1,
}
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """{(sample name, labels): value} of a Prometheus exposition."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as response:
        return parse(response.read().decode())


def scrape_or_none(url: str) -> Samples | None:
    try:
        return scrape(url)
    except OSError:
        return None


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def labelled(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


# ---- Prometheus ----


def test_a_peer_and_the_bootstrap_serve_what_the_run_records(tmp_path: Path) -> None:
    """Two peers and a bootstrap, each with --metrics-port: one peer from the command line, the other
    in this process (its endpoint is read once its run has ended). Its metrics equal its summary;
    the bootstrap's show both peers by region, as the board says."""
    boot_port, partner_port = free_ports(2)
    boot = start_bootstrap(tmp_path, extra=["--metrics-port", str(boot_port), "--refresh", "0.2"])
    boot_url = f"http://127.0.0.1:{boot_port}/metrics"
    run = ["--run-id", "metrics", *TWO_PEERS, "--pace", "fixed"]  # a round every 4 steps, however loaded
    partner = spawn(
        [
            "join",
            "--bootstrap",
            boot.host_port,
            *run,
            "--region",
            "eu-west",
            "--metrics-port",
            str(partner_port),
        ],
        tmp_path,
        "partner.log",
    )
    try:
        # the partner waits for a second peer: its endpoint and the bootstrap's show it waiting
        partner_url = f"http://127.0.0.1:{partner_port}/metrics"
        waiting = wait_for(
            lambda: (s := scrape_or_none(partner_url)) and labelled(s, "p2p_cocodc_peer_info") and s,
            120,
            "the partner's metrics",
        )
        info = labelled(waiting, "p2p_cocodc_peer_info")
        assert [dict(labels)["region"] for labels in info] == ["eu-west"], info
        assert value(waiting, "p2p_cocodc_step") == 0 and value(
            waiting, "p2p_cocodc_peer_state", state="waiting"
        )

        def board_shows(region: str, state: str) -> Samples | None:
            samples = scrape_or_none(boot_url)
            peers = labelled(samples or {}, "p2p_cocodc_bootstrap_peer_step")
            regions = {dict(labels)["region"] for labels in peers}
            states = labelled(samples or {}, "p2p_cocodc_bootstrap_peers")
            counted = {dict(labels)["state"] for labels in states if dict(labels)["run_id"] == "metrics"}
            return samples if region in regions and state in counted else None

        wait_for(lambda: board_shows("eu-west", "waiting"), 60, "the bootstrap to list the waiting partner")

        metrics, server = serve_peer_metrics("127.0.0.1", 0)
        cfg = build_config({}, {**TINY, "out": str(tmp_path / "us-east.jsonl")})
        opts = SwarmOptions(boot.host_port, run_id="metrics", region="us-east", pace="fixed")
        peer = Peer(cfg, opts, metrics=metrics)
        log = RunLog(cfg.out)
        try:
            summary = uvloop.run(peer.run(log))
        finally:
            log.close()
        ours = scrape(server.url)
        server.close()
        # its last record ("done", step 24) reaches the bootstrap's board
        seen = wait_for(lambda: board_shows("us-east", "done"), 60, "the bootstrap to list the finished peer")
        assert partner.wait(timeout=120) == 0, (tmp_path / "partner.log").read_text()[-3000:]
    finally:
        end_group(partner)
        end_group(boot.proc)

    evals = [r for r in records(Path(cfg.out)) if r["kind"] == "eval"]
    assert summary["steps"] == 24 and summary["bytes_sent"] > 0 and summary["rounds_done"] >= 4
    assert value(ours, "p2p_cocodc_step") == summary["steps"]
    assert value(ours, "p2p_cocodc_inner_steps_total") == 24
    assert value(ours, "p2p_cocodc_tokens_total") == 24 * TINY["batch_size"] * TINY["seq_len"]
    assert value(ours, "p2p_cocodc_sent_bytes_total") == summary["bytes_sent"]
    assert value(ours, "p2p_cocodc_received_bytes_total") > 0
    assert value(ours, "p2p_cocodc_stall_seconds_total") == summary["stall_s"]
    assert value(ours, "p2p_cocodc_rounds_total", outcome="completed") == summary["rounds_done"]
    assert value(ours, "p2p_cocodc_rounds_total", outcome="failed") == summary["rounds_failed"]
    assert value(ours, "p2p_cocodc_round_duration_seconds_count") == summary["rounds_done"]
    assert value(ours, "p2p_cocodc_eval_step") == evals[-1]["step"] == 24
    assert value(ours, "p2p_cocodc_val_perplexity") == evals[-1]["val_ppl"] == summary["final_val_ppl"]
    assert value(ours, "p2p_cocodc_val_loss") == evals[-1]["val_loss"]
    assert value(ours, "p2p_cocodc_peer_state", state="done") == 1
    info = dict(next(iter(labelled(ours, "p2p_cocodc_peer_info"))))
    assert info == {"run_id": "metrics", "region": "us-east", "peer_id": summary["peer_id"], "algo": "cocodc"}

    assert value(seen, "p2p_cocodc_bootstrap_dht_up") == 1
    mine = {"run_id": "metrics", "peer": summary["peer_id"], "region": "us-east"}
    assert value(seen, "p2p_cocodc_bootstrap_peer_step", **mine) == 24
    assert value(seen, "p2p_cocodc_bootstrap_peer_val_perplexity", **mine) == summary["final_val_ppl"]


def test_a_metrics_port_in_use_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    with closing(socket.socket()) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        join = run_cli(
            ["join", "--bootstrap", "127.0.0.1:9", "--metrics-port", str(port), *TWO_PEERS], tmp_path, 60
        )
        boot_port, status_port = free_ports(2)
        boot = run_cli(
            [
                "bootstrap",
                "--port",
                str(boot_port),
                "--status-port",
                str(status_port),
                "--metrics-port",
                str(port),
                "--address-file",
                "bootstrap.json",
                "--state-dir",
                str(tmp_path),
            ],
            tmp_path,
            60,
        )
    for done in (join, boot):
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert lines[0].startswith(f"error: --metrics-port {port} is in use on 127.0.0.1"), done.stderr
    assert not (tmp_path / "bootstrap.json").exists()  # refused before its DHT started


def test_the_bootstrap_keeps_series_for_a_bounded_number_of_well_named_peers() -> None:
    """Peers are untrusted: a board of many peers, one with a name no peer id has, gives series for
    at most MAX_PEER_SERIES well-named peers, while the count by state covers every one."""
    view = {"state": "training", "step": 5, "val_ppl": -1.0, "region": "x", "tokens_per_s": 1.0}
    view |= {"stall_s": 0.0, "bytes_sent": 0, "bytes_received": 0}
    base58 = str.maketrans("0", "z")  # a peer id is base58: no 0, O, I or l
    peers = {f"Qm{i:04d}".translate(base58): view for i in range(MAX_PEER_SERIES + 10)}
    peers["A bad id 0"] = view  # sorted before the others
    snapshot = Snapshot({"maddrs": [], "peer_id": "Qm"})
    snapshot.status = json.dumps({"runs": {"r": {"info": {}, "peers": peers}}}).encode()
    metrics = BootstrapMetrics()
    metrics.snapshot = snapshot
    samples = parse(generate_latest(metrics.registry).decode())
    steps = labelled(samples, "p2p_cocodc_bootstrap_peer_step")
    assert len(steps) == MAX_PEER_SERIES and all(dict(labels)["peer"].startswith("Qm") for labels in steps)
    assert value(samples, "p2p_cocodc_bootstrap_peers", run_id="r", state="training") == len(peers)
    assert not labelled(samples, "p2p_cocodc_bootstrap_peer_val_perplexity")  # -1: none yet


# ---- --log-to ----


def test_log_to_tensorboard_and_wandb_hold_every_evaluation(tmp_path: Path) -> None:
    """A simulation with --log-to tensorboard,wandb: TensorBoard's event file and W&B's offline run
    (the default without a W&B login) hold val_ppl at every step --out evaluated, and the summary."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    env = {k: v for k, v in ENV.items() if k not in ("WANDB_MODE", "WANDB_API_KEY")} | {"HOME": str(tmp_path)}
    args = [
        "simulate",
        *TWO_PEERS,
        "--out",
        "run.jsonl",
        "--log-to",
        "tensorboard,wandb",
        "--log-dir",
        "logs",
    ]
    done = subprocess.run(CLI + args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "offline: wandb sync" in done.stderr, done.stderr
    run = records(tmp_path / "run.jsonl")
    evals, summary = [r for r in run if r["kind"] == "eval"], run[-1]
    assert [e["step"] for e in evals] == [0, 8, 16, 24]

    (events,) = [p for p in (tmp_path / "logs").iterdir() if p.name != "wandb"]
    board = EventAccumulator(str(events))
    board.Reload()
    ppl = [(s.step, s.value) for s in board.Scalars("eval/val_ppl")]
    assert ppl == [(e["step"], pytest.approx(e["val_ppl"], rel=1e-6)) for e in evals]
    (final,) = board.Scalars("summary/final_val_ppl")
    assert (final.step, final.value) == (24, pytest.approx(summary["final_val_ppl"], rel=1e-6))

    (offline,) = (tmp_path / "logs" / "wandb").glob("offline-run-*/run-*.wandb")
    history, summaries = wandb_records(offline)
    assert [(h["_step"], h["eval/val_ppl"]) for h in history] == [(e["step"], e["val_ppl"]) for e in evals]
    assert summaries["final_val_ppl"] == summary["final_val_ppl"]
    assert summaries["bytes_sent"] == summary["bytes_sent"]


def wandb_records(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The history rows and the summary of an offline W&B run file: a LevelDB-style log (32 KiB
    blocks of CRC-checked chunks) of protobuf records, after a 7-byte W&B header."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    assert raw[:4] == b":W&B"
    block, pos, chunks, history, summary = 32768, 7, b"", [], {}
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        data = raw[pos + 7 : pos + 7 + length]
        if kind == 0:
            break
        assert zlib.crc32(bytes([kind]) + data) == crc
        chunks, pos = chunks + data, pos + 7 + length
        if kind not in (1, 4):  # 1: a whole record, 2-4: its first, middle and last chunks
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunks)
        chunks = b""
        kind_of_record = record.WhichOneof("record_type")
        items = {"history": record.history.item, "summary": record.summary.update}.get(kind_of_record, [])
        values = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}
        if kind_of_record == "history":
            history.append(values)
        elif kind_of_record == "summary":
            summary.update(values)
    return history, summary


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"log_to": "tensorboard,mlflow"}, "unknown --log-to 'mlflow'"),
        ({"log_dir": "logs"}, "--log-dir needs --log-to"),
    ],
)
def test_log_options_are_checked(given: dict[str, str], message: str) -> None:
    with pytest.raises(UserError, match=message):
        build_config({}, given)


def test_a_profile_may_list_both_sinks(tmp_path: Path) -> None:
    profile = tmp_path / "p.toml"
    profile.write_text('log-to = ["wandb", "tensorboard", "wandb"]\n')
    assert build_config(load_toml(profile), {}).log_to == "wandb,tensorboard"
    assert (
        build_config({}, {"log_to": "tensorboard"}).computing_options()
        == build_config({}, {}).computing_options()
    )


def test_wandb_stays_offline_without_a_login(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from p2p_cocodc.ops.sinks import wandb_mode

    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert wandb_mode() == "offline"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password KEY\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"


def test_a_missing_package_is_one_line_naming_its_extra(tmp_path: Path) -> None:
    """Where wandb is not installed (here: an import of it fails first on the path), --log-to wandb
    stops before any set-up with the pip extra to install."""
    shadow = tmp_path / "shadow" / "wandb"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'wandb'\")\n")
    env = {**ENV, "PYTHONPATH": f"{shadow.parent}{os.pathsep}{ENV['PYTHONPATH']}"}
    args = ["simulate", *TWO_PEERS, "--log-to", "wandb", "--out", "run.jsonl"]
    done = subprocess.run(CLI + args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: --log-to wandb needs the wandb package (No module named 'wandb'): pip install -e '.[wandb]'"
    ], done.stderr
    assert not (tmp_path / "run.jsonl").exists()


def test_a_profile_may_hold_the_metrics_port() -> None:
    from p2p_cocodc.config.join import swarm_options

    opts = swarm_options({"bootstrap": "127.0.0.1:31338", "metrics-port": 9101}, {})
    assert opts.metrics_port == 9101
    assert swarm_options({"bootstrap": "127.0.0.1:31338"}, {"metrics_port": 9102}).metrics_port == 9102
    with pytest.raises(UserError, match="--port and --metrics-port are both 9101"):
        swarm_options({"bootstrap": "127.0.0.1:31338", "metrics-port": 9101, "port": 9101}, {})
