"""Who trains in a run, and how a peer enters it: the admission rules as pure decisions.

Each function reads a view of the notice board (peer id -> record) and this peer's ``Seat`` and
returns a decision, or raises UserError with the one line users see. Nothing here waits, reads a
clock, touches the network or disk: the peer (``node.py``) reads the board, loops, times out and
fetches; this module only decides (like torchft's lighthouse ``quorum_compute``). The rules:

* **Same run.** A record is of this run when it carries this peer's fingerprint (the options every
  peer must share) and swarm key id. Other records under the run id are strangers, ignored, unless
  every other live ("waiting" or "training") peer is one and none shares ours: then this peer is the
  odd one out. An open peer among keyed ones is told to bring the key; otherwise it stops with "trains
  with other options", naming the options that differ (the caller fetches that peer's run info).
* **Under way.** A run is under way once --workers peers of it train, or one has trained past the
  step it started (or resumed) at; yet only once a training peer's step moved while this peer watched
  (``first_steps``): right after a whole swarm was killed, its records still say "training" for a
  record lifetime. Until one moves, wait. A resuming peer ignores training records past step 0 that
  did not resume and have not moved: a dead swarm's.
* **Join.** A run under way takes a peer that can take the swarm's state (not ddp). It keeps its
  --shard (or its checkpoint's: it takes the swarm's state, not its checkpoint), else takes the shard
  this identity read before if no one reads it, else the first free one of --max-peers; none free:
  the run is full.
* **Start.** Once --workers live peers of the run, this one among them, are on the board, they start
  together; more than --workers is an error. Peers without a shard take the free shards of
  range(--workers) in peer-id order, so every peer computes the same split from the same board. A
  shard another peer of the run reads (a finished one reads none) is an error. When any of them
  resumes, all must, and the swarm goes on from the newest step all of them hold: the smallest.
* **Clash.** A shard is read by one peer: of the live peers of the run reading one shard, a training
  peer keeps it, else the first in id order, and every waiting one besides is refused (the others
  count it out of the run). Except on a peer's first look at the board, taken before its own record
  is on it: a live peer found there reading its --shard came first, so this one is refused, and no
  other peer ever sees the clash. Two peers that missed each other on their first looks (started at
  the same moment) see the clash later, both, and only the one whose id sorts last is refused.
* **Started.** Step 1 begins only once --workers peers of the run show "training". A peer of the
  starting set that leaves before (its record gone, done or leaving) sends the others back to the lobby.
* **Ended.** When every other peer of the run on the board is done (a done record stays for the
  longest lifetime a record has, 2 minutes), the run ended before this peer came: it stops with one
  line (finished: a new --run-id; stopped early: --resume), unless it resumes the run itself.
* **Sync shape.** τ (--overlap) and N (--transmissions) are the same on every peer. Where they are
  'auto', each peer works them out from its own link and step time (a resuming one takes its
  checkpoint's) and publishes that proposal, which never changes; the peers starting a run take the
  largest τ and the fewest N of their proposals (the slowest transfer is hidden, the narrowest link
  not overrun): the same numbers on every peer of the starting set, which then publish what they
  train with. A peer taking the swarm's state takes its donors' shape, whatever it worked out.
* **Donors.** A peer taking the swarm's state asks up to ``DONORS`` training peers of the run (not
  itself, none distrusted), highest step first, then by id. None, and one of the run is done: the run
  finished without it. A state at or past --steps leaves nothing to train.

Every ``Wait`` names what the peer waits for ("only 2 of --workers 3 peers joined"); the caller ends
the text with the run and its --wait-peers when the wait times out.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from p2p_cocodc.config.derived import declared_busy_s
from p2p_cocodc.errors import UserError
from p2p_cocodc.swarm.run_options import differences

DONORS = 3  # a joiner asks this many live peers for the state (at least 2 where there are)
LIVE = ("waiting", "training")  # the states of peers that take part in a start


class Record(Protocol):
    """The fields of a board record (``swarm.records.PeerRecord``) the lobby reads."""

    @property
    def state(self) -> str: ...  # 'waiting' | 'joining' | 'training' | 'leaving' | 'done'
    @property
    def step(self) -> int: ...
    @property
    def shard(self) -> int | None: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def key_id(self) -> str: ...
    @property
    def resume_step(self) -> int: ...  # -1: it does not resume
    @property
    def proposed_shape(self) -> list[int]: ...  # [τ, N] it worked out for itself (or its checkpoint's)
    @property
    def sync_shape(self) -> list[int]: ...  # [τ, N] it trains with ([] until it starts or joins)
    @property
    def starting_pace(self) -> int: ...  # the send-slot spacing its declared link asks a start for


View = Mapping[str, Record]


@dataclass(frozen=True)
class Seat:
    """What the lobby knows of this peer: who it is, which run it asks for, what it brings."""

    peer_id: str
    run_id: str
    fingerprint: str
    key_id: str  # the public id of the swarm key it holds ("open": none)
    is_open: bool  # it holds no swarm key and no owner's certificate
    workers: int  # --workers
    data_shards: int  # --max-peers
    steps: int  # --steps
    shard: int | None = None  # --shard, or its checkpoint's shard
    resume_step: int | None = None  # the step of the checkpoint it resumes from (--resume)
    can_take_state: bool = True  # False for ddp: it cannot join a run under way


@dataclass(frozen=True)
class Wait:
    """Not yet: ``reason`` is the start of the timeout's text; ``live`` the run's live peers to show
    (this one included where it is on the board), None where no roster is shown."""

    reason: str
    live: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Start:
    """Start the run with ``live`` (every live peer, in id order): this peer reads ``shard``, and the
    whole swarm resumes from its checkpoints of ``resume_step`` (None: a fresh start)."""

    shard: int
    resume_step: int | None
    live: tuple[str, ...]


@dataclass(frozen=True)
class Join:
    """The run is under way: take the swarm's state (not a checkpoint) and read ``shard``."""

    shard: int


