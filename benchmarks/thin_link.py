"""Thin links: a real swarm (a bootstrap and three CoCoDC peers) over links shaped to a few Mbit/s.

Needs root (Linux network namespaces; see tests/netns.py). Each run builds its own network: a switch
namespace routing between the peers and holding the bootstrap (on the switch's address,
10.213.0.254), and one namespace per peer (10.213.0.1-3), each linked to the switch by a pair of
TUN devices shaped with tbf to ``--mbps`` Mbit/s in each direction and delayed by a relay so two
peers see ``--rtt-ms`` of round trip (``--profile thin``: 2 Mbit/s, 100 ms). Nothing runs on the
host's interfaces; everything is removed at the end, and a run that passes ``--timeout`` has all its
processes ended.

The peers train the ``small`` preset on bytes (3.24 M parameters, 13 MB in fp32, 4 fragments of
about 3.2 MB: one fragment's all-reduce sends about 4.3 MB from each peer and receives as much).
Per peer the report gives the exit code, the final θ̄ hash, stall, rounds done and failed, wall
time, the last step the bootstrap saw it at, the warnings it logged and its last log lines; and
whether all hashes agree. While the peers run, the benchmark samples every second each peer's TCP
sockets (``ss``: bytes queued to send, smoothed RTT), polls the bootstrap's /status every 2 s and,
at the end, reads tbf's counters (bytes sent, drops). ``--dht-probe`` adds a bystander DHT node in
peer 0's namespace that times a store and a get every 2 s: the same shaped link as peer 0, but its
own libp2p connections, so it tells the link's delay apart from delay inside the peers' connections.

    python benchmarks/thin_link.py --mbps 10 --mbps 2 --steps 192 --dht-probe   # 5-12 minutes
    python benchmarks/thin_link.py --mbps 2 --steps 48 --timeout 300 --workdir runs/thin
    python benchmarks/thin_link.py --mbps 2 --repeat 5 --busy   # one θ̄ every time, a core kept busy
    python benchmarks/thin_link.py --mbps 2 --repeat 3 --busy --undeclared   # as a new user runs it
    python benchmarks/thin_link.py --profile thin --overlap auto --transmissions auto --steps 96
    python benchmarks/thin_link.py --mbps 30 --rtt-ms 100 --narrow-to 2 --steps 480 --undeclared
    python benchmarks/thin_link.py --profile thin --overlap auto --transmissions auto --steps 480 \
        --judge-codec fp32

``--judge-codec C`` replays peer 0's rounds in the simulator (``simulate --events``) with the run's
own codec, which must give the swarm's θ̄, and with C: the perplexity the same schedule reaches with
C, apart from how many syncs the link carried.

``--narrow-to MBIT`` re-shapes every link to MBIT Mbit/s while the peers train, once peer 0 has
settled ``--narrow-after`` rounds; the report then gives each peer's stall before the narrowing,
in the rounds right after it, and over the last third of the run (from its evaluation records).

``--busy`` keeps one core of the host busy beside the peers (as other work on a shared machine
does), ``--repeat N`` runs each rate N times; the last line counts the runs that ended with one θ̄.

Every line a peer prints is kept in WORKDIR/RATE/peerI.log, prefixed with seconds since the peers
were started (likewise bootstrap.log, status.log, dht_probe.log; samples.jsonl holds the socket
samples); the results go to WORKDIR/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import nullcontext, suppress
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.netns import PROFILES, ThinNet, tcp_throughput, thin_network  # noqa: E402
from tests.swarm_procs import busy_core  # noqa: E402

CLI = [sys.executable, "-m", "p2p_cocodc"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
PEERS = 3
BOOT_PORT, STATUS_PORT = 31337, 31338  # inside the switch namespace: nothing else listens there


# Polls the bootstrap's /status every 2 s from the switch namespace: one line of JSON per answer.
STATUS_POLL = """
import json, sys, time, urllib.request
while True:
    try:
        with urllib.request.urlopen(sys.argv[1], timeout=5) as reply:
            print(json.dumps(json.load(reply)), flush=True)
    except Exception as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
    time.sleep(2)
"""


# A bystander DHT node (client mode: nobody stores on it) in a peer's namespace: the same link, but its
# own libp2p connections. It times a store and a get(latest) like a peer's heartbeat, every 2 s.
DHT_PROBE = """
import json, signal, sys, time
import hivemind
from hivemind.utils import get_dht_time
maddrs, host, key = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
dht = hivemind.DHT(initial_peers=maddrs, host_maddrs=[f"/ip4/{host}/tcp/0"], nat_port_map=False,
                   client_mode=True, start=True)
