"""Handing the swarm's state to a joiner (``swarm/state_transfer.py``): packing is exact, a donor's
manifest is checked at one boundary, and over real hivemind streams on 127.0.0.1 a joiner gets the
state of the asked step from several donors, re-fetches a chunk a donor corrupted, retries further
ahead when the donors are past the asked step, and refuses donors that disagree."""

from __future__ import annotations

import asyncio
import copy

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_cocodc.swarm.state_transfer import (
    UNANSWERED_PAUSES_S,
    Snapshot,
    StateServer,
    StateUnavailable,
    _ask,
    make_snapshot,
    parse_manifest,
    pull_state,
    unpack,
)
from p2p_cocodc.swarm.wire import BadMessage
from tests.local_dhts import local_dhts

LAST = 20  # the donors' run ends at this step (--steps)


def sample_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "strategy": {
            "outer": [
                {"global_params": torch.randn(1000, generator=g), "momentum": torch.randn(1000, generator=g)},
                {"global_params": torch.randn(3, 5, generator=g), "momentum": torch.zeros(0)},
            ],
            "schedule": {"last_send": [3, 7], "sent": [True, False], "last_rms": [0.1 + 1e-17, float("inf")]},
            "in_flight": [{"fragment": 1, "sent_step": 7, "due_step": 19}],
        },
        "versions": [4, 2],
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(3.25, dtype=torch.float64),
    }


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))  # bits
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b and type(a) is type(b)


def wire(manifest: dict) -> dict:
    """The manifest as a joiner receives it: through msgpack."""
    return msgpack.unpackb(msgpack.packb(manifest, use_bin_type=True), raw=False)


def test_a_snapshot_unpacks_to_the_same_state_bit_for_bit() -> None:
    state = sample_state()
    snapshot = make_snapshot(12, state, chunk_bytes=1024)
    manifest = parse_manifest(wire(snapshot.manifest), 12)
    assert len(manifest["chunks"]) == -(-len(snapshot.blob) // 1024) > 1
    blob = b"".join(snapshot.chunk(i) for i in range(len(manifest["chunks"])))
    assert_same(state, unpack(manifest, blob))
    other = make_snapshot(12, sample_state(1))
    assert other.manifest["digest"] != make_snapshot(12, state).manifest["digest"]


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda m: m.update(step=13), "of step 13"),
        (lambda m: m["tensors"][0].__setitem__(0, "complex64"), "known dtype"),
        (lambda m: m.update(size=m["size"] + 4), "'size'"),
        (lambda m: m["chunks"].append("0" * 64), "'chunks' must list"),
        (lambda m: m.update(chunk_bytes=0), "'chunk_bytes'"),
        (lambda m: m["skeleton"]["versions"].append({"__tensor__": 99}), "points past"),
        (lambda m: m["skeleton"].update(deep=[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]), "too deeply"),
        (lambda m: m["chunks"].__setitem__(0, "f" * 64), "digest"),
        (lambda m: m.pop("digest"), "keys"),
    ],
)
def test_a_bad_manifest_is_refused_with_what_is_wrong(change, error: str) -> None:
    manifest = wire(make_snapshot(12, sample_state(), chunk_bytes=1024).manifest)
    change(manifest)
    with pytest.raises(BadMessage, match=error):
        parse_manifest(manifest, 12)


values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(values)
def test_any_value_as_a_manifest_is_refused_without_a_crash(value) -> None:
    with pytest.raises(BadMessage):
        parse_manifest(value, 0)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.sampled_from(["step", "size", "chunk_bytes", "tensors", "chunks", "skeleton"]), values)
)
def test_a_manifest_with_hostile_fields_is_refused_without_a_crash(fields) -> None:
    manifest = wire(make_snapshot(0, sample_state(), chunk_bytes=1024).manifest)
    manifest.update(fields)
    try:
        parse_manifest(manifest, 0)
    except BadMessage:
        return
    assert not fields or all(manifest[k] == v for k, v in fields.items())


