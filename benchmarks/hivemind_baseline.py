"""Side by side with the nearest peer: hivemind's own ``hivemind.Optimizer`` with local updates
(``use_local_updates=True``, its DiLoCo-like mode) against our swarm, on the same model, data, three
peers and shaped links (issue 21, part 6).

Needs root (Linux network namespaces; tests/netns.py). Each system gets its own fresh network of
``--profile`` links (``thin``: 2 Mbit/s each way, 100 ms between two peers), a bootstrap in the switch
namespace and one peer per node namespace:

- **ours**: ``p2p-cocodc bootstrap`` and three ``p2p-cocodc join`` peers with the options of
  ``benchmarks/thin_link.py`` (``small``, bytes, cocodc H = 24, K = 4, ``--codec`` default fp4,
  ``--overlap auto --transmissions auto``, the link declared);
- **hivemind**: a bootstrap ``hivemind.DHT`` and three workers of this script (``--worker``). Each
  builds the model, its data shard, AdamW and the validation batches with our own builder
  (``TrainingSetup``, as a peer does), so it trains exactly our model on exactly our shard with our
  inner optimizer (AdamW, warmup + cosine LR per step, gradient clipping), and wraps that AdamW in
  ``hivemind.Optimizer(use_local_updates=True)``. ``target_batch_size`` = peers × H × batch size, so a
  hivemind epoch (one averaging of all parameters) comes every H inner steps per peer, the interval at
  which a cocodc peer syncs each fragment before its pace widens. It evaluates its own parameters
  with our evaluation on the same held-out batches every 24 steps and at its end.

Both train as many samples as ``--steps`` inner steps of every peer (hivemind: ⌈steps / H⌉ epochs, each
peer stopping once the swarm has moved past the last one); ``--our-steps`` runs ours for more. Then
a short run of each on loopback (every process in one namespace, on 127.0.0.1: no shaping) times
join → first inner step there.

Measured for each system: every peer's evaluation curve (val perplexity against seconds since its
training started); join → first inner step (the harness starting the process → the peer's step-0
evaluation record, written just before its first step; polled every 50 ms); bytes on the wire from
tbf's counters (each node's uplink, sampled every second from just before the bootstrap starts);
and the exchange's goodput ÷ shaped bandwidth (definitions in docs/hivemind-baseline.md). The headline
ratio: the wall time at which our evaluation curve first reaches hivemind's final perplexity ÷
hivemind's training wall time.

    python benchmarks/hivemind_baseline.py --profile thin --steps 96 --our-steps 96 --our-steps 480  # 8 min
    python benchmarks/hivemind_baseline.py --only loopback                 # join times only, 1 minute
    python benchmarks/hivemind_baseline.py --only links --delay-state-averaging   # hivemind's default

Every process it starts is in its own process group and is ended at the end (also on a timeout, an
error or SIGTERM); the namespaces are removed. Logs and records go to WORKDIR/{ours-N,hivemind,
loopback-ours,loopback-hivemind}/, the results and the table to WORKDIR/results.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# The harness's helpers; a hivemind peer of this script (--worker) starts without them, as fast as it can.
HELPER = "--worker" in sys.argv or "--dht-bootstrap" in sys.argv
if not HELPER:
    from thin_link import (  # noqa: E402
        BOOT_PORT,
        CLI,
        STATUS_PORT,
        Logged,
        code_version,
        end_all,
        exchange_goodput,
        hivemind_sockets,
        notable,
        records,
        remove_dead_sockets,
        tbf_counters,
        training_options,
    )

    from p2p_cocodc.ops.compare import crossing  # noqa: E402
    from tests.netns import PROFILES, NetnsUnavailable, ThinNet, tcp_throughput, thin_network  # noqa: E402

SCRIPT = [sys.executable, str(Path(__file__).resolve())]
PEERS = 3  # as benchmarks/thin_link.py runs them
H, BATCH, EVAL_EVERY = 24, 4, 24  # thin_link.training_options: --inner-steps, --batch-size, --eval-every
RUN_ID = "hmbase"


# ---------------------------------------------------------------- the hivemind side (in a namespace)


def dht_bootstrap(host: str, address_file: Path) -> None:
    """A bootstrap hivemind DHT on ``host`` (the switch): writes its maddrs, then serves until SIGTERM."""
    from p2p_cocodc.swarm.dht import install_pdeathsig

    install_pdeathsig()
    import hivemind

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    dht = hivemind.DHT(host_maddrs=[f"/ip4/{host}/tcp/0"], nat_port_map=False, start=True)
    try:
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        address_file.write_text(json.dumps({"maddrs": maddrs}))
        print(f"hivemind bootstrap DHT at {maddrs}", flush=True)
        stop.wait()
    finally:
        dht.shutdown()


def uplink_tx_bytes() -> int:
    """Bytes sent by this namespace's one interface that is not lo (its shaped uplink)."""
    with open("/proc/net/dev") as dev:
        for line in dev.read().splitlines()[2:]:
            name, _, counters = line.partition(":")
            if name.strip() != "lo":
                return int(counters.split()[8])
    return 0


