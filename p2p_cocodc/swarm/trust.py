"""Who may take part in a run, and proof of who wrote each notice-board record.

**Identities.** Every DHT node of ours holds an RSA key; its libp2p peer id is the hash of the public
key (``peer_id_of``), and libp2p authenticates that id on every stream. A peer started without
``--identity`` gets a fresh key in a private temporary file (``ephemeral_identity``).

**Records bound to their writer.** ``BoardValidator`` is a hivemind record validator installed in
every node we start (peers and bootstrap). A record's subkey is its writer's peer id; its value
travels in an envelope ``[MAGIC, value, public key (DER), membership proof, signature]``, the
signature (RSA PKCS#1 v1.5, SHA-256) covering the DHT key, the subkey, the value, the expiration
time and the proof. A node stores, and a reader accepts, a record only if the public key hashes to
the subkey, the signature verifies and the expiration is at most ``MAX_EXPIRATION_S`` ahead: nobody
can write, overwrite or extend another peer's record, and nobody can plant a long-lived ghost.

**Membership.** A run may require a swarm secret (``p2p-cocodc keygen``, ``--swarm-key-file``): a
member proves it holds the key with ``HMAC-SHA256(key, "p2p-cocodc member\\0" ‖ peer id)``, a
proof bound to its authenticated id, so copying another member's proof buys nothing. Or it may
require a certificate from the run's owner (``keygen --owner``, ``admit``, ``--owner``,
``--certificate``): the owner's RSA signature of that same message, with the owner's public key,
whose hash every peer checks against the owner id it was given; it is likewise bound to one id.
Nodes that hold the key (or know the owner id) store, and readers accept, records under a run's key
only with a valid proof; the exchange and the state server then serve only peers with such a record
on the board. Without either the run is open: any peer that reaches the bootstrap may take part,
and ``join`` says so.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from p2p_cocodc.errors import UserError

log = logging.getLogger(__name__)

KEY_HEADER = "p2p-cocodc swarm key v1"
KEY_BYTES = 32
OPEN = "open"  # the key id of a run without a swarm key
MAGIC = b"p2c1"
MAX_VALUE_BYTES = 16 * 1024  # larger values would wedge hivemind's DHT pipe anyway
MAX_KEY_BYTES = 2048  # a DER RSA public key of up to 8192 bits
MAX_SIGNATURE_BYTES = 1024
MAX_PEER_ID = 128
MAX_PROOF_BYTES = 3 * 1024  # an owner's certificate: its public key and signature
MAX_ENVELOPE_BYTES = MAX_VALUE_BYTES + MAX_KEY_BYTES + MAX_PROOF_BYTES + MAX_SIGNATURE_BYTES + 64  # + framing
MAX_EXPIRATION_S = 300.0  # a record may expire at most this far ahead (lifetimes are ≤ 120 s; clocks drift)


# ---- the swarm key ----


def new_file(path: str, force: bool, flag: str = "") -> Path:
    """Where a key or certificate will be written: refused when it exists (unless ``force``) or
    its folder does not."""
    target = Path(path)
    if target.exists() and not force:
        raise UserError(f"{flag}{path} already exists: give a new path, or --force to replace it")
    if not target.parent.is_dir():
        raise UserError(f"{flag}{path}: folder {target.parent} does not exist")
    return target


def keygen(path: str, force: bool = False) -> str:
    """Write a new swarm key file (mode 0600); returns its key id. Refuses to overwrite without ``force``."""
    target = new_file(path, force)
    key = secrets.token_bytes(KEY_BYTES)
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{KEY_HEADER}\n{key.hex()}\n")
        os.replace(tmp, target)
    except OSError as exc:
        with suppress(OSError):
            tmp.unlink()
        raise UserError(f"{path}: cannot write the key ({exc.strerror})") from None
    return key_id(key)


def read_swarm_key(path: str) -> bytes:
    """The key in a file ``keygen`` wrote, or UserError saying what is wrong with the file."""
    where = f"--swarm-key-file {path}"
    try:
        mode = os.stat(path).st_mode
        with open(path, encoding="ascii") as f:
            text = f.read(1024)
    except FileNotFoundError:
        raise UserError(f"{where}: no such file (create one with `p2p-cocodc keygen {path}`)") from None
    except IsADirectoryError:
        raise UserError(
            f"{where} is a folder: give the key file in it (made by `p2p-cocodc keygen FILE`)"
        ) from None
    except OSError as exc:
        raise UserError(f"{where}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise UserError(f"{where} is not a swarm key file (made by `p2p-cocodc keygen`)") from None
    lines = text.split()
    if len(lines) < 2 or " ".join(lines[:-1]) != KEY_HEADER:
        raise UserError(f"{where} is not a swarm key file (made by `p2p-cocodc keygen`)")
    try:
        key = bytes.fromhex(lines[-1])
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise UserError(
            f"{where}: the key must be {2 * KEY_BYTES} hex digits; the file is damaged: copy it again "
            "from the run's owner"
        )
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UserError(f"{where} can be read by other users: run `chmod 600 {path}`")
    return key


def key_id(key: bytes) -> str:
    """A public name of a key (it reveals nothing of the key): what records and refusals quote."""
    return hashlib.sha256(b"p2p-cocodc key id\0" + key).hexdigest()[:16]


@dataclass(frozen=True)
class Membership:
    """Who may take part: everyone; the holders of the swarm key (``key``); or the peers the run's
    owner signed a certificate for (``owner``: the owner's id; ``certificate``: this peer's own)."""

    key: bytes | None = None
    owner: str | None = None
    certificate: bytes | None = None  # this peer's proof under an owner: packed (owner key, signature)

    @classmethod
    def from_options(
        cls,
        swarm_key_file: str | None = None,
        owner: str | None = None,
        certificate: str | None = None,
        identity: str | None = None,
    ) -> Membership:
        """The membership a peer's options ask for, or UserError saying which option to fix. A
        bootstrap passes no certificate (it only checks others')."""
        if swarm_key_file is not None and owner is not None:
            raise UserError("--swarm-key-file and --owner: a run admits by one of them; give one")
        if certificate is not None and owner is None:
            raise UserError("--certificate needs --owner (the id of the run's owner key that signed it)")
        if owner is not None:
            check_owner_id(owner)
            proof = read_certificate(certificate, owner, identity) if certificate is not None else None
            return cls(owner=owner, certificate=proof)
        return cls(read_swarm_key(swarm_key_file) if swarm_key_file is not None else None)

    @property
    def is_open(self) -> bool:
        return self.key is None and self.owner is None

    @property
    def key_id(self) -> str:
        if self.owner is not None:
            return "own" + hashlib.sha256(self.owner.encode()).hexdigest()[:13]
        return OPEN if self.key is None else key_id(self.key)

    def check_admitted(self, bootstrap_key_id: str | None, where: str) -> None:
        """UserError, at once, when the bootstrap admits by another key than this peer holds: its
        records would be refused by every node of the run, and it would only learn that it is shut
        out as a DHT that takes nothing. An open bootstrap (or one that did not say) admits all."""
        if bootstrap_key_id in (None, OPEN) or bootstrap_key_id == self.key_id:
            return
        theirs = "an owner's certificate" if bootstrap_key_id.startswith("own") else "a swarm key"
        mine = "none (an open run)" if self.is_open else self.key_id
        raise UserError(
            f"{where} admits only peers with {theirs}, key id {bootstrap_key_id}; this peer's is {mine}: "
            "give it the run's key file (--swarm-key-file), or its owner's id and a certificate "
            "(--owner, --certificate)"
        )

    def proof(self, peer_id: str) -> bytes:
        """This peer's proof (``peer_id`` is its own id)."""
        if self.owner is not None:
            return self.certificate or b""
        if self.key is None:
            return b""
        return hmac.new(self.key, _member_message(peer_id), hashlib.sha256).digest()

    def admits(self, peer_id: str, proof: bytes) -> bool:
        if self.owner is not None:
            return _certifies(self.owner, peer_id, proof)
        return self.key is None or hmac.compare_digest(self.proof(peer_id), proof)


def _member_message(peer_id: str) -> bytes:
    return b"p2p-cocodc member\0" + peer_id.encode()


# ---- certificates signed by a run's owner ----

CERT_HEADER = "p2p-cocodc certificate v1"


def owner_keygen(path: str, force: bool = False) -> str:
    """Write a new owner key (an RSA identity file, mode 0600); returns the owner id to give peers."""
    from hivemind.p2p import P2P

    target = new_file(path, force)
    tmp = target.with_name(f".{target.name}.tmp")
    with suppress(OSError):
        tmp.unlink()
    try:
        P2P.generate_identity(str(tmp))
        os.chmod(tmp, 0o600)
        os.replace(tmp, target)
    except OSError as exc:
        raise UserError(f"{path}: cannot write the key ({exc.strerror})") from None
    return Identity.from_file(path, "--owner-key").peer_id


def admit(owner_key: str, peer_id: str, out: str, force: bool = False) -> str:
    """Sign a certificate that lets ``peer_id`` take part in the owner's runs; returns the owner id."""
    check_owner_id(peer_id, "peer id")
    owner = Identity.from_file(owner_key, "--owner-key")
    target = new_file(out, force, "--out ")
    signature = owner.sign(_member_message(peer_id))
    text = f"{CERT_HEADER}\n{owner.public_der.hex()}\n{peer_id}\n{signature.hex()}\n"
    try:
        target.write_text(text, encoding="ascii")
    except OSError as exc:
        raise UserError(f"--out {out}: cannot write it ({exc.strerror})") from None
    return owner.peer_id


def read_certificate(path: str, owner: str, identity: str | None) -> bytes:
    """This peer's certificate, checked against the owner id and its own identity; the proof its
    records carry. UserError says what is wrong with the file or the options."""
    where = f"--certificate {path}"
    if identity is None:
        raise UserError(f"{where} names one peer id: give that peer's --identity file too")
    try:
        lines = Path(path).read_text(encoding="ascii").splitlines()
        if len(lines) != 4 or lines[0] != CERT_HEADER:
            raise ValueError
        owner_der, peer, signature = bytes.fromhex(lines[1]), lines[2].strip(), bytes.fromhex(lines[3])
    except FileNotFoundError:
        raise UserError(f"{where}: no such file (the run's owner makes it with `p2p-cocodc admit`)") from None
    except (OSError, UnicodeDecodeError, ValueError, IndexError):
        raise UserError(f"{where} is not a certificate made by `p2p-cocodc admit`") from None
    mine = Identity.from_file(identity).peer_id
    if peer != mine:
        raise UserError(f"{where} admits peer {peer}, and this peer's --identity {identity} is {mine}")
    proof = msgpack.packb([owner_der, signature], use_bin_type=True)
    if peer_id_of_or_none(owner_der) != owner:
        raise UserError(f"{where} was signed by owner {peer_id_of_or_none(owner_der)}, not --owner {owner}")
    if not _certifies(owner, peer, proof):
        raise UserError(f"{where}: the owner's signature does not verify; the file is damaged")
    return proof


def _certifies(owner: str, peer_id: str, proof: bytes) -> bool:
    try:
        owner_der, signature = msgpack.unpackb(proof, raw=True, max_bin_len=MAX_KEY_BYTES, max_array_len=2)
    except Exception:  # noqa: BLE001 - msgpack raises several types on garbage
        return False
    if not isinstance(owner_der, bytes) or not isinstance(signature, bytes):
        return False
    return peer_id_of_or_none(owner_der) == owner and verify(owner_der, _member_message(peer_id), signature)


def check_owner_id(text: str, what: str = "--owner") -> None:
    """A peer id as libp2p writes it (base58, as `p2p-cocodc keygen --owner` and `peer-id` print)."""
    import base58

    try:
        ok = 0 < len(text) <= MAX_PEER_ID and len(base58.b58decode(text)) >= 16
    except ValueError:
        ok = False
    if not ok:
        raise UserError(f"{what} {text!r} is not a peer id (base58, as `p2p-cocodc peer-id` prints it)")


# ---- identities ----


def peer_id_of(public_der: bytes) -> str:
    """The libp2p peer id of an RSA public key (DER SubjectPublicKeyInfo), base58."""
    import base58
    import multihash
    from hivemind.proto import crypto_pb2

    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=public_der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


class Identity:
    """The RSA key behind a peer id (hivemind's identity file format: a libp2p protobuf)."""

    def __init__(self, private_der: bytes) -> None:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        key = serialization.load_der_private_key(private_der, password=None)
        if not isinstance(key, rsa.RSAPrivateKey):
            raise ValueError("not an RSA key")
        self._der = private_der
        self._key = key
        self.public_der = key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        self.peer_id = peer_id_of(self.public_der)

    @classmethod
    def from_file(cls, path: str, flag: str = "--identity") -> Identity:
        from hivemind.proto import crypto_pb2

        try:
            with open(path, "rb") as f:
                protobuf = crypto_pb2.PrivateKey.FromString(f.read(64 * 1024))
            if protobuf.key_type != crypto_pb2.RSA:
                raise ValueError("not an RSA identity")
            return cls(protobuf.data)
        except OSError as exc:
            raise UserError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None
        except Exception as exc:  # noqa: BLE001 - protobuf and cryptography raise many types for bad keys
            raise UserError(
                f"{flag} {path} is not a private key file ({type(exc).__name__}); "
                "give the file an earlier run created, or a new path to create one"
            ) from None

    def sign(self, data: bytes) -> bytes:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding

        return self._key.sign(data, padding.PKCS1v15(), hashes.SHA256())

    def __getstate__(self) -> dict[str, Any]:
        return {"der": self._der}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["der"])  # type: ignore[misc]


