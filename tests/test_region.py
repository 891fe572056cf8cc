"""A region of several processes (torchrun): its ranks train one replica with DDP over gloo, rank 0
speaks to the swarm, and the region computes what a one-process region computes, to rounding."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.swarm_procs import (
    CLI,
    ENV,
    end_group,
    free_port,
    records,
    run_cli,
    spawn,
    start_bootstrap,
)
from tests.tiny_options import TWO_PEERS

OPTIONS = [*TWO_PEERS, "--device", "cpu"]
# θ̄ of a 2-rank region against a 1-process region: DDP's mean of two half-batch gradients equals the
# whole batch's up to float rounding, which AdamW's normalised steps carry on; over 24 steps the
# largest difference measured was 9e-7. A region that trained on half its batch differs by ~1e-2.
TOLERANCE = 1e-5


def torchrun(args: list[str], port: int) -> list[str]:
    """``torchrun --nproc-per-node 2 -m p2p_cocodc ARGS`` on 127.0.0.1, as a command line."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    launcher += ["--master-addr", "127.0.0.1", "--master-port", str(port), "--tee", "3"]
    return [*launcher, "-m", "p2p_cocodc", *args]


def test_a_two_rank_region_trains_like_a_one_process_region(tmp_path: Path) -> None:
    boot = start_bootstrap(tmp_path)
    procs: list[subprocess.Popen] = []
    try:
        common = ["join", "--bootstrap", boot.host_port, *OPTIONS, "--run-id", "region", "--pace", "fixed"]
        region = torchrun([*common, "--shard", "0/2", "--out", "a.jsonl", "--save", "a-model"], free_port())
        log = open(tmp_path / "a.log", "w")  # noqa: SIM115 - the process owns it until it ends
        procs.append(
            subprocess.Popen(
                region, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True
            )
        )
        procs.append(
            spawn([*common, "--shard", "1/2", "--out", "b.jsonl", "--save", "b-model"], tmp_path, "b.log")
        )
        sim = run_cli(["simulate", *OPTIONS, "--save", "sim-model"], tmp_path, timeout=120)
        assert sim.returncode == 0, sim.stderr
        for name, proc in zip("ab", procs, strict=True):
            assert proc.wait(timeout=240) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        for proc in [*procs, boot.proc]:
            end_group(proc)

    a, b = records(tmp_path / "a.jsonl")[-1], records(tmp_path / "b.jsonl")[-1]
    assert a["kind"] == b["kind"] == "summary"
    assert a["rounds_done"] >= 4 and a["rounds_failed"] == 0
    assert a["global_params_sha256"] == b["global_params_sha256"]  # one θ̄ in the swarm, bit for bit
    reference = load_file(tmp_path / "sim-model" / "model.safetensors")
    got = load_file(tmp_path / "a-model" / "model.safetensors")
    worst = max(float((got[k] - reference[k]).abs().max()) for k in reference)
    assert worst <= TOLERANCE, f"θ̄ of the 2-rank region differs from a 1-process region's by {worst}"


def run_world(cwd: Path, args_by_rank: list[list[str]]) -> list[tuple[int, str]]:
    """Start one process per rank of a world (the variables torchrun sets) running ``join ARGS``;
    each one's exit code and standard error."""
    port = free_port()
    procs = []
    for rank, args in enumerate(args_by_rank):
        env = {**ENV, "WORLD_SIZE": str(len(args_by_rank)), "RANK": str(rank), "LOCAL_RANK": str(rank)}
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        command = [*CLI, "join", "--bootstrap", "127.0.0.1:9", *OPTIONS, *args]
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        procs.append(subprocess.Popen(command, cwd=cwd, env=env, start_new_session=True, **pipes))
    try:
        return [(p.wait(timeout=120), p.communicate()[1]) for p in procs]
    finally:
        for p in procs:
            end_group(p)


