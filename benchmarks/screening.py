"""Does screening leave honest members out? Clean runs of every algorithm, rule and codec, counted;
attacks, still caught (p2p_cocodc/algorithms/aggregation.py, docs/algorithms.md).

Every run is the simulator with the default screening (``--outlier-norm 4 --outlier-cosine 0
--outlier-window 16``) and its exclusions counted, while every slice's statistics are recorded
(wrapping ``aggregation.screen``): each member's ρ_i (norm over the median norm), its c_i in that
slice and c̄_i, the mean over its last W slices at that owner that the cosine test judges.

- ``test``: the real-process tests' runs (``tests/tiny_options.py``: nano, H = 8, K = 2, τ = 2,
  32 steps) with 3 and 4 workers, for each seed and each of cocodc (its damped default), cocodc
  undamped (``--dc-alpha 0 --dc-lambda 0.5``), streaming and diloco; the (codec, rule) pair turns
  with the seed, so every codec meets every rule.
- ``long``: the same, 384 steps: late in such a run single honest slices point against the group.
- ``convergence``: the convergence benchmark's runs (``benchmarks/convergence.py``: micro, M = 4,
  H = 48, K = 4, 480 steps), cocodc's defaults and streaming, seeds 0-2.
- attacks: the last worker sends its outer gradient ×10 or ×(−1) in every round (``test`` and
  ``long``, 4 workers, the first ``--attack-seeds`` seeds): the rounds that left it out, and the
  final perplexity against the clean run's.

    python benchmarks/screening.py                          # about 2 hours on this 2-core CPU
    python benchmarks/screening.py --seeds 2 --attack-seeds 1 --no-convergence   # a quick look

Each run's result is kept under ``runs/screening/`` and reused; the report goes to
docs/performance.md ("Screening: honest members left out").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import p2p_cocodc.algorithms.aggregation as aggregation_module  # noqa: E402
from benchmarks.convergence import COMMON  # noqa: E402
from benchmarks.report import write_section  # noqa: E402
from p2p_cocodc.algorithms.aggregation import Aggregation, mean_cosine  # noqa: E402
from p2p_cocodc.config.train import TrainConfig  # noqa: E402
from p2p_cocodc.names import AGGREGATES, CODEC_NAMES  # noqa: E402
from p2p_cocodc.run.records import RunLog, read_records  # noqa: E402
from p2p_cocodc.run.simulator import Simulation  # noqa: E402
from tests.tiny_options import TINY_FIELDS  # noqa: E402

RUNS = ROOT / "runs" / "screening"
ALGOS = {
    "cocodc": {"algo": "cocodc"},
    "cocodc undamped": {"algo": "cocodc", "dc_alpha": 0.0, "dc_lambda": 0.5},
    "streaming": {"algo": "streaming"},
    "diloco": {"algo": "diloco", "overlap": 0, "fragments": 1},
}
PAIRS = [(codec, rule) for codec in CODEC_NAMES for rule in AGGREGATES]
ATTACKS = {"x10": 10.0, "sign-flip": -1.0}


def simulate(options: dict[str, Any], factor: float | None) -> dict[str, Any]:
    """One screened run; with ``factor``, the last worker's outer gradients are multiplied by it."""
    slices: list[dict[str, list[float]]] = []
    screen, similarity = aggregation_module.screen, aggregation_module.similarity
    ratios: list[list[float]] = []

    def measured(values):
        found = similarity(values)
        ratios.append(found[0])
        return found

    def recorded(values, aggregation=aggregation_module.MEAN, earlier=()):
        screening = screen(values, aggregation, earlier)
        if screening.cosines:
            histories = [
                [*(earlier[i] if i < len(earlier) else ()), c] for i, c in enumerate(screening.cosines)
            ]
            slices.append(
                {
                    "ratio": ratios[-1],
                    "cosine": list(screening.cosines),
                    "mean_cosine": [mean_cosine(h, aggregation.outlier_window) for h in histories],
                    "excluded": list(screening.excluded),
                }
            )
        return screening

    aggregation_module.screen, aggregation_module.similarity = recorded, measured
    out = RUNS / "last.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        sim = Simulation(TrainConfig(**options, out=str(out), force=True).validate())
        if factor is not None:
            strategy = sim.workers[max(sim.workers)].strategy
            payload = strategy.payload
            strategy.payload = lambda p, step: factor * payload(p, step)  # type: ignore[method-assign]
        log = RunLog(str(out))
        try:
            summary = sim.run(log)
        finally:
            log.close()
    finally:
        aggregation_module.screen, aggregation_module.similarity = screen, similarity
    rounds = [r for r in read_records(out) if r["kind"] == "exclusion"]
    return {
        "ppl": summary["final_val_ppl"],
        "exclusion_rounds": [r["excluded"] for r in rounds],
        "slices": slices,
    }


