"""The options a run's peers share, by option name, and what a mismatched peer is told."""

from __future__ import annotations

from dataclasses import replace

import pytest

from p2p_cocodc.config.train import TrainConfig
from p2p_cocodc.peer.node import shared_options
from p2p_cocodc.run.setup import TrainingSetup
from p2p_cocodc.swarm.run_options import SHOWN_CHARS, differences, fingerprint, option_view

BASE = TrainConfig(
    model="nano", tokenizer="byte", seq_len=32, batch_size=4, workers=2, steps=48, inner_steps=8, fragments=2
)


def shared(**changes: object) -> dict:
    cfg = replace(BASE, **changes).validate()
    return shared_options(TrainingSetup(cfg), cfg.algo_settings())


def view(**changes: object) -> dict:
    return option_view(shared(**changes))


def test_the_view_names_options_as_the_command_line_does() -> None:
    ours = view()
    for name in ("--algo", "--lr", "--outer-lr", "--overlap", "--steps", "--seed", "--codec", "--aggregate"):
        assert name in ours, sorted(ours)
    assert ours["--overlap"] == 2 and ours["--steps"] == BASE.steps  # resolved: H/4, the inner total


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"lr": 2e-3}, "--lr 0.002 there, 0.001 here"),
        ({"outer_lr": 0.4}, "--outer-lr 0.4 there, 0.7 here"),
        ({"overlap": 3}, "--overlap 3 there, 2 here"),
        ({"steps": 96}, "--steps 96 there, 48 here"),
        ({"max_peers": 3}, "--max-peers 3 there, 2 here"),
    ],
)
def test_a_mismatch_names_the_option_and_both_values(changes: dict, expected: str) -> None:
    assert fingerprint(shared()) != fingerprint(shared(**changes))
    ours, theirs = view(), view(**changes)
    assert differences(ours, theirs) == [expected]


@pytest.mark.parametrize("theirs", [None, 3, "x", [1, 2], {}, {"--lr": None}, {"--unknown": 1}])
def test_what_another_peer_published_is_read_without_trust(theirs: object) -> None:
    ours = view()
    found = differences(ours, theirs)
    assert found == ([f"--lr null there, {ours['--lr']} here"] if theirs == {"--lr": None} else [])


def test_a_long_value_from_another_peer_is_cut_short_and_few_are_listed() -> None:
    ours = view()
    theirs = {name: "x" * 10_000 for name in ours}
    found = differences(ours, theirs)
    assert 0 < len(found) <= 4 and all(len(line) < 3 * SHOWN_CHARS + 40 for line in found)
