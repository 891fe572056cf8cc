"""A region of several processes (torchrun): its ranks train one replica over gloo, whole on each
rank (DDP) or sharded (FSDP2, --region-parallel fsdp), rank 0 speaks to the swarm, and the region
computes what a one-process region computes, to rounding."""

from __future__ import annotations

import copy
import multiprocessing
import subprocess
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
    simulate_here,
    spawn,
    start_bootstrap,
    torchrun,
)
from tests.tiny_options import TWO_PEERS

# fp32: the default fp4 would round the float-level difference below into a larger one now and then
OPTIONS = [*TWO_PEERS, "--device", "cpu", "--codec", "fp32"]
# θ̄ of a 2-rank region against a 1-process region: DDP's mean of two half-batch gradients equals the
# whole batch's up to float rounding, which AdamW's normalised steps carry on; over 24 steps the
# largest difference measured was 9e-7. A region that trained on half its batch differs by ~1e-2.
TOLERANCE = 1e-5


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_two_rank_region_trains_like_a_one_process_region(tmp_path: Path, parallel: str) -> None:
    """A 2-rank region (DDP, or FSDP2 with the replica and AdamW sharded and rank 0's whole copy on
    its host) beside a one-process peer, checkpointing every 8 steps: one θ̄ in the swarm, and it is
    the simulator's, where every region is one process, to rounding."""
    boot = start_bootstrap(tmp_path)
    procs: list[subprocess.Popen] = []
    try:
        common = ["join", "--bootstrap", boot.host_port, *OPTIONS, "--run-id", "region", "--pace", "fixed"]
        mine = ["--shard", "0/2", "--out", "a.jsonl", "--save", "a-model", "--region-parallel", parallel]
        mine += ["--checkpoint-dir", "ck", "--checkpoint-every", "8"]  # the region's state, gathered mid-run
        procs.append(spawn([], tmp_path, "a.log", command=torchrun([*common, *mine], free_port())))
        procs.append(
            spawn([*common, "--shard", "1/2", "--out", "b.jsonl", "--save", "b-model"], tmp_path, "b.log")
        )
        sim = simulate_here([*OPTIONS, "--save", "sim-model"], tmp_path)
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
    assert a["region_ranks"] == 2 and a["region_parallel"] == parallel and "region_ranks" not in b
    whole = sum(t.numel() * 4 for t in load_file(tmp_path / "sim-model" / "model.safetensors").values())
    # rank 0's device holds the whole replica, or its half of every parameter (FSDP2 pads an odd row)
    assert sorted(p.name for p in (tmp_path / "ck").glob("step-*.json"))[-1] == "step-00000024.json"
    held = a["region_param_bytes_per_rank"]
    assert held == whole if parallel == "ddp" else whole / 2 <= held < 0.55 * whole, (held, whole)
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