def cached(name: str, options: dict[str, Any], factor: float | None) -> dict[str, Any]:
    path = RUNS / f"{name}.json"
    if path.exists():
        return json.loads(path.read_text())
    started = time.perf_counter()
    found = {"options": options, "factor": factor, **simulate(options, factor)}
    found["seconds"] = time.perf_counter() - started
    path.write_text(json.dumps(found))
    return found


def runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    plan: list[tuple[str, str, dict[str, Any], str | None]] = []  # (config, algo, options, attack)
    for config, steps, seeds in (("test", 32, args.seeds), ("long", 384, args.long_seeds or args.seeds)):
        for seed in range(seeds):
            for algo, algo_options in ALGOS.items():
                for workers in (3, 4):
                    codec, rule = PAIRS[(seed * 2 + workers) % len(PAIRS)]
                    options = {
                        **TINY_FIELDS,
                        **algo_options,
                        "workers": workers,
                        "steps": steps,
                        "eval_every": steps,
                        "seed": seed,
                        "codec": codec,
                        "aggregate": rule,
                    }
                    plan.append((config, algo, options, None))
                    if workers == 4 and seed < args.attack_seeds:
                        plan += [(config, algo, options, attack) for attack in ATTACKS]
    if args.convergence:
        convergence = {key.replace("-", "_"): value for key, value in COMMON.items()}
        for seed in range(3):
            for algo in args.convergence_algos:
                plan.append(("convergence", algo, {**convergence, **ALGOS[algo], "seed": seed}, None))
    found = []
    for i, (config, algo, options, attack) in enumerate(plan):
        name = "_".join(
            [
                config,
                algo.replace(" ", "-"),
                f"w{options['workers']}",
                f"s{options['seed']}",
                attack or "clean",
            ]
        )
        result = cached(name, options, ATTACKS[attack] if attack else None)
        found.append({"config": config, "algo": algo, "attack": attack, **result})
        print(
            f"[{i + 1}/{len(plan)}] {name}: ppl {result['ppl']:.2f}, "
            f"{len(result['exclusion_rounds'])} rounds with exclusions",
            flush=True,
        )
    return found


def honest_margins(run: dict[str, Any]) -> dict[str, float]:
    attacker = run["options"]["workers"] - 1 if run["attack"] else None
    ratio, cosine, mean = [], [], []
    for s in run["slices"]:
        members = [i for i in range(len(s["cosine"])) if i != attacker]
        ratio += [s["ratio"][i] for i in members]
        cosine += [s["cosine"][i] for i in members]
        mean += [s["mean_cosine"][i] for i in members]
    return {"max_ratio": max(ratio), "min_cosine": min(cosine), "min_mean_cosine": min(mean)}


