"""What checked contributions and robust aggregation cost (p2p_cocodc/algorithms/aggregation.py).

(a) Perplexity: the simulator trains the same short run with each ``--aggregate``, first with
honest workers, then with one attacking worker whose outer gradient is multiplied by 10 or by −1
before it is averaged (injected here by wrapping the simulator's ``butterfly_mean``; no library
code knows of it). Each rule runs screened (the default thresholds) and unscreened
(``--outlier-norm 1e9 --outlier-cosine -1``: nobody is ever left out). The honest runs also record
every slice's ρ_i (norm over the median norm) and c_i (cosine to the coordinate-wise median), the
margins the default thresholds keep.

(b) Time: ``reduce_slice`` of one slice of ``--numel`` fp32 values from 4 honest members, per rule,
against the reduce before screening existed (decode, ``mean_in_order``, encode), the rules taking
turns in every repeat; the median over the repeats, as a ratio to the screened mean.

    python benchmarks/aggregation.py                     # about 30 minutes on this 2-core CPU

Each run's result is kept under ``runs/aggregation/`` and reused by a later call with the same
options, so the timing can be measured again (on a quiet machine) without training again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import p2p_cocodc.algorithms.aggregation as aggregation_module  # noqa: E402
import p2p_cocodc.run.simulator  # noqa: E402
from benchmarks.report import write_section  # noqa: E402
from p2p_cocodc.algorithms.aggregation import Aggregation  # noqa: E402
from p2p_cocodc.algorithms.butterfly import butterfly_mean, reduce_slice  # noqa: E402
from p2p_cocodc.algorithms.codecs import CODECS, mean_in_order  # noqa: E402
from p2p_cocodc.config.train import TrainConfig  # noqa: E402
from p2p_cocodc.names import AGGREGATES  # noqa: E402
from p2p_cocodc.run.records import RunLog  # noqa: E402
from p2p_cocodc.run.simulator import Simulation  # noqa: E402

RUNS = ROOT / "runs" / "aggregation"
ATTACKS = {"none": 1.0, "x10": 10.0, "sign-flip": -1.0}
UNSCREENED = {"outlier_norm": 1e9, "outlier_cosine": -1.0}


def simulate(cfg: TrainConfig, factor: float) -> dict:
    """One run; the last member of every round sends its outer gradient times ``factor``. Its final
    perplexity, how many rounds left someone out, and every slice's (ρ_i, c_i)."""
    similarities: list[tuple[list[float], list[float]]] = []

    similarity = aggregation_module.similarity

    def attacked(vectors, codec, aggregation, *records):
        vectors = [*vectors[:-1], vectors[-1] * factor]
        return butterfly_mean(vectors, codec, aggregation, *records)

    def recorded(values):
        found = similarity(values)
        similarities.append(found)
        return found

    p2p_cocodc.run.simulator.butterfly_mean = attacked
    aggregation_module.similarity = recorded
    try:
        sim = Simulation(cfg.validate())
        summary = sim.run(RunLog(None))
    finally:
        p2p_cocodc.run.simulator.butterfly_mean = butterfly_mean
        aggregation_module.similarity = similarity
    rounds = sum(1 for r in sim.records if r["kind"] == "exclusion")
    return {"ppl": summary["final_val_ppl"], "rounds_with_exclusions": rounds, "similarities": similarities}