def ensure_identity(path: str) -> Identity:
    """The identity in ``path``, created there first if the file does not exist."""
    from hivemind.p2p import P2P

    if not os.path.exists(path):
        if not Path(path).parent.is_dir():
            raise UserError(f"--identity {path}: folder {Path(path).parent} does not exist")
        P2P.generate_identity(path)
    return Identity.from_file(path)


def check_identity(path: str) -> None:
    """An existing identity file must hold a key (a missing one is created when the DHT starts)."""
    if os.path.exists(path):
        Identity.from_file(path)


def verify(public_der: bytes, data: bytes, signature: bytes) -> bool:
    from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import padding, rsa

    try:
        key = serialization.load_der_public_key(public_der)
        if not isinstance(key, rsa.RSAPublicKey):
            return False
        key.verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
    except (InvalidSignature, UnsupportedAlgorithm, ValueError, TypeError):  # a key or signature from anyone
        return False
    return True


class EphemeralIdentity:
    """A fresh identity file in a private temporary folder, removed by ``close``."""

    def __init__(self) -> None:
        from hivemind.p2p import P2P

        self.folder = tempfile.mkdtemp(prefix="p2p-cocodc-id-")
        self.path = os.path.join(self.folder, "identity.key")
        P2P.generate_identity(self.path)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