@dataclass(frozen=True)
class Mismatch:
    """Every other live peer of the run id trains with other options: fetch ``peer``'s run info and
    raise ``mismatch_error``."""

    peer: str


@dataclass(frozen=True)
class Donors:
    """Take the swarm's state from these peers (best first)."""

    peers: tuple[str, ...]


Admission = Wait | Start | Join | Mismatch


def same_run(record: Record, seat: Seat) -> bool:
    """A record of a peer of this run: our configuration, and our swarm key (or none, both)."""
    return record.fingerprint == seat.fingerprint and record.key_id == seat.key_id


def peers_to_reach(view: View, seat: Seat) -> list[str]:
    """The peers a round may need a connection to (``swarm/connections.py`` keeps one to each):
    this run's on the board, but for this one and those that have left."""
    staying = ("waiting", "joining", "training")
    return [p for p, r in view.items() if p != seat.peer_id and r.state in staying and same_run(r, seat)]


def admit(view: View, seat: Seat, first_steps: Mapping[str, int] | None) -> tuple[Admission, dict[str, int]]:
    """One look at the board: start, join, wait, or the options that differ to fetch; UserError for
    a peer refused (a shard clash, a run ended, ...). ``first_steps`` (peer -> the step its record
    showed when first read here) is None on this peer's first look, taken before its own record is
    on the board (a shard clash found then refuses it: ``refused_for_shards``), and comes back
    updated, to be passed to the next call."""
    first = dict(first_steps or {})
    same = {p: r for p, r in view.items() if same_run(r, seat)}
    odd = odd_one_out(view, seat)
    if odd is not None:
        return Mismatch(odd), first
    check_not_ended(same, seat)
    stale_self = stale_own_record(same.get(seat.peer_id), seat)
    training = {p: r for p, r in same.items() if r.state == "training" and p != seat.peer_id}
    moving = {p for p, r in training.items() if r.step > first.setdefault(p, r.step)}
    if seat.resume_step is not None:  # a killed swarm's records: not resumed, still (step 0 too)
        dead = {p for p, r in training.items() if r.resume_step < 0 and p not in moving}
        same = {p: r for p, r in same.items() if p not in dead}
        training = {p: r for p, r in training.items() if p not in dead}
    refused = refused_for_shards(same, seat, first_look=first_steps is None)  # about to exit: not of the run
    same = {p: r for p, r in same.items() if p not in refused}
    past_start = any(r.step > max(r.resume_step, 0) for r in training.values())
    if len(training) >= seat.workers or past_start:
        if not moving:  # under way, or the records of a dead swarm: which one shows within a lifetime
            return Wait("no training peer moved in"), first
        if not seat.can_take_state:
            raise UserError(
                f"run {seat.run_id!r} is under way, and a ddp run cannot take a peer in progress: use "
                "another --run-id, or a DiLoCo-family --algo"
            )
        return Join(free_shard(same, seat)), first
    live = sorted(p for p, r in same.items() if r.state in LIVE and not (p == seat.peer_id and stale_self))
    if len(live) >= seat.workers and seat.peer_id in live:
        shard = settle_shard(live, same, seat)
        resume = None
        if seat.resume_step is not None or any(same[p].resume_step >= 0 for p in live):
            resume = resume_from(live, same, seat)
        return Start(shard, resume, tuple(live)), first
    return Wait(f"only {len(live)} of --workers {seat.workers} peers joined", tuple(live)), first


