"""Invariants of the algorithm core that catch the classic sign, merge and schedule bugs."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from p2p_cocodc.algorithms.codecs import SyncCodecs, get_codec
from p2p_cocodc.algorithms.compensation import compensate_per_step, compensate_per_tensor
from p2p_cocodc.algorithms.fragments import assign_units, make_fragments
from p2p_cocodc.algorithms.inner import InnerTrainer
from p2p_cocodc.algorithms.outer import OuterOptimizer, OuterSettings
from p2p_cocodc.algorithms.schedules import (
    AdaptiveSchedule,
    FixedSchedule,
    RoundCost,
    delta_rms,
    paced_codec_spacing,
    paced_spacing,
)
from p2p_cocodc.algorithms.strategies import Strategy, make_strategy
from p2p_cocodc.config.train import TrainConfig
from p2p_cocodc.errors import UserError
from p2p_cocodc.models.build import build_model
from p2p_cocodc.run.records import RunLog, params_sha256
from p2p_cocodc.run.simulator import Simulation

SMALL = TrainConfig(
    model="nano",
    tokenizer="byte",
    seq_len=32,
    batch_size=4,
    workers=2,
    steps=32,
    inner_steps=8,
    fragments=4,
    overlap=2,
    eval_every=16,
    eval_batches=2,
    step_time=0.05,
    lr=3e-3,
    warmup=4,
    codec="fp32",  # the algorithms' own arithmetic, exact; the codecs have their tests
)


def simulate(cfg: TrainConfig, **kwargs) -> tuple[Simulation, dict]:
    sim = Simulation(replace(cfg, **kwargs).validate())
    return sim, sim.run(RunLog(None))


# ---- outer optimizer ----


def test_outer_step_with_lr_one_and_no_momentum_is_parameter_averaging() -> None:
    torch.manual_seed(0)
    global_params = torch.randn(100)
    replicas = [global_params + 0.1 * torch.randn(100) for _ in range(3)]
    opt = OuterOptimizer(global_params, OuterSettings(lr=1.0, momentum=0.0))
    delta = torch.stack([global_params - r for r in replicas]).mean(0)
    new = opt.step(delta)
    torch.testing.assert_close(new, torch.stack(replicas).mean(0), atol=1e-6, rtol=0)


def test_outer_nesterov_matches_torch_sgd() -> None:
    torch.manual_seed(0)
    start = torch.randn(50)
    ours = OuterOptimizer(start, OuterSettings(lr=0.7, momentum=0.9))
    param = torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(5):
        grad = torch.randn(50)
        ours.step(grad)
        param.grad = grad.clone()
        sgd.step()
    torch.testing.assert_close(ours.global_params, param.detach(), atol=1e-6, rtol=0)


def test_outer_momentum_clip_bounds_the_buffer() -> None:
    opt = OuterOptimizer(torch.zeros(4), OuterSettings(lr=1.0, momentum=0.9, momentum_clip=0.5))
    opt.step(torch.tensor([10.0, -10.0, 0.1, 0.0]))
    assert opt.momentum.abs().max() <= 0.5
    assert opt.momentum[2] == pytest.approx(0.1)


# ---- fragments ----


def test_strided_and_sequential_assignment() -> None:
    assert assign_units(6, 4, "strided") == [[0, 4], [1, 5], [2], [3]]
    assert assign_units(6, 3, "sequential") == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(UserError, match="--fragments 7 must be between 1 and the model's 6 units"):
        assign_units(6, 7, "strided")


def test_fragments_cover_every_parameter_once() -> None:
    model = build_model("tiny", 256, 32)
    fragments = make_fragments(model, 4, "strided")
    names = [n for f in fragments for n in f.names]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    flat = fragments[1].read()
    fragments[1].write(flat + 1.0)
    torch.testing.assert_close(fragments[1].read(), flat + 1.0)


# ---- compensation ----


def _tensors(seed: int, shapes=((8, 4), (16,))) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def test_taylor_correction_has_norm_lambda0_times_local_progress() -> None:
    z, snap, now = _tensors(1), _tensors(2), _tensors(3)
    for lam0 in (0.0, 0.2, 1.0):
        out = compensate_per_tensor(z, snap, now, lam0)
        for z_i, s_i, n_i, o_i in zip(z, snap, now, out, strict=True):
            g = s_i - n_i
            correction = z_i - g - o_i  # = λ·g⊙g⊙D
            assert float(correction.norm()) == pytest.approx(lam0 * float(g.norm()), rel=1e-4)
            if lam0 > 0:
                direction = g * g * (z_i - s_i)
                cos = torch.nn.functional.cosine_similarity(correction.flatten(), direction.flatten(), 0)
                assert float(cos) == pytest.approx(1.0, abs=1e-5)


def test_taylor_with_zero_lambda_reapplies_local_progress_and_zero_overlap_gives_z() -> None:
    z, snap, now = _tensors(1), _tensors(2), _tensors(3)
    for out, z_i, s_i, n_i in zip(compensate_per_tensor(z, snap, now, 0.0), z, snap, now, strict=True):
        torch.testing.assert_close(out, z_i + (n_i - s_i))
    for out, z_i in zip(compensate_per_tensor(z, snap, snap, 0.7), z, strict=True):
        assert torch.equal(out, z_i)


def test_per_step_rule_caps_lambda_and_debiases_weight_decay() -> None:
    z, snap, now = _tensors(1), _tensors(2), _tensors(3)
    capped = compensate_per_step(z, snap, now, lam0=1e6, steps=4, lam_max=2.0)
    for out, z_i, s_i, n_i in zip(capped, z, snap, now, strict=True):
        u = (s_i - n_i) / 4
        torch.testing.assert_close(out, z_i - 4 * (u + 2.0 * u * u * (z_i - s_i)))
    # λ0 = 0 with decay ρ: θ = now + ρ·(z − snap), weight decay applied to the displacement too.
    for out, z_i, s_i, n_i in zip(
        compensate_per_step(z, snap, now, 0.0, 4, decay=0.9), z, snap, now, strict=True
    ):
        torch.testing.assert_close(out, n_i + 0.9 * (z_i - s_i))


# ---- schedules ----


def test_fixed_schedule_sends_each_fragment_every_h_steps() -> None:
    schedule = FixedSchedule(inner_steps=12, num_fragments=4)
    sends = {p: [t for t in range(1, 61) if schedule.select(t, ()) == [p]] for p in range(4)}
    assert sends[0] == [3, 15, 27, 39, 51]
    assert sends[3] == [12, 24, 36, 48, 60]
    assert schedule.select(15, in_flight={0}) == []


def test_adaptive_schedule_bounds_staleness_and_never_resends_in_flight() -> None:
    H, K, N, tau = 24, 4, 8, 6
    schedule = AdaptiveSchedule(H, K, N)
    gen = torch.Generator().manual_seed(0)
    in_flight: dict[int, int] = {}
    last_sync = [0] * K
    order = []
    for t in range(1, 400):
        for p in [p for p, due in in_flight.items() if due <= t]:
            del in_flight[p]
            schedule.record_result(p, delta_rms(torch.randn(10, generator=gen) * (p + 1)))
        for p in schedule.select(t, in_flight.keys()):
            assert p not in in_flight
            in_flight[p] = t + tau
            schedule.record_send(p, t)
            assert t - last_sync[p] <= H + H // N, f"fragment {p} went {t - last_sync[p]} steps unsent"
            last_sync[p] = t
            order.append(p)
    assert order[:K] == list(range(K))  # never-sent fragments first
    counts = [order.count(p) for p in range(K)]
    assert counts[3] > counts[0]  # the fastest-drifting fragment is sent most often


def test_a_paced_schedule_spaces_its_slots_never_below_h_over_n_and_keeps_the_spacing() -> None:
    schedule = AdaptiveSchedule(inner_steps=24, num_fragments=4, transmissions=4)  # a slot every 6
    assert [t for t in range(1, 40) if schedule.select(t, ())] == [6, 12, 18, 24, 30, 36]
    assert schedule.overlap(4) == 4  # not paced: τ as configured
    schedule.set_spacing(15)
    assert [t for t in range(1, 40) if schedule.select(t, ())] == [15, 30]
    assert schedule.overlap(4) == 14 and schedule.overlap(20) == 14  # the slot less a step, whatever τ
    schedule.set_spacing(30)  # slots ≥ H apart: every slot finds a stale fragment, the stalest goes
    sent = []
    for t in range(30, 300, 30):
        (p,) = schedule.select(t, ())
        schedule.record_send(p, t)
        sent.append(p)
    assert sent == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    schedule.set_spacing(2)  # narrower than ⌊H/N⌋: the configured N stays the most a run sends
    assert schedule.spacing == 6
    schedule.set_spacing(1 << 24)  # what a hostile peer may ask: at most one slot every 4·H steps
    assert schedule.spacing == 4 * 24
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="spacing"):
            schedule.set_spacing(bad)  # type: ignore[arg-type]
    schedule.set_spacing(20)
    restored = AdaptiveSchedule(inner_steps=24, num_fragments=4, transmissions=4)
    restored.load_state_dict(schedule.state_dict())
    assert restored.spacing == 20
    with pytest.raises(ValueError, match="cannot be paced"):
        FixedSchedule(24, 4).set_spacing(12)


def test_the_paced_spacing_is_what_the_link_keeps_up_with_within_bounds() -> None:
    # ⌊H/N⌋ = 24 of H = 48; the link is busy 3 s per round, a step takes 0.1 s: with 25 % headroom,
    # a slot every 37.5 steps, rounded up to a multiple of a quarter of 24
    assert paced_spacing(24, 48, 3.0, 0.1) == 42
    assert paced_spacing(24, 48, 4.32, 0.1) == 54  # exactly 54
    assert paced_spacing(24, 48, 0.5, 0.1) == 24  # a fast link: the configured ⌊H/N⌋
    assert paced_spacing(24, 48, 600.0, 0.1) == 4 * 48  # at most one slot every 4·H steps
    assert paced_spacing(24, 48, 0.0, 0.1) == 24  # nothing measured yet
    assert paced_spacing(24, 48, 3.0, 0.0) == 24
    assert paced_spacing(3, 24, 1.0, 0.25) == 5  # ⌊H/N⌋ under 4: whole steps
    # going back to a narrower spacing needs 1.4× the busy time there, not 1.25×
    assert paced_spacing(24, 48, 3.3, 0.1, current=48) == 48  # 1.25 · 3.3 s = 41.25 steps, 1.4 · 3.3 = 46.2
    assert paced_spacing(24, 48, 2.8, 0.1, current=48) == 42  # 1.4 · 2.8 s = 39.2 steps
    assert paced_spacing(24, 48, 2.8, 0.1, current=48, settled=False) == 48  # a round or two: no narrower
    assert paced_spacing(24, 48, 4.0, 0.1, current=42, settled=False) == 54  # but wider at once
    assert paced_spacing(24, 48, 4.0, 0.1, current=42) == 54  # wider as before
    # at ⌊H/N⌋ a sync gets τ steps, not its slot: where τ + 1 falls short of the need, ⌊H/N⌋ + q
    assert paced_spacing(24, 48, 1.6, 0.1, overlap=23) == 24  # 1.25 · 1.6 s = 20 steps ≤ τ + 1 = 24
    assert paced_spacing(24, 48, 1.6, 0.1, overlap=17) == 30  # 20 steps > τ + 1 = 18
    assert paced_spacing(24, 48, 1.4, 0.1, current=30, overlap=17) == 30  # 1.4 · 1.4 s = 19.6 > 18
    assert paced_spacing(24, 48, 1.4, 0.1, current=30, overlap=19) == 24  # 19.6 ≤ 20


def test_the_paced_spacing_gives_a_sync_the_steps_it_takes_to_land() -> None:
    """A fast link (no busy time to speak of) whose syncs take D = 0.5 s from send to result: at
    ⌊H/N⌋ = 1 with τ = 1 and steps of 0.2 s, they land 2.5 steps late. The spacing h gives a paced
    sync h − 1 steps, so h ≥ 1.25 · D / s + 1 (``docs/thin-link.md``: `region` stalled 13–28 %)."""
    assert paced_spacing(1, 48, 0.01, 0.2, overlap=1) == 1  # D not measured yet: the link alone
    assert paced_spacing(1, 48, 0.01, 0.2, overlap=1, landing_s=0.5) == 5  # 1.25 · 2.5 + 1 = 4.1
    assert paced_spacing(1, 48, 0.0, 0.2, overlap=1, landing_s=0.5) == 5  # no bulk delivery timed
    assert paced_spacing(1, 48, 0.01, 0.2, overlap=4, landing_s=0.5) == 1  # τ = 4 steps ≥ 3.1
    # the link's own need still counts where it is the larger one: 1.25 · 3 s = 37.5 steps
    assert paced_spacing(24, 48, 3.0, 0.1, overlap=23, landing_s=2.0) == 42  # 1.25 · 20 + 1 = 26
    assert paced_spacing(24, 48, 3.0, 0.1, overlap=23, landing_s=3.6) == 48  # 1.25 · 36 + 1 = 46
    # narrowing takes 1.4×, as for the link: 1.4 · 2.5 + 1 = 4.5 steps
    assert paced_spacing(1, 48, 0.01, 0.2, current=6, overlap=1, landing_s=0.5) == 5
    assert paced_spacing(1, 48, 0.01, 0.2, current=6, overlap=1, landing_s=0.5, settled=False) == 6
    assert paced_spacing(1, 48, 0.01, 0.2, current=4, overlap=1, landing_s=0.5) == 5  # wider at once


def test_with_a_paced_codec_the_spacing_says_which_codec_a_link_keeps_up_with() -> None:
    """--paced-codec (a coarser codec's round takes half the steady one's link time here): ⌊H/N⌋ =
    24 of H = 48, q = 6, a step of 0.1 s. The steady codec at ⌊H/N⌋ while its rounds fit there, or
    at ⌊H/N⌋ + q where τ is too short to land them (latency, which fewer bytes do not help); else
    the coarser one, at least ⌊H/N⌋ + q + 1 = 31, the spacing that says so; and back to the steady
    codec only where its rounds fit with 1.4× headroom, once the link's measurement settled."""

    def wish(steady_busy: float, current: int = 24, settled: bool = True, overlap: int = 23) -> int:
        coarse_busy = steady_busy / 2
        return paced_codec_spacing(
            24, 48, RoundCost(steady_busy), RoundCost(coarse_busy), 0.1, current, settled, overlap
        )

    assert wish(1.6) == 24  # the steady codec: 1.25 · 1.6 s = 20 steps
    assert wish(1.6, overlap=12) == 30  # steady, paced by a grain: 20 steps > τ + 1 = 13
    assert wish(3.0) == 31  # steady 37.5 steps; coarse 18.75, at least ⌊H/N⌋ + q + 1
    assert wish(6.0) == 42  # coarse: 1.25 · 3 s = 37.5 steps, up to a multiple of 6
    assert wish(0.0) == 24  # nothing measured yet
    assert AdaptiveSchedule(48, 2, 2).bandwidth_paced() is False
    for spacing, coarse in ((30, False), (31, True)):
        schedule = AdaptiveSchedule(48, 2, 2)
        schedule.set_spacing(spacing)
        assert schedule.bandwidth_paced() is coarse
    # with the coarser codec in use (current ≥ 31)
    assert wish(3.0, current=36) == 31  # steady: 1.4 · 3 s = 42 steps, too many; coarse 21, at least 31
    assert wish(1.6, current=36) == 24  # steady: 1.4 · 1.6 s = 22.4 steps fit in 24
    assert wish(1.6, current=36, settled=False) == 36  # not before the measurement settled
    assert wish(6.0, current=42) == 42  # coarse: the narrowing headroom keeps 42 (1.4 · 30 = 42)
    assert wish(4.8, current=48) == 36  # coarse: 1.4 · 24 = 33.6 steps, up to 36


