"""Untrusted notice-board records and state manifests at the points where they become data:
``trust.open_envelope``, ``trust.subkey_peer``, ``BoardValidator.why_invalid``, ``PeerRecord.from_wire``
and ``state_transfer.parse_manifest`` take arbitrary input without raising anything but their
documented refusal (None, a reason string, BadMessage), without hanging or allocating what a few
bytes announce, and what they accept is well-typed and bounded (hypothesis, derandomized)."""

from __future__ import annotations

import dataclasses
import math
import tracemalloc
from typing import Any

import msgpack
import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import P2P
from hivemind.utils import MSGPackSerializer, get_dht_time
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_cocodc.swarm import trust
from p2p_cocodc.swarm.records import (
    MAX_FRAGMENTS,
    MAX_LIFETIME_S,
    MAX_REGION,
    MAX_SYNC_SHAPE,
    MAX_TALLY,
    NONE_YET,
    REGION_CHARS,
    STATES,
    PeerRecord,
)
from p2p_cocodc.swarm.state_transfer import (
    DTYPES,
    MAX_CHUNKS,
    MAX_TENSORS,
    TENSOR_KEY,
    digest,
    make_snapshot,
    parse_manifest,
    unpack,
)
from p2p_cocodc.swarm.trust import BoardValidator, Envelope, Identity, Membership
from p2p_cocodc.swarm.wire import MAX_FRAME, BadMessage
from tests.test_message_fuzz import scalars, values  # any msgpack-able value: the same strategies

FUZZ = settings(max_examples=400, derandomize=True, deadline=None)
SLOW_FUZZ = settings(max_examples=150, derandomize=True, deadline=None)  # an RSA signature per example


def packed(obj: Any) -> bytes | None:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return None


# ---- envelopes and subkeys ----


def check_envelope(env: Envelope | None) -> None:
    if env is None:
        return
    assert isinstance(env, Envelope)
    limits = (
        (env.value, trust.MAX_VALUE_BYTES),
        (env.public_der, trust.MAX_KEY_BYTES),
        (env.proof, trust.MAX_PROOF_BYTES),
        (env.signature, trust.MAX_SIGNATURE_BYTES),
    )
    for field, limit in limits:
        assert type(field) is bytes and len(field) <= limit


@FUZZ
@given(st.binary(max_size=512))
def test_open_envelope_takes_arbitrary_bytes(raw: bytes) -> None:
    check_envelope(trust.open_envelope(raw))


PAST_A_LIMIT = st.sampled_from([trust.MAX_KEY_BYTES, trust.MAX_PROOF_BYTES, trust.MAX_VALUE_BYTES]).map(
    lambda n: bytes(n + 1)
)
envelope_fields = values | st.binary(max_size=64) | PAST_A_LIMIT
envelope_like = st.builds(
    lambda magic, rest: [magic, *rest],
    st.sampled_from([trust.MAGIC, b"p2c0", "p2c1", None]),
    st.lists(envelope_fields, min_size=3, max_size=5),
)


@FUZZ
@given(envelope_like | values, st.booleans())
def test_open_envelope_takes_arbitrary_structures(items: Any, bin_type: bool) -> None:
    try:
        raw = msgpack.packb(items, use_bin_type=bin_type)
    except (TypeError, ValueError, OverflowError):
        return
    env = trust.open_envelope(raw)
    check_envelope(env)
    if env is not None:  # raw=True: a msgpack str reads as the same bytes as a bin
        assert isinstance(items, list) and len(items) == 5 and items[0] in (trust.MAGIC, "p2c1")
        assert all(isinstance(x, bytes | str) for x in items)
    assert trust.open_envelope(items) is None  # only bytes are opened


@FUZZ
@given(st.binary(max_size=300) | values.map(packed).filter(lambda b: b is not None))
def test_subkey_peer_takes_arbitrary_bytes(raw: bytes) -> None:
    peer = trust.subkey_peer(raw)
    assert peer is None or (type(peer) is str and 0 < len(peer) <= trust.MAX_PEER_ID)


@FUZZ
@given(st.text(max_size=200))
def test_subkey_peer_reads_back_any_short_string(text: str) -> None:
    expected = text if 0 < len(text) <= trust.MAX_PEER_ID else None
    assert trust.subkey_peer(MSGPackSerializer.dumps(text)) == expected