try:
    while True:
        row = {"t": time.time()}
        for what in ("store", "get"):
            start = time.monotonic()
            if what == "store":
                fut = dht.store("p2p-cocodc.thin-probe", {"at": start}, get_dht_time() + 10,
                                subkey=str(dht.peer_id), return_future=True)
            else:
                fut = dht.get(key, latest=True, return_future=True)
            try:
                found = fut.result(timeout=60)
                row[what + "_s"] = round(time.monotonic() - start, 3)
                if what == "get":
                    row["peers_on_board"] = len(found.value) if found is not None else 0
            except Exception as exc:
                row[what + "_s"], row[what + "_error"] = round(time.monotonic() - start, 3), repr(exc)
        print(json.dumps(row), flush=True)
        time.sleep(2)
finally:
    dht.shutdown()
"""


def training_options(args: argparse.Namespace, mbps: float) -> list[str]:
    """The peers' options; each declares its link (--bandwidth-mbps, --latency-ms: half the round
    trip), which its deadlines and 'auto' follow, unless ``--undeclared`` (the defaults, as a new
    user runs them: the link is measured)."""
    declared = (
        [] if args.undeclared else ["--bandwidth-mbps", str(mbps), "--latency-ms", str(args.rtt_ms / 2)]
    )
    syncs = ["--overlap", args.overlap] + (
        ["--transmissions", args.transmissions] if args.transmissions else []
    )
    return [
        "--algo", args.algo, "--model", "small", "--tokenizer", "byte", "--seq-len", "64",
        "--batch-size", "4", "--workers", str(PEERS), "--steps", str(args.steps),
        "--inner-steps", "24", "--fragments", "4", *syncs, "--eval-every", "24",
        "--eval-batches", str(args.eval_batches), "--threads", "1", "--quiet", *declared,
    ] + (["--codec", args.codec] if args.codec else []) + (
        ["--paced-codec", args.paced_codec] if args.paced_codec else []
    ) + (["--data", args.data] if args.data else []) + (
        ["--no-final-sync"] if args.no_final_sync else []
    ) + (["--min-step-time", str(args.min_step_time)] if args.min_step_time else [])  # fmt: skip


def judge_codec(
    args: argparse.Namespace, mbps: float, rundir: Path, summary: dict[str, Any]
) -> dict[str, Any]:
    """Replays peer 0's records (``simulate --events``: the same rounds, members and paces) twice:
    with the run's own codec, which must give the swarm's θ̄ (the swarm ≡ simulator oracle), and
    with ``--judge-codec``, which tells what the same schedule reaches with that codec: the
    codec's cost apart from how many syncs the link carried."""
    resolved = {"overlap": str(summary["overlap"]), "transmissions": str(summary["transmissions"])}
    mine = {**vars(args), **resolved, "codec": None, "paced_codec": None}
    options = training_options(argparse.Namespace(**mine), mbps)
    options += ["--events", str(rundir / "peer0.jsonl")]
    found: dict[str, Any] = {}
    replays = {}
    for name, codec in (("own", args.codec), ("judge", args.judge_codec)):  # side by side: 2 cores
        argv = [*CLI, "simulate", *options, "--out", str(rundir / f"replay-{name}.jsonl")]
        argv += ["--codec", codec] if codec else []
        # the run's paced codec where a pace said so; the judge's codec throughout
        argv += ["--paced-codec", "same" if name == "judge" else args.paced_codec or "auto"]
        replays[name, codec] = subprocess.Popen(
            argv, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
    for (name, codec), proc in replays.items():
        _, err = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            return {"error": f"simulate ({name}) exited {proc.returncode}: {err.strip()[-300:]}"}
        last = records(rundir / f"replay-{name}.jsonl")[-1]
        found[name] = {
            "codec": codec or "default",
            "ppl": last["final_val_ppl"],
            "sha256": last["global_params_sha256"],
        }
    found["reproduced"] = found["own"]["sha256"] == summary["global_params_sha256"]
    found["own_vs_judge"] = round(found["own"]["ppl"] / found["judge"]["ppl"] - 1, 4)
    return found


class Logged:
    """A process whose output lines go to a file, each prefixed with seconds since ``t0``."""

    def __init__(self, net: ThinNet, where: str, argv: list[str], log: Path, t0: float) -> None:
        self.log = log
        self.out: Path | None = None  # a peer's --out records
        self.proc = net.popen_in(
            where, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV, start_new_session=True
        )
        self.started = time.monotonic()
        self.ended: float | None = None
        self.killed = False  # still running after SIGTERM and its grace: SIGKILLed
        self._pump = threading.Thread(target=self._copy, args=(t0,), daemon=True)
        self._pump.start()

    def _copy(self, t0: float) -> None:
        with open(self.log, "w") as out:
            for raw in self.proc.stdout:  # type: ignore[union-attr]
                out.write(f"[{time.monotonic() - t0:7.1f}s] {raw.decode(errors='replace')}")
                out.flush()

    def poll(self) -> int | None:
        code = self.proc.poll()
        if code is not None and self.ended is None:
            self.ended = time.monotonic()
        return code


def start_peer(net: ThinNet, node: Any, argv: list[str], rundir: Path, name: str, t0: float) -> Logged:
    """One peer's process in its namespace: records to RUNDIR/NAME.jsonl, its lines to NAME.log."""
    out = rundir / f"{name}.jsonl"
    out.unlink(missing_ok=True)
    proc = Logged(net, node.ns, [*argv, "--out", str(out)], rundir / f"{name}.log", t0)
    proc.out = out
    return proc


def end_all(procs: list[Logged], grace_s: float = 30.0) -> None:
    """SIGTERM to every main process at once (each shuts hivemind down), SIGKILL to the process
    groups of those still running ``grace_s`` later."""
    for proc in procs:
        if proc.proc.poll() is None:
            with suppress(ProcessLookupError):
                proc.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        with suppress(subprocess.TimeoutExpired):
            proc.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        proc.killed = proc.proc.poll() is None
        with suppress(ProcessLookupError):
            os.killpg(proc.proc.pid, signal.SIGKILL)
    for proc in procs:
        proc.proc.wait(timeout=30)
        proc.poll()
        proc._pump.join(timeout=10)


def hivemind_sockets(net: ThinNet, ns: str) -> set[str]:
    """Paths of hivemind's unix sockets bound by processes in namespace ``ns`` (so: ours)."""
    done = net.run_in(ns, ["cat", "/proc/net/unix"], capture_output=True, text=True)
    fields = (line.split() for line in done.stdout.splitlines()[1:])
    return {f[-1] for f in fields if len(f) >= 8 and Path(f[-1]).name.startswith("hivemind-")}


def remove_dead_sockets(paths: set[str]) -> list[str]:
    """Unlink the socket files among ``paths`` that nobody listens on any more (killed p2pd daemons
    and some hivemind clients leave them in /tmp)."""
    import socket

    removed = []
    for path in sorted(paths):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except FileNotFoundError:
            continue
        except OSError:
            with suppress(OSError):
                os.unlink(path)
                removed.append(path)
        finally:
            probe.close()
    return removed


def sample_sockets(net: ThinNet, node_ns: str) -> list[dict[str, Any]]:
    """Established TCP sockets of a namespace: peer address, bytes queued to send, smoothed RTT."""
    done = net.run_in(node_ns, ["ss", "-tinH", "state", "established"], capture_output=True, text=True)
    found = []
    lines = done.stdout.splitlines()
    for i, line in enumerate(lines):
        fields = line.split()
        if len(fields) >= 4 and fields[0].isdigit():  # Recv-Q Send-Q Local Peer
            info = lines[i + 1] if i + 1 < len(lines) else ""
            rtt = re.search(r"\brtt:([\d.]+)/", info)
            found.append(
                {
                    "local": fields[2],
                    "peer": fields[3],
                    "send_q": int(fields[1]),
                    "rtt_ms": float(rtt.group(1)) if rtt else None,
                }
            )
    return found


def tbf_counters(net: ThinNet, ns: str) -> dict[str, dict[str, int]]:
    done = subprocess.run(["tc", "-s", "-n", ns, "qdisc", "show"], capture_output=True, text=True)
    counters, dev = {}, None
    for line in done.stdout.splitlines():
        head = re.match(r"qdisc tbf \S+ dev (\S+)", line)
        if head:
            dev = head.group(1)
        sent = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+)", line)
        if sent and dev:
            counters[dev] = {"bytes": int(sent.group(1)), "dropped": int(sent.group(3))}
            dev = None
    return counters


