"""Who may take part in a run, and proof of who wrote each record (``swarm/trust.py``): the swarm key
file and its refusals, membership proofs bound to a peer id, identities that are the libp2p peer ids
hivemind uses, and ``BoardValidator`` both on hand-made hivemind records and inside real hivemind DHT
nodes on 127.0.0.1, where a node must not be able to write, overwrite, extend or plant another
peer's record, nor (in a keyed run) a stranger's record under the run's key."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import pickle
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import P2P, PeerID
from hivemind.utils import MSGPackSerializer, get_dht_time

from p2p_cocodc.errors import UserError
from p2p_cocodc.swarm import trust
from p2p_cocodc.swarm.dht import p2pd_socket, start_dht, stop_dht
from p2p_cocodc.swarm.records import Board, PeerRecord, peers_key
from p2p_cocodc.swarm.trust import BoardValidator, Identity, Membership

KEY = bytes(range(32))
OTHER_KEY = bytes(range(32, 64))


def peer_record(**changes: Any) -> PeerRecord:
    return dataclasses.replace(PeerRecord("training", 3, 0, 2, 0.25, 1.0, "f" * 16, [1, 2]), **changes)


# ---- the swarm key file ----


def test_keygen_writes_a_key_that_reads_back_with_a_stable_public_id(tmp_path: Path) -> None:
    path = tmp_path / "swarm.key"
    kid = trust.keygen(str(path))
    key = trust.read_swarm_key(str(path))
    assert len(key) == trust.KEY_BYTES
    assert kid == trust.key_id(key) == trust.key_id(bytes(key)) == Membership(key).key_id
    assert len(kid) == 16 and all(c in "0123456789abcdef" for c in kid)
    assert kid not in path.read_text() and key.hex()[:16] != kid  # the id names the key, it is not the key
    assert Membership.from_options(str(path)) == Membership(key)
    other = tmp_path / "other.key"
    assert trust.keygen(str(other)) != kid  # a fresh key each time
    assert trust.read_swarm_key(str(other)) != key


def test_keygen_writes_mode_0600_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        trust.keygen(str(tmp_path / "swarm.key"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "swarm.key").st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["swarm.key"]  # no temporary file left behind


def test_keygen_refuses_to_overwrite_a_key_without_force(tmp_path: Path) -> None:
    path = tmp_path / "swarm.key"
    kid = trust.keygen(str(path))
    before = path.read_bytes()
    with pytest.raises(UserError, match="--force") as refused:
        trust.keygen(str(path))
    assert str(path) in str(refused.value)
    assert path.read_bytes() == before
    assert trust.keygen(str(path), force=True) != kid
    assert path.read_bytes() != before and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with pytest.raises(UserError, match="does not exist"):
        trust.keygen(str(tmp_path / "no-such-folder" / "swarm.key"))


def _write(path: Path, data: bytes, mode: int = 0o600) -> None:
    path.write_bytes(data)
    os.chmod(path, mode)


HEADER = trust.KEY_HEADER.encode()
BAD_KEY_FILES: dict[str, tuple[Callable[[Path], None], str]] = {
    "missing": (lambda p: None, "keygen"),
    "a folder": (lambda p: p.mkdir(), "is a folder"),
    "empty": (lambda p: _write(p, b""), "keygen"),
    "not a key file": (lambda p: _write(p, b"hello, world\n"), "keygen"),
    "header only": (lambda p: _write(p, HEADER + b"\n"), "keygen"),
    "hex too short": (lambda p: _write(p, HEADER + b"\n" + b"ab" * 31 + b"\n"), "64 hex digits"),
    "hex too long": (lambda p: _write(p, HEADER + b"\n" + b"ab" * 33 + b"\n"), "64 hex digits"),
    "odd hex": (lambda p: _write(p, HEADER + b"\n" + b"a" * 63 + b"\n"), "64 hex digits"),
    "not hex": (lambda p: _write(p, HEADER + b"\n" + b"zz" * 32 + b"\n"), "64 hex digits"),
    "binary garbage": (lambda p: _write(p, b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x01" * 20), "keygen"),
    "binary after the header": (lambda p: _write(p, HEADER + b"\n\xff\xfe" * 20), "keygen"),
    "group-readable": (lambda p: _write(p, HEADER + b"\n" + b"ab" * 32 + b"\n", 0o640), "chmod 600"),
    "world-readable": (lambda p: _write(p, HEADER + b"\n" + b"ab" * 32 + b"\n", 0o604), "chmod 600"),
}


@pytest.mark.parametrize("case", sorted(BAD_KEY_FILES))
def test_a_bad_key_file_is_one_user_error_line_naming_the_file_and_the_remedy(
    tmp_path: Path, case: str
) -> None:
    make, remedy = BAD_KEY_FILES[case]
    path = tmp_path / "swarm.key"
    make(path)
    with pytest.raises(UserError) as refused:
        trust.read_swarm_key(str(path))
    message = str(refused.value)
    assert "\n" not in message and str(path) in message and "--swarm-key-file" in message
    assert remedy in message
    with pytest.raises(UserError):
        Membership.from_options(str(path))


def test_a_good_key_file_reads_the_key_it_holds(tmp_path: Path) -> None:
    path = tmp_path / "swarm.key"
    _write(path, HEADER + b"\n" + KEY.hex().encode() + b"\n")
    assert trust.read_swarm_key(str(path)) == KEY
    _write(path, HEADER + b"\r\n" + KEY.hex().upper().encode())  # CRLF, upper case, no final newline
    assert trust.read_swarm_key(str(path)) == KEY


# ---- membership ----


def test_a_membership_proof_is_bound_to_its_peer_id() -> None:
    members = Membership(KEY)
    alice, bob = "QmAlice", "QmBob"
    proof = members.proof(alice)
    assert len(proof) == 32 and proof == members.proof(alice)
    assert members.admits(alice, proof)
    assert not members.admits(bob, proof)  # a copied proof buys nothing
    assert not members.admits(alice, b"")
    assert not members.admits(alice, proof[:-1] + bytes([proof[-1] ^ 1]))
    assert not members.is_open and members.key_id == trust.key_id(KEY) != trust.OPEN


def test_an_open_membership_admits_anything() -> None:
    everyone = Membership()
    assert everyone.is_open and everyone.key_id == trust.OPEN and Membership.from_options() == everyone
    assert everyone.proof("QmAlice") == b""
    for proof in (b"", b"junk", Membership(KEY).proof("QmAlice"), bytes(64)):
        assert everyone.admits("QmAlice", proof)


def test_two_keys_disagree() -> None:
    one, two = Membership(KEY), Membership(OTHER_KEY)
    assert one.key_id != two.key_id
    assert one.proof("QmAlice") != two.proof("QmAlice")
    assert not two.admits("QmAlice", one.proof("QmAlice"))
    assert not one.admits("QmAlice", two.proof("QmAlice"))


# ---- identities ----


@pytest.fixture(scope="module")
def id_files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    folder = tmp_path_factory.mktemp("identities")
    paths = [str(folder / f"{name}.key") for name in ("alice", "bob", "carol", "dave")]
    for path in paths:
        P2P.generate_identity(path)
    return paths


@pytest.fixture(scope="module")
def ids(id_files: list[str]) -> list[Identity]:
    return [Identity.from_file(p) for p in id_files]


def test_an_identity_is_the_peer_id_hivemind_computes(id_files: list[str], ids: list[Identity]) -> None:
    for path, identity in zip(id_files, ids, strict=True):
        with open(path, "rb") as f:
            assert identity.peer_id == PeerID.from_identity(f.read()).to_base58()
        assert trust.peer_id_of(identity.public_der) == identity.peer_id
        assert pickle.loads(pickle.dumps(identity)).peer_id == identity.peer_id  # what a child process gets
    assert len({i.peer_id for i in ids}) == len(ids)
    assert trust.peer_id_of_or_none(b"not a key") not in {i.peer_id for i in ids}


def test_a_bad_identity_file_is_one_user_error_line(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.key"
    garbage.write_bytes(b"\x08\x00\x12\x04junk")
    for path, words in ((garbage, "not a private key file"), (tmp_path / "missing.key", "cannot read")):
        with pytest.raises(UserError, match=words) as refused:
            Identity.from_file(str(path))
        assert "\n" not in str(refused.value) and str(path) in str(refused.value)
    trust.check_identity(str(tmp_path / "missing.key"))  # a missing file is created later: no error
    with pytest.raises(UserError):
        trust.check_identity(str(garbage))


def test_an_ephemeral_identity_is_a_key_file_removed_on_close() -> None:
    fresh = trust.EphemeralIdentity()
    assert stat.S_IMODE(os.stat(fresh.folder).st_mode) & 0o077 == 0  # a private folder
    assert Identity.from_file(fresh.path).peer_id
    fresh.close()
    assert not os.path.exists(fresh.folder)


# ---- BoardValidator on hand-made hivemind records ----

RUN = "trust-unit"
VALUE = {"hello": [1, 2.5, "three"]}


def make_record(
    signer: BoardValidator | None,
    key: str = peers_key(RUN),
    subkey: Any = None,
    value: Any = VALUE,
    expiration: float | None = None,
    raw_subkey: bytes | None = None,
) -> DHTRecord:
    """A record as hivemind's store_many builds it (serialized subkey and value), signed by ``signer``."""
    expiration = get_dht_time() + 30 if expiration is None else expiration
    if raw_subkey is None:
        raw_subkey = MSGPackSerializer.dumps(signer.identity.peer_id if subkey is None else subkey)
    record = DHTRecord(trust.dht_key_id(key), raw_subkey, MSGPackSerializer.dumps(value), expiration)
    if signer is None:
        return record
    return dataclasses.replace(record, value=signer.sign_value(record))