def test_a_paced_schedule_counts_its_slots_from_the_last_send() -> None:
    """Two sends are never closer than the spacing, across a change of it either way (the multiples
    of a new spacing may lie a step after the last send)."""
    schedule = AdaptiveSchedule(inner_steps=24, num_fragments=4, transmissions=1)  # a slot every 24

    def sends(steps: range) -> list[int]:
        sent = []
        for t in steps:
            for p in schedule.select(t, ()):
                schedule.record_send(p, t)
                sent.append(t)
        return sent

    assert sends(range(1, 30)) == [24]
    schedule.set_spacing(36)  # at step 29: the multiples of 36 would send at 36, 12 steps after 24
    assert sends(range(30, 100)) == [60, 96]
    schedule.set_spacing(30)  # narrower, at step 99: 30 after the last send, not at the multiples of 30
    assert sends(range(100, 160)) == [126, 156]
    restored = AdaptiveSchedule(inner_steps=24, num_fragments=4, transmissions=1)
    restored.load_state_dict(schedule.state_dict())  # a joiner's slots are the swarm's
    assert [t for t in range(157, 200) if restored.select(t, ())] == [186]
    # a narrower spacing that comes after its first slot (the result carrying it landed 41 steps
    # after the last send): a slot at once, and the spacing from there; a restored schedule keeps it
    assert sends(range(160, 187)) == [186]
    schedule.set_spacing(42, step=187)
    assert sends(range(187, 229)) == [228]
    schedule.set_spacing(31, step=269)  # 269 − 228 = 41 > 31: the slot at 259 has passed
    restored.load_state_dict(schedule.state_dict())
    assert sends(range(269, 301)) == [269, 300]
    assert [t for t in range(269, 301) if restored.select(t, ())] == [269, 300]
    schedule.set_spacing(62, step=301)  # wider: no catching up
    schedule.set_spacing(31, step=320)  # narrower, but 320 − 300 = 20: its first slot is still ahead
    assert sends(range(301, 340)) == [331]


