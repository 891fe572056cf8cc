"""Forged groups: what a member that hands out private groups costs the honest peers (issue 19).

Each repeat runs two swarms of four ``nano`` peers on 127.0.0.1, one after the other, same options:

- *clean*: four honest peers;
- *attacked*: three honest peers and one ``pairs`` member (``tests/hostile_peer.py``): at every
  round it reaches it hands each peer behind it in that round's line, and in the line of the next
  three rounds of the fragment, a GROUP of the two of them, which it never runs.

For the three honest peers (shards 0-2) it reports their speed (steps / wall time from the
summary), stall, syncs done and failed, whether they end with one θ̄, and whether each names the
attacker in ``accused``; then, per repeat, the attacked/clean ratio of the honest peers' median
speed, and the median ratio over the repeats. Issue 19 asks for ≥ 0.8 and one θ̄ every time.

    python benchmarks/forged_groups.py --repeat 3            # about 6 minutes on 2 cores
    python benchmarks/forged_groups.py --repeat 1 --steps 48 --workdir runs/forged

The peers run ``python -m p2p_cocodc`` (and ``python -m tests.hostile_peer``) with the working
directory of the invocation: run it from the tree you want to measure. Results go to
WORKDIR/results.json; every peer's log and --out stay in WORKDIR/RUN/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.swarm_procs import HOSTILE, end_group, records, spawn, start_bootstrap  # noqa: E402
from tests.tiny_options import TINY_MODEL, TINY_SYNCS  # noqa: E402

PEERS = 4
HONEST = 3


def run_swarm(workdir: Path, attacked: bool, steps: int, timeout_s: float) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    boot = start_bootstrap(workdir)
    options = [*TINY_MODEL, "--workers", str(PEERS), "--steps", str(steps), *TINY_SYNCS, "--threads", "1"]
    join = ["join", "--bootstrap", boot.host_port, "--run-id", "forged", *options, "--quiet"]
    procs = []
    try:
        for i in range(PEERS):
            args = [*join, "--shard", f"{i}/{PEERS}", "--out", f"peer{i}.jsonl"]
            if attacked and i == HONEST:
                procs.append(spawn(["pairs", *args], workdir, f"peer{i}.log", command=HOSTILE))
            else:
                procs.append(spawn(args, workdir, f"peer{i}.log"))
        codes = [proc.wait(timeout=timeout_s) for proc in procs]
    finally:
        for proc in [*procs, boot.proc]:
            end_group(proc)
    ends = [records(workdir / f"peer{i}.jsonl")[-1] for i in range(PEERS)]
    # a peer that ended with an error has no summary: it counts as 0 steps/s and no θ̄
    summaries = [e if e["kind"] == "summary" else {"steps": 0, "wall_time_s": 1.0} for e in ends]
    attacker = summaries[HONEST].get("peer_id")
    honest = summaries[:HONEST]
    return {
        "attacked": attacked,
        "exit_codes": codes,
        "steps_per_s": [s["steps"] / s["wall_time_s"] for s in honest],
        "stall_s": [round(s.get("stall_s", 0.0), 1) for s in honest],
        "rounds_done": [s.get("rounds_done") for s in honest],
        "rounds_failed": [s.get("rounds_failed") for s in honest],
        "one_theta": len({s.get("global_params_sha256") for s in honest}) == 1 and not any(codes[:HONEST]),
        "attacker_accused_by": sum(attacker in s.get("accused", {}) for s in honest),
        "honest_accused": sorted({p for s in honest for p in s.get("accused", {}) if p != attacker}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one swarm may take")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="forged-groups-"))
    runs, ratios = [], []
    for r in range(args.repeat):
        pair = [
            run_swarm(workdir / f"{kind}{r}", kind == "attacked", args.steps, args.timeout)
            for kind in ("clean", "attacked")
        ]
        clean, attacked = (statistics.median(run["steps_per_s"]) for run in pair)
        ratios.append(attacked / clean)
        for run in pair:
            runs.append(run)
            print(json.dumps(run))
        print(
            f"repeat {r}: honest median speed {clean:.2f} -> {attacked:.2f} steps/s, ratio {ratios[-1]:.2f}"
        )
    result = {
        "steps": args.steps,
        "runs": runs,
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "one_theta_every_time": all(run["one_theta"] for run in runs),
        "attacker_always_accused": all(
            run["attacker_accused_by"] == HONEST for run in runs if run["attacked"]
        ),
        "honest_never_accused": not any(run["honest_accused"] for run in runs),
    }
    (workdir / "results.json").write_text(json.dumps(result, indent=2))
    print(
        f"median attacked/clean speed of the honest peers: {result['median_ratio']:.2f} over {args.repeat} "
        f"repeats; one θ̄ every time: {result['one_theta_every_time']}; attacker accused by every honest "
        f"peer: {result['attacker_always_accused']}; honest never accused: {result['honest_never_accused']}"
    )
    print(f"results: {workdir / 'results.json'}")


if __name__ == "__main__":
    main()