def sign_raw(signer: BoardValidator, key: str, raw: bytes, expiration: float) -> DHTRecord:
    """A record of exactly these value bytes under the signer's own subkey, signed."""
    subkey = MSGPackSerializer.dumps(signer.identity.peer_id)
    record = DHTRecord(trust.dht_key_id(key), subkey, raw, expiration)
    return dataclasses.replace(record, value=signer.sign_value(record))


def repack(record: DHTRecord, **fields: bytes) -> DHTRecord:
    """The record with envelope fields replaced, the rest (the signature included) kept."""
    env = trust.open_envelope(record.value)
    assert env is not None
    items = {**dataclasses.asdict(env), **fields}
    packed = [trust.MAGIC, items["value"], items["public_der"], items["proof"], items["signature"]]
    return dataclasses.replace(record, value=msgpack.packb(packed, use_bin_type=True))


def test_a_record_signed_by_its_own_writer_validates_and_strips_back_to_its_value(
    ids: list[Identity],
) -> None:
    alice, bob = BoardValidator(ids[0], Membership()), BoardValidator(ids[1], Membership())
    record = make_record(alice)
    assert record.value != MSGPackSerializer.dumps(VALUE)  # it travels in an envelope
    for reader in (alice, bob):
        assert reader.why_invalid(record) is None and reader.validate(record)
        assert MSGPackSerializer.loads(reader.strip_value(record)) == VALUE
    # and the way hivemind itself applies validators
    composite = CompositeValidator([bob])
    assert composite.validate(record)
    assert MSGPackSerializer.loads(composite.strip_value(record)) == VALUE
    env = trust.open_envelope(record.value)
    assert env is not None and env.public_der == ids[0].public_der and env.proof == b""