def stale_own_record(own: Record | None, seat: Seat) -> bool:
    """Whether the record under our own id is our identity's previous process's (a peer killed and
    started again within its record's lifetime): one that trained past its start, or that resumes
    otherwise than we do. Such a record is not ours yet, and not a peer: we wait for ours."""
    if own is None or own.state != "training":
        return False
    ours = -1 if seat.resume_step is None else seat.resume_step
    return own.step > max(own.resume_step, 0) or own.resume_step != ours


def run_end(records: Iterable[Record]) -> int | None:
    """The step a run ended at, when every one of ``records`` (its peers on the board) is done; None
    while any of them takes part, or when there are none. A done record stays on the board for the
    longest lifetime a record has (``swarm/records.py`` ``MAX_LIFETIME_S``, 2 minutes): that long
    after its end, a run is known to have ended (and its id stays taken). It finished when that step
    is its --steps; before it, its peers left early."""
    records = list(records)
    if not records or any(r.state != "done" for r in records):
        return None
    return max(r.step for r in records)


def check_not_ended(same: View, seat: Seat) -> None:
    """UserError when every other peer of the run on the board is done and none takes part any more
    (``run_end``): the run ended before this peer came. A peer resuming the run is let through: a
    swarm stopped early goes on with --resume."""
    step = run_end(r for p, r in same.items() if p != seat.peer_id)
    if seat.resume_step is None and step is not None:
        raise ended_error(seat.run_id, step, seat.steps)


def check_not_ended_at_bootstrap(ended: Any, run_id: str, steps: int) -> None:
    """UserError when the bootstrap saw run ``run_id`` end (``ended``: its /ended answer, untrusted),
    asked before this peer sets anything up; a peer that resumes the run does not ask."""
    end = ended.get(run_id) if isinstance(ended, dict) else None
    step = end.get("step") if isinstance(end, dict) else None
    if isinstance(step, int) and not isinstance(step, bool) and 0 <= step:
        raise ended_error(run_id, step, steps)


def ended_error(run_id: str, step: int, steps: int) -> UserError:
    """What a peer asking for a run that ended is told: a finished run's id stays taken while the
    bootstrap remembers its end (its last 16 ended runs, until it restarts) and while its done records
    are on the board (2 minutes); a run whose peers left early goes on with --resume."""
    if step >= steps:
        return UserError(
            f"run {run_id!r} finished at step {step}: choose a new --run-id, or --resume from a "
            "checkpoint (a finished run's id stays taken while the bootstrap remembers its end)"
        )
    return UserError(
        f"run {run_id!r} ended at step {step} of --steps {steps} (its peers left): to go on, "
        "start them again with --resume and their --checkpoint-dir; or choose a new --run-id"
    )


def odd_one_out(view: View, seat: Seat) -> str | None:
    """The peer to name when every other live peer of this run id has another configuration or
    another swarm key (None when some share ours: the strangers are ignored, as a stranger's record
    must not stop a run). UserError when an open peer finds only keyed ones."""
    others = {p: r for p, r in view.items() if p != seat.peer_id and r.state in LIVE}
    if not others or any(p != seat.peer_id and same_run(r, seat) for p, r in view.items()):
        return None
    keys = sorted({r.key_id for r in others.values()} - {seat.key_id})
    if keys and seat.is_open:  # a keyed peer's DHT never returns an open peer's record
        raise UserError(
            f"run {seat.run_id!r} admits only holders of its swarm key or of its owner's certificate (key "
            f"id {keys[0]}): pass --swarm-key-file, or --owner and --certificate, as its owner gave them; "
            "or pick another --run-id"
        )
    return sorted(others)[0]


def mismatch_error(seat: Seat, peer: str, options: dict[str, Any], run_infos: Mapping[str, Any]) -> UserError:
    """The error for ``Mismatch(peer)``: ``options`` are ours (``option_view``), ``run_infos`` what
    the board holds (``Board.run_infos``: untrusted)."""
    info = run_infos.get(peer)
    differ = differences(options, info.get("options") if isinstance(info, Mapping) else None)
    which = f" ({'; '.join(differ)})" if differ else ""
    return UserError(
        f"peer {peer[:12]} of run {seat.run_id!r} trains with other options{which}: start every peer with "
        "the same options (or profile), or pick another --run-id"
    )


