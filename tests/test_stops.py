"""Stops that stop: SIGINT or SIGTERM, to a peer's main process (``kill PID``) or to its whole
process group (systemd's default KillMode, supervisord's stopasgroup, a shell's job control), once
or twice, in every phase of a peer's life (starting, waiting, joining, training, saving) and to
the bootstrap (systemd's KillMode=mixed included). The process ends, with 128 + the first signal
for a peer stopped before the end of its run (0 for the bootstrap, and for a peer whose run was
over), leaves no process of its group behind, and a peer that trained writes its summary, its
--save and its checkpoint.

A second signal comes either while the first stop is under way (once the process says "stopping
on SIGx": it must change nothing) or once the stop is done and the process has printed its last
line (Python's own exit, about a second here: it must not end the process by the signal).

Events are ordered by what the processes show (a line in a log, a record in --out, a helper
process, a closed port), never by sleeping; where a signal must land in a given phase, the
processes concerned are frozen (SIGSTOP) from the moment that phase shows until the signal is
sent: a signal to a frozen process waits, and is handled where it was frozen, once thawed. Each
test runs its cases side by side (one test per signal and phase): a real peer costs 5-10 s here."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from functools import partial
from pathlib import Path

import pytest

from p2p_cocodc.models.saved import CONFIG_FILE
from p2p_cocodc.peer.cpu import TRAIN_NICENESS
from p2p_cocodc.run.checkpoint import committed
from tests.swarm_procs import (
    Bootstrap,
    end_group,
    evals,
    free_port,
    free_ports,
    group_members,
    records,
    socket_files,
    spawn,
    start_bootstrap,
    thread_niceness,
    wait_for,
)
from tests.tiny_options import TINY_MODEL, TINY_SYNCS

PEER = [*TINY_MODEL, *TINY_SYNCS, "--threads", "1"]
SIGNALS = [signal.SIGINT, signal.SIGTERM]
# a hang guard, not a speed target: a stopped peer ends about 1-5 s after the signal here, its
# DHT's shutdown and Python's own exit included (the issue asks for 10 s; this loaded 2-core
# machine, several peers starting at once, is given three times that)
ENDS_WITHIN_S = 30
# once the main process has ended, its helpers (DHT process, p2pd) end on their own well within
# this: systemd's KillMode=mixed SIGKILLs what is left only after TimeoutStopSec=15
GROUP_GONE_S = 10
STARTS_WITHIN_S = 90  # a guard on a peer's start: several start at once on 2 cores


@pytest.fixture(scope="module")
def boot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bootstrap]:
    boot = start_bootstrap(tmp_path_factory.mktemp("boot"))
    try:
        yield boot
    finally:
        end_group(boot.proc)


def send(proc: subprocess.Popen, sig: signal.Signals, target: str) -> None:
    """``sig`` to the main process (``kill PID``) or to its whole process group (``kill -- -PGID``)."""
    if target == "group":
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)


def process_state(pid: int) -> str | None:
    """The state letter /proc shows for ``pid`` (T: stopped, Z: a zombie), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


@contextmanager
def frozen(pid: int, group: bool = False) -> Iterator[None]:
    """``pid`` (``group``: its whole process group) stopped with SIGSTOP for the block, then thawed
    with SIGCONT, whatever happens: what the block sees of them holds until it ends, and a signal
    it sends them is handled once they run again, where they were frozen."""
    kill = os.killpg if group else os.kill
    with suppress(ProcessLookupError):
        kill(pid, signal.SIGSTOP)
    try:
        members = lambda: group_members(pid) if group else [pid]  # noqa: E731
        wait_for(lambda: all(process_state(p) in ("T", "Z", None) for p in members()), 10, "SIGSTOP to take")
        yield
    finally:
        with suppress(ProcessLookupError):
            kill(pid, signal.SIGCONT)


