"""Replaying a swarm run in the simulator: which data shards trained from when, which shards each
round averaged, which rounds failed.

A peer writes to its ``--out`` file, besides its evaluations:

- ``{"kind": "join", "shard": 2, "step": 96, "peer": "Qm…"}`` for every replica it learns of: the
  replica reading data shard 2 starts after step 96 from θ̄ at 96 (step 0: the peers that started
  the run). A shard joins again when its peer crashed and came back, or fell out of the swarm and
  took its state again; the replica starts afresh each time, its screening memory too (the cosine
  record of the slices it owns). ``peer`` is the id the other slice owners remember its cosines by:
  one that comes back with the same --identity is the same member to them, one with a new id a new
  member (records without it: the shard is the id).
- ``{"kind": "start", "pace": 48}`` when the peers that started the run agreed on a send-slot
  spacing before their first step (from their declared links; the last such record counts);
- ``{"kind": "round", "round": "f2:96", "members": [0, 2], "pace": 6, "completed": true}`` for every
  round it settled: the data shards of the round's group (in member order), the send-slot spacing
  the group agreed on (CoCoDC's paced schedule takes it with the round's result; 0 or absent: none),
  and whether the round completed. A completed fragment round also names the ``"codec"`` its
  payloads took (``SyncCodecs``): it follows from the pace, so a replay does not need it.

θ̄ depends only on those, so ``simulate --events FILE`` with a peer's records reproduces what the
swarm computed, bit for bit, when peers joined, left, crashed, or were left out of rounds: a
completed round averages only its members' outer gradients and every live replica applies it (a
peer left out of a group fetches the same average); a failed round is abandoned by all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeGuard

from p2p_cocodc.errors import UserError
from p2p_cocodc.swarm.messages import MAX_PACE

MAX_PEER_ID = 128  # a libp2p peer id in base58 is 46-59 characters


@dataclass(frozen=True)
class RoundRecord:
    members: tuple[int, ...]  # data shards, in member order (empty for a failed round)
    completed: bool
    pace: int = 0  # the send-slot spacing agreed with the round (0: none)


@dataclass(frozen=True)
class Events:
    """A peer's records: the rounds by id, and by step S the data shards (ascending) whose replica
    starts after S. ``joins`` is empty when the file has no join records."""

    rounds: dict[str, RoundRecord]
    joins: dict[int, tuple[int, ...]]
    start_pace: int = 0  # the send-slot spacing the run started with (0: the schedule's own)
    peers: dict[tuple[int, int], str] = field(default_factory=dict)  # (step, shard) of a join: its peer id

    def member(self, shard: int, step: int) -> int | str:
        """The id the slice owners know data shard ``shard``'s replica by at ``step``: the peer id of
        its latest join at or before ``step`` (the shard where the records name none)."""
        joined = [s for s, i in self.peers if i == shard and s <= step]
        return self.peers[(max(joined), shard)] if joined else shard


def read_events(path: str, data_shards: int) -> Events:
    """The round and join records of a peer's --out file; one clear error for anything else.
    Shards must be below ``data_shards`` (--max-peers); a join recorded twice counts once."""
    rounds: dict[str, RoundRecord] = {}
    joins: dict[int, set[int]] = {}
    peers: dict[tuple[int, int], str] = {}
    start_pace = 0
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--events {path}: cannot read it ({exc})") from None
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"--events {path}:{number}: not a JSON line") from None
        kind = record.get("kind") if isinstance(record, dict) else None
        if kind == "round":
            round_id, settled = _round(record, data_shards, f"--events {path}:{number}")
            if round_id in rounds:
                raise UserError(f"--events {path}:{number}: round {round_id} is recorded twice")
            rounds[round_id] = settled
        elif kind == "start":
            start_pace = record.get("pace")
            if not (_is_int(start_pace) and 0 <= start_pace <= MAX_PACE):
                raise UserError(
                    f"--events {path}:{number}: a start record needs an int 'pace' in [0, {MAX_PACE}]"
                )
        elif kind == "join":
            shard, step, peer = record.get("shard"), record.get("step"), record.get("peer")
            if not (
                _is_int(shard)
                and 0 <= shard < data_shards
                and _is_int(step)
                and step >= 0
                and (peer is None or (isinstance(peer, str) and 0 < len(peer) <= MAX_PEER_ID))
            ):
                raise UserError(
                    f"--events {path}:{number}: a join record needs 'shard' (a data shard below "
                    f"--max-peers {data_shards}), 'step' (≥ 0) and, if any, 'peer' (an id of 1 to "
                    f"{MAX_PEER_ID} characters)"
                )
            joins.setdefault(step, set()).add(shard)
            if peer is not None:
                peers[(step, shard)] = peer
    if not rounds:
        raise UserError(f"--events {path}: no round records (write them with join --out)")
    joined = {step: tuple(sorted(shards)) for step, shards in sorted(joins.items())}
    return Events(rounds, joined, start_pace, peers)


def _round(record: dict, data_shards: int, where: str) -> tuple[str, RoundRecord]:
    round_id, members, completed = record.get("round"), record.get("members"), record.get("completed")
    pace = record.get("pace", 0)
    valid = (
        isinstance(round_id, str)
        and _is_int(pace)
        and 0 <= pace <= MAX_PACE
        and isinstance(completed, bool)
        and isinstance(members, list)
        and (0 < len(members) <= data_shards or (not completed and not members))
        and all(_is_int(m) and 0 <= m < data_shards for m in members)
        and len(set(members)) == len(members)
    )
    if not valid:
        raise UserError(
            f"{where}: a round record needs 'round', 'completed', 'members' (distinct shards "
            f"below --max-peers {data_shards}) and an int 'pace' in [0, {MAX_PACE}] if any"
        )
    return round_id, RoundRecord(tuple(members), completed, pace)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