# ---- the validator ----


@pytest.fixture(scope="module")
def writer(tmp_path_factory: pytest.TempPathFactory) -> BoardValidator:
    path = str(tmp_path_factory.mktemp("fuzz-id") / "writer.key")
    P2P.generate_identity(path)
    return BoardValidator(Identity.from_file(path), Membership())


@pytest.fixture(scope="module")
def reader(tmp_path_factory: pytest.TempPathFactory) -> BoardValidator:
    path = str(tmp_path_factory.mktemp("fuzz-id") / "reader.key")
    P2P.generate_identity(path)
    return BoardValidator(Identity.from_file(path), Membership(bytes(32)), protected=["p2p-cocodc.p.peers"])


expirations = (
    st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0, 1e308, -1e308])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.floats(-1000, 1000).map(lambda dt: get_dht_time() + dt)
)
keys = st.binary(max_size=40) | st.sampled_from(["p2p-cocodc.p.peers", "p2p-cocodc.runs"]).map(
    trust.dht_key_id
)
record_values = (
    st.binary(max_size=600)
    | values.map(packed).filter(lambda b: b is not None)
    | envelope_like.map(packed).filter(lambda b: b is not None)
)


def check_reason(validator: BoardValidator, record: DHTRecord) -> str | None:
    why = validator.why_invalid(record)
    assert why is None or (type(why) is str and why)
    assert validator.validate(record) == (why is None)
    return why


@SLOW_FUZZ
@given(keys, st.binary(max_size=200), record_values, expirations)
def test_arbitrary_records_are_refused_with_a_reason(
    reader: BoardValidator, key: bytes, subkey: bytes, value: bytes, expiration: float
) -> None:
    assert check_reason(reader, DHTRecord(key, subkey, value, expiration)) is not None


def signed(writer: BoardValidator, key: bytes, subkey: bytes, value: bytes, expiration: float) -> DHTRecord:
    record = DHTRecord(key, subkey, value, expiration)
    return dataclasses.replace(record, value=writer.sign_value(record))


subkeys = (
    st.just(None)  # the writer's own peer id
    | st.text(max_size=130).map(MSGPackSerializer.dumps)
    | st.binary(max_size=40)
)
inner_values = st.binary(max_size=200) | values.map(packed).filter(lambda b: b is not None)


def own(writer: BoardValidator, subkey: bytes | None) -> bytes:
    return MSGPackSerializer.dumps(writer.identity.peer_id) if subkey is None else subkey


@SLOW_FUZZ
@given(keys, subkeys, inner_values, expirations)
def test_a_signed_record_is_accepted_only_under_its_signers_subkey_and_within_the_bound(
    writer: BoardValidator, key: bytes, subkey: bytes | None, value: bytes, expiration: float
) -> None:
    record = signed(writer, key, own(writer, subkey), value, expiration)
    if check_reason(writer, record) is None:
        assert trust.subkey_peer(record.subkey) == writer.identity.peer_id
        assert writer.strip_value(record) == value
        assert not expiration - get_dht_time() > trust.MAX_EXPIRATION_S
    elif subkey is None and math.isfinite(expiration) and expiration < get_dht_time() + 200:
        # (a value readers cannot decode may also be refused)
        with pytest.raises(Exception):  # noqa: B017 - any decoding error
            MSGPackSerializer.loads(value)


@SLOW_FUZZ
@given(keys, inner_values, expirations)
def test_an_accepted_record_expires_a_finite_time_at_most_max_expiration_ahead(
    writer: BoardValidator, key: bytes, value: bytes, expiration: float
) -> None:
    """A NaN expiration is refused (``nan - now > MAX_EXPIRATION_S`` alone is False)."""
    record = signed(writer, key, own(writer, None), value, expiration)
    if check_reason(writer, record) is None:
        assert math.isfinite(expiration) and expiration - get_dht_time() <= trust.MAX_EXPIRATION_S