def code_version() -> dict[str, Any]:
    """The commit the peers run, and the package files that differ from it (the working tree is what runs)."""

    def git(*argv: str) -> str:
        done = subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.rstrip()  # not strip(): a status line starts with a space

    changed = git("status", "--short", "--", "p2p_cocodc").splitlines()
    return {"commit": git("rev-parse", "--short", "HEAD"), "changed": [line[3:] for line in changed]}


def timed_lines(path: Path) -> list[dict[str, Any]]:
    """JSON lines of a Logged process, each with "at": seconds since the peers were started."""
    rows = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            stamp, _, text = line.partition("] ")
            with suppress(ValueError):
                row = json.loads(text)
                if isinstance(row, dict):
                    rows.append({"at": float(stamp.strip("[ s")), **row})
    return rows


def board_history(path: Path) -> dict[int, tuple[float, int]]:
    """Per shard, when the bootstrap's /status last listed that peer's record, and at which step."""
    last: dict[int, tuple[float, int]] = {}
    for row in timed_lines(path):
        for record in row.get("runs", {}).get("thin", {}).get("peers", {}).values():
            last[record["shard"]] = (row["at"], record["step"])
    return last


def off_board(path: Path, shard: int, alive_until: float) -> tuple[float, int]:
    """From the bootstrap's /status samples (every 2 s): the longest time this peer's record was
    missing from the board while its process still ran, after it first appeared (the last 4 s
    before its exit are left out: a record may lag a peer's end), and how many samples missed it."""
    rows = [r for r in timed_lines(path) if "runs" in r]
    seen = [
        (
            r["at"],
            any(rec.get("shard") == shard for rec in r["runs"].get("thin", {}).get("peers", {}).values()),
        )
        for r in rows
    ]
    first = next((at for at, here in seen if here), None)
    if first is None:
        return 0.0, 0
    longest, missing, since = 0.0, 0, None
    for at, here in seen:
        if at <= first or at > alive_until - 4:
            continue
        if here:
            since = None
            continue
        missing += 1
        since = at if since is None else since
        longest = max(longest, at - since + 2.0)  # each sample stands for 2 s
    return round(longest, 1), missing


