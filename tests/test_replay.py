"""``simulate --events``: the simulator replays the rounds a swarm run recorded (which workers each
round averaged, which rounds failed). The swarm-side oracle (a real run with a leaver replayed to
the same θ̄ hash) is in test_swarm.py; here, the replay's own rules, in process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from p2p_cocodc.config import build_config
from p2p_cocodc.errors import UserError
from p2p_cocodc.metrics import RunLog
from p2p_cocodc.sim import Simulation

OPTIONS = {
    "algo": "streaming",
    "model": "nano",
    "tokenizer": "byte",
    "seq_len": 32,
    "batch_size": 4,
    "workers": 3,
    "steps": 24,
    "inner_steps": 8,
    "fragments": 2,
    "overlap": 2,
    "eval_every": 24,
    "eval_batches": 2,
    "step_time": 0.05,
    "threads": 1,
}


class RecordsRounds(Simulation):
    """The plain simulation, noting the id of every round it averages."""

    rounds_seen: list[str] = []

    def _average(self, round_id, payloads):
        self.rounds_seen.append(round_id)
        return super()._average(round_id, payloads)


def plain_rounds() -> list[str]:
    RecordsRounds.rounds_seen = []
    RecordsRounds(build_config({}, OPTIONS)).run(RunLog(None))
    return list(RecordsRounds.rounds_seen)


@pytest.fixture(scope="module")
def rounds() -> list[str]:
    return plain_rounds()


def run(tmp_path: Path, events: dict[str, tuple[list[int], bool]] | None = None) -> str:
    options = dict(OPTIONS)
    if events is not None:
        path = tmp_path / "events.jsonl"
        lines = [{"kind": "round", "round": r, "members": m, "completed": c} for r, (m, c) in events.items()]
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        options["events"] = str(path)
    summary = Simulation(build_config({}, options)).run(RunLog(None))
    return summary["global_params_sha256"]


def test_replaying_full_groups_is_the_plain_run(tmp_path: Path, rounds: list[str]) -> None:
    assert len(rounds) >= 5
    full = {r: ([0, 1, 2], True) for r in rounds}
    assert run(tmp_path, full) == run(tmp_path)


def test_a_round_without_a_worker_or_failed_changes_theta_bar(tmp_path: Path, rounds: list[str]) -> None:
    plain = run(tmp_path)
    without = {r: ([0, 1, 2], True) for r in rounds} | {rounds[0]: ([0, 2], True)}
    failed = {r: ([0, 1, 2], True) for r in rounds} | {rounds[0]: ([], False)}
    hashes = {plain, run(tmp_path, without), run(tmp_path, failed)}
    assert len(hashes) == 3


def test_a_round_the_events_do_not_record_is_refused_with_one_line(tmp_path: Path, rounds: list[str]) -> None:
    partial = {r: ([0, 1, 2], True) for r in rounds[1:]}
    with pytest.raises(UserError, match=f"no record of round {rounds[0]}"):
        run(tmp_path, partial)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not a JSON line"),
        ('{"kind": "round", "round": "f0:8", "members": [0, 9], "completed": true}', "distinct shards"),
        ('{"kind": "round", "round": "f0:8", "members": [1, 1], "completed": true}', "distinct shards"),
        ('{"kind": "round", "round": "f0:8", "members": [], "completed": true}', "distinct shards"),
        ('{"kind": "eval", "step": 8}', "no round records"),
    ],
)
def test_malformed_events_are_refused_with_one_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(UserError, match=message):
        Simulation(build_config({}, {**OPTIONS, "events": str(path)}))
