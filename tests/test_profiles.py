"""The ready region profiles in peers/ and the [swarm] table of a profile."""

from __future__ import annotations

import socket
from dataclasses import asdict
from pathlib import Path

import pytest

from p2p_cocodc.config.join import swarm_options
from p2p_cocodc.config.train import SWARM_TABLE, build_config, load_toml, read_toml
from p2p_cocodc.errors import UserError
from tests.swarm_procs import free_port, run_cli
from tests.tiny_options import TWO_PEERS

PROFILES = sorted((Path(__file__).parent.parent / "peers").glob("*.toml"))


def test_region_profiles_share_training_options_and_split_the_data() -> None:
    assert len(PROFILES) >= 3
    shared = []
    shards = []
    ports = []
    for path in PROFILES:
        cfg = asdict(build_config(load_toml(path), {}))
        shared.append({k: v for k, v in cfg.items() if k not in ("out", "save")})
        opts = swarm_options(read_toml(path)[SWARM_TABLE], {"bootstrap": "127.0.0.1:31338"})
        assert opts.shard is not None and opts.shard[1] == cfg["workers"]
        shards.append(opts.shard[0])
        ports.append(opts.port)
    assert all(s == shared[0] for s in shared), "regions would refuse to train together"
    assert sorted(shards) == list(range(len(PROFILES)))
    assert len(set(ports)) == len(PROFILES) and 0 not in ports, "on one machine they would share a port"


def test_command_line_overrides_the_swarm_table() -> None:
    opts = swarm_options({"run-id": "a", "port": 4000, "wait-peers": 5}, {"port": 4001, "bootstrap": "h:1"})
    assert (opts.run_id, opts.port, opts.wait_peers_s, opts.bootstrap) == ("a", 4001, 5.0, "h:1")


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"bootstrap": "h:1", "colour": "red"}, "unknown key 'colour'"),
        ({"bootstrap": "h:1", "port": "eighty"}, "--port must be int, got 'eighty'"),
        ({"bootstrap": "h:1", "wait-peers": True}, "--wait-peers must be float, got True"),
        ({"bootstrap": "h:1", "pace": "slow"}, "unknown --pace 'slow': use one of link, fixed"),
        ({"bootstrap": "h:1", "shard": "1-3"}, "--shard '1-3'"),
        ({"bootstrap": "h:1", "round-timeout": 0}, "must be > 0"),
        ({}, "join needs --bootstrap"),
    ],
)
def test_bad_swarm_tables_say_what_to_fix(table: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        swarm_options(table, {})


def test_a_region_profile_listens_on_this_machine_only_unless_told() -> None:
    """A run on one machine binds 127.0.0.1; peers on other machines need --host 0.0.0.0 (given)."""
    for path in PROFILES:
        table = read_toml(path)[SWARM_TABLE]
        assert swarm_options(table, {"bootstrap": "127.0.0.1:31338"}).host == "127.0.0.1", path
        given = {"bootstrap": "203.0.113.10:31338", "host": "0.0.0.0", "announce": "203.0.113.20"}
        assert swarm_options(table, given).host == "0.0.0.0"


def test_a_taken_port_the_profile_sets_says_the_regions_peer_is_probably_running(tmp_path: Path) -> None:
    """The port of the profile taken: most likely by this region's own peer, so the line says so and
    how to check; a --port the user chose, taken, is the plain line (another program holds it)."""
    profile = tmp_path / "eu-west.toml"
    bootstrap = f"127.0.0.1:{free_port()}"  # nobody: the port is refused before it is asked
    join = ["join", "--config", str(profile), "--bootstrap", bootstrap, *TWO_PEERS]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        profile.write_text(f'[swarm]\nrun-id = "r1"\nport = {port}\n', encoding="utf-8")
        ours = run_cli(join, tmp_path, 120)
        checked = run_cli([*join, "--check"], tmp_path, 120)
        profile.write_text(f'[swarm]\nrun-id = "r1"\nport = {free_port()}\n', encoding="utf-8")
        chosen = run_cli([*join, "--port", str(port)], tmp_path, 120)
    expected = (
        f"error: --port {port} is in use on 127.0.0.1: it is the port {profile} sets, so this region's "
        "peer (eu-west) is probably running already; check with `p2p-cocodc status --bootstrap "
        f"{bootstrap} --run-id r1` or its unit (`systemctl status p2p-cocodc-peer@eu-west`); for a "
        "second peer here, give it another --port"
    )
    assert ours.returncode == 2 and ours.stderr.strip().splitlines() == [expected], ours.stderr
    assert checked.returncode == 2 and expected in checked.stderr.splitlines(), checked.stderr
    assert chosen.returncode == 2 and chosen.stderr.strip().splitlines() == [
        f"error: --port {port} is in use on 127.0.0.1: another peer, bootstrap or program listens there; "
        "give each one on a machine its own --port (the peer profiles use 31401-31403)"
    ], chosen.stderr