def test_adaptive_schedule_picks_highest_drift() -> None:
    schedule = AdaptiveSchedule(inner_steps=100, num_fragments=3, transmissions=50)
    # drift = rms(last Δ) · steps since send / last interval: [1·8/2, 5·6/4, 10·4/6] = [4, 7.5, 6.7]
    for p in range(3):
        schedule.record_send(p, 2 * (p + 1))
        schedule.record_result(p, delta_rms(torch.full((4,), [1.0, 5.0, 10.0][p])))
    assert schedule.select(10, ()) == [1]
    assert schedule.select(10, {1}) == [2]
    assert schedule.select(10, {1, 2}) == [0]
    assert schedule.select(11, ()) == []  # not a send slot (one slot every ⌊100/50⌋ = 2 steps)


# ---- whole-run equivalences (the simulator drives the real strategies) ----


def test_single_worker_diloco_with_plain_outer_step_equals_adamw() -> None:
    cfg = replace(SMALL, workers=1, algo="diloco", overlap=0, outer_lr=1.0, outer_momentum=0.0)
    sim = Simulation(cfg.validate())
    reference_model = copy.deepcopy(sim.workers[0].trainer.model)
    initial = copy.deepcopy(reference_model.state_dict())
    reference = InnerTrainer(reference_model, sim.setup.inner)
    sim.run(RunLog(None))
    for step in range(1, cfg.steps + 1):
        reference.step(*sim.workers[0].shard.batch(step - 1), step)
    final = sim.global_state()
    for name, value in final.items():
        torch.testing.assert_close(value, reference_model.state_dict()[name], atol=1e-5, rtol=0)
    assert max(float((final[k] - v).abs().max()) for k, v in initial.items()) > 1e-2


