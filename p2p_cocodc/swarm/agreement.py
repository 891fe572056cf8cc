"""Do the peers still hold one θ̄? The check that turns any split, whatever caused it, into an alarm.

Every live peer holds the same θ̄ at the end of every inner step (``docs/swarm.md``). A bug, or a
member that lies in a round (a leader that hands different member lists to different peers), can
break that without any single message looking wrong. So each peer publishes, on the notice board,
the sha256 of its θ̄ at its latest ``PUBLISHED`` evaluation steps (``--eval-every``), keeps its own
digests of the last ``KEEP`` such steps, and compares them with the digests the others published
(``compare``). At a step S, the *voters* are this peer and every other training peer that reached S:

- a peer on the board with no digest of S in its record that may vote at S (it joined the run by
  S, and is still training or got that far) is *pending*: its vote may come, or may have slid out
  of its record (a record holds ``PUBLISHED`` digests); one that joined after S, or stopped before
  it, does not vote;
- the verdict is *settled* once one digest is held by a strict majority of the voters, pending ones
  counted as voters: no vote still to come can change it, so every peer that sees the same board
  reaches the same verdict, however the votes arrive. A peer whose digest is not the majority's is
  *behind*: it takes the swarm's state again (``Peer._resync``), as a peer that missed a round does;
- with every vote in (*final*) and no strict majority (two peers, or a tie), the peers *in doubt*
  lose: a peer that went on past a sync it could not learn the outcome of (a round it settled
  undecided, ``swarm/round.py``) publishes the first step it holds θ̄ in doubt from
  (``theta_doubt``), and where every voter not in doubt holds one θ̄, that θ̄ is the swarm's (a peer
  in doubt assumed the sync failed; a peer that knows either completed it or failed it too). Where
  no such θ̄ exists, nobody can tell which side is right: every peer stops with an error naming the
  split. A peer's doubt ends when every vote of a later step is in and a strict majority holds its
  θ̄ there (or every voter does), or when it takes the swarm's state;
- peers whose digest differs from this one's are *disputed*: named in its log, board record and
  summary, and a peer that disputed anyone never ends with the success line.

Pure bookkeeping: the peer computes the digests and reads the board.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# own digests kept: peers many evaluations apart still compare, so a split a drifter keeps published
# (``earlier``) reaches a peer that reads it only once the drifter has taken the state (seconds)
KEEP = 64
PUBLISHED = 8  # digests a board record carries (its latest and the ones before it)
DIGEST_CHARS = 16  # hex characters of sha256 published (64 bits: collisions are not the threat)


def in_doubt(doubt: int, joined_at: int, step: int) -> bool:
    """Whether a peer that publishes ``doubt`` (``theta_doubt``) and ``joined_at`` holds its θ̄ of
    ``step`` in doubt: from its doubt step on, and before the step it took the swarm's state at, if
    it did so since."""
    return 0 <= doubt <= step and (joined_at <= doubt or step < joined_at)


@dataclass(frozen=True)
class Reported:
    """What another peer's board record says: the step it is at, and its latest θ̄ digests."""

    step: int
    digests: Mapping[int, str]
    joined_at: int = 0  # the step whose end it took the swarm's state at (0: it started the run)
    training: bool = True  # False: done or leaving, so it reaches no later step
    doubt: int = -1  # its θ̄ is in doubt from this step on, until it took the swarm's state (-1: none)

    def in_doubt(self, step: int) -> bool:
        return in_doubt(self.doubt, self.joined_at, step)

    def may_vote(self, step: int) -> bool:
        """Whether it held, or will hold, a θ̄ of ``step`` (its digest of it may have slid out of its
        record, or not be in it yet): it joined by then, and it is training or got that far."""
        return self.joined_at <= step and (self.training or self.step >= step)


@dataclass(frozen=True)
class Verdict:
    """What the board says of this peer's θ̄ at one step where some peer disagrees with it."""

    step: int
    disputed: tuple[str, ...]  # peers whose θ̄ at ``step`` differs from ours
    behind: bool  # a strict majority of the voters at ``step`` hold another θ̄: ours is split off
    settled: bool  # a strict majority of the voters holds one θ̄ (ours or another): the split side is known
    holders: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (digest, its holders) by digest; "" is us
    final: bool = True  # every voter's digest is in: an unsettled verdict is a split no vote can mend
    before_resync: bool = False  # ours is of a θ̄ this peer held before it took the swarm's state since
    in_doubt: tuple[str, ...] = ()  # disputed peers whose digest there is of a θ̄ they hold in doubt
    by_doubt: bool = False  # settled without a strict majority: the θ̄ of every voter not in doubt


