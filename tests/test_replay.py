"""``simulate --events``: the simulator replays the rounds a swarm run recorded (which data shards
each round averaged, which rounds failed) and the replicas that joined it under way. The swarm-side
oracle (a real run with a leaver replayed to the same θ̄ hash) is in test_swarm.py; here, the
replay's own rules, in process."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from p2p_cocodc.algorithms.inner import InnerTrainer
from p2p_cocodc.algorithms.strategies import Strategy
from p2p_cocodc.config.train import build_config
from p2p_cocodc.errors import UserError
from p2p_cocodc.run.records import RunLog, params_sha256
from p2p_cocodc.run.simulator import Simulation

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

    def _average(self, round_id, step, payloads, codec):
        self.rounds_seen.append(round_id)
        return super()._average(round_id, step, payloads, codec)


def plain_rounds() -> list[str]:
    RecordsRounds.rounds_seen = []
    RecordsRounds(build_config({}, OPTIONS)).run(RunLog(None))
    return list(RecordsRounds.rounds_seen)


@pytest.fixture(scope="module")
def rounds() -> list[str]:
    return plain_rounds()


Rounds = dict[str, tuple[list[int], bool]]  # round id: members, completed
Joins = Sequence[tuple[int, int]]  # (shard, step)


def replay(
    tmp_path: Path,
    events: Rounds | None = None,
    joins: Joins = (),
    paces: dict[str, int] | None = None,
    sim_class: type[Simulation] = Simulation,
    **options: object,
) -> Simulation:
    """A simulation of OPTIONS (changed by ``options``) that replays these round records (with the
    pace a round agreed, from ``paces``) and these (shard, step) join records, as a peer writes them."""
    options = {**OPTIONS, **options}
    if events is not None:
        path = tmp_path / "events.jsonl"
        paces = paces or {}
        lines = [{"kind": "join", "shard": i, "step": s, "peer": f"peer{i}"} for i, s in joins]
        lines += [
            {"kind": "round", "round": r, "members": m, "completed": c, "pace": paces.get(r, 0)}
            for r, (m, c) in events.items()
        ]
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        options["events"] = str(path)
    return sim_class(build_config({}, options))


def run(tmp_path: Path, events: Rounds | None = None, joins: Joins = (), **options: object) -> str:
    return replay(tmp_path, events, joins, **options).run(RunLog(None))["global_params_sha256"]


def test_replaying_full_groups_is_the_plain_run(tmp_path: Path, rounds: list[str]) -> None:
    assert len(rounds) >= 5
    full = {r: ([0, 1, 2], True) for r in rounds}
    plain = run(tmp_path)
    assert run(tmp_path, full) == plain
    started = [(0, 0), (1, 0), (2, 0), (2, 0)]  # a join a peer learnt of twice counts once
    assert run(tmp_path, full, started) == plain


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


def test_a_pace_agreed_with_a_round_spaces_the_later_sends_and_a_joiner_keeps_it(tmp_path: Path) -> None:
    """cocodc with H = 8, N = 4: a send slot every 2 steps. The round sent after step 2 (fragment 0,
    applied after step 4, τ = 2) agreed on a pace of 6: from then on slots are 6 steps apart, on
    every replica, and a replica that joins later takes the spacing over with the shared state."""
    options = {"algo": "cocodc", "transmissions": 4, "steps": 40}
    all_rounds = {
        f"f{p}:{step}": ([0, 1, 2], True) for p in range(2) for step in range(1, options["steps"] + 1)
    }
    paced = replay(tmp_path, all_rounds, paces={"f0:2": 6}, sim_class=RecordsRounds, **options)
    RecordsRounds.rounds_seen = []
    paced_hash = paced.run(RunLog(None))["global_params_sha256"]
    sent_at = [int(r.split(":")[1]) for r in RecordsRounds.rounds_seen]
    # applied after step 4 before step 4's sends (apply, send, apply): slot 4 is already paced, and
    # the slots are counted from the last send (step 2)
    scheduled = [step for step in sent_at if step < options["steps"]]  # the closing rounds: at 40
    gaps = {b - a for a, b in zip(scheduled[1:], scheduled[2:], strict=False)}
    assert sent_at[:2] == [2, 8] and gaps == {6} and len(scheduled) > 4, sent_at
    assert sent_at[len(scheduled) :] in ([40], [40, 40]), sent_at
    assert {w.strategy.schedule.spacing for w in paced.workers.values()} == {6}  # type: ignore[attr-defined]
    assert paced_hash != run(tmp_path, all_rounds, **options)  # sending less changes what is learnt
    # the same replay with shard 2 joining after step 20 (from shared state): slots stay 6 apart
    joins = [(0, 0), (1, 0), (2, 0), (2, 20)]
    rejoined = replay(tmp_path, all_rounds, joins, paces={"f0:2": 6}, sim_class=RecordsRounds, **options)
    RecordsRounds.rounds_seen = []
    rejoined.run(RunLog(None))
    assert [int(r.split(":")[1]) for r in RecordsRounds.rounds_seen] == sent_at
    assert rejoined.workers[2].strategy.schedule.spacing == 6  # type: ignore[union-attr]


# ---- replicas joining a run under way ----

# cocodc's θ̄ of fragment 0 moved at step 6; fragment 1, sent after step 8, is in flight at 9: the
# joiner applies it at step 10
JOINED_AT = 9


def every_round(before: list[int], after: list[int]) -> Rounds:
    """Every round id the run could open (so the test does not depend on cocodc's choices): those
    sent up to JOINED_AT average ``before``, later ones ``after``."""
    return {
        f"f{p}:{step}": (before if step <= JOINED_AT else after, True)
        for p in range(OPTIONS["fragments"])
        for step in range(1, OPTIONS["steps"] + 1)
    }


def test_a_joiner_starts_from_theta_bar_and_keeps_the_same_theta_bar(tmp_path: Path) -> None:
    """Shard 2 joins after step 9 and shard 1 leaves (it is in no later group): every live replica
    holds one θ̄ after every step, the joiner starts from it, and the replay is deterministic."""
    events = every_round([0, 1], [0, 2])
    sim = replay(tmp_path, events, [(0, 0), (1, 0), (2, JOINED_AT)], algo="cocodc")

    def check(step: int, record: dict) -> None:
        assert (2 in sim.workers) == (step >= JOINED_AT)
        hashes = {params_sha256(w.strategy.global_state()) for w in sim.workers.values()}
        assert len(hashes) == 1, f"θ̄ differs across replicas after step {step}"
        if step == JOINED_AT:
            assert params_sha256(sim.workers[2].trainer.model.state_dict()) == hashes.pop()

    joined = sim.run(RunLog(None), progress=check)["global_params_sha256"]
    assert joined == run(tmp_path, events, [(0, 0), (1, 0), (2, JOINED_AT)], algo="cocodc")
    assert joined != run(tmp_path, every_round([0, 1], [0, 1]), [(0, 0), (1, 0)], algo="cocodc")


def test_a_join_replays_what_resetting_a_replica_by_hand_computes(tmp_path: Path) -> None:
    """The reference: shard 2 trains from step 0 but is in no group until step 9, then its replica is
    reset by hand to what a joiner is (fresh AdamW, θ = θ̄, snapshots of the syncs in flight = θ̄).
    A replay in which shard 2 joins after step 9, or rejoins then, must end with the same θ̄."""
    events = every_round([0, 1], [0, 1, 2])
    reference = replay(tmp_path, events, [(0, 0), (1, 0), (2, 0)], algo="cocodc")

    def reset_shard_2(step: int, record: dict) -> None:
        if step != JOINED_AT:
            return
        worker = reference.workers[2]
        worker.trainer = InnerTrainer(worker.trainer.model, reference.setup.inner)
        strategy = worker.strategy
        assert isinstance(strategy, Strategy) and strategy.in_flight
        for fragment, outer in zip(strategy.fragments, strategy.outer, strict=True):
            fragment.write(outer.global_params)
        for p, sync in strategy.in_flight.items():
            sync.snapshot = strategy.outer[p].global_params.clone()
            sync.residual = None  # error feedback: a joiner sent none of them, so it keeps no codec error

    expected = reference.run(RunLog(None), progress=reset_shard_2)["global_params_sha256"]
    assert run(tmp_path, events, [(0, 0), (1, 0), (2, JOINED_AT)], algo="cocodc") == expected
    assert run(tmp_path, events, [(0, 0), (1, 0), (2, 0), (2, JOINED_AT)], algo="cocodc") == expected
    assert run(tmp_path, events, [(0, 0), (1, 0), (2, 0)], algo="cocodc") != expected


def test_max_peers_leaves_data_shards_for_joiners(tmp_path: Path) -> None:
    """--max-peers 4 cuts the data into 4 smaller shards: the 3 workers start on 0-2, shard 3 joins."""
    sim = replay(
        tmp_path, every_round([0, 1, 2], [0, 1, 3]), [(0, 0), (1, 0), (2, 0), (3, JOINED_AT)], max_peers=4
    )
    assert sim.workers[0].shard.windows.numel() < replay(tmp_path).workers[0].shard.windows.numel()
    sim.run(RunLog(None))
    assert list(sim.workers) == [0, 1, 2, 3]


def test_a_group_with_a_shard_that_has_not_joined_is_refused_with_one_line(tmp_path: Path) -> None:
    sim = replay(tmp_path, every_round([0, 2], [0, 2]), [(0, 0), (1, 0), (2, JOINED_AT)])
    with pytest.raises(
        UserError, match="round f0:4 averages data shard 2, which no join record starts before it"
    ):
        sim.run(RunLog(None))


@pytest.mark.parametrize(
    ("joins", "options", "message"),
    [
        (
            [(0, 0), (1, 0), (2, 8)],
            {"algo": "ddp", "overlap": 0},
            "records peers joining a run under way, which a ddp run",
        ),
        ([(2, 8)], {}, "no join records at step 0"),
        ([(0, 0), (3, 8)], {}, "a join record needs 'shard' .* below --max-peers 3"),
        ([(0, 0), (1, -1)], {}, "a join record needs .* 'step' \\(≥ 0\\)"),
    ],
)
def test_joins_that_cannot_be_replayed_are_refused_with_one_line(
    tmp_path: Path, joins: Joins, options: dict, message: str
) -> None:
    with pytest.raises(UserError, match=message):
        replay(tmp_path, {"g:1": ([0], True)}, joins, **options)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not a JSON line"),
        ('{"kind": "round", "round": "f0:8", "members": [0, 9], "completed": true}', "distinct shards"),
        ('{"kind": "round", "round": "f0:8", "members": [1, 1], "completed": true}', "distinct shards"),
        ('{"kind": "round", "round": "f0:8", "members": [], "completed": true}', "distinct shards"),
        ('{"kind": "eval", "step": 8}', "no round records"),
        ('{"kind": "round", "round": "f0:8", "members": [0], "completed": true, "pace": -1}', "'pace'"),
        ('{"kind": "round", "round": "f0:8", "members": [0], "completed": true, "pace": "6"}', "'pace'"),
        ('{"kind": "start", "pace": -4}', "a start record needs an int 'pace'"),
        ('{"kind": "start", "pace": 1e9}', "a start record needs an int 'pace'"),
        ('{"kind": "start"}', "a start record needs an int 'pace'"),
        ('{"kind": "join", "shard": 0, "step": 0, "peer": 7}', "'peer' \\(an id of 1 to 128"),
        ('{"kind": "join", "shard": 0, "step": 0, "peer": ""}', "'peer' \\(an id of 1 to 128"),
    ],
)
def test_malformed_events_are_refused_with_one_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(UserError, match=message):
        Simulation(build_config({}, {**OPTIONS, "events": str(path)}))


@pytest.mark.parametrize("again", ["peer2", "peer2-new"])
def test_a_replica_that_joins_again_screens_afresh_and_is_known_by_its_peer_id(
    tmp_path: Path, again: str
) -> None:
    """Screening memory in a replay is what the swarm's is: a shard's peer that comes back (after a
    crash, or taking the swarm's state again) remembers no member's cosines, as its new process (or
    reset exchange) does, and the other slice owners remember members by the peer id the join
    records give: one that comes back with its --identity goes on where it was, one with a new id is
    a new member to them. Before, the simulator kept both by data shard, and a crashed peer's replay
    screened differently from the swarm."""
    joins = [(0, 0, "peer0"), (1, 0, "peer1"), (2, 0, "peer2"), (2, JOINED_AT, again)]
    lines = [{"kind": "join", "shard": i, "step": s, "peer": p} for i, s, p in joins]
    lines += [
        {"kind": "round", "round": r, "members": m, "completed": c}
        for r, (m, c) in every_round([0, 1, 2], [0, 1, 2]).items()
    ]
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    sim = RecordsRounds(
        build_config({}, {**OPTIONS, "algo": "cocodc", "events": str(path), "outlier_window": 64})
    )
    RecordsRounds.rounds_seen = []
    sim.run(RunLog(None))
    after = sum(1 for r in RecordsRounds.rounds_seen if int(r.split(":")[1]) > JOINED_AT)
    before = len(RecordsRounds.rounds_seen) - after
    assert before > 0 and after > 0
    restarted, stayed = sim.cosine_records[2].cosines, sim.cosine_records[0].cosines
    assert {member: len(c) for member, c in restarted.items()} == {
        "peer0": after,
        "peer1": after,
        again: after,
    }
    if again == "peer2":
        assert len(stayed["peer2"]) == before + after
    else:
        assert len(stayed["peer2"]) == before and len(stayed[again]) == after
