"""The fragment exchange alone on a shaped link, beside raw TCP moving the same bytes the same way.

Needs root (network namespaces: ``tests/netns.py``). Three nodes on a link profile (``--profile
thin``: 2 Mbit/s, 100 ms round trip). In the same network, one after the other:

- **raw TCP, two phases**: each node sends X bytes to each other node over a connection opened
  beforehand, and once it has received X from each, X more to each: the traffic of a butterfly
  all-reduce (PARTs, then RESULTs) with nothing else, the floor of any exchange in two phases;
- **the exchange**: each node runs a DHT and a ``FragmentExchange`` (no notice board: every node's
  view of the others is fixed), and all three call ``allreduce`` on a vector of ``--numel`` values
  in ``--codec`` at the same moment, ``--rounds`` times, ``--period`` s apart; X is what one PART of
  that vector weighs. Three times: alone, beside a thread that trains a small model in the same
  process at the same CPU priority (as a peer's training thread ran until 2026-12-02), and beside
  one that yields the CPU as a peer's training thread now does (``peer/cpu.py``). On a 2-core
  machine, three such threads keep every core busy, as three training peers do.

For each, the time a node takes from the start to holding everything (for the exchange: from the
group's adoption, the summary's butterfly time), per node and round, and the goodput: the payload
a node sent ÷ (the link's rate × that time), as ``thin_link.py`` reports it for a training swarm.

    python benchmarks/exchange_floor.py --profile thin --codec q2 --numel 810000 --rounds 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PEERS = 3
TCP_PORT = 7000
LOADS = {  # what runs beside each node's exchange
    "none": "FragmentExchange, nothing else running",
    "same": "FragmentExchange beside a training thread at the same CPU priority",
    "yields": "FragmentExchange beside a training thread that yields (peer/cpu.py)",
}


def raw_tcp_node(me: int, addrs: list[str], size: int, rounds: int, t0: float, period: float) -> list[float]:
    """One node of the raw-TCP exchange: seconds per round from its start to holding 2·X from each."""
    others = [i for i in range(len(addrs)) if i != me]
    received = dict.fromkeys(others, 0)
    arrived = threading.Condition()
    server = socket.create_server((addrs[me], TCP_PORT))

    def read(conn: socket.socket, peer: int) -> None:
        while data := conn.recv(1 << 16):
            with arrived:
                received[peer] += len(data)
                arrived.notify_all()

    def accept() -> None:
        for _ in others:
            conn, (host, _) = server.accept()
            threading.Thread(target=read, args=(conn, addrs.index(host)), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    time.sleep(max(0.0, t0 - 2.0 - time.monotonic()))  # every node listens by then
    out = {i: socket.create_connection((addrs[i], TCP_PORT)) for i in others}
    payload = b"\0" * size
    expected, took = 0, []
    for r in range(rounds):
        time.sleep(max(0.0, t0 + r * period - time.monotonic()))
        started = time.monotonic()
        for _phase in range(2):
            for i in others:
                threading.Thread(target=out[i].sendall, args=(payload,), daemon=True).start()
            expected += size
            with arrived:
                arrived.wait_for(lambda total=expected: all(received[i] >= total for i in others))
        took.append(time.monotonic() - started)
    return took


async def written(paths: list[Path], what: str, within_s: float = 60.0) -> list[str]:
    """The texts of ``paths`` once every one is written by the process that owns it."""
    deadline = time.monotonic() + within_s
    while not all(p.exists() and p.read_text() for p in paths):
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} did not start within {within_s:.0f} s")
        await asyncio.sleep(0.1)
    return [p.read_text() for p in paths]


async def exchange_node(args: argparse.Namespace) -> dict:
    import torch

    from p2p_cocodc.algorithms.codecs import get_codec
    from p2p_cocodc.peer.cpu import training_yields_cpu
    from p2p_cocodc.swarm.dht import start_dht
    from p2p_cocodc.swarm.exchange import FragmentExchange
    from p2p_cocodc.swarm.records import PeerRecord

    first = Path(args.first)
    if args.node == 0:
        dht = start_dht([], args.addrs[0], 0)
        first.write_text(str(dht.get_visible_maddrs()[0]))
    else:
        (maddr,) = await written([first], "node 0's DHT")
        dht = start_dht([maddr], args.addrs[args.node], 0)
    p2p = await dht.replicate_p2p()
    Path(f"{args.ids}.{args.node}").write_text(p2p.peer_id.to_base58())
    peers = await written([Path(f"{args.ids}.{i}") for i in range(PEERS)], "the other nodes")
    view = {peer: PeerRecord("training", 0, i, PEERS, 0.0, args.mbps, "b") for i, peer in enumerate(peers)}
    codec = get_codec(args.codec)
    exchange = FragmentExchange(
        p2p, "floor", codec, args.node, "b", lambda: view, 120.0, link_mbps=args.mbps,
        round_bytes=codec.round_bytes(args.numel, PEERS),
    )  # fmt: skip
    await exchange.start()
    stop = threading.Event()
    if args.load != "none":  # a training loop beside the exchange: one thread of small torch steps
        torch.set_num_threads(1)

        def train() -> None:
            if args.load == "yields":
                training_yields_cpu()  # as a peer's training thread does
            model = torch.nn.Sequential(
                torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)
            )
            optimizer = torch.optim.AdamW(model.parameters())
            batch = torch.randn(64, 256)
            while not stop.is_set():
                optimizer.zero_grad()
                model(batch).square().mean().backward()
                optimizer.step()

        trainer = threading.Thread(target=train, daemon=True)
        trainer.start()
    butterflies = []
    for r in range(args.rounds):
        # outer gradients alike in direction (screening keeps every member), new every round
        vector = torch.randn(args.numel, generator=torch.Generator().manual_seed(r))
        vector += 0.3 * torch.randn(
            args.numel, generator=torch.Generator().manual_seed(1000 * r + args.node + 1)
        )
        await asyncio.sleep(max(0.0, args.t0 + r * args.period - time.monotonic()))
        before = exchange.stats.butterflies_s
        await exchange.allreduce(f"r{r}", vector, r)
        butterflies.append(exchange.stats.butterflies_s - before)
    await asyncio.sleep(2.0)  # the others' last acknowledgements
    stop.set()
    if args.load != "none":
        trainer.join()  # a torch thread still running at the interpreter's exit aborts it
    await exchange.stop()
    sent = exchange.stats.bytes_sent
    dht.shutdown()
    return {"node": args.node, "butterflies": butterflies, "bytes_sent": sent}


def node_main(args: argparse.Namespace) -> None:
    if args.mode == "tcp":
        took = raw_tcp_node(args.node, args.addrs, args.size, args.rounds, args.t0, args.period)
        print(json.dumps({"node": args.node, "butterflies": took}), flush=True)
    else:
        print(json.dumps(asyncio.run(exchange_node(args))), flush=True)


def run(args: argparse.Namespace) -> None:
    import tempfile

    from p2p_cocodc.algorithms.butterfly import slice_sizes
    from p2p_cocodc.algorithms.codecs import get_codec
    from tests.netns import PROFILES, thin_network

    profile = PROFILES[args.profile] if args.profile else None
    mbps, rtt_ms = (profile.mbit, profile.rtt_ms) if profile else (args.mbps, args.rtt_ms)
    codec = get_codec(args.codec)
    part = codec.wire_bytes(slice_sizes(args.numel, PEERS, codec.block)[0])
    rate = mbps * 1e6 / 8
    with thin_network(PEERS, mbps, rtt_ms=rtt_ms) as net, tempfile.TemporaryDirectory() as tmp:
        addrs = ",".join(n.address for n in net.nodes)
        rows = []
        for trial in range(args.repeat):
            for mode, load in (("tcp", "none"), *(("exchange", load) for load in LOADS)):
                t0 = time.monotonic() + (4.0 if mode == "tcp" else 25.0)
                common = [str(Path(__file__)), "--as-node", mode, "--addrs", addrs, "--t0", str(t0)]
                common += ["--period", str(args.period), "--rounds", str(args.rounds), "--mbps", str(mbps)]
                common += ["--codec", args.codec, "--numel", str(args.numel), "--size", str(part)]
                common += ["--first", f"{tmp}/first-{trial}-{load}", "--ids", f"{tmp}/ids-{trial}-{load}"]
                common += ["--load", load]
                procs = [
                    net.popen_in(
                        n,
                        [sys.executable, *common, "--node", str(n.index)],
                        stdout=subprocess.PIPE,
                        text=True,
                        cwd=ROOT,
                    )
                    for n in net.nodes
                ]
                outs = []
                for proc in procs:
                    out, _ = proc.communicate(timeout=60 + 30 + args.rounds * args.period * 2)
                    outs.append(json.loads(out.strip().splitlines()[-1]))
                times = [t for o in outs for t in o["butterflies"]]
                sent = 4 * part  # two PARTs and two RESULTs per node and round
                median = statistics.median(times)
                what = LOADS[load] if mode == "exchange" else "raw TCP, two phases"
                goodput = sent / (rate * median)
                rows.append((trial, what, median, goodput))
                listed = sorted(round(t, 2) for t in times)
                print(
                    f"trial {trial}, {what}: median {median:.3f} s, goodput {goodput:.3f}; {listed}",
                    flush=True,
                )
    print(f"\n{PEERS} nodes, {mbps} Mbit/s, {rtt_ms} ms round trip, {args.numel} values in {args.codec}: "
          f"{part} bytes a PART")  # fmt: skip
    print("| trial | what | median s (round, node) | goodput ÷ shaped bandwidth |")
    print("|---|---|---|---|")
    for trial, what, median, goodput in rows:
        print(f"| {trial} | {what} | {median:.3f} | {goodput:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", help="a named link (tests/netns.py PROFILES)")
    parser.add_argument("--mbps", type=float, default=2.0)
    parser.add_argument("--rtt-ms", type=float, default=100.0)
    parser.add_argument("--codec", default="q2")
    parser.add_argument(
        "--numel", type=int, default=810_000, help="values averaged per round (a fragment of `small`)"
    )
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--period", type=float, default=5.0, help="seconds between round starts")
    parser.add_argument("--repeat", type=int, default=2, help="trials, each raw TCP then the exchange")
    parser.add_argument("--as-node", dest="mode", help=argparse.SUPPRESS)
    parser.add_argument("--load", default="none", choices=sorted(LOADS), help=argparse.SUPPRESS)
    parser.add_argument("--node", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--addrs", type=lambda s: s.split(","), help=argparse.SUPPRESS)
    parser.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--first", help=argparse.SUPPRESS)
    parser.add_argument("--ids", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        node_main(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