def ends(proc: subprocess.Popen, log: Path) -> int:
    """The exit code of ``proc``, which must end within ENDS_WITHIN_S; its group (DHT process,
    p2pd) must then be gone within GROUP_GONE_S."""
    try:
        code = proc.wait(timeout=ENDS_WITHIN_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{log.stem} did not end within {ENDS_WITHIN_S} s: {log.read_text()[-2000:]}")
    wait_for(lambda: not group_members(proc.pid), GROUP_GONE_S, f"{log.stem}'s DHT process and p2pd to end")
    return code


def again_while_stopping(proc: subprocess.Popen, sig: signal.Signals, target: str, log: Path) -> None:
    """``sig`` a second time while the first stop is under way: once ``log`` says it is stopping,
    the process's group frozen so that it cannot end in between."""
    wait_for(
        partial(line_of, log, f"stopping on {sig.name}"), ENDS_WITHIN_S, f"{log.stem} to say it stops", 0.01
    )
    with frozen(proc.pid, group=True):
        assert proc.poll() is None, f"{log.stem} ended before the second signal: {log.read_text()[-2000:]}"
        send(proc, sig, target)


def again_once_done(proc: subprocess.Popen, sig: signal.Signals, target: str, log: Path, last: str) -> None:
    """``sig`` a second time once the stop is done and ``log`` shows the last line, ``last``: the
    process is frozen from then until it is sent, so that Python's own exit cannot end in between."""
    wait_for(partial(line_of, log, last), ENDS_WITHIN_S, f"{log.stem}'s last line", 0.01)
    with frozen(proc.pid):
        assert proc.poll() is None, f"{log.stem} ended before the second signal: the test came too late"
        send(proc, sig, target)


def last_line(log: Path) -> str:
    return log.read_text().strip().splitlines()[-1]


def line_of(log: Path, text: str) -> bool:
    return log.exists() and text in log.read_text()


def trained(out: Path, evaluations: int) -> bool:
    return evals(out) >= evaluations


# ---- a peer ----


@pytest.mark.parametrize("sig", SIGNALS, ids=[s.name for s in SIGNALS])
def test_a_starting_peer_stops(boot: Bootstrap, tmp_path: Path, sig: signal.Signals) -> None:
    """Two peers at once. "setup" is signalled by pid while it sets up: it printed its metrics
    address, its run has not begun (the imports, the model and the data; no helper process yet);
    again once it printed its last line. "dht" is signalled by group while its DHT starts: its
    first helper process is up, it does not wait for peers yet, and the group's signal ends the
    helpers being started (p2pd, torch_shm_manager); again while it stops. Before: SIGTERM during
    the set-up ended the process by the signal (-15, no line), SIGINT printed "interrupted" (and
    sometimes ended it by the signal, -2), and a group signal during the DHT's start made the
    start-up fail (a traceback and exit 1, or "cannot join the swarm" and exit 2)."""
    common = ["join", "--bootstrap", boot.host_port, *PEER, "--workers", "2"]
    logs = {case: tmp_path / f"{case}.log" for case in ("setup", "dht")}
    last = f"stopped by {sig.name} while starting, before training"
    metrics = ["--metrics-port", str(free_port())]
    setup = spawn([*common, "--run-id", f"setup-{sig.name}", *metrics], tmp_path, "setup.log")
    dht = spawn([*common, "--run-id", f"dht-{sig.name}"], tmp_path, "dht.log")
    try:
        wait_for(partial(line_of, logs["setup"], "metrics at"), STARTS_WITHIN_S, "the metrics address", 0.01)
        with frozen(setup.pid):
            assert "is open" not in logs["setup"].read_text(), "its run began: the test came too late"
            assert group_members(setup.pid) == [setup.pid]
            send(setup, sig, "pid")
        again_once_done(setup, sig, "pid", logs["setup"], last)
        wait_for(lambda: len(group_members(dht.pid)) > 1, STARTS_WITHIN_S, "the DHT's first helper", 0.01)
        with frozen(dht.pid, group=True):
            assert "waiting for peers" not in logs["dht"].read_text(), (
                "it waits already: the test came too late"
            )
            send(dht, sig, "group")
        again_while_stopping(dht, sig, "group", logs["dht"])
        codes = {"setup": ends(setup, logs["setup"]), "dht": ends(dht, logs["dht"])}
    finally:
        end_group(setup)
        end_group(dht)
    for case, log in logs.items():
        assert codes[case] == 128 + sig, log.read_text()[-2000:]
        assert last_line(log) == last, log.read_text()[-2000:]


@pytest.mark.parametrize("sig", SIGNALS, ids=[s.name for s in SIGNALS])
def test_a_waiting_peer_stops(boot: Bootstrap, tmp_path: Path, sig: signal.Signals) -> None:
    """Two peers at once, each waiting for a second peer: "pid" signalled by pid, and again once
    it printed its last line; "group" signalled by group, and again while it stops. Before: a
    group signal left the peer waiting for ever on its DHT process, and a signal after the stop
    ended the process by the signal (-2, -15)."""
    peers, logs = {}, {}
    last = f"stopped by {sig.name} while waiting for peers, before training"
    for target in ("pid", "group"):
        run = ["--run-id", f"wait-{sig.name}-{target}", "--workers", "2"]
        peers[target] = spawn(["join", "--bootstrap", boot.host_port, *run, *PEER], tmp_path, f"{target}.log")
        logs[target] = tmp_path / f"{target}.log"
    try:
        for log in logs.values():
            wait_for(partial(line_of, log, "waiting for peers 1/2"), STARTS_WITHIN_S, "the peer to wait")
        sockets = {target: socket_files(group_members(peer.pid)) for target, peer in peers.items()}
        for target, peer in peers.items():
            send(peer, sig, target)
        again_while_stopping(peers["group"], sig, "group", logs["group"])
        again_once_done(peers["pid"], sig, "pid", logs["pid"], last)
        codes = {target: ends(peer, logs[target]) for target, peer in peers.items()}
    finally:
        for peer in peers.values():
            end_group(peer)
    for target, log in logs.items():
        assert codes[target] == 128 + sig, log.read_text()[-2000:]
        assert last_line(log) == last, log.read_text()[-2000:]
        assert sockets[target] and not any(path.exists() for path in sockets[target])  # p2pd's socket file


@pytest.mark.parametrize(
    ("sig", "target"),
    [(signal.SIGINT, "pid"), (signal.SIGTERM, "group")],
    ids=["SIGINT-pid", "SIGTERM-group"],
)
def test_a_joining_peer_stops(boot: Bootstrap, tmp_path: Path, sig: signal.Signals, target: str) -> None:
    """A peer joins a run under way and is signalled while it takes the state: its only donor is
    frozen from the moment the joiner says "joining" (a donor that does not answer, or answers
    late: it waits to reach the step asked), and the joiner has chosen it. One joiner per test (a
    second would have to get there before the frozen donor's record lapses, 8 s): SIGINT by pid,
    again once it printed its last line; SIGTERM by group, again while it stops. Before: the
    joiner waited for its donor (up to 4 × 2 minutes), and a group signal, which ends its p2pd,
    made it fail ("could not take the swarm's state", exit 2)."""
    run = ["--run-id", f"join-{sig.name}", "--workers", "1", "--max-peers", "2", "--steps", "100000"]
    common = ["join", "--bootstrap", boot.host_port, *run, *PEER]
    last = f"stopped by {sig.name} while joining, before training"
    # the founder's steps take 8 s: a donor answers once it reaches the step asked (two past its
    # record's), so the joiner's ask stays unanswered for seconds after it says "joining", whatever
    # the load, and the donor is frozen before it can answer (at full speed a tiny step is a few
    # ms: a loaded machine let the joiner take the state before the freeze)
    founder = spawn([*common, "--out", "founder.jsonl", "--min-step-time", "8"], tmp_path, "founder.log")
    joiner = None
    log = tmp_path / "joiner.log"
    try:
        wait_for(partial(trained, tmp_path / "founder.jsonl", 1), STARTS_WITHIN_S, "the founder to train")
        joiner = spawn([*common, "--out", "joiner.jsonl"], tmp_path, "joiner.log")
        wait_for(
            partial(line_of, log, "joining: taking the swarm's state"), STARTS_WITHIN_S, "the joiner", 0.01
        )
        with frozen(founder.pid):  # its DHT process and p2pd run on: the joiner reaches it, it never answers
            wait_for(partial(line_of, log, "joining: taking the state from 1 donors"), 30, "the donor chosen")
            assert not line_of(log, "took the swarm's state"), "it joined already: the test came too late"
            send(joiner, sig, target)
            if target == "group":
                again_while_stopping(joiner, sig, target, log)
            else:
                again_once_done(joiner, sig, target, log, last)
            code = ends(joiner, log)
    finally:
        if joiner is not None:
            end_group(joiner)
        end_group(founder)
    assert code == 128 + sig, log.read_text()[-2000:]
    assert last_line(log) == last, log.read_text()[-2000:]
    assert not any(r["kind"] == "summary" for r in records(tmp_path / "joiner.jsonl"))  # it trained nothing


@pytest.mark.parametrize("sig", SIGNALS, ids=[s.name for s in SIGNALS])
def test_a_training_peer_stops_with_its_summary_and_model(
    boot: Bootstrap, tmp_path: Path, sig: signal.Signals
) -> None:
    """Two peers at once, each training alone: "pid" signalled by pid, and again once it printed
    its last line; "group" signalled by group, and again while it stops. Each writes its summary
    (``stopped_by``: the first signal), θ̄ to --save's partial folder and the checkpoint of the
    step it stopped after. Before: a group signal left the peer waiting for ever on its DHT
    process, a training peer exited 0, and a signal after the stop ended it by the signal."""
    peers, logs = {}, {}
    for target in ("pid", "group"):
        run = ["--run-id", f"train-{sig.name}-{target}", "--workers", "1", "--steps", "100000"]
        files = ["--out", f"{target}.jsonl", "--save", f"{target}-model", "--checkpoint-dir", f"{target}-ck"]
        peers[target] = spawn(
            ["join", "--bootstrap", boot.host_port, *run, *PEER, *files], tmp_path, f"{target}.log"
        )
        logs[target] = tmp_path / f"{target}.log"
    try:
        for target in peers:
            wait_for(partial(trained, tmp_path / f"{target}.jsonl", 2), STARTS_WITHIN_S, "training")
        threads = thread_niceness(peers["pid"].pid)  # training yields the CPU to the syncs (peer/cpu.py)
        main = threads[peers["pid"].pid]
        assert min(main + TRAIN_NICENESS, 19) in threads.values(), threads
        for target, peer in peers.items():
            send(peer, sig, target)
        again_while_stopping(peers["group"], sig, "group", logs["group"])
        again_once_done(peers["pid"], sig, "pid", logs["pid"], "left the swarm after step")
        codes = {target: ends(peer, logs[target]) for target, peer in peers.items()}
    finally:
        for peer in peers.values():
            end_group(peer)
    for target, log in logs.items():
        assert codes[target] == 128 + sig, log.read_text()[-2000:]
        summary = records(tmp_path / f"{target}.jsonl")[-1]
        assert summary["kind"] == "summary" and summary["stopped_by"] == sig.name
        steps = summary["steps"]
        assert summary["saved"] == f"{target}-model.partial-step-{steps}"
        assert (tmp_path / summary["saved"] / CONFIG_FILE).is_file()
        assert committed(tmp_path / f"{target}-ck")[-1][0] == steps
        assert last_line(log).startswith(f"left the swarm after step {steps} of 100000"), last_line(log)


SAVE_STEPS = 16


@pytest.mark.parametrize("sig", SIGNALS, ids=[s.name for s in SIGNALS])
def test_a_peer_signalled_as_its_run_ends_keeps_its_whole_model(
    boot: Bootstrap, tmp_path: Path, sig: signal.Signals
) -> None:
    """Two peers at once, each training alone to its last step, signalled once its last evaluation
    is in --out ("pid" by pid, and again once it printed its last line; "group" by group), frozen
    from the moment it is seen so that the signal comes before anything else of the run's end (the
    last checkpoint, the last syncs' wait, the writing of --save, the summary, the DHT's shutdown,
    all within a second here). What that pins down: a signal at the end of a run costs nothing,
    wherever in that second it lands: the whole --save (not a partial folder), no staging folder
    left, the summary, the last checkpoint, exit 0 and the success line (the run is complete).
    What it does not: that the signal landed inside the writing of --save. No test can aim there
    without a hook in the code, and none is needed: --save is written on the event loop's thread,
    so a signal that comes meanwhile is handled once it is written (a --save that fails:
    tests/test_saved_model.py)."""
    peers, logs = {}, {}
    for target in ("pid", "group"):
        run = ["--run-id", f"save-{sig.name}-{target}", "--workers", "1", "--steps", str(SAVE_STEPS)]
        files = ["--out", f"{target}.jsonl", "--save", f"{target}-model", "--checkpoint-dir", f"{target}-ck"]
        peers[target] = spawn(
            ["join", "--bootstrap", boot.host_port, *run, *PEER, *files], tmp_path, f"{target}.log"
        )
        logs[target] = tmp_path / f"{target}.log"

    def evaluated_last(out: Path) -> bool:
        return out.exists() and any(r["kind"] == "eval" and r["step"] == SAVE_STEPS for r in records(out))

    def signal_the_last() -> bool:
        """Signal each peer whose last evaluation is in: both are watched at once."""
        for target in [t for t in waiting if evaluated_last(tmp_path / f"{t}.jsonl")]:
            peer = peers[target]
            with frozen(peer.pid, group=True):
                assert peer.poll() is None, f"it ended before the signal: {logs[target].read_text()[-2000:]}"
                send(peer, sig, target)
            waiting.remove(target)
        return not waiting

    waiting = list(peers)
    try:
        wait_for(signal_the_last, STARTS_WITHIN_S, "the last evaluations", 0.01)
        again_once_done(peers["pid"], sig, "pid", logs["pid"], "final val ppl ")
        codes = {target: ends(peer, logs[target]) for target, peer in peers.items()}
    finally:
        for peer in peers.values():
            end_group(peer)
    for target, log in logs.items():
        assert codes[target] == 0, log.read_text()[-2000:]
        summary = records(tmp_path / f"{target}.jsonl")[-1]
        assert summary["kind"] == "summary" and summary["steps"] == SAVE_STEPS
        assert summary["saved"] == f"{target}-model"
        assert (tmp_path / f"{target}-model" / CONFIG_FILE).is_file()
        assert not list(tmp_path.glob(f".{target}-model.*"))  # no staging folder left
        assert committed(tmp_path / f"{target}-ck")[-1][0] == SAVE_STEPS
        assert last_line(log).startswith("final val ppl "), last_line(log)


# ---- the bootstrap ----


def dht_process(proc: subprocess.Popen) -> int:
    """The bootstrap's DHT process: its child with its own command line (hivemind forks it)."""
    cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    found = []
    for pid in group_members(proc.pid):
        with suppress(OSError):
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == proc.pid and Path(f"/proc/{pid}/cmdline").read_bytes() == cmdline:
                found.append(pid)
    assert len(found) == 1, found
    return found[0]


def refuses(host_port: str) -> bool:
    """Whether nothing listens on ``host_port`` any more (the bootstrap's status server, closed
    last of all, after its DHT)."""
    host, port = host_port.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


@pytest.mark.parametrize("sig", SIGNALS, ids=[s.name for s in SIGNALS])
def test_the_bootstrap_stops(tmp_path: Path, sig: signal.Signals) -> None:
    """Three bootstraps at once. "pid": the signal to the main process only; for SIGTERM, this is
    systemd's KillMode=mixed of bootstrap/p2p-cocodc-bootstrap.service: nothing else is signalled,
    and the whole group must be gone on its own, well before its TimeoutStopSec=15 would SIGKILL
    what is left. "early": to the main process with its DHT process frozen, then to the group
    while the DHT shuts down (it cannot finish while frozen). "late": to the group, then to the
    group again once its status server is closed (the last of its shutdown; Python's own exit,
    most of a second here, remains), the main process frozen from then until the signal is sent.
    Each exits 0 and leaves no process of its group, nor p2pd's socket file. Before: a signal
    during Python's exit ended the bootstrap by the signal (-15, -2)."""
    cases = ("pid", "early", "late")
    for case in cases:
        (tmp_path / case).mkdir()
    ports = free_ports(2 * len(cases))  # picked together: no two bootstraps share one
    with ThreadPoolExecutor(len(cases)) as pool:  # they start side by side
        starting = {
            case: pool.submit(start_bootstrap, tmp_path / case, ports=(ports[2 * i], ports[2 * i + 1]))
            for i, case in enumerate(cases)
        }
    boots = {case: future.result() for case, future in starting.items() if future.exception() is None}
    try:
        assert len(boots) == len(cases), [future.exception() for future in starting.values()]
        procs = {case: b.proc for case, b in boots.items()}
        logs = {case: tmp_path / case / "bootstrap.log" for case in cases}
        sockets = {case: socket_files(group_members(proc.pid)) for case, proc in procs.items()}
        send(procs["pid"], sig, "pid")
        with frozen(dht_process(procs["early"])):
            send(procs["early"], sig, "pid")
            wait_for(partial(line_of, logs["early"], f"stopping on {sig.name}"), ENDS_WITHIN_S, "the stop")
            assert procs["early"].poll() is None
            send(procs["early"], sig, "group")
        send(procs["late"], sig, "group")
        wait_for(partial(refuses, boots["late"].host_port), ENDS_WITHIN_S, "the status server to close", 0.01)
        with frozen(procs["late"].pid):
            assert procs["late"].poll() is None, "it ended before the second signal: the test came too late"
            send(procs["late"], sig, "group")
        codes = {case: ends(proc, logs[case]) for case, proc in procs.items()}
    finally:
        for b in boots.values():
            end_group(b.proc)
    for case, code in codes.items():
        output = logs[case].read_text()
        assert code == 0, output[-2000:]
        assert "Traceback" not in output, output[-2000:]
        assert sockets[case] and not any(path.exists() for path in sockets[case]), output[-2000:]
