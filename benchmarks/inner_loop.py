"""The peer's inner loop against a plain PyTorch training loop: throughput and peak memory.

"plain": the loop anyone would write for the same model, batch, device and precision (forward,
cross-entropy, backward, clip, AdamW step), nothing else. "peer": ``p2p-cocodc join`` in a swarm of
one (``--workers 1``): the same inner steps plus everything a peer adds around them (snapshots and
their host copies, the outer gradients, every round through the exchange, the outer step,
CoCoDC's compensation, schedules, records, the board's heartbeat); nothing to wait for, so what it
costs is the machinery, not the network. Each runs alone in its own process, one after the other,
alternating which goes first; the report gives per-repeat ratios and their median.

Throughput: training tokens over training wall time (the peer's ``tokens_per_s``, evaluation time
excluded). Memory: each process's peak (``devices.peak_memory_bytes``: the CUDA allocator's peak on
a GPU, the peak resident set elsewhere), against the model's own state: the replica, θ̄ and the
outer momentum (fp32 on the CPU), AdamW's two moments: 5 × 4 bytes per parameter. The peer's DHT
and libp2p daemon are separate processes; their peak resident sets are sampled and shown apart.

    python benchmarks/inner_loop.py --repeats 5                      # CPU, about 10 minutes here
    python benchmarks/inner_loop.py --device cuda --model base --steps 300 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.report import write_section  # noqa: E402
from tests.swarm_procs import end_group, start_bootstrap  # noqa: E402

CLI = [sys.executable, "-m", "p2p_cocodc"]


def plain_loop(options: dict[str, Any]) -> dict[str, Any]:
    """The plain loop, in this process: the same model, batches, device and precision as a peer."""
    import torch
    import torch.nn.functional as F

    from p2p_cocodc.algorithms.devices import peak_memory_bytes
    from p2p_cocodc.config.train import build_config
    from p2p_cocodc.run.setup import TrainingSetup

    cfg = build_config({}, options)
    setup = TrainingSetup(cfg)
    placement = setup.placement
    model = setup.trainer().model
    inner = setup.inner
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=inner.lr, betas=(inner.beta1, inner.beta2), weight_decay=inner.weight_decay
    )
    shard = setup.shard(0, cfg.data_shards)
    started = time.perf_counter()
    for step in range(cfg.steps):
        x, y = placement.batch(*shard.batch(step))
        with placement.autocast():
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), inner.grad_clip)
        optimizer.step()
        float(loss)  # the peer reads every step's loss too
    wall = time.perf_counter() - started
    return {
        "tokens_per_s": cfg.steps * cfg.batch_size * cfg.seq_len / wall,
        "peak_memory_bytes": peak_memory_bytes(placement.device),
        "num_params": setup.num_params,
        "device": str(placement.device),
        "device_name": torch.cuda.get_device_name(placement.device) if torch.cuda.is_available() else "",
    }


def vm_hwm(pid: int) -> int:
    """A process's peak resident set in bytes (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def run_plain(options: dict[str, Any], workdir: Path) -> dict[str, Any]:
    args = [sys.executable, __file__, "--plain-child", json.dumps(options)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=3600, cwd=workdir)
    if done.returncode != 0:
        raise RuntimeError(f"the plain loop failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def run_peer(options: dict[str, Any], bootstrap: str, repeat: int, workdir: Path) -> dict[str, Any]:
    out = workdir / f"peer-{repeat}.jsonl"
    args = ["join", "--bootstrap", bootstrap, "--workers", "1", "--run-id", f"loop-{repeat}", "--quiet"]
    for name, value in options.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    log = open(workdir / f"peer-{repeat}.log", "w")  # noqa: SIM115 - closed with the process
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [*CLI, *args, "--out", str(out)]
    proc = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, cwd=workdir, start_new_session=True, env=env
    )
    helpers: dict[int, int] = {}  # the peer's DHT and daemon processes: pid -> peak resident set
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            pending = children(proc.pid)
            while pending:
                pid = pending.pop()
                helpers[pid] = max(helpers.get(pid, 0), vm_hwm(pid))
                pending += children(pid)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        if proc.wait(timeout=3600) != 0:
            raise RuntimeError(f"the peer failed; see {workdir / f'peer-{repeat}.log'}")
    finally:
        stop.set()
        end_group(proc)
    summary = json.loads(out.read_text().splitlines()[-1])
    summary["helpers_peak_bytes"] = sum(helpers.values())
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--model", default="small")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--plain-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_child:
        print(json.dumps(plain_loop(json.loads(args.plain_child))))
        return
    options = {
        "algo": "cocodc", "model": args.model, "steps": args.steps, "inner_steps": 48, "fragments": 4,
        "overlap": 12, "seq_len": 128, "batch_size": 8, "eval_every": args.steps, "eval_batches": 2,
        "threads": args.threads, "device": args.device, "precision": args.precision,
    }  # fmt: skip
    workdir = Path(tempfile.mkdtemp(prefix="inner-loop-"))
    boot = start_bootstrap(workdir)
    rows = []
    try:
        for repeat in range(args.repeats):
            order = ("plain", "peer") if repeat % 2 == 0 else ("peer", "plain")
            got = {}
            for side in order:
                got[side] = (
                    run_plain(options, workdir)
                    if side == "plain"
                    else run_peer(options, boot.host_port, repeat, workdir)
                )
            rows.append((repeat, order[0], got["peer"], got["plain"]))
            ratio = got["peer"]["tokens_per_s"] / got["plain"]["tokens_per_s"]
            print(f"repeat {repeat}: peer {got['peer']['tokens_per_s']:.0f} tok/s, plain "
                  f"{got['plain']['tokens_per_s']:.0f} tok/s, ratio {ratio:.3f}", flush=True)  # fmt: skip
    finally:
        end_group(boot.proc)
    report(rows, args, options)


