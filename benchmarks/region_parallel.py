"""A region of two ranks (torchrun, gloo, this machine's CPU) beside a one-process peer, its replica
held whole on each rank (``--region-parallel ddp``) or sharded across them (``fsdp``), side by side
in each repeat, alternating which mode goes first.

Per mode, from the region's summary record: its training tokens/s, its sync work between steps
(``sync_boundary_s``: with fsdp this includes gathering each synced fragment from the shards to rank
0's host and scattering the merge back), the bytes of parameters rank 0's device holds, and its peak
memory. The last lines give the median ratio fsdp ÷ ddp of tokens/s and of the sync work. The CPU
figures show the cost of the orders and the gathers; what FSDP is for (a model larger than one GPU)
needs GPUs (docs/devices.md has the arithmetic).

    python benchmarks/region_parallel.py --repeat 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.swarm_procs import end_group, free_port, records, spawn, start_bootstrap, torchrun  # noqa: E402

MODES = ("ddp", "fsdp")


def run(mode: str, args: argparse.Namespace, workdir: Path) -> dict:
    """One run: a bootstrap, the 2-rank region in ``mode`` and a one-process peer; the region's summary."""
    workdir.mkdir(parents=True)
    boot = start_bootstrap(workdir)
    common = ["join", "--bootstrap", boot.host_port, "--run-id", f"region-{mode}", "--pace", "fixed"]
    common += ["--model", args.model, "--tokenizer", "byte", "--seq-len", str(args.seq_len)]
    common += ["--batch-size", str(args.batch_size), "--workers", "2", "--steps", str(args.steps)]
    common += ["--inner-steps", str(args.inner_steps), "--fragments", str(args.fragments), "--overlap", "2"]
    common += ["--eval-every", str(args.steps), "--eval-batches", "2", "--device", "cpu", "--threads", "1"]
    region = [*common, "--shard", "0/2", "--out", "region.jsonl", "--region-parallel", mode]
    procs = [spawn([], workdir, "region.log", command=torchrun(region, free_port()))]
    procs.append(spawn([*common, "--shard", "1/2", "--out", "peer.jsonl", "--quiet"], workdir, "peer.log"))
    try:
        codes = [proc.wait(timeout=args.timeout) for proc in procs]
    finally:
        for proc in [*procs, boot.proc]:
            end_group(proc)
    if codes != [0, 0]:
        raise SystemExit(f"{mode}: exit codes {codes}; see {workdir}/region.log and peer.log")
    return records(workdir / "region.jsonl")[-1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--inner-steps", type=int, default=24)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="region-parallel-"))
    got: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for repeat in range(args.repeat):
        order = MODES if repeat % 2 == 0 else MODES[::-1]
        for mode in order:
            summary = run(mode, args, workdir / f"{repeat}-{mode}")
            got[mode].append(summary)
            print(
                f"repeat {repeat + 1} {mode}: {summary['tokens_per_s']:.0f} tokens/s, sync work between "
                f"steps "
                f"{summary['sync_boundary_s']:.2f} s ({summary['sync_boundary_share']:.1%}), rank 0 holds "
                f"{summary['region_param_bytes_per_rank'] / 1e6:.2f} MB of parameters, peak memory "
                f"{summary['peak_memory_bytes'] / 1e6:.0f} MB, {summary['rounds_done']} rounds",
                flush=True,
            )
    speed = [f["tokens_per_s"] / d["tokens_per_s"] for d, f in zip(got["ddp"], got["fsdp"], strict=True)]
    work = [
        f["sync_boundary_s"] / max(d["sync_boundary_s"], 1e-9)
        for d, f in zip(got["ddp"], got["fsdp"], strict=True)
    ]
    print(
        f"fsdp ÷ ddp tokens/s: {', '.join(f'{r:.3f}' for r in speed)} (median {statistics.median(speed):.3f})"
    )
    print(
        f"fsdp ÷ ddp sync work: {', '.join(f'{r:.2f}' for r in work)} (median {statistics.median(work):.2f})"
    )
    print(f"runs in {workdir}")


if __name__ == "__main__":
    main()
