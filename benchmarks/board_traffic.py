"""The swarm's own traffic between rounds: what each peer sends while it trains and syncs nothing.

Needs root (network namespaces, ``tests/netns.py``). A bootstrap and three peers on the ``thin``
profile (2 Mbit/s, 100 ms), each peer training ``small`` with DiLoCo and H = --steps, so that no
round runs in the measured window: all a peer sends there is the notice board (its publishes, its
reads' answers to the others), the DHT's upkeep and libp2p's. Each peer's uplink is tbf's byte
counter on its own TUN, read every second; the figure is bytes per second between --from and
--to seconds after the peers started (all of them are training by then).

Each ``--tree`` is a checkout of this project (a ``git worktree`` of an older commit, say); the
peers run that tree's code, one run per tree and repeat, the trees' order alternating between
repeats, so the figures are side by side on the same machine and link:

    git worktree add /tmp/before f88eaf6
    python benchmarks/board_traffic.py --tree /tmp/before --tree . --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from thin_link import BOOT_PORT, PEERS, STATUS_PORT, tbf_counters  # noqa: E402

from tests.netns import netns_unavailable_reason, wan_network  # noqa: E402

STEP_S = 0.4  # --min-step-time: the peers train for the whole window whatever the machine's speed


def peer_argv(host: str, boot: str, index: int, steps: int, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "p2p_cocodc", "join", "--bootstrap", f"{boot}:{STATUS_PORT}", "--host", host,
        "--run-id", "board", "--shard", f"{index}/{PEERS}", "--algo", "diloco", "--model", "small",
        "--tokenizer", "byte", "--seq-len", "64", "--batch-size", "4", "--workers", str(PEERS),
        "--steps", str(steps), "--inner-steps", str(steps), "--eval-every", str(steps), "--threads", "1",
        "--min-step-time", str(STEP_S), "--bandwidth-mbps", "2", "--quiet", "--out", str(out),
    ]  # fmt: skip


def one_run(tree: Path, args: argparse.Namespace, workdir: Path) -> list[float]:
    """Each peer's uplink bytes per second in the window, running ``tree``'s code."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    steps = int((args.to + 60) / STEP_S)  # never reaches its one sync inside the window
    workdir.mkdir(parents=True)
    with wan_network(PEERS, "thin") as net:
        boot_log = open(workdir / "bootstrap.log", "w")  # noqa: SIM115 - closed with the network
        address = workdir / "bootstrap.json"
        boot = [sys.executable, "-m", "p2p_cocodc", "bootstrap", "--host", net.switch_address]
        boot += ["--port", str(BOOT_PORT), "--status-port", str(STATUS_PORT), "--address-file", str(address)]
        kw: dict[str, Any] = {"cwd": tree, "env": env, "stderr": subprocess.STDOUT, "start_new_session": True}
        net.popen_in(net.switch, boot, stdout=boot_log, **kw)
        deadline = time.monotonic() + 60
        while not address.exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"the bootstrap did not start in 60 s: see {workdir / 'bootstrap.log'}")
            time.sleep(0.2)
        peers = []
        for i, node in enumerate(net.nodes):
            log = open(workdir / f"peer{i}.log", "w")  # noqa: SIM115 - closed with the network
            argv = peer_argv(node.address, net.switch_address, i, steps, workdir / f"peer{i}.jsonl")
            peers.append(net.popen_in(node, argv, stdout=log, **kw))
        t0, samples = time.monotonic(), []
        while (now := time.monotonic() - t0) < args.to + 1:
            if any(p.poll() is not None for p in peers):
                raise SystemExit(f"a peer ended before the window did: see {workdir}/peer*.log")
            sent = [tbf_counters(net, n.ns).get(n.iface, {}).get("bytes", 0) for n in net.nodes]
            samples.append((now, sent))
            time.sleep(1.0)
    (workdir / "samples.json").write_text(json.dumps(samples))
    start = min(samples, key=lambda s: abs(s[0] - args.since))
    end = min(samples, key=lambda s: abs(s[0] - args.to))
    return [(b - a) / (end[0] - start[0]) for a, b in zip(start[1], end[1], strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", type=Path, action="append", help="a checkout whose code the peers run")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--from", dest="since", type=float, default=25.0, help="window start, s")
    parser.add_argument("--to", type=float, default=70.0, help="window end, s")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    if (reason := netns_unavailable_reason()) is not None:
        raise SystemExit(f"board_traffic.py needs network namespaces: {reason}")
    trees = [t.resolve() for t in (args.tree or [ROOT])]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="board-traffic-"))
    rates: dict[Path, list[float]] = {t: [] for t in trees}
    for r in range(args.repeat):
        for t in trees if r % 2 == 0 else trees[::-1]:
            per_peer = one_run(t, args, workdir / f"{t.name}-{r}")
            rates[t] += per_peer
            print(f"repeat {r} {t}: " + ", ".join(f"{x / 1000:.1f}" for x in per_peer) + " kB/s", flush=True)
    first = statistics.median(rates[trees[0]])
    print("| tree | uplink between rounds, kB/s per peer (median; all) | ÷ first |")
    print("|---|---|---|")
    for t in trees:
        med = statistics.median(rates[t])
        every = ", ".join(f"{x / 1000:.1f}" for x in rates[t])
        print(f"| {t} | {med / 1000:.1f} ({every}) | {med / first:.2f} |")


if __name__ == "__main__":
    main()
