"""Replaying a swarm run's rounds in the simulator: which workers each round averaged, which failed.

A peer writes one ``{"kind": "round", "round": "f2:96", "members": [0, 2], "completed": true}``
record to its ``--out`` file for every round it settled: the data shards of the round's group (the
simulator's worker indices, in member order) and whether the round completed. θ̄ depends only on
those, so ``simulate --events FILE`` with a peer's records reproduces what the swarm computed,
bit for bit, when peers left, crashed, or were left out of rounds: a completed round averages only
its members' outer gradients and every worker applies it (a peer left out of a group fetches the
same average); a failed round is abandoned by all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from p2p_cocodc.errors import UserError


@dataclass(frozen=True)
class RoundRecord:
    members: tuple[int, ...]  # data shards, in member order (empty for a failed round)
    completed: bool


def read_rounds(path: str, workers: int) -> dict[str, RoundRecord]:
    """The round records of a peer's --out file, by round id; one clear error for anything else."""
    rounds: dict[str, RoundRecord] = {}
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--events {path}: cannot read it ({exc})") from None
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"--events {path}:{number}: not a JSON line") from None
        if not isinstance(record, dict) or record.get("kind") != "round":
            continue
        round_id, members, completed = record.get("round"), record.get("members"), record.get("completed")
        valid = (
            isinstance(round_id, str)
            and isinstance(completed, bool)
            and isinstance(members, list)
            and (0 < len(members) <= workers or (not completed and not members))
            and all(isinstance(m, int) and not isinstance(m, bool) and 0 <= m < workers for m in members)
            and len(set(members)) == len(members)
        )
        if not valid:
            raise UserError(
                f"--events {path}:{number}: a round record needs 'round', 'completed' and 'members' "
                f"(distinct shards below --workers {workers})"
            )
        if round_id in rounds:
            raise UserError(f"--events {path}:{number}: round {round_id} is recorded twice")
        rounds[round_id] = RoundRecord(tuple(members), completed)
    if not rounds:
        raise UserError(f"--events {path}: no round records (write them with join --out)")
    return rounds