DOING = {  # what a peer whose record says this state is doing, in the shard clash's line
    "waiting": "waiting for this run",
    "joining": "joining this run",
    "training": "training in this run",
    "leaving": "leaving this run",
}


def shard_clash(seat: Seat, peer: str, record: Record) -> UserError:
    """The one line for a peer whose own --shard (or checkpoint's shard) ``peer`` already reads."""
    return UserError(
        f"--shard {seat.shard}/{seat.data_shards} is already read by peer {peer[:12]}, which is "
        f"{DOING.get(record.state, record.state)}: this region's peer is probably already running (the "
        "same profile started twice); stop this one, or give it another --shard (a peer stopped a "
        "moment ago leaves the board within seconds)"
    )


def refused_for_shards(same: View, seat: Seat, first_look: bool) -> set[str]:
    """The waiting peers of the run that a shard clash refuses (the **Clash** rule): of the live
    peers reading one shard, a training one keeps it, else the first in id order, this peer last on
    its ``first_look``. UserError when this peer is refused; else the others refused, to count out."""
    readers = {p: r.shard for p, r in same.items() if r.state in LIVE and r.shard is not None}
    readers.pop(seat.peer_id, None)  # our record may be a stale one of this identity's last process
    if seat.shard is not None:
        readers[seat.peer_id] = seat.shard

    def precedence(p: str) -> tuple[bool, bool, str]:
        training = p != seat.peer_id and same[p].state == "training"
        return not training, first_look and p == seat.peer_id, p

    keeper: dict[int, str] = {}
    refused = set()
    for p in sorted(readers, key=precedence):
        if readers[p] not in keeper:
            keeper[readers[p]] = p
        elif p == seat.peer_id:
            kept = keeper[readers[p]]
            raise shard_clash(seat, kept, same[kept])
        elif same[p].state == "waiting":  # a training peer is not in the lobby: it is not refused
            refused.add(p)
    return refused


def shards_taken(records: View, seat: Seat) -> dict[int, str]:
    """The data shards other peers of the run read (shard -> peer; finished peers read none);
    UserError if this peer's own --shard (or checkpoint's shard) is among them."""
    taken = {
        r.shard: p
        for p, r in records.items()
        if r.shard is not None and p != seat.peer_id and r.state != "done"
    }
    if seat.shard in taken:
        raise shard_clash(seat, taken[seat.shard], records[taken[seat.shard]])
    return taken


def settle_shard(live: Sequence[str], records: View, seat: Seat) -> int:
    """The shard of a peer starting the run with ``live`` (sorted ids, this one among them): its
    --shard, or a shard no peer reads: peers without one take the free shards in id order."""
    if len(live) > seat.workers:
        raise UserError(
            f"{len(live)} peers joined run {seat.run_id!r} but --workers is {seat.workers}: give every "
            "peer the same --workers, or use another --run-id"
        )
    taken = shards_taken(records, seat)
    if seat.shard is not None:
        return seat.shard
    free = [i for i in range(seat.workers) if i not in taken]
    unsettled = [p for p in live if records[p].shard is None or p == seat.peer_id]
    return free[unsettled.index(seat.peer_id)]


def free_shard(records: View, seat: Seat) -> int:
    """A data shard no live peer reads, for a peer joining a run under way: its --shard, or the one
    this identity read before (a restart), or the first free one."""
    taken = shards_taken(records, seat)
    if seat.shard is not None:
        return seat.shard
    free = [i for i in range(seat.data_shards) if i not in taken]
    if not free:
        raise UserError(
            f"run {seat.run_id!r} is full: its peers read all {seat.data_shards} data shards (--max-peers "
            f"{seat.data_shards}); wait for a peer to leave, or start the run with a larger --max-peers"
        )
    before = records.get(seat.peer_id)
    return before.shard if before is not None and before.shard in free else free[0]


def resume_from(live: Sequence[str], records: View, seat: Seat) -> int:
    """A whole swarm restarted with --resume: every peer goes on from the newest step all of them
    hold a checkpoint of (a peer killed before its last checkpoint holds an older one)."""
    fresh = [p[:12] for p in live if records[p].resume_step < 0]
    if fresh:
        raise UserError(
            f"peers {', '.join(fresh)} start run {seat.run_id!r} afresh while others resume it: start "
            "every peer with --resume (and its --checkpoint-dir), or none"
        )
    return min(records[p].resume_step for p in live)


