"""Runs that admit only the peers their owner certified: `keygen --owner`, `peer-id`, `admit`, and
`join --owner --identity --certificate`, with real keys, real peers and a keyed bootstrap."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2p_cocodc.errors import UserError
from p2p_cocodc.swarm.trust import Membership, admit, ensure_identity, owner_keygen
from tests.swarm_procs import end_group, records, run_cli, spawn, start_bootstrap
from tests.tiny_options import TWO_PEERS


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("keys")
    owner_keygen(str(folder / "owner.key"))
    owner_keygen(str(folder / "other-owner.key"))
    for name in ("a", "b"):
        identity = ensure_identity(str(folder / f"{name}.id"))
        admit(str(folder / "owner.key"), identity.peer_id, str(folder / f"{name}.cert"))
    admit(
        str(folder / "other-owner.key"), ensure_identity(str(folder / "a.id")).peer_id, str(folder / "x.cert")
    )
    return {p.name: p for p in folder.iterdir()}


def owner_id(keys: dict[str, Path], name: str = "owner.key") -> str:
    return ensure_identity(str(keys[name])).peer_id


def test_a_certificate_admits_exactly_the_peer_it_names(keys: dict[str, Path]) -> None:
    owner = owner_id(keys)
    a = Membership.from_options(None, owner, str(keys["a.cert"]), str(keys["a.id"]))
    a_id, b_id = (ensure_identity(str(keys[f"{n}.id"])).peer_id for n in "ab")
    assert a.admits(a_id, a.proof(a_id))
    assert not a.admits(b_id, a.proof(a_id))  # a's certificate is worthless to b
    proof = a.proof(a_id)
    tampered = proof[:-1] + bytes([proof[-1] ^ 1])  # its last byte changed (a proof may end in 0)
    assert not a.admits(a_id, b"") and not a.admits(a_id, tampered)
    bootstrap = Membership.from_options(owner=owner)  # knows the owner, holds no certificate
    assert bootstrap.admits(a_id, a.proof(a_id)) and not bootstrap.is_open
    assert bootstrap.key_id == a.key_id != Membership().key_id
    other = Membership.from_options(owner=owner_id(keys, "other-owner.key"))
    assert not other.admits(a_id, a.proof(a_id))
    # a peer is told at once by what its bootstrap admits (its /address names the key id)
    a.check_admitted(bootstrap.key_id, "--bootstrap B")
    a.check_admitted("open", "--bootstrap B")  # an open bootstrap relays any run's records
    a.check_admitted(None, "--bootstrap B")  # given as a multiaddr: it could not be asked
    with pytest.raises(UserError, match=f"an owner's certificate, key id {other.key_id}; this peer's is"):
        a.check_admitted(other.key_id, "--bootstrap B")
    with pytest.raises(UserError, match=r"this peer's is none \(an open run\)"):
        Membership().check_admitted(bootstrap.key_id, "--bootstrap B")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"swarm_key_file": "k", "owner": "OWNER"}, "give one"),
        ({"certificate": "a.cert"}, "--certificate needs --owner"),
        ({"owner": "not a peer id!"}, "is not a peer id"),
        ({"owner": "OWNER", "certificate": "a.cert"}, "give that peer's --identity"),
        ({"owner": "OWNER", "certificate": "a.cert", "identity": "b.id"}, "admits peer"),
        ({"owner": "OWNER", "certificate": "x.cert", "identity": "a.id"}, "signed by owner"),
        ({"owner": "OWNER", "certificate": "missing.cert", "identity": "a.id"}, "no such file"),
        ({"owner": "OWNER", "certificate": "a.id", "identity": "a.id"}, "is not a certificate"),
    ],
)
def test_bad_membership_options_get_one_line(keys: dict[str, Path], options: dict, message: str) -> None:
    folder = keys["a.id"].parent
    given = {
        k: (owner_id(keys) if v == "OWNER" else str(folder / v) if k != "owner" else v)
        for k, v in options.items()
    }
    with pytest.raises(UserError, match=message) as raised:
        Membership.from_options(**given)
    assert "\n" not in str(raised.value)


def test_certified_peers_train_together_and_an_uncertified_one_is_shut_out(tmp_path: Path) -> None:
    made = run_cli(["keygen", "--owner", "owner.key"], tmp_path, timeout=60)
    assert made.returncode == 0, made.stderr
    owner = made.stdout.split("owner id ")[1].split()[0]
    for name in ("a", "b"):
        peer = run_cli(["peer-id", f"{name}.id"], tmp_path, timeout=60).stdout.strip()
        signed = run_cli(["admit", peer, "--owner-key", "owner.key", "--out", f"{name}.cert"], tmp_path, 60)
        assert signed.returncode == 0, signed.stderr
    boot = start_bootstrap(tmp_path, extra=["--owner", owner])
    join = ["join", "--bootstrap", boot.host_port, "--run-id", "owned", *TWO_PEERS]
    procs = []
    try:
        for i, name in enumerate("ab"):
            certified = ["--owner", owner, "--identity", f"{name}.id", "--certificate", f"{name}.cert"]
            args = [*join, *certified, "--shard", f"{i}/2", "--out", f"{name}.jsonl"]
            procs.append(spawn(args, tmp_path, f"{name}.log"))
        stranger = run_cli([*join, "--identity", "c.id"], tmp_path, timeout=120)  # no certificate
        for name, proc in zip("ab", procs, strict=True):
            assert proc.wait(timeout=300) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        for proc in [*procs, boot.proc]:
            end_group(proc)
    assert stranger.returncode != 0
    error = stranger.stderr.strip().splitlines()[-1]
    assert error.startswith("error: ") and "--certificate" in error and "Traceback" not in stranger.stderr
    summaries = [records(tmp_path / f"{name}.jsonl")[-1] for name in "ab"]
    assert summaries[0]["global_params_sha256"] == summaries[1]["global_params_sha256"]
    assert all(s["rounds_done"] > 0 and s["rounds_failed"] == 0 for s in summaries)
