"""Messages the libp2p daemons lose when a sender closes its stream at once (``wire.close_when_read``).

Two hivemind P2P daemons on 127.0.0.1; one writes ``--messages`` small frames to the other, each on a
stream of its own, ``--concurrency`` at a time, while ``--load`` busy processes (started here, ended
here) load the machine's cores as three training peers do. Each repeat runs both ways of ending a
stream in turn:

- ``at once``: write, then close our end (the exchange before this benchmark);
- ``when read``: write, then close once the receiver has read the frame and closed its end.

A message is lost when the receiver's handler never reads it whole, while the sender saw no error.

    python benchmarks/lost_messages.py --repeat 4
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from p2p_cocodc.swarm.wire import close_when_read, read_frame, write_frame  # noqa: E402

PROTOCOL = "lost-messages"


async def one_run(count: int, concurrency: int, when_read: bool) -> dict[str, int | float]:
    from hivemind.p2p import P2P

    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
    client = await P2P.create(
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        initial_peers=[str(m) for m in await server.get_visible_maddrs()],
        nat_port_map=False,
    )
    read: set[int] = set()
    cut_short = send_errors = 0

    async def serve(_info, reader, writer) -> None:
        nonlocal cut_short
        try:
            read.add((await read_frame(reader, 10.0))["i"])
        except Exception:  # noqa: BLE001 - counted: a frame cut short
            cut_short += 1
        finally:
            writer.close()

    async def send(i: int, turns: asyncio.Semaphore) -> None:
        nonlocal send_errors
        async with turns:
            try:
                _, reader, writer = await client.call_binary_stream_handler(server.peer_id, PROTOCOL)
                await write_frame(writer, {"i": i, "pad": b"x" * 200})
            except Exception:  # noqa: BLE001 - an error the sender saw: not a silent loss
                send_errors += 1
                return
            if when_read:
                await close_when_read(reader, writer, 10.0)
            else:
                writer.close()

    await server.add_binary_stream_handler(PROTOCOL, serve)
    turns = asyncio.Semaphore(concurrency)
    started = time.perf_counter()
    try:
        await asyncio.gather(*(send(i, turns) for i in range(count)))
        deadline = time.monotonic() + 10.0  # a frame still in flight is given time to arrive
        while len(read) + cut_short + send_errors < count and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    finally:
        await client.shutdown()
        await server.shutdown()
    lost = count - len(read) - send_errors
    return {
        "read": len(read),
        "cut": cut_short,
        "errors": send_errors,
        "lost": lost,
        "s": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--load", type=int, default=3, help="busy processes beside the two daemons")
    parser.add_argument("--repeat", type=int, default=4)
    args = parser.parse_args()
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    totals = {"at once": [0, 0], "when read": [0, 0]}  # lost, sent
    print("| repeat | stream closed | sent | read | cut short | send errors | lost silently | s |")
    print("|---|---|---|---|---|---|---|---|")
    try:
        for repeat in range(args.repeat):
            for name, when_read in (("at once", False), ("when read", True)):
                r = asyncio.run(one_run(args.messages, args.concurrency, when_read))
                totals[name][0] += int(r["lost"])
                totals[name][1] += args.messages
                print(
                    f"| {repeat} | {name} | {args.messages} | {r['read']} | {r['cut']} | {r['errors']} | "
                    f"{r['lost']} | {r['s']:.1f} |",
                    flush=True,
                )
    finally:
        for process in load:
            process.kill()
            process.wait()
    for name, (lost, sent) in totals.items():
        print(f"closed {name}: {lost} of {sent} messages lost silently")


if __name__ == "__main__":
    main()
