"""The round machine's vocabulary (``swarm/round.py``): its deadlines, the events it is fed and the
effects it returns, and the computations it asks for (run by the transport, in a worker)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum

import torch

from p2p_cocodc.algorithms.butterfly import assemble, encode_slices, reduce_slice, slice_sizes
from p2p_cocodc.algorithms.codecs import Codec, get_codec
from p2p_cocodc.errors import UserError
from p2p_cocodc.swarm.messages import Average, Members, Message, Status
from p2p_cocodc.swarm.wire import SLOWEST_LINK_MBPS

EXACT = get_codec("fp32")  # an average served to a recovering peer where it has no slice means


# ---- deadlines: every timeout of the protocol, in one place ----


@dataclass(frozen=True)
class Deadlines:
    """Every time limit of a round. ``round_s`` is ``--round-timeout``; transfers of N bytes are
    allowed ``8·N / slowest_link_mbps`` seconds on top, so a large fragment on a slow link is not
    taken for a dead peer."""

    round_s: float = 60.0  # the leader's wait for joiners beyond the slowest peer's arrival; the all-reduce
    resend_s: float = 2.0  # JOIN, PROBE, FETCH and unacknowledged deliveries are sent again after this
    answer_s: float = 15.0  # a peer that answers nothing we send it for this long is taken for gone
    heard_s: float = 8.0  # a peer that messaged us is live this long (a board record's lifetime)
    slowest_link_mbps: float = SLOWEST_LINK_MBPS

    def transfer_s(self, num_bytes: int) -> float:
        return 8.0 * num_bytes / (self.slowest_link_mbps * 1e6)

    def resend_after(self, num_bytes: int) -> float:
        return self.resend_s + self.transfer_s(num_bytes)

    def form_by(self, started: float, eta_s: float) -> float:
        """The leader decides the group by then (twice the slowest peer's arrival, plus round_s)."""
        return started + 2.0 * eta_s + self.round_s

    def join_patience(self, started: float, eta_s: float) -> float:
        """A joiner whose leader has not decided by then gives the round up and recovers."""
        return self.form_by(started, eta_s) + self.round_s + self.answer_s

    def allreduce_by(self, adopted: float, wire_bytes: int) -> float:
        """The butterfly completes by then, or the member recovers."""
        return adopted + self.round_s + 2.0 * self.transfer_s(wire_bytes)

    def idle_expiry_s(self) -> float:
        """A round others opened here that this peer never reaches is forgotten after this."""
        return 2 * self.round_s + 2 * self.answer_s

    def undecided_by(self, recovering_since: float) -> float:
        """A recovering peer that still waits then for peers on the board that answer nothing (a
        congested link, a slow ACK: any of them may hold the average) settles ``Undecided``."""
        return recovering_since + self.round_s + 2.0 * self.answer_s

    def settle_by(self, started: float, eta_s: float, wire_bytes: int) -> float:
        """Every live peer has settled the round by then (the model check asserts it)."""
        all_reduced = self.allreduce_by(self.join_patience(started, eta_s), wire_bytes)
        return self.undecided_by(all_reduced) + self.answer_s


@dataclass(frozen=True)
class BoardPeer:
    """What the notice board says of a live peer of this run: how far along it is."""

    step: int
    step_time_s: float
    leaving: bool = False  # it said it is stopping: it finishes its rounds but joins no new group
    done: bool = False  # it has finished (or left) the run: off the board for good


# ---- events ----


@dataclass(frozen=True)
class Start:
    """This peer reached the round: average ``vector`` (sent after inner step ``step``); ``pace``
    is the send-slot spacing its link keeps up with (0: it asks for none)."""

    step: int
    vector: torch.Tensor
    pace: int = 0
    recent: tuple[int, int] = (0, 0)  # (trained, window) of the steps ``vector`` covers (``--inner-share``)
    codec: Codec | None = None  # the round's wire codec (``SyncCodecs``); None: the machine's
    earlier: Mapping[str, tuple[float, ...]] = field(default_factory=dict)  # members' c_i at our slices


@dataclass(frozen=True)
class Received:
    sender: str  # authenticated by the transport, never read from the message
    message: Message
    replayed: bool = False  # a PART whose bytes this sender already sent in another round (transport)


@dataclass(frozen=True)
class ViewChanged:
    view: Mapping[str, BoardPeer]  # live training peers of the run with our fingerprint, not us


@dataclass(frozen=True)
class Computed:
    job: Job
    value: object = None
    error: str | None = None


@dataclass(frozen=True)
class Tick:
    """Time passed: deadlines and re-sends."""


@dataclass(frozen=True)
class Leaving:
    """This peer is leaving the run: it finishes the groups it is in, and joins or leads no other."""


Event = Start | Received | ViewChanged | Computed | Tick | Leaving


# ---- effects ----


@dataclass(frozen=True)
class Send:
    to: str
    message: Message


@dataclass(frozen=True)
class Job:
    """Arithmetic to run off the event loop; ``run_job`` does it and returns the ``Computed``."""

    kind: str  # encode | reduce | assemble | decode
    inputs: tuple = ()


@dataclass(frozen=True)
class Compute:
    job: Job


@dataclass(frozen=True)
class Completed:
    average: torch.Tensor
    members: Members
    pace: int  # the group's pace: the largest send-slot spacing its members asked for
    by_butterfly: bool  # False: fetched from a peer that completed
    screened_out: tuple[str, ...] = ()  # members this peer left out of its own slice's aggregate
    cosines: tuple[tuple[str, float], ...] = ()  # (member, c_i) at its own slice: its CosineRecord's next
    means: tuple[bytes, ...] = ()  # fetched: the members' slice means the AVERAGE carried, if it did


@dataclass(frozen=True)
class Failed:
    reason: str


@dataclass(frozen=True)
class Lost:
    """Another peer completed the round, and its average can no longer be had here."""

    reason: str


@dataclass(frozen=True)
class Undecided:
    """This peer could not learn whether the round completed: a peer on the board that may hold
    its average answered nothing until ``Deadlines.undecided_by``. The peer goes on as if the
    round failed, with θ̄ in doubt (``swarm/agreement.py``): if that peer completed, θ̄ split, and
    the peers' θ̄ digests settle which side takes the swarm's state."""

    reason: str


Outcome = Completed | Failed | Lost | Undecided


def settled_answer(outcome: Outcome | None, dropped_out: bool, phase: Phase) -> tuple[Status, str]:
    """What a peer with no average to give, which will not complete the round, answers a FETCH.
    One that dropped out (gave the round up, not an observer) answers like a promise; an observer
    that found no average failed the round (a peer that reaches it later must not complete it alone)."""
    if isinstance(outcome, Failed):
        return (Status.WAITING if dropped_out else Status.FAILED), outcome.reason
    if isinstance(outcome, Lost):
        return Status.GONE, "completed elsewhere; this peer has no average"
    if isinstance(outcome, Undecided):  # it holds no average, and promises nothing either way
        return Status.WAITING, "could not learn the outcome; taking the swarm's state"
    return Status.WAITING, "gave the round up" if phase == Phase.IDLE else "recovering"


@dataclass(frozen=True)
class Settle:
    outcome: Outcome


@dataclass(frozen=True)
class Note:
    """A line for ``join --verbose``."""

    text: str


@dataclass(frozen=True)
class Accuse:
    """A peer sent what no honest peer sends: the transport counts it against that peer and says so."""

    peer: str
    why: str


Effect = Send | Compute | Settle | Note | Accuse


def job_key(job: Job) -> str:
    """How the machine names a computation it waits for: its kind, and a reduce its slice."""
    return f"reduce {job.inputs[7]}" if job.kind == "reduce" else job.kind


def run_job(job: Job, codec: Codec) -> Computed:
    """Carry out a Compute effect: the butterfly's arithmetic, with bad payloads as errors."""
    try:
        if job.kind == "encode":
            vector, parts = job.inputs
            value: object = encode_slices(vector, parts, codec)
        elif job.kind == "reduce":  # (the aggregate's encoding, its Screening); _: who sent it, which slice
            encoded, numel, aggregation, _, earlier, members, weights, _ = job.inputs
            value = reduce_slice(encoded, numel, codec, aggregation, earlier, members, weights)
        elif job.kind == "assemble":
            means, sizes, members = job.inputs
            value = assemble(means, sizes, codec, members)
        else:  # decode an AVERAGE: (the message, its sender)
            msg: Average = job.inputs[0]
            if msg.means and msg.codec != codec.name:
                raise UserError(f"an average in {msg.codec}, where this round's codec is {codec.name}")
            if msg.means:
                sizes = slice_sizes(msg.numel, len(msg.means), codec.block)
                value = assemble(msg.means, sizes, codec, len(msg.members))
            else:
                value = EXACT.decode(msg.data, msg.numel)
    except UserError as exc:
        return Computed(job, error=str(exc))
    return Computed(job, value)


def average_reply(
    round_id: str, done: Completed, results: Mapping[int, bytes], slices: int, codec: Codec
) -> Average:
    """The AVERAGE a peer that completed a round answers a FETCH with: the means of the round's
    ``slices`` slices as their RESULTs carried them, of which ``assemble`` makes the same average
    (1/14 of fp32's bytes in q2), where it holds all of them (it took part in the butterfly, or
    fetched them so); else the average in fp32."""
    numel = done.average.numel()
    means = done.means
    if not means and done.by_butterfly and len(done.members) > 1 and len(results) == slices:
        means = tuple(results[s] for s in range(slices))
    if means:
        return Average(round_id, done.members, done.pace, numel, b"", means, codec.name)
    return Average(round_id, done.members, done.pace, numel, EXACT.encode(done.average))


@dataclass
class Recovery:
    """A recovering peer's bookkeeping: what the peers asked for the round's average have answered."""

    asks: int = 0  # FETCHes sent so far (each carries its number)
    answers: dict[str, tuple[Status, int]] = field(default_factory=dict)  # peer -> (status, ask answered)
    last_final_ask: int = 0  # asks sent before the last answer became final; WAITING must be newer
    unanswered_since: dict[str, float] = field(default_factory=dict)  # peer -> oldest FETCH it owes
    since: float = 0.0  # when this peer began to recover
    holders: set[str] = field(default_factory=set)  # peers that said they hold the average (HOLDS)
    designated: str | None = None  # the one peer asked to send the average itself
    asked_average: set[str] = field(default_factory=set)  # peers a FETCH asked for the average

    def pending(self, asked: set[str]) -> list[str]:
        """The peers of ``asked`` that may still hold the average: no final answer (FAILED, GONE),
        and no WAITING given after the last final answer came."""
        return [
            peer
            for peer in sorted(asked)
            if (answer := self.answers.get(peer, (None, -1)))[0] not in (Status.FAILED, Status.GONE)
            and not (answer[0] == Status.WAITING and answer[1] > self.last_final_ask)
        ]

    def designate(self, pending: list[str], line: Callable[[str], bytes]) -> str | None:
        """The one peer of ``pending`` (those that may still hold the average) a FETCH asks to send
        it; the others only say whether they hold it. Every holder sending it made a peer on a thin
        link download it once per holder. A peer that said it holds it, else the first in ``line``
        (to lead the round: the leader of a group most likely completed it); kept until it is no
        longer pending (silent past ``answer_s``, off the board, or a final answer), or it answered
        that it holds none yet (BUSY, WAITING) while another said it holds it. Not sooner: its
        average may be on its way, and a second holder asked would send it twice."""
        holders = [p for p in pending if p in self.holders]
        answered = self.answers.get(self.designated or "", (None, 0))[0]
        if self.designated not in pending or (answered in (Status.BUSY, Status.WAITING) and holders):
            self.designated = min(holders or pending, key=line, default=None)
        return self.designated


class Phase(Enum):
    IDLE = "idle"
    FORMING = "forming"
    RUNNING = "running"
    RECOVERING = "recovering"
    DONE = "done"


def leader_rank(round_id: str, peer: str) -> bytes:
    """The order in which peers are in line to lead a round: a hash of the round and the peer id.
    Every peer computes the same line, and it changes from round to round, so an id ground to sort
    first (20,000 RSA keys a second) leads no more rounds than any other id."""
    return hashlib.sha256(f"p2p-cocodc lead\0{round_id}\0{peer}".encode()).digest()


def short(peer: str) -> str:
    return peer[:12]
