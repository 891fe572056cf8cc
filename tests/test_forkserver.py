"""The warm server the tests fork their processes from (``tests/forkserver.py``) gives each one what
a fresh ``python -m MODULE`` process would have: a session of its own, the working directory,
environment and arguments asked for, its exit code or signal, random state of its own, and a hash
seed that the peers of one swarm do not all share."""

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests import forkserver
from tests.swarm_procs import ENV, is_live, wait_for

FACTS = "tests.process_facts"


def facts(done: subprocess.CompletedProcess[str]) -> dict:
    return json.loads(done.stdout.splitlines()[0])


def test_a_forked_process_is_the_process_asked_for(tmp_path: Path) -> None:
    done = forkserver.run(FACTS, ["3"], tmp_path, {**ENV, "PROCESS_FACTS_MARKER": "here"}, timeout=60)
    got = facts(done)
    assert done.returncode == 3, done.stderr
    assert got["pgid"] == got["sid"] == got["pid"] != os.getpid()  # its own session and group
    assert got["cwd"] == str(tmp_path) and got["argv"] == ["3"] and got["marker"] == "here"
    assert got["main"] == FACTS and got["path0"] == str(tmp_path)  # run as python -m runs it
    assert done.stderr == "to stderr\n"  # stdout and stderr apart


def test_forked_processes_draw_their_own_random_numbers_and_two_servers_hash_apart(tmp_path: Path) -> None:
    runs = [facts(forkserver.run(FACTS, [], tmp_path, ENV, timeout=60)) for _ in range(4)]
    assert len({r["random"] for r in runs}) == 4
    # the two servers take turns: one hash seed each, so consecutive processes hash apart
    assert runs[0]["hash"] == runs[2]["hash"] != runs[1]["hash"] == runs[3]["hash"]


def test_a_signalled_process_reports_its_signal_and_waits_keep_their_timeouts(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    with open(out, "w") as log:
        child = forkserver.start(FACTS, ["wait"], tmp_path, ENV, log.fileno(), log.fileno())
    wait_for(lambda: "to stderr" in out.read_text(), 60, "the child to start")
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.05)  # it waits for a signal: it cannot have exited by itself
    assert child.poll() is None and is_live(child.pid)
    child.terminate()
    assert child.wait(timeout=60) == -signal.SIGTERM
    child.kill()  # once reaped, no signal goes to the pid (another process may hold it by now)

    with pytest.raises(subprocess.TimeoutExpired):
        forkserver.run(FACTS, ["wait"], tmp_path, ENV, timeout=0.5)  # ended, as subprocess.run does