def test_streaming_with_one_fragment_and_no_overlap_equals_diloco() -> None:
    _, diloco = simulate(SMALL, algo="diloco", overlap=0)
    _, streaming = simulate(SMALL, algo="streaming", fragments=1, overlap=0, alpha=0.0)
    _, streaming_merge = simulate(SMALL, algo="streaming", fragments=1, overlap=0, alpha=0.5)
    assert streaming["global_params_sha256"] == diloco["global_params_sha256"]
    assert streaming_merge["global_params_sha256"] != diloco["global_params_sha256"]


def test_cocodc_without_overlap_equals_streaming_without_merge() -> None:
    _, cocodc = simulate(SMALL, algo="cocodc", overlap=0, dc_lambda=0.5, dc_alpha=0.0)
    _, streaming = simulate(SMALL, algo="streaming", overlap=0, alpha=0.0)
    assert cocodc["global_params_sha256"] == streaming["global_params_sha256"]
    _, overlapped = simulate(SMALL, algo="cocodc", overlap=2, dc_lambda=0.5, dc_alpha=0.0)
    assert overlapped["global_params_sha256"] != streaming["global_params_sha256"]


def test_cocodc_damped_without_overlap_equals_streaming_merge() -> None:
    _, cocodc = simulate(SMALL, algo="cocodc", overlap=0, dc_alpha=0.5)
    _, streaming = simulate(SMALL, algo="streaming", overlap=0, alpha=0.5)
    assert cocodc["global_params_sha256"] == streaming["global_params_sha256"]


