"""A model of the swarm for the round machine: 3-5 peers on an in-memory network with a fake clock.

``explore(seed)`` builds one schedule from a seed and runs it: when each peer reaches the round,
how long every message takes (so messages overtake each other), which are dropped or duplicated,
which peers crash and when, how long each peer's view of the board lags behind the truth (dead
peers linger, new ones appear late), how long each computation takes, and whether one peer only
fetches the round's average (a peer that joined the run after the round was sent, or came back
to it: it promises to join no group and asks the others), and whether one peer is a *forger*
that hands others private groups. It checks the machine's
invariants after every event and returns a ``Verdict``; nothing here reads a real clock.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
from dataclasses import dataclass, field
from itertools import count

import torch

from p2p_cocodc.algorithms.butterfly import PIECE_BYTES, butterfly_mean
from p2p_cocodc.algorithms.codecs import get_codec
from p2p_cocodc.swarm.agreement import Agreement, Reported
from p2p_cocodc.swarm.messages import Group
from p2p_cocodc.swarm.round import RoundMachine
from p2p_cocodc.swarm.round_events import (
    Accuse,
    BoardPeer,
    Completed,
    Compute,
    Deadlines,
    Failed,
    Leaving,
    Lost,
    Phase,
    Received,
    Send,
    Settle,
    Start,
    Tick,
    Undecided,
    ViewChanged,
    leader_rank,
    run_job,
)

# The channel the protocol assumes: a message takes at most MAX_DELAY_S, and of two copies of a
# message in a row on one link at most one is lost, so a live peer answers within
# 2·resend_s + 2·MAX_DELAY_S + a tick; answer_s is set above that (the failure detector is right).
MAX_DELAY_S = 4.0
DEADLINES = Deadlines(round_s=20.0, resend_s=1.0, answer_s=12.0, heard_s=4.0)
TICK_S = 0.5
STEP = 10  # the round's step; every peer's board record says it is there once it starts
ROUND = "f0:10"


@dataclass
class Plan:
    """One schedule, drawn from a seed."""

    ids: list[str]
    start_at: dict[str, float]
    crash_at: dict[str, float]
    delay: tuple[float, float]  # message delay range, seconds
    slow_share: float  # share of messages delayed by up to 3 s more
    drop: float
    duplicate: float
    view_lag: dict[tuple[str, str], float]  # (viewer, peer) -> seconds until the viewer sees the peer
    linger: dict[tuple[str, str], float]  # (viewer, dead peer) -> seconds it stays on the viewer's board
    leave_at: dict[str, float]  # peers that say they are leaving (SIGTERM) at that time
    board_lag: dict[tuple[str, str], float]  # (viewer, peer) -> seconds a change of its record takes
    codec: str
    numel: int
    fetcher: str | None = None  # a peer that only wants the round's average (``take_part=False``)
    paces: dict[str, int] = field(default_factory=dict)  # the pace each peer asks for at Start
    # (sender, receiver) -> (from, until, extra delay): a congested link (a thin uplink full of
    # slices, a slow ACK) delivers what is sent on it in that window late, beyond ``answer_s``: the
    # failure detector then takes a live peer for gone
    congested: dict[tuple[str, str], tuple[float, float, float]] = field(default_factory=dict)
    # a member that runs the round honestly, yet sends each peer behind it in the round's line a
    # GROUP of the two of them, which it never runs: before anyone reaches the round (a capture of
    # a round not reached), when it reaches it, and once more at ``forge_at`` (issue 19's attack)
    forger: str | None = None
    forge_at: float = 0.0

    @property
    def faults(self) -> bool:
        return (
            bool(self.crash_at)
            or self.drop > 0
            or bool(self.leave_at)
            or bool(self.congested)
            or self.forger is not None
        )


def draw_plan(seed: int) -> Plan:
    rng = random.Random(seed)
    n = rng.choice([3, 3, 4, 5])
    ids = sorted({f"{rng.randrange(16**8):08x}" for _ in range(n)})
    while len(ids) < n:
        ids.append(f"{rng.randrange(16**8):08x}")
    start_at = {p: rng.uniform(0, 3) for p in ids}
    if rng.random() < 0.3:  # a straggler, or a peer joining the run late
        start_at[rng.choice(ids)] = rng.uniform(5, 40)
    crash_at: dict[str, float] = {}
    if rng.random() < 0.5:
        for victim in rng.sample(ids, rng.choice([1, 1, 2]) if n > 3 else 1):
            crash_at[victim] = rng.uniform(0, 30)
    view_lag: dict[tuple[str, str], float] = {}
    if rng.random() < 0.4:  # views disagree: newcomers show on the others' boards late (they see all)
        for newcomer in rng.sample(ids, rng.choice([1, 2]) if n > 3 else 1):
            for viewer in ids:
                if viewer != newcomer and rng.random() < 0.7:
                    view_lag[(viewer, newcomer)] = start_at[newcomer] + rng.uniform(0, 8)
    linger = {(v, p): rng.uniform(0, DEADLINES.heard_s * 2) for v in ids for p in crash_at if v != p}
    leave_at: dict[str, float] = {}
    if rng.random() < 0.25:  # a peer leaves: before it reaches the round, or during it
        stayers = [p for p in ids if p not in crash_at]
        leave_at[rng.choice(stayers)] = rng.uniform(0, 15)
    board_lag = {(v, p): rng.uniform(0, 2) for v in ids for p in ids if v != p}
    fast = rng.random() < 0.5
    fetcher = None
    extra = random.Random(seed + 1_000_003)  # its own stream: the other draws stay as they were
    if n >= 3 and extra.random() < 0.25:
        fetcher = extra.choice(ids)
        start_at[fetcher] = extra.uniform(0, 40)
    paces = {p: extra.choice([0, 6, 6, 13, 40]) for p in ids}
    congested = draw_congestion(ids, random.Random(seed + 2_000_003))
    forging = random.Random(seed + 3_000_007)
    forger = forging.choice(ids) if forging.random() < 0.2 and fetcher is None else None
    return Plan(
        ids=ids,
        start_at=start_at,
        crash_at=crash_at,
        delay=(0.001, 0.05) if fast else (0.01, 1.0),
        slow_share=rng.choice([0.0, 0.1, 0.3]),
        drop=rng.choice([0.0, 0.0, 0.05, 0.2]),
        duplicate=rng.choice([0.0, 0.1]),
        view_lag=view_lag,
        linger=linger,
        leave_at=leave_at,
        board_lag=board_lag,
        codec=rng.choice(["fp32", "fp32", "int8"]),
        numel=rng.choice([5, 8, 130]),
        fetcher=fetcher,
        paces=paces,
        congested=congested,
        forger=forger,
        forge_at=forging.uniform(0, 12),
    )


def draw_congestion(ids: list[str], rng: random.Random) -> dict[tuple[str, str], tuple[float, float, float]]:
    """In about a third of the schedules, one peer's uplink (every link out of it) or one link is
    slow for a while: what is sent on it then arrives up to 1-5 times ``answer_s`` late."""
    if rng.random() >= 0.35:
        return {}
    sender = rng.choice(ids)
    receivers = [p for p in ids if p != sender]
    if rng.random() < 0.5:
        receivers = [rng.choice(receivers)]
    start = rng.uniform(0, 30)
    until = start + rng.uniform(2, 80)
    extra = rng.uniform(1, 5) * DEADLINES.answer_s
    return {(sender, to): (start, until, extra) for to in receivers}


@dataclass
class Verdict:
    seed: int
    violation: str | None = None
    events: int = 0
    outcomes: dict[str, str] = field(default_factory=dict)
    end_time: float = 0.0


class World:
    """The peers, the network and the clock of one schedule."""

    undecided_doubt = True  # an undecided peer publishes its doubt (False: the check's teeth test)

    def __init__(
        self, plan: Plan, rng: random.Random, machine: type[RoundMachine], piece_bytes: int = PIECE_BYTES
    ) -> None:
        self.plan = plan
        self.piece_bytes = piece_bytes  # small: every member's slice comes in pieces
        self.rng = rng
        self.machine_cls = machine
        self.codec = get_codec(plan.codec)
        self.now = 0.0
        self.queue: list[tuple[float, int, object]] = []
        self.order = count()
        self.machines: dict[str, RoundMachine] = {}
        self.vectors = {
            p: torch.randn(plan.numel, generator=torch.Generator().manual_seed(i))
            for i, p in enumerate(plan.ids)
        }
        self.outcomes: dict[str, object] = {}
        self.settled_at: dict[str, float] = {}
        self.dead: set[str] = set()
        self.leaving: set[str] = set()
        self.exited: dict[str, float] = {}  # leavers that have exited, and when
        self.started: set[str] = set()
        self.events = 0
        self.trace: list[str] | None = None
        self.checked_state = (0, 0, 0)
        self.butterfly_means: dict[tuple, torch.Tensor] = {}  # members -> their butterfly mean
        self.dropped_last: set[tuple[str, str]] = set()  # links whose last message was dropped
        self.accusations: list[tuple[str, str, str]] = []  # (accuser, accused, why)
        self.forged_to: set[str] = set()  # peers the forger sent a private group

    # ---- the schedule ----

    def at(self, t: float, what: object) -> None:
        heapq.heappush(self.queue, (t, next(self.order), what))

    def view_of(self, viewer: str) -> dict[str, BoardPeer]:
        """What ``viewer``'s board shows now: started peers once its lag has passed, dead peers
        until they have lingered long enough."""
        view = {}
        for peer in self.plan.ids:
            if peer == viewer:
                continue
            shows_at = self.plan.view_lag.get((viewer, peer), 0.0)
            if self.now < shows_at:
                continue
            crash = self.plan.crash_at.get(peer)
            if crash is not None and self.now >= crash + self.plan.linger.get((viewer, peer), 0.0):
                continue
            lag = self.plan.board_lag[(viewer, peer)]  # its record is re-read every heartbeat or so
            at_round = peer in self.started and self.now >= self.plan.start_at[peer] + lag
            step = STEP if at_round else STEP - 1
            leaving = self.now >= self.plan.leave_at.get(peer, math.inf) + lag
            done = self.now >= self.exited.get(peer, math.inf) + lag
            view[peer] = BoardPeer(step=step, step_time_s=1.0, leaving=leaving, done=done)
        return view

    def exit_leavers(self) -> None:
        """A leaving peer exits once it has settled what it started (at once if it never started)."""
        for peer in self.leaving - set(self.exited):
            machine = self.machines.get(peer)
            started = peer in self.started
            if not started or (peer in self.outcomes and machine is not None and machine.quiescent(self.now)):
                self.exited[peer] = self.now
                for viewer in self.plan.ids:
                    if viewer != peer:
                        self.at(self.now + self.plan.board_lag[(viewer, peer)] + 1e-6, ("views",))

    def machine(self, peer: str) -> RoundMachine:
        if peer not in self.machines:
            self.machines[peer] = self.machine_cls(
                peer,
                ROUND,
                self.plan.ids.index(peer),
                "fp",
                self.codec,
                DEADLINES,
                self.view_of(peer),
                self.now,
                piece_bytes=self.piece_bytes,
            )
        return self.machines[peer]

    def feed(self, peer: str, event: object) -> None:
        if peer in self.dead or peer in self.exited:
            return
        effects = self.machine(peer).handle(event, self.now)  # type: ignore[arg-type]
        if self.trace is not None and not isinstance(event, Tick | ViewChanged):
            self.trace.append(f"{self.now:8.3f} {peer[:6]} <- {describe(event)}")
        for effect in effects:
            if self.trace is not None and not isinstance(effect, Compute):
                self.trace.append(f"{self.now:8.3f} {peer[:6]} -> {describe(effect)}")
            if isinstance(effect, Send):
                self.send(peer, effect)
            elif isinstance(effect, Compute):
                self.at(self.now + self.rng.choice([0.0, 0.01, 0.3]), ("computed", peer, effect.job))
            elif isinstance(effect, Accuse):
                self.accusations.append((peer, effect.peer, effect.why))
            elif isinstance(effect, Settle):
                if peer in self.outcomes:
                    raise AssertionError(f"{peer} settled twice")
                self.outcomes[peer] = effect.outcome
                self.settled_at[peer] = self.now

    def send(self, sender: str, effect: Send) -> None:
        plan, rng = self.plan, self.rng
        copies = 2 if rng.random() < plan.duplicate else 1
        link = (sender, effect.to)
        for _ in range(copies):
            if rng.random() < plan.drop and link not in self.dropped_last:
                self.dropped_last.add(link)
                continue
            self.dropped_last.discard(link)
            delay = rng.uniform(*plan.delay)
            if rng.random() < plan.slow_share:
                delay = min(delay + rng.uniform(0, 3), MAX_DELAY_S)
            jam = plan.congested.get(link)
            if jam is not None and jam[0] <= self.now < jam[1]:
                delay += jam[2] * (jam[1] - self.now) / (jam[1] - jam[0])  # its queue drains by the end
            self.at(self.now + delay, ("deliver", effect.to, sender, effect.message))

    def run(self, seed: int, limit_s: float = 900.0) -> Verdict:
        plan = self.plan
        for peer, t in plan.start_at.items():
            self.at(t, ("start", peer))
        for peer, t in plan.crash_at.items():
            self.at(t, ("crash", peer))
        if plan.forger is not None:
            for t in (0.0, plan.start_at[plan.forger], plan.start_at[plan.forger] + plan.forge_at):
                self.at(t, ("forge",))
        for peer, t in plan.leave_at.items():
            self.at(t, ("leave", peer))
            for viewer in plan.ids:
                if viewer != peer:
                    self.at(t + plan.board_lag[(viewer, peer)] + 1e-6, ("views",))
        changes = (
            {t for t in plan.view_lag.values()}
            | {plan.start_at[p] + t for (_, p), t in plan.board_lag.items()}
            | {plan.crash_at[p] + t for (_, p), t in plan.linger.items()}
            | set(plan.start_at.values())
        )
        for t in changes:
            self.at(t + 1e-6, ("views",))
        self.at(TICK_S, ("tick",))
        verdict = Verdict(seed)
        while self.queue:
            t, _, what = heapq.heappop(self.queue)
            self.now = t
            self.events += 1
            kind = what[0]  # type: ignore[index]
            if kind == "start":
                _, peer = what  # type: ignore[misc]
                if peer in self.leaving:
                    continue  # it left before reaching the round: it never starts it
                self.started.add(peer)
                if peer == plan.fetcher and self.machine(peer).phase == Phase.IDLE:
                    self.machine(peer).observe()  # as FragmentExchange.allreduce(take_part=False) does
                self.feed(peer, Start(STEP, self.vectors[peer], plan.paces.get(peer, 0)))
                self.broadcast_views()
            elif kind == "deliver":
                _, to, sender, message = what  # type: ignore[misc]
                if sender in self.dead and sender not in self.exited and self.rng.random() < 0.5:
                    continue  # a crashed peer's messages in flight may be lost with it
                self.feed(to, Received(sender, message))
            elif kind == "computed":
                _, peer, job = what  # type: ignore[misc]
                self.feed(peer, run_job(job, self.codec))
            elif kind == "forge":
                self.forge()
            elif kind == "crash":
                self.dead.add(what[1])  # type: ignore[index]
            elif kind == "leave":
                self.leaving.add(what[1])  # type: ignore[index]
                if what[1] in self.machines:  # type: ignore[index]
                    self.feed(what[1], Leaving())  # type: ignore[index]
            elif kind == "views":
                self.broadcast_views()
            elif kind == "tick":
                for peer in list(self.machines):
                    self.feed(peer, Tick())
                if not self.finished() and self.now < limit_s:
                    self.at(self.now + TICK_S, ("tick",))
            self.exit_leavers()
            verdict.violation = self.check()
            if verdict.violation:
                break
            if self.finished() and kind == "tick":
                break
        verdict.violation = verdict.violation or self.check_end(limit_s)
        verdict.events = self.events
        verdict.end_time = self.now
        verdict.outcomes = {p[:6]: type(o).__name__ for p, o in self.outcomes.items()}
        return verdict

    def forge(self) -> None:
        """The forger hands each peer behind it in the round's line a group of the two of them."""
        forger = self.plan.forger
        assert forger is not None
        if forger in self.dead or forger in self.exited:
            return
        shard = self.plan.ids.index
        for peer in self.plan.ids:
            if peer != forger and leader_rank(ROUND, forger) < leader_rank(ROUND, peer):
                members = tuple(sorted([(forger, shard(forger)), (peer, shard(peer))], key=lambda m: m[1]))
                self.forged_to.add(peer)
                self.send(forger, Send(peer, Group(ROUND, members, 0)))

    def broadcast_views(self) -> None:
        for peer in list(self.machines):
            self.feed(peer, ViewChanged(self.view_of(peer)))

    def live_peers(self) -> list[str]:
        return [p for p in self.plan.ids if p not in self.dead and p not in self.exited]

    def finished(self) -> bool:
        """Every live peer started and settled, and nothing of theirs is left to deliver."""
        live = self.live_peers()
        return all(p in self.outcomes for p in live) and all(
            self.machines[p].quiescent(self.now) for p in live
        )

    # ---- the invariants ----

    def check(self) -> str | None:
        """The invariants; they depend only on outcomes and on who is alive, so they are evaluated
        again whenever either has changed since the last event."""
        state = (len(self.outcomes), len(self.dead), len(self.exited))
        if state == self.checked_state:
            return None
        self.checked_state = state
        # over live peers: a peer that completes and then dies takes its outcome with it (a peer
        # that copied its average before it died is live and is checked)
        completed = {
            p: o for p, o in self.outcomes.items() if isinstance(o, Completed) and p in self.live_peers()
        }
        groups = {(o.members, o.pace) for o in completed.values() if o.by_butterfly}
        if len(groups) > 1:
            return f"two groups completed the round: {groups}"
        if any(p == self.plan.fetcher for o in completed.values() for p, _ in o.members):
            return "the peer that only fetches the average was listed in the group"
        averages = list(completed.values())
        for o in averages[1:]:
            if not torch.equal(o.average, averages[0].average):
                return "two peers completed with different averages"
            if o.pace != averages[0].pace:
                return f"two peers completed with different paces: {o.pace} and {averages[0].pace}"
        if averages:
            members = averages[0].members
            asked = max(self.plan.paces.get(p, 0) for p, _ in members)
            if averages[0].pace != asked:
                return f"the group's pace is {averages[0].pace}, its members asked for at most {asked}"
            if members not in self.butterfly_means:  # the same group, checked again as its peers settle
                vectors = [self.vectors[p] for p, _ in members]
                mean = butterfly_mean(vectors, self.codec, piece_bytes=self.piece_bytes)
                self.butterfly_means[members] = mean.average
            if not torch.equal(averages[0].average, self.butterfly_means[members]):
                return f"the average is not the butterfly mean of its members {members}"
        # honest peers agree; the forger's own outcome may differ (its machine ignores the lists
        # its process forged, and may complete a group of one: a liar's θ̄ is its own problem,
        # the θ̄ check outvotes it)
        live = set(self.live_peers()) - {self.plan.forger}
        live_completed = [p for p in completed if p in live]
        # an Undecided peer holds θ̄ in doubt until the θ̄ vote: it may sit beside either outcome
        live_failed = [p for p, o in self.outcomes.items() if p in live and isinstance(o, Failed | Lost)]
        if live_completed and live_failed:
            return f"live peers disagree: {live_completed} completed, {live_failed} did not"
        lost = [p for p, o in self.outcomes.items() if isinstance(o, Lost)]
        if lost:
            return f"{lost} lost the round (nothing is ever evicted in the model)"
        honest = [a for a in self.accusations if a[0] != self.plan.forger and a[1] != self.plan.forger]
        if honest:
            return f"{honest[0][0][:6]} accused {honest[0][1][:6]}, an honest peer: {honest[0][2]}"
        undecided = [p for p, o in self.outcomes.items() if isinstance(o, Undecided)]
        # the failure detector is right, and every peer answers: every peer can know (a forger that
        # leads may go silent on a peer it handed a private group)
        if undecided and not self.plan.congested and self.plan.forger is None:
            return f"{undecided} could not learn the outcome, on links that deliver in time"
        return None

    def check_end(self, limit_s: float) -> str | None:
        live = [p for p in self.live_peers() if p != self.plan.forger]  # the forger may never settle
        unsettled = [p for p in live if p not in self.outcomes]
        if unsettled:
            return f"{unsettled} never settled (by {self.now:.0f} s)"
        bound = DEADLINES.settle_by(max(self.plan.start_at.values()), 0.0, 0)
        late = {p: t for p, t in self.settled_at.items() if p in live and t > bound}
        if late:
            return f"peers settled after the bound {bound:.0f} s: {late}"
        split = self.vote_splits()
        if split:
            return split
        forger = self.plan.forger
        if forger is not None and not (self.plan.crash_at or self.plan.drop or self.plan.congested):
            others = [p for p in self.plan.ids if p != forger]
            leads = min(self.plan.ids, key=lambda p: leader_rank(ROUND, p)) == forger
            # private groups cost the honest peers nothing: where the forger does not lead, they
            # never take its lists; where it leads and every peer is on time, they leave its
            # private pairs for the group it runs (the larger list of a leader that sent two,
            # ``group_claims.preferred``). A late peer lets a leader that runs its group wait for
            # it, while its private pairs go silent: that costs the round, as a silent leader does
            on_time = max(self.plan.start_at.values()) < 5
            if not self.plan.view_lag and not self.plan.leave_at and (on_time or not leads):
                behind = [p for p in others if not isinstance(self.outcomes.get(p), Completed)]
                if behind:
                    how = "leads" if leads else "does not lead"
                    return f"a forger that {how} the round made {behind[0][:6]} miss it"
                blamed_by = {a for a, accused, _ in self.accusations if accused == forger}
                if self.forged_to and not blamed_by:
                    return "the forger handed out private groups, and no honest peer accused it"
            return None
        if not (self.plan.crash_at or self.plan.drop or self.plan.congested):  # a leave is no fault
            full = tuple(sorted(p for p in self.plan.ids if p != self.plan.fetcher))
            for p in live:
                o = self.outcomes[p]
                if not isinstance(o, Completed):
                    reason = o.reason if isinstance(o, Failed | Lost) else o
                    return f"no crash and no lost message, yet {p[:6]} did not complete: {reason}"
                on_time = (
                    max(self.plan.start_at.values()) < 5 and not self.plan.view_lag and not self.plan.leave_at
                )
                if tuple(sorted(m for m, _ in o.members)) != full and on_time:
                    return f"no faults and everyone on time, yet the group was {o.members}"
        return None

    def vote_splits(self) -> str | None:
        """The θ̄ vote at the next evaluation (``swarm/agreement.py``, the real one) over every live
        peer, the forger with what its machine settled: the honest peers that do not find themselves
        behind must hold one θ̄ (the others take it), and none may face a split nothing settles. A
        peer that failed the round, or settled it undecided (in doubt), holds θ̄ without it."""
        live = self.live_peers()
        theta = {p: self._theta_after(p) for p in live}
        undecided = {p for p in live if isinstance(self.outcomes.get(p), Undecided)}
        doubt = {p: STEP if p in undecided and self.undecided_doubt else -1 for p in live}
        kept: set[str] = set()
        for p in live:
            if p == self.plan.forger:
                continue
            mine = Agreement()
            mine.record(STEP, theta[p])
            if doubt[p] >= 0:
                mine.doubt_from(doubt[p])
            others = {q: Reported(STEP, {STEP: theta[q]}, doubt=doubt[q]) for q in live if q != p}
            verdicts = mine.compare(others)
            if any(not v.settled for v in verdicts):
                return f"the θ̄ vote cannot settle the split on {p[:6]}: {verdicts[0].holders}"
            if not any(v.behind for v in verdicts):
                kept.add(theta[p])
        if len(kept) > 1:
            return f"honest peers keep {len(kept)} different θ̄ after the vote"
        return None

    def _theta_after(self, peer: str) -> str:
        outcome = self.outcomes.get(peer)
        if isinstance(outcome, Completed):
            return hashlib.sha256(outcome.average.numpy().tobytes()).hexdigest()[:16]
        return "without"


