"""The lobby's admission rules (``peer/lobby.py``), decided on made-up boards: no DHT, no clock."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_cocodc.errors import UserError
from p2p_cocodc.peer import lobby
from p2p_cocodc.peer.lobby import Donors, Join, Left, Mismatch, Seat, Start, Wait, admit


@dataclass(frozen=True)
class R:
    """A made-up board record: only the fields the lobby reads."""

    state: str = "waiting"
    step: int = 0
    shard: int | None = None
    fingerprint: str = "fp"
    key_id: str = "open"
    resume_step: int = -1
    proposed_shape: tuple[int, ...] = ()
    sync_shape: tuple[int, ...] = ()
    starting_pace: int = 0


ME = "bbb"
SEAT = Seat(
    peer_id=ME, run_id="r", fingerprint="fp", key_id="open", is_open=True, workers=3, data_shards=4, steps=100
)


def seat(**changes: object) -> Seat:
    return replace(SEAT, **changes)  # type: ignore[arg-type]


def t(step: int = 0, **fields: object) -> R:
    return R(state="training", step=step, **fields)  # type: ignore[arg-type]


def decide(view: dict[str, R], me: Seat = SEAT, first: dict[str, int] | None = None) -> lobby.Admission:
    return admit(view, me, first or {})[0]


def watched(views: list[dict[str, R]], me: Seat = SEAT) -> lobby.Admission:
    """The decision after looking at each board in turn (the steps first seen carried along)."""
    first: dict[str, int] = {}
    for view in views:
        decision, first = admit(view, me, first)
    return decision


# ---- starting together ----

W = R()  # a waiting peer without a shard
START_CASES = {
    "exactly --workers": ({"aaa": W, ME: W, "ccc": W}, SEAT, Start(1, None, ("aaa", ME, "ccc"))),
    "first in id order": ({"ccc": W, ME: W, "ddd": W}, SEAT, Start(0, None, ("bbb", "ccc", "ddd"))),
    "others' --shard skipped": (
        {"aaa": R(shard=0), ME: W, "ccc": W},
        SEAT,
        Start(1, None, ("aaa", ME, "ccc")),
    ),
    "settled peers not counted": (
        {"aaa": R(shard=1), ME: W, "ccc": W},
        SEAT,
        Start(0, None, ("aaa", ME, "ccc")),
    ),
    "--shard kept": ({"aaa": W, ME: W, "ccc": W}, seat(shard=2), Start(2, None, ("aaa", ME, "ccc"))),
    "own stale record's shard not kept": (
        {"aaa": W, ME: R(shard=0), "ccc": W},
        SEAT,
        Start(1, None, ("aaa", ME, "ccc")),
    ),
    "training peers at step 0 count": (
        {"aaa": t(), ME: W, "ccc": t()},
        SEAT,
        Start(1, None, ("aaa", ME, "ccc")),
    ),
    "a finished peer's shard is free": (
        {"aaa": W, ME: W, "ccc": W, "ddd": R(state="done", shard=0)},
        seat(shard=0),
        Start(0, None, ("aaa", ME, "ccc")),
    ),
    "strangers ignored": (
        {"aaa": W, ME: W, "ccc": W, "zzz": R(fingerprint="other")},
        SEAT,
        Start(1, None, ("aaa", ME, "ccc")),
    ),
    "too few": ({"aaa": W, ME: W}, SEAT, Wait("only 2 of --workers 3 peers joined", ("aaa", ME))),
    "not on the board yet": (
        {"aaa": W, "ccc": W, "ddd": W},
        SEAT,
        Wait("only 3 of --workers 3 peers joined", ("aaa", "ccc", "ddd")),
    ),
    "joining and leaving peers are not live": (
        {"aaa": R(state="joining"), ME: W, "ccc": R(state="leaving")},
        SEAT,
        Wait("only 1 of --workers 3 peers joined", (ME,)),
    ),
}


@pytest.mark.parametrize("view, me, expected", START_CASES.values(), ids=START_CASES.keys())
def test_start(view: dict[str, R], me: Seat, expected: lobby.Admission) -> None:
    assert decide(view, me) == expected


ERROR_CASES = {
    "shard already taken": (
        {"aaa": R(shard=2), ME: W, "ccc": W},
        seat(shard=2),
        "--shard 2/4 is already read by peer aaa, which is waiting for this run: this region's peer is "
        "probably already running (the same profile started twice); stop this one, or give it another "
        "--shard",
    ),
    "shard read by a leaving peer": (
        {"aaa": t(5, shard=0), "ccc": R(state="leaving", step=5, shard=2)},
        seat(shard=2),
        "--shard 2/4 is already read by peer ccc, which is leaving this run",
    ),
    "too many peers": (
        {"aaa": W, ME: W, "ccc": W, "ddd": W},
        SEAT,
        "4 peers joined run 'r' but --workers is 3: give every peer the same --workers",
    ),
    "fresh while others resume": (
        {"aaa": R(resume_step=8), ME: R(resume_step=10), "ccc": W},
        seat(resume_step=10),
        "peers ccc start run 'r' afresh while others resume it: start every peer with --resume",
    ),
    "this one fresh while others resume": (
        {"aaa": R(resume_step=8), ME: W, "ccc": R(resume_step=8)},
        SEAT,
        "peers bbb start run 'r' afresh while others resume it",
    ),
    "open peer among keyed ones": (
        {"aaa": R(key_id="k1"), ME: W},
        SEAT,
        "run 'r' admits only holders of its swarm key or of its owner's certificate (key id k1)",
    ),
    "ddp under way": (
        {"aaa": t(5), ME: W},
        seat(can_take_state=False),
        "run 'r' is under way, and a ddp run cannot take a peer in progress: use another --run-id",
    ),
    "run full": (
        {"aaa": t(5, shard=0), ME: W, "ccc": t(5, shard=1)},
        seat(data_shards=2, workers=2),
        "run 'r' is full: its peers read all 2 data shards (--max-peers 2); wait for a peer to leave",
    ),
    "joiner's --shard taken": (
        {"aaa": t(5, shard=3), ME: W},
        seat(shard=3),
        "--shard 3/4 is already read by peer aaa, which is training in this run: this region's peer",
    ),
}


@pytest.mark.parametrize("view, me, message", ERROR_CASES.values(), ids=ERROR_CASES.keys())
def test_refused(view: dict[str, R], me: Seat, message: str) -> None:
    moved = {p: replace(r, step=r.step + 1) if r.state == "training" else r for p, r in view.items()}
    with pytest.raises(UserError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        watched([view, moved], me)


# ---- the same profile started twice: a shard clash ----

CLASH_LINE = (
    "--shard 0/4 is already read by peer {}, which is {}: this region's peer is probably already "
    "running (the same profile started twice); stop this one, or give it another --shard (a peer "
    "stopped a moment ago leaves the board within seconds)"
)


def refused(view: dict[str, R], me: Seat, first: dict[str, int] | None) -> str | None:
    """The line ``admit`` refuses this peer with; None where it is not refused."""
    try:
        admit(view, me, first)
    except UserError as error:
        return str(error)
    return None


def test_the_newcomer_is_refused_on_its_first_look_and_the_peer_there_first_waits_on() -> None:
    for first_peer in ("aaa", "ccc"):  # on the board before the newcomer, bbb, looked: its id before, after
        board = {first_peer: R(shard=0)}
        assert refused(board, seat(shard=0), None) == CLASH_LINE.format(first_peer, "waiting for this run")
        # refused before its record is on the board: the peer that was there first never sees it
        assert decide(board, seat(peer_id=first_peer, shard=0)) == Wait(
            "only 1 of --workers 3 peers joined", (first_peer,)
        )
    # a training peer is never refused: the waiting one is, on any look
    training = CLASH_LINE.format("aaa", "training in this run")
    assert refused({"aaa": t(5, shard=0)}, seat(shard=0), {}) == training
    assert refused({ME: R(shard=0)}, seat(shard=0), None) is None  # its own identity's stale record
    assert refused({"aaa": R(shard=0, fingerprint="x"), "ccc": W}, seat(shard=0), None) is None  # a stranger


def test_peers_that_missed_each_other_on_their_first_looks_leave_exactly_one() -> None:
    board = {"aaa": R(shard=0), ME: R(shard=0), "ccc": W}
    # the one whose id sorts last is refused; the other counts it out of the run and waits on
    assert refused(board, seat(shard=0), {}) == CLASH_LINE.format("aaa", "waiting for this run")
    assert decide(board, seat(peer_id="aaa", shard=0)) == Wait(
        "only 2 of --workers 3 peers joined", ("aaa", "ccc")
    )
    # and so does a third peer: the split it starts with leaves the refused one out
    full = {**board, "ddd": W}
    assert decide(full, seat(peer_id="ccc")) == Start(1, None, ("aaa", "ccc", "ddd"))
    assert decide(full, seat(peer_id="aaa", shard=0)) == Start(0, None, ("aaa", "ccc", "ddd"))
    # a waiting peer clashing with a training one is counted out, sorting first or not
    assert decide({"aaa": R(shard=0), ME: W, "ccc": t(shard=0)}) == Wait(
        "only 2 of --workers 3 peers joined", (ME, "ccc")
    )
    # a training peer is not in the lobby: never counted out, even beside another on its shard
    assert decide({"aaa": t(shard=0), ME: W, "ccc": t(shard=0)}) == Start(1, None, ("aaa", ME, "ccc"))


def start_twice(order: str) -> set[str]:
    """Two peers of one profile (--shard 0) in a run of --workers 3: each takes its first look
    (``l``), then publishes its record (``p``), in ``order`` ("a" is peer aaa's event, "c" peer
    ccc's: "clal…" means ccc looks first, then aaa); then both look again, twice. The peers refused."""
    board: dict[str, R] = {}
    gone: set[str] = set()
    events = iter(order)
    for who, event in zip(events, events, strict=True):
        peer = {"a": "aaa", "c": "ccc"}[who]
        if peer in gone:
            continue
        if event == "p":
            board[peer] = R(shard=0)
        elif refused(board, seat(peer_id=peer, shard=0), None) is not None:
            gone.add(peer)
    for _ in range(2):  # a refused peer's record stays on the board until it lapses
        for peer in sorted(set(board) - gone):
            if refused(board, seat(peer_id=peer, shard=0), {}) is not None:
                gone.add(peer)
    return gone


@pytest.mark.parametrize(
    "order, expected",
    [
        ("alapclcp", {"ccc"}),  # ccc came after aaa was on the board: ccc
        ("clcpalap", {"aaa"}),  # aaa came after ccc: aaa, though its id sorts first
        ("alclapcp", {"ccc"}),  # both looked before either was on the board: the last id
        ("alclcpap", {"ccc"}),
        ("clalapcp", {"ccc"}),
        ("clalcpap", {"ccc"}),
    ],
)
def test_one_profile_started_twice_leaves_exactly_one_peer_and_the_one_there_first(
    order: str, expected: set[str]
) -> None:
    assert start_twice(order) == expected


# ---- resuming ----


def test_resume_from_the_smallest_common_step() -> None:
    view = {
        "aaa": R(resume_step=8, shard=0),
        ME: R(resume_step=10, shard=1),
        "ccc": R(resume_step=12, shard=2),
    }
    assert decide(view, seat(resume_step=10, shard=1)) == Start(1, 8, ("aaa", ME, "ccc"))


def test_dead_swarm_records_are_ignored_while_resuming() -> None:
    dead = {"aaa": t(12, shard=0), "ccc": t(12, shard=2)}  # killed past step 0, never resumed
    back = {"ddd": R(resume_step=10, shard=0), "eee": R(resume_step=10, shard=2)}
    me = seat(resume_step=10, shard=1)
    board = {**dead, **back, ME: R(resume_step=10, shard=1)}
    # their shards are not taken, and they are not a run under way, for as long as they don't move
    assert watched([board, board], me) == Start(1, 10, (ME, "ddd", "eee"))
    # a fresh peer sees a run under way that has not moved (yet)
    assert decide({**dead, ME: W}) == Wait("no training peer moved in")


def test_a_swarm_restarted_at_once_waits_out_the_killed_processes_records() -> None:
    """Every peer killed (a power cut) and started again with --resume within a record's lifetime,
    with the same identities: the board still holds the killed processes' records under their ids,
    ours among them, and one still at step 0 (killed before a heartbeat published a later step).
    They are neither peers starting afresh nor a run under way: wait until the restarted peers'
    own records replace them."""
    me = seat(workers=2, resume_step=32, shard=1)
    killed = {"aaa": t(0, shard=0), ME: t(40, shard=1)}
    assert isinstance(decide(killed, me), Wait)
    ours_first = {"aaa": t(0, shard=0), ME: R(resume_step=32, shard=1)}
    assert isinstance(watched([killed, ours_first], me), Wait)
    back = {"aaa": R(resume_step=32, shard=0), ME: R(resume_step=32, shard=1)}
    assert watched([killed, ours_first, back], me) == Start(1, 32, ("aaa", ME))


def test_a_moving_record_is_not_dead() -> None:
    me = seat(resume_step=10, shard=1)
    before = {"aaa": t(12, shard=0), ME: R(resume_step=10, shard=1)}
    after = {**before, "aaa": t(13, shard=0)}
    assert watched([before, after], me) == Join(1)  # the swarm went on: take its state, keep the shard


def test_resumed_training_peers_are_not_dead() -> None:
    view = {"aaa": t(10, resume_step=10), "ccc": t(10, resume_step=10), ME: R(resume_step=10)}
    # they train from their checkpoint of step 10 and wait at 10: not past their start
    assert decide(view, seat(resume_step=10)) == Start(1, 10, ("aaa", ME, "ccc"))


# ---- joining a run under way ----


def test_under_way_only_once_a_step_moved() -> None:
    view = {"aaa": t(5, shard=0), "ccc": t(5, shard=1), ME: W}
    first: dict[str, int] = {}
    decision, first = admit(view, SEAT, first)
    assert decision == Wait("no training peer moved in") and first == {"aaa": 5, "ccc": 5}
    decision, first = admit(view, SEAT, first)  # nothing moved
    assert decision == Wait("no training peer moved in")
    decision, first = admit({**view, "ccc": t(6, shard=1)}, SEAT, first)
    assert decision == Join(2) and first == {"aaa": 5, "ccc": 5}  # the first step seen is kept


JOIN_CASES = {
    "first free shard": ({"aaa": t(5, shard=0), "ccc": t(5, shard=1)}, SEAT, Join(2)),
    "--workers training at step 0 moving": ({"aaa": t(0), "ccc": t(0), "ddd": t(0)}, SEAT, Join(0)),
    "one peer past its start": ({"aaa": t(5, shard=1)}, SEAT, Join(0)),
    "--shard kept": ({"aaa": t(5, shard=0)}, seat(shard=3), Join(3)),
    "the identity's previous shard": (
        {"aaa": t(5, shard=0), ME: t(40, shard=3)},
        SEAT,
        Join(3),
    ),
    "previous shard now taken": (
        {"aaa": t(5, shard=3), ME: t(40, shard=3)},
        SEAT,
        Join(0),
    ),
    "finished peers read no shard": (
        {"aaa": t(5, shard=1), "ccc": R(state="done", step=9, shard=0)},
        SEAT,
        Join(0),
    ),
    "a resumer's checkpoint gives way": ({"aaa": t(20, shard=0)}, seat(resume_step=10, shard=2), Join(2)),
}


@pytest.mark.parametrize("view, me, expected", JOIN_CASES.values(), ids=JOIN_CASES.keys())
def test_join(view: dict[str, R], me: Seat, expected: lobby.Admission) -> None:
    moved = {
        p: replace(r, step=r.step + 1) if r.state == "training" and p != ME else r for p, r in view.items()
    }
    assert watched([view, moved], me) == expected


# ---- the odd one out ----


def test_other_options() -> None:
    view = {"aaa": R(fingerprint="x"), "ccc": R(fingerprint="y", state="training"), ME: W}
    assert decide(view) == Mismatch("aaa")
    ours = {"--lr": 0.001, "--seed": 0}
    error = lobby.mismatch_error(SEAT, "aaa", ours, {"aaa": {"options": {"--lr": 0.002, "--seed": 0}}})
    assert str(error) == (
        "peer aaa of run 'r' trains with other options (--lr 0.002 there, 0.001 here): start every peer "
        "with the same options (or profile), or pick another --run-id"
    )
    for infos in ({}, {"aaa": "junk"}, {"aaa": {"options": 3}}):  # nothing readable: no list
        assert "trains with other options: start" in str(lobby.mismatch_error(SEAT, "aaa", ours, infos))


def test_a_keyed_peer_among_open_ones_hears_of_other_options() -> None:
    keyed = seat(key_id="k2", is_open=False)
    assert decide({"aaa": R(), ME: R(key_id="k2")}, keyed) == Mismatch("aaa")
    assert decide({"aaa": R(key_id="k1"), ME: R(key_id="k2")}, keyed) == Mismatch("aaa")


@pytest.mark.parametrize(
    "view",
    [
        {},
        {ME: W},
        {"aaa": R(fingerprint="x", state="done"), ME: W},  # only live strangers count
        {"aaa": R(fingerprint="x"), "ccc": R(state="joining"), ME: W},  # one shares ours
    ],
)
def test_no_odd_one_out(view: dict[str, R]) -> None:
    assert lobby.odd_one_out(view, SEAT) is None


# ---- step 1, donors, steps left ----


STARTING_SET = ("aaa", ME, "ccc")


def test_started() -> None:
    started = lobby.started
    assert started({"aaa": t(), ME: t(), "ccc": W}, SEAT, STARTING_SET) == Wait("only 2 of 3 peers started")
    assert started({"aaa": t(), ME: t(), "ccc": t(), "zzz": t(fingerprint="x")}, SEAT, STARTING_SET) is None
    assert started({"aaa": t(), ME: t(), "ccc": t(key_id="k")}, SEAT, STARTING_SET) == Wait(
        "only 2 of 3 peers started"
    )


@pytest.mark.parametrize(
    "ccc",
    [None, R(state="done"), R(state="leaving")],
    ids=["record gone", "done", "leaving"],
)
def test_a_peer_of_the_starting_set_that_left_sends_the_others_back_to_the_lobby(ccc: R | None) -> None:
    view = {"aaa": t(), ME: t(), **({"ccc": ccc} if ccc is not None else {})}
    assert lobby.started(view, SEAT, STARTING_SET) == Left(("ccc",))
    # still there, though not training yet: wait for it; this peer's own record never counts as gone
    assert lobby.started({"aaa": t(), "ccc": W}, SEAT, STARTING_SET) == Wait("only 1 of 3 peers started")
    # --workers training (one came in its place): the run starts
    assert lobby.started({**view, "ddd": t()}, SEAT, STARTING_SET) is None


DONOR_VIEW = {
    "aaa": t(5),
    "ccc": t(7),
    "ddd": t(7),
    "eee": t(6),
    ME: t(9),  # never itself
    "fff": R(state="joining", step=9),
    "ggg": R(state="done", step=10),
    "hhh": t(50, fingerprint="x"),
}


@pytest.mark.parametrize(
    "distrusted, expected",
    [
        (set(), ["ccc", "ddd", "eee"]),
        ({"ccc"}, ["ddd", "eee", "aaa"]),
        ({"ccc", "ddd", "eee"}, ["aaa"]),
    ],
)
def test_donors(distrusted: set[str], expected: list[str]) -> None:
    assert lobby.choose_donors(DONOR_VIEW, SEAT, distrusted) == expected
    assert lobby.find_donors(DONOR_VIEW, SEAT, distrusted) == Donors(tuple(expected))


def test_no_donors() -> None:
    waiting = {ME: R(state="joining"), "aaa": R(state="joining"), "zzz": R(state="done", fingerprint="x")}
    assert lobby.find_donors(waiting, SEAT, set()) == Wait("no peer to take the swarm's state from in")
    assert lobby.find_donors({"aaa": t(5)}, SEAT, {"aaa"}) == Wait(
        "no peer to take the swarm's state from in"
    )
    with pytest.raises(UserError, match="^run 'r' has finished without this peer: no peer trains any more"):
        lobby.find_donors({**waiting, "ccc": R(state="done", step=100)}, SEAT, set())


def test_steps_left() -> None:
    lobby.check_steps_left(99, SEAT)
    with pytest.raises(UserError, match="^run 'r' is at step 100 of --steps 100: nothing left to train$"):
        lobby.check_steps_left(100, SEAT)


# ---- the real record, and purity ----


def test_board_records_fit() -> None:
    from p2p_cocodc.swarm.records import PeerRecord

    def record(state: str, shard: int | None) -> PeerRecord:
        return PeerRecord(state, 0, shard, 4, 0.0, 0.0, "fp")

    view = {"aaa": record("waiting", None), ME: record("waiting", None), "ccc": record("training", 0)}
    assert decide(view) == Start(2, None, ("aaa", ME, "ccc"))  # aaa and bbb take 1 and 2, in id order


def test_pure() -> None:
    code = (
        "import sys, p2p_cocodc.peer.lobby; "
        "print(sorted(m for m in ('asyncio', 'hivemind', 'torch', 'socket') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---- every peer of a board computes the same split ----


@st.composite
def boards(draw: st.DrawFn) -> tuple[dict[str, R], int, list[str]]:
    workers = draw(st.integers(1, 6))
    ids = draw(
        st.lists(
            st.text("abcdef0123", min_size=1, max_size=6), min_size=workers, max_size=workers, unique=True
        )
    )
    given_shards = draw(st.permutations(range(workers)))
    resumes = draw(st.one_of(st.none(), st.lists(st.integers(0, 50), min_size=workers, max_size=workers)))
    view: dict[str, R] = {}
    # a lone peer among strangers is odd, and one among done peers of its run comes after the run ended
    noises = ["done", "stranger"] if workers > 1 else []
    for i, noise in enumerate(draw(st.lists(st.sampled_from(noises), max_size=3)) if noises else []):
        shard = draw(st.one_of(st.none(), st.integers(0, 3)))  # a finished peer's shard is free again
        view[f"z{i}"] = R(state="done", shard=shard) if noise == "done" else R(fingerprint="x", shard=shard)
    for i, peer in enumerate(ids):
        view[peer] = R(
            state=draw(st.sampled_from(["waiting", "training"])),
            shard=given_shards[i] if draw(st.booleans()) else None,
            resume_step=resumes[i] if resumes is not None else -1,
        )
    return view, workers, ids


@settings(max_examples=300, deadline=None)
@given(boards())
def test_every_peer_starts_with_its_own_shard(board: tuple[dict[str, R], int, list[str]]) -> None:
    view, workers, peers = board
    decisions = {
        p: decide(
            view,
            seat(
                peer_id=p,
                workers=workers,
                shard=r.shard,
                resume_step=None if r.resume_step < 0 else r.resume_step,
            ),
        )
        for p, r in view.items()
        if p in peers  # the run's live peers (not the finished ones, nor strangers)
    }
    assert all(isinstance(d, Start) for d in decisions.values()), decisions
    starts = [d for d in decisions.values() if isinstance(d, Start)]
    assert sorted(d.shard for d in starts) == list(range(workers))
    assert all(d.shard == view[p].shard for p, d in decisions.items() if view[p].shard is not None)
    assert len({d.resume_step for d in starts}) == 1 and len({d.live for d in starts}) == 1
    steps = [view[p].resume_step for p in peers]
    assert starts[0].resume_step == (min(steps) if min(steps) >= 0 else None)


# ---- a run that ended before this peer came ----


def test_a_finished_run_says_so_and_keeps_its_id_as_long_as_a_done_record_lives() -> None:
    done = {"aaa": R(state="done", step=100, shard=0), "ccc": R(state="done", step=100, shard=1)}
    with pytest.raises(UserError, match=r"^run 'r' finished at step 100: choose a new --run-id") as caught:
        decide({**done, ME: W})
    assert "or --resume from a checkpoint" in str(caught.value)


def test_a_run_the_bootstrap_saw_end_is_refused_before_anything_is_set_up() -> None:
    ended = {"r": {"step": 100, "steps": 100, "at": 1.0}, "other": {"step": 5, "steps": 9, "at": 2.0}}
    with pytest.raises(UserError, match=r"^run 'r' finished at step 100: choose a new --run-id"):
        lobby.check_not_ended_at_bootstrap(ended, "r", 100)
    with pytest.raises(UserError, match=r"^run 'other' ended at step 5 of --steps 9 \(its peers left\)"):
        lobby.check_not_ended_at_bootstrap(ended, "other", 9)
    lobby.check_not_ended_at_bootstrap(ended, "new", 100)  # a run it never saw end: the board decides
    # the bootstrap's answer is untrusted: anything but a step is no end
    for hostile in (
        None,
        [],
        "r",
        {"r": None},
        {"r": {"step": True}},
        {"r": {"step": -1}},
        {"r": {"step": "9"}},
    ):
        lobby.check_not_ended_at_bootstrap(hostile, "r", 100)


def test_a_run_whose_peers_left_early_says_how_to_go_on() -> None:
    left = {"aaa": R(state="done", step=40), "ccc": R(state="done", step=38)}
    with pytest.raises(UserError, match=r"ended at step 40 of --steps 100 \(its peers left\): to go on"):
        decide({**left, ME: W})
    # the peers themselves, started again with --resume, go on
    assert isinstance(decide({**left, ME: R(resume_step=40)}, seat(resume_step=40)), Wait)


@pytest.mark.parametrize(
    "board",
    [
        {"aaa": R(state="done", step=100), "ccc": t(90)},  # one finished early, another trains
        {"aaa": R(state="done", step=100), "ccc": R(state="leaving", step=90)},  # one still leaving
        {"aaa": R(state="done", step=100, fingerprint="x"), "ccc": W},  # a stranger's done record
        {ME: R(state="done", step=100)},  # this identity's own record from an earlier run
    ],
)
def test_a_run_with_a_peer_still_in_it_or_only_a_stranger_done_is_not_ended(board: dict[str, R]) -> None:
    assert isinstance(decide({**board, ME: board.get(ME, W)}), Wait | Start | Join)


# ---- τ and N: --overlap auto / --transmissions auto agreed ----


def test_a_starting_set_takes_the_largest_overlap_and_the_fewest_sends_of_its_proposals() -> None:
    """Each peer worked τ and N out from its own link and step time; the starting set takes the
    largest τ and the fewest N, and every member computes the same from the same board whatever
    its own proposal, even once some of them already publish the agreed shape."""
    proposals = {"aaa": (3, 6), ME: (2, 8), "ccc": (4, 7)}
    view = {p: R(proposed_shape=shape) for p, shape in proposals.items()}
    live = tuple(sorted(view))
    assert {lobby.starting_shape(view, live, own) for own in proposals.values()} == {(4, 6)}
    # a peer of another starting set (here "ddd", not in live) is not asked
    assert lobby.starting_shape({**view, "ddd": R(proposed_shape=(7, 1))}, live, (2, 8)) == (4, 6)
    # once started, "aaa" also publishes what it trains with: its proposal still counts, unchanged
    started = {**view, "aaa": t(proposed_shape=(3, 6), sync_shape=(4, 6))}
    assert lobby.starting_shape(started, live, (2, 8)) == (4, 6)
    # an older peer's record without a proposal: only the proposals there count
    assert lobby.starting_shape({**view, "ccc": R()}, live, (2, 8)) == (3, 6)


def test_a_starting_set_takes_the_widest_pace_its_declared_links_ask_for() -> None:
    """The pace the run starts with is the largest any member of the starting set asks for (0: none
    asks, the schedule's own spacing), the same on every member whatever its own wish."""
    wishes = {"aaa": 48, ME: 0, "ccc": 72}
    view = {p: R(starting_pace=w) for p, w in wishes.items()}
    live = tuple(sorted(view))
    assert {lobby.starting_pace(view, live, own) for own in wishes.values()} == {72}
    assert lobby.starting_pace({**view, "ddd": R(starting_pace=96)}, live, 0) == 72  # not a starter
    assert lobby.starting_pace({p: R() for p in view}, live, 0) == 0


def test_a_joiner_takes_the_swarms_shape_not_its_own() -> None:
    """Its donors train with the agreed (τ, N): the joiner takes it, whatever its own proposal;
    none published (donors of an older version): None, and the joiner keeps its own."""
    view = {"aaa": t(5, proposed_shape=(1, 8), sync_shape=(4, 6)), "ccc": t(5, sync_shape=(4, 6))}
    assert lobby.swarm_shape(view, ["aaa", "ccc"]) == (4, 6)
    assert lobby.swarm_shape({"aaa": t(5), "ccc": t(5)}, ["aaa", "ccc"]) is None
