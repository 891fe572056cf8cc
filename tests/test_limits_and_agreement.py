"""Per-remote-peer limits and the θ̄ agreement check: pure bookkeeping, driven by a made-up clock
and made-up boards."""

from __future__ import annotations

from p2p_cocodc.swarm.agreement import KEEP, Agreement, Reported, in_doubt
from p2p_cocodc.swarm.limits import MAX_TRACKED, Limits, PeerLimiter


def test_a_peer_past_its_rate_is_refused_until_its_bucket_refills() -> None:
    limiter = PeerLimiter(Limits(messages_per_s=10.0, burst=5.0, streams=100))
    admitted = [limiter.admit("a", 0.0) is None for _ in range(8)]
    for _ in range(5):
        limiter.done("a")
    assert admitted == [True] * 5 + [False] * 3
    assert limiter.admit("b", 0.0) is None  # another peer has its own bucket
    assert limiter.admit("a", 0.05) is not None  # half a token later: still empty
    assert limiter.admit("a", 0.2) is None  # 0.2 s at 10/s refilled more than one


def test_streams_and_bytes_in_flight_are_bounded_per_peer_and_released() -> None:
    limiter = PeerLimiter(Limits(streams=2, buffered_bytes=100))
    assert limiter.admit("a", 0.0) is None and limiter.admit("a", 0.0) is None
    assert "at once" in (limiter.admit("a", 0.0) or "")
    assert limiter.reserve("a", 60) is None
    assert "bytes" in (limiter.reserve("a", 41) or "")
    assert limiter.reserve("b", 100) is None  # not a's budget
    limiter.done("a", 60)
    limiter.done("a")
    assert limiter.admit("a", 1.0) is None and limiter.reserve("a", 100) is None
    limiter.done("a", 100)
    assert not limiter.reading["a"] and not limiter.buffered["a"]


def test_refusals_are_counted_by_peer_and_only_some_are_logged() -> None:
    limiter = PeerLimiter(Limits())
    logged = [limiter.refuse("x") for _ in range(201)]
    assert [i for i, yes in enumerate(logged) if yes] == [0, 100, 200]
    limiter.refuse("y")
    assert limiter.worst(1) == {"x": 201}
    for i in range(MAX_TRACKED + 10):  # strangers with many ids cannot grow the tally without bound
        limiter.refuse(f"s{i}")
    assert len(limiter.refused) <= MAX_TRACKED


def agreement(**digests: str) -> Agreement:
    mine = Agreement()
    for step, digest in digests.items():
        mine.record(int(step[1:]), digest)
    return mine


def at(
    step: int, digest: str, now: int | None = None, joined_at: int = 0, training: bool = True, doubt: int = -1
) -> Reported:
    """A board record that holds ``digest`` for ``step`` and is at step ``now`` (``step`` if None)."""
    return Reported(step if now is None else now, {step: digest}, joined_at, training, doubt)


def test_peers_that_agree_raise_nothing_and_unknown_steps_are_not_compared() -> None:
    mine = agreement(s48="aa", s96="bb")
    assert mine.compare({"p": at(48, "aa"), "q": at(96, "bb"), "r": at(144, "zz"), "s": at(12, "zz")}) == []
    assert mine.latest() == (96, "bb") and mine.earlier() == [[48, "aa"]]


def test_a_peer_in_the_minority_is_behind_and_one_in_the_majority_names_the_split_one() -> None:
    behind = agreement(s48="xx").compare({"p": at(48, "aa"), "q": at(48, "aa")})
    assert len(behind) == 1 and behind[0].behind and behind[0].settled and behind[0].disputed == ("p", "q")
    ahead = agreement(s48="aa").compare({"p": at(48, "aa"), "q": at(48, "xx")})
    assert ahead[0].settled and not ahead[0].behind and ahead[0].disputed == ("q",)


def test_a_tie_settles_nothing() -> None:
    (two,) = agreement(s48="aa").compare({"p": at(48, "xx")})
    assert not two.settled and not two.behind and two.final and two.disputed == ("p",)
    (four,) = agreement(s48="aa").compare({"p": at(48, "aa"), "q": at(48, "xx"), "r": at(48, "xx")})
    assert not four.settled and four.final and four.disputed == ("q", "r")


