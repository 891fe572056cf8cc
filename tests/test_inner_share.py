"""Uneven regions (``algorithms/inner_share.py``): which steps a region of share k/H trains, how auto
picks k, the options' one-line refusals, and the simulator's clock and replicas with uneven speeds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from p2p_cocodc.algorithms.aggregation import Aggregation, aggregate
from p2p_cocodc.algorithms.inner_share import (
    RegionShare,
    auto_share,
    parse_shares,
    recent_steps,
    share_steps,
    trains,
    weight,
)
from p2p_cocodc.config.train import TrainConfig
from p2p_cocodc.errors import UserError
from p2p_cocodc.run.records import RunLog
from p2p_cocodc.run.simulator import Simulation
from p2p_cocodc.swarm.messages import Part, parse_message
from p2p_cocodc.swarm.wire import BadMessage
from tests.swarm_procs import train_swarm
from tests.tiny_options import TINY, TINY_FIELDS


@given(st.integers(1, 64), st.data())
def test_a_share_trains_k_steps_of_every_window_spread_evenly(inner_steps: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(1, inner_steps))
    for window in range(3):
        steps = [
            s
            for s in range(window * inner_steps + 1, (window + 1) * inner_steps + 1)
            if trains(s, k, inner_steps)
        ]
        assert len(steps) == k
        # spread evenly: no two trained steps further apart than ⌈H/k⌉, the last at the window's end
        assert steps[-1] == (window + 1) * inner_steps
        gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
        assert all(gap <= -(-inner_steps // k) for gap in gaps)


def test_share_steps_rounds_and_keeps_at_least_one_step() -> None:
    assert share_steps(1.0, 48) == 48
    assert share_steps(0.5, 48) == 24
    assert share_steps(0.001, 48) == 1
    assert share_steps(0.34, 3) == 1
    for bad in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(UserError, match="--inner-share"):
            share_steps(bad, 48)


def test_auto_trains_in_proportion_to_speed_and_every_step_within_ten_percent_of_the_fastest() -> None:
    assert auto_share(0.10, 0.10) == 1.0
    assert auto_share(0.105, 0.10) == 1.0  # measured noise between equal regions: everyone trains
    assert auto_share(0.20, 0.10) == pytest.approx(0.5 / 1.1)  # 10 % spare, to catch up
    assert auto_share(0.40, 0.10) == pytest.approx(0.25 / 1.1)
    assert auto_share(0.0, 0.10) == 1.0  # not measured yet
    assert auto_share(0.20, 0.0) == 1.0  # nobody published a step time yet


def test_auto_chooses_from_the_median_of_the_last_window_of_step_times() -> None:
    """One slow step (a sync's merge at a boundary) does not make an equal region skip steps, as a
    moving average of step times did (2-5 of 768); a region slower for most of a window, or from
    its trial step on, takes its share."""
    region = RegionShare(None, 16)
    region.measured(0.05)  # the trial step before step 1
    assert not region.choose(lambda: 0.05) and region.steps == 16
    for step_s in [0.05] * 6 + [0.40] + [0.05] * 3:  # one step 8 × as long
        region.measured(step_s)
        assert not region.choose(lambda: 0.05) and region.steps == 16
    for _ in range(8):
        region.measured(0.10)
    assert region.choose(lambda: 0.05) and region.steps == round(16 * 0.5 / 1.1)  # half speed now
    for _ in range(9):
        region.measured(0.05)
    assert region.choose(lambda: 0.05) and region.steps == 16  # as fast again
    half = RegionShare(None, 16)
    half.measured(0.10)
    assert half.choose(lambda: 0.05) and half.steps == round(16 * 0.5 / 1.1)  # from step 1
    fixed = RegionShare(1.0, 16)
    fixed.measured(0.10)
    assert not fixed.choose(lambda: 0.05) and fixed.steps == 16  # a set share never changes


def test_an_auto_share_tells_the_steps_it_trained_at_each_steps_own_k() -> None:
    """A region on auto that slows down mid-window (k = 8 of 8, then 4 from step 13) tells the
    owners of its send after step 16 the steps it trained among 9-16: 4 at k = 8, then 2 at k = 4.
    Before, the k of the moment (4) was applied to the whole window: (4, 8). The count holds when
    the round starts up to τ < H steps after the send, and a fixed share keeps ``recent_steps``."""
    region, trained = RegionShare(None, 8), set()
    for step in range(1, 23):
        region.measured(0.10)
        region.choose(lambda step=step: 0.10 if step <= 12 else 0.05)  # the others twice as fast
        if region.trains(step):
            trained.add(step)
        if step == 12:
            assert region.recent(12) == (0, 0)  # 5-12: every step, at k = 8
        if step == 16:
            at_send = region.recent(16)
    assert region.steps == 4 and at_send == (len(trained & set(range(9, 17))), 8) == (6, 8)
    assert region.recent(16) == at_send  # 6 steps later, as the round starts
    assert recent_steps(16, 4, 8) == (4, 8)  # what the k of the moment gives
    fixed = RegionShare(0.5, 8)
    assert [fixed.trains(t) for t in range(1, 9)] == [trains(t, 4, 8) for t in range(1, 9)]
    assert all(fixed.recent(s) == recent_steps(s, 4, 8) for s in range(1, 30))


def test_inner_share_values_are_refused_in_one_line_naming_the_option() -> None:
    assert parse_shares("auto", 3) is None
    assert parse_shares("0.5", 3) == [0.5, 0.5, 0.5]
    assert parse_shares("1,1,0.25", 3) == [1.0, 1.0, 0.25]
    for bad, why in (
        ("1,0.5", "one per worker"),
        ("fast", "a number"),
        ("1,0,1", r"\(0, 1\]"),
        ("2", r"\(0, 1\]"),
    ):
        with pytest.raises(UserError, match=why):
            parse_shares(bad, 3)
    base = TrainConfig(**TINY_FIELDS, workers=3, steps=16)
    with pytest.raises(UserError, match="--inner-share 0.5: ddp averages every step"):
        TrainConfig(**{**TINY_FIELDS, "overlap": 0}, algo="ddp", workers=3, inner_share="0.5").validate()
    with pytest.raises(UserError, match="--worker-speeds '1,2': give 3 positive numbers"):
        TrainConfig(**{**base.__dict__, "worker_speeds": "1,2"}).validate()
    with pytest.raises(UserError, match="--worker-speeds '1,0,1'"):
        TrainConfig(**{**base.__dict__, "worker_speeds": "1,0,1"}).validate()


def simulate(**options: object) -> dict:
    """Without closing rounds: they take the link's time after training, whatever the speeds."""
    cfg = TrainConfig(
        **TINY_FIELDS,
        workers=3,
        steps=32,
        eval_every=32,
        step_time=0.1,
        codec="fp32",
        final_sync=False,
        **options,
    )
    return Simulation(cfg.validate()).run(RunLog(None))


def test_the_simulator_runs_at_the_slowest_replicas_pace_unless_it_trains_its_share() -> None:
    """Worker 2 at half speed: training every step, the run takes twice as long as an even one;
    training half the steps (auto), as long as an even one, and its θ̄ is that of --inner-share
    1,1,0.5. A share changes θ̄ (fewer steps were trained); speeds alone do not."""
    even = simulate()
    waiting = simulate(worker_speeds="1,1,0.5")
    sharing = simulate(worker_speeds="1,1,0.5", inner_share="auto")
    fixed = simulate(inner_share="1,1,0.5")
    assert waiting["sim_time_s"] == pytest.approx(2 * even["sim_time_s"])
    assert sharing["sim_time_s"] == pytest.approx(even["sim_time_s"])
    assert waiting["global_params_sha256"] == even["global_params_sha256"]
    assert sharing["global_params_sha256"] == fixed["global_params_sha256"] != even["global_params_sha256"]
    assert sharing["final_val_ppl"] < sharing["initial_val_ppl"] * 0.8  # it still learns


def test_a_slow_peer_on_auto_trains_its_share_and_the_swarm_keeps_one_global_model(tmp_path: Path) -> None:
    """Three real peers on --inner-share auto, peer 2 held to 0.25 s a step (--min-step-time), far
    slower than the others: it trains a share of the steps from step 1 (its own step time and the
    others' are on the board before it: measured on a throwaway copy, its floor included), chosen
    again before every step, and every peer ends with the same θ̄. Before, it trained every step
    until the others' first records came, and they waited for it."""
    options = [*TINY, "--run-id", "uneven", "--inner-share", "auto", "--pace", "fixed"]
    own = [[], [], ["--min-step-time", "0.25"]]
    summaries = train_swarm(tmp_path / "swarm", options, own, timeout=240)
    slow = summaries[2]
    # 1 of every 8 steps (the others' steps take milliseconds): steps 8, 16, 24 and 32
    assert slow["inner_share"] == 1 / 8 and slow["steps_trained"] == 32 // 8, slow
    assert len({s["global_params_sha256"] for s in summaries}) == 1
    assert all(s["rounds_failed"] == 0 for s in summaries)


def test_an_owner_weighs_each_members_slice_by_the_steps_it_trained() -> None:
    """Σ w_i x_i / Σ w_i for the mean; equal weights are the plain mean bit for bit; a robust rule
    runs on the values scaled by w_i·n / Σ w; screening judges the values as sent."""
    torch.manual_seed(0)
    values = [torch.randn(300) for _ in range(3)]
    plain, _ = aggregate(values)
    assert torch.equal(aggregate(values, weights=[0.5, 0.5, 0.5])[0], plain)
    weighted, _ = aggregate(values, weights=[1.0, 1.0, 0.5])
    expected = (values[0] + values[1] + 0.5 * values[2]) / 2.5
    assert torch.allclose(weighted, expected, atol=1e-6) and not torch.allclose(weighted, plain)
    trimmed = Aggregation(rule="trimmed-mean")
    scaled = [v * (w * 3 / 2.5) for v, w in zip(values, [1.0, 1.0, 0.5], strict=True)]
    assert torch.equal(aggregate(values, trimmed, weights=[1.0, 1.0, 0.5])[0], aggregate(scaled, trimmed)[0])


def test_a_part_tells_the_steps_its_sender_trained_and_a_bad_count_is_refused() -> None:
    members = (("a", 0), ("b", 1))
    part = Part("f0:8", members, 0, 1, 3, b"xyz", 4, 8)
    assert parse_message(part.to_wire()) == part
    assert (
        recent_steps(8, 4, 8) == (4, 8)
        and recent_steps(3, 4, 8) == (1, 3)
        and recent_steps(8, 8, 8) == (0, 0)
    )
    assert weight(*recent_steps(8, 8, 8)) == 1.0 and weight(4, 8) == 0.5
    older = {k: v for k, v in part.to_wire().items() if k not in ("trained", "window")}
    assert parse_message(older).weight() == (0, 0)  # a PART from a peer that predates the fields
    for trained, window in ((9, 8), (1, 0), (-1, 8), (1, 1 << 25), ("4", 8)):
        with pytest.raises(BadMessage, match="'trained'"):
            parse_message({**part.to_wire(), "trained": trained, "window": window})
