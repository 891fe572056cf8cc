"""Which member lists of one round a peer may believe, and which prove their sender dishonest.

A group is decided by exactly one peer, its **leader**: the first of its members in the round's
line (``leader_rank``). Every joiner chose a leader before itself in line, and the leader lists
itself, so a member list is a claim made by its first member. A peer checks each list it is sent
against what it did itself; a sender is blamed only for what it said directly (libp2p authenticates
senders), never for a list it relays, which is its source's word, not its own:

- **forged lead**: a list that puts this peer first, which it never decided, with the sender in it
  (an honest member holds a list naming itself only on its leader's word: this peer's);
- **a listing never asked for**: a GROUP that names this peer, from its own first member, while
  this peer never sent that member a JOIN in this round (a leader lists only peers that joined it).
  A process that gave the round up before reaching it (it was taking the swarm's state, or came
  back after a crash) may have had an earlier process join: that listing is blamed on no one;
- **two groups**: a sender that is first in line in two different groups (member list and pace)
  of the round;
- **a group besides ours**: a list the sender leads, from a member that has sent this peer a slice
  of this peer's group (an honest peer leads no group once it runs another).

**A leader that sent two groups.** An honest leader decides one list, so two different lists of a
round with the same first member (told to this peer directly: libp2p authenticates senders) prove
that member lied. It may have handed this peer a private pair it never runs, and its joiners the
group it does run: every honest member then takes the ``preferred`` of the two (the larger list),
leaving the other while it has not reduced its slice there (``RoundMachine``): a group it leaves
can never complete, as its slice's mean is never sent, so one group still completes at most. One
that has reduced stays, and so never recovers on a liar's word. A member that relays a less
preferred list of its leader's is not taken for one of another group (it comes over once its
leader's larger list reaches it).

A list that names this peer is adopted only on the word of a leader this process joined (its
GROUP, or a delivery it sent; a member's delivery that comes first is held until then), and only
once the peer has reached the round (``RoundMachine`` never adopts while IDLE): a member cannot hand a peer
a private group for the round at hand, and no one can capture a round the peer has not reached.
A list that does not name this peer may still be adopted while forming (this peer then recovers
and asks for the average: a group it is not in must never meet a second one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from p2p_cocodc.swarm.messages import Code, Members, Message

FORGED_LEAD = "a member list that puts this peer first in line for the round, which it never decided"
GroupKey = tuple[Members, int]  # a group: its ordered member list and its pace


def preferred(a: GroupKey, b: GroupKey) -> GroupKey:
    """Of two groups one leader sent (it lied), the one its honest members all take: the one with
    more members; between lists of one size, the smaller ``(members, pace)``."""
    return min(a, b, key=lambda group: (-len(group[0]), group))


class Judgement(NamedTuple):
    why: str  # why the sender is dishonest, '' if it is not (or was already accused this round)
    ignore: bool  # the message is not to be acted on


class GroupClaims:
    """What one round's machine was told about the round's groups, and by whom."""

    def __init__(self, me: str, rank: Callable[[str], bytes]) -> None:
        self.me = me
        self.rank = rank
        self.joined: set[str] = set()  # every peer this process sent a JOIN for this round
        self.led: dict[str, GroupKey] = {}  # sender -> the group it said it leads (first said)
        self.blamed: set[str] = set()  # senders already accused in this round: once each

    def first(self, members: Members) -> str:
        """The member that decided this list, if anyone did: the first in line."""
        return min((peer for peer, _ in members), key=self.rank)

    def names_me(self, members: Members) -> bool:
        return any(peer == self.me for peer, _ in members)

    def judge(
        self, sender: str, msg: Message, mine: Members | None, may_be_earlier: bool, ran_mine: bool = False
    ) -> Judgement:
        """What ``sender`` just said: whether it proves the sender dishonest (``why``, given once
        per sender and round) and whether the message is to be ignored. ``mine``: this peer's
        group, if it has one; ``may_be_earlier``: an earlier process of this peer may have joined
        the round (it gave the round up before reaching it); ``ran_mine``: the sender has sent this
        peer a slice of that group.

        - A list that puts this peer first, which it never decided (a member handing out groups
          of one to split θ̄, or making a peer fail rounds it has not reached): never adopted. Its
          sender is blamed only if it is named in it (an honest member holds a list naming itself
          only from that list's leader: this peer). A GROUP with it is ignored; a FETCH or a
          delivery is still answered (its sender may be a victim asking for the average).
        - A GROUP naming this peer from its own first member, which this peer never joined:
          ignored whole, and its sender blamed.
        - A sender first in line in two different groups of the round: blamed.
        - A list the sender leads, from a member that has sent this peer a slice of its group (an
          honest peer leads no group once it runs another): ignored, and its sender blamed. It
          runs ours: taking its word that it is elsewhere would fail our group's round on this
          peer while the liar completes it and hands the average on."""
        members: Members = getattr(msg, "members", ())
        if not members or members == mine:
            return Judgement("", ignore=False)
        first = self.first(members)
        if first == self.me:
            named = any(peer == sender for peer, _ in members)
            return self._blame(sender, FORGED_LEAD if named else "", ignore=msg.code == Code.GROUP)
        if first != sender:
            return Judgement("", ignore=False)
        pace: int = getattr(msg, "pace", 0)
        said = self.led.setdefault(sender, (members, pace))
        unasked = (
            msg.code == Code.GROUP
            and self.names_me(members)
            and sender not in self.joined
            and not may_be_earlier
        )
        if unasked:
            return self._blame(sender, "a group of the round naming this peer, which never joined it", True)
        if ran_mine:
            return self._blame(sender, "a group of the round it leads, while it runs this peer's", True)
        if said != (members, pace):
            return self._blame(sender, "two different groups of the round, each led by itself", False)
        return Judgement("", ignore=False)

    def _blame(self, sender: str, why: str, ignore: bool) -> Judgement:
        if not why or sender in self.blamed:
            return Judgement("", ignore)
        self.blamed.add(sender)
        return Judgement(why, ignore)

    def may_adopt(self, sender: str, members: Members) -> bool:
        """Whether a list may become this peer's group (the machine is forming): one that names
        this peer only from its leader's own word, and only a leader this process joined; one that
        does not name it, from anyone."""
        return not self.names_me(members) or (self.first(members) == sender and sender in self.joined)

    def leads_both(self, sender: str, group: GroupKey, mine: GroupKey) -> bool:
        """Whether ``sender``, which this process joined, leads both this member's group ``mine``
        and another list of the round it just sent (so it lied)."""
        led = self.first(group[0]) == sender == self.first(mine[0])
        return group != mine and led and sender in self.joined

    def prefers(self, group: GroupKey, mine: GroupKey, reduced: bool) -> bool:
        """Whether a member leaves ``mine`` for ``group``, another list of its lying leader: the
        ``preferred`` one that names this peer, if it has not ``reduced`` its slice in ``mine``
        (otherwise it stays: ``group`` can then never complete, and ``mine`` may)."""
        return not reduced and self.names_me(group[0]) and preferred(group, mine) == group

    def outranked(self, group: GroupKey, mine: GroupKey) -> bool:
        """Whether ``group``, another list of this peer's leader (relayed by a member, or sent by
        the leader), is the one its honest members leave for ``mine``: no reason to give up ours."""
        return self.first(group[0]) == self.first(mine[0]) and preferred(group, mine) == mine != group