PUBLISH_LINE = re.compile(r"board publish: ([\d.]+) s, (ok|failed)")


def publish_latency(log_lines: list[str]) -> dict[str, Any]:
    """Percentiles of the peer's own board publishes, from its ``board publish:`` log lines."""
    found = [PUBLISH_LINE.search(line) for line in log_lines]
    took = sorted(float(m.group(1)) for m in found if m)
    if not took:
        return {"n": 0}

    def pct(q: float) -> float:
        return took[min(len(took) - 1, int(q * len(took)))]

    failed = sum(1 for m in found if m and m.group(2) == "failed")
    return {
        "n": len(took),
        "p50": pct(0.5),
        "p90": pct(0.9),
        "p99": pct(0.99),
        "max": took[-1],
        "failed": failed,
    }


def records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with suppress(ValueError):
            out.append(json.loads(line))
    return out


def exchange_goodput(summary: dict[str, Any] | None, mbps: float) -> dict[str, Any]:
    """One peer's exchange goodput ÷ shaped bandwidth (docs/hivemind-baseline.md, "Definitions"): the
    payload bytes its rounds sent ÷ (the link's rate × the time those rounds took): ``ratio`` from
    this peer reaching each round to its holding the average (the other members' arrival included),
    ``butterfly_ratio`` from the group's adoption (every member there) to the average."""
    summary = summary or {}
    rounds, mean = summary.get("rounds_done") or 0, summary.get("mean_round_s") or 0.0
    sent, seconds = summary.get("bytes_sent") or 0, rounds * mean
    butterfly_s = (summary.get("butterflies") or 0) * (summary.get("mean_butterfly_s") or 0.0)
    rate = mbps * 1e6 / 8

    def ratio(s: float) -> float | None:
        return round(sent / (rate * s), 3) if s else None

    return {
        "rounds": rounds,
        "round_s": round(seconds, 1),
        "butterfly_s": round(butterfly_s, 1),
        "bytes": sent,
        "ratio": ratio(seconds),
        "butterfly_ratio": ratio(butterfly_s),
    }