@SLOW_FUZZ
@given(keys, inner_values)
def test_an_accepted_record_holds_a_value_readers_can_decode(
    writer: BoardValidator, key: bytes, value: bytes
) -> None:
    """Only values readers can decode are accepted: hivemind decodes them after validation, where a
    failure hangs the reader's get (tests/test_trust.py, the board wedge)."""
    record = signed(writer, key, own(writer, None), value, get_dht_time() + 30)
    if check_reason(writer, record) is None:
        MSGPackSerializer.loads(writer.strip_value(record))


@SLOW_FUZZ
@given(inner_values, st.data())
def test_any_change_to_a_signed_record_is_refused(writer: BoardValidator, value: bytes, data: Any) -> None:
    value = MSGPackSerializer.dumps(value)  # a value readers can decode: only the change may be wrong
    record = signed(writer, trust.dht_key_id("k"), own(writer, None), value, get_dht_time() + 30)
    assert check_reason(writer, record) is None
    where = data.draw(st.sampled_from(["envelope", "key", "subkey", "expiration"]))
    if where == "envelope":
        index = data.draw(st.integers(0, len(record.value) - 1))
        flip = data.draw(st.integers(1, 255))
        raw = bytearray(record.value)
        raw[index] ^= flip
        changed = dataclasses.replace(record, value=bytes(raw))
    elif where == "key":
        changed = dataclasses.replace(
            record, key=data.draw(st.binary(max_size=40).filter(lambda k: k != record.key))
        )
    elif where == "subkey":
        other = data.draw(st.text(min_size=1, max_size=128).filter(lambda s: s != writer.identity.peer_id))
        changed = dataclasses.replace(record, subkey=MSGPackSerializer.dumps(other))
    else:
        delta = data.draw(st.floats(-100, 100).filter(lambda d: d != 0))
        changed = dataclasses.replace(record, expiration_time=record.expiration_time + delta)
        if changed.expiration_time == record.expiration_time:
            return
    if check_reason(writer, changed) is None:  # only a re-encoding of the very same fields may pass
        assert where == "envelope" and trust.open_envelope(changed.value) == trust.open_envelope(record.value)


# ---- peer records ----

FIELDS = [f.name for f in dataclasses.fields(PeerRecord)]
hostile = (
    st.sampled_from(
        [
            float("nan"),
            float("inf"),
            float("-inf"),
            -0.0,
            1e308,
            2**63,
            2**64 - 1,
            -(2**63),
            True,
            False,
            None,
            "",
            "x" * 10_000,
            b"bytes",
            [],
            [[[[1]]]],
            {},
            {"a": {"b": 1}},
            list(range(MAX_FRAGMENTS + 1)),
            {f"p{i}": 1 for i in range(MAX_TALLY + 1)},
            {"": 1},
            {"p": -1},
            {"p": True},
            {"p": 1.0},
            "training",
            "open",
        ]
    )
    | values
)
valid_field = {
    "state": st.sampled_from(STATES),
    "step": st.integers(0, 2**64 - 1),
    "shard": st.none() | st.integers(0, 3),
    "num_shards": st.integers(1, 4),
    "step_time_s": st.floats(0, 1e9),
    "bandwidth_mbps": st.floats(0, 1e9) | st.integers(0, 2**63),
    "fingerprint": st.text(max_size=64),
    "versions": st.lists(st.integers(0, 2**64 - 1), max_size=8),
    "stall_s": st.floats(0, 1e9),
    "bytes_sent": st.integers(0, 2**64 - 1),
    "joined_at": st.integers(0, 2**64 - 1),
    "resume_step": st.integers(-1, 2**63),
    "ttl_s": st.floats(0, MAX_LIFETIME_S),
    "key_id": st.text(min_size=1, max_size=16),
    "refused": st.dictionaries(
        st.text(min_size=1, max_size=64), st.integers(0, 2**64 - 1), max_size=MAX_TALLY
    ),
    "outliers": st.dictionaries(
        st.text(min_size=1, max_size=64), st.integers(0, 2**64 - 1), max_size=MAX_TALLY
    ),
    "theta_step": st.integers(-1, 2**63),
    "theta_sha": st.text(max_size=16),
    "theta_earlier": st.lists(st.tuples(st.integers(-1, 2**63), st.text(max_size=17)).map(list), max_size=8),
    "theta_doubt": st.integers(-2, 2**63),
    "region": st.text(alphabet=sorted(REGION_CHARS), max_size=MAX_REGION) | st.text(max_size=MAX_REGION + 1),
    "tokens_per_s": st.floats(0, 1e9),
    "val_ppl": st.just(NONE_YET) | st.floats(0, 1e308) | st.floats(-2, 0),
    "bytes_received": st.integers(0, 2**64 - 1),
    "last_round_s": st.just(NONE_YET) | st.floats(-2, 1e9),
    "proposed_shape": st.just([]) | st.lists(st.integers(-1, 2**21), min_size=1, max_size=3),
    "sync_shape": st.just([]) | st.lists(st.integers(-1, 2**21), min_size=2, max_size=2),
    "starting_pace": st.integers(-1, 2**21),
}
assert set(valid_field) == set(FIELDS)
# every field valid, or hostile: most examples break one or two fields of an otherwise good record
wire_records = st.fixed_dictionaries(
    {name: st.one_of(strategy, strategy, strategy, hostile) for name, strategy in valid_field.items()}
)
odd_dicts = st.dictionaries(st.sampled_from([*FIELDS, "extra", ""]), hostile, max_size=len(FIELDS) + 1)


