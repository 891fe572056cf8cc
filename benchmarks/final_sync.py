"""Closing rounds (``--final-sync``) on the convergence benchmark: final perplexity with and without.

Without closing rounds a run ends with each fragment's θ̄ as its last applied sync left it: the
replicas' steps since, and the syncs still in flight at the last step, are in no θ̄. With them
(the default), every fragment not sent at the last step syncs once more and is applied at once.
The setting is ``benchmarks/convergence.py``'s (``micro`` GPT, 4 workers, H = 48, K = 4, 480
steps, a modelled 10 Mbit/s link), with the default codec (fp4). The default is *chosen* on
``builtin:sotu-before-1900`` and *judged* on ``builtin:sotu-from-1900`` and ``builtin:web-bible``,
seeds 0-2, cocodc; streaming on the first corpus as a second algorithm. Runs go to ``--runs-dir``
(finished ones are reused); the table is printed, for ``docs/performance.md``.

    python benchmarks/final_sync.py --jobs 2    # ~35 min on 2 cores
"""

from __future__ import annotations

from convergence import CHOOSE_ON, JUDGE_ON, run_rows, study_arguments, study_parser

ENDS = {"closing rounds (default)": {}, "none (--no-final-sync)": {"no-final-sync": True}}


def main() -> None:
    args = study_arguments(study_parser(__doc__, "final_sync"))
    cases = [("cocodc", data) for data in (CHOOSE_ON, *JUDGE_ON)] + [("streaming", CHOOSE_ON)]
    wanted = {
        (algo, data, end): [
            {"algo": algo, "codec": "fp4", **opts, "data": data, "seed": seed} for seed in args.seeds
        ]
        for algo, data in cases
        for end, opts in ENDS.items()
    }
    rows = run_rows(wanted, args.runs_dir, args.jobs)
    seeds = " ".join(map(str, args.seeds))
    print(f"`python benchmarks/final_sync.py --jobs {args.jobs} --seeds {seeds}`\n")
    print("| algo | data | end of the run | final val ppl per seed | mean | vs none | MB sent / worker |")
    print("|---|---|---|---|---|---|---|")
    for algo, data in cases:
        plain = rows[(algo, data, "none (--no-final-sync)")]
        for end in ENDS:
            row = rows[(algo, data, end)]
            per_seed = ", ".join(f"{p:.2f}" for p in row["ppl"])
            print(
                f"| {algo} | `{data}` | {end} | {per_seed} | {row['mean']:.2f} "
                f"| {row['mean'] / plain['mean'] - 1:+.2%} | {row['mb']:.2f} |"
            )


if __name__ == "__main__":
    main()