def _other_peers_subkey(v: list[BoardValidator]) -> DHTRecord:
    return make_record(v[0], subkey=v[1].identity.peer_id)  # alice writes under bob's subkey


def _other_peers_public_key(v: list[BoardValidator]) -> DHTRecord:
    # alice signs under bob's subkey and puts bob's public key in the envelope
    return repack(_other_peers_subkey(v), public_der=v[1].identity.public_der)


def _value_changed(v: list[BoardValidator]) -> DHTRecord:
    return repack(make_record(v[0]), value=MSGPackSerializer.dumps({"hello": "forged"}))


def _expiration_extended(v: list[BoardValidator]) -> DHTRecord:
    record = make_record(v[0])
    return dataclasses.replace(record, expiration_time=record.expiration_time + 60)


def _expiration_shortened(v: list[BoardValidator]) -> DHTRecord:
    record = make_record(v[0])
    return dataclasses.replace(record, expiration_time=record.expiration_time - 1)


def _moved_to_another_key(v: list[BoardValidator]) -> DHTRecord:
    return dataclasses.replace(make_record(v[0]), key=trust.dht_key_id(peers_key("another-run")))


def _proof_added(v: list[BoardValidator]) -> DHTRecord:
    return repack(make_record(v[0]), proof=Membership(KEY).proof(v[0].identity.peer_id))