@pytest.mark.parametrize(
    "algo,codec", [("streaming", "int8"), ("cocodc", "fp4"), ("diloco", "bf16"), ("cocodc", "topk4")]
)
def test_every_worker_holds_identical_global_params_after_every_sync(algo: str, codec: str) -> None:
    cfg = replace(
        SMALL,
        algo=algo,
        codec=codec,
        workers=3,
        steps=30,
        overlap=0 if algo == "diloco" else 3,
        transmissions=8,
    )
    sim = Simulation(cfg.validate())
    checked = []

    def check(step: int, record: dict) -> None:
        hashes = {params_sha256(w.strategy.global_state()) for w in sim.workers.values()}
        assert len(hashes) == 1, f"θ̄ differs across workers after step {step}"
        checked.append(step)

    summary = sim.run(RunLog(None), progress=check)
    assert len(checked) == cfg.steps
    assert summary["final_val_ppl"] < 0.8 * summary["initial_val_ppl"]
    local = [params_sha256(w.trainer.model.state_dict()) for w in sim.workers.values()]
    assert len(set(local)) == 3  # replicas themselves differ: each trained on its own shard


def test_ddp_replicas_stay_identical_and_learn() -> None:
    sim, summary = simulate(SMALL, algo="ddp", workers=2, overlap=0)
    states = [w.trainer.model.state_dict() for w in sim.workers.values()]
    assert params_sha256(states[0]) == params_sha256(states[1])
    assert summary["final_val_ppl"] < 0.8 * summary["initial_val_ppl"]


