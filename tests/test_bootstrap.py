"""``p2p-cocodc bootstrap`` run for real as ``python -m p2p_cocodc`` in its own process group.

No mocks: the bootstrap's DHT, p2pd and HTTP server are real, and a second real DHT in this process
publishes a record into it. Each test kills what it started by process group, whatever happens.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import closing, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from p2p_cocodc.errors import UserError
from p2p_cocodc.swarm.dht import p2pd_socket, parse_bootstrap, start_dht, stop_dht
from p2p_cocodc.swarm.records import Board, PeerRecord
from tests.swarm_procs import end_group, free_port, free_ports, wait_for

START_DEADLINE_S = 60.0


def bootstrap_cmd(*args: Any) -> list[str]:
    return [sys.executable, "-m", "p2p_cocodc", "bootstrap", *map(str, args)]


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@dataclass
class Bootstrap:
    """A running bootstrap process, started in its own session so its whole group can be killed."""

    cwd: Path
    port: int
    status_port: int
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> dict[str, Any]:
        """Start it and return the address file's contents once it appears."""
        address_file = self.cwd / "bootstrap.json"
        with suppress(FileNotFoundError):
            address_file.unlink()
        # Files, not pipes: torch_shm_manager (hivemind's shared memory) would hold a pipe open for ~2 s
        # after the bootstrap exits, in a session of its own, and make communicate() wait for it.
        with open(self.cwd / "out.txt", "wb") as out, open(self.cwd / "err.txt", "wb") as err:
            self.proc = subprocess.Popen(
                bootstrap_cmd(
                    "--port",
                    self.port,
                    "--status-port",
                    self.status_port,
                    "--refresh",
                    0.2,
                    "--state-dir",
                    self.cwd,
                ),
                cwd=self.cwd,
                env=env(),
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_DEADLINE_S
        while not address_file.exists():
            if self.proc.poll() is not None:
                pytest.fail(f"bootstrap exited with {self.proc.returncode}: {self.output()}")
            assert time.monotonic() < deadline, "no address file within the deadline"
            time.sleep(0.1)
        return json.loads(address_file.read_text())

    def get(self, path: str) -> tuple[int, Any]:
        url = f"http://127.0.0.1:{self.status_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def terminate(self, group: bool = False, timeout: float = 30.0) -> tuple[int, str, str]:
        """SIGTERM to the main process (``kill PID``) or to its whole group, as systemd's
        KillMode=control-group sends it, DHT process and p2pd included."""
        assert self.proc is not None
        if group:
            os.killpg(self.proc.pid, signal.SIGTERM)
        else:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=timeout)
        return code, *self.output()

    def output(self) -> tuple[str, str]:
        return (self.cwd / "out.txt").read_text(), (self.cwd / "err.txt").read_text()

    def kill_group(self) -> None:
        if self.proc is not None:
            with suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)


@pytest.fixture(scope="module")
def boot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bootstrap]:
    """One bootstrap shared by the tests below; the last test stops and restarts it."""
    b = Bootstrap(tmp_path_factory.mktemp("boot"), *free_ports(2))
    try:
        b.start()
        yield b
    finally:
        b.kill_group()


