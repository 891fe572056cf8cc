"""Uneven regions, as the swarm trains today: three peers on 127.0.0.1, one of them slower. Issue 21,
part 4's first measure: how long the fast regions wait for the slow one.

Every peer's inner step is held to a floor with ``--min-step-time`` (the rest of the step slept), so
the machine's own speed does not set the ratio: "even" runs every peer at ``--step`` seconds,
"uneven" runs peer 2 at ``--slow`` × that. Per run and peer, from the summary: wall time, stall
(waits for sync results) and its share of the wall time, training tokens/s, and whether the θ̄ agree.
Runs alternate even and uneven; the last lines give the medians over ``--repeat`` pairs.

    python benchmarks/uneven_regions.py --repeat 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.swarm_procs import train_swarm  # noqa: E402

PEERS = 3


def run(name: str, floors: list[float], args: argparse.Namespace, workdir: Path) -> list[dict]:
    """One run of three peers, peer i's steps held to ``floors[i]`` seconds; their summaries."""
    options = ["--run-id", name, "--algo", args.algo]
    options += ["--model", "nano", "--tokenizer", "byte", "--seq-len", "32", "--batch-size", "4"]
    options += ["--workers", str(PEERS), "--steps", str(args.steps), "--inner-steps", str(args.inner_steps)]
    options += ["--fragments", "2", "--eval-every", str(args.steps), "--eval-batches", "2", "--threads", "1"]
    return train_swarm(workdir, options, [["--min-step-time", str(floor)] for floor in floors], args.timeout)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=3, help="pairs of runs (even, uneven)")
    parser.add_argument("--step", type=float, default=0.05, help="the fast peers' step time floor, seconds")
    parser.add_argument("--slow", type=float, default=2.0, help="the slow peer's step time, × --step")
    parser.add_argument("--algo", default="cocodc")
    parser.add_argument("--steps", type=int, default=192)
    parser.add_argument("--inner-steps", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="uneven-"))
    layouts = {"even": [args.step] * PEERS, "uneven": [args.step] * (PEERS - 1) + [args.step * args.slow]}
    share: dict[str, list[float]] = {name: [] for name in layouts}  # the fast peers' stall share, per run
    wall: dict[str, list[float]] = {name: [] for name in layouts}
    print("| run | peer | step floor s | wall s | stall s | stall share | tokens/s | one θ̄ |")
    print("|---|---|---|---|---|---|---|---|")
    for repeat in range(args.repeat):
        for name, floors in layouts.items():
            summaries = run(f"{name}-{repeat}", floors, args, workdir / f"{name}-{repeat}")
            one = len({s["global_params_sha256"] for s in summaries}) == 1
            for i, (s, floor) in enumerate(zip(summaries, floors, strict=True)):
                stalled = s["stall_s"] / s["wall_time_s"]
                print(
                    f"| {name} {repeat} | {i} | {floor:g} | {s['wall_time_s']:.1f} | {s['stall_s']:.1f} | "
                    f"{stalled:.1%} | {s['tokens_per_s']:.0f} | {'yes' if one else 'NO'} |",
                    flush=True,
                )
            fast = [s for s, floor in zip(summaries, floors, strict=True) if floor == args.step]
            share[name].append(statistics.median(s["stall_s"] / s["wall_time_s"] for s in fast))
            wall[name].append(statistics.median(s["wall_time_s"] for s in fast))
    for name in layouts:
        print(
            f"{name}: the fast peers stalled a median {statistics.median(share[name]):.1%} of their wall "
            "time "
            f"({statistics.median(wall[name]):.1f} s for {args.steps} steps)"
        )
    print(f"runs in {workdir}")


if __name__ == "__main__":
    main()