def test_blocking_diloco_stalls_and_overlap_hides_the_transfer() -> None:
    slow = dict(latency_ms=20.0, bandwidth_mbps=20.0, step_time=0.05)  # fragments fit, a full sync stalls
    _, diloco = simulate(SMALL, algo="diloco", overlap=0, **slow)
    _, streaming = simulate(SMALL, algo="streaming", overlap="auto", **slow)
    assert diloco["stall_s"] > 0.5
    assert streaming["stall_s"] < 0.1 * diloco["stall_s"]
    assert streaming["overlap"] >= 1
    assert streaming["sim_time_s"] < diloco["sim_time_s"]


def test_auto_overlap_too_slow_link_is_a_clear_error() -> None:
    with pytest.raises(UserError, match="--overlap auto: a fragment transfer takes"):
        Simulation(replace(SMALL, algo="streaming", overlap="auto", bandwidth_mbps=0.01).validate())


def test_strategy_refuses_resending_a_fragment_in_flight() -> None:
    sim = Simulation(replace(SMALL, algo="cocodc").validate())
    strategy = sim.workers[0].strategy
    assert isinstance(strategy, Strategy)
    strategy.payload(0, 1)
    with pytest.raises(RuntimeError, match="already in flight"):
        strategy.payload(0, 2)


# ---- error feedback ----


def test_error_feedback_leaves_what_was_not_sent_in_the_replica_for_the_next_sync() -> None:
    codec = get_codec("topk2")
    settings = replace(SMALL, algo="cocodc", dc_alpha=0.5).algo_settings()
    model = build_model("nano", 256, 32)
    twin_model = copy.deepcopy(model)
    strategy = make_strategy(model, settings, codecs=SyncCodecs(codec, None, feedback=True))
    plain = make_strategy(twin_model, settings)  # the same replica without error feedback
    assert isinstance(strategy, Strategy) and isinstance(plain, Strategy) and strategy.kept_share == 0.5
    _progress(strategy, 0)
    _progress(plain, 0)
    delta = strategy.outer[1].global_params - strategy.fragments[1].read()
    sent = strategy.payload(1, 1)
    assert torch.equal(sent, codec.roundtrip(delta)) and torch.equal(plain.payload(1, 1), delta)
    assert 0 < int((sent != 0).sum()) <= delta.numel() // 8 + 32  # 32 of every 256 values at most
    residual = strategy.in_flight[1].residual
    assert residual is not None and torch.equal(residual, delta - sent)
    saved = copy.deepcopy(strategy.state_dict())  # the residual of a sync in flight is checkpointed
    assert torch.equal(saved["in_flight"][0]["residual"], residual)
    assert "residual" not in str(strategy.shared_state())  # per replica: a joiner has none
    strategy.abandon(1)  # failed: nothing changes, the next Δ_p holds everything again
    assert torch.equal(strategy.payload(1, 2), sent)
    average = codec.roundtrip(delta * 0.5)
    strategy.apply(1, average.clone(), 3)
    plain.apply(1, average.clone(), 3)
    assert torch.equal(strategy.outer[1].global_params, plain.outer[1].global_params)  # θ̄ alike
    # the replica keeps (1 − ρ) of what was not sent on top of what the merge keeps (ρ of it)
    kept = plain.fragments[1].read() - strategy.fragments[1].read()
    assert torch.allclose(kept, 0.5 * residual, atol=1e-6) and kept.abs().max() > 0
    # so the next outer gradient holds it: Δ_p = θ̄_p − θ_p
    after = strategy.outer[1].global_params - strategy.fragments[1].read()
    assert torch.allclose(after - (plain.outer[1].global_params - plain.fragments[1].read()), kept, atol=1e-6)
    fresh = make_strategy(build_model("nano", 256, 32), settings, codecs=SyncCodecs(codec, None, True))
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.in_flight[1].residual, residual)  # type: ignore[arg-type]