# ---- records bound to their writer ----


def dht_key_id(key: str) -> bytes:
    """The bytes hivemind's validators see for a DHT key (its hash)."""
    from hivemind.dht.routing import DHTID

    return DHTID.generate(source=key).to_bytes()


def _signed_bytes(key: bytes, subkey: bytes, value: bytes, expiration: float, proof: bytes) -> bytes:
    return msgpack.packb([MAGIC, key, subkey, value, expiration, proof], use_bin_type=True)


@dataclass(frozen=True)
class Envelope:
    value: bytes
    public_der: bytes
    proof: bytes
    signature: bytes


def open_envelope(raw: Any) -> Envelope | None:
    """An envelope from untrusted bytes, every field typed and bounded, or None."""
    if not isinstance(raw, bytes) or len(raw) > MAX_ENVELOPE_BYTES:
        return None
    try:
        items = msgpack.unpackb(raw, raw=True, max_bin_len=MAX_VALUE_BYTES, max_array_len=8, max_map_len=0)
    except Exception:  # noqa: BLE001 - msgpack raises several types on garbage
        return None
    if not isinstance(items, list) or len(items) != 5 or items[0] != MAGIC:
        return None
    value, public_der, proof, signature = items[1:]
    limits = (
        (value, MAX_VALUE_BYTES),
        (public_der, MAX_KEY_BYTES),
        (proof, MAX_PROOF_BYTES),
        (signature, MAX_SIGNATURE_BYTES),
    )
    if not all(isinstance(x, bytes) and len(x) <= limit for x, limit in limits):
        return None
    return Envelope(value, public_der, proof, signature)