def describe(item: object) -> str:
    """One short line for a trace: peer ids cut to 6 characters, tensors and bytes left out."""
    if isinstance(item, Received | Send):
        message = item.message
        fields = {k: v for k, v in vars(message).items() if k not in ("round_id", "data")}
        if "members" in fields:
            fields["members"] = [m[:6] for m, _ in fields["members"]]
        who = item.sender if isinstance(item, Received) else item.to
        return f"{type(message).__name__}{'<' if isinstance(item, Received) else '>'}{who[:6]} {fields}"
    if isinstance(item, Start):
        return "Start"
    return repr(item)[:160]


def explore(
    seed: int, machine: type[RoundMachine] = RoundMachine, trace: bool = False, piece_bytes: int = PIECE_BYTES
) -> tuple[Verdict, list[str]]:
    """Run the schedule of ``seed``; with ``trace``, also every event and effect, one per line;
    with a small ``piece_bytes``, every member's slice in pieces (``pieces_per_member``)."""
    plan = draw_plan(seed)
    world = World(plan, random.Random(seed * 7919 + 1), machine, piece_bytes)
    world.trace = [] if trace else None
    try:
        verdict = world.run(seed)
    except Exception as exc:  # noqa: BLE001 - a machine that raises is a violation like any other
        verdict = Verdict(
            seed, f"a machine raised {type(exc).__name__}: {exc}", world.events, end_time=world.now
        )
    return verdict, world.trace or []