def group_members(pgid: int) -> list[int]:
    """Pids (zombies aside) whose process group is pgid."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with suppress(OSError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()  # after "(comm)": state, ppid, pgrp, ...
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry))
    return pids


def assert_group_gone(pgid: int) -> None:
    """The DHT process and p2pd went with the main process."""
    deadline = time.monotonic() + 5
    while group_members(pgid):
        assert time.monotonic() < deadline, f"left behind: {group_members(pgid)}"
        time.sleep(0.1)


def test_addresses_are_served_and_resolvable(boot: Bootstrap) -> None:
    address = json.loads((boot.cwd / "bootstrap.json").read_text())
    assert address["maddrs"] and all("/p2p/" in m for m in address["maddrs"])
    assert address["maddrs"][0].startswith(f"/ip4/127.0.0.1/tcp/{boot.port}/p2p/{address['peer_id']}")
    assert address["join"] == f"127.0.0.1:{boot.status_port}" and address["key_id"] == "open"

    code, health = boot.get("/health")
    assert code == 200 and health["ok"] is True and health["dht_alive"] is True
    assert health["uptime_s"] >= 0
    code, served = boot.get("/address")
    assert code == 200 and served == {k: address[k] for k in ("maddrs", "peer_id", "key_id")}
    assert parse_bootstrap(f"127.0.0.1:{boot.status_port}") == (address["maddrs"], "open")
    code, missing = boot.get("/nope")
    assert code == 404 and "error" in missing


def test_the_libp2p_port_given_for_the_status_port_gets_one_line_naming_both(boot: Bootstrap) -> None:
    """Its status port is neither the default one nor the next one: nothing to find it by."""
    with pytest.raises(UserError, match="is the bootstrap's libp2p port: give its status port") as raised:
        parse_bootstrap(f"127.0.0.1:{boot.port}")
    assert "\n" not in str(raised.value)


def test_an_open_bootstrap_says_so_at_start(boot: Bootstrap) -> None:
    assert "open: any peer that reaches this bootstrap may join" in boot.output()[1]


def test_status_shows_a_run_published_by_a_peer(boot: Bootstrap) -> None:
    maddrs = json.loads((boot.cwd / "bootstrap.json").read_text())["maddrs"]
    record = PeerRecord(
        state="training",
        step=7,
        shard=1,
        num_shards=2,
        step_time_s=0.25,
        bandwidth_mbps=12.5,
        fingerprint="f" * 16,
        versions=[3, 4],
        stall_s=0.5,
        bytes_sent=1234,
    )
    dht = start_dht(maddrs, "127.0.0.1", 0)
    socket_path = p2pd_socket(dht)
    me = dht.peer_id.to_base58()  # a record's subkey is its writer's id
    try:
        asyncio.run(Board(dht, "r1", me, ttl_s=30).publish(record, run_info={"algo": "cocodc", "workers": 2}))
        deadline = time.monotonic() + 20
        while True:
            code, status = boot.get("/status")
            assert code == 200
            if me in status["runs"].get("r1", {}).get("peers", {}):
                break
            assert time.monotonic() < deadline, f"run r1 never showed up: {status}"
            time.sleep(0.2)
    finally:
        stop_dht(dht, socket_path)  # shutdown, and p2pd's socket file out of /tmp
    run = status["runs"]["r1"]
    assert run["info"] == {"algo": "cocodc", "workers": 2}
    expected = record.to_wire()
    del expected["fingerprint"], expected["ttl_s"]  # /status leaves both out
    seen = run["peers"][me]
    assert 0 <= seen.pop("age_s") < 30 and seen.pop("health") == []  # what the bootstrap adds (watch.py)
    assert seen == expected
    assert isinstance(status["updated_at"], float)


def test_sigterm_exits_cleanly_and_a_restart_keeps_the_peer_id(boot: Bootstrap) -> None:
    assert boot.proc is not None
    before = json.loads((boot.cwd / "bootstrap.json").read_text())
    start = time.monotonic()
    code, out, err = boot.terminate()
    assert code == 0, err
    assert time.monotonic() - start < 30  # a bound on a hang, not a speed target (loaded CI machines)
    assert f"p2p-cocodc join --bootstrap 127.0.0.1:{boot.status_port}" in out
    assert f"p2p-cocodc join --bootstrap {before['maddrs'][0]}" in out
    assert "Traceback" not in err
    assert_group_gone(boot.proc.pid)

    after = boot.start()  # same --state-dir, so the same bootstrap.id
    assert after["peer_id"] == before["peer_id"]
    assert after["maddrs"] == before["maddrs"]
    code, _, err = boot.terminate(group=True)
    assert code == 0, err
    assert "Traceback" not in err
    assert_group_gone(boot.proc.pid)


def test_bad_port_is_one_line_error(tmp_path: Path) -> None:
    proc = subprocess.run(
        bootstrap_cmd("--port", 70000, "--state-dir", tmp_path),
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "--port" in lines[0], proc.stderr
    assert not (tmp_path / "bootstrap.id").exists()


def test_status_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.Popen(
            bootstrap_cmd("--port", free_port(), "--status-port", port, "--state-dir", tmp_path),
            cwd=tmp_path,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            _, err = proc.communicate(timeout=60)
        finally:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 2
    assert f"error: --status-port {port} is in use" in err and "Traceback" not in err


def test_an_identity_a_live_peer_uses_is_refused_with_one_line(tmp_path: Path) -> None:
    """Two processes started with one --identity: the second is refused (hivemind finds the id
    live through its initial peers), naming the file, instead of two daemons with one peer id."""
    identity = str(tmp_path / "peer.id")
    first = start_dht([], "127.0.0.1", 0, identity_path=identity)
    first_socket = p2pd_socket(first)
    try:
        with pytest.raises(UserError, match=r"--identity .*peer\.id: a running peer of this swarm already"):
            start_dht([str(first.get_visible_maddrs()[0])], "127.0.0.1", 0, identity_path=identity)
    finally:
        stop_dht(first, first_socket)


def test_the_bootstrap_keeps_its_files_in_its_state_folder_not_where_it_is_started(tmp_path: Path) -> None:
    """Without --identity, --address-file or --state-dir, its key and address file go to
    $XDG_STATE_HOME/p2p-cocodc (created, mode 700: it holds the private key), none to the working
    directory; it says where, and prints its status page, not the page's JSON."""
    here, state = tmp_path / "here", tmp_path / "xdg" / "p2p-cocodc"
    here.mkdir()
    port, status_port = free_ports(2)
    with open(tmp_path / "out.txt", "wb") as out:
        proc = subprocess.Popen(
            bootstrap_cmd("--port", port, "--status-port", status_port),
            cwd=here,
            env={**env(), "XDG_STATE_HOME": str(tmp_path / "xdg")},
            stdout=out,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:

        def printed() -> str | None:
            if proc.poll() is not None:
                pytest.fail(f"bootstrap exited: {(tmp_path / 'out.txt').read_text()[-2000:]}")
            text = (tmp_path / "out.txt").read_text()
            return text if "peers join with any of" in text else None

        text = wait_for(printed, START_DEADLINE_S, "the bootstrap's join lines")
    finally:
        end_group(proc)
    assert list(here.iterdir()) == []
    assert (state / "bootstrap.id").is_file() and (state / "bootstrap.json").is_file()
    assert state.stat().st_mode & 0o777 == 0o700
    assert f"(identity {state / 'bootstrap.id'})" in text
    assert (
        f"status page http://127.0.0.1:{status_port}/; addresses written to {state / 'bootstrap.json'}"
        in text
    )


def test_state_dir_and_explicit_files_win_over_the_default_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from p2p_cocodc.config.bootstrap import bootstrap_options

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert bootstrap_options({}, {}, "x").identity_path == str(
        tmp_path / "xdg" / "p2p-cocodc" / "bootstrap.id"
    )
    monkeypatch.setenv("XDG_STATE_HOME", "relative")  # ignored, as the XDG base directories say
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    home_state = tmp_path / "home" / ".local" / "state" / "p2p-cocodc"
    assert bootstrap_options({}, {}, "x").address_path == str(home_state / "bootstrap.json")

    # --state-dir (here from the file), and --identity beside it
    opts = bootstrap_options({"state-dir": str(tmp_path / "s")}, {"identity": str(tmp_path / "b.id")}, "x")
    assert opts.validate().identity_path == str(tmp_path / "b.id")
    assert opts.address_path == str(tmp_path / "s" / "bootstrap.json")
    opts.make_state_dir()
    assert (tmp_path / "s").is_dir() and not home_state.exists()

    given = {"identity": str(tmp_path / "b.id"), "address_file": str(tmp_path / "b.json")}
    explicit = bootstrap_options({}, {**given, "state_dir": str(tmp_path / "unused")}, "x").validate()
    explicit.make_state_dir()
    assert not (tmp_path / "unused").exists()
    with pytest.raises(UserError, match="--state-dir /dev/null is a file, not a folder"):
        bootstrap_options({}, {"state_dir": "/dev/null"}, "x").validate()


def test_a_stop_whose_cancel_a_dht_call_swallowed_still_exits_0(monkeypatch) -> None:
    """The schedule of a CI failure: SIGTERM to the bootstrap's group cancels the serving loop while
    a board read is under way, the read swallows the cancel (3.11's ``wait_for`` can, when its inner
    call ends at the same moment), and the DHT process, signalled too, is gone when the loop looks
    again: that is a stop (0), not the DHT's death (1, after ``DEAD_GRACE_S``)."""
    from p2p_cocodc.ops import bootstrap

    class GoneWithTheGroup:
        alive = True

        def is_alive(self) -> bool:
            return self.alive

    dht = GoneWithTheGroup()
    reading = asyncio.Event()

    async def swallowing_read(*args: Any) -> bool:
        reading.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            dht.alive = False  # the same signal ended the DHT process
        return False

    async def main() -> int:
        task = asyncio.ensure_future(bootstrap.watch(dht, "me", bootstrap.Snapshot({}), 0.01))
        await reading.wait()
        task.cancel()  # what the stop signal's handler does
        return await asyncio.wait_for(task, 2 * bootstrap.DEAD_GRACE_S)

    monkeypatch.setattr(bootstrap, "refresh", swallowing_read)
    handlers = {sig: signal.getsignal(sig) for sig in bootstrap.STOP_SIGNALS}
    try:
        assert asyncio.run(main()) == 0
    finally:
        for sig, handler in handlers.items():  # watch() sets its own, then ignores both on its way out
            signal.signal(sig, handler)