def _decodes(value: bytes) -> bool:
    """Whether hivemind's serializer reads ``value`` (it decodes a record's value only after
    validation, in a callback whose error is lost: a value it cannot read hangs every reader)."""
    from hivemind.utils import MSGPackSerializer

    try:
        MSGPackSerializer.loads(value)
    except Exception:  # noqa: BLE001 - msgpack and hivemind's ext hooks raise many types on garbage
        return False
    return True


def subkey_peer(subkey: bytes) -> str | None:
    """The peer id a record's subkey names (msgpack of a string), or None."""
    try:
        peer = msgpack.unpackb(subkey, raw=False, max_str_len=MAX_PEER_ID, max_bin_len=0, max_array_len=0)
    except Exception:  # noqa: BLE001 - msgpack raises several types on garbage
        return None
    return peer if isinstance(peer, str) and 0 < len(peer) <= MAX_PEER_ID else None


class BoardValidator:
    """A hivemind record validator (the ``RecordValidatorBase`` interface, without importing
    hivemind here): signs this node's records, and accepts a record only when its writer is the
    peer its subkey names (and, under a run key in ``protected``, a member). Every node of ours
    runs one (``dht.start_dht``)."""

    priority = 10  # hivemind checks validators in decreasing priority: this one first

    def __init__(
        self, identity: Identity, membership: Membership, protected: Iterable[str] | None = ()
    ) -> None:
        self.identity = identity
        self.membership = membership
        self.rejected = 0  # records refused (logged: the first, then every 100th)
        # the DHT keys whose records need a membership proof (None: every key; a keyed bootstrap)
        self.protected = None if protected is None else {dht_key_id(k) for k in protected}

    def sign_value(self, record: Any) -> bytes:
        proof = self.membership.proof(self.identity.peer_id)
        signed = _signed_bytes(record.key, record.subkey, record.value, record.expiration_time, proof)
        envelope = [MAGIC, record.value, self.identity.public_der, proof, self.identity.sign(signed)]
        return msgpack.packb(envelope, use_bin_type=True)

    def validate(self, record: Any) -> bool:
        why = self.why_invalid(record)
        if why is not None:
            self.rejected += 1
            if self.rejected % 100 == 1:  # the first, then every 100th: a flood must not flood the log
                log.warning("refusing a board record: %s (%d refused so far)", why, self.rejected)
        return why is None

    def why_invalid(self, record: Any) -> str | None:
        """None for a valid record, else what is wrong with it (for tests and logs)."""
        from hivemind.utils import get_dht_time

        envelope = open_envelope(record.value)
        if envelope is None:
            return "not a signed record"
        writer = subkey_peer(record.subkey)
        if writer is None:
            return "the subkey is not a peer id"
        expiration = record.expiration_time
        if not math.isfinite(expiration) or expiration - get_dht_time() > MAX_EXPIRATION_S:
            return f"expires more than {MAX_EXPIRATION_S:.0f} s ahead (or never)"
        signed = _signed_bytes(
            record.key, record.subkey, envelope.value, record.expiration_time, envelope.proof
        )
        if not verify(envelope.public_der, signed, envelope.signature):
            return "bad signature"
        signer = peer_id_of_or_none(envelope.public_der)  # its signature verified: it did sign this
        if signer != writer:
            return f"signed by another peer ({signer}) than the one its subkey names ({writer})"
        if not _decodes(envelope.value):  # hivemind decodes it after us, where an error hangs the reader
            return "a value readers cannot decode"
        needs_proof = self.protected is None or record.key in self.protected
        if needs_proof and not self.membership.admits(writer, envelope.proof):
            return "its writer does not hold this run's swarm key"
        return None

    def strip_value(self, record: Any) -> bytes:
        envelope = open_envelope(record.value)
        return envelope.value if envelope is not None else record.value

    def merge_with(self, other: Any) -> bool:
        return False


def peer_id_of_or_none(public_der: bytes) -> str | None:
    try:
        return peer_id_of(public_der)
    except Exception:  # noqa: BLE001 - a malformed key from another peer
        return None