def split_line(step: int, holders: Mapping[str, Sequence[str]]) -> str:
    """The one line a peer stops with when no majority holds one θ̄: the step, each digest and who
    holds it ("" is this peer)."""
    split = "; ".join(
        f"{digest} on {', '.join(p[:12] if p else 'this peer' for p in peers)}"
        for digest, peers in holders.items()
    )
    return (
        f"θ̄ after step {step} split with no majority of the peers to tell which one is the swarm's "
        f"({split}): this run did not stay synchronised"
    )


class Agreement:
    """This peer's θ̄ digests at recent evaluation steps, compared with the others'."""

    def __init__(self) -> None:
        self.mine: OrderedDict[int, str] = OrderedDict()
        self.history: set[int] = set()  # steps whose digest is of a θ̄ this peer held before a resync
        self.split: set[int] = set()  # steps where some peer published another digest than ours
        self.doubt = -1  # published: the first step of a θ̄ held in doubt (``doubt_from``), or -1
        self.doubting = False  # this peer holds its θ̄ in doubt now (not since confirmed, nor resynced)

    def record(self, step: int, digest: str) -> None:
        self.mine[step] = digest[:DIGEST_CHARS]
        self.mine.move_to_end(step)
        self.history.discard(step)
        while len(self.mine) > KEEP:
            self.split.discard(self.mine.popitem(last=False)[0])

    def latest(self) -> tuple[int, str]:
        """(step, digest) to publish; (-1, "") before the first evaluation."""
        if not self.mine:
            return -1, ""
        step = next(reversed(self.mine))
        return step, self.mine[step]

    def earlier(self) -> list[list[int | str]]:
        """``PUBLISHED - 1`` digests before the latest, oldest first, as [step, digest] pairs: those of
        steps where a split was seen first (they stay published while kept, so the split reaches a
        peer that reads the board late, also once this peer has resynced and evaluated again), then
        the most recent."""
        before = list(self.mine)[:-1]
        chosen = [step for step in before if step in self.split][-(PUBLISHED - 1) :]
        recent = [step for step in before if step not in self.split]
        room = PUBLISHED - 1 - len(chosen)
        chosen += recent[-room:] if room else []
        return [[step, self.mine[step]] for step in sorted(chosen)]

    def doubt_from(self, step: int) -> None:
        """This peer went on past a sync it could not learn the outcome of, as if it failed: its θ̄
        from ``step`` on is in doubt (a tie of digests goes against it) until confirmed."""
        self.doubt = min(self.doubt, step) if self.doubting else step
        self.doubting = True

    def _in_doubt(self, step: int) -> bool:
        return self.doubting and self.doubt <= step and step not in self.history

    def resynced(self) -> None:
        """This peer is taking the swarm's state. The digests it recorded so far stay, published and
        compared: they are what it held, and the others must see the split too. But they are of a θ̄
        it no longer holds, so no verdict on them makes it take the state again. Its doubt stays
        published for them (the others read it up to its new ``joined_at``); its new θ̄ is not in
        doubt."""
        self.history = set(self.mine)
        self.doubting = False

    def compare(self, others: Mapping[str, Reported]) -> list[Verdict]:
        """One verdict per step this peer holds a digest for where some peer published another; a
        doubt this peer holds ends at a step where every vote is in and its θ̄ is the majority's."""
        verdicts = []
        confirmed = False
        for step, mine in self.mine.items():
            votes = {p: r.digests[step] for p, r in others.items() if step in r.digests}
            pending = sum(1 for r in others.values() if step not in r.digests and r.may_vote(step))
            disputed = tuple(sorted(p for p, d in votes.items() if d != mine))
            tally = Counter(votes.values())
            tally[mine] += 1
            top, count = tally.most_common(1)[0]
            settled = 2 * count > 1 + len(votes) + pending
            if self._in_doubt(step) and pending == 0 and (settled and top == mine or not disputed):
                confirmed = True
            if not disputed:
                continue
            self.split.add(step)
            in_doubt = tuple(p for p in disputed if others[p].in_doubt(step))
            sure = {d for p, d in votes.items() if not others[p].in_doubt(step)}
            sure |= set() if self._in_doubt(step) else {mine}
            by_doubt = not settled and pending == 0 and len(sure) == 1
            if by_doubt:  # a tie: the θ̄ every voter not in doubt holds is the swarm's
                settled, (top,) = True, sure
            held: dict[str, list[str]] = {mine: [""]}  # "": this peer
            for peer, digest in sorted(votes.items()):
                held.setdefault(digest, []).append(peer)
            holders = tuple(sorted((d, tuple(peers)) for d, peers in held.items()))
            old = step in self.history
            behind = settled and top != mine and not old
            verdicts.append(
                Verdict(step, disputed, behind, settled, holders, pending == 0, old, in_doubt, by_doubt)
            )
        if confirmed:
            self.doubt, self.doubting = -1, False
        return verdicts