def test_ranks_given_different_options_stop_with_one_line(tmp_path: Path) -> None:
    for code, err in run_world(tmp_path, [["--lr", "0.001"], ["--lr", "0.002"]]):
        assert code != 0
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and "--lr" in lines[0] and "same options" in lines[0], err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--batch-size", "3"], "multiple of 2"),
        (["--algo", "ddp", "--overlap", "0"], "--algo ddp under torchrun"),
        (["--device", "cuda:0"], "--device cuda:0"),
    ],
)
def test_a_region_refuses_what_it_cannot_train(tmp_path: Path, extra: list[str], message: str) -> None:
    for code, err in run_world(tmp_path, [extra, extra]):
        assert code != 0
        assert message in err and "Traceback" not in err, err


def test_when_rank_0_fails_every_rank_of_the_region_stops(tmp_path: Path) -> None:
    """Rank 0 cannot reach the swarm (nothing listens at the bootstrap's address): it says so, and
    the rank that waits for its orders stops too instead of waiting."""
    (code0, err0), (code1, err1) = run_world(tmp_path, [[], []])
    assert code0 != 0 and code1 != 0
    assert "bootstrap" in err0 and "Traceback" not in err0, err0
    assert "rank 0 of this region failed" in err1 and "Traceback" not in err1, err1


def _rank(rank: int, port: int, diverge: bool, results: Any) -> None:
    """One rank of an in-process region: rank 0 orders three steps (the second hands over a whole
    new trainer state, the third a changed parameter), then the end; rank 1 follows."""
    import os

    from p2p_cocodc.config.train import build_config
    from p2p_cocodc.errors import UserError
    from p2p_cocodc.peer.region import Region
    from p2p_cocodc.run.setup import TrainingSetup

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
    cfg = build_config(
        {}, {"model": "nano", "tokenizer": "byte", "seq_len": 32, "batch_size": 4, "device": "cpu"}
    )
    region = Region(rank, 2, rank)
    try:
        with region.joined(cfg, {}):
            setup = TrainingSetup(cfg, region.placement)
            trainer = setup.trainer()
            region.wrap(trainer)  # DDP starts every rank from rank 0's parameters
            params = list(trainer.model.parameters())
            shard = setup.shard(0, 1)
            if rank == 1:
                with torch.no_grad():
                    params[0].add_(1.0)  # out of step until rank 0's whole state arrives
                region.follow(trainer, lambda _shard, step: shard.batch(step - 1))
                results.put((rank, "ok"))
                return
            with region.leading():
                region.lead_step(trainer, 0, *shard.batch(0), 1)
                with torch.no_grad():  # what taking the swarm's state does: new parameters, fresh AdamW
                    for p in params:
                        p.mul_(0.5)
                trainer.reset()
                region.whole = not diverge
                region.lead_step(trainer, 0, *shard.batch(1), 2)
                with torch.no_grad():
                    params[3].add_(0.25)  # a merged fragment
                region.changed_params([params[3]], trainer.model)
                region.lead_step(trainer, 0, *shard.batch(2), 3)
                with torch.no_grad():
                    params[5].sub_(0.25)  # a result due at the last step: it goes with the end
                region.changed_params([params[5]], trainer.model)
            results.put((rank, "ok"))
    except UserError as exc:
        results.put((rank, str(exc)))


@pytest.mark.parametrize("diverge", [False, True])
def test_rank_0_hands_its_ranks_whole_states_and_merged_fragments_and_a_divergence_is_caught(
    diverge: bool,
) -> None:
    """The orders' whole-state and changed-parameter paths, in one 2-rank gloo world: the follower
    ends with rank 0's replica; when rank 0 withholds the whole state, the follower's end-of-run
    check catches the divergence."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_rank, args=(r, port, diverge, results)) for r in (0, 1)]
    for proc in ranks:
        proc.start()
    try:
        got = dict(results.get(timeout=120) for _ in ranks)
    finally:
        for proc in ranks:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    assert got[0] == "ok"
    if diverge:
        assert "the region's ranks diverged" in got[1], got
    else:
        assert got[1] == "ok", got