# ---- over real streams ----


@pytest.fixture
def dhts():
    with local_dhts(4) as nodes:
        yield nodes


class Donor:
    """A state server whose training is driven by the test: ``finish(step)`` ends a step."""

    def __init__(self, p2p, state: dict) -> None:
        self.step = 0
        self.state = state
        self.server = StateServer(
            p2p, "t", "fp", lambda: self.step, lambda: copy.deepcopy(self.state), LAST, chunk_bytes=1024
        )

    def finish(self, step: int) -> None:
        self.step = step
        self.server.step_done(step)


async def start_donors(dhts, states: list[dict]) -> tuple[object, list[Donor]]:
    p2ps = [await d.replicate_p2p() for d in dhts[: len(states) + 1]]
    donors = [Donor(p2p, state) for p2p, state in zip(p2ps[1:], states, strict=True)]
    for donor in donors:
        await donor.server.start()
    return p2ps[0], donors


async def asked(donors: list[Donor], step: int, within_s: float = 60.0) -> None:
    """Until every donor has been asked for its state at ``step`` (no wall-clock ordering; the bound
    only ends a test that would hang: 10 s ran out once in CI, the machine loaded by the other worker)."""
    deadline = asyncio.get_running_loop().time() + within_s
    while not all(step in d.server.snapshots for d in donors):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"the donors were not asked for step {step}")
        await asyncio.sleep(0.01)


async def train_until(donors: list[Donor], step: int) -> None:
    """The donors finish steps one by one (each one a scheduling point for the servers)."""
    while any(d.step < step for d in donors):
        for donor in donors:
            if donor.step < step:
                donor.finish(donor.step + 1)
        await asyncio.sleep(0.01)


async def shutdown(joiner, donors: list[Donor]) -> None:
    for donor in donors:
        await donor.server.stop()
        await donor.server.p2p.shutdown()
    await joiner.shutdown()


def with_donors(dhts, states: list[dict], body) -> None:
    """Run ``body(joiner, donors)`` with one donor per state, and shut everything down after."""

    async def main() -> None:
        joiner, donors = await start_donors(dhts, states)
        try:
            await body(joiner, donors)
        finally:
            await shutdown(joiner, donors)

    asyncio.run(main())


def ids(donors: list[Donor]) -> list[str]:
    return [d.server.p2p.peer_id.to_base58() for d in donors]


def test_a_joiner_takes_the_asked_step_from_several_donors(dhts) -> None:
    async def body(joiner, donors: list[Donor]) -> None:
        pulling = asyncio.ensure_future(
            pull_state(joiner, "t", "fp", ids(donors), step=5, step_time_s=1e3, last=LAST)
        )
        await asked(donors, 5)
        await train_until(donors, 8)
        pulled = await pulling
        assert pulled.step == 5 and sorted(pulled.donors) == sorted(ids(donors))
        assert_same(sample_state(), pulled.state)
        served = [d.server.served_bytes for d in donors]
        assert all(n > 0 for n in served) and sum(served) >= pulled.num_bytes, served

    with_donors(dhts, [sample_state(), sample_state()], body)


def test_a_corrupted_chunk_is_taken_from_another_donor(dhts) -> None:
    async def body(joiner, donors: list[Donor]) -> None:
        liar = donors[0].server
        liar.snapshots[3] = asyncio.get_running_loop().create_future()
        good = make_snapshot(3, sample_state(), chunk_bytes=1024)
        bad = bytearray(good.blob)
        for i in range(0, len(bad), 1024):
            bad[i] ^= 0xFF  # the right manifest, and one flipped byte in every chunk
        liar.copied.add(3)
        liar.snapshots[3].set_result(Snapshot(good.manifest, bytes(bad)))
        pulling = asyncio.ensure_future(
            pull_state(joiner, "t", "fp", ids(donors), step=3, step_time_s=1e3, last=LAST)
        )
        await asked(donors[1:], 3)
        await train_until(donors, 3)
        pulled = await pulling
        assert_same(sample_state(), pulled.state)
        assert donors[1].server.served_bytes >= pulled.num_bytes  # the honest donor served it all

    with_donors(dhts, [sample_state(), sample_state()], body)


