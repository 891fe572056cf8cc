"""``join --check`` against a real bootstrap (its own process), and the bootstrap's dial-back.

Real p2pd, real DHT, real dial-back: ``p2p-cocodc join --check`` as a user runs it where the exit
code and output are the point, the checks in this process (``run_checks``) where only their lines
are, which spares a Python start and torch's import. The bootstrap's status port is the one after
its libp2p port, so that its libp2p port works after ``--bootstrap HOST:`` too.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from p2p_cocodc.config.join import swarm_options
from p2p_cocodc.config.train import build_config
from p2p_cocodc.errors import UserError
from p2p_cocodc.ops.preflight import run_checks
from p2p_cocodc.swarm.dht import (
    STATUS_PORT,
    find_bootstrap,
    p2pd_socket,
    split_host_port,
    start_dht,
    stop_dht,
)
from p2p_cocodc.swarm.dial_back import MIN_INTERVAL_S
from tests.swarm_procs import Bootstrap, end_group, free_port, run_cli, start_bootstrap

CHECK_DEADLINE_S = 60.0  # one `join --check`, Python's start and p2pd's included


def adjacent_free_ports() -> tuple[int, int]:
    """A free port and the free one after it."""
    for _ in range(100):
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port, port + 1
    pytest.fail("no two adjacent free ports")


@pytest.fixture(scope="module")
def boot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Bootstrap, int]]:
    """A bootstrap, and its libp2p port."""
    cwd = tmp_path_factory.mktemp("preflight")
    port, status_port = adjacent_free_ports()
    bootstrap = start_bootstrap(cwd, ports=(port, status_port))
    try:
        yield bootstrap, port
    finally:
        end_group(bootstrap.proc)


def check(bootstrap: str, *args: str, cwd: Path) -> tuple[int, list[str], list[str]]:
    """``join --check``: exit code, stdout lines, stderr lines; within the deadline."""
    start = time.monotonic()
    proc = run_cli(["join", "--check", "--bootstrap", bootstrap, *args], cwd, CHECK_DEADLINE_S)
    assert time.monotonic() - start < CHECK_DEADLINE_S
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, proc.stdout.splitlines(), proc.stderr.splitlines()


def checks_here(bootstrap: str, **options: object) -> dict[bool | None, list[str]]:
    """``run_checks`` in this process: the lines of the checks that passed (True), failed (False)
    and could not run (None)."""
    said: dict[bool | None, list[str]] = {True: [], False: [], None: []}
    opts = swarm_options({}, {"bootstrap": bootstrap, **options})
    start = time.monotonic()
    all_passed = run_checks(build_config({}, {}), opts, lambda passed, line: said[passed].append(line))
    assert time.monotonic() - start < CHECK_DEADLINE_S
    assert all_passed == (not said[False])
    return said


def test_a_peer_that_can_join_passes_every_check(boot: tuple[Bootstrap, int], tmp_path: Path) -> None:
    bootstrap, _ = boot
    port = free_port()
    code, out, err = check(bootstrap.host_port, "--port", str(port), cwd=tmp_path)
    assert code == 0, err
    assert err == []
    assert all(line.startswith("ok: ") for line in out[:-1]), out
    assert f"ok: 127.0.0.1:{port} is free" in out
    assert any(line.startswith("ok: the bootstrap's DHT node answers at /ip4/127.0.0.1/") for line in out)
    assert f"ok: the bootstrap reached this peer at /ip4/127.0.0.1/tcp/{port}: other peers can" in out
    assert out[-1] == "this peer can join: run the same command without --check"


def test_a_taken_port_fails_with_one_line_and_code_2(boot: tuple[Bootstrap, int], tmp_path: Path) -> None:
    bootstrap, _ = boot
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = check(bootstrap.host_port, "--port", str(port), cwd=tmp_path)
    assert code == 2
    assert err == [
        f"error: --port {port} is in use on 127.0.0.1: another peer, bootstrap or program listens there; "
        "give each one on a machine its own --port (the peer profiles use 31401-31403)"
    ]
    assert f"ok: the bootstrap's status server answers at {bootstrap.host_port}" in out


def test_a_port_another_p2pd_holds_is_refused_before_a_second_one_starts() -> None:
    """p2pd would share it (SO_REUSEPORT) and each peer would dial itself: join, bootstrap and demo
    all start their DHT through start_dht, which refuses."""
    port = free_port()
    first = start_dht([], "127.0.0.1", port)
    try:
        with pytest.raises(UserError, match=f"--port {port} is in use on 0.0.0.0: another peer, bootstrap"):
            start_dht([], "0.0.0.0", port)
    finally:
        stop_dht(first, p2pd_socket(first))


def test_a_dead_bootstrap_fails_with_one_line() -> None:
    nobody = f"127.0.0.1:{free_port()}"
    said = checks_here(nobody)
    assert said[False] == [
        f"--bootstrap {nobody}: no p2p-cocodc bootstrap answers at http://{nobody}/address "
        "(connection refused); is it running, and is that the HOST:PORT it printed?"
    ]
    assert any(line.startswith("p2pd listens") for line in said[True]), said  # not resting on the bootstrap


def test_an_unreachable_address_fails_with_what_to_fix(boot: tuple[Bootstrap, int]) -> None:
    """p2pd listens on 127.0.0.1 but announces 127.0.0.2: the bootstrap's dial-back is refused."""
    bootstrap, _ = boot
    port = free_port()
    said = checks_here(bootstrap.host_port, port=port, announce="127.0.0.2")
    assert said[False] == [
        f"other peers cannot reach you at /ip4/127.0.0.2/tcp/{port}: --host 127.0.0.1 takes "
        "connections from this machine only: use --host 0.0.0.0 and open the port in your firewall or set "
        "--announce to your public address"
    ]
    assert any(line.startswith("the bootstrap's DHT node answers") for line in said[True]), said