def _signature_cut(v: list[BoardValidator]) -> DHTRecord:
    return repack(make_record(v[0]), signature=b"")


def _ghost(v: list[BoardValidator]) -> DHTRecord:
    return make_record(v[0], expiration=get_dht_time() + trust.MAX_EXPIRATION_S + 60)


def _an_hour_ahead(v: list[BoardValidator]) -> DHTRecord:
    return make_record(v[0], expiration=get_dht_time() + 3600)


def _infinite(v: list[BoardValidator]) -> DHTRecord:
    return make_record(v[0], expiration=float("inf"))


def _bare_value(v: list[BoardValidator]) -> DHTRecord:
    return make_record(None, subkey=v[0].identity.peer_id)


def _wrong_magic(v: list[BoardValidator]) -> DHTRecord:
    record = make_record(v[0])
    items = msgpack.unpackb(record.value, raw=True)
    items[0] = b"p2c0"
    return dataclasses.replace(record, value=msgpack.packb(items, use_bin_type=True))


def _garbage_subkey(raw: bytes) -> Callable[[list[BoardValidator]], DHTRecord]:
    return lambda v: make_record(v[0], raw_subkey=raw)


REJECTED: dict[str, tuple[Callable[[list[BoardValidator]], DHTRecord], str]] = {
    "another peer's subkey (forged or overwritten)": (_other_peers_subkey, "another peer"),
    "another peer's subkey and public key": (_other_peers_public_key, "bad signature"),
    "value changed after signing": (_value_changed, "bad signature"),
    "expiration extended after signing": (_expiration_extended, "bad signature"),
    "expiration shortened after signing": (_expiration_shortened, "bad signature"),
    "moved to another DHT key": (_moved_to_another_key, "bad signature"),
    "a proof added after signing": (_proof_added, "bad signature"),
    "signature cut": (_signature_cut, "bad signature"),
    "a ghost past MAX_EXPIRATION_S": (_ghost, "expires more than"),
    "an hour ahead": (_an_hour_ahead, "expires more than"),
    "never expires": (_infinite, "expires more than"),
    "not an envelope": (_bare_value, "not a signed record"),
    "an envelope of another format": (_wrong_magic, "not a signed record"),
    "subkey: hivemind's regular value": (_garbage_subkey(DHTProtocol.IS_REGULAR_VALUE), "not a peer id"),
    "subkey: empty": (_garbage_subkey(b""), "not a peer id"),
    "subkey: not msgpack": (_garbage_subkey(b"\xc1\xff"), "not a peer id"),
    "subkey: an int": (_garbage_subkey(msgpack.packb(7)), "not a peer id"),
    "subkey: bytes": (_garbage_subkey(msgpack.packb(b"QmAlice", use_bin_type=True)), "not a peer id"),
    "subkey: empty string": (_garbage_subkey(msgpack.packb("")), "not a peer id"),
    "subkey: too long": (_garbage_subkey(msgpack.packb("Q" * 200)), "not a peer id"),
    "subkey: trailing bytes": (_garbage_subkey(msgpack.packb("QmAlice") + b"\x00"), "not a peer id"),
    "subkey: a list": (_garbage_subkey(msgpack.packb(["QmAlice"])), "not a peer id"),
}


@pytest.mark.parametrize("case", list(REJECTED))
def test_board_validator_rejects(ids: list[Identity], case: str) -> None:
    make, reason = REJECTED[case]
    validators = [BoardValidator(i, Membership()) for i in ids]
    record = make(validators)
    for reader in validators:  # every reader, the (pretended) writer included
        why = reader.why_invalid(record)
        assert why is not None and reason in why, why
        assert not reader.validate(record)


