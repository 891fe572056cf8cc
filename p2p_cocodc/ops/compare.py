"""``compare``: a table of runs and a plot of perplexity against steps and against time."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from p2p_cocodc.errors import UserError
from p2p_cocodc.run.records import read_records


def crossing(evals: list[dict[str, Any]], target: float, axis: str) -> float | None:
    """Where val_ppl first reaches ``target`` on ``axis``, interpolated in log-perplexity."""
    for before, after in zip(evals, evals[1:], strict=False):
        if after["val_ppl"] <= target:
            if before["val_ppl"] <= target:
                return float(before[axis])
            lo, hi = math.log(after["val_ppl"]), math.log(before["val_ppl"])
            frac = (hi - math.log(target)) / (hi - lo)
            return before[axis] + frac * (after[axis] - before[axis])
    if evals and evals[0]["val_ppl"] <= target:
        return float(evals[0][axis])
    return None


def time_axis(evals: list[dict[str, Any]]) -> str:
    """Simulator runs have a virtual clock, swarm peers a wall clock."""
    return "sim_time_s" if "sim_time_s" in evals[0] else "wall_time_s"


CLOCKS = {"sim_time_s": "simulated", "wall_time_s": "wall"}  # what a run's seconds are


EVAL_KEYS = {"step", "val_ppl", "bytes_sent"}
SUMMARY_KEYS = {"algo", "steps", "final_val_ppl", "bytes_sent", "stall_s"}


def load_run(path: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The evaluations and the summary of a finished run, checked for the fields we read."""
    records = read_records(path)
    evals = [r for r in records if r["kind"] == "eval"]
    summaries = [r for r in records if r["kind"] == "summary"]
    if not evals or not summaries:
        raise UserError(f"{path} has no eval or summary records: was the run finished?")
    for record, keys in [*((e, EVAL_KEYS) for e in evals), (summaries[-1], SUMMARY_KEYS)]:
        missing = keys - record.keys()
        if missing:
            raise UserError(f"{path}: a {record['kind']} record lacks {', '.join(sorted(missing))}")
    if not {"sim_time_s", "wall_time_s"} & evals[0].keys():
        raise UserError(f"{path}: eval records have neither sim_time_s nor wall_time_s")
    return evals, summaries[-1]


def run_names(paths: list[str]) -> list[str]:
    """File stems, or the paths without suffix where two stems are the same."""
    if len(set(paths)) != len(paths):
        raise UserError("the same run file is given twice")
    stems = [Path(p).stem for p in paths]
    if len(set(stems)) == len(stems):
        return stems
    return [str(Path(p).with_suffix("")) for p in paths]


def compare_runs(paths: list[str], target_ppl: float | None, plot_path: str | None) -> str:
    if target_ppl is not None and not (math.isfinite(target_ppl) and target_ppl > 0):
        raise UserError(f"--target-ppl must be a finite number > 0, got {target_ppl}")
    runs = {name: load_run(p) for name, p in zip(run_names(paths), paths, strict=True)}
    target = target_ppl if target_ppl is not None else max(s["final_val_ppl"] for _, s in runs.values())
    header = (
        f"{'run':<28} {'algo':<10} {'final ppl':>10} {'steps→' + format(target, '.2f'):>13} "
        f"{'time→target s':>14} {'clock':<9} {'MB sent':>9} {'stall s':>8}"
    )
    lines = [header, "-" * len(header)]
    for name, (evals, summary) in runs.items():
        steps = crossing(evals, target, "step")
        seconds = crossing(evals, target, time_axis(evals))
        lines.append(
            f"{name[:28]:<28} {summary['algo']:<10} {summary['final_val_ppl']:>10.3f} "
            f"{'—' if steps is None else format(steps, '.0f'):>13} "
            f"{'—' if seconds is None else format(seconds, '.1f'):>14} {CLOCKS[time_axis(evals)]:<9} "
            f"{summary['bytes_sent'] / 1e6:>9.2f} {summary['stall_s']:>8.1f}"
        )
    if plot_path is not None:
        plot_runs(runs, plot_path)
        lines.append(f"plot written to {plot_path}")
    return "\n".join(lines)


def plot_runs(runs: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    clocks = {CLOCKS[time_axis(evals)] for evals, _ in runs.values()}
    for name, (evals, _) in runs.items():
        shown = [e for e in evals if e["step"] > 0]
        axis = time_axis(evals)
        label = name if len(clocks) == 1 else f"{name} ({CLOCKS[axis]} s)"
        by_step.plot([e["step"] for e in shown], [e["val_ppl"] for e in shown], label=label)
        by_time.plot([e[axis] for e in shown], [e["val_ppl"] for e in shown], label=label)
    by_step.set_xlabel("inner step")
    by_time.set_xlabel(
        f"{clocks.pop()} time (s)" if len(clocks) == 1 else "time (s): simulated or wall, see legend"
    )
    for ax in (by_step, by_time):
        ax.set_ylabel("validation perplexity (θ̄)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    by_step.legend(fontsize=8)
    fig.tight_layout()
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110, format="png")
    except OSError as exc:
        raise UserError(f"--plot {path}: cannot write it ({exc.strerror or exc})") from None
    finally:
        plt.close(fig)
