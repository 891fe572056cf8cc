"""One averaging round on one peer, as a pure state machine: ``handle(event, now) -> effects``.

No I/O, no clock, no threads: the transport (``swarm/exchange.py``) feeds it events (this peer
reached the round, a message arrived, the board changed, a computation finished, time passed) with
the time, and carries out the effects it returns (send, compute, settle). The model check
(``tests/test_round_model.py``) runs it on an in-memory network with a fake clock.
Phases (``docs/swarm.md`` has the full tables and every rule):

- IDLE: not at the round yet; it answers what others ask, and records joins if it leads.
- FORMING: the leader is the first in line (``leader_rank``, a hash of round and peer id) of the
  peers this one knows to be live; the others JOIN it. It lists every live peer that joins, and
  decides once all have, or at its deadline once its last PROBEs are answered. A peer takes part
  in the first group it learns, ever, from a leader it joined (``group_claims.py``: which lists it
  believes, which prove a liar); a live id before a leader in line makes it yield.
- RUNNING: the butterfly (``algorithms/butterfly.py``); PARTs and RESULTs carry the member list and
  are re-sent until acknowledged; a member that cannot complete recovers.
- RECOVERING: it asks every peer it knows for the round's average (FETCH) and completes with any
  AVERAGE; it settles FAILED (or LOST: average gone) only when no peer asked may still produce one.
  A silent peer on the board may be live behind a congested link, so it stays asked; still silent
  at ``Deadlines.undecided_by``, this peer settles UNDECIDED (the peer then holds θ̄ in doubt).
- DONE: settled; it still answers, and re-sends its RESULTs until acknowledged or too late.
The invariants the model checks after every event are listed in ``docs/swarm.md``."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from p2p_cocodc.algorithms.aggregation import MEAN, Aggregation, Screening
from p2p_cocodc.algorithms.butterfly import PIECE_BYTES, owner_cosines
from p2p_cocodc.algorithms.codecs import Codec
from p2p_cocodc.swarm.group_claims import GroupClaims
from p2p_cocodc.swarm.messages import (
    Ack,
    Average,
    Code,
    Fetch,
    Group,
    Join,
    Leader,
    Members,
    Message,
    Part,
    Probe,
    Result,
    Status,
    StatusReply,
)
from p2p_cocodc.swarm.round_butterfly import Butterfly
from p2p_cocodc.swarm.round_events import (
    Accuse,
    BoardPeer,
    Completed,
    Compute,
    Computed,
    Deadlines,
    Effect,
    Event,
    Failed,
    Job,
    Leaving,
    Lost,
    Note,
    Outcome,
    Phase,
    Received,
    Recovery,
    Send,
    Settle,
    Start,
    Undecided,
    ViewChanged,
    average_reply,
    job_key,
    leader_rank,
    settled_answer,
    short,
)


class RoundMachine(Butterfly):
    """One round on one peer. Create it when the peer reaches the round or first hears of it."""

    def __init__(
        self,
        me: str,
        round_id: str,
        shard: int,
        fingerprint: str,
        codec: Codec,
        deadlines: Deadlines,
        view: Mapping[str, BoardPeer],
        now: float,
        aggregation: Aggregation = MEAN,
        piece_bytes: int = PIECE_BYTES,
    ) -> None:
        self.me = me
        self.round_id = round_id
        self.shard = shard
        self.fingerprint = fingerprint
        self.codec = codec
        self.aggregation = aggregation  # how the slice this peer owns is checked and averaged
        self.piece_bytes = piece_bytes  # how large a slice's pieces are (``pieces_per_member``)
        self.earlier_cosines: Mapping[str, tuple[float, ...]] = {}  # members' c_i at our slices (Start)
        self.deadlines = deadlines
        self.view: dict[str, BoardPeer] = {}
        self.seen_on_board: set[str] = set()  # a member that has left the board is gone
        self.departed: set[str] = set()  # said it is leaving or done: never a candidate again
        self._see(view)
        self.phase = Phase.IDLE
        self.step: int | None = None
        self.vector: torch.Tensor | None = None
        self.created_at = now
        self.started_at = now
        self.eta_s = 0.0
        # who is live for this round
        self.heard: dict[str, float] = {}  # peer -> when it last messaged us
        self.ranks: dict[str, bytes] = {}  # peer -> leader_rank
        self.silent_since: dict[str, float] = {}  # peer -> first message it has not answered since
        self.gave_up: set[str] = set()  # peers that asked for the average: they will not join
        # forming
        self.joins: dict[str, int] = {}  # while leading: joined peer -> shard
        self.wish = 0  # the pace this peer asks for (from Start)
        self.wishes: dict[str, int] = {}  # while leading: joined peer -> the pace it asked for
        self.joined: str | None = None  # the leader we sent JOIN to
        self.early: dict[tuple[str, Code, int], Part] = {}  # deliveries that came before our group
        self.claims = GroupClaims(me, self.rank)  # which member lists we may believe, and who lied
        self.closing_since: float | None = None  # the leader's deadline passed: last probes are out
        self.leading_since: float | None = None  # since when this peer takes itself for the leader
        self.answered_probe: dict[str, float] = {}  # peer -> when it last answered a JOIN/PROBE of ours
        self.points_to: dict[str, str] = {}  # peer -> the leader it named in its last LEADER answer
        self.gave_round_up = False  # asked for the average with no group: it joins no group, ever
        self.observer = False  # only here for the average (``observe``): no peer promises anything to it
        self.last_sent: dict[tuple[Code, str, int], float] = {}  # (kind, to, piece) -> when
        # the group and the butterfly
        self.members: Members | None = None
        self.pace = 0  # the group's pace, with its members
        self.adopted_at = now
        self.slices: list[bytes] | None = None
        self.sizes: list[int] = []
        self.parts: dict[tuple[str, int], bytes] = {}  # (member, slice) -> its encoding, slices we own
        self.recent: dict[str, tuple[int, int]] = {}  # each PART's (trained, window); ours from Start
        self.results: dict[int, bytes] = {}  # slice -> its owner's encoded mean
        self.acked: set[tuple[Code, str, int]] = set()  # (kind, member, piece) acknowledged
        self.finished_with: set[str] = set()  # members that settled: they need no RESULT of ours
        self.screenings: dict[int, tuple[tuple[str, ...], Screening]] = {}  # our slices: (kept, screening)
        self.jobs_out: set[str] = set()
        self.recovery: Recovery | None = None
        self.screened_out: tuple[str, ...] = ()  # members left out of this peer's slice (outliers)
        self.cosines: tuple[tuple[str, float], ...] = ()  # each member's c_i at this peer's slice
        self.replayed: set[str] = set()  # members that sent this peer a slice from an earlier round
        self.outcome: Outcome | None = None
        self.why_recovering = ""

    # ---- the one entry point ----

    def handle(self, event: Event, now: float) -> list[Effect]:
        out: list[Effect] = []
        if isinstance(event, Received) and event.replayed and event.sender not in self.replayed:
            self.replayed.add(event.sender)  # left out of our slice's mean, whatever else it sent
            out.append(Accuse(event.sender, "a slice it had already sent in an earlier round (a replay)"))
        if isinstance(event, Start):
            self._on_start(event, now, out)
        elif isinstance(event, Received):
            self._on_message(event.sender, event.message, now, out)
        elif isinstance(event, ViewChanged):
            self._see(event.view)
        elif isinstance(event, Computed):
            self._on_computed(event, now, out)
        elif isinstance(event, Leaving) and self._may_drop_out(now):
            self.gave_round_up = True  # like a promise: no group of this round will list us
            for peer in sorted(set(self.joins) - {self.me}):  # our joiners go elsewhere
                self._reply_status(out, peer, Status.WAITING, "leaving the run", now)
            self.joins = {}
            if self.phase == Phase.FORMING:  # it needs no average: it settles without asking anyone
                self._settle(Failed("this peer left the run before the round formed"), now, out)
        self._advance(now, out)
        return out

    def observe(self) -> None:
        """Before Start: this peer only wants the round's average (it took the swarm's state after
        the round was sent). It joins no group, and peers that have not reached the round answer
        it BUSY instead of promising to stay out: an observer must not make the round fail."""
        self.gave_round_up = True
        self.observer = True

    @property
    def settled(self) -> bool:
        return self.outcome is not None

    def forget_average(self) -> None:
        """Drop the average to free memory: askers hear it is gone (and know they are behind)."""
        if isinstance(self.outcome, Completed):
            self.outcome = Lost("completed here; the average is no longer kept")

    def quiescent(self, now: float) -> bool:
        """Settled, and nothing left to deliver: the transport may keep only its answer."""
        return self.settled and not self._undelivered_results(now)

    # ---- who is live ----

    def present(self, now: float) -> set[str]:
        """Peers (not us) that are there: on the board, heard from within a record lifetime, or
        members of our group that have not left the board; and not silent for ``answer_s`` after we
        sent them something."""
        recent = {p for p, t in self.heard.items() if now - t <= self.deadlines.heard_s}
        left_board = self.seen_on_board - set(self.view)
        members = {p for p, _ in self.members or ()} - left_board
        return (set(self.view) | recent | members) - self._silent(now) - {self.me}

    def live(self, now: float) -> set[str]:
        """Peers that may still take part in a group of this round: present, and neither
        recovering nor leaving the run."""
        return self.present(now) - self.gave_up - self.departed

    def _see(self, view: Mapping[str, BoardPeer]) -> None:
        """A new view of the board: peers that said they are leaving or done stay departed (one that
        messaged us recently must not become a leader candidate again once its record is gone)."""
        self.departed |= {p for p, seen in view.items() if seen.leaving or seen.done}
        self.view = {p: seen for p, seen in view.items() if not seen.done and p != self.me}
        self.seen_on_board |= set(self.view)

    def candidates(self, now: float) -> set[str]:
        """Peers that may lead the round: on the board or recently heard from, not recovering.
        Silence does not remove a peer here: one that stays on the board may be live behind a
        broken link, and leading past it could form a second group; a dead one leaves the board."""
        recent = {p for p, t in self.heard.items() if now - t <= self.deadlines.heard_s}
        return (set(self.view) | recent) - self.gave_up - self.departed - {self.me}

    def _silent(self, now: float) -> set[str]:
        return {p for p, t in self.silent_since.items() if now - t > self.deadlines.answer_s}

    def leader(self, now: float) -> str:
        return min(self.candidates(now) | {self.me}, key=self.rank)

    def rank(self, peer: str) -> bytes:
        """A peer's place in the line for this round's lead (``leader_rank``), computed once."""
        found = self.ranks.get(peer)
        if found is None:
            found = self.ranks[peer] = leader_rank(self.round_id, peer)
        return found

    def _expect_answer(self, peer: str, now: float) -> None:
        self.silent_since.setdefault(peer, now)

    def _send(self, out: list[Effect], to: str, message: Message, now: float, expect: bool = True) -> None:
        out.append(Send(to, message))
        self.last_sent[(message.code, to, self._piece(getattr(message, "index", 0)))] = now
        if expect:
            self._expect_answer(to, now)

    def _due(self, code: Code, to: str, now: float, every: float | None = None, index: int = 0) -> bool:
        last = self.last_sent.get((code, to, self._piece(index)))
        return last is None or now - last >= (every if every is not None else self.deadlines.resend_s)

    # ---- events ----

    def _on_start(self, event: Start, now: float, out: list[Effect]) -> None:
        if self.phase != Phase.IDLE:
            return
        self.step, self.vector, self.wish = event.step, event.vector, event.pace
        self.codec = event.codec or self.codec  # the round's own: it may be coarser than the run's
        self.recent[self.me] = event.recent
        self.earlier_cosines = event.earlier
        self.started_at = now
        etas = [max(event.step - p.step, 0) * p.step_time_s for p in self.view.values()]
        # a peer's record is its own word: one that claims to be far behind is waited for no longer
        # than a peer that is round_s behind (it takes the average instead), whatever it claims
        self.eta_s = min(max(etas, default=0.0), self.deadlines.round_s)
        self.phase = Phase.FORMING
        if self.gave_round_up:  # promised, or only here for the average: never a member
            self._recover(now, out, "this peer gave the round up before it reached it")

    def _on_message(self, sender: str, msg: Message, now: float, out: list[Effect]) -> None:
        if sender == self.me:
            return
        self.silent_since.pop(sender, None)
        if isinstance(msg, StatusReply) and msg.status == Status.REFUSED:
            # it refused to open the round (its table of rounds is full): no answer about the round
            out.append(Note(f"round {self.round_id}: {short(sender)} refused us: {msg.detail}"))
            return
        if isinstance(msg, Join | Probe) and msg.fingerprint != self.fingerprint:
            self._reply_status(out, sender, Status.REFUSED, "your options differ from this run's", now)
            return  # a peer of another configuration is not a peer of this round
        ran_mine = self._ran_with(sender)
        judged = self.claims.judge(sender, msg, self.members, self.gave_round_up, ran_mine)
        if judged.why:
            out.append(Accuse(sender, judged.why))
        if judged.ignore:
            return
        self.heard[sender] = now
        if isinstance(msg, Join | Probe):  # Probe is a Join subclass: both ask what we know
            self._on_join(sender, msg, now, out)
        elif isinstance(msg, Leader):
            self.answered_probe[sender] = now
            self.points_to[sender] = msg.leader
            hinted = msg.leader
            if hinted != self.me and hinted not in self.candidates(now) and self.phase == Phase.FORMING:
                if self._due(Code.PROBE, hinted, now):  # a peer we do not know takes part: ask it
                    self._send(out, hinted, self._probe(), now)
        elif isinstance(msg, Part | Result):
            self._on_delivery(sender, msg, now, out)
        elif isinstance(msg, Average):
            self._on_average(sender, msg, now, out)
        elif isinstance(msg, Group):
            self.answered_probe[sender] = now
            self._on_group(sender, msg, now, out)
        elif isinstance(msg, Ack):
            self.acked.add((msg.kind, sender, self._piece(msg.index)))
        elif isinstance(msg, Fetch):
            self._on_fetch(sender, msg, now, out)
        elif isinstance(msg, StatusReply):
            self.answered_probe[sender] = now
            self._on_status(sender, msg, now, out)

    def _on_join(self, sender: str, msg: Join, now: float, out: list[Effect]) -> None:
        if self.members is not None:
            self._send(out, sender, Group(self.round_id, self.members, self.pace), now, expect=False)
        elif isinstance(self.outcome, Completed):  # copied from a group we were not in: that group
            group = Group(self.round_id, self.outcome.members, self.outcome.pace)
            self._send(out, sender, group, now, expect=False)
        elif self.phase == Phase.DONE or self.phase == Phase.RECOVERING or self.gave_round_up:
            self._reply_settled(out, sender, now)  # a promise, too: never lead or join what we gave up
        elif msg.code == Code.JOIN and self.leader(now) == self.me:
            self.joins[sender] = msg.shard
            self.wishes[sender] = msg.pace
            self._send(out, sender, Leader(self.round_id, self.me), now, expect=False)
        else:
            self._send(out, sender, Leader(self.round_id, self.leader(now)), now, expect=False)

    def _on_group(self, sender: str, msg: Group, now: float, out: list[Effect]) -> None:
        if self.members is None:
            self._learn(sender, msg.members, msg.pace, now, out, f"from {short(sender)}")
        elif not self._same_group(msg) and self.phase == Phase.RUNNING and self._is_member(sender):
            group, mine = (msg.members, msg.pace), (self.members, self.pace)
            if self.claims.leads_both(sender, group, mine):  # it lied: we switch, or stay, never recover
                if self.claims.prefers(group, mine, self._reduced_any()):
                    self.phase = Phase.FORMING  # ours can never complete: our slice's mean is never sent
                    self.parts, self.results, self.slices, self.screenings = {}, {}, None, {}
                    self.acked, self.last_sent = set(), {}  # its parts go to every member at once
                    self._adopt(*group, now, out, f"from {short(sender)}, which led another group first")
            elif not self.claims.outranked(group, mine):  # an outranked list's members come to ours
                self._recover(now, out, f"member {short(sender)} is in another group of the round")

    def _on_delivery(self, sender: str, msg: Part, now: float, out: list[Effect]) -> None:
        if self.phase == Phase.IDLE:
            return  # members send slices only after we joined; stray data is never held (no ACK)
        if self.vector is not None and len(msg.data) > self.codec.bound_bytes(self.vector.numel()):
            return  # larger than our whole vector encoded: never held
        if self.members is None and self.phase == Phase.FORMING:
            self._learn(sender, msg.members, msg.pace, now, out, f"from a delivery of {short(sender)}")
            if self.members is None:
                leader = self.claims.first(msg.members)
                if self.claims.names_me(msg.members) and leader in self.claims.joined:
                    # ahead of our leader's GROUP: held until it comes, which a JOIN asks for again now
                    self.early[(sender, msg.code, msg.piece())] = msg
                    self._send(out, leader, Join(self.round_id, self.shard, self.fingerprint, self.wish), now)
                return  # any other list is never held or ACKed
        if not self._same_group(msg):
            if self.members is not None:
                if self.claims.outranked((self.members, self.pace), (msg.members, msg.pace)):
                    # our leader's other list: kept for a switch
                    self.early[(sender, msg.code, msg.piece())] = msg
                self._send(out, sender, Group(self.round_id, self.members, self.pace), now, expect=False)
            else:
                self._reply_settled(out, sender, now)
            return
        if self.phase == Phase.RECOVERING or (
            self.phase == Phase.DONE and not isinstance(self.outcome, Completed)
        ):
            self._reply_settled(out, sender, now)  # our butterfly is over: the sender must recover
            return
        if not self._is_member(sender):
            return
        if msg.index not in self._owned(self.me if msg.code == Code.PART else sender):
            return  # not a slice this peer owns (or the sender owns): ignore, never ACK
        key = (sender, msg.index) if msg.code == Code.PART else msg.index
        box: dict = self.parts if msg.code == Code.PART else self.results
        if key not in box and self.phase != Phase.DONE:
            box[key] = msg.data
            if msg.code == Code.PART:
                self.recent[sender] = msg.weight()
            self._check_size(sender, msg, now, out)
        self._send(out, sender, Ack(self.round_id, msg.code, msg.index), now, expect=False)

    def _on_average(self, sender: str, msg: Average, now: float, out: list[Effect]) -> None:
        if self.phase == Phase.RECOVERING and "decode" not in self.jobs_out and self.vector is not None:
            if msg.numel != self.vector.numel():
                return
            self.jobs_out.add("decode")
            out.append(Compute(Job("decode", (msg, sender))))

    def _on_fetch(self, sender: str, msg: Fetch, now: float, out: list[Effect]) -> None:
        self.gave_up.add(sender)  # it will not join: a leader stops waiting for it
        self.joins.pop(sender, None)
        if msg.members and self.members is None:
            self._learn(sender, msg.members, msg.pace, now, out, f"from a FETCH of {short(sender)}")
        if isinstance(self.outcome, Completed) and not msg.average:
            self._reply_status(out, sender, Status.HOLDS, "completed: holds the average", now, msg.ask)
        elif isinstance(self.outcome, Completed):
            reply = average_reply(self.round_id, self.outcome, self.results, self._slices(), self.codec)
            self._send(out, sender, reply, now, expect=False)
        elif self.outcome is not None or self.phase == Phase.RECOVERING:
            self._reply_settled(out, sender, now, msg.ask)
        elif self.phase != Phase.IDLE or self._is_member(self.me) or self.joins or msg.observer:
            # forming (our leader may list us yet), running, or leading: we may still complete; and
            # not there yet, we keep an observer waiting rather than give the round up for it
            self._reply_status(out, sender, Status.BUSY, "still in the round", now, msg.ask)
        else:
            self._give_round_up(sender, msg.ask, now, out)

    def _may_drop_out(self, now: float) -> bool:
        """Whether a peer that is leaving may give this round up: it has not reached it, or it
        leads it and has not decided. One that joined a leader may be listed: it finishes."""
        leads = self.phase == Phase.FORMING and self.leader(now) == self.me
        return self.members is None and not self.gave_round_up and (self.phase == Phase.IDLE or leads)

    def _give_round_up(self, asker: str, ask: int, now: float, out: list[Effect]) -> None:
        """Asked for the average before reaching the round, with no group and no joiners: promise
        to join no group of the round, ever, so the asker may rely on this WAITING (a group formed
        later could complete after the asker has failed the round)."""
        self.gave_round_up = True
        self._reply_status(out, asker, Status.WAITING, "gave the round up", now, ask)

    def _on_status(self, sender: str, msg: StatusReply, now: float, out: list[Effect]) -> None:
        status = msg.status
        if self.phase == Phase.DONE:
            self.finished_with.add(sender)  # it settled too: it needs nothing more from us
            return
        if self.phase == Phase.RECOVERING and self.recovery is not None:
            self._record_answer(sender, status, msg, now)
            return
        if status == Status.WAITING:
            self.gave_up.add(sender)  # recovering or not in any group: it will not join ours
            self.joins.pop(sender, None)
            if self.phase == Phase.RUNNING and self._is_member(sender):
                self._recover(now, out, f"member {short(sender)} is recovering")
        elif status in (Status.FAILED, Status.GONE) and self.phase in (Phase.FORMING, Phase.RUNNING):
            if self.phase == Phase.RUNNING and not self._is_member(sender):
                return
            self._recover(now, out, f"peer {short(sender)} has settled the round ({status.name})")
            assert self.recovery is not None
            self._record_answer(sender, status, msg, now)

    def _on_computed(self, event: Computed, now: float, out: list[Effect]) -> None:
        kind = event.job.kind
        self.jobs_out.discard(job_key(event.job))
        if self.phase == Phase.DONE:
            return
        if kind == "decode":
            if self.phase == Phase.RECOVERING and event.error is None:
                msg, sender = event.job.inputs
                members, pace = msg.members, msg.pace
                assert isinstance(event.value, torch.Tensor)
                ours = members == self.members and self._reduced_all()  # our slices' means are in it
                kept = (self.screened_out, self.cosines) if ours else ((), ())  # so its screening counts
                self._settle(Completed(event.value, members, pace, False, *kept, msg.means), now, out)
                out.append(Note(f"round {self.round_id}: took the average {short(sender)} completed"))
            return
        if self.phase != Phase.RUNNING:
            return
        if event.error is not None:
            self._recover(now, out, event.error)
        elif kind == "encode":
            assert isinstance(event.value, list) and self.members is not None
            if len(event.value) != self._slices():
                return  # for a group this peer left (``_on_group``): the new one's is under way
            self.slices = event.value
            for s in self._mine():
                self.parts[(self.me, s)] = self.slices[s]
        elif kind == "reduce":
            assert isinstance(event.value, tuple) and self.members is not None
            s, kept = event.job.inputs[7], event.job.inputs[3]
            self.results[s], screening = event.value
            self.screenings[s] = (kept, screening)
            if not self._reduced_all():
                return
            judged = [self.screenings[i] for i in self._mine()]
            left_out = {k[i] for k, sc in judged for i in sc.excluded} | self.replayed
            self.screened_out = tuple(p for p, _ in self.members if p in left_out)
            same_kept = all(k == kept for k, _ in judged)  # a replay found between pieces: none recorded
            cosines = owner_cosines([sc for _, sc in judged]) if same_kept else ()
            self.cosines = tuple(zip(kept, cosines, strict=False))
            if self.screened_out:
                names = [short(p) for p in self.screened_out]
                out.append(Note(f"round {self.round_id}: left {names} out of my slice's mean (outliers)"))
        elif kind == "assemble":
            assert isinstance(event.value, torch.Tensor) and self.members is not None
            done = Completed(event.value, self.members, self.pace, True, self.screened_out, self.cosines)
            self._settle(done, now, out)  # True: by the butterfly

    # ---- the phases ----

    def _advance(self, now: float, out: list[Effect]) -> None:
        if self.phase == Phase.FORMING:
            self._form(now, out)
        if self.phase == Phase.RUNNING:
            self._run(now, out)
        if self.phase == Phase.RECOVERING:
            self._ask_for_average(now, out)
        if self.phase == Phase.DONE:
            self._deliver_results(now, out)

    def _form(self, now: float, out: list[Effect]) -> None:
        leader = self.leader(now)
        if leader != self.me:
            if self.joins.keys() - {self.me}:  # we led, but a live peer before us in line is known: yield
                out.append(Note(f"round {self.round_id}: yielding the lead to {short(leader)}"))
                for peer in sorted(self.joins.keys() - {self.me}):
                    self._send(out, peer, Leader(self.round_id, leader), now, expect=False)
            self.joins = {}
            self.closing_since = None
            self.leading_since = None
            if self.joined != leader or self._due(Code.JOIN, leader, now):
                self.joined = leader
                self.claims.joined.add(leader)
                self._send(out, leader, Join(self.round_id, self.shard, self.fingerprint, self.wish), now)
            if now >= self.deadlines.join_patience(self.started_at, self.eta_s):
                self._recover(now, out, f"leader {short(leader)} did not form the group in time")
            return
        self.joined = None
        if self.leading_since is None:
            self.leading_since = now
        self.joins[self.me] = self.shard
        missing = self.live(now) - set(self.joins)
        # peers on the board that answer nothing may be live behind a congested link, in a group
        # of the round we cannot hear of: they count as missing until they answer or leave the board
        quiet = self._unreachable(self._silent(now)) - set(self.joins)
        missing |= quiet
        if not missing and self._others_answered(missing, now, out):
            self._decide(now, out)
            return
        assert self.step is not None
        overdue = {p for p in missing if p not in self.view or self.view[p].step >= self.step}
        for peer in sorted(overdue):  # it is past the round, or unseen on the board: ask what it knows
            if self._due(Code.PROBE, peer, now, 2 * self.deadlines.resend_s):
                self._send(out, peer, self._probe(), now)
        if now < self.deadlines.form_by(self.started_at, self.eta_s):
            return
        if self.closing_since is None:  # the deadline: a last probe of every missing peer
            self.closing_since = now
            for peer in sorted(missing):
                self._send(out, peer, self._probe(), now)
        # no missing peer is coming, and no peer that did not join holds a group: form without them
        if self._last_probes_answered(missing, now, out) & self._others_answered(missing, now, out):
            out.append(Note(f"round {self.round_id}: forms without {sorted(short(p) for p in missing)}"))
            self._decide(now, out)
        elif quiet and now >= self.deadlines.join_patience(self.started_at, self.eta_s):
            names = sorted(short(p) for p in quiet)
            self._recover(now, out, f"{names} on the board answered nothing: the group cannot be decided")

    def _others_answered(self, missing: set[str], now: float, out: list[Effect]) -> bool:
        """Whether every present peer that will not join (recovering, leaving) has answered a probe
        since we lead: it may hold a group of the round that we must adopt rather than form a
        second one. Probes those that have not."""
        assert self.leading_since is not None
        since = self.leading_since
        unknown = {
            p
            for p in self.present(now) - set(self.joins) - missing
            if self.answered_probe.get(p, -1.0) < since
        }
        for peer in sorted(unknown):
            if self._due(Code.PROBE, peer, now, 2 * self.deadlines.resend_s):
                self._send(out, peer, self._probe(), now)
        return not unknown

    def _last_probes_answered(self, missing: set[str], now: float, out: list[Effect]) -> bool:
        """Whether every missing peer, and every peer one of them named as its leader, has answered
        a probe sent since the deadline (or went silent off the board): until then one of them may
        hold or lead a group we do not know of. Re-sends the probes still unanswered."""
        since = self.closing_since
        assert since is not None
        unanswered = {p for p in missing if self.answered_probe.get(p, -1.0) < since}
        hinted = {self.points_to.get(p) for p in missing} - {None, self.me} - missing
        silent = self._silent(now)
        gone = silent - self._unreachable(silent)
        unanswered |= {
            h for h in hinted if h is not None and h not in gone and self.answered_probe.get(h, -1.0) < since
        }
        for peer in sorted(unanswered):
            if self._due(Code.PROBE, peer, now):
                self._send(out, peer, self._probe(), now)
        return not unanswered

    def _decide(self, now: float, out: list[Effect]) -> None:
        """The group: every peer that joined, by data shard; its pace is the largest any asked for
        (the slowest member's link sets everyone's schedule)."""
        members = tuple(sorted(self.joins.items(), key=lambda item: (item[1], item[0])))
        self.wishes[self.me] = self.wish
        pace = max(self.wishes.get(peer, 0) for peer, _ in members)
        self._adopt(members, pace, now, out, "as its leader")

    def _learn(
        self, sender: str, members: Members, pace: int, now: float, out: list[Effect], how: str
    ) -> None:
        """A member list a message carries, while this peer holds none: adopted while forming if
        ``GroupClaims.may_adopt`` allows; never while IDLE (no capture of a round not reached)."""
        if self.phase == Phase.FORMING and self.claims.may_adopt(sender, members):
            self._adopt(members, pace, now, out, how)

    def _adopt(self, members: Members, pace: int, now: float, out: list[Effect], how: str) -> None:
        """The first group this peer learns is its group of the round (a lying leader's: ``_on_group``)."""
        self.members, self.pace = members, pace
        self.adopted_at = now
        listed = [f"{short(p)}:{s}" for p, s in members]
        out.append(Note(f"round {self.round_id}: group {listed}, pace {pace} ({how})"))
        for peer in sorted(set(self.joins) - {self.me}):  # our joiners learn it from us
            self._send(out, peer, Group(self.round_id, members, pace), now, expect=False)
        self.joins = {}
        if self.phase == Phase.FORMING:
            self._enter_group(now, out)
            held, self.early = self.early, {}  # deliveries of this group are taken now; those of a
            for (sender, _, _), early in sorted(held.items()):  # list our leader prefers, held again
                self._on_delivery(sender, early, now, out)

    def _recover(self, now: float, out: list[Effect], why: str) -> None:
        if self.phase in (Phase.RECOVERING, Phase.DONE):
            return
        self.phase = Phase.RECOVERING
        self.why_recovering = why
        self.recovery = Recovery(since=now)
        out.append(Note(f"round {self.round_id}: {why}; asking the other peers for the average"))

    def _ask_for_average(self, now: float, out: list[Effect]) -> None:
        rec = self.recovery
        assert rec is not None
        members = {p for p, _ in self.members or ()}
        recent = {p for p, t in self.heard.items() if now - t <= self.deadlines.heard_s}
        left_board = self.seen_on_board - set(self.view)
        there = set(self.view) | recent | (members - left_board)  # silence alone is no reason here
        silent = {p for p, t in rec.unanswered_since.items() if now - t > self.deadlines.answer_s}
        unreachable = self._unreachable(silent)
        # a liar too: it may complete a group and hand its average to an honest peer (seed 6511)
        asked = there - (silent - unreachable) - {self.me}
        gone = (members | set(rec.answers) | set(rec.unanswered_since)) - asked - {self.me}
        for peer in sorted(gone):  # a peer that left, or never answered a FETCH, is final like a FAILED one
            if peer in rec.answers and rec.answers[peer][0] in (Status.FAILED, Status.GONE):
                continue
            rec.answers[peer] = (Status.FAILED, rec.asks)
            rec.last_final_ask = rec.asks
        pending = rec.pending(asked)
        designated = rec.designate(pending, lambda p: leader_rank(self.round_id, p))
        for peer in pending:
            if self._due(Code.FETCH, peer, now) or (peer == designated and peer not in rec.asked_average):
                rec.asks += 1
                rec.unanswered_since.setdefault(peer, now)
                wants = peer == designated  # the others only say whether they hold it
                rec.asked_average |= {peer} if wants else set()
                fetch = Fetch(self.round_id, rec.asks, self.members or (), self.pace, self.observer, wants)
                self._send(out, peer, fetch, now)
        if "decode" in self.jobs_out:
            return
        if pending:  # silent on the board, or still "in the round" past every honest deadline
            if now >= self.deadlines.undecided_by(rec.since):
                names = sorted(short(p) for p in pending)
                why = f"{self.why_recovering}, and {names} on the board gave no final answer"
                self._settle(Undecided(why + ": it may hold the average"), now, out)
            return
        if not self._may_conclude(now):
            return
        lost = any(status == Status.GONE for status, _ in rec.answers.values())
        why = f"{self.why_recovering}, and no peer holds the round's average"
        self._settle(Lost(why + " any more") if lost else Failed(why), now, out)

    def _unreachable(self, silent: set[str]) -> set[str]:
        """Of the silent peers, those that may still hold the average or a group: the ones on the
        board (a live peer behind a congested link looks as silent as a dead one). Seed 378."""
        return silent & set(self.view)

    def _may_conclude(self, now: float) -> bool:
        """Whether this peer may settle without an average once nobody it asked can produce one. An
        observer waits a record lifetime first: a peer new to the run sees the board as the DHT lets
        it, a live member may show up on it only that much later, and an observer's FAILED is final
        (the round then fails everywhere). Model check: schedule 5022."""
        return not self.observer or now >= self.started_at + self.deadlines.heard_s

    def _record_answer(self, sender: str, status: Status, msg: StatusReply, now: float) -> None:
        rec = self.recovery
        assert rec is not None
        previous = rec.answers.get(sender)
        if previous is not None and previous[0] in (Status.FAILED, Status.GONE):
            return  # final answers stay final
        rec.unanswered_since.pop(sender, None)
        rec.answers[sender] = (status, self._answered_ask(status, msg.ask))
        rec.holders |= {sender} if status == Status.HOLDS else set()
        if status in (Status.FAILED, Status.GONE):
            rec.last_final_ask = rec.asks
        elif status == Status.BUSY and previous is not None and previous[0] == Status.WAITING:
            rec.last_final_ask = rec.asks  # it joined a group after all: ask the others again

    def _answered_ask(self, status: Status, ask: int) -> int:
        """Which FETCH an answer counts for (a WAITING confirms nothing final after it was sent)."""
        return ask

    def _settle(self, outcome: Outcome, now: float, out: list[Effect]) -> None:
        self.outcome = outcome
        self.phase = Phase.DONE
        self.parts = {}
        self.slices = None
        self.vector = None
        out.append(Settle(outcome))

    def _reply_settled(self, out: list[Effect], to: str, now: float, ask: int = 0) -> None:
        """A peer that has no average to give and will not complete the round itself says so."""
        status, why = settled_answer(self.outcome, self.gave_round_up and not self.observer, self.phase)
        self._reply_status(out, to, status, why, now, ask)

    def _reply_status(
        self, out: list[Effect], to: str, status: Status, detail: str, now: float, ask: int = 0
    ) -> None:
        self._send(out, to, StatusReply(self.round_id, status, detail[:200], ask), now, expect=False)

    def _probe(self) -> Probe:
        return Probe(self.round_id, self.shard, self.fingerprint, self.wish)

    def _same_group(self, msg: Group) -> bool:
        return (msg.members, msg.pace) == (self.members, self.pace)

    def _is_member(self, peer: str) -> bool:
        return self.members is not None and any(p == peer for p, _ in self.members)