def test_a_sync_sent_while_a_link_paces_the_swarm_takes_the_paced_codec() -> None:
    """A sync sent with the send slots wider than ⌊H/N⌋ is encoded with the paced codec, its
    error fed back; which codec a sync in flight took is checkpointed and goes to a joiner with
    the shared state (it follows from the schedule's spacing at the send, which every replica
    holds alike, and every member of a round must encode it alike)."""
    fp4, q2 = get_codec("fp4"), get_codec("q2")
    settings = replace(SMALL, algo="cocodc").algo_settings()

    def strategy() -> Strategy:
        made = make_strategy(build_model("nano", 256, 32), settings, codecs=SyncCodecs(fp4, q2, True))
        assert isinstance(made, Strategy)
        return made

    paced = strategy()
    _progress(paced, 0)
    delta = [paced.outer[p].global_params - paced.fragments[p].read() for p in range(2)]
    assert torch.equal(paced.payload(0, 2), fp4.roundtrip(delta[0]))  # at ⌊H/N⌋: the steady codec
    paced.schedule.set_spacing(2 * paced.schedule.base_spacing)
    sent = paced.payload(1, 4)
    assert torch.equal(sent, q2.roundtrip(delta[1])) and not torch.equal(sent, fp4.roundtrip(delta[1]))
    assert torch.equal(paced.in_flight[1].residual, delta[1] - sent)  # type: ignore[arg-type]
    assert (paced.sync_codec(0), paced.sync_codec(1)) == (fp4, q2)
    resumed, joiner = strategy(), strategy()
    resumed.load_state_dict(copy.deepcopy(paced.state_dict()))
    joiner.join_from(paced.shared_state())
    for other in (resumed, joiner):
        assert (other.sync_codec(0), other.sync_codec(1)) == (fp4, q2)
    hostile = copy.deepcopy(paced.shared_state())
    hostile["in_flight"][0]["paced"] = "yes"
    with pytest.raises(ValueError, match="paced='yes'"):
        strategy().join_from(hostile)


def test_a_lossless_codec_or_error_feedback_off_keeps_no_residual() -> None:
    for codec, feedback in (("fp32", True), ("topk2", False)):
        sim = Simulation(replace(SMALL, algo="cocodc", codec=codec, error_feedback=feedback).validate())
        strategy = sim.workers[0].strategy
        assert isinstance(strategy, Strategy)
        strategy.payload(0, 1)
        assert strategy.in_flight[0].residual is None


def test_topk_options_are_checked() -> None:
    with pytest.raises(UserError, match="--topk applies to the topk2 and topk4 codecs"):
        replace(SMALL, topk=0.1).validate()
    with pytest.raises(UserError, match="--topk must be a fraction"):
        replace(SMALL, codec="topk2", topk=0.0).validate()
    for codec in ("topk4", "q2"):
        with pytest.raises(UserError, match=f"--codec {codec} is too coarse without error feedback"):
            replace(SMALL, algo="ddp", overlap=0, codec=codec).validate()


# ---- joining a run under way ----


def test_closing_the_run_syncs_every_fragment_not_sent_at_the_last_step_and_applies_it_at_once() -> None:
    """--final-sync: at the last step a sync in flight is due at once, and every fragment but one the
    schedule sent at that step goes once more with τ = 0; after those are applied, θ̄ holds every
    fragment's training (streaming with α = 0 leaves the replica equal to θ̄)."""
    settings = replace(SMALL, algo="streaming", fragments=2, overlap=3, alpha=0.0).algo_settings()
    strategy = make_strategy(build_model("nano", 256, 32), settings)
    assert isinstance(strategy, Strategy) and len(strategy.fragments) == 2
    _progress(strategy, 0)
    strategy.send(1, 38)  # in flight, due at 41
    assert strategy.due(40) == []
    strategy.close(40)
    assert strategy.due(40) == [1]
    strategy.apply(1, strategy.outer[1].global_params - strategy.in_flight[1].snapshot, 40)
    for p in (0, 1):  # one at a time, each applied at once (τ = 0) before the next is sent
        assert strategy.sends_after(40) == [p]
        strategy.send(p, 40)
        assert strategy.due(40) == [p]
        strategy.apply(p, strategy.outer[p].global_params - strategy.in_flight[p].snapshot, 40)
    assert strategy.sends_after(40) == []  # and then none, whatever the schedule would send
    for p, fragment in enumerate(strategy.fragments):
        assert torch.equal(fragment.read(), strategy.outer[p].global_params)
    sent_last = make_strategy(build_model("nano", 256, 32), settings)
    assert isinstance(sent_last, Strategy)
    sent_last.send(0, 40)  # the schedule's own send at the last step carries all of fragment 0
    sent_last.close(40)
    assert sent_last.due(40) == [0] and sent_last.sends_after(40) == [1] and sent_last.sends_after(40) == []


def _progress(strategy: Strategy, seed: int) -> None:
    """Local training, as far as the strategy can tell: every fragment of the replica moves."""
    g = torch.Generator().manual_seed(seed)
    for fragment in strategy.fragments:
        flat = fragment.read()
        fragment.write(flat + 0.01 * torch.randn(flat.shape, generator=g))