def test_a_record_with_a_nan_expiration_is_rejected(ids: list[Identity]) -> None:
    """``exp - now > MAX_EXPIRATION_S`` is False for NaN: without its own check, a NaN expiration
    would pass, and hivemind's storage keeps a NaN-expiring subkey in an existing dictionary
    (``nan < now`` is False, so it never expires): a self-signed ghost outliving every honest record."""
    alice, bob = BoardValidator(ids[0], Membership()), BoardValidator(ids[1], Membership())
    record = make_record(alice, expiration=float("nan"))
    assert bob.why_invalid(record) is not None
    assert not bob.validate(record)


# values hivemind's MSGPackSerializer.loads cannot decode: a reader's get raises inside hivemind's
# finish_search (a callback), so the get never completes and Board.peers() times out (see below)
UNDECODABLE = {
    "not msgpack": b"\xc1",
    "empty": b"",
    "truncated": b"\x92\x01",
    "trailing bytes": b"\x01\x02",
    "nested past msgpack's stack": b"\x91" * 5000 + b"\xc0",
    "hivemind ext type with garbage": b"\xd4\x50\x00",
}


def test_a_record_whose_value_readers_cannot_decode_is_rejected(ids: list[Identity]) -> None:
    """The validator checks that the value inside the envelope decodes: hivemind decodes it only
    after validation, in ``_SearchState.finish_search``, where the exception is lost and the get
    hangs (``test_a_value_readers_cannot_decode_does_not_wedge_the_board``)."""
    alice, bob = BoardValidator(ids[0], Membership()), BoardValidator(ids[1], Membership())
    accepted = []
    for case, raw in UNDECODABLE.items():
        with pytest.raises(Exception):  # noqa: B017 - that is the point: hivemind's reader raises on it
            MSGPackSerializer.loads(raw)
        record = sign_raw(alice, peers_key(RUN), raw, get_dht_time() + 30)
        assert trust.open_envelope(record.value) is not None
        if bob.why_invalid(record) is None:
            accepted.append(case)
    assert not accepted, f"records readers cannot decode were accepted: {accepted}"


class StolenProof(Membership):
    """A non-member that copies a member's proof into its own records."""

    def __init__(self, proof: bytes) -> None:
        super().__init__(None)
        object.__setattr__(self, "stolen", proof)

    def proof(self, peer_id: str) -> bytes:
        return self.stolen  # type: ignore[attr-defined,no-any-return]


def test_a_protected_key_needs_a_membership_proof(ids: list[Identity]) -> None:
    alice, bob, carol, dave = ids
    members = Membership(KEY)
    reader = BoardValidator(carol, members, protected=[peers_key(RUN)])
    member = BoardValidator(bob, members)
    stranger = BoardValidator(alice, Membership())
    copier = BoardValidator(alice, StolenProof(members.proof(bob.peer_id)))
    other_swarm = BoardValidator(dave, Membership(OTHER_KEY))

    assert reader.why_invalid(make_record(member)) is None
    for writer in (stranger, copier, other_swarm):
        why = reader.why_invalid(make_record(writer))
        assert why is not None and "swarm key" in why
        # the same writer under a key the run does not protect is accepted
        assert reader.why_invalid(make_record(writer, key="p2p-cocodc.runs")) is None
        assert reader.why_invalid(make_record(writer, key=peers_key("another-run"))) is None
    # protected=None (a keyed bootstrap): every key needs the proof
    everywhere = BoardValidator(carol, members, protected=None)
    assert everywhere.why_invalid(make_record(member, key="anything")) is None
    assert "swarm key" in (everywhere.why_invalid(make_record(stranger, key="anything")) or "")
    # a member's record passes an open reader too: the proof is only extra bytes there
    assert BoardValidator(carol, Membership()).why_invalid(make_record(member)) is None


# ---- real DHT nodes ----


async def stored_under(key: str, _dht: Any, node: Any) -> dict[str, tuple[bytes, float]]:
    """{subkey: (raw value, expiration)} in one node's own storage under ``key`` (runs in its DHT process)."""
    found = node.protocol.storage.get(DHTID.generate(source=key))
    if found is None or not isinstance(found.value, DictionaryDHTValue):
        return {}
    return {str(sub): (bytes(value), float(exp)) for sub, (value, exp) in found.value.items()}


async def known_peers(_dht: Any, node: Any) -> list[str]:
    return sorted(peer.to_base58() for peer in node.protocol.routing_table.uid_to_peer_id.values())