def test_a_vote_still_to_come_keeps_the_verdict_open_and_a_majority_of_all_voters_settles_it() -> None:
    # p disagrees at 48; q has not reached 48 yet: no verdict is final, none is settled by 1 of 3
    (open_,) = agreement(s48="aa").compare({"p": at(48, "xx"), "q": at(40, "aa")})
    assert not open_.final and not open_.settled and not open_.behind
    # q past 48 without a digest of it: it joined after 48 and does not vote (a final tie), or its
    # digest of 48 slid out of its record (its vote is unknown: nothing is final)
    (tie,) = agreement(s48="aa").compare({"p": at(48, "xx"), "q": at(56, "cc", joined_at=50)})
    assert tie.final and not tie.settled
    (slid,) = agreement(s48="aa").compare({"p": at(48, "xx"), "q": at(56, "cc")})
    assert not slid.final and not slid.settled
    # a peer that is done at step 40 will never vote at 48
    (done,) = agreement(s48="aa").compare({"p": at(48, "xx"), "q": at(40, "aa", training=False)})
    assert done.final and not done.settled
    # two of four voters agree with p, one is pending: 2 of 4 is no strict majority yet; 3 of 4 is
    four = {"p": at(48, "xx"), "q": at(48, "xx"), "r": at(47, "zz", now=47)}
    (waiting,) = agreement(s48="aa").compare(four)
    assert not waiting.settled and not waiting.final
    (outvoted,) = agreement(s48="aa").compare({**four, "r": at(48, "xx")})
    assert outvoted.settled and outvoted.behind and outvoted.final


def test_every_peer_reaches_the_same_verdict_from_the_same_board() -> None:
    # three peers, one split off: whichever order their digests reached the board in, the two that
    # agree find themselves settled and the third behind, and each names the same split
    digests = {"a": "aa", "b": "aa", "c": "cc"}
    for me, mine in digests.items():
        others = {p: at(48, d) for p, d in digests.items() if p != me}
        (verdict,) = agreement(s48=mine).compare(others)
        assert verdict.settled and verdict.final and verdict.behind == (me == "c")
        assert dict(verdict.holders) == {
            "aa": tuple(sorted(p if p != me else "" for p in "ab")),
            "cc": ("" if me == "c" else "c",),
        }


def test_only_the_latest_digests_are_kept_and_forget_drops_them() -> None:
    mine = Agreement()
    for step in range(100):
        mine.record(step, f"{step:016x}")
    assert KEEP == 64 and len(mine.mine) == KEEP and mine.latest() == (99, f"{99:016x}")
    assert mine.earlier() == [[step, f"{step:016x}"] for step in range(92, 99)]
    assert mine.compare({"p": at(30, "zz")}) == []  # too old to compare
    assert mine.compare({"p": at(98, "zz"), "q": at(98, "zz")})[0].behind


def test_the_digests_of_a_split_stay_published_while_kept() -> None:
    """A drifter outvoted at step 8 resyncs and evaluates again: its digest of step 8 stays in its
    record (with the most recent ones beside it) until it is no longer kept, so a peer that reads
    the board late still sees the split (issue 19: an honest peer once recorded none)."""
    mine = agreement(s8="xx")
    assert mine.compare({"p": at(8, "aa"), "q": at(8, "aa")})[0].behind
    mine.resynced()
    for step in range(16, 16 + 8 * 12, 8):
        mine.record(step, f"{step:016x}")
    assert mine.latest()[0] == 104
    assert [step for step, _ in mine.earlier()] == [8, 56, 64, 72, 80, 88, 96]  # without the split: 48-96
    for step in range(112, 112 + 8 * KEEP, 8):  # once it is no longer kept, it is gone
        mine.record(step, f"{step:016x}")
    assert 8 not in mine.mine and 8 not in [step for step, _ in mine.earlier()]


