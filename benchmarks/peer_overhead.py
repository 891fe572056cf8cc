"""Peer overhead: training throughput with the swarm exchanging in the background ÷ without it.

Both sides run the same peer program (``p2p-cocodc join``), three processes at a time on
127.0.0.1, so they compete for the same cores. "swarm": three peers of one run (--workers 3)
averaging fragments over libp2p. "solo": three independent one-peer runs (--workers 1), the same
training loop with nothing to exchange. Throughput is the peer's own ``tokens_per_s`` (training
tokens over wall time without evaluation; stalls waiting for the network count against it). Each
repeat runs both sides back to back, alternating which goes first; the report gives per-repeat
ratios and their median, and writes docs/performance.md.

    python benchmarks/peer_overhead.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.report import write_section  # noqa: E402

CLI = [sys.executable, "-m", "p2p_cocodc"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
PEERS = 3


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_bootstrap(workdir: Path) -> tuple[subprocess.Popen, str]:
    status = free_port()
    address = workdir / "bootstrap.json"
    proc = subprocess.Popen(
        CLI
        + ["bootstrap", "--port", str(free_port()), "--status-port", str(status)]
        + ["--identity", str(workdir / "b.id"), "--address-file", str(address)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=ENV,
    )
    deadline = time.monotonic() + 60
    while not address.exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("the bootstrap did not start")
        time.sleep(0.2)
    return proc, f"127.0.0.1:{status}"


def run_peers(mode: str, repeat: int, training: list[str], bootstrap: str, workdir: Path) -> list[float]:
    """Three peers at once; returns each one's tokens per second."""
    procs = []
    outs = []
    for i in range(PEERS):
        if mode == "swarm":
            extra = ["--workers", str(PEERS), "--shard", f"{i}/{PEERS}", "--run-id", f"swarm-{repeat}"]
        else:
            extra = ["--workers", "1", "--run-id", f"solo-{repeat}-{i}"]
        out = workdir / f"{mode}-{repeat}-{i}.jsonl"
        outs.append(out)
        cmd = CLI + ["join", "--bootstrap", bootstrap, *training, *extra, "--out", str(out), "--quiet"]
        log = open(workdir / f"{mode}-{repeat}-{i}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append(
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=ENV)
        )
    try:
        for proc in procs:
            if proc.wait(timeout=1800) != 0:
                raise RuntimeError(f"a {mode} peer failed; see {workdir}")
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return [json.loads(out.read_text().splitlines()[-1])["tokens_per_s"] for out in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=192)
    parser.add_argument("--model", default="micro")
    parser.add_argument("--algo", default="cocodc")
    args = parser.parse_args()
    training = [
        "--algo", args.algo, "--model", args.model, "--steps", str(args.steps), "--inner-steps", "48",
        "--fragments", "4", "--overlap", "12", "--eval-every", str(args.steps), "--eval-batches", "2",
        "--threads", "1",
    ]  # fmt: skip
    workdir = Path(tempfile.mkdtemp(prefix="peer-overhead-"))
    boot, address = start_bootstrap(workdir)
    rows = []
    try:
        for repeat in range(args.repeats):
            order = ("swarm", "solo") if repeat % 2 == 0 else ("solo", "swarm")
            tps = {
                mode: statistics.mean(run_peers(mode, repeat, training, address, workdir)) for mode in order
            }
            rows.append((repeat, order[0], tps["swarm"], tps["solo"], tps["swarm"] / tps["solo"]))
            print(f"repeat {repeat}: swarm {tps['swarm']:.0f} tok/s, solo {tps['solo']:.0f} tok/s, "
                  f"ratio {rows[-1][4]:.3f}", flush=True)  # fmt: skip
    finally:
        os.killpg(boot.pid, signal.SIGTERM)
        boot.wait(timeout=30)
    write_report(rows, args, training)


def write_report(rows: list[tuple], args: argparse.Namespace, training: list[str]) -> None:
    median = statistics.median(r[4] for r in rows)
    command = f"python benchmarks/peer_overhead.py --repeats {args.repeats} --steps {args.steps}"
    if args.model != "micro" or args.algo != "cocodc":
        command += f" --model {args.model} --algo {args.algo}"
    table = "\n".join(f"| {r[0]} | {r[1]} | {r[2]:.0f} | {r[3]:.0f} | {r[4]:.3f} |" for r in rows)
    text = f"""Throughput of a peer training while the swarm averages fragments in the background, divided by
the throughput of the same peer program with nothing to exchange, both measured side by side in
one run: three peers on 127.0.0.1 at a time (this machine: {os.cpu_count()} cores, shared), each
repeat running both sides back to back and alternating which goes first. Throughput is the peer's
`tokens_per_s`: training tokens over wall time minus evaluation; time stalled waiting for a
fragment counts against it.

Reproduce: `{command}`

Training options: `{" ".join(training)}`

| repeat | first | swarm tok/s (mean of 3 peers) | solo tok/s (mean of 3 peers) | ratio |
|---|---|---|---|---|
{table}

**Median ratio: {median:.3f}** (target ≥ 0.95), spread {min(r[4] for r in rows):.3f} to
{max(r[4] for r in rows):.3f} over the repeats: the machine is shared, so single repeats are noisy.
"""
    write_section("Peer overhead", text)
    print(text)


if __name__ == "__main__":
    main()
