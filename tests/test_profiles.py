"""The ready region profiles in peers/ and the [swarm] table of a profile."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest

from p2p_cocodc.config.join import swarm_options
from p2p_cocodc.config.train import SWARM_TABLE, build_config, load_toml, read_toml
from p2p_cocodc.errors import UserError

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
