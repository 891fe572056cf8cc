"""Why the swarm runs its own fragment exchange: round time against hivemind's DecentralizedAverager.

Three peers in one process on 127.0.0.1 (real DHT nodes, real p2pd daemons) average the same
vector, alternately with our ``FragmentExchange`` (leader-formed group + butterfly all-reduce over
libp2p streams) and with one ``DecentralizedAverager`` per peer (hivemind's matchmaking and
all-reduce, in a process of its own per averager). Reports the median wall time of a round for each,
side by side, and prints a markdown table for docs/swarm.md.

    python benchmarks/exchange_vs_averager.py --numel 1000000 --rounds 7
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from p2p_cocodc.algorithms.codecs import get_codec
from p2p_cocodc.swarm.dht import start_dht
from p2p_cocodc.swarm.exchange import FragmentExchange
from p2p_cocodc.swarm.records import PeerRecord

PEERS = 3


async def exchange_rounds(dhts: list, vectors: list[torch.Tensor], rounds: int) -> list[float]:
    p2ps = [await d.replicate_p2p() for d in dhts]
    view = {
        p.peer_id.to_base58(): PeerRecord("training", 0, i, PEERS, 0.0, 0.0, "b") for i, p in enumerate(p2ps)
    }
    exchanges = [
        FragmentExchange(p, "bench", get_codec("fp32"), i, "b", lambda: view, 60.0)
        for i, p in enumerate(p2ps)
    ]
    for ex in exchanges:
        await ex.start()
    times = []
    for r in range(rounds):
        started = time.perf_counter()
        await asyncio.gather(*(ex.allreduce(f"r{r}", v, r) for ex, v in zip(exchanges, vectors, strict=True)))
        times.append(time.perf_counter() - started)
    for ex in exchanges:
        await ex.stop()
    return times


async def averager_rounds(dhts: list, vectors: list[torch.Tensor], rounds: int) -> list[float]:
    from hivemind.averaging import DecentralizedAverager

    averagers = [
        DecentralizedAverager(
            [v.clone()], d, start=True, prefix="bench_frag0", target_group_size=PEERS, min_group_size=2,
            min_matchmaking_time=1.0, request_timeout=1.0, allreduce_timeout=60.0,
        )
        for d, v in zip(dhts, vectors, strict=True)
    ]  # fmt: skip
    times = []
    try:
        for _ in range(rounds):
            for avg, v in zip(averagers, vectors, strict=True):
                with avg.get_tensors() as (buf,):
                    buf.copy_(v)
            started = time.perf_counter()
            groups = await asyncio.gather(*(asyncio.wrap_future(a.step(wait=False)) for a in averagers))
            times.append(time.perf_counter() - started)
            if any(g is None or len(g) != PEERS for g in groups):
                raise RuntimeError("an averager round formed a partial group")
    finally:
        for avg in averagers:
            avg.shutdown()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    vectors = [torch.randn(args.numel) for _ in range(PEERS)]
    first = start_dht([], "127.0.0.1", 0)
    dhts = [first] + [
        start_dht([str(first.get_visible_maddrs()[0])], "127.0.0.1", 0) for _ in range(PEERS - 1)
    ]
    try:
        ours = asyncio.run(exchange_rounds(dhts, vectors, args.rounds))
        theirs = asyncio.run(averager_rounds(dhts, vectors, args.rounds))
    finally:
        for d in dhts:
            d.shutdown()
    setting = f"{args.numel:,} fp32 values, {PEERS} peers, {args.rounds} rounds"
    print(f"| method | median s per round ({setting}) | all rounds |")
    print("|---|---|---|")
    for name, times in (("FragmentExchange (ours)", ours), ("DecentralizedAverager", theirs)):
        print(f"| {name} | {statistics.median(times):.3f} | {', '.join(f'{t:.2f}' for t in times)} |")


if __name__ == "__main__":
    main()
