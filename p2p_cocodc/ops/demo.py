"""``p2p-cocodc demo``: a whole swarm on this machine — one bootstrap and N peers on 127.0.0.1.

The peers are real OS processes started exactly as a user would start them (``bootstrap`` and ``join``),
so the demo exercises the real DHT, the real transfers and the real shutdown paths. Each child gets its
own process group, so one ``killpg`` reaches the child and the helpers it forks (DHT process, p2pd), and
the demo only ever signals groups it started itself.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from p2p_cocodc.errors import UserError
from p2p_cocodc.ops.progress import Progress, progress_bars

HOST = "127.0.0.1"
RUN_ID = "demo"
BOOTSTRAP_READY_S = 60.0  # hivemind's p2pd usually answers in a few seconds
POLL_S = 0.5
STATUS_EVERY_S = 1.0  # the bootstrap refreshes its /status snapshot about this often
TERM_GRACE_S = 15.0  # a peer on SIGTERM finishes its step, writes its summary and shuts hivemind down
PR_SET_PDEATHSIG = 1
# Looked up before any fork: between fork and exec the child should do as little as possible.
_PRCTL = ctypes.CDLL(None).prctl if sys.platform == "linux" else None


def run_demo(peers: int, training: dict[str, Any], workdir: str | None, quiet: bool) -> str:
    """Start the swarm, show progress until every peer is done, and return the results table.

    ``training`` holds ``join`` options (field name → value; None means join's default). Every process
    is stopped on the way out, whatever happens; Ctrl-C and SIGTERM arrive here as KeyboardInterrupt.
    """
    from p2p_cocodc.config.train import build_config
    from p2p_cocodc.swarm.trust import keygen

    options = {k: v for k, v in training.items() if v is not None}
    cfg = build_config({}, {**options, "workers": peers})  # a bad value fails now, not in N peer logs
    work = _prepare_workdir(workdir, peers)
    click.echo(f"work dir {work} (logs, peer records)", err=True)

    procs, swarm = Processes(), list[Child]()
    with _sigterm_as_interrupt():
        try:
            port, status_port = _free_ports(2)
            key = work / "swarm.key"  # the demo's swarm admits only its own peers
            keygen(str(key), force=True)
            boot_args = _bootstrap_args(work, port, status_port) + ["--swarm-key-file", str(key)]
            boot = procs.spawn("bootstrap", boot_args, work / "bootstrap.log")
            click.echo(f"bootstrap on {HOST}:{port}, status page http://{HOST}:{status_port}/", err=True)
            _wait_for_address(boot, work / "bootstrap.json")
            join_args = _join_args(options, peers, status_port) + ["--swarm-key-file", str(key)]
            for i in range(peers):
                out = work / f"peer{i}.jsonl"
                args = ["join", *join_args, "--shard", f"{i}/{peers}", "--region", f"peer{i}"]
                args += ["--out", str(out)]
                swarm.append(procs.spawn(f"peer {i}", args, work / f"peer{i}.log", out))
            _watch(procs, swarm, boot, status_port, cfg.steps, cfg.batch_size * cfg.seq_len, quiet)
        finally:
            procs.stop_all()
    return results_table(swarm)


def _prepare_workdir(workdir: str | None, peers: int) -> Path:
    """The work dir, without the outputs of an earlier demo there: a stale address file would send
    the peers to a dead bootstrap, and a stale record file would be read as this run's."""
    if workdir is None:
        return Path(tempfile.mkdtemp(prefix="p2p-cocodc-demo-"))
    work = Path(workdir)
    try:
        work.mkdir(parents=True, exist_ok=True)
        for name in ["bootstrap.json", *(f"peer{i}.jsonl" for i in range(peers))]:
            (work / name).unlink(missing_ok=True)
    except OSError as exc:
        raise UserError(f"--workdir {work}: cannot use it ({exc.strerror or exc})") from None
    return work


def _bootstrap_args(work: Path, port: int, status_port: int) -> list[str]:
    args = ["bootstrap", "--host", HOST, "--port", str(port), "--status-port", str(status_port)]
    return args + ["--identity", str(work / "bootstrap.id"), "--address-file", str(work / "bootstrap.json")]


def _join_args(options: dict[str, Any], peers: int, status_port: int) -> list[str]:
    args = ["--bootstrap", f"{HOST}:{status_port}", "--run-id", RUN_ID, "--workers", str(peers)]
    args += ["--threads", "1", "--quiet"]
    for name, value in options.items():
        args += ["--" + name.replace("_", "-"), str(value)]
    return args


def _free_ports(count: int) -> list[int]:
    """Distinct ports free right now (another program could still take one before we bind it)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


# ---- the processes ----


@dataclass
class Child:
    """A process the demo started, the log it writes, and (for peers) its JSON-lines file."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    out: Path | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    gone: bool = False  # its process group was seen empty: never signal that group id again
    _read: int = 0  # bytes of ``out`` already parsed

    def new_records(self) -> list[dict[str, Any]]:
        """Records appended since the last call; a line still being written waits for the next poll."""
        if self.out is None or not self.out.exists():
            return []
        with open(self.out, "rb") as f:
            f.seek(self._read)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._read += len(complete)
        fresh = [json.loads(line) for line in complete.splitlines() if line.strip()]
        self.records += fresh
        return fresh

    def log_tail(self, lines: int = 3) -> str:
        """The last non-blank lines of the log, joined into one line for an error message."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "(no log)"
        tail = [line.strip()[:300] for line in text.splitlines() if line.strip()][-lines:]
        return " | ".join(tail) or "(empty log)"

    def check(self, expected_running: bool) -> bool:
        """True if it ended well; raise a UserError naming it if it failed or ended too early."""
        code = self.proc.poll()
        if code is None:
            return False
        if code != 0 or expected_running:
            raise UserError(f"{self.name} exited with code {code} (log {self.log}): {self.log_tail()}")
        return True

    def signal_group(self, sig: int) -> None:
        """Signal the child's process group, unless it was seen empty (then its id may be reused)."""
        if self.group_alive():
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def group_alive(self) -> bool:
        # The group id is the leader's pid (start_new_session); it stays reserved while any member lives.
        if not self.gone:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                self.gone = True
            except PermissionError:
                pass
        return not self.gone


class Processes:
    """Everything the demo started, and how to stop all of it.

    ``strays`` are descendants that left their process group, out of killpg's reach: torch's
    torch_shm_manager (hivemind selects torch's file_system sharing) calls setsid. It exits by itself
    a few seconds after its clients, but the demo promises to leave nothing behind, so it waits for
    them and kills the ones that stay.
    """

    def __init__(self) -> None:
        self.children: list[Child] = []
        self.strays: dict[int, str] = {}  # pid → its start time, so a reused pid is never signalled

    def spawn(self, name: str, args: list[str], log: Path, out: Path | None = None) -> Child:
        # One torch thread per process: N peers share a few cores, and oversubscription slows them all.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with open(log, "wb") as log_file:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                [sys.executable, "-m", "p2p_cocodc", *args],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # safe: the demo starts no threads before its children
            )
        child = Child(name, proc, log, out)
        self.children.append(child)
        return child

    def note_strays(self) -> None:
        """Remember every descendant whose process group is not one of ours."""
        table = _process_table()
        groups = {c.proc.pid for c in self.children}
        frontier = set(groups)
        while frontier:
            found = {pid for pid, (ppid, _, _) in table.items() if ppid in frontier}
            self.strays |= {pid: table[pid][2] for pid in found if table[pid][1] not in groups}
            frontier = found

    def stop_all(self) -> None:
        """SIGTERM every process we started, give them TERM_GRACE_S, then SIGKILL their groups;
        then the same for the strays. A second Ctrl-C or SIGTERM meanwhile is ignored: cutting this
        short would leave processes behind."""
        handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.note_strays()
            for child in self.children:  # the main process only: it shuts its DHT and p2pd down itself
                if child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM)
            self._wait(lambda: not any(c.group_alive() for c in self.children))
            for child in self.children:
                child.signal_group(signal.SIGKILL)
                with suppress(subprocess.TimeoutExpired):
                    child.proc.wait(timeout=5)
            self._wait(lambda: not self._living_strays())
            for pid in self._living_strays():
                with suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def _wait(self, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + TERM_GRACE_S
        while not done() and time.monotonic() < deadline:
            for child in self.children:
                child.proc.poll()  # reap the leader, so the group check sees only the living
            time.sleep(0.1)

    def _living_strays(self) -> list[int]:
        table = _process_table()
        return [pid for pid, started in self.strays.items() if pid in table and table[pid][2] == started]


def _die_with_parent() -> None:
    """Runs in the child before exec: if the demo itself is SIGKILLed, the kernel SIGTERMs the child."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


def _process_table() -> dict[int, tuple[int, int, str]]:
    """pid → (parent pid, process group, start time) of every live process; {} without /proc."""
    table = {}
    with suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    with open(f"/proc/{entry.name}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except (OSError, IndexError):
                    continue  # it ended meanwhile
                if fields[0] != "Z":  # zombies are dead; their parent reaps them
                    table[int(entry.name)] = (int(fields[1]), int(fields[2]), fields[19])
    return table


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM takes the Ctrl-C path (KeyboardInterrupt, exit 130), so children are stopped either way."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---- progress and results ----


def _wait_for_address(boot: Child, address: Path) -> None:
    """Return once the bootstrap has written its addresses: from then on peers can join through it."""
    deadline = time.monotonic() + BOOTSTRAP_READY_S
    while not address.exists():
        boot.check(expected_running=True)
        if time.monotonic() > deadline:
            raise UserError(f"the bootstrap wrote no address in {BOOTSTRAP_READY_S:.0f} s: {boot.log_tail()}")
        time.sleep(0.2)


def _watch(
    procs: Processes,
    peers: list[Child],
    boot: Child,
    status_port: int,
    steps: int,
    tokens_per_step: int,
    quiet: bool,
) -> None:
    """Poll until every peer has exited 0. Each peer's progress takes its state and step from the
    bootstrap's /status page (a peer publishes every second) and perplexity from its eval records,
    which also carry the step should /status lag. Any failure raises, and the caller stops everything."""
    names = [p.name for p in peers]
    last_status = 0.0
    with progress_bars(names, steps, tokens_per_step, quiet) as shown:
        while True:
            procs.note_strays()
            done = [p.check(expected_running=False) for p in peers]
            boot.check(expected_running=True)
            live: dict[int, dict[str, Any]] = {}
            if not quiet and time.monotonic() - last_status > STATUS_EVERY_S:
                live, last_status = _status_by_shard(status_port), time.monotonic()
            here = [names[i] for i, p in sorted(live.items()) if p.get("state") in ("waiting", "training")]
            for i, (peer, progress) in enumerate(zip(peers, shown, strict=True)):
                others = [name for name in here if name != peer.name]
                _show(progress, live.get(i, {}), peer.new_records(), [peer.name, *others], len(peers))
            if all(done):
                return
            time.sleep(POLL_S)


def _show(
    progress: Progress, status: dict[str, Any], records: list[dict[str, Any]], here: list[str], needed: int
) -> None:
    """One peer's state as /status last showed it, and its new evaluations, on its progress."""
    state = status.get("state")
    evals = [r for r in records if r.get("kind") == "eval"]
    step = max([progress.clock.at, *(r["step"] for r in evals)])
    if isinstance(status.get("step"), int):
        step = max(step, min(status["step"], progress.total))
    if state == "waiting":
        progress.waiting(here, needed)
    elif state == "joining":
        progress.joining([])
    elif progress.phase is not None and (state == "training" or step > 0):
        progress.training(step)
    for record in evals:
        progress.step(record["step"], record)
    if step > progress.clock.at:
        progress.step(step, {})


def _status_by_shard(status_port: int) -> dict[int, dict[str, Any]]:
    """The demo run's peers on the bootstrap's /status page, by shard; {} if it does not answer."""
    url = f"http://{HOST}:{status_port}/status"
    try:
        with urllib.request.urlopen(url, timeout=0.5) as response:
            peers = json.load(response)["runs"][RUN_ID]["peers"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {p["shard"]: p for p in peers.values() if isinstance(p, dict) and isinstance(p.get("shard"), int)}


def results_table(peers: list[Child]) -> str:
    """One line per peer — shard, perplexity before → after, MB sent, stall and wall seconds — then
    the global parameters θ̄ every peer ended with; peers that disagree are an error."""
    summaries = []
    for peer in peers:
        peer.new_records()
        found = [r for r in peer.records if r.get("kind") == "summary"]
        if not found:
            raise UserError(
                f"{peer.name} exited without a summary record (log {peer.log}): {peer.log_tail()}"
            )
        summaries.append(found[-1])
    n = len(peers)
    row = "{:<5} {:>5}  {:>22}  {:>8}  {:>7}  {:>7}"
    lines = [row.format("peer", "shard", "val ppl before → after", "MB sent", "stall s", "wall s")]
    for i, s in enumerate(summaries):
        ppl = f"{s['initial_val_ppl']:.1f} → {s['final_val_ppl']:.1f}"
        mb, stall, wall = s["bytes_sent"] / 1e6, s["stall_s"], s["wall_time_s"]
        lines.append(row.format(i, f"{s['shard']}/{n}", ppl, f"{mb:.2f}", f"{stall:.1f}", f"{wall:.1f}"))
    hashes = {s["global_params_sha256"] for s in summaries}
    if len(hashes) == 1:
        lines.append(f"θ̄ sha256: all {n} peers agree ({hashes.pop()[:16]})")
        return "\n".join(lines)
    shown = ", ".join(f"peer {i}: {s['global_params_sha256'][:16]}" for i, s in enumerate(summaries))
    click.echo("\n".join(lines))
    raise UserError(f"the peers ended with different global parameters θ̄ ({shown}); this is a bug")
