"""Do the peers still hold one θ̄? The check that turns any split, whatever caused it, into an alarm.

Every live peer holds the same θ̄ at the end of every inner step (``docs/swarm.md``). A bug, or a
member that lies in a round (a leader that hands different member lists to different peers), can
break that without any single message looking wrong. So each peer publishes, on the notice board,
the sha256 of its θ̄ at its latest evaluation step (``--eval-every``), keeps its own digests of the
last ``KEEP`` such steps, and compares them with the digests the others published (``compare``):

- at a step S where the peers reporting S (this one included) disagree, the digest a strict majority
  of them holds is the swarm's; a peer whose digest is not it is *behind*: it takes the swarm's state
  again (``Peer._resync``), as a peer that missed a round does;
- peers whose digest differs from this one's are *disputed*: named in its log, board record and
  summary; with no strict majority (two peers, or a tie) nobody can tell which side is right, and the
  run ends with an error instead of a success line.

Pure bookkeeping: the peer computes the digests and reads the board.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

KEEP = 16  # own digests kept: peers a few evaluations apart still compare
DIGEST_CHARS = 16  # hex characters of sha256 published (64 bits: collisions are not the threat)


@dataclass(frozen=True)
class Verdict:
    """What the board says of this peer's θ̄ at one step where some peer disagrees with it."""

    step: int
    disputed: tuple[str, ...]  # peers whose θ̄ at ``step`` differs from ours
    behind: bool  # a strict majority of the peers reporting ``step`` hold another θ̄: ours is split off
    settled: bool  # a strict majority holds one θ̄ (ours or another): the split side is known
    holders: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (digest, its holders) by digest; "" is us


class Agreement:
    """This peer's θ̄ digests at recent evaluation steps, compared with the others'."""

    def __init__(self) -> None:
        self.mine: OrderedDict[int, str] = OrderedDict()

    def record(self, step: int, digest: str) -> None:
        self.mine[step] = digest[:DIGEST_CHARS]
        self.mine.move_to_end(step)
        while len(self.mine) > KEEP:
            self.mine.popitem(last=False)

    def latest(self) -> tuple[int, str]:
        """(step, digest) to publish; (-1, "") before the first evaluation."""
        if not self.mine:
            return -1, ""
        step = next(reversed(self.mine))
        return step, self.mine[step]

    def forget(self) -> None:
        """This peer took the swarm's state: its earlier digests were of a θ̄ it no longer holds."""
        self.mine.clear()

    def compare(self, others: Mapping[str, tuple[int, str]]) -> list[Verdict]:
        """One verdict per step this peer holds a digest for where some peer published another."""
        by_step: dict[int, dict[str, str]] = {}
        for peer, (step, digest) in others.items():
            if step in self.mine:
                by_step.setdefault(step, {})[peer] = digest
        verdicts = []
        for step, digests in sorted(by_step.items()):
            mine = self.mine[step]
            disputed = tuple(sorted(p for p, d in digests.items() if d != mine))
            if not disputed:
                continue
            votes = Counter(digests.values())
            votes[mine] += 1
            top, count = votes.most_common(1)[0]
            settled = 2 * count > sum(votes.values())
            held: dict[str, list[str]] = {mine: [""]}  # "": this peer
            for peer, digest in sorted(digests.items()):
                held.setdefault(digest, []).append(peer)
            holders = tuple(sorted((d, tuple(peers)) for d, peers in held.items()))
            verdicts.append(Verdict(step, disputed, settled and top != mine, settled, holders))
        return verdicts