async def push(
    key: str, subkey: str, value: bytes, expiration: float, _dht: Any, node: Any
) -> dict[str, bool]:
    """What a hostile node can do: ask every node it knows to store these exact bytes (its own
    signature, or none), bypassing its own validator. {peer id: stored}."""
    key_id = DHTID.generate(source=key)
    answers = {}
    for peer in list(node.protocol.routing_table.uid_to_peer_id.values()):
        ok = await node.protocol.call_store(peer, [key_id], [value], expiration, subkeys=[subkey])
        answers[peer.to_base58()] = ok is not None and bool(ok[0])
    return answers


def wait_until_known(nodes: list[Any], timeout: float = 15.0) -> None:
    """Poll (with a deadline) until every node's routing table holds every other node."""
    everyone = {d.peer_id.to_base58() for d in nodes}
    deadline = time.monotonic() + timeout
    while True:
        missing = [
            d for d in nodes if set(d.run_coroutine(known_peers)) != everyone - {d.peer_id.to_base58()}
        ]
        if not missing:
            return
        assert time.monotonic() < deadline, "the nodes did not learn of each other"
        time.sleep(0.05)


@contextmanager
def swarm(
    id_files: list[str | None], members: list[Membership | None], protected: list[str]
) -> Iterator[list[Any]]:
    """Nodes on 127.0.0.1, the first everyone's bootstrap, each with its identity file (None: fresh)
    and membership; always shut down."""
    nodes: list[Any] = []
    try:
        for path, membership in zip(id_files, members, strict=True):
            initial = [str(nodes[0].get_visible_maddrs()[0])] if nodes else []
            nodes.append(start_dht(initial, "127.0.0.1", 0, None, path, membership, protected))
        yield nodes
    finally:
        for dht in reversed(nodes):
            stop_dht(dht, p2pd_socket(dht))


@pytest.fixture(scope="module")
def open_swarm(id_files: list[str]) -> Iterator[list[Any]]:
    """Three nodes of an open run (alice bootstraps bob and carol); each test uses its own run id."""
    with swarm(id_files[:3], [None] * 3, []) as nodes:
        wait_until_known(nodes)
        yield nodes


def board(dht: Any, run: str, timeout: float | None = None) -> Board:
    return Board(dht, run, dht.peer_id.to_base58(), ttl_s=8, timeout=timeout)


def test_a_dht_node_runs_with_the_peer_id_of_its_identity_file(
    open_swarm: list[Any], id_files: list[str], ids: list[Identity]
) -> None:
    for dht, path, identity in zip(open_swarm, id_files, ids, strict=False):
        with open(path, "rb") as f:
            from_file = PeerID.from_identity(f.read()).to_base58()
        assert dht.peer_id.to_base58() == identity.peer_id == from_file


def test_a_node_cannot_write_under_another_peers_subkey(open_swarm: list[Any], id_files: list[str]) -> None:
    alice, bob, carol = open_swarm
    b, c = bob.peer_id.to_base58(), carol.peer_id.to_base58()
    run = "forge"
    key = peers_key(run)
    asyncio.run(board(bob, run).publish(peer_record()))
    held = [d.run_coroutine(functools.partial(stored_under, key)) for d in open_swarm]
    assert any(b in h for h in held[0::2])  # another node holds bob's own record

    forged = peer_record(state="leaving", fingerprint="evil")
    later = get_dht_time() + 60  # it would win over bob's record if it were kept
    assert not alice.store(key, forged.to_wire(), later, subkey=b)  # through alice's own (signing) DHT
    # and bypassing alice's validator: her signature under bob's subkey, with or without bob's public key
    signer = BoardValidator(Identity.from_file(id_files[0]), Membership())
    record = make_record(signer, key=key, subkey=b, value=forged.to_wire(), expiration=later)
    for raw in (record.value, repack(record, public_der=Identity.from_file(id_files[1]).public_der).value):
        assert alice.run_coroutine(functools.partial(push, key, b, raw, later)) == {b: False, c: False}

    assert [d.run_coroutine(functools.partial(stored_under, key)) for d in open_swarm] == held
    for reader in (alice, carol):
        assert asyncio.run(board(reader, run).peers()) == {b: peer_record(ttl_s=8)}


