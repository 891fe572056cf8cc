"""Peers forked from a warm process: ``python -m p2p_cocodc ARGS`` without paying for the imports.

A peer, bootstrap or simulator process spends about 2 s of CPU importing torch and torch._dynamo (the
first AdamW step imports it) before its first line of its own; a full suite starts a few hundred of
them on 2 cores. A fork server imports that and the package once, then forks one child per
process a test starts. The child is a real process running the real entry point: ``runpy`` runs
``-m MODULE`` as ``python -m`` would, in its own session (process group), in the test's working
directory and environment, its output in the test's file. The test holds a ``Forked``, which behaves
as the ``subprocess.Popen`` it replaces (pid, poll, wait, signals).

What a fork shares with its siblings and would not share as a fresh process, and why it is harmless:
- the imported modules: none of them starts a thread or makes a lock shared between processes as it
  is imported (the server checks both before it forks: one thread, no multiprocessing lock), and
  hivemind, which makes such locks, is imported by each child itself (0.3 s);
- ``random``'s state: Python reseeds it in every forked child (``os.register_at_fork``); torch's is
  seeded by the run itself;
- the hash seed of ``str``: the same in every child of one server. Two servers, started with their
  own random seeds, take turns, so the peers of one swarm do not all hash alike and an order that
  depends on it would still split them, as it would between real machines.

The server serves the process that started it, and exits when that process does."""

from __future__ import annotations

import atexit
import contextlib
import gc
import itertools
import json
import multiprocessing.synchronize
import os
import runpy
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

# What the processes the tests start import, the server imports before it forks. Not hivemind: its
# import makes multiprocessing locks (MPFuture's), which every fork would share with every other, so a
# peer killed while holding one would stall the DHTs of all the others (it did, in test_stops).
WARM = (
    "torch",
    "torch._dynamo",
    "uvloop",
    "p2p_cocodc.cli.main",
    "p2p_cocodc.peer.node",
    "p2p_cocodc.peer.region",
    "p2p_cocodc.ops.bootstrap",
    "p2p_cocodc.ops.monitoring",
    "p2p_cocodc.ops.progress",
    "p2p_cocodc.ops.sinks",
    "p2p_cocodc.run.checkpoint",
    "p2p_cocodc.run.simulator",
)
READY = b"ready\n"


class Forked:
    """A process the fork server started for this one: what ``subprocess.Popen`` offers of it."""

    def __init__(self, args: list[str], pid: int, channel: socket.socket) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._channel = channel  # the server writes the exit code here once it has reaped the child

    def poll(self) -> int | None:
        if self.returncode is None:
            self._channel.setblocking(False)
            try:
                self._take(self._channel.recv(64))
            except BlockingIOError:
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._channel.settimeout(timeout)
            try:
                self._take(self._channel.recv(64))
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never a pid the server has reaped: it may be another process's now
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _take(self, reply: bytes) -> None:
        if not reply:
            raise RuntimeError(f"the fork server that started pid {self.pid} is gone")
        self.returncode = int(reply)
        self._channel.close()