def test_a_multiaddr_bootstrap_without_its_status_server_skips_only_the_dial_back(
    boot: tuple[Bootstrap, int],
) -> None:
    """Its status port is not the default one: nothing to ask for a dial-back, and the check says so."""
    bootstrap, _ = boot
    said = checks_here(bootstrap.maddr)
    assert said[False] == []
    assert any(line.startswith("the bootstrap's DHT node answers") for line in said[True]), said
    assert len(said[None]) == 1 and said[None][0].startswith("not checked whether other peers can reach")


def test_the_bootstraps_libp2p_port_finds_its_status_port(boot: tuple[Bootstrap, int]) -> None:
    bootstrap, port = boot
    assert find_bootstrap(f"127.0.0.1:{port}") == find_bootstrap(bootstrap.host_port)
    assert find_bootstrap(f"127.0.0.1:{port}")[0] == bootstrap.host_port


def test_the_bootstrap_is_asked_directly_whatever_http_proxy_says(
    boot: tuple[Bootstrap, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    bootstrap, _ = boot
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{free_port()}")  # no proxy listens there
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    assert find_bootstrap(bootstrap.host_port)[0] == bootstrap.host_port


def test_a_host_alone_means_the_default_status_port() -> None:
    assert split_host_port("boot.example.org") == ("boot.example.org", STATUS_PORT)
    assert split_host_port("203.0.113.10:41338") == ("203.0.113.10", 41338)
    assert split_host_port("[2001:db8::1]") == ("2001:db8::1", STATUS_PORT)
    assert split_host_port("2001:db8::1") == ("2001:db8::1", STATUS_PORT)
    assert split_host_port("[2001:db8::1]:41338") == ("2001:db8::1", 41338)
    for bad in ("host:", "host:0", "host:70000", "http://host:31338", ":31338"):
        with pytest.raises(UserError, match="give the HOST:PORT"):
            split_host_port(bad)


def reach(bootstrap: Bootstrap, peer_id: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://{bootstrap.host_port}/reach/{peer_id}", timeout=20) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_dial_back_takes_only_connected_peer_ids_and_is_rate_limited(boot: tuple[Bootstrap, int]) -> None:
    """Anyone may ask, so it dials no address it is given and no peer that is not connected to it."""
    bootstrap, _ = boot
    assert reach(bootstrap, "ip4/198.51.100.7/tcp/80")[0] == 400  # an address is no peer id
    assert reach(bootstrap, "not-a-peer-id")[0] == 400
    stranger = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # a well-formed id nobody connected with
    deadline = time.monotonic() + 10 * MIN_INTERVAL_S
    while True:  # another test's dial-back may have been the last one: wait for our turn
        sent = time.monotonic()
        code, answer = reach(bootstrap, stranger)
        if code != 429:
            break
        assert time.monotonic() < deadline, answer
        time.sleep(0.1)
    assert (code, answer) == (200, {"peer_id": stranger, "result": "unknown"})
    code, answer = reach(bootstrap, stranger)
    # two dial-backs start at least MIN_INTERVAL_S apart: the second is refused, or came that much later
    assert code == 429 or time.monotonic() - sent >= MIN_INTERVAL_S, (code, answer)
    assert code in (200, 429)


def test_join_asks_the_bootstrap_before_it_builds_the_model() -> None:
    """A dead --bootstrap fails in a second, not after the model's and data's set-up: the model here
    would fail that set-up with another error."""
    from p2p_cocodc.peer.node import Peer

    nobody = f"127.0.0.1:{free_port()}"
    cfg = build_config({}, {"model": "tests.plugin_models:missing_unit", "tokenizer": "byte"})
    with pytest.raises(UserError, match=f"--bootstrap {nobody}: no p2p-cocodc bootstrap answers"):
        Peer(cfg, swarm_options({}, {"bootstrap": nobody}))