def test_a_record_expiring_in_an_hour_is_refused(open_swarm: list[Any]) -> None:
    alice, bob, carol = open_swarm
    b, c = bob.peer_id.to_base58(), carol.peer_id.to_base58()
    run = "ghost"
    key = peers_key(run)
    asyncio.run(board(carol, run).publish(peer_record()))
    assert not bob.store(key, peer_record().to_wire(), get_dht_time() + 3600, subkey=b)
    for d in open_swarm:
        assert b not in d.run_coroutine(functools.partial(stored_under, key))
    assert set(asyncio.run(board(alice, run).peers())) == {c}
    # the same record with an ordinary lifetime is taken: the refusal was about the expiration
    assert bob.store(key, peer_record().to_wire(), get_dht_time() + 60, subkey=b, exclude_self=True)
    assert set(asyncio.run(board(alice, run).peers())) == {b, c}


def test_a_record_with_a_nan_expiration_is_refused_by_the_swarm(open_swarm: list[Any]) -> None:
    """(See test_a_record_with_a_nan_expiration_is_rejected.) With an honest record already under
    the key, no node keeps bob's NaN-expiring record, and readers never list bob."""
    alice, bob, carol = open_swarm
    b, c = bob.peer_id.to_base58(), carol.peer_id.to_base58()
    run = "nan"
    key = peers_key(run)
    asyncio.run(board(carol, run).publish(peer_record()))
    stored = bob.store(key, peer_record().to_wire(), float("nan"), subkey=b)
    assert set(asyncio.run(board(alice, run).peers())) == {c}
    assert not stored


def test_a_value_readers_cannot_decode_does_not_wedge_the_board(
    open_swarm: list[Any], id_files: list[str]
) -> None:
    """Bob signs a record under his own subkey whose value is not msgpack. Were it stored, no reader's
    get would complete (hivemind decodes the value after validation, in a callback whose exception
    is lost): every Board.peers() in the run would time out for as long as bob kept the record
    alive. Any peer of an open run (or a member of a keyed one) could do it."""
    alice, bob, carol = open_swarm
    b, c = bob.peer_id.to_base58(), carol.peer_id.to_base58()
    run = "wedge"
    key = peers_key(run)
    asyncio.run(board(carol, run).publish(peer_record()))
    signer = BoardValidator(Identity.from_file(id_files[1]), Membership())
    expiration = get_dht_time() + 30
    envelope = sign_raw(signer, key, b"\xc1", expiration).value
    stored = bob.run_coroutine(functools.partial(push, key, b, envelope, expiration))
    try:
        seen: Any = asyncio.run(board(alice, run, timeout=4).peers())
    except ConnectionError as exc:
        seen = exc
    assert not isinstance(seen, ConnectionError), f"one peer's undecodable record wedged the board: {seen}"
    assert set(seen) == {c}
    assert not any(stored.values())


def test_a_stranger_without_the_swarm_key_cannot_join_a_keyed_run() -> None:
    run = "keyed"
    members = Membership(KEY)
    protected = [peers_key(run)]
    with swarm([None] * 3, [members] * 3, protected) as honest:
        boot = str(honest[0].get_visible_maddrs()[0])
        stranger = start_dht([boot], "127.0.0.1", 0, protected=protected)  # no key: open membership
        try:
            wait_until_known([*honest, stranger])
            one, two = (d.peer_id.to_base58() for d in honest[1:])
            s = stranger.peer_id.to_base58()

            async def main() -> None:
                await board(honest[1], run).publish(peer_record())
                await board(honest[2], run).publish(peer_record(shard=1))
                with pytest.raises(ConnectionError, match="no other node"):
                    await board(stranger, run).publish(peer_record())

            asyncio.run(main())
            expected = {one: peer_record(ttl_s=8), two: peer_record(shard=1, ttl_s=8)}
            for reader in honest:
                assert asyncio.run(board(reader, run).peers()) == expected
            for dht in honest:
                assert s not in dht.run_coroutine(functools.partial(stored_under, peers_key(run)))
        finally:
            stop_dht(stranger, p2pd_socket(stranger))