def test_fsdp_outside_torchrun_is_one_line(tmp_path: Path) -> None:
    """One process cannot shard its replica: the line says to start it under torchrun."""
    done = run_cli(
        ["join", "--bootstrap", "127.0.0.1:9", *OPTIONS, "--region-parallel", "fsdp"], tmp_path, 60
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "--region-parallel fsdp" in lines[0] and "torchrun --nproc-per-node" in lines[0], lines


def test_when_rank_0_fails_every_rank_of_the_region_stops(tmp_path: Path) -> None:
    """Rank 0 cannot reach the swarm (nothing listens at the bootstrap's address): it says so, and
    the rank that waits for its orders stops too instead of waiting."""
    (code0, err0), (code1, err1) = run_world(tmp_path, [[], []])
    assert code0 != 0 and code1 != 0
    assert "bootstrap" in err0 and "Traceback" not in err0, err0
    assert "rank 0 of this region failed" in err1 and "Traceback" not in err1, err1


def world_of_two(rank: int, port: int) -> Any:
    """In a spawned process: the variables of a 2-rank world on 127.0.0.1, and a tiny run's config."""
    import os

    from p2p_cocodc.config.train import build_config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
    return build_config(
        {}, {"model": "nano", "tokenizer": "byte", "seq_len": 32, "batch_size": 4, "device": "cpu"}
    )


def two_ranks(target: Any, *args: Any) -> dict[int, Any]:
    """``target(rank, port, *args, results)`` in two spawned processes, the ranks of one world; what
    each put on ``results`` (a (rank, value) pair), by rank. Both are ended on the way out."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [context.Process(target=target, args=(r, port, *args, results)) for r in (0, 1)]
    for proc in ranks:
        proc.start()
    try:
        return dict(results.get(timeout=120) for _ in ranks)
    finally:
        for proc in ranks:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def _rank(rank: int, port: int, diverge: bool, results: Any) -> None:
    """One rank of an in-process region: rank 0 orders three steps (the second hands over a whole
    new trainer state, the third a changed parameter), then the end; rank 1 follows."""
    from p2p_cocodc.errors import UserError
    from p2p_cocodc.peer.region import Region
    from p2p_cocodc.run.setup import TrainingSetup

    cfg = world_of_two(rank, port)
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
                region.follow(lambda _shard, step: shard.batch(step - 1))
                results.put((rank, "ok"))
                return
            with region.leading():
                region.lead_step(0, *shard.batch(0), 1)
                with torch.no_grad():  # what taking the swarm's state does: new parameters, fresh AdamW
                    for p in params:
                        p.mul_(0.5)
                trainer.reset()
                region.whole = not diverge
                region.lead_step(0, *shard.batch(1), 2)
                with torch.no_grad():
                    params[3].add_(0.25)  # a merged fragment
                region.changed_params([params[3]], trainer.model)
                region.lead_step(0, *shard.batch(2), 3)
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
    got = two_ranks(_rank, diverge)
    assert got[0] == "ok"
    if diverge:
        assert "the region's ranks diverged" in got[1], got
    else:
        assert got[1] == "ok", got


def _fsdp_rank(rank: int, port: int, results: Any) -> None:
    """One rank of an in-process fsdp region. Rank 0 orders steps, merges a fragment into its host
    replica, hands over a whole trainer state and gathers the region's, and checks each against a
    one-process trainer doing the same on the whole batch; rank 1 follows."""
    from p2p_cocodc.errors import UserError
    from p2p_cocodc.peer.region import Region
    from p2p_cocodc.run.setup import TrainingSetup

    cfg = world_of_two(rank, port)
    import p2p_cocodc.peer.shards as shards

    shards.BUCKET = 3000  # fragments cross in several buckets, a larger tensor alone in its own
    region = Region(rank, 2, rank, "fsdp")
    try:
        with region.joined(cfg, {}):
            setup = TrainingSetup(cfg, region.placement)
            view = region.wrap(setup.trainer())
            shard = setup.shard(0, 1)
            if rank == 1:
                region.follow(lambda _shard, step: shard.batch(step - 1))
                results.put((rank, 0.0))
                return
            one = setup.trainer()  # a one-process region's trainer, on the whole batch
            host, ref = list(view.model.parameters()), list(one.model.parameters())
            worst = 0.0

            def compare() -> None:
                nonlocal worst
                state, expected = view.state_dict(), one.state_dict()
                for name, tensor in expected["model"].items():
                    worst = max(worst, float((state["model"][name] - tensor).abs().max()))
                assert state["adamw"]["state"].keys() == expected["adamw"]["state"].keys()
                for key, moments in expected["adamw"]["state"].items():
                    got = state["adamw"]["state"][key]
                    assert float(got["step"]) == float(moments["step"])
                    for name in ("exp_avg", "exp_avg_sq"):
                        worst = max(worst, float((got[name] - moments[name]).abs().max()))

            with region.leading():
                for step in (1, 2):
                    region.lead_step(0, *shard.batch(step - 1), step)
                    one.step(*shard.batch(step - 1), step)
                compare()
                region.lead_step(0, *shard.batch(2), 3)  # the host replica is a step behind now
                one.step(*shard.batch(2), 3)
                region.collect(host[1:9], view.model)  # a merge reads its fragment, then writes it
                with torch.no_grad():
                    for mine, theirs in zip(host[1:9], ref[1:9], strict=True):
                        mine.add_(0.25)
                        theirs.add_(0.25)
                region.changed_params(host[1:9], view.model)
                region.lead_step(0, *shard.batch(3), 4)
                one.step(*shard.batch(3), 4)
                compare()
                # what a resumed run loads: a whole other trainer state (parameters and moments)
                other = copy.deepcopy(one.state_dict())
                other["model"] = {k: v * 0.5 for k, v in other["model"].items()}
                for moments in other["adamw"]["state"].values():
                    moments["exp_avg"] *= 2.0
                one.load_state_dict(other)
                view.load_state_dict(other)
                region.whole = True
                region.lead_step(0, *shard.batch(4), 5)
                one.step(*shard.batch(4), 5)
                compare()
            results.put((rank, worst))
    except (UserError, AssertionError) as exc:
        results.put((rank, repr(exc)))


def test_an_fsdp_region_merges_hands_over_and_gathers_the_state_of_a_one_process_region() -> None:
    """The fsdp orders in one 2-rank gloo world: steps, a fragment gathered from the shards, merged
    on rank 0's host and scattered back, a whole trainer state handed to the shards (a resume), and
    the region's state gathered (a checkpoint): parameters and AdamW moments stay a one-process
    trainer's on the whole batch, to rounding (FSDP2 averages two half-batch gradients)."""
    got = two_ranks(_fsdp_rank)
    assert got[1] == 0.0, got
    assert isinstance(got[0], float) and got[0] <= TOLERANCE, got