def perplexity(base: TrainConfig) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows = []
    honest: list[tuple[list[float], list[float]]] = []
    for attack, factor in ATTACKS.items():
        for rule in AGGREGATES:
            for screened in (True, False):
                if attack == "none" and not screened:
                    continue  # nobody is screened out of an honest run: the same bits
                cfg = replace(base, aggregate=rule, **({} if screened else UNSCREENED))
                name = (
                    f"{base.model}-w{base.workers}-s{base.steps}-h{base.inner_steps}-{attack}-{rule}"
                    f"{'' if screened else '-unscreened'}.json"
                )
                started = time.perf_counter()
                if (RUNS / name).exists():
                    found = json.loads((RUNS / name).read_text())
                else:
                    found = simulate(cfg, factor)
                    RUNS.mkdir(parents=True, exist_ok=True)
                    (RUNS / name).write_text(json.dumps(found))
                if attack == "none":
                    honest += found["similarities"]
                rows.append({"attack": attack, "rule": rule, "screened": screened, **found})
                print(f"{attack:9} {rule:13} screened={screened!s:5} ppl {found['ppl']:9.2f} "
                      f"({found['rounds_with_exclusions']} rounds with exclusions, "
                      f"{time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
    ratios = [r for ratio, _ in honest for r in ratio]
    cosines = [c for _, cosine in honest for c in cosine]
    stats = {
        "slices": len(honest),
        "max_ratio": max(ratios),
        "min_ratio": min(ratios),
        "min_cosine": min(cosines),
    }
    return rows, stats


def timing(numel: int, repeats: int) -> dict[str, float]:
    codec = CODECS["fp32"]
    gen = torch.Generator().manual_seed(0)
    shared = torch.randn(numel, generator=gen)
    encoded = [codec.encode(shared + torch.randn(numel, generator=gen)) for _ in range(4)]

    def before() -> bytes:
        return codec.encode(mean_in_order([codec.decode(data, numel) for data in encoded]))

    def reduce(rule: str) -> Any:
        aggregation = Aggregation(rule)
        return lambda: reduce_slice(encoded, numel, codec, aggregation)

    runs = {"before screening": before, **{rule: reduce(rule) for rule in AGGREGATES}}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=192)
    parser.add_argument("--inner-steps", type=int, default=24)
    parser.add_argument("--numel", type=int, default=2_000_000)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = TrainConfig(
        model=args.model, workers=args.workers, steps=args.steps, inner_steps=args.inner_steps,
        eval_every=args.steps, eval_batches=8, step_time=0.1, threads=args.threads,
    )  # fmt: skip
    times = timing(args.numel, args.repeats)
    for name, seconds in times.items():
        print(f"{name:16} {seconds * 1e3:8.1f} ms", flush=True)
    rows, stats = perplexity(base)
    report(args, base, rows, stats, times)


def report(
    args: argparse.Namespace, base: TrainConfig, rows: list[dict], stats: dict, times: dict[str, float]
) -> None:
    command = (
        f"python benchmarks/aggregation.py --model {args.model} --workers {args.workers} "
        f"--steps {args.steps} --inner-steps {args.inner_steps} --numel {args.numel} "
        f"--repeats {args.repeats} --threads {args.threads}"
    )
    clean = next(r["ppl"] for r in rows if r["attack"] == "none" and r["rule"] == "mean")
    table = "\n".join(
        f"| {r['attack']} | {r['rule']} | {'yes' if r['screened'] else 'no'} | {r['ppl']:.2f} | "
        f"{r['ppl'] / clean:.3f} | {r['rounds_with_exclusions']} |"
        for r in rows
    )
    mean = times["mean"]
    timings = "\n".join(
        f"| {name} | {seconds * 1e3:.1f} | {seconds / mean:.2f} |" for name, seconds in times.items()
    )
    rounds = (args.steps // args.inner_steps) * base.fragments
    text = f"""The price of checking every member's slice and of the robust rules (`docs/algorithms.md`,
"Checked contributions and robust aggregation"). Device: CPU, {os.cpu_count()} cores (shared machine),
{args.threads} torch threads.

Reproduce: `{command}`

**Perplexity.** `simulate --model {args.model} --workers {args.workers} --steps {args.steps} --inner-steps
{args.inner_steps}` (cocodc, K = {base.fragments}, {rounds} rounds, fp32 codec, step time {base.step_time} s),
final validation perplexity of θ̄ with each `--aggregate`. The attacker is one of the {args.workers} workers
whose outer gradient is multiplied by 10 or by −1 before every round's average; "screened: no" is
`--outlier-norm 1e9 --outlier-cosine -1` (nobody is ever left out). Ratio: to the honest run's mean.

| attack | `--aggregate` | screened | final val ppl | ratio | rounds with exclusions |
|---|---|---|---|---|---|
{table}

Honest slices ({stats["slices"]} slices of the honest runs, {args.workers} members each): ρ_i (norm over
the median norm) from {stats["min_ratio"]:.3f} to {stats["max_ratio"]:.3f}, against the threshold
`--outlier-norm` {Aggregation().outlier_norm}; the lowest c_i (cosine to the coordinate-wise median)
{stats["min_cosine"]:.3f}, against `--outlier-cosine` {Aggregation().outlier_cosine}.

**Time.** `reduce_slice` of one slice of {args.numel / 1e6:g} M fp32 values from 4 honest members (decode,
screen, combine, encode), median of {args.repeats} repeats with the rules taking turns; "before
screening" is the reduce as it was before (decode, in-order mean, encode).

| reduce | ms | ÷ mean |
|---|---|---|
{timings}
"""
    write_section("Checked contributions and robust aggregation", text)
    print(text)


if __name__ == "__main__":
    main()