def _fragment_strategy(model: torch.nn.Module, cfg: TrainConfig) -> Strategy:
    strategy = make_strategy(model, cfg.algo_settings())
    assert isinstance(strategy, Strategy)
    return strategy


def _plain_values_only(value: object) -> bool:
    """What the swarm can send: tensors, and int/float/bool/str/None in lists and str-keyed dicts."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain_values_only(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain_values_only(v) for v in value)
    return value is None or isinstance(value, (torch.Tensor, int, float, bool, str))


def test_a_joiner_takes_over_global_params_momentum_schedule_and_syncs_in_flight() -> None:
    base = build_model("nano", 256, 32)
    donor = _fragment_strategy(copy.deepcopy(base), SMALL)  # cocodc: its merge uses the snapshot
    _progress(donor, 1)
    donor.apply(1, 0.5 * donor.payload(1, 2), 4)  # θ̄_1, momentum and the schedule's drift move
    _progress(donor, 2)
    donor.payload(0, 6)  # in flight at S = 6, due at 8
    shared = donor.shared_state()
    assert _plain_values_only(shared)
    assert shared["in_flight"] == [{"fragment": 0, "sent_step": 6, "due_step": 8, "paced": False}]

    joiner = _fragment_strategy(copy.deepcopy(base), SMALL)
    _progress(joiner, 3)  # what the fresh replica held before does not matter
    joiner.join_from(shared)
    theta_bar = donor.outer[0].global_params.clone()
    assert params_sha256(joiner.global_state()) == params_sha256(donor.global_state())
    assert params_sha256(joiner.model.state_dict()) == params_sha256(joiner.global_state())
    assert joiner.schedule.state_dict() == donor.schedule.state_dict()
    assert torch.equal(joiner.outer[1].momentum, donor.outer[1].momentum) and donor.outer[1].momentum.any()
    assert torch.equal(joiner.in_flight[0].snapshot, theta_bar)
    assert joiner.outer[0].global_params.data_ptr() != donor.outer[0].global_params.data_ptr()

    _progress(donor, 4)
    _progress(joiner, 5)
    now = joiner.fragments[0].read()
    averaged = 0.01 * torch.randn(theta_bar.shape, generator=torch.Generator().manual_seed(6))
    for strategy in (donor, joiner):
        strategy.apply(0, averaged, 8)
    assert params_sha256(joiner.global_state()) == params_sha256(donor.global_state())
    # the joiner compensates its progress since S against θ̄_0 at S, damped by dc_alpha
    f = joiner.fragments[0]
    z = joiner.outer[0].global_params
    expected = compensate_per_tensor(
        f.per_tensor(z), f.per_tensor(theta_bar), f.per_tensor(now), SMALL.dc_lambda
    )
    compensated = torch.cat([e.reshape(-1) for e in expected])
    assert torch.equal(f.read(), torch.lerp(compensated, now, SMALL.dc_alpha))


def test_joining_from_a_state_of_another_fragment_split_is_refused() -> None:
    base = build_model("nano", 256, 32)
    donor = _fragment_strategy(copy.deepcopy(base), SMALL)
    joiner = _fragment_strategy(copy.deepcopy(base), replace(SMALL, fragments=2))
    with pytest.raises(ValueError, match="the state has 4 fragments, this strategy 2"):
        joiner.join_from(donor.shared_state())


def test_divergence_is_a_clear_error() -> None:
    with pytest.raises(UserError, match="training diverged at step .*lower --lr"):
        simulate(SMALL, algo="diloco", overlap=0, lr=1e6, warmup=0, grad_clip=0.0)


def test_auto_transmissions_is_what_the_link_carries_in_h_steps() -> None:
    link = dict(latency_ms=20.0, bandwidth_mbps=20.0, step_time=0.05)
    sim = Simulation(replace(SMALL, algo="cocodc", transmissions="auto", **link).validate())
    sizes = [f.numel for f in make_fragments(sim.workers[0].trainer.model, SMALL.fragments, "strided")]
    # butterfly all-reduce of M = 2 replicas: each link carries 2(M−1)/M = 1× the fp32 fragment
    mean_seconds = sum(0.020 + 8 * 4 * n / 20e6 for n in sizes) / len(sizes)
    assert sim.settings.transmissions == int(SMALL.inner_steps * 0.05 / mean_seconds)
    assert 1 <= sim.settings.transmissions < SMALL.inner_steps