def test_donors_past_the_step_make_the_joiner_ask_further_ahead(dhts) -> None:
    async def body(joiner, donors: list[Donor]) -> None:
        await train_until(donors, 10)
        pulling = asyncio.ensure_future(
            pull_state(joiner, "t", "fp", ids(donors), step=4, step_time_s=1e3, last=LAST)
        )
        await asked(
            donors, 13
        )  # refused at 4 (they are at 10): asked again at 10 + 2 + 1 (a round trip of a step)
        await train_until(donors, 14)
        pulled = await pulling
        assert pulled.step == 13

    with_donors(dhts, [sample_state(), sample_state()], body)


def test_donors_faster_than_the_board_says_are_caught_by_a_doubling_margin(dhts) -> None:
    """The board says a step takes 1000 s, but the donors are 4 steps further at every look (a fast
    run on a loaded machine, whose record is old). The joiner's margin doubles with every ask that
    came too late (3, then 6 steps), so its third ask is ahead of them. A margin that stayed at 3
    steps was behind them at every ask (1, 7, 11, 15) and gave up: "the donors kept moving past the
    asked step"."""

    def moving(donor: Donor) -> None:
        """Each ask for a manifest finds ``donor`` 4 steps further."""
        original = donor.server._manifest

        async def manifest(step: int) -> dict:
            donor.step += 4
            return await original(step)

        donor.server._manifest = manifest  # type: ignore[method-assign]

    async def body(joiner, donors: list[Donor]) -> None:
        for donor in donors:
            moving(donor)
        pulling = asyncio.ensure_future(
            pull_state(joiner, "t", "fp", ids(donors), step=1, step_time_s=1e3, last=LAST)
        )
        await asked(donors, 14)  # past at 1 (they are at 4) and at 7 (at 8); then 8 + 2 × 3
        await train_until(donors, 14)
        pulled = await pulling
        assert pulled.step == 14

    with_donors(dhts, [sample_state(), sample_state()], body)


def test_a_donor_drops_a_copy_no_joiner_downloads_for_a_newer_ask(dhts) -> None:
    """Donor a keeps being past the asked step, donor b behind it: b copied its state for each ask
    (steps 2 and 9), which the joiner left for a further step as a was past. b used to refuse the
    third ("already holds copies of its state for other joiners") and the joiner failed, as a peer
    coming back on `thin` did; b now drops the oldest copy nobody downloads."""

    async def body(joiner, donors: list[Donor]) -> None:
        a, b = donors
        await train_until([a], 6)
        await train_until([b], 1)
        pulling = asyncio.ensure_future(
            pull_state(joiner, "t", "fp", ids(donors), step=2, step_time_s=1e3, last=LAST)
        )
        await asked([b], 2)  # a, at 6, said it is past 2
        await train_until([a], 11)  # past the next ask, 6 + 3, too
        await train_until([b], 2)
        await asked([b], 9)
        await train_until([b], 9)
        await asked(donors, 17)  # 11 + 2 × 3 (a second late ask): b holds copies of 2 and 9,
        assert 2 not in b.server.snapshots  # which nobody downloads
        await train_until(donors, 17)
        pulled = await pulling
        assert pulled.step == 17 and sorted(pulled.donors) == sorted(ids(donors))
        assert_same(sample_state(), pulled.state)

    with_donors(dhts, [sample_state(), sample_state()], body)