class ForkServer:
    """One warm server process (``python -m tests.forkserver``), started here and ended with us."""

    def __init__(self, env: dict[str, str]) -> None:
        folder = tempfile.mkdtemp(prefix="p2p-cocodc-forks-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        self.address = os.path.join(folder, "server")
        env = {k: v for k, v in env.items() if k != "PYTHONHASHSEED"}  # a random one of its own
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.forkserver", self.address, str(os.getpid())],
            cwd=Path(__file__).resolve().parent.parent,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line != READY:
            raise RuntimeError(f"the fork server did not start: {line!r}")

    def start(
        self, module: str, args: Sequence[str], cwd: Path, env: dict[str, str], stdout: int, stderr: int
    ) -> Forked:
        """``python -m MODULE ARGS`` in ``cwd`` with ``env``, its output to the open files ``stdout``
        and ``stderr`` (descriptors)."""
        channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        channel.connect(self.address)
        request = {"module": module, "args": list(args), "cwd": str(cwd), "env": env}
        socket.send_fds(channel, [json.dumps(request).encode()], [stdout, stderr])
        pid = int(channel.recv(64))
        return Forked([module, *args], pid, channel)


_servers: list[ForkServer] = []
_turn = itertools.count()
_lock = threading.Lock()


def start(
    module: str, args: Sequence[str], cwd: Path, env: dict[str, str], stdout: int, stderr: int
) -> Forked:
    """The next of this process's two servers starts ``python -m MODULE ARGS``. They are made on first
    use, in the environment of that request (``tests/swarm_procs.py`` always passes its ``ENV``): the settings
    read at import (``PYTHONPATH``, ``OMP_NUM_THREADS``) come from it."""
    with _lock:
        if not _servers:
            _servers.extend(ForkServer(env) for _ in range(2))
        server = _servers[next(_turn) % len(_servers)]
    return server.start(module, args, cwd, env, stdout, stderr)


def run(
    module: str, args: Sequence[str], cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGS`` to completion, its output captured (``subprocess.run``'s contract:
    ``TimeoutExpired`` past ``timeout``, once its process group is ended)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        child = start(module, args, cwd, env, out.fileno(), err.fileno())
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(child.args, code, out.read().decode(), err.read().decode())


def _serve(address: str, client: int) -> dict | None:
    """Fork a child per request until ``client`` exits; in the child, the request it is to run."""
    for name in WARM:
        __import__(name)
    threads = len(os.listdir("/proc/self/task"))  # native ones too
    if threads != 1:
        raise RuntimeError(f"{threads} threads after the imports: a fork would copy locks they may hold")
    shared = [o for o in gc.get_objects() if isinstance(o, multiprocessing.synchronize.SemLock)]
    if shared:
        raise RuntimeError(
            f"the imports made {len(shared)} multiprocessing locks: every fork would share them"
        )
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(64)
    watch = selectors.DefaultSelector()
    watch.register(listener, selectors.EVENT_READ, "request")
    watch.register(os.pidfd_open(client), selectors.EVENT_READ, "client gone")
    sys.stdout.buffer.write(READY)
    sys.stdout.flush()
    while True:
        for key, _ in watch.select():
            if key.data == "client gone":
                return None
            if key.data == "request":
                channel, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(channel, 1 << 20, 2)
                pid = os.fork()
                if pid == 0:  # the child: drop the server's descriptors, become the process asked for
                    for other in list(watch.get_map().values()):
                        if isinstance(other.fileobj, socket.socket):
                            other.fileobj.close()  # the listener
                        else:
                            os.close(other.fd)  # pidfds
                        if isinstance(other.data, tuple):
                            other.data[1].close()  # the channels of the children before it
                    watch.close()
                    channel.close()
                    request = json.loads(message)
                    request["output"] = fds
                    return request
                for fd in fds:
                    os.close(fd)
                with contextlib.suppress(OSError):  # a client that left: the child is still reaped
                    channel.sendall(str(pid).encode())
                watch.register(os.pidfd_open(pid), selectors.EVENT_READ, (pid, channel))
            else:
                pid, channel = key.data
                _, status = os.waitpid(pid, 0)
                watch.unregister(key.fileobj)
                os.close(key.fd)
                with channel, contextlib.suppress(OSError):  # the client may have dropped its handle
                    channel.sendall(str(os.waitstatus_to_exitcode(status)).encode())


def _become(request: dict) -> None:
    """In the forked child: what ``python -m MODULE ARGS`` would be, in its own session."""
    os.setsid()
    for target, fd in zip((1, 2), request["output"], strict=True):
        os.dup2(fd, target)
    for fd in set(request["output"]) - {1, 2}:
        os.close(fd)
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]  # -m puts the working directory first
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [request["module"], *request["args"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    todo = _serve(sys.argv[1], int(sys.argv[2]))
    if todo is not None:
        _become(todo)