@dataclass(frozen=True)
class Left:
    """Peers of the starting set left before the run started: go back to the lobby (wait for peers,
    decide start and shard again)."""

    peers: tuple[str, ...]


def started(view: View, seat: Seat, live: Collection[str]) -> Wait | Left | None:
    """None once --workers peers of the run show 'training' (then all agree on each round's leader);
    until then, ``Left`` naming the peers of ``live`` (``Start.live``) whose record is gone from the
    board or says done or leaving, else a wait."""
    training = [r for r in view.values() if same_run(r, seat) and r.state == "training"]
    if len(training) >= seat.workers:
        return None
    left = [p for p in live if p != seat.peer_id and (p not in view or view[p].state in ("done", "leaving"))]
    if left:
        return Left(tuple(sorted(left)))
    return Wait(f"only {len(training)} of {seat.workers} peers started")


def choose_donors(view: View, seat: Seat, distrusted: Collection[str]) -> list[str]:
    """Up to ``DONORS`` training peers of the run to take the state from: not this peer, none
    distrusted, highest step first, then by id."""
    candidates = (
        p
        for p, r in view.items()
        if p != seat.peer_id and same_run(r, seat) and r.state == "training" and p not in distrusted
    )
    return sorted(candidates, key=lambda p: (-view[p].step, p))[:DONORS]


def find_donors(view: View, seat: Seat, distrusted: Collection[str]) -> Donors | Wait:
    """``Donors`` to take the swarm's state from, or a wait for one; UserError when the run has
    finished without this peer."""
    donors = choose_donors(view, seat, distrusted)
    if donors:
        return Donors(tuple(donors))
    if any(r.state == "done" and same_run(r, seat) for r in view.values()):
        raise UserError(
            f"run {seat.run_id!r} has finished without this peer: no peer trains any more to take the "
            "swarm's state from"
        )
    return Wait("no peer to take the swarm's state from in")


def starting_shape(view: View, live: Iterable[str], own: tuple[int, int]) -> tuple[int, int]:
    """The (τ, N) a run starts with (the **Sync shape** rule): the largest τ and the fewest N among
    this peer's proposal ``own`` and those the other peers of ``live`` (``Start.live``) publish."""
    shapes = [own, *(tuple(view[p].proposed_shape) for p in live if p in view and view[p].proposed_shape)]
    return max(s[0] for s in shapes), min(s[1] for s in shapes)


def declared_pace(replica: Any, mbps: float, step_time: float | None) -> int:
    """The send-slot spacing this peer's declared link (``mbps``) keeps up with from the first step,
    as its first round would ask for it (``SwarmReplica._pace_wish``); 0 for a schedule that is not
    paced, for a spacing no wider than the schedule's own, or with no step time known before the
    start (it is measured for --overlap/--transmissions auto, or given by --step-time)."""
    strategy = replica.strategy
    if strategy.send_spacing() is None or not step_time:
        return 0

    def declared(codec: Any) -> tuple[float, float]:  # a RoundCost: the link's time, no landing measured
        return declared_busy_s(replica.round_bytes(codec), mbps), 0.0

    wish = strategy.pace_wish(declared, step_time)
    return wish if wish > strategy.send_spacing() else 0


def starting_pace(view: View, live: Iterable[str], own: int) -> int:
    """The send-slot spacing a run starts with (0: the schedule's own): the largest this peer
    (``own``) and the other peers of ``live`` ask for from their declared links, so that the first
    syncs are paced as the first round's result would have paced the later ones."""
    return max([own, *(view[p].starting_pace for p in live if p in view)])


def swarm_shape(view: View, donors: Iterable[str]) -> tuple[int, int] | None:
    """The (τ, N) the run trains with, as ``donors`` (training peers) publish it; None where none does."""
    shapes = [tuple(view[p].sync_shape) for p in donors if p in view and view[p].sync_shape]
    if not shapes:
        return None
    return max(s[0] for s in shapes), min(s[1] for s in shapes)


def check_steps_left(step: int, seat: Seat) -> None:
    """UserError when the state taken at the end of ``step`` leaves nothing of --steps to train."""
    if step >= seat.steps:
        raise UserError(
            f"run {seat.run_id!r} is at step {step} of --steps {seat.steps}: nothing left to train"
        )