def stall_shares(
    evals: list[dict[str, Any]], narrowed: dict | None, steps: int, closing_s: float = 0.0
) -> dict[str, float]:
    """A peer's stalled share of wall time from its evaluation records: before the links narrowed,
    from then on, and over the run's last third (``whole`` without a narrowing). ``closing_s``: the
    closing rounds' time (--final-sync), in the last evaluation's wall time but after training."""

    def share(lo: int, hi: int) -> float:
        inside = [e for e in evals if lo <= e["step"] <= hi]
        if len(inside) < 2:
            return float("nan")
        first, last = inside[0], inside[-1]
        wall = last["wall_time_s"] - first["wall_time_s"] - (closing_s if last["step"] == steps else 0.0)
        return round((last["stall_s"] - first["stall_s"]) / wall, 3) if wall > 0 else float("nan")

    if narrowed is None:
        return {"whole": share(0, steps), "last_third": share(steps * 2 // 3, steps)}
    at = narrowed["after_step"]
    return {"before": share(0, at), "after": share(at, steps), "last_third": share(steps * 2 // 3, steps)}


def reached(evals: list[dict[str, Any]], levels: list[float]) -> dict[str, float | None]:
    """The wall time (s since the peer's training started) of its first evaluation of θ̄ at or below
    each perplexity of ``levels`` (None: never), for runs compared by time to a perplexity."""
    return {
        f"{level:g}": next((e["wall_time_s"] for e in evals if e["val_ppl"] <= level), None)
        for level in levels
    }


def notable(log: Path) -> list[str]:
    """Warning and error lines of a peer's log (hivemind's and ours), without repeats of one text."""
    seen, kept = set(), []
    for line in log.read_text(errors="replace").splitlines():
        if re.search(r"\bWARN|ERROR|error:|Traceback|Exception", line):
            key = re.sub(r"\d+(\.\d+)?", "#", line.split("] ", 1)[-1])
            if key not in seen:
                seen.add(key)
                kept.append(line)
    return kept


def run_rate(mbps: float, args: argparse.Namespace, workdir: Path, name: str) -> dict[str, Any]:
    rundir = workdir / name
    rundir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "mbps": mbps,
        "rtt_ms": args.rtt_ms,
        "steps": args.steps,
        "timeout_s": args.timeout,
    }
    result["code"] = code_version()
    with thin_network(PEERS, mbps, rtt_ms=args.rtt_ms, latency_ms=args.queue_ms) as net:
        a, b = net.nodes[0], net.nodes[1]
        measured, _ = tcp_throughput(net, a, b, int(mbps * 1e6 / 8 * 2))  # about 2 s of traffic
        result["link_measured_mbps"] = round(measured, 2)
        print(f"[{mbps:g} Mbit/s] link check: {measured:.2f} Mbit/s TCP goodput {a.address} -> {b.address}")
        t0 = time.monotonic()
        boot_argv = CLI + ["bootstrap", "--host", net.switch_address, "--port", str(BOOT_PORT)]
        boot_argv += ["--status-port", str(STATUS_PORT), "--identity", str(rundir / "bootstrap.id")]
        boot_argv += ["--address-file", str(rundir / "bootstrap.json")]
        (rundir / "bootstrap.json").unlink(missing_ok=True)
        boot = Logged(net, net.switch, boot_argv, rundir / "bootstrap.log", t0)
        status_url = f"http://{net.switch_address}:{STATUS_PORT}/status"
        peers: list[Logged] = []
        status: Logged | None = None
        probe: Logged | None = None
        cut: list[Logged] = []
        argvs: list[list[str]] = []
        crashed: list[Logged] = []
        samples: list[dict[str, Any]] = []
        sockets: set[str] = set()
        try:
            deadline = time.monotonic() + 60
            while not (rundir / "bootstrap.json").exists():
                if boot.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the bootstrap did not start; see {rundir / 'bootstrap.log'}")
                time.sleep(0.2)
            joining = f"{net.switch_address}:{STATUS_PORT}"
            for node in net.nodes:
                argv = CLI + ["join", "--bootstrap", joining, "--host", node.address, "--run-id", "thin"]
                argv += ["--shard", f"{node.index}/{PEERS}", *training_options(args, mbps)]
                argv += ["--identity", str(rundir / f"peer{node.index}.id")]  # a restart keeps its id
                argv += ["--verbose"] if args.verbose else []
                argvs.append(argv)
                peers.append(start_peer(net, node, argv, rundir, f"peer{node.index}", t0))
            result["peer_command"] = " ".join(["ip netns exec NS python", *argv[1:]])
            result["bootstrap_command"] = " ".join(["ip netns exec SWITCH python", *boot_argv[1:]])
            status = Logged(
                net, net.switch, [sys.executable, "-c", STATUS_POLL, status_url], rundir / "status.log", t0
            )
            if args.dht_probe:
                maddrs = json.loads((rundir / "bootstrap.json").read_text())["maddrs"]
                probe_argv = [sys.executable, "-c", DHT_PROBE, json.dumps(maddrs), a.address]
                probe_argv.append("p2p-cocodc.thin.peers")
                probe = Logged(net, a.ns, probe_argv, rundir / "dht_probe.log", t0)
            started = time.monotonic()
            timed_out = False
            narrowing = args.narrow_to is not None
            while [p.poll() for p in peers].count(None):  # polls each: its end time is kept
                settled = [r for r in records(rundir / "peer0.jsonl") if r.get("kind") == "round"]
                if narrowing and len(settled) >= args.narrow_after:
                    net.reshape(args.narrow_to)
                    narrowing = False
                    result["narrowed"] = {
                        "to_mbps": args.narrow_to,
                        "t": round(time.monotonic() - t0, 1),
                        "after_step": max(r["step"] for r in settled),
                    }
                    print(f"[{mbps:g} Mbit/s] narrowed to {args.narrow_to:g} Mbit/s after step "
                          f"{result['narrowed']['after_step']}")  # fmt: skip
                if args.crash_after is not None and not crashed and len(settled) >= args.crash_after:
                    crashed.append(peers[-1])
                    os.killpg(peers[-1].proc.pid, signal.SIGKILL)
                    peers[-1].proc.wait(timeout=30)
                    peers[-1].poll()
                    node = net.nodes[-1]
                    peers[-1] = start_peer(net, node, argvs[-1], rundir, f"peer{node.index}-returned", t0)
                    result["crashed"] = {
                        "t": round(time.monotonic() - t0, 1),
                        "after_step": max(r["step"] for r in settled),
                    }
                    print(f"[{mbps:g} Mbit/s] peer {node.index} SIGKILLed after peer 0's step "
                          f"{result['crashed']['after_step']} and started again")  # fmt: skip
                if time.monotonic() - started > args.timeout:
                    timed_out = True
                    cut = [p for p in peers if p.poll() is None]
                    break
                tick = {"t": round(time.monotonic() - t0, 1)}
                for node in net.nodes:
                    tick[node.address] = sample_sockets(net, node.ns)
                for ns in net.namespaces:
                    sockets |= hivemind_sockets(net, ns)
                samples.append(tick)
                time.sleep(1.0)
            result["timed_out"] = timed_out
            result["tbf"] = {ns: tbf_counters(net, ns) for ns in [net.switch] + [n.ns for n in net.nodes]}
        finally:
            end_all([*peers, *(p for p in (status, probe) if p), boot])
            for proc in crashed:
                proc._pump.join(timeout=10)
            result["removed_sockets"] = remove_dead_sockets(sockets)
        (rundir / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
        board = board_history(rundir / "status.log")
        result["dht_probe"] = timed_lines(rundir / "dht_probe.log")
        result["peers"] = []
        for node, proc in zip(net.nodes, peers, strict=True):
            recs = records(proc.out)
            summary = next((r for r in recs if r.get("kind") == "summary"), None)
            evals = [r for r in recs if r.get("kind") == "eval"]
            log_lines = proc.log.read_text(errors="replace").splitlines()
            code = proc.proc.returncode
            peer_send_q = [
                max((s["send_q"] for s in tick[node.address]), default=0)
                for tick in samples
                if node.address in tick
            ]
            result["peers"].append(
                {
                    "peer": node.index,
                    "address": node.address,
                    "exit_code": (
                        f"cut at timeout, {'SIGKILLed' if proc.killed else code}" if proc in cut else code
                    ),
                    "wall_s": round((proc.ended or time.monotonic()) - proc.started, 1),
                    "sha256": summary["global_params_sha256"] if summary else None,
                    # a peer that failed wrote no summary: its last evaluation, or the step it last published
                    "steps": summary["steps"]
                    if summary
                    else max([e["step"] for e in evals] + [board.get(node.index, (0, 0))[1]]),
                    "stall_s": round((summary or (evals[-1] if evals else {})).get("stall_s", 0.0), 1),
                    "stall_shares": stall_shares(
                        evals, result.get("narrowed"), args.steps, (summary or {}).get("final_sync_s") or 0.0
                    ),
                    "final_sync_s": (summary or {}).get("final_sync_s"),
                    "sync_landing_s": (summary or {}).get("sync_landing_s") or {},
                    "reached": reached(evals, args.reach),
                    "rounds_done": summary.get("rounds_done") if summary else None,
                    "rounds_failed": summary.get("rounds_failed") if summary else None,
                    "final_val_ppl": summary.get("final_val_ppl") if summary else None,
                    "bytes_sent": (summary or (evals[-1] if evals else {})).get("bytes_sent"),
                    "goodput": exchange_goodput(summary, mbps),
                    "max_send_q": max(peer_send_q, default=0),
                    # from the log, for a peer that wrote no summary: rounds it saw a group for, and
                    # fragment syncs it logged as failed
                    "groups_logged": len(set(re.findall(r"round (f\d+:\d+): group", "\n".join(log_lines)))),
                    "syncs_failed_logged": sum(
                        "failed (" in x and "sync of fragment" in x for x in log_lines
                    ),
                    "publish": publish_latency(log_lines),
                    # longest time (s) and /status samples its record was off the bootstrap's board
                    # while the peer ran; and how often this peer declared another member gone
                    "off_board": off_board(
                        rundir / "status.log", node.index, (proc.ended or time.monotonic()) - t0
                    ),
                    "gone_claims": sum("is gone" in x for x in log_lines),
                    # rounds it could not learn the outcome of (a silent peer on the board): resynced
                    "undecided": sum("may hold the average" in x for x in log_lines),
                    "lost_dht": any("lost the swarm's DHT" in x for x in log_lines),
                    # (seconds since start, step) of the last time the bootstrap saw its record
                    "last_on_board": board.get(node.index),
                    "notable": notable(proc.log)[:40],
                    # a peer started again (--crash-after): how it took the swarm's state
                    "took_state": next((x for x in log_lines if "took the swarm's state" in x), None),
                    "last_lines": log_lines[-args.tail :],
                }
            )
    hashes = {p["sha256"] for p in result["peers"]}
    result["hashes_equal"] = len(hashes) == 1 and None not in hashes
    first = records(rundir / "peer0.jsonl")
    settled = [r for r in first if r["kind"] == "round" and r["completed"]]
    # peer 0's completed rounds in send order: (sent after step, agreed pace, codec its payloads took)
    result["rounds"] = sorted((int(r["round"].split(":")[1]), r["pace"], r.get("codec")) for r in settled)
    if args.judge_codec and first and first[-1]["kind"] == "summary":
        result["judged"] = judge_codec(args, mbps, rundir, first[-1])
    return result


def report(result: dict[str, Any]) -> str:
    lines = [
        f"### {result['mbps']:g} Mbit/s (measured {result['link_measured_mbps']} Mbit/s), "
        f"{result.get('rtt_ms', 0):g} ms round trip, "
        f"{result['steps']} steps, timed out: {result['timed_out']}, hashes equal: {result['hashes_equal']}; "
        f"code {result['code']['commit']}{' + changes' if result['code']['changed'] else ''}",
        "",
        "| peer | exit | steps | θ̄ sha256 | stall s | rounds done / failed | wall s | max send-Q "
        "| on board until | off board while alive (longest s / samples) | 'is gone' claims "
        "| board publish p50 / p90 / p99 / max s (n, failed) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["peers"]:
        sha = p["sha256"][:16] if p["sha256"] else "—"
        if p["rounds_done"] is not None:
            rounds = f"{p['rounds_done']} / {p['rounds_failed']}"
        else:  # no summary: what its log says
            rounds = f"({p['groups_logged']} formed / {p['syncs_failed_logged']} failed)"
        board = p["last_on_board"]
        seen = f"{board[0]:.0f} s (step {board[1]})" if board else "—"
        pub = p["publish"]
        publish = (
            f"{pub['p50']:.2f} / {pub['p90']:.2f} / {pub['p99']:.2f} / {pub['max']:.2f} "
            f"({pub['n']}, {pub['failed']})"
            if pub["n"]
            else "—"
        )
        lines.append(
            f"| {p['peer']} | {p['exit_code']} | {p['steps']} | {sha} | {p['stall_s']} | {rounds} | "
            f"{p['wall_s']} | {p['max_send_q']} | {seen} | {p['off_board'][0]} / {p['off_board'][1]} | "
            f"{p['gone_claims']} | {publish}{' | lost the DHT' if p['lost_dht'] else ''} |"
        )
    probe = result.get("dht_probe") or []
    if probe:
        for what in ("store", "get"):
            took = sorted(r[f"{what}_s"] for r in probe if f"{what}_s" in r)
            failed = sum(f"{what}_error" in r for r in probe)
            lines.append(
                f"\nbystander DHT {what}: {len(took)} calls, median {took[len(took) // 2]:.2f} s, "
                f"max {took[-1]:.2f} s, {failed} failed"
            )
    if "narrowed" in result:
        n = result["narrowed"]
        lines.append(
            f"\nnarrowed to {n['to_mbps']:g} Mbit/s at {n['t']} s, after peer 0's step {n['after_step']}"
        )
    if "crashed" in result:
        c, took = result["crashed"], result["peers"][-1]["took_state"] or "it took no state"
        lines.append(f"\npeer {PEERS - 1} SIGKILLed at {c['t']} s, after peer 0's step {c['after_step']}, "
                     f"and started again: {took}")  # fmt: skip
    lines.append("exchange goodput ÷ shaped bandwidth: " + ", ".join(
        f"peer {p['peer']} {g['ratio']} ({g['bytes'] / 1e6:.2f} MB, {g['rounds']} rounds, {g['round_s']} s; "
        f"{g['butterfly_ratio']} over the butterflies' own {g['butterfly_s']} s)"
        for p in result["peers"] if (g := p["goodput"])["ratio"] is not None
    ))  # fmt: skip
    lines.append("stalled share of wall time, by part of the run: " + "; ".join(
        f"peer {p['peer']} " + ", ".join(f"{k} {v:.1%}" for k, v in p["stall_shares"].items())
        for p in result["peers"]
    ))  # fmt: skip
    if any(p.get("final_sync_s") is not None for p in result["peers"]):
        lines.append("closing rounds after the last step (--final-sync), s: " + ", ".join(
            f"peer {p['peer']} {p['final_sync_s'] or 0:.1f}" for p in result["peers"]
        ))  # fmt: skip
    if any(p["sync_landing_s"] for p in result["peers"]):
        lines.append("syncs' landing time (send to result, the wait for the others left out), median of the "
                     "last 8, s: " + ", ".join(
            f"peer {p['peer']} " + " ".join(f"{c} {v:.2f}" for c, v in p["sync_landing_s"].items())
            for p in result["peers"]
        ))  # fmt: skip
    if result["peers"] and (first := result["peers"][0]["reached"]):
        lines.append("peer 0's θ̄ first evaluated at or below (--reach), wall s: " + ", ".join(
            f"ppl {level}: {'never' if t is None else f'{t:.1f}'}" for level, t in first.items()
        ))  # fmt: skip
    lines.append("peer 0's rounds (sent after step: pace agreed, codec): " + ", ".join(
        f"{step}: {pace} {codec}" for step, pace, codec in result["rounds"]
    ))  # fmt: skip
    if judged := result.get("judged"):
        lines.append(
            judged["error"]
            if "error" in judged
            else f"same schedule in the simulator (peer 0's records): {judged['own']['codec']} ppl "
            f"{judged['own']['ppl']:.3f} (the swarm's θ̄: {'yes' if judged['reproduced'] else 'NO'}), "
            f"{judged['judge']['codec']} ppl {judged['judge']['ppl']:.3f}: {judged['own_vs_judge']:+.2%}"
        )
    for p in result["peers"]:
        lines += ["", f"peer {p['peer']}: warnings and errors", *("    " + x for x in p["notable"][:12])]
        lines += [f"peer {p['peer']}: last lines", *("    " + x for x in p["last_lines"])]
    return "\n".join(lines)


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """This script's options (``argv``: the command line's by default), a ``--profile``'s link applied."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mbps", type=float, action="append", help="link rate; repeat for several runs")
    parser.add_argument("--steps", type=int, default=96, help="inner steps per peer")
    parser.add_argument("--timeout", type=float, default=480.0, help="seconds before a run's peers are ended")
    parser.add_argument("--algo", default="cocodc")
    parser.add_argument("--data", help="the peers' --data (default: theirs, the embedded corpus)")
    parser.add_argument("--codec", default=None, help="the peers' --codec (default: theirs, fp4)")
    parser.add_argument("--no-final-sync", action="store_true", help="the peers end without closing rounds")
    parser.add_argument(
        "--paced-codec", default=None, help="the peers' --paced-codec (default: theirs, auto: q2 while paced)"
    )
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="round trip between two peers (the relay)")
    parser.add_argument(
        "--profile", choices=sorted(PROFILES), help="a named link: sets --mbps and --rtt-ms (tests/netns.py)"
    )
    parser.add_argument("--overlap", default="12", help="the peers' --overlap (a number, or auto)")
    parser.add_argument("--transmissions", help="the peers' --transmissions (a number, or auto; default K)")
    parser.add_argument("--queue-ms", type=float, default=50.0, help="tbf latency: longest wait in a queue")
    parser.add_argument("--tail", type=int, default=8, help="last log lines to report per peer")
    parser.add_argument(
        "--reach",
        type=float,
        nargs="*",
        default=[],
        help="perplexities: report when peer 0's θ̄ was first evaluated at or below each (wall s)",
    )
    parser.add_argument("--no-verbose", dest="verbose", action="store_false", help="join without --verbose")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each rate")
    parser.add_argument("--busy", action="store_true", help="keep one core busy beside the peers")
    parser.add_argument(
        "--min-step-time",
        type=float,
        default=0.0,
        help="the peers' --min-step-time: steps no shorter than this, so that three peers' training "
        "leaves this machine's CPU to their syncs, as regions on machines of their own do",
    )
    parser.add_argument(
        "--eval-batches",
        type=int,
        default=2,
        help="validation batches in each peer's evaluations (and the replays'): 2 keeps them cheap; "
        "more to compare final perplexities within 1 %%",
    )
    parser.add_argument("--undeclared", action="store_true", help="peers do not declare their link rate")
    parser.add_argument("--narrow-to", type=float, help="re-shape the links to this many Mbit/s mid-run")
    parser.add_argument(
        "--narrow-after", type=int, default=4, help="rounds peer 0 settles before --narrow-to"
    )
    parser.add_argument(
        "--crash-after",
        type=int,
        help="SIGKILL the last peer once peer 0 has settled this many rounds, and start it again at once",
    )
    parser.add_argument(
        "--judge-codec",
        help="after each run, replay peer 0's rounds in the simulator with this codec too (e.g. fp32)",
    )
    parser.add_argument(
        "--dht-probe",
        action="store_true",
        help="also time DHT calls from a bystander node in peer 0's namespace (own connections, same link)",
    )
    args = parser.parse_args(argv)
    if args.profile:
        args.rtt_ms = PROFILES[args.profile].rtt_ms
        args.mbps = [PROFILES[args.profile].mbit]
    return args


def main() -> None:
    args = arguments()
    rates = args.mbps or [10.0, 2.0]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="thin-link-"))
    workdir.mkdir(parents=True, exist_ok=True)
    # SIGTERM (or a CI timeout) must still end the peers and remove the namespaces
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = []
    with busy_core() if args.busy else nullcontext():
        for mbps in rates:
            for run in range(args.repeat):
                name = f"{mbps:g}mbit" + (f"-{run + 1}" if args.repeat > 1 else "")
                results.append({**run_rate(mbps, args, workdir, name), "busy_core": args.busy})
                print(report(results[-1]), flush=True)
                (workdir / "results.json").write_text(json.dumps(results, indent=1))
    one = sum(r["hashes_equal"] for r in results)
    clean = sum(r["hashes_equal"] and all(p["exit_code"] == 0 for p in r["peers"]) for r in results)
    print(f"\none θ̄ at the end in {one} of {len(results)} runs, every peer exiting 0 in {clean}")
    print(f"logs, samples and results.json in {workdir}")


if __name__ == "__main__":
    main()