def is_int(x: Any) -> bool:
    return type(x) is int


def is_number(x: Any) -> bool:
    return type(x) in (int, float) and math.isfinite(x)


def check_peer_record(record: PeerRecord | None) -> None:
    if record is None:
        return
    r = record
    assert r.state in STATES and type(r.state) is str
    for x in (r.step, r.num_shards, r.bytes_sent, r.joined_at, r.bytes_received):
        assert is_int(x) and x >= 0
    assert is_int(r.resume_step) and r.resume_step >= -1
    assert is_int(r.theta_step) and r.theta_step >= -1
    assert is_int(r.theta_doubt) and r.theta_doubt >= -1
    assert r.shard is None or (is_int(r.shard) and 0 <= r.shard < r.num_shards)
    for x in (r.step_time_s, r.bandwidth_mbps, r.stall_s, r.ttl_s, r.tokens_per_s):
        assert is_number(x) and x >= 0
    for x in (r.val_ppl, r.last_round_s):  # a measure, or none yet
        assert is_number(x) and (x >= 0 or x == NONE_YET)
    assert type(r.region) is str and len(r.region) <= MAX_REGION and set(r.region) <= REGION_CHARS
    assert 0 < r.ttl_s <= MAX_LIFETIME_S
    assert type(r.fingerprint) is str and len(r.fingerprint) <= 64
    assert type(r.key_id) is str and 0 < len(r.key_id) <= 16
    assert type(r.theta_sha) is str and len(r.theta_sha) <= 16
    assert type(r.theta_earlier) is list and len(r.theta_earlier) <= 7
    for pair in r.theta_earlier:
        assert type(pair) is list and len(pair) == 2 and is_int(pair[0]) and pair[0] >= 0
        assert type(pair[1]) is str and len(pair[1]) <= 16
    assert type(r.versions) is list and len(r.versions) <= MAX_FRAGMENTS
    assert all(is_int(v) and v >= 0 for v in r.versions)
    for shape in (r.proposed_shape, r.sync_shape):  # [τ, N], or none
        assert type(shape) is list and (shape == [] or len(shape) == 2)
        assert all(is_int(x) and x <= MAX_SYNC_SHAPE for x in shape)
        assert shape == [] or (shape[0] >= 0 and shape[1] >= 1)
    assert is_int(r.starting_pace) and 0 <= r.starting_pace <= MAX_SYNC_SHAPE
    for tally in (r.refused, r.outliers):
        assert type(tally) is dict and len(tally) <= MAX_TALLY
        assert all(type(k) is str and 0 < len(k) <= 64 and is_int(c) and c >= 0 for k, c in tally.items())
    # what we accept, we could have sent: it survives the wire
    assert PeerRecord.from_wire(MSGPackSerializer.loads(MSGPackSerializer.dumps(r.to_wire()))) == r


@FUZZ
@given(wire_records | odd_dicts | values)
def test_peer_record_from_wire_takes_arbitrary_values(value: Any) -> None:
    check_peer_record(PeerRecord.from_wire(value))