class AveragingWatch(threading.Thread):
    """Polls the state averager's lock every 20 ms: each interval it is held (the all-reduce of one
    averaging round, group already found) with the uplink bytes sent meanwhile."""

    def __init__(self, averager: Any, t0: float) -> None:
        super().__init__(daemon=True)
        self.averager, self.t0 = averager, t0
        self.rounds: list[dict[str, float]] = []
        self.done = threading.Event()

    def run(self) -> None:
        held: tuple[float, int] | None = None
        while not self.done.is_set():
            busy = self.averager.averaging_in_progress
            if busy and held is None:
                held = (time.perf_counter(), uplink_tx_bytes())
            elif not busy and held is not None:
                start, sent = held
                self.rounds.append(
                    {
                        "start_s": round(start - self.t0, 2),
                        "seconds": round(time.perf_counter() - start, 3),
                        "uplink_bytes": uplink_tx_bytes() - sent,
                    }
                )
                held = None
            time.sleep(0.02)


class Cut(BaseException):
    """SIGTERM: the harness's timeout ended the run."""


def worker(args: argparse.Namespace) -> None:
    """One hivemind peer: our model, shard, AdamW and evaluation, under hivemind.Optimizer."""
    from p2p_cocodc.swarm.dht import install_pdeathsig

    install_pdeathsig()  # its DHT, averager and p2pd die with it

    def cut(*_: Any) -> None:
        raise Cut

    signal.signal(signal.SIGTERM, cut)  # the harness's timeout: evaluate what it has, then exit
    import hivemind
    import torch
    from hivemind.compression import Float16Compression, NoCompression

    from p2p_cocodc.config.train import build_config
    from p2p_cocodc.run.setup import TrainingSetup

    cfg = build_config(
        {},
        {
            "model": "small", "tokenizer": "byte", "seq_len": 64, "batch_size": BATCH, "workers": PEERS,
            "steps": args.steps, "inner_steps": H, "eval_every": EVAL_EVERY, "eval_batches": 2, "threads": 1,
        },
    )  # fmt: skip
    setup = TrainingSetup(cfg)
    trainer = setup.trainer()  # a copy of the seeded initial model, with our AdamW settings
    shard = setup.shard(args.index, cfg.data_shards)
    eval_model = setup.eval_model()
    out = open(args.out, "w")  # noqa: SIM115 - closed at the end

    def write(record: dict[str, Any]) -> None:
        out.write(json.dumps(record) + "\n")
        out.flush()

    maddrs = json.loads(Path(args.bootstrap_file).read_text())["maddrs"]
    dht = hivemind.DHT(
        initial_peers=maddrs, host_maddrs=[f"/ip4/{args.host}/tcp/0"], nat_port_map=False, start=True
    )
    compression = {"fp16": Float16Compression(), "fp32": NoCompression()}[args.compression]
    opt = hivemind.Optimizer(
        dht=dht,
        run_id=RUN_ID,
        optimizer=trainer.optimizer,
        target_batch_size=PEERS * H * BATCH,  # one epoch = H inner steps of every peer
        batch_size_per_step=BATCH,
        use_local_updates=True,
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout,
        next_chunk_timeout=args.averaging_timeout / 5,
        state_averaging_compression=compression,
        # off (default here): each epoch's averaging runs inside the step that ends the epoch (blocking
        # DiLoCo, outer lr 1); on (hivemind's default): in the background, by the delta rule
        delay_state_averaging=args.delay_state_averaging,
        averager_opts={"initialize_optimizer": False},  # no zero-gradient AdamW step: same trajectory as ours
        verbose=True,
    )
    started = time.perf_counter()
    watch = AveragingWatch(opt.state_averager, started)
    watch.start()

    def evaluate(step: int, **extra: Any) -> None:
        state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        record = setup.eval_record(eval_model, state, step, PEERS)
        write({**record, "wall_time_s": time.perf_counter() - started, "epoch": opt.local_epoch, **extra})

    optimizer_s = []  # seconds of each hivemind.Optimizer.step (its waits for averaging included)
    done, cut_at = 0, None
    try:
        evaluate(0)
        # the swarm trains as many samples as --steps steps of every peer: ceil(steps / H) epochs. A
        # peer stops once it has moved past the last one (in a blocking round, the final average in
        # hand), not at a step count: a peer that stopped at its own step --steps could leave the
        # slowest waiting for the last round without it (averaging_timeout)
        epochs, step = math.ceil(args.steps / H), 0
        while opt.local_epoch < epochs and step < 2 * args.steps:
            step += 1
            began = time.perf_counter()
            loss = trainer.backward(*shard.batch(step - 1))
            if setup.inner.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), setup.inner.grad_clip)
            for group in trainer.optimizer.param_groups:  # hivemind's opt.param_groups are copies
                group["lr"] = setup.inner.lr_at(step)
            stepped = time.perf_counter()
            opt.step()
            optimizer_s.append(time.perf_counter() - stepped)
            write(
                {
                    "kind": "step",
                    "step": step,
                    "loss": float(loss),
                    "step_s": round(time.perf_counter() - began, 4),
                    "optimizer_s": round(optimizer_s[-1], 4),
                    "epoch": opt.local_epoch,
                }
            )
            done = step
            if step % EVAL_EVERY == 0:
                evaluate(step)
        if done % EVAL_EVERY:
            evaluate(done)
    except Cut:
        cut_at = time.perf_counter() - started
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        evaluate(done, cut=True)
    try:
        trained = cut_at if cut_at is not None else time.perf_counter() - started
        watch.done.set()
        watch.join(timeout=1)
        typical = sorted(optimizer_s)[len(optimizer_s) // 2] if optimizer_s else 0.0
        write(
            {
                "kind": "summary",
                "steps": done,
                "cut_at_timeout": cut_at is not None,
                "wall_time_s": trained,
                "epochs": opt.local_epoch,
                # time the optimizer step waited beyond its typical length: the averaging it waits on
                "stall_s": sum(max(0.0, s - typical) for s in optimizer_s),
                "rounds": watch.rounds,
            }
        )
    finally:
        out.close()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

        def shutdown() -> None:
            # not opt.shutdown(): it waits up to averaging_timeout for a round the last epoch began
            opt.tracker.shutdown(1.0)
            opt.state_averager.shutdown()
            dht.shutdown()

        # hivemind's shutdown can hang (a DHT child failing to unpickle a pipe whose sharer is gone):
        # give it 10 s, then leave; the DHT, averager and p2pd die with this process (PDEATHSIG), and
        # the harness ends the process group anyway
        closing = threading.Thread(target=shutdown, daemon=True)
        closing.start()
        closing.join(timeout=10)
        sys.stdout.flush()
        os._exit(0)


# ---------------------------------------------------------------- the harness (the host namespace)


class Placement:
    """Where a run's processes live: (namespace, address) of the bootstrap and of each peer."""

    def __init__(self, boot: tuple[str, str], peers: list[tuple[str, str]]) -> None:
        self.boot, self.peers = boot, peers


def on_links(net: ThinNet) -> Placement:
    assert net.switch_address is not None
    return Placement((net.switch, net.switch_address), [(n.ns, n.address) for n in net.nodes])


def on_loopback(net: ThinNet) -> Placement:
    ns = net.nodes[0].ns
    return Placement((ns, "127.0.0.1"), [(ns, "127.0.0.1")] * PEERS)


def commands(
    system: str, args: argparse.Namespace, where: Placement, rundir: Path, mbps: float | None, steps: int
):
    """The bootstrap's argv, its address file, and each peer's argv and --out file."""
    address = rundir / "bootstrap.json"
    boot_host = where.boot[1]
    peers = []
    if system == "ours":
        boot = [*CLI, "bootstrap", "--host", boot_host, "--port", str(BOOT_PORT)]
        boot += ["--status-port", str(STATUS_PORT), "--identity", str(rundir / "bootstrap.id")]
        boot += ["--address-file", str(address)]
        ours = copy.copy(args)
        ours.steps = steps
        ours.undeclared = mbps is None  # on loopback a new user's defaults: the link is measured
        ours.data = None  # the embedded corpus, as hivemind's workers train on
        options = training_options(ours, mbps or 0.0)
        for i, (_, host) in enumerate(where.peers):
            out = rundir / f"peer{i}.jsonl"
            argv = [*CLI, "join", "--bootstrap", f"{boot_host}:{STATUS_PORT}", "--host", host]
            argv += ["--run-id", RUN_ID, "--shard", f"{i}/{PEERS}", *options, "--out", str(out), "--verbose"]
            peers.append((argv, out))
    else:
        boot = [*SCRIPT, "--dht-bootstrap", "--host", boot_host, "--address-file", str(address)]
        for i, (_, host) in enumerate(where.peers):
            out = rundir / f"peer{i}.jsonl"
            argv = [*SCRIPT, "--worker", "--index", str(i), "--host", host, "--bootstrap-file", str(address)]
            argv += ["--steps", str(steps), "--out", str(out), "--compression", args.compression]
            argv += ["--matchmaking-time", str(args.matchmaking_time)]
            argv += ["--averaging-timeout", str(args.averaging_timeout)]
            argv += ["--delay-state-averaging"] if args.delay_state_averaging else []
            peers.append((argv, out))
    return boot, address, peers


def first_eval(path: Path) -> bool:
    """Whether the peer's step-0 evaluation record (written just before its first step) is there."""
    return any(r.get("kind") == "eval" and r.get("step") == 0 for r in records(path))


def uplinks(net: ThinNet) -> dict[str, int]:
    """Bytes each node has sent so far (tbf on its own TUN: its uplink), by node address."""
    found = {}
    for node in net.nodes:
        counters = tbf_counters(net, node.ns)
        found[node.address] = counters.get(node.iface, {}).get("bytes", 0)
    return found


def run_system(
    system: str,
    net: ThinNet,
    where: Placement,
    args: argparse.Namespace,
    rundir: Path,
    mbps: float | None,
    steps: int,
) -> dict[str, Any]:
    """``steps`` inner steps of ``system`` ("ours" or "hivemind") on ``net`` (``mbps``: its links'
    rate, None on loopback); every process it started is ended before it returns."""
    rundir.mkdir(parents=True, exist_ok=True)
    boot_argv, address, peer_argvs = commands(system, args, where, rundir, mbps, steps)
    address.unlink(missing_ok=True)
    for _, out in peer_argvs:
        out.unlink(missing_ok=True)
    t0 = time.monotonic()
    samples = [{"t": 0.0, **uplinks(net)}]
    boot = Logged(net, where.boot[0], boot_argv, rundir / "bootstrap.log", t0)
    peers: list[Logged] = []
    joined: dict[int, float] = {}
    timed_out = False
    sockets: set[str] = set()
    try:
        deadline = time.monotonic() + 90
        while not address.exists():
            if boot.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {system} bootstrap did not start; see {rundir / 'bootstrap.log'}")
            time.sleep(0.1)
        for i, ((ns, _), (argv, _)) in enumerate(zip(where.peers, peer_argvs, strict=True)):
            peers.append(Logged(net, ns, argv, rundir / f"peer{i}.log", t0))
        last_sample = time.monotonic()
        while [p.poll() for p in peers].count(None):
            now = time.monotonic()
            if now - peers[0].started > args.timeout:
                timed_out = True
                break
            for i, ((_, out), proc) in enumerate(zip(peer_argvs, peers, strict=True)):
                if i not in joined and first_eval(out):
                    joined[i] = now - proc.started
            if now - last_sample >= 1.0:
                samples.append({"t": round(now - t0, 2), **uplinks(net)})
                for ns in net.namespaces:
                    sockets |= hivemind_sockets(net, ns)
                last_sample = now
            time.sleep(0.05)
        samples.append({"t": round(time.monotonic() - t0, 2), **uplinks(net)})
    finally:
        end_all([*peers, boot], grace_s=15.0)
        removed = remove_dead_sockets(sockets)
    result: dict[str, Any] = {
        "system": system,
        "steps": steps,
        "timed_out": timed_out,
        "removed_sockets": len(removed),
        "bootstrap_command": " ".join(["ip netns exec SWITCH", *boot_argv]),
        "peer_command": " ".join(["ip netns exec NS", *peer_argvs[-1][0]]),
        "uplink_samples": samples,
        "peers": [],
    }
    addresses = [host for _, host in where.peers]
    for i, ((_, out), proc) in enumerate(zip(peer_argvs, peers, strict=True)):
        recs = records(out)
        summary = next((r for r in recs if r.get("kind") == "summary"), {})
        evals = [r for r in recs if r.get("kind") == "eval"]
        # our peers count wall time from the start of training too; where the harness saw the step-0 record
        train_start = (proc.started - t0) + joined[i] if i in joined else None
        result["peers"].append(
            {
                "peer": i,
                "address": addresses[i],
                "exit_code": proc.proc.returncode,
                "process_wall_s": round((proc.ended or time.monotonic()) - proc.started, 1),
                "join_to_first_step_s": round(joined[i], 2) if i in joined else None,
                "train_start_s": train_start,  # seconds after the bootstrap was started
                "evals": [
                    {k: e.get(k) for k in ("step", "val_ppl", "wall_time_s", "bytes_sent", "stall_s")}
                    for e in evals
                ],
                "summary": {k: v for k, v in summary.items() if k != "config"},
                "notable": notable(rundir / f"peer{i}.log")[:20],
                "averaged_logged": sum(
                    "Averaged parameters with" in line
                    for line in (rundir / f"peer{i}.log").read_text(errors="replace").splitlines()
                ),
            }
        )
    return result


# ---------------------------------------------------------------- what the runs say


def bytes_at(samples: list[dict[str, Any]], t: float, addresses: list[str]) -> float:
    """Uplink bytes of ``addresses`` together at ``t`` s after the bootstrap started (interpolated
    between the once-a-second samples)."""
    total = [(s["t"], sum(s.get(a, 0) for a in addresses)) for s in samples]
    base = total[0][1]
    for (ta, ba), (tb, bb) in zip(total, total[1:], strict=False):
        if ta <= t <= tb:
            return ba - base + (bb - ba) * (t - ta) / max(tb - ta, 1e-9)
    return total[-1][1] - base


def final_ppl(peer: dict[str, Any]) -> float | None:
    return peer["evals"][-1]["val_ppl"] if peer["evals"] else None


def goodput(system: str, peer: dict[str, Any], mbps: float) -> dict[str, Any]:
    """Exchange goodput ÷ shaped bandwidth of one peer (docs/hivemind-baseline.md, "Definitions")."""
    s = peer["summary"]
    if system == "ours":
        return exchange_goodput(s, mbps)
    done = [r for r in s.get("rounds", []) if r["seconds"] > 0.1]
    rounds, sent, seconds = (
        len(done),
        sum(r["uplink_bytes"] for r in done),
        sum(r["seconds"] for r in done),
    )
    rate = mbps * 1e6 / 8
    return {
        "rounds": rounds,
        "round_s": round(seconds, 1),
        "bytes": sent,
        "ratio": round(sent / (rate * seconds), 3) if seconds else None,
    }


def side(run: dict[str, Any], mbps: float) -> dict[str, Any]:
    """One run's figures: final perplexities, wall times, join times, bytes, goodput, stall."""
    peers = run["peers"]
    addresses = [p["address"] for p in peers]
    walls = [p["evals"][-1]["wall_time_s"] for p in peers if p["evals"]]
    starts = [p["train_start_s"] for p in peers if p["train_start_s"] is not None]
    end = max((s + w for s, w in zip(starts, walls, strict=False)), default=None)
    return {
        "steps": run["steps"],
        "final_ppl": [final_ppl(p) for p in peers],
        "final_step": [p["evals"][-1]["step"] if p["evals"] else None for p in peers],
        "train_wall_s": max(walls, default=None),
        "process_wall_s": max(p["process_wall_s"] for p in peers),
        "join_s": [p["join_to_first_step_s"] for p in peers],
        "bytes_total": bytes_at(run["uplink_samples"], 1e12, addresses),
        "bytes_to_end": bytes_at(run["uplink_samples"], end, addresses) if end else None,
        "goodput": [goodput(run["system"], p, mbps) for p in peers],
        "stall_s": [p["summary"].get("stall_s") for p in peers],
        "exit_codes": [p["exit_code"] for p in peers],
        "timed_out": run["timed_out"],
    }


def compare(ours: dict[str, dict[str, Any]], theirs: dict[str, Any], mbps: float) -> dict[str, Any]:
    """The headline figures of each of our runs against hivemind's: when our evaluation curve first
    reached hivemind's final perplexity (the best of its three peers), against hivemind's training
    wall time, and the bytes each side sent by then."""
    hm = side(theirs, mbps)
    ppls = [p for p in hm["final_ppl"] if p is not None]
    target = min(ppls) if ppls else None
    out: dict[str, Any] = {"hivemind": hm, "target_ppl": target, "ours": {}}
    for name, run in ours.items():
        mine = side(run, mbps)
        reached = [
            crossing(p["evals"], target, "wall_time_s") if target is not None and p["evals"] else None
            for p in run["peers"]
        ]
        worst = None if target is None or not reached or None in reached else max(reached)
        mine["time_to_target_s"], mine["time_to_target_max_s"] = reached, worst
        mine["bytes_to_target"] = mine["time_ratio"] = mine["bytes_ratio"] = None
        if worst is not None:
            start = max(p["train_start_s"] or 0.0 for p in run["peers"])
            addresses = [p["address"] for p in run["peers"]]
            mine["bytes_to_target"] = bytes_at(run["uplink_samples"], start + worst, addresses)
            if hm["train_wall_s"]:
                mine["time_ratio"] = worst / hm["train_wall_s"]
            if hm["bytes_to_end"]:
                mine["bytes_ratio"] = mine["bytes_to_target"] / hm["bytes_to_end"]
        out["ours"][name] = mine
    return out


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if math.isfinite(value) else str(value)
    return str(value)


def table(c: dict[str, Any], loop: dict[str, Any], mbps: float) -> str:
    """One markdown table: a column per run of ours, one for hivemind."""
    cols = [*c["ours"].values(), c["hivemind"]]
    names = [f"ours, {o['steps']} steps" for o in c["ours"].values()]
    names.append(f"hivemind.Optimizer, {c['hivemind']['steps']} steps")

    def each(values: list[Any], digits: int = 1) -> str:
        return ", ".join(fmt(v, digits) for v in values) if values else "—"

    def gp(x: dict[str, Any]) -> str:
        return "<br>".join(
            f"{fmt(g['ratio'], 2)} ({g['bytes'] / 1e6:.2f} MB / {g['round_s']} s, {g['rounds']} rounds)"
            for g in x["goodput"]
        )

    def mb(value: float | None) -> str:
        return fmt(value / 1e6 if value is not None else None, 2)

    def row(label: str, cells: list[str]) -> str:
        return f"| {label} | {' | '.join(cells)} |"

    target = fmt(c["target_ppl"], 2)
    ours = list(c["ours"].values())
    hm = c["hivemind"]
    lines = [
        row("figure", names),
        row("---", ["---"] * len(cols)),
        row("final val perplexity, per peer (at step)", [
            f"{each(x['final_ppl'], 2)} ({each(x['final_step'])})" for x in cols
        ]),
        row("training wall time, s (slowest peer)", [fmt(x["train_wall_s"]) for x in cols]),
        row(f"wall time to {target} (hivemind's best final), s", [
            *(fmt(o["time_to_target_max_s"]) for o in ours), fmt(hm["train_wall_s"])
        ]),
        row("**÷ hivemind's wall time** (target ≤ 0.67)", [
            *(f"**{fmt(o['time_ratio'], 3)}**" for o in ours), "1"
        ]),
        row("bytes on the wire by then, 3 uplinks, MB", [
            *(mb(o["bytes_to_target"]) for o in ours), mb(hm["bytes_to_end"])
        ]),
        row("÷ hivemind's bytes", [*(fmt(o["bytes_ratio"], 3) for o in ours), "1"]),
        row("bytes on the wire, whole run, MB", [mb(x["bytes_total"]) for x in cols]),
        row("stall, s per peer", [each(x["stall_s"]) for x in cols]),
        row("process wall time, s (slowest peer)", [fmt(x["process_wall_s"]) for x in cols]),
        row(f"join → first inner step, s per peer, {mbps:g} Mbit/s links", [each(x["join_s"]) for x in cols]),
        row("join → first inner step, s per peer, loopback (target ≤ 10)", [
            *(each(loop["ours"]) for _ in ours), each(loop["hivemind"])
        ]),
        row("exchange goodput ÷ shaped bandwidth, per peer (target ≥ 0.8)", [gp(x) for x in cols]),
        row("exit codes", [each(x["exit_codes"]) + (" (timed out)" * x["timed_out"]) for x in cols]),
    ]  # fmt: skip
    return "\n".join(lines)


def check(args: argparse.Namespace) -> None:
    """Bad input: one clear line, exit 2."""
    problems = []
    if min([args.steps, args.loopback_steps, *(args.our_steps or [])]) < 1:
        problems.append("--steps, --our-steps and --loopback-steps must be at least 1")
    if args.timeout <= 0 or args.averaging_timeout <= 0 or args.matchmaking_time <= 0:
        problems.append("--timeout, --averaging-timeout and --matchmaking-time must be positive")
    if problems:
        print(f"hivemind_baseline.py: {'; '.join(problems)}", file=sys.stderr)
        sys.exit(2)


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """This script's options (``argv``: the command line's by default), with what
    ``thin_link.training_options`` reads for our peers."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--profile",
        default="thin",
        choices=None if HELPER else sorted(PROFILES),
        help="the links (tests/netns.py)",
    )
    parser.add_argument("--steps", type=int, default=96, help="inner steps per peer, both systems")
    parser.add_argument("--loopback-steps", type=int, default=8, help="steps of the loopback runs")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a run's peers are ended")
    parser.add_argument("--codec", default="fp4", help="our peers' --codec")
    parser.add_argument(
        "--paced-codec", default=None, help="our peers' --paced-codec (default: theirs, auto)"
    )
    parser.add_argument("--no-final-sync", action="store_true", help="our peers end without closing rounds")
    parser.add_argument("--overlap", default="auto", help="our peers' --overlap")
    parser.add_argument("--transmissions", default="auto", help="our peers' --transmissions")
    parser.add_argument(
        "--compression", default="fp16", choices=("fp16", "fp32"), help="hivemind's state averaging"
    )
    parser.add_argument("--matchmaking-time", type=float, default=5.0, help="hivemind.Optimizer's")
    parser.add_argument("--averaging-timeout", type=float, default=300.0, help="hivemind.Optimizer's")
    parser.add_argument(
        "--delay-state-averaging",
        action="store_true",
        help="hivemind averages in the background (its default; on a thin link its epochs then follow its "
        "ETA, not the samples: docs/hivemind-baseline.md)",
    )
    parser.add_argument(
        "--our-steps",
        type=int,
        action="append",
        help="our peers' --steps (repeat for several runs of ours; default: --steps)",
    )
    parser.add_argument("--only", choices=("links", "loopback"), help="run only that part")
    parser.add_argument("--workdir", type=Path, default=None)
    # the processes this script starts for hivemind
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dht-bootstrap", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--host", help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap-file", help=argparse.SUPPRESS)
    parser.add_argument("--address-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check(args)
    if not HELPER:  # what thin_link.training_options reads
        args.algo, args.rtt_ms, args.undeclared = "cocodc", PROFILES[args.profile].rtt_ms, False
        args.min_step_time = 0.0  # its peers train at full speed, as hivemind's do
        args.eval_batches = 2  # as hivemind's peers evaluate (``eval_batches`` in its helper)
    return args


def main() -> None:
    args = arguments()
    if args.dht_bootstrap:
        return dht_bootstrap(args.host, args.address_file)
    if args.worker:
        return worker(args)
    mbps = PROFILES[args.profile].mbit
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hivemind-baseline-"))
    workdir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still ends the processes, removes the network
    results: dict[str, Any] = {"profile": args.profile, "steps": args.steps, "code": code_version()}
    runs = [(f"ours-{n}", "ours", n) for n in args.our_steps or [args.steps]]
    runs.append(("hivemind", "hivemind", args.steps))
    try:
        for name, system, steps in runs if args.only != "loopback" else []:
            with thin_network(PEERS, mbps, rtt_ms=args.rtt_ms) as net:
                measured, _ = tcp_throughput(net, net.nodes[0], net.nodes[1], int(mbps * 1e6 / 8 * 2))
                print(f"[{name}] link check: {measured:.2f} Mbit/s TCP goodput", flush=True)
                results[name] = run_system(system, net, on_links(net), args, workdir / name, mbps, steps)
                results[name]["link_measured_mbps"] = round(measured, 2)
            print(f"[{name}] done: {summary_line(results[name])}", flush=True)
            (workdir / "results.json").write_text(json.dumps(results, indent=1))
        for system in ("ours", "hivemind") if args.only != "links" else ():
            with thin_network(1, 1000.0) as net:  # only its namespace's own lo is used
                where, rundir = on_loopback(net), workdir / f"loopback-{system}"
                run = run_system(system, net, where, args, rundir, None, args.loopback_steps)
            results[f"loopback-{system}"] = run
            print(f"[loopback {system}] done: {summary_line(run)}", flush=True)
            (workdir / "results.json").write_text(json.dumps(results, indent=1))
    except NetnsUnavailable as exc:
        print(f"hivemind_baseline.py: this machine does not allow network namespaces: {exc}", file=sys.stderr)
        sys.exit(2)
    ours = {name: results[name] for name, system, _ in runs if system == "ours" and name in results}
    if ours and "hivemind" in results:
        results["compare"] = compare(ours, results["hivemind"], mbps)
        loop = {
            s: [p["join_to_first_step_s"] for p in results[f"loopback-{s}"]["peers"]]
            if f"loopback-{s}" in results
            else []
            for s in ("ours", "hivemind")
        }
        results["table"] = table(results["compare"], loop, mbps)
        print(results["table"])
    (workdir / "results.json").write_text(json.dumps(results, indent=1))
    print(f"logs, records and results.json in {workdir}")


def summary_line(run: dict[str, Any]) -> str:
    return "; ".join(
        f"peer {p['peer']}: exit {p['exit_code']}, join→step {p['join_to_first_step_s']} s, "
        f"final ppl {fmt(final_ppl(p), 2)}, process {p['process_wall_s']} s"
        for p in run["peers"]
    ) + (" (timed out)" if run["timed_out"] else "")


if __name__ == "__main__":
    main()