def test_a_joiner_asks_no_step_past_the_runs_last(dhts) -> None:
    """Asked past the run's end (a board step plus a margin), the joiner takes the state at the run's last
    step: a donor never waits for a step its run does not reach."""

    async def body(joiner, donors: list[Donor]) -> None:
        await train_until(donors, 15)
        pulling = asyncio.ensure_future(
            pull_state(joiner, "t", "fp", ids(donors), step=40, step_time_s=1e3, last=LAST)
        )
        await asked(donors, LAST)
        await train_until(donors, LAST)
        pulled = await pulling
        assert pulled.step == LAST
        refused = await _ask(
            joiner, "t", ids(donors)[0], {"want": "manifest", "step": LAST + 1, "fingerprint": "fp"}
        )
        assert isinstance(refused, dict) and refused["ok"] is False, refused
        assert refused["detail"] == f"the run ends at step {LAST}", refused

    with_donors(dhts, [sample_state(), sample_state()], body)


def test_a_joiner_after_the_runs_last_step_is_told_the_run_ended(dhts) -> None:
    async def body(joiner, donors: list[Donor]) -> None:
        await train_until(donors, LAST)
        with pytest.raises(StateUnavailable, match=rf"the run ended \(step {LAST}\)"):
            await pull_state(joiner, "t", "fp", ids(donors), step=12, step_time_s=1e3, last=LAST)

    with_donors(dhts, [sample_state(), sample_state()], body)


def test_a_donor_that_could_not_be_asked_is_asked_again_after_a_pause(dhts) -> None:
    """One of two donors does not answer the first ask (its server is not up: as when a dial fails
    under load): the joiner waits ``UNANSWERED_PAUSES_S[0]`` on its clock, asks both again, and
    takes the state from both. Asked again at once, it gave up within a second (test_hostile, once)."""

    async def main() -> None:
        joiner, (ready,) = await start_donors(dhts, [sample_state()])
        late = Donor(await dhts[2].replicate_p2p(), sample_state())
        donors = [ready, late]
        pauses: list[float] = []

        async def pause(seconds: float) -> None:  # the joiner's clock: the late donor is up when it ends
            pauses.append(seconds)
            await late.server.start()

        try:
            pulling = asyncio.ensure_future(
                pull_state(joiner, "t", "fp", ids(donors), step=2, step_time_s=1e3, last=LAST, pause=pause)
            )
            await asked([ready], 2)
            await train_until([ready], 2)  # it answers; the late donor's ask failed
            await asked([late], 2)  # asked again, after the pause
            await train_until([late], 2)
            pulled = await pulling
            assert pauses == [UNANSWERED_PAUSES_S[0]]
            assert sorted(pulled.donors) == sorted(ids(donors)) and pulled.step == 2
            assert_same(sample_state(), pulled.state)
        finally:
            await shutdown(joiner, donors)

    asyncio.run(main())


def test_a_donor_that_never_answers_ends_the_pull_after_every_pause(dhts) -> None:
    async def main() -> None:
        joiner, (ready,) = await start_donors(dhts, [sample_state()])
        silent = await dhts[2].replicate_p2p()  # no state server: every ask to it fails
        pauses: list[float] = []

        async def pause(seconds: float) -> None:
            pauses.append(seconds)

        try:
            donors = [*ids([ready]), silent.peer_id.to_base58()]
            pulling = asyncio.ensure_future(pull_state(joiner, "t", "fp", donors, 2, 1e3, LAST, pause=pause))
            await asked([ready], 2)
            await train_until([ready], 2)
            gave_up = r"fewer than 2 donors gave their state, asked 4 times"
            with pytest.raises(StateUnavailable, match=gave_up):
                await asyncio.wait_for(pulling, 60)
            assert pauses == list(UNANSWERED_PAUSES_S)
        finally:
            await silent.shutdown()
            await shutdown(joiner, [ready])

    asyncio.run(main())


def test_donors_that_disagree_are_refused(dhts) -> None:
    async def body(joiner, donors: list[Donor]) -> None:
        pulling = asyncio.ensure_future(
            pull_state(joiner, "t", "fp", ids(donors), step=2, step_time_s=1e3, last=LAST)
        )
        await asked(donors, 2)
        await train_until(donors, 2)
        with pytest.raises(StateUnavailable, match="split"):
            await pulling

    with_donors(dhts, [sample_state(0), sample_state(1)], body)
