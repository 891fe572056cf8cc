"""Scaling: what one peer sends and how long a round takes as the swarm grows (issue 21, part 7).

Real swarms of 2, 3, 4 and 6 peers on 127.0.0.1 (``--peers``), each peer a ``join`` process with its
DHT and libp2p daemon (``nano``, cocodc, H = 16, K = 2, τ = 4, fp32, the configured pace), and the
simulator from 2 to 64 workers (``--workers``), same options. Per swarm: bytes each peer sent per
inner step (median over its peers; the butterfly sends 2(M−1)/M of each fragment, so this should
stay flat as M grows) and the mean round time a peer saw (from its arrival at a round to the
average, the others' arrivals included; real peers only: the simulator's rounds take what its link
model says). The table goes to stdout, the plot to ``--plot`` (docs/scaling.png by default).

    python benchmarks/scaling.py            # about 5 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.swarm_procs import records, run_cli, train_swarm  # noqa: E402

OPTIONS = [
    "--algo",
    "cocodc",
    "--model",
    "nano",
    "--tokenizer",
    "byte",
    "--seq-len",
    "32",
    "--batch-size",
    "4",
]
OPTIONS += [
    "--inner-steps",
    "16",
    "--fragments",
    "2",
    "--overlap",
    "4",
    "--eval-batches",
    "2",
    "--threads",
    "1",
]


def swarm(peers: int, steps: int, workdir: Path, timeout: float) -> list[dict]:
    """``peers`` real peers training ``steps`` steps together; their summaries."""
    options = ["--run-id", f"scale-{peers}", *OPTIONS, "--workers", str(peers), "--steps", str(steps)]
    options += ["--eval-every", str(steps), "--pace", "fixed"]
    return train_swarm(workdir, options, [[]] * peers, timeout)


def simulated(workers: int, steps: int, workdir: Path) -> dict:
    """The simulator's summary for ``workers`` workers."""
    workdir.mkdir(parents=True)
    args = [
        "simulate",
        *OPTIONS,
        "--workers",
        str(workers),
        "--steps",
        str(steps),
        "--eval-every",
        str(steps),
    ]
    done = run_cli([*args, "--out", "sim.jsonl", "--quiet"], workdir, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"simulate --workers {workers}: {done.stderr[-2000:]}")
    return records(workdir / "sim.jsonl")[-1]


def plot(real: dict[int, tuple[float, float]], sim: dict[int, float], path: Path) -> None:
    """Bytes per peer per step against the swarm's size (both), and the real peers' round time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(list(sim), list(sim.values()), "o-", label="simulator")
    left.plot(list(real), [v[0] for v in real.values()], "s-", label="real peers (127.0.0.1)")
    left.set(xscale="log", xlabel="swarm size M", ylabel="bytes per peer per inner step", ylim=(0, None))
    sizes = sorted({*sim, *real})
    left.set_xticks(sizes, [str(m) for m in sizes])
    left.minorticks_off()
    left.set_title("what one peer sends (butterfly: 2(M−1)/M of a fragment)")
    left.legend()
    right.plot(list(real), [v[1] for v in real.values()], "s-", color="C1")
    right.set(xlabel="swarm size M (real peers on 2 cores)", ylabel="mean round time, s", ylim=(0, None))
    right.set_title("round time a peer sees (arrival to average)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 3, 4, 6])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "scaling.png")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="scaling-"))
    real, sim = {}, {}
    print("| swarm | size | bytes per peer per step | mean round s (median over peers) | one θ̄ |")
    print("|---|---|---|---|---|")
    for m in args.peers:
        summaries = swarm(m, args.steps, workdir / f"peers-{m}", args.timeout)
        per_step = statistics.median(s["bytes_sent"] / args.steps for s in summaries)
        round_s = statistics.median(s["mean_round_s"] for s in summaries)
        one = len({s["global_params_sha256"] for s in summaries}) == 1
        real[m] = (per_step, round_s)
        print(
            f"| real peers | {m} | {per_step:,.0f} | {round_s:.3f} | {'yes' if one else 'NO'} |", flush=True
        )
    for m in args.workers:
        summary = simulated(m, args.steps, workdir / f"sim-{m}")
        sim[m] = summary["bytes_sent"] / args.steps
        print(f"| simulator | {m} | {sim[m]:,.0f} | – | – |", flush=True)
    if args.plot:
        plot(real, sim, args.plot)
        print(f"plot: {args.plot}")
    print(f"runs in {workdir}")


if __name__ == "__main__":
    main()