def test_after_a_resync_the_old_digests_are_still_compared_but_never_make_it_resync_again() -> None:
    mine = agreement(s8="xx", s16="xx")
    assert mine.compare({"p": at(8, "aa"), "q": at(8, "aa")})[0].behind
    mine.resynced()
    (old,) = mine.compare({"p": at(8, "aa"), "q": at(8, "aa")})
    assert old.disputed == ("p", "q") and old.settled and not old.behind  # named, not acted on
    assert mine.latest() == (16, "xx")  # still published: the others see the split too
    mine.record(16, "bb")  # evaluated again after taking the state: a digest of the θ̄ it holds now
    assert mine.compare({"p": at(16, "aa"), "q": at(16, "aa")})[0].behind


def test_a_tie_goes_against_the_peers_in_doubt_and_a_strict_majority_of_them_still_wins() -> None:
    """A peer that settled a round undecided goes on as if it failed, its θ̄ in doubt from the step
    it applied nothing at. Two peers: the one that completed the round wins the tie, and the one in
    doubt takes its state (it does not distrust it). Five, the CI failure of issue 21: four honest
    peers in doubt outvote the one member that completed a group of one alone."""
    (sure,) = agreement(s48="aa").compare({"u": at(48, "xx", doubt=44)})
    assert sure.settled and not sure.behind and sure.by_doubt and sure.in_doubt == ("u",)
    doubting = agreement(s48="xx")
    doubting.doubt_from(44)
    (verdict,) = doubting.compare({"p": at(48, "aa")})
    assert verdict.settled and verdict.behind and verdict.by_doubt and verdict.in_doubt == ()
    # a digest of a step before the doubt is not in doubt: a tie there settles nothing
    (before,) = agreement(s40="aa").compare({"u": at(40, "xx", doubt=44)})
    assert not before.settled and before.final
    # both in doubt, apart: nobody knows
    both = agreement(s48="xx")
    both.doubt_from(44)
    (none,) = both.compare({"u": at(48, "yy", doubt=44)})
    assert not none.settled and none.final
    # four in doubt against the one that completed alone: the strict majority is theirs
    honest = {f"h{i}": at(48, "xx", doubt=44) for i in range(3)}
    mine = agreement(s48="xx")
    mine.doubt_from(44)
    (majority,) = mine.compare({**honest, "f": at(48, "ff")})
    assert majority.settled and not majority.behind and not majority.by_doubt
    (outvoted,) = agreement(s48="ff").compare({**honest, "h3": at(48, "xx", doubt=44)})
    assert outvoted.behind and not outvoted.by_doubt


def test_a_doubt_ends_when_the_votes_confirm_it_or_the_peer_resyncs_and_stays_published_for_old_digests() -> (
    None
):
    mine = agreement(s48="xx")
    mine.doubt_from(44)
    mine.doubt_from(46)  # a second undecided sync: the doubt still starts at the first
    assert mine.doubt == 44 and mine.doubting
    assert mine.compare({"p": at(48, "xx"), "q": at(40, "xx")}) == [] and mine.doubting  # q's vote to come
    assert mine.compare({"p": at(48, "xx"), "q": at(48, "xx")}) == [] and not mine.doubting
    assert mine.doubt == -1  # confirmed: nothing in doubt is published any more
    # resynced in doubt: its old digests stay in doubt for the others, up to the step it took the
    # state at (its new joined_at); its later ones are not in doubt
    resynced = agreement(s48="xx")
    resynced.doubt_from(44)
    assert resynced.compare({"p": at(48, "aa")})[0].behind
    resynced.resynced()
    assert resynced.doubt == 44 and not resynced.doubting
    record = Reported(56, {48: "xx", 56: "aa"}, joined_at=50, doubt=resynced.doubt)
    assert record.in_doubt(48) and not record.in_doubt(56) and not record.in_doubt(40)
    (old,) = agreement(s48="aa").compare({"r": record})
    assert old.settled and old.by_doubt and old.in_doubt == ("r",)  # no split left to stop for
    resynced.doubt_from(60)  # a new doubt after the resync starts afresh
    assert resynced.doubt == 60 and resynced.doubting
    # a joiner takes a donor's state of step 16 (``Peer._take_state``): in doubt if the donor's is
    assert in_doubt(12, 0, 16) and not in_doubt(12, 14, 16) and not in_doubt(-1, 0, 16)
