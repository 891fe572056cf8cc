"""A peer stopped for a long time (SIGSTOP, then SIGCONT: a suspended VM, a laptop lid) rejoins
through the resync path and ends with the swarm's θ̄ (issue 19, item 6).

Three ``nano`` peers on 127.0.0.1 (the tests' options, ``--pace fixed``) train ``--steps`` steps; once
training is under way, the peer that is not the round leader (and not shard 0) is stopped for each
``--stop-s`` in turn, in its own swarm. The others must train through the stop, so ``--steps`` must
outlast it: at about 30 steps/s here, give 60 × the stop in seconds, plus 2,000.

For each stop it reports: the sleeper's exit code, whether it said it was stopped and took the
swarm's state again (``resyncs``), the others' exit codes, whether all three end with one θ̄, and
the stall and failed syncs of the others. The tests cover the heartbeat's arithmetic with made-up
times (``tests/test_presence.py``: 60 s, 5 min, 30 min) and a real 17 s stop
(``tests/test_restarts.py``); this is the real thing at lengths a suite cannot wait for.

    python benchmarks/sleeping_peer.py --stop-s 60 --steps 6000       # about 4 minutes on 2 cores
    python benchmarks/sleeping_peer.py --stop-s 300 --steps 20000     # about 12 minutes

Every peer's log and --out stay in WORKDIR/stop-N/; the results go to WORKDIR/results.json.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.swarm_procs import (  # noqa: E402
    end_group,
    evals,
    records,
    round_leader_shard,
    start_bootstrap,
    start_three_training,
)


def sleep_once(workdir: Path, stop_s: float, steps: int) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    boot = start_bootstrap(workdir)
    peers: list[Any] = []
    try:
        outs = start_three_training(workdir, boot, "sleep", steps, peers)
        leader = round_leader_shard(boot.host_port, "sleep")
        sleeper = next(i for i in (1, 2, 0) if i != leader)
        others = [i for i in range(3) if i != sleeper]
        peers[sleeper].send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            before = [evals(outs[i]) for i in others]
            while time.monotonic() - stopped_at < stop_s:
                if any(peers[i].poll() is not None for i in others):
                    raise RuntimeError(f"a peer ended while peer {sleeper} slept: give more --steps")
                time.sleep(1.0)  # a benchmark's own pacing, not a protocol's order
            trained = [evals(outs[i]) - n for i, n in zip(others, before, strict=True)]
        finally:
            peers[sleeper].send_signal(signal.SIGCONT)
        codes = {i: peers[i].wait(timeout=steps / 5 + 600) for i in range(3)}
    finally:
        for proc in [*peers, boot.proc]:
            end_group(proc)
    summaries = {i: records(outs[i])[-1] for i in range(3)}
    log = (workdir / f"peer{sleeper}.log").read_text()
    woke = next((line for line in log.splitlines() if "was stopped for" in line), None)
    finished = all(s.get("kind") == "summary" for s in summaries.values())
    return {
        "stop_s": stop_s,
        "steps": steps,
        "sleeper": sleeper,
        "exit_codes": codes,
        "others_evals_while_asleep": trained,
        "woke_line": woke,
        "sleeper_resyncs": summaries[sleeper].get("resyncs"),
        "one_theta": finished and len({s["global_params_sha256"] for s in summaries.values()}) == 1,
        "others_stall_s": [summaries[i].get("stall_s") for i in others],
        "others_rounds_failed": [summaries[i].get("rounds_failed") for i in others],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stop-s", type=float, nargs="+", default=[60.0])
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="sleeping-peer-"))
    results = []
    for stop_s in args.stop_s:
        result = sleep_once(workdir / f"stop-{stop_s:g}", stop_s, args.steps)
        results.append(result)
        print(json.dumps(result), flush=True)
    (workdir / "results.json").write_text(json.dumps(results, indent=1))
    print(f"results in {workdir / 'results.json'}")


if __name__ == "__main__":
    main()
