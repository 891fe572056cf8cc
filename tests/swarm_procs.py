"""Real OS processes for swarm tests: a bootstrap node and peers on 127.0.0.1, each in its own
process group so a test can always end everything it started."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import forkserver
from tests.tiny_options import TINY

CLI_MODULE = "p2p_cocodc"
CLI = [sys.executable, "-m", CLI_MODULE]
HOSTILE = [sys.executable, "-m", "tests.hostile_peer"]  # a member with one behaviour changed: + MODES
REPO = Path(__file__).resolve().parent.parent
# One torch thread per process: several peers share 2 cores here.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 now: all are held at once while they are picked, so
    two of them are never the same port (one at a time, the kernel may hand out a port twice)."""
    with ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def free_port() -> int:
    return free_ports(1)[0]


def records(path: Path) -> list[dict]:
    """The records of a run's --out file (JSON lines)."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def torchrun(args: list[str], port: int, ranks: int = 2) -> list[str]:
    """``torchrun --nproc-per-node RANKS -m p2p_cocodc ARGS`` on 127.0.0.1, as a command line."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1"]
    launcher += [
        "--nproc-per-node",
        str(ranks),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--tee",
        "3",
    ]
    return [*launcher, "-m", "p2p_cocodc", *args]


def run_cli(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """``p2p-cocodc ARGS`` to completion in a process of its own (forked warm: tests/forkserver.py),
    output captured."""
    return forkserver.run(CLI_MODULE, args, cwd, ENV, timeout)


def run_here(
    args: list[str], cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``p2p-cocodc ARGS`` run to completion in this process, in ``cwd`` and with ``env`` set in the
    environment meanwhile, output captured as a subprocess's would be: for the runs whose process is
    not what a test checks (the simulator as an oracle, a refused option), which need no process of
    their own (a fresh one spends about 3 s of CPU on imports first, a forked one still a fork and
    hivemind's import). The simulator is deterministic on one thread, and this process runs torch on
    one (tests/conftest.py)."""
    from p2p_cocodc.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    code: int | str | None = 0
    with contextlib.ExitStack() as scope:
        patch = scope.enter_context(pytest.MonkeyPatch.context())
        for name, value in (env or {}).items():
            patch.setenv(name, value)
        scope.enter_context(contextlib.chdir(cwd))
        scope.enter_context(contextlib.redirect_stdout(out))
        scope.enter_context(contextlib.redirect_stderr(err))
        try:
            main(args)
        except SystemExit as stop:
            code = stop.code
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def simulate_here(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``p2p-cocodc simulate ARGS`` in this process (``run_here``): the oracle of a swarm test."""
    return run_here(["simulate", *args], cwd)


def spawn(
    args: list[str],
    cwd: Path,
    log_name: str,
    prefix: Sequence[str] = (),
    command: Sequence[str] = CLI,
) -> subprocess.Popen | forkserver.Forked:
    """``p2p-cocodc ARGS`` (or ``command`` ARGS) in its own process group, output to ``log_name``;
    ``prefix`` runs it through a command such as ``ip netns exec NS`` (which execs it: the group
    stays the same). A ``python -m`` command is forked from a warm server (``tests/forkserver.py``:
    the same process, less about 2 s of CPU for its imports); one with a prefix is a new process."""
    log = open(cwd / log_name, "w")  # noqa: SIM115 - the process owns it until it ends
    if not prefix and list(command[:2]) == [sys.executable, "-m"]:
        with log:
            module, *given = command[2:]
            return forkserver.start(module, [*given, *args], cwd, ENV, log.fileno(), log.fileno())
    return subprocess.Popen(
        [*prefix, *command, *args],
        cwd=cwd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=ENV,
        start_new_session=True,
    )


@contextmanager
def busy_core() -> Iterator[subprocess.Popen]:
    """One core of this machine kept busy while open (a spinning Python process, as other work on a
    shared machine would), ended by its pid on the way out."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        yield spinner
    finally:
        spinner.kill()
        spinner.wait()


def end_group(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """End what the test started (never anything else): SIGTERM to the main process, which shuts
    hivemind down and removes its socket files, then SIGKILL to its group after ``grace_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    if group_members(proc.pid):
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def socket_files(pids: list[int]) -> list[Path]:
    """The unix socket files p2pd daemons among ``pids`` listen on (from their command lines)."""
    paths = []
    for pid in pids:
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for arg in args:
            if arg.startswith(b"-listen=/unix/"):
                paths.append(Path(arg.decode()[len("-listen=/unix") :]))
    return paths


def sigkill_like_a_crash(pid: int) -> list[int]:
    """SIGKILL ``pid`` alone, as a crash or the OOM killer would; its helpers (DHT process, p2pd) must
    die by their death signal. Returns them once they have, after removing the socket files their
    killed p2pd could not remove itself."""
    helpers = descendants(pid)
    sockets = socket_files(helpers)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not any(map(is_live, helpers)), 10, "helpers to die")  # their reaping is init's
    for path in sockets:
        path.unlink(missing_ok=True)
    return helpers


def is_live(pid: int) -> bool:
    """Whether ``pid`` runs: it exists and is not a zombie (dead, waiting to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, read from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def descendants(pid: int) -> list[int]:
    """Live processes whose parent chain reaches ``pid``."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(entry.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


@dataclass
class Bootstrap:
    proc: subprocess.Popen
    maddr: str
    host_port: str


def start_bootstrap(
    cwd: Path,
    host: str = "127.0.0.1",
    prefix: Sequence[str] = (),
    extra: Sequence[str] = (),
    ports: tuple[int, int] | None = None,
) -> Bootstrap:
    """``ports``: its libp2p and status ports (default: 0, so the bootstrap binds free ones itself,
    with no window in which another process may take a port picked for it; its address file says
    which)."""
    port, status_port = ports or (0, 0)
    argv = ["bootstrap", "--host", host, "--port", str(port), "--status-port", str(status_port)]
    argv += ["--identity", str(cwd / "bootstrap.id"), "--address-file", str(cwd / "bootstrap.json")]
    proc = spawn([*argv, *extra], cwd, "bootstrap.log", prefix)
    address = cwd / "bootstrap.json"

    def ready() -> dict | None:
        if proc.poll() is not None:
            pytest.fail(f"bootstrap exited: {(cwd / 'bootstrap.log').read_text()[-2000:]}")
        return json.loads(address.read_text()) if address.exists() else None

    info = wait_for(ready, 60, "the bootstrap's address file")
    return Bootstrap(proc, info["maddrs"][0], info["join"])


def train_swarm(workdir: Path, options: list[str], own: list[list[str]], timeout: float) -> list[dict]:
    """A bootstrap in ``workdir`` (made here) and one ``join OPTIONS OWN[i] --shard i/N`` per entry of
    ``own``, writing peerI.jsonl and peerI.log, waited for and ended; their summaries (RuntimeError
    naming the folder when one did not exit 0)."""
    workdir.mkdir(parents=True)
    boot = start_bootstrap(workdir)
    procs = []
    try:
        for i, extra in enumerate(own):
            args = ["join", "--bootstrap", boot.host_port, *options, *extra]
            args += ["--shard", f"{i}/{len(own)}", "--out", f"peer{i}.jsonl", "--quiet"]
            procs.append(spawn(args, workdir, f"peer{i}.log"))
        codes = [proc.wait(timeout=timeout) for proc in procs]
    finally:
        for proc in [*procs, boot.proc]:
            end_group(proc)
    if codes != [0] * len(own):
        raise RuntimeError(f"peers exited {codes}; see {workdir}")
    return [records(workdir / f"peer{i}.jsonl")[-1] for i in range(len(own))]


def evals(path: Path) -> int:
    """How many evaluations of θ̄ a peer has written: how far its training has come."""
    return sum(r["kind"] == "eval" for r in records(path)) if path.exists() else 0


def run_peers(boot_status: str, run_id: str) -> dict:
    """The peers of ``run_id`` on the bootstrap's /status (peer id -> what it shows of the peer)."""
    with urllib.request.urlopen(f"http://{boot_status}/status", timeout=10) as reply:
        return json.load(reply)["runs"].get(run_id, {}).get("peers") or {}


def round_leader_shard(boot_status: str, run_id: str) -> int:
    """The shard of the peer with the smallest id on the bootstrap's /status (it leads about a third
    of the rounds: the line is a hash of round and id), once /status lists the run."""
    found = wait_for(lambda: run_peers(boot_status, run_id), 30, f"run {run_id} on the bootstrap's /status")
    return found[min(found)]["shard"]


def start_three_training(
    tmp_path: Path, boot: Bootstrap, run_id: str, steps: int, peers: list[subprocess.Popen], *extra: str
) -> list[Path]:
    """Three cocodc peers on shards 0-2 (appended to ``peers`` as they start, so the caller ends
    them whatever happens), returned once each has written a few records: training is under way.
    ``extra`` options may name the peer's index as {i}. They keep the configured send pace (on this
    loaded machine, slow acknowledgements can pace a run): the tests count the syncs done."""
    for i in range(3):
        args = ["join", "--bootstrap", boot.maddr, "--algo", "cocodc", *TINY, "--steps", str(steps)]
        args += ["--shard", f"{i}/3", "--out", f"peer{i}.jsonl", "--run-id", run_id, "--verbose"]
        args += ["--pace", "fixed"]
        args += [option.format(i=i) for option in extra]
        peers.append(spawn(args, tmp_path, f"peer{i}.log"))
    outs = [tmp_path / f"peer{i}.jsonl" for i in range(3)]
    wait_for(lambda: all(evals(o) >= 2 for o in outs), 120, "training to be under way")
    return outs


def joined_at(path: Path) -> dict | None:
    """The join record a peer writes for itself once it has the swarm's state (a joiner's, step > 0)."""
    mine = [r for r in records(path) if r["kind"] == "join"] if path.exists() else []
    return next((r for r in mine if r["step"] > 0), None)


def assert_replayed(tmp_path: Path, options: list[str], theta: str, events: str = "peer0.jsonl") -> None:
    """``simulate --algo cocodc OPTIONS`` replays a founder's records (rounds, joins) to ``theta``."""
    sim = simulate_here(["--algo", "cocodc", *options, "--events", events, "--out", "replay.jsonl"], tmp_path)
    assert sim.returncode == 0, sim.stderr
    assert records(tmp_path / "replay.jsonl")[-1]["global_params_sha256"] == theta


def thread_niceness(pid: int) -> dict[int, int]:
    """Every thread of process ``pid`` (listed in /proc/PID/task) with its niceness."""
    return {
        int(t.name): os.getpriority(os.PRIO_PROCESS, int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir()
    }