@FUZZ
@given(wire_records)
def test_peer_record_from_wire_reads_what_came_over_msgpack(value: dict) -> None:
    raw = packed(value)
    if raw is not None:
        check_peer_record(PeerRecord.from_wire(MSGPackSerializer.loads(raw)))


def test_peer_record_from_wire_refuses_an_int_too_big_for_a_float() -> None:
    """Not reachable through msgpack (its ints fit in 64 bits), but a record is refused, not an
    OverflowError (``math.isfinite`` on an int past ~1e308), whatever hands it over."""
    crashed = []
    floats = ("step_time_s", "bandwidth_mbps", "stall_s", "ttl_s", "tokens_per_s", "val_ppl", "last_round_s")
    for field in floats:
        value = PeerRecord("training", 3, 0, 2, 0.25, 1.0, "f" * 16, [1, 2]).to_wire()
        value[field] = 10**400
        try:
            assert PeerRecord.from_wire(value) is None
        except OverflowError:
            crashed.append(field)
    assert not crashed, f"from_wire raised OverflowError for {crashed}"


# ---- state manifests ----

dims = st.sampled_from([0, 1, 2, 3, 7, 2**20, 2**39 - 1, 2**39, 2**40 - 1, 2**40, -1, True, 1.0])
shapes = st.lists(dims, max_size=9) | st.lists(st.sampled_from([0, 1, 2**39, 2**40 - 1]), max_size=8)
dtype_names = st.sampled_from([*DTYPES, "float8", "uint8", 7])
tensor_lists = st.lists(st.tuples(dtype_names, shapes).map(list), max_size=4)


def true_size(tensors: list) -> int | None:
    """The bytes the tensors describe, or None when they are not ones a manifest may describe."""
    import torch

    total = 0
    for dtype, shape in tensors:
        if dtype not in DTYPES or not all(type(n) is int and 0 <= n < 1 << 40 for n in shape):
            return None
        total += math.prod(shape) * torch.empty((), dtype=DTYPES[dtype]).element_size()
    return total


