"""The peer's inner loop against a plain PyTorch training loop: throughput, MFU and peak memory.

"plain": the loop anyone would write for the same model, batch, device and precision (forward,
cross-entropy, backward, clip, optimizer step), nothing else. Its optimizer is the peer's own: the
``.optimizer`` of the ``InnerTrainer`` that ``TrainingSetup.trainer()`` builds (AdamW, fused or not
as the trainer makes it), with that trainer's settings for the LR schedule and the gradient clip; so
a change to the trainer's optimizer changes both sides, and an older tree (``--code``) is compared
with its own. It reads each step's loss late, as the peer does (the loss of step s once step s+1 has
been queued, the last one after the loop), and runs one untimed forward pass first, as the peer
evaluates θ̄ (untimed) before its first step. "peer": ``p2p-cocodc join`` in a swarm of one
(``--workers 1``): the same inner steps plus everything a peer adds around them (snapshots and their
host copies, the outer gradients, every round through the exchange, the outer step, the algorithm's
own work such as CoCoDC's compensation, schedules, records, the board's heartbeat); nothing to wait
for, so what it costs is the machinery, not the network. Each runs alone in its own process, one
after the other, alternating which goes first, after one untimed plain run that warms the device
(on an H200, whichever side ran first on a cold GPU was 5-10 % slower; ``--no-warm-up`` skips it);
the report gives per-repeat ratios and their median.

Throughput: training tokens over training wall time (the peer's ``tokens_per_s``, evaluation time
excluded; the plain loop's from its first step to the end of its last, CUDA work included). MFU:
model FLOPs per token = 6 × N (N: the model's parameters, embeddings included; the attention
scores' sequence-length term left out) × tokens/s ÷ the device's dense bf16 peak, known from its
name (H100 SXM / 80GB HBM3 and H200: 989 TFLOP/s, H100 PCIe: 756, A100: 312, L40S: 362, L4: 121;
other devices, and CPUs: no MFU). Where the peer's summary has ``sync_boundary_s`` (seconds its
training thread waited between steps on sync work), the table gives it per sync (÷ rounds_done).

Memory: each process's peak (``devices.peak_memory_bytes``: the CUDA allocator's peak on a GPU, the
peak resident set elsewhere), against the model's own state: the replica, θ̄ and the outer momentum
(fp32 on the CPU), AdamW's two moments: 5 × 4 bytes per parameter. The peer's child processes (its
DHT process and libp2p daemon) are sampled every 0.5 s: their peak resident sets (VmHWM, which
counts the pages the DHT process still shares copy-on-write with the peer it was forked from), and
the most each held of its own (USS: Private_Clean + Private_Dirty) and of its proportional share
(PSS) in /proc/PID/smaps_rollup, summed over them.

``--code DIR`` runs the ``p2p_cocodc`` package of another checkout on both sides (and in the
bootstrap), so an older tree is measured beside this one on the same machine; this script and its
helpers come from this checkout. ``--json PATH`` writes the rows and the summary's numbers after each
repeat (a run cut short keeps what it measured); ``--no-write`` leaves docs/performance.md alone.

    python benchmarks/inner_loop.py --repeats 5                      # CPU, about 10 minutes here
    python benchmarks/inner_loop.py --device cuda --precision bf16 --model hf:/tmp/llama317 \\
        --batch-size 16 --seq-len 512 --algo cocodc --inner-steps 48 --steps 96 --repeats 3

(``benchmarks/llama_folder.py /tmp/llama317`` writes that 317 M-parameter Llama's folder;
``benchmarks/gpu_check.sh`` runs the GPU rows.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
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
# dense bf16 peaks by device name, first match wins
PEAK_BF16 = (
    (r"H100.*PCIe", 756e12),
    (r"H100.*(SXM|HBM3)", 989e12),
    (r"H200", 989e12),
    (r"A100", 312e12),
    (r"L40S", 362e12),
    (r"\bL4\b", 121e12),
)
MB = 1e6


def plain_loop(options: dict[str, Any], code: str) -> dict[str, Any]:
    """The plain loop, in this process, with the ``p2p_cocodc`` of ``code``: the same model, batches,
    device, precision and optimizer as a peer."""
    sys.path.insert(0, code)
    import torch
    import torch.nn.functional as F

    import p2p_cocodc
    from p2p_cocodc.algorithms.devices import peak_memory_bytes
    from p2p_cocodc.config.train import build_config
    from p2p_cocodc.run.setup import TrainingSetup

    cfg = build_config({}, options)
    setup = TrainingSetup(cfg)
    placement = setup.placement
    trainer = setup.trainer()
    model, optimizer, settings = trainer.model, trainer.optimizer, trainer.settings
    model.train()
    shard = setup.shard(0, cfg.data_shards)
    # untimed, as the peer's evaluation of θ̄ before its first step is: one forward pass, so that
    # neither side's timed steps include the device's first-use set-up (kernels, libraries)
    with torch.no_grad(), placement.autocast():
        float(model(placement.batch(*shard.batch(0))[0]).float().mean())
    previous = None  # the loss of the step before, read once this step is queued
    started = time.perf_counter()
    for step in range(cfg.steps):
        x, y = placement.batch(*shard.batch(step))
        optimizer.zero_grad(set_to_none=True)
        with placement.autocast():
            logits = trainer.forward(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        if settings.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = settings.lr_at(step + 1)
        optimizer.step()
        if previous is not None:
            float(previous)
        previous = loss.detach()
    float(previous)
    on_cuda = placement.device.type == "cuda"
    if on_cuda:
        torch.cuda.synchronize(placement.device)
    wall = time.perf_counter() - started
    return {
        "tokens_per_s": cfg.steps * cfg.batch_size * cfg.seq_len / wall,
        "peak_memory_bytes": peak_memory_bytes(placement.device),
        "num_params": setup.num_params,
        "device": str(placement.device),
        "device_name": torch.cuda.get_device_name(placement.device) if on_cuda else "",
        "optimizer": type(optimizer).__name__ + (" (fused)" if optimizer.defaults.get("fused") else ""),
        "code": str(Path(p2p_cocodc.__file__).resolve().parent.parent),
    }


def memory(pid: int) -> tuple[int, int, int]:
    """A process's peak resident set (VmHWM), unique set (USS: Private_Clean + Private_Dirty) and
    proportional set (PSS) now, in bytes; zeros once it is gone."""
    found: dict[str, int] = {}
    try:
        for name in ("status", "smaps_rollup"):
            for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in ("VmHWM", "Private_Clean", "Private_Dirty", "Pss"):
                    found[key] = int(value.split()[0]) * 1024
    except OSError:
        return 0, 0, 0
    return (
        found.get("VmHWM", 0),
        found.get("Private_Clean", 0) + found.get("Private_Dirty", 0),
        found.get("Pss", 0),
    )


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def python_path(code: Path) -> str:
    """PYTHONPATH with ``code`` first."""
    return os.pathsep.join(p for p in (str(code), os.environ.get("PYTHONPATH")) if p)


def run_plain(options: dict[str, Any], code: Path, workdir: Path) -> dict[str, Any]:
    args = [sys.executable, __file__, "--plain-child", json.dumps(options), "--code", str(code)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=3600, cwd=workdir)
    if done.returncode != 0:
        raise RuntimeError(f"the plain loop failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def run_peer(
    options: dict[str, Any], code: Path, bootstrap: str, repeat: int, workdir: Path
) -> dict[str, Any]:
    out = workdir / f"peer-{repeat}.jsonl"
    args = ["join", "--bootstrap", bootstrap, "--workers", "1", "--run-id", f"loop-{repeat}", "--quiet"]
    for name, value in options.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    log = open(workdir / f"peer-{repeat}.log", "w")  # noqa: SIM115 - closed with the process
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": python_path(code)}
    command = [*CLI, *args, "--out", str(out)]
    proc = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, cwd=workdir, start_new_session=True, env=env
    )
    helpers: dict[int, tuple[int, ...]] = {}  # the peer's DHT and daemon processes: pid -> the most seen
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            pending = children(proc.pid)
            while pending:
                pid = pending.pop()
                now = memory(pid)
                helpers[pid] = tuple(map(max, helpers.get(pid, now), now))
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
    for i, name in enumerate(("helpers_peak_bytes", "helpers_uss_bytes", "helpers_pss_bytes")):
        summary[name] = sum(most[i] for most in helpers.values())
    return summary


def peak_flops(device_name: str) -> float | None:
    """The device's dense bf16 peak in FLOP/s, from its name; None where unknown."""
    return next((peak for pattern, peak in PEAK_BF16 if re.search(pattern, device_name)), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--model", default="small", help="a model name, or hf:PATH")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--algo", default="cocodc", choices=("cocodc", "streaming", "diloco"))
    parser.add_argument("--inner-steps", type=int, default=48)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--overlap", type=int, help="default: 0 for diloco, else inner steps // 4")
    parser.add_argument(
        "--code", type=Path, default=ROOT, help="the checkout whose p2p_cocodc both sides run"
    )
    parser.add_argument(
        "--compile", default="off", help="both sides' torch.compile backend (off, inductor), compile timed"
    )
    parser.add_argument(
        "--no-warm-up",
        action="store_true",
        help="skip the untimed plain run before the repeats (it warms the device: clocks, caches)",
    )
    parser.add_argument("--no-write", action="store_true", help="leave docs/performance.md alone")
    parser.add_argument("--json", type=Path, help="write the rows and the summary here")
    parser.add_argument("--plain-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_child:
        print(json.dumps(plain_loop(json.loads(args.plain_child), str(args.code))))
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still ends the peers
    args.code = args.code.resolve()
    if args.overlap is None:
        args.overlap = 0 if args.algo == "diloco" else args.inner_steps // 4
    model = args.model
    if model.startswith("hf:"):  # the peers run in a temporary folder
        model = "hf:" + str(Path(model[3:]).resolve())
    options = {
        "algo": args.algo, "model": model, "steps": args.steps, "inner_steps": args.inner_steps,
        "fragments": args.fragments, "overlap": args.overlap, "seq_len": args.seq_len,
        "batch_size": args.batch_size, "eval_every": args.steps, "eval_batches": 2,
        "threads": args.threads, "device": args.device, "precision": args.precision,
    }  # fmt: skip
    if args.compile != "off":  # an older tree (--code) may not have the option
        options["compile"] = args.compile
    workdir = Path(tempfile.mkdtemp(prefix="inner-loop-"))
    boot = start_bootstrap(workdir, prefix=("env", f"PYTHONPATH={python_path(args.code)}"))
    rows = []
    try:
        if not args.no_warm_up:  # whichever side ran first on a cold GPU was 5-10 % slower (H200)
            run_plain(options, args.code, workdir)
        for repeat in range(args.repeats):
            order = ("plain", "peer") if repeat % 2 == 0 else ("peer", "plain")
            got = {}
            for side in order:
                got[side] = (
                    run_plain(options, args.code, workdir)
                    if side == "plain"
                    else run_peer(options, args.code, boot.host_port, repeat, workdir)
                )
            rows.append((repeat, order[0], got["peer"], got["plain"]))
            ratio = got["peer"]["tokens_per_s"] / got["plain"]["tokens_per_s"]
            print(f"repeat {repeat}: peer {got['peer']['tokens_per_s']:.0f} tok/s, plain "
                  f"{got['plain']['tokens_per_s']:.0f} tok/s, ratio {ratio:.3f}", flush=True)  # fmt: skip
            if args.json:
                args.json.write_text(json.dumps(summarize(rows, args), indent=1) + "\n")
    finally:
        end_group(boot.proc)
    summary = summarize(rows, args)
    text = report(summary)
    if not args.no_write:
        write_section(title(args, summary), text)
    print(text)


def command(args: argparse.Namespace) -> str:
    """The command that reproduces the run."""
    code = f" --code {args.code}" if args.code != ROOT else ""
    return (
        f"python benchmarks/inner_loop.py --repeats {args.repeats} --steps {args.steps} --model {args.model} "
        f"--device {args.device} --precision {args.precision} --threads {args.threads} --batch-size "
        f"{args.batch_size} --seq-len {args.seq_len} --algo {args.algo} --inner-steps {args.inner_steps} "
        f"--fragments {args.fragments} --overlap {args.overlap}{code}"
    )


def summarize(rows: list[tuple], args: argparse.Namespace) -> dict[str, Any]:
    """The run's numbers: per repeat, and medians over the repeats (MFU and the sync waits: None where
    not known)."""
    plain0 = rows[0][3]
    num_params = plain0["num_params"]
    peak = peak_flops(plain0["device_name"])
    flops_per_token = 6 * num_params

    def mfu(tokens_per_s: float) -> float | None:
        return tokens_per_s * flops_per_token / peak if peak else None

    def sync_ms(peer: dict[str, Any]) -> float | None:
        boundary = peer.get("sync_boundary_s")  # older trees do not record it
        return 1e3 * boundary / peer["rounds_done"] if boundary is not None and peer["rounds_done"] else None

    measured = [
        {
            "repeat": repeat,
            "first": first,
            "ratio": peer["tokens_per_s"] / plain["tokens_per_s"],
            "peer_mfu": mfu(peer["tokens_per_s"]),
            "plain_mfu": mfu(plain["tokens_per_s"]),
            "sync_boundary_ms_per_sync": sync_ms(peer),
            "peer": peer,
            "plain": plain,
        }
        for repeat, first, peer, plain in rows
    ]

    def median(key: str, side: str | None = None) -> Any:
        values = [row[side][key] if side else row[key] for row in measured]
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    ratios = [row["ratio"] for row in measured]
    return {
        "command": command(args),
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "device": plain0["device"],
        "device_name": plain0["device_name"],
        "optimizer": plain0["optimizer"],
        "code": plain0["code"],
        "num_params": num_params,
        "flops_per_token": flops_per_token,
        "peak_flops": peak,
        "repeats_done": len(rows),
        "median_ratio": statistics.median(ratios),
        "min_ratio": min(ratios),
        "max_ratio": max(ratios),
        "peer_tokens_per_s": median("tokens_per_s", "peer"),
        "plain_tokens_per_s": median("tokens_per_s", "plain"),
        "peer_mfu": median("peer_mfu"),
        "plain_mfu": median("plain_mfu"),
        "sync_boundary_ms_per_sync": median("sync_boundary_ms_per_sync"),
        "peer_peak_bytes": median("peak_memory_bytes", "peer"),
        "plain_peak_bytes": median("peak_memory_bytes", "plain"),
        "model_state_bytes": 5 * 4 * num_params,  # replica, θ̄, outer momentum, AdamW's two moments (fp32)
        "helpers_peak_bytes": median("helpers_peak_bytes", "peer"),
        "helpers_uss_bytes": median("helpers_uss_bytes", "peer"),
        "helpers_pss_bytes": median("helpers_pss_bytes", "peer"),
        "rows": measured,
    }


def title(args: argparse.Namespace, summary: dict[str, Any]) -> str:
    """The docs section's title: device and precision, then what differs from the defaults."""
    device = summary["device"].split(":")[0]
    parts = [device, args.precision]
    if args.model != "small":
        parts.append(Path(args.model.removeprefix("hf:")).name)
    if args.algo != "cocodc":
        parts.append(args.algo)
    if (args.batch_size, args.seq_len) != (8, 128):
        parts.append(f"{args.batch_size}×{args.seq_len}")
    if device == "cpu":
        parts.append(f"{args.threads} thread{'s' if args.threads > 1 else ''}")
    return f"Inner loop against a plain PyTorch loop ({', '.join(parts)})"


def table(s: dict[str, Any]) -> str:
    """One row per repeat; MFU where the device's peak is known, the sync waits where recorded."""
    mfu = s["peak_flops"] is not None
    waits = s["sync_boundary_ms_per_sync"] is not None
    header = ["repeat", "first", "peer tok/s", "plain tok/s", "ratio"]
    header += ["peer MFU", "plain MFU"] if mfu else []
    header += ["syncs"] + (["sync wait ms/sync"] if waits else []) + ["stall s"]
    ends = all("finish_s" in row["peer"] for row in s["rows"])  # older trees do not record it
    header += ["end wait s"] if ends else []
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in s["rows"]:
        peer, plain = row["peer"], row["plain"]
        cells = [row["repeat"], row["first"], f"{peer['tokens_per_s']:.0f}", f"{plain['tokens_per_s']:.0f}"]
        cells.append(f"{row['ratio']:.3f}")
        if mfu:
            cells += [f"{100 * row['peer_mfu']:.1f} %", f"{100 * row['plain_mfu']:.1f} %"]
        cells.append(peer["rounds_done"])
        if waits:
            wait = row["sync_boundary_ms_per_sync"]
            cells.append("–" if wait is None else f"{wait:.1f}")
        cells.append(f"{peer['stall_s']:.2f}")
        if ends:
            cells.append(f"{peer['finish_s']:.2f}")
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def report(s: dict[str, Any]) -> str:
    """The docs section: the table of repeats and the summary's numbers, in words."""
    device = s["device"] + (f" ({s['device_name']})" if s["device_name"] else "")
    where = f"{device}, {os.cpu_count()} CPU cores (shared machine)"
    memory_kind = "CUDA allocator peak" if s["device"].startswith("cuda") else "peak resident set"
    o, n = s["options"], s["num_params"]
    run = f"`--algo {o['algo']}`, H = {o['inner_steps']}, {o['fragments']} fragments, overlap {o['overlap']}"
    code = "" if Path(s["code"]) == ROOT else f" Code: `{s['code']}`."
    spread = f"spread {s['min_ratio']:.3f} to {s['max_ratio']:.3f}"
    if s["peak_flops"] is not None:
        peak = f"the {s['peak_flops'] / 1e12:.0f} TFLOP/s dense bf16 peak"
        spread += (
            f". **MFU** (6 × {n / 1e6:.1f} M FLOPs per token × tokens/s ÷ {peak}): peer "
            f"{100 * s['peer_mfu']:.1f} %, plain loop {100 * s['plain_mfu']:.1f} % (medians)"
        )
    if s["sync_boundary_ms_per_sync"] is not None:
        wait = s["sync_boundary_ms_per_sync"]
        spread += f". The training thread waited {wait:.1f} ms per sync on sync work (median)"
    peer_peak, plain_peak, state = s["peer_peak_bytes"], s["plain_peak_bytes"], s["model_state_bytes"]
    over = f"**{peer_peak / state:.1f}×** it ({(peer_peak - plain_peak) / MB:+.0f} MB over the plain loop)"
    batch = f"{o['batch_size']} × {o['seq_len']} tokens"
    helpers = (
        f"{s['helpers_peak_bytes'] / MB:.0f} MB peak RSS, **{s['helpers_uss_bytes'] / MB:.0f} MB unique "
        f"(USS)** (target ≤ 600 MB), {s['helpers_pss_bytes'] / MB:.0f} MB PSS"
    )
    return f"""Tokens per second of a peer's inner loop (`join` in a swarm of one: every sync still runs
through the exchange and the outer step; {run})
divided by a plain PyTorch loop of the same model, batch ({batch}), device, precision
and optimizer ({s["optimizer"]}), each alone in its own process, one after the other, alternating which
goes first. The peer's tokens/s counts its training up to its last step, its waits for sync results
(stall) included; the end's wait for the syncs still in flight (end wait) is apart.
Device: **{where}**. Model `{o["model"]}` ({n / 1e6:.2f} M parameters), {o["precision"]}.{code}

Reproduce: `{s["command"]}`

{table(s)}

**Median ratio: {s["median_ratio"]:.3f}** (target ≥ 0.98), {spread}.

**Peak memory** ({memory_kind}, median over the repeats): peer {peer_peak / MB:.0f} MB, plain loop
{plain_peak / MB:.0f} MB; the model's own state (replica + θ̄ + outer momentum + AdamW, 5 × 4 bytes ×
{n / 1e6:.2f} M) is {state / MB:.0f} MB, so the peer holds {over}.
DHT + daemon (the peer's child processes, summed): {helpers}.
"""


if __name__ == "__main__":
    main()