def report(rows: list[tuple], args: argparse.Namespace, options: dict[str, Any]) -> None:
    ratios = [peer["tokens_per_s"] / plain["tokens_per_s"] for _, _, peer, plain in rows]
    median = statistics.median(ratios)
    plain0 = rows[0][3]
    num_params = plain0["num_params"]
    model_bytes = 5 * 4 * num_params  # replica, θ̄, outer momentum, AdamW's two moments (fp32)
    peer_peak = statistics.median(peer["peak_memory_bytes"] for _, _, peer, _ in rows)
    plain_peak = statistics.median(plain["peak_memory_bytes"] for _, _, _, plain in rows)
    helpers = statistics.median(peer["helpers_peak_bytes"] for _, _, peer, _ in rows)
    device = plain0["device"] + (f" ({plain0['device_name']})" if plain0["device_name"] else "")
    where = f"{device}, {os.cpu_count()} CPU cores (shared machine)"
    memory_kind = "CUDA allocator peak" if plain0["device"].startswith("cuda") else "peak resident set"
    command = (
        f"python benchmarks/inner_loop.py --repeats {args.repeats} --steps {args.steps} --model {args.model} "
        f"--device {args.device} --precision {args.precision} --threads {args.threads}"
    )
    table = "\n".join(
        f"| {r} | {first} | {peer['tokens_per_s']:.0f} | {plain['tokens_per_s']:.0f} | {ratio:.3f} | "
        f"{peer['rounds_done']} |"
        for (r, first, peer, plain), ratio in zip(rows, ratios, strict=True)
    )
    mb = 1e6
    text = f"""Tokens per second of a peer's inner loop (`join` in a swarm of one: every sync still runs
through the exchange, the outer step and CoCoDC's compensation) divided by a plain PyTorch loop of
the same model, batch, device and precision, each alone in its own process, one after the other,
alternating which goes first. Device: **{where}**. Model `{args.model}` ({num_params / 1e6:.2f} M
parameters), {args.precision}.

Reproduce: `{command}`

| repeat | first | peer tok/s | plain tok/s | ratio | syncs |
|---|---|---|---|---|---|
{table}

**Median ratio: {median:.3f}** (target ≥ 0.98), spread {min(ratios):.3f} to {max(ratios):.3f}.

**Peak memory** ({memory_kind}, median over the repeats): peer {peer_peak / mb:.0f} MB, plain loop
{plain_peak / mb:.0f} MB; the model's own state (replica + θ̄ + outer momentum + AdamW, 5 × 4 bytes ×
{num_params / 1e6:.2f} M) is {model_bytes / mb:.0f} MB, so the peer holds **{peer_peak / model_bytes:.1f}×**
it ({(peer_peak - plain_peak) / mb:+.0f} MB over the plain loop). The peer's DHT process and libp2p
daemon hold another {helpers / mb:.0f} MB between them.
"""
    title = f"Inner loop against a plain PyTorch loop ({plain0['device']}, {args.precision}"
    threads = f", {args.threads} thread{'s' if args.threads > 1 else ''})"
    write_section(title + (threads if plain0["device"] == "cpu" else ")"), text)
    print(text)


if __name__ == "__main__":
    main()