@st.composite
def manifests(draw: Any) -> tuple[dict, int]:
    """A manifest a hostile donor could send: fields mostly consistent (so some get accepted), with
    hostile values mixed in, and its digest recomputed (a donor computes its own)."""
    step = draw(st.integers(0, 100))
    tensors = draw(tensor_lists)
    size = true_size(tensors)
    if size is None or draw(st.integers(0, 4)) == 0:
        size = draw(st.sampled_from([0, 1, 2**40, -1, 1.5, None]) | st.integers(0, 2**41))
    chunk_bytes = draw(st.sampled_from([1, 7, 1 << 20, 4 << 20, MAX_FRAME // 2, MAX_FRAME, 0, -1, True]))
    if isinstance(size, int) and isinstance(chunk_bytes, int) and chunk_bytes > 0:
        count = max(1, math.ceil(size / chunk_bytes))
    else:
        count = 1
    count = count if count <= 64 else draw(st.integers(0, 64))
    if draw(st.integers(0, 4)) == 0:
        count = draw(st.integers(0, 8))
    chunk = draw(st.sampled_from(["0" * 64, "z" * 64, "0" * 63, 7]))
    refs = st.fixed_dictionaries({TENSOR_KEY: st.integers(-1, len(tensors))})
    skeleton = draw(st.recursive(scalars | refs, lambda inner: st.lists(inner, max_size=3), max_leaves=8))
    manifest = {
        "step": draw(st.sampled_from([step, step + 1, True, float(step), str(step)])),
        "skeleton": skeleton,
        "tensors": tensors,
        "size": size,
        "chunk_bytes": chunk_bytes,
        "chunks": [chunk] * count,
    }
    try:
        manifest["digest"] = digest(manifest)
    except (TypeError, ValueError, OverflowError):
        manifest["digest"] = "0" * 64
    if draw(st.integers(0, 9)) == 0:
        manifest[draw(st.sampled_from(sorted(manifest)))] = draw(hostile)
    return manifest, step


def check_manifest(manifest: dict, step: int) -> None:
    assert manifest["step"] == step
    assert type(manifest["size"]) is int and 0 <= manifest["size"] < 1 << 40
    assert type(manifest["chunk_bytes"]) is int and 0 < manifest["chunk_bytes"] <= MAX_FRAME // 2
    assert len(manifest["tensors"]) <= MAX_TENSORS and len(manifest["chunks"]) <= MAX_CHUNKS
    assert manifest["size"] == true_size(manifest["tensors"])
    if manifest["size"] <= 1 << 20:  # what parse_manifest accepts, unpack turns into a state
        unpack(manifest, bytes(manifest["size"]))


@FUZZ
@given(manifests())
def test_parse_manifest_takes_what_a_hostile_donor_sends(drawn: tuple[dict, int]) -> None:
    manifest, step = drawn
    try:
        accepted = parse_manifest(manifest, step)
    except BadMessage as exc:
        assert str(exc)
        return
    check_manifest(accepted, step)


@FUZZ
@given(
    values
    | st.dictionaries(
        st.sampled_from(["step", "skeleton", "tensors", "size", "chunk_bytes", "chunks", "digest"]),
        hostile,
        max_size=7,
    )
)
def test_parse_manifest_takes_arbitrary_values(value: Any) -> None:
    try:
        check_manifest(parse_manifest(value, 0), 0)
    except BadMessage as exc:
        assert str(exc)


def test_a_real_manifest_still_parses() -> None:
    import torch

    snapshot = make_snapshot(
        5, {"w": torch.ones(3, 2), "empty": torch.zeros(0, 4), "n": [1, 2.5]}, chunk_bytes=8
    )
    wire = msgpack.unpackb(msgpack.packb(snapshot.manifest, use_bin_type=True), raw=False)
    check_manifest(parse_manifest(wire, 5), 5)


def test_a_manifest_of_an_empty_tensor_with_huge_dimensions_is_refused_or_unpacked() -> None:
    """Bounding each dimension (< 2^40) and the total bytes is not enough: a tensor with a 0
    dimension has 0 bytes whatever the others are, and ``torch.empty([0, 2**39, 2**39])`` raises
    RuntimeError (its strides overflow); ``pull_state`` unpacks outside its BadMessage handling, so
    such a manifest from hostile donors would crash the joiner with a traceback."""
    manifest = {
        "step": 0,
        "skeleton": {"w": {TENSOR_KEY: 0}},
        "tensors": [["float32", [0, 2**39, 2**39]]],
        "size": 0,
        "chunk_bytes": 4 << 20,
        "chunks": ["e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"],
    }
    manifest["digest"] = digest(manifest)
    try:
        accepted = parse_manifest(manifest, 0)
    except BadMessage:
        return
    unpack(accepted, b"")


# ---- allocations stay bounded ----

ANNOUNCING = {
    "array32 of 4 G items": b"\xdd\xff\xff\xff\xff",
    "map32 of 4 G pairs": b"\xdf\xff\xff\xff\xff",
    "bin32 of 4 GiB": b"\xc6\xff\xff\xff\xff",
    "str32 of 4 GiB": b"\xdb\xff\xff\xff\xff",
    "ext32 of 4 GiB": b"\xc9\xff\xff\xff\xff\x01",
    "an envelope whose value is a 4 GiB bin": b"\x95\xc4\x04p2c1\xc6\xff\xff\xff\xff",
    "an envelope whose value is a 4 G array": b"\x95\xc4\x04p2c1\xdd\xff\xff\xff\xff",
    "an envelope of 4 G items": b"\xdd\xff\xff\xff\xff\xc4\x04p2c1",
    "nested arrays of 1 G items": b"\x91" * 4 + b"\xdd\x3f\xff\xff\xff",
}


@pytest.mark.parametrize("case", list(ANNOUNCING))
def test_a_few_bytes_announcing_a_huge_length_are_refused_without_allocating_it(
    reader: BoardValidator, case: str
) -> None:
    raw = ANNOUNCING[case]
    record = DHTRecord(trust.dht_key_id("p2p-cocodc.p.peers"), raw, raw, get_dht_time() + 10)
    tracemalloc.start()
    try:
        assert trust.open_envelope(raw) is None
        assert trust.subkey_peer(raw) is None
        assert reader.why_invalid(record) is not None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{case}: {peak} bytes allocated"
