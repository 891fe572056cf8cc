"""Each codec's encode and decode time, beside the same codecs at another commit, in one process.

A round's arithmetic sits between its two phases on the link: a member encodes its vector before
its first PART leaves, an owner decodes its members' slices, combines them and encodes the mean
before its RESULTs leave, and a member decodes the means before it holds the average. Here one
slice of ``--numel`` values (a third of a `small` fragment by default, a slice of a `thin` round)
is encoded and decoded ``--repeat`` times by each codec, with one torch thread, as a peer's worker
thread does; the median time of each is reported. With ``--against REV``, the codecs module of that
commit (``git show REV:p2p_cocodc/algorithms/codecs.py``) is loaded beside this one and timed in
turn with it, so the ratio is measured side by side, and every payload and decoded value of
the two is compared bit for bit (a faster codec must send and decode the same bits).

    python benchmarks/codec_speed.py --against b809bdb --codecs q2 q1 fp4
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2p_cocodc.algorithms import codecs  # noqa: E402
from p2p_cocodc.names import CODEC_NAMES  # noqa: E402


def codecs_at(rev: str, folder: Path) -> ModuleType:
    """The codecs module as it was at ``rev``, loaded under a name of its own."""
    source = subprocess.run(
        ["git", "show", f"{rev}:p2p_cocodc/algorithms/codecs.py"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    path = folder / "codecs_then.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("codecs_then", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["codecs_then"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def medians_ms(runs: list[Callable[[], object]], repeat: int) -> list[float]:
    """Each callable's median time, the callables run in turn ``repeat`` times (after one warm-up):
    the same operation of the two commits in alternation, so both see the same machine."""
    times: list[list[float]] = [[] for _ in runs]
    for r in range(repeat + 1):
        for run, took in zip(runs, times, strict=True):
            started = time.perf_counter()
            run()
            if r:
                took.append(time.perf_counter() - started)
    return [1e3 * statistics.median(took) for took in times]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=270_000)
    parser.add_argument("--repeat", type=int, default=40)
    parser.add_argument("--codecs", nargs="+", default=list(CODEC_NAMES), choices=CODEC_NAMES)
    parser.add_argument("--against", help="a commit whose codecs to time beside these")
    args = parser.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as folder:
        then = codecs_at(args.against, Path(folder)) if args.against else None
        print(
            f"{args.numel} values, median of {args.repeat}, ms"
            + (f"; 'then': {args.against}" if then else "")
        )
        print(
            "| codec | encode | decode |"
            + (" encode then | decode then | encode × | decode × |" if then else "")
        )
        print("|---|---|---|" + ("---|---|---|---|" if then else ""))
        for name in args.codecs:
            now = codecs.get_codec(name)
            payload = now.encode(x)
            encodes, decodes = [partial(now.encode, x)], [partial(now.decode, payload, x.numel())]
            if then is not None:
                old = then.get_codec(name)
                same = old.encode(x) == payload and torch.equal(
                    old.decode(payload, x.numel()).view(torch.int32),
                    now.decode(payload, x.numel()).view(torch.int32),
                )
                if not same:
                    print(f"{name}: the payload or the decoded values differ from {args.against}'s")
                    return 1
                encodes.append(partial(old.encode, x))
                decodes.append(partial(old.decode, payload, x.numel()))
            (encode, *encode_then), (decode, *decode_then) = (
                medians_ms(encodes, args.repeat),
                medians_ms(decodes, args.repeat),
            )
            cells = [f"{t:.2f}" for t in (encode, decode, *encode_then, *decode_then)]
            if then is not None:
                cells += [f"{encode_then[0] / encode:.2f}", f"{decode_then[0] / decode:.2f}"]
            print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