def report(args: argparse.Namespace, found: list[dict[str, Any]]) -> None:
    default = Aggregation()
    rows = []
    for config in ("test", "long", "convergence"):
        for algo in ALGOS:
            clean = [r for r in found if r["config"] == config and r["algo"] == algo and not r["attack"]]
            if not clean:
                continue
            margins = [honest_margins(r) for r in clean]
            honest_out = sum(len(rounds) for r in clean for rounds in r["exclusion_rounds"])
            slices_w1 = sum(  # what judging each slice alone (W = 1, the rule before) would have done
                1 for r in clean for s in r["slices"] if min(s["cosine"]) < default.outlier_cosine
            )
            worst = {key: (max if key == "max_ratio" else min)(m[key] for m in margins) for key in margins[0]}
            rows.append(
                f"| {config} | {algo} | {len(clean)} | {sum(len(r['slices']) for r in clean)} | "
                f"**{honest_out}** | {slices_w1} | {worst['max_ratio']:.2f} | {worst['min_cosine']:.3f} | "
                f"{worst['min_mean_cosine']:.3f} |"
            )
    attack_rows = []
    for attack in ATTACKS:
        for config in ("test", "long"):
            for algo in ALGOS:
                hit = [
                    r for r in found if r["config"] == config and r["algo"] == algo and r["attack"] == attack
                ]
                if not hit:
                    continue
                rounds = sum(len(r["slices"]) // r["options"]["workers"] for r in hit)
                caught = sum(
                    sum(r["options"]["workers"] - 1 in excluded for excluded in r["exclusion_rounds"])
                    for r in hit
                )
                honest_out = sum(
                    sum(
                        any(i != r["options"]["workers"] - 1 for i in excluded)
                        for excluded in r["exclusion_rounds"]
                    )
                    for r in hit
                )
                ratios = []
                for r in hit:
                    twin = next(
                        c
                        for c in found
                        if not c["attack"] and c["config"] == config and c["algo"] == algo
                        and c["options"]["seed"] == r["options"]["seed"] and c["options"]["workers"] == 4
                    )  # fmt: skip
                    ratios.append(r["ppl"] / twin["ppl"])
                attack_rows.append(
                    f"| {attack} | {config} | {algo} | {len(hit)} | {caught} of {rounds} | {honest_out} | "
                    f"{min(ratios):.3f}-{max(ratios):.3f} |"
                )
    command = f"python benchmarks/screening.py --seeds {args.seeds} --attack-seeds {args.attack_seeds}"
    command += f" --long-seeds {args.long_seeds}" if args.long_seeds else ""
    command += (
        f" --convergence-algos {' '.join(args.convergence_algos)}"
        if args.convergence
        else " --no-convergence"
    )
    text = f"""Honest members left out of a slice's mean by screening, in clean simulator runs with the
default thresholds (`--outlier-norm {default.outlier_norm:g} --outlier-cosine {default.outlier_cosine:g}
--outlier-window {default.outlier_window}`), and attacks still caught. `test`: the real-process tests'
runs (nano, H = 8, K = 2, τ = 2, 32 steps, 3 and 4 workers), {args.seeds} seeds per algorithm and
worker count, the (codec, rule) pair turning with the seed so every codec meets every rule; `long`:
the same, 384 steps, {args.long_seeds or args.seeds} seeds; `convergence`: the convergence benchmark's
runs (micro, M = 4, H = 48, K = 4, 480 steps, fp32, mean), seeds 0-2. "left out": honest members
left out of a round's mean (the target: 0). "W = 1": slices where judging each slice alone, the rule
before `--outlier-window`, would have left an honest member out.
Margins: the largest honest ρ_i (threshold {default.outlier_norm:g}), the lowest honest c_i of one
slice, and the lowest honest c̄_i, the mean the cosine test judges (threshold {default.outlier_cosine:g}).

Reproduce: `{command}` (runs kept in `runs/screening/`).

| runs | algorithm | clean runs | slices | left out | W = 1 | max ρ_i | min c_i | min c̄_i |
|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Attacks (4 workers, the last one attacking in every round): rounds that left the attacker out,
rounds that left an honest member out, and the final perplexity against the clean run of the same
seed.

| attack | runs | algorithm | runs | attacker left out | honest left out | ppl ÷ clean |
|---|---|---|---|---|---|---|
{chr(10).join(attack_rows)}
"""
    write_section("Screening: honest members left out", text)
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=20, help="clean seeds per configuration")
    parser.add_argument("--long-seeds", type=int, default=None, help="clean seeds of the long runs (--seeds)")
    parser.add_argument("--attack-seeds", type=int, default=3, help="seeds of the attacked runs")
    parser.add_argument(
        "--convergence-algos", nargs="+", default=["cocodc", "streaming"], choices=list(ALGOS)
    )
    parser.add_argument("--no-convergence", dest="convergence", action="store_false")
    args = parser.parse_args()
    report(args, runs(args))


if __name__ == "__main__":
    main()
