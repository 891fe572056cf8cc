"""Uneven regions: three peers on 127.0.0.1, one of them slower (issue 21, part 4). How long the fast
regions wait for the slow one, and how soon the run reaches a given perplexity, when the slow
region (a) makes the others wait (``--inner-share 1``, what the swarm did before), (b) trains its
share of the steps (``--inner-share auto``: DyLU, ``algorithms/inner_share.py``), or (c) is left out
(two peers).

Every peer's inner step is held to a floor with ``--min-step-time`` (the rest of the step slept), so
the machine's own speed does not set the ratio: the fast peers run at ``--step`` seconds, the slow
one at ``--slow`` × that ("even": all three fast, for reference). Per run and peer, from the
summary: wall time, stall (waits for sync results) and its share of the wall time, steps trained,
training tokens/s, and whether the θ̄ agree. Per run, from peer 0's evaluations of θ̄: the wall time
at which θ̄ first reached the target perplexity (the highest final perplexity of the uneven layouts
in that repeat, so every one of them reaches it). Layouts run in turn within each repeat; the last
lines give the medians over ``--repeat`` repeats.

    python benchmarks/uneven_regions.py --repeat 3
    python benchmarks/uneven_regions.py --repeat 3 --batch-size 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.swarm_procs import records, train_swarm  # noqa: E402
from tests.tiny_options import TINY_MODEL  # noqa: E402

LAYOUTS = {  # the peers' step floors (× --step) and --inner-share
    "even": ([1, 1, 1], "1"),
    "wait": ([1, 1, None], "1"),
    "share": ([1, 1, None], "auto"),
    "without": ([1, 1], "1"),
}


def run(
    name: str, floors: list[float], inner_share: str, args: argparse.Namespace, workdir: Path
) -> list[dict]:
    """One run of len(floors) peers, peer i's steps held to ``floors[i]`` seconds; their summaries,
    each with its run's evaluations under "evals"."""
    options = ["--run-id", name, "--algo", args.algo, "--inner-share", inner_share]
    options += [*TINY_MODEL[:-1], str(args.batch_size)]  # nano on bytes, --batch-size as given
    options += [
        "--workers",
        str(len(floors)),
        "--steps",
        str(args.steps),
        "--inner-steps",
        str(args.inner_steps),
    ]
    options += [
        "--fragments",
        "2",
        "--eval-every",
        str(args.eval_every),
        "--eval-batches",
        "4",
        "--threads",
        "1",
    ]
    summaries = train_swarm(
        workdir, options, [["--min-step-time", str(floor)] for floor in floors], args.timeout
    )
    evals = [r for r in records(workdir / "peer0.jsonl") if r["kind"] == "eval"]
    return [{**s, "evals": evals} for s in summaries]


def time_to(evals: list[dict], target: float) -> float | None:
    """The wall time of the first evaluation of θ̄ at or below ``target`` perplexity (None: never)."""
    return next((e["wall_time_s"] for e in evals if e["val_ppl"] <= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=3, help="repeats of every layout")
    parser.add_argument("--step", type=float, default=0.05, help="the fast peers' step time floor, seconds")
    parser.add_argument("--slow", type=float, default=2.0, help="the slow peer's step time, × --step")
    parser.add_argument("--algo", default="cocodc")
    parser.add_argument("--steps", type=int, default=192)
    parser.add_argument("--inner-steps", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=16)
    parser.add_argument(
        "--batch-size", type=int, default=4, help="1: noisier gradients, where more data helps"
    )
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="uneven-"))
    stall: dict[str, list[float]] = {name: [] for name in LAYOUTS}  # the fast peers' stall share, per run
    wall: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    reach: dict[str, list[float]] = {name: [] for name in LAYOUTS}  # wall time to the target perplexity
    print(
        "| run | peer | step floor s | share | steps trained | wall s | stall s | stall share | tokens/s "
        "| one θ̄ |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for repeat in range(args.repeat):
        runs = {}
        for name, (factors, inner_share) in LAYOUTS.items():
            floors = [args.step * (args.slow if f is None else f) for f in factors]
            summaries = run(f"{name}-{repeat}", floors, inner_share, args, workdir / f"{name}-{repeat}")
            runs[name] = summaries
            one = len({s["global_params_sha256"] for s in summaries}) == 1
            for i, (s, floor) in enumerate(zip(summaries, floors, strict=True)):
                print(
                    f"| {name} {repeat} | {i} | {floor:g} | {s['inner_share']:.3g} | {s['steps_trained']} | "
                    f"{s['wall_time_s']:.1f} | {s['stall_s']:.1f} | {s['stall_s'] / s['wall_time_s']:.1%} | "
                    f"{s['tokens_per_s']:.0f} | {'yes' if one else 'NO'} |",
                    flush=True,
                )
            fast = [s for s, floor in zip(summaries, floors, strict=True) if floor == args.step]
            stall[name].append(statistics.median(s["stall_s"] / s["wall_time_s"] for s in fast))
            wall[name].append(statistics.median(s["wall_time_s"] for s in fast))
        target = max(runs[name][0]["final_val_ppl"] for name in ("wait", "share", "without"))
        for name, summaries in runs.items():
            reached = time_to(summaries[0]["evals"], target)
            reach[name].append(reached if reached is not None else float("inf"))
            print(
                f"repeat {repeat}, {name}: final ppl {summaries[0]['final_val_ppl']:.2f}, "
                f"ppl {target:.2f} at {reached} s"
            )
    print("| layout | fast peers' stall share | wall s | wall s to the target ppl |")
    print("|---|---|---|---|")
    for name in LAYOUTS:
        print(
            f"| {name} | {statistics.median(stall[name]):.1%} | {statistics.median(wall[name]):.1f} | "
            f"{statistics.median(reach[name]):.1f} |"
        )
    print(f"runs in {workdir}")


if __name__ == "__main__":
    main()
