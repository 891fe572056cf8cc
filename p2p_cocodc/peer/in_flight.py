"""What a peer's syncs in flight were sent with, and its screening memory, kept in its checkpoints.

A round is judged by the slice owners' screening memory as it was at the round's send
(``FragmentExchange.screening_memory``, ``Start.earlier``), and it asks for the pace its peer wished
for then. A whole swarm resumed from its checkpoints runs its syncs in flight again
(``SwarmReplica.rerun_in_flight``): to end with the uninterrupted run's θ̄ (the simulator's, which
keeps its cosine records in its checkpoints), each must go out as it was sent, and the memory the
later rounds are judged by must be the one the run had. So a checkpoint holds:

- ``record``: this peer's ``CosineRecord`` (the members' earlier cosines at its slices, as the
  rounds applied so far left it; members are peer ids, stable across a restart with --identity);
- ``in_flight``: for each sync in flight, the pace asked for and the memory at its send.

A checkpoint written before these were kept resumes with an empty memory, as it always did.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from p2p_cocodc.algorithms.aggregation import CosineRecord, memory_entries
from p2p_cocodc.algorithms.strategies import PendingSync
from p2p_cocodc.swarm.exchange import ScreeningMemory


class SentWith(NamedTuple):
    """A fragment's last send by this peer: after which step, the pace (steps per send) it asked
    for, its screening memory then."""

    step: int
    pace: int
    memory: ScreeningMemory


def sent_with(sent: dict[int, SentWith], p: int, sent_step: int) -> SentWith | None:
    """What the sync of fragment ``p`` sent after ``sent_step`` was sent with, if this peer sent it
    (not a sync in flight in a state it took from the swarm)."""
    known = sent.get(p)
    return known if known is not None and known.step == sent_step else None


def screening_state(
    record: CosineRecord, sent: dict[int, SentWith], in_flight: dict[int, PendingSync]
) -> dict[str, Any]:
    """The checkpoint's ``screening`` entry: ``record``, and what the syncs ``in_flight`` were sent with."""
    kept = {p: known for p, sync in in_flight.items() if (known := sent_with(sent, p, sync.sent_step))}
    return {
        "record": memory_entries(record.cosines),
        "in_flight": [[p, *known[:2], memory_entries(known.memory)] for p, known in kept.items()],
    }


def load_screening(state: Any, record: CosineRecord) -> dict[int, SentWith]:
    """A ``screening_state`` back: its record into ``record`` (None, an older checkpoint: emptied),
    and what its syncs in flight were sent with; ValueError if it is not one."""
    if state is None:
        record.load_state_dict({"members": []})
        return {}
    if not isinstance(state, dict) or not isinstance(state.get("in_flight"), list):
        raise ValueError(f"the screening state is {state!r}")
    record.load_state_dict({"members": state.get("record")})
    sent = {}
    for entry in state["in_flight"]:
        if not (isinstance(entry, list) and len(entry) == 4 and all(type(v) is int for v in entry[:3])):
            raise ValueError(f"a sync in flight was sent with {entry!r}")
        at_send = CosineRecord(record.window)
        at_send.load_state_dict({"members": entry[3]})
        sent[entry[0]] = SentWith(entry[1], entry[2], dict(at_send.cosines))
    return sent
