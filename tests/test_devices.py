"""Where replicas compute: --device and --precision, θ̄ kept on the CPU in fp32 whatever the replica
does, the copies to and from the device, and a swarm of regions on different precisions."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from p2p_cocodc.algorithms.devices import Placement, resolve_device
from p2p_cocodc.algorithms.outer import OuterOptimizer, OuterSettings
from p2p_cocodc.algorithms.strategies import Strategy
from p2p_cocodc.config.train import TrainConfig, build_config
from p2p_cocodc.errors import UserError
from p2p_cocodc.run.records import RunLog, params_sha256
from p2p_cocodc.run.setup import TrainingSetup
from p2p_cocodc.run.simulator import Simulation
from tests.swarm_procs import end_group, records, run_cli, spawn, start_bootstrap
from tests.test_algorithms import SMALL as ALGORITHMS_SMALL
from tests.tiny_options import TINY_MODEL, TWO_PEERS

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device; this machine has none")

SMALL = replace(ALGORITHMS_SMALL, steps=16, fragments=2, eval_every=8, device="cpu")


def run(cfg: TrainConfig) -> tuple[Simulation, dict]:
    sim = Simulation(cfg.validate())
    return sim, sim.run(RunLog(None))


# ---- options ----


@pytest.mark.skipif(CUDA, reason="checks the message of a machine without CUDA")
@pytest.mark.parametrize("spec", ["cuda", "cuda:1"])
def test_asking_for_cuda_without_it_says_what_to_use(spec: str) -> None:
    with pytest.raises(UserError, match=f"--device {spec}: no CUDA device here .*use --device cpu or auto"):
        resolve_device(spec)


def test_auto_takes_cuda_when_there_is_one_else_the_cpu() -> None:
    assert resolve_device("auto").type == ("cuda" if CUDA else "cpu")


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "cuda:-1", "tpu"])
def test_a_malformed_device_is_refused_before_any_work(spec: str) -> None:
    with pytest.raises(UserError, match="--device"):
        build_config({}, {"device": spec})


def test_an_unknown_precision_is_refused() -> None:
    with pytest.raises(UserError, match="unknown --precision 'fp16': use one of fp32, bf16"):
        build_config({}, {"precision": "fp16"})


# ---- θ̄ on the CPU, the outer step computed ahead ----


def test_an_outer_step_computed_ahead_is_the_same_bits_as_one_applied_in_place() -> None:
    initial = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    settings = OuterSettings(lr=0.7, momentum=0.9, momentum_clip=0.05)
    ahead, in_place = OuterOptimizer(initial, settings), OuterOptimizer(initial, settings)
    for seed in range(3):
        delta = torch.randn(1000, generator=torch.Generator().manual_seed(seed + 1))
        step = ahead.peek(delta)
        assert not torch.equal(step.global_params, ahead.global_params)  # peeking changes nothing
        ahead.take(step)
        in_place.step(delta)
        assert torch.equal(ahead.global_params, in_place.global_params)
        assert torch.equal(ahead.momentum, in_place.momentum)


def test_the_outer_step_writes_into_two_pairs_of_buffers_and_matches_torch_sgd() -> None:
    initial = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    outer = OuterOptimizer(initial, OuterSettings(lr=0.7, momentum=0.9))
    param = torch.nn.Parameter(initial.clone())
    sgd = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    seen = set()
    for seed in range(6):
        delta = torch.randn(1000, generator=torch.Generator().manual_seed(seed + 1))
        outer.step(delta)
        param.grad = delta.clone()
        sgd.step()
        torch.testing.assert_close(outer.global_params, param.detach(), rtol=0, atol=1e-6)
        seen.add(outer.global_params.data_ptr())
    assert len(seen) == 2  # no new fragment-sized buffer after the first step


def test_a_prepared_result_applies_like_the_averaged_delta_and_a_stale_one_is_prepared_again() -> None:
    setup = TrainingSetup(SMALL)
    settings = SMALL.algo_settings()
    replicas = [setup.replica(settings)[1] for _ in range(2)]
    first, second = replicas
    assert isinstance(first, Strategy) and isinstance(second, Strategy)
    averaged = sum(strategy.payload(0, 1) for strategy in replicas) / 2
    first.apply(0, first.prepare(0, averaged), 3)
    second.apply(0, averaged, 3)
    assert params_sha256(first.global_state()) == params_sha256(second.global_state())
    assert torch.equal(first.fragments[0].read(), second.fragments[0].read())
    # a result prepared before θ̄_p moved is computed again from the θ̄_p it is applied to
    for strategy in replicas:
        strategy.payload(0, 4)
    stale = first.prepare(0, averaged)
    for strategy in replicas:  # twice: θ̄_p lives again in the buffer it lived in when prepared
        strategy.outer[0].step(torch.ones_like(averaged))
        strategy.outer[0].step(torch.ones_like(averaged))
    first.apply(0, stale, 6)
    second.apply(0, averaged, 6)
    assert params_sha256(first.global_state()) == params_sha256(second.global_state())


def test_a_compiled_forward_is_traced_and_computes_what_the_plain_one_does() -> None:
    """--compile: the inner steps call the model through torch.compile. With the eager backend
    (tracing, no code generation: inductor's kernels are checked on a GPU, benchmarks/gpu_check.sh)
    the traced graph runs the same operations, so the run ends with the same θ̄, bit for bit."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    _, plain = run(SMALL)
    assert not torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled_sim, compiled = run(replace(SMALL, compile="eager"))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the model's forward was traced
    assert all(w.trainer.forward is not w.trainer.model for w in compiled_sim.workers.values())
    assert compiled["global_params_sha256"] == plain["global_params_sha256"]


def test_theta_bar_lives_on_the_cpu_in_fp32_whatever_the_replica_computes_in() -> None:
    sim, summary = run(replace(SMALL, precision="bf16"))
    for worker in sim.workers.values():
        strategy = worker.strategy
        assert isinstance(strategy, Strategy)
        for outer in strategy.outer:
            assert outer.global_params.device.type == "cpu" and outer.global_params.dtype == torch.float32
        assert all(p.dtype == torch.float32 for p in worker.trainer.model.parameters())
    assert summary["final_val_ppl"] < summary["initial_val_ppl"]


def test_bf16_autocast_changes_what_replicas_compute_but_not_how_they_agree() -> None:
    fp32, fp32_summary = run(SMALL)
    bf16, bf16_summary = run(replace(SMALL, precision="bf16"))
    assert fp32_summary["global_params_sha256"] != bf16_summary["global_params_sha256"]
    # the same run, again: bf16 autocast is deterministic on the CPU
    _, again = run(replace(SMALL, precision="bf16"))
    assert again["global_params_sha256"] == bf16_summary["global_params_sha256"]
    # every replica holds one θ̄
    hashes = {params_sha256(w.strategy.global_state()) for w in bf16.workers.values()}
    assert len(hashes) == 1
    assert (
        abs(bf16_summary["final_val_ppl"] - fp32_summary["final_val_ppl"])
        < 0.05 * fp32_summary["final_val_ppl"]
    )


# ---- CUDA ----


@needs_cuda
def test_copies_to_the_host_and_back_on_the_side_stream_keep_every_bit() -> None:
    placement = Placement(torch.device("cuda:0"))
    source = torch.randn(1 << 20, device="cuda:0")
    host = placement.to_host(source * 2).wait()
    assert host.device.type == "cpu" and host.is_pinned()
    assert torch.equal(host, (source * 2).cpu())
    back = placement.to_device(host)
    host.zero_()  # the caller may change its tensor at once: the copy was staged
    assert torch.equal(back.get(), source * 2)


@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_simulation_on_cuda_keeps_theta_bar_on_the_cpu_and_learns(precision: str) -> None:
    sim, summary = run(replace(SMALL, device="cuda", precision=precision))
    worker = next(iter(sim.workers.values()))
    assert next(worker.trainer.model.parameters()).device.type == "cuda"
    assert all(o.global_params.device.type == "cpu" for o in worker.strategy.outer)  # type: ignore[union-attr]
    assert summary["final_val_ppl"] < 0.9 * summary["initial_val_ppl"]
    _, cpu = run(replace(SMALL, device="cpu", precision=precision))
    assert summary["final_val_ppl"] == pytest.approx(cpu["final_val_ppl"], rel=0.05)


@needs_cuda
def test_a_cuda_replica_merges_like_a_cpu_replica() -> None:
    """The merge (CoCoDC's compensation) runs on the device; from the same state and the same
    averaged Δ a CUDA replica lands where a CPU one does, to float rounding."""
    cfg = SMALL.validate()
    cpu_setup = TrainingSetup(cfg)
    cuda_setup = TrainingSetup(replace(cfg, device="cuda"))
    (_, on_cpu), (_, on_cuda) = (
        cpu_setup.replica(cfg.algo_settings()),
        cuda_setup.replica(cfg.algo_settings()),
    )
    assert isinstance(on_cpu, Strategy) and isinstance(on_cuda, Strategy)
    delta = on_cpu.payload(1, 1)
    on_cuda.payload(1, 1)
    with torch.no_grad():
        for strategy in (on_cpu, on_cuda):
            for p in strategy.fragments[1].params:
                p.add_(torch.ones_like(p) * 1e-3)
    averaged = 0.5 * delta + 0.01
    on_cpu.apply(1, averaged, 3)
    on_cuda.apply(1, on_cuda.prepare(1, averaged), 3)
    assert torch.equal(on_cpu.outer[1].global_params, on_cuda.outer[1].global_params)
    assert torch.allclose(on_cpu.fragments[1].read(), on_cuda.fragments[1].read().cpu(), atol=1e-6)


# ---- a swarm of regions on different precisions ----

SWARM = [*TWO_PEERS, "--pace", "fixed"]


def test_a_bf16_region_and_an_fp32_region_hold_one_global_model(tmp_path: Path) -> None:
    """Regions on different hardware train together: one computes under bf16 autocast, one in fp32;
    θ̄ and the outer step are fp32 on each one's CPU, so both end with the same θ̄, bit for bit."""
    boot = start_bootstrap(tmp_path)
    peers = []
    try:
        for i, precision in enumerate(("fp32", "bf16")):
            args = ["join", "--bootstrap", boot.host_port, *SWARM, "--shard", f"{i}/2", "--run-id", "mixed"]
            args += ["--precision", precision, "--device", "cpu", "--out", f"p{i}.jsonl"]
            peers.append(spawn(args, tmp_path, f"p{i}.log"))
        same = run_cli(
            ["simulate", *SWARM[:-2], "--device", "cpu", "--out", "fp32.jsonl"], tmp_path, timeout=120
        )
        assert same.returncode == 0, same.stderr
        for i, peer in enumerate(peers):
            assert peer.wait(timeout=180) == 0, (tmp_path / f"p{i}.log").read_text()[-3000:]
    finally:
        for proc in [*peers, boot.proc]:
            end_group(proc)
    fp32, bf16 = (records(tmp_path / f"p{i}.jsonl")[-1] for i in range(2))
    assert fp32["rounds_done"] >= 4 and fp32["rounds_failed"] == 0
    assert fp32["global_params_sha256"] == bf16["global_params_sha256"]
    # and the bf16 region did compute in bf16: θ̄ is not the all-fp32 swarm's
    assert fp32["global_params_sha256"] != records(tmp_path / "fp32.jsonl")[-1]["global_params_sha256"]
    assert bf16["config"]["precision"] == "bf16"


@pytest.mark.skipif(CUDA, reason="checks the message of a machine without CUDA")
def test_join_and_simulate_without_cuda_say_so_in_one_line(tmp_path: Path) -> None:
    for command in (["simulate"], ["join", "--bootstrap", "127.0.0.1:9"]):
        done = run_cli([*command, *TINY_MODEL, "--steps", "2", "--device", "cuda"], tmp_path, timeout=120)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert "--device cuda: no CUDA device here" in lines[0]
