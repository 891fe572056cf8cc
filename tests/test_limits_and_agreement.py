"""Per-remote-peer limits and the θ̄ agreement check: pure bookkeeping, driven by a made-up clock
and made-up boards."""

from __future__ import annotations

from p2p_cocodc.swarm.agreement import Agreement
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


def test_peers_that_agree_raise_nothing_and_unknown_steps_are_not_compared() -> None:
    mine = agreement(s48="aa", s96="bb")
    assert mine.compare({"p": (48, "aa"), "q": (96, "bb"), "r": (144, "zz"), "s": (12, "zz")}) == []
    assert mine.latest() == (96, "bb")


def test_a_peer_in_the_minority_is_behind_and_one_in_the_majority_names_the_split_one() -> None:
    behind = agreement(s48="xx").compare({"p": (48, "aa"), "q": (48, "aa")})
    assert len(behind) == 1 and behind[0].behind and behind[0].settled and behind[0].disputed == ("p", "q")
    ahead = agreement(s48="aa").compare({"p": (48, "aa"), "q": (48, "xx")})
    assert ahead[0].settled and not ahead[0].behind and ahead[0].disputed == ("q",)


def test_a_tie_settles_nothing() -> None:
    (two,) = agreement(s48="aa").compare({"p": (48, "xx")})
    assert not two.settled and not two.behind and two.disputed == ("p",)
    (four,) = agreement(s48="aa").compare({"p": (48, "aa"), "q": (48, "xx"), "r": (48, "xx")})
    assert not four.settled and four.disputed == ("q", "r")


def test_only_the_latest_digests_are_kept_and_forget_drops_them() -> None:
    mine = Agreement()
    for step in range(100):
        mine.record(step, f"{step:016x}")
    assert len(mine.mine) == 16 and mine.latest() == (99, f"{99:016x}")
    assert mine.compare({"p": (10, "zz")}) == []  # too old to compare
    mine.forget()
    assert mine.latest() == (-1, "")
