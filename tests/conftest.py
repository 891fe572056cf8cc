"""Test-wide settings."""

import atexit
import compileall
import os
import shutil
import signal
import tempfile
from pathlib import Path

import torch

# One intra-op thread: the models here are tiny, and on a shared 2-core machine a second busy process
# turns torch's thread pool into a spin-wait that makes in-process runs 10-100× slower.
torch.set_num_threads(1)

# A bootstrap started without --identity, --address-file or --state-dir keeps its files under
# $XDG_STATE_HOME: never the user's own, here or in the processes the tests start (they copy this
# environment), whatever a test forgets to pass.
_STATE = tempfile.mkdtemp(prefix="p2p-cocodc-tests-state-")
os.environ["XDG_STATE_HOME"] = _STATE
atexit.register(shutil.rmtree, _STATE, ignore_errors=True)

# The package's bytecode, written once: every peer, bootstrap and CLI process the tests start reads it
# instead of compiling the package again (about 0.3 s of CPU each where PYTHONDONTWRITEBYTECODE is set,
# as on CI's machine, which leaves an editable install uncompiled). Python reads a cache it may not write.
for _tree in ("p2p_cocodc", "tests"):
    compileall.compile_dir(Path(__file__).resolve().parent.parent / _tree, quiet=1)

# A suite started in the background by a non-interactive shell (``.ci/run &``) inherits SIGINT
# ignored, and so would every process it starts: the tests that press Ctrl-C on a peer, the demo or
# `status` would find it deaf. Their processes get the default disposition, as from a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The files that start real swarms, longest first (seconds of a full run on 2 cores: test_netns,
# test_hostile, test_restarts and test_elastic 2026-12-03, with other heavy jobs on the machine, the
# rest 2026-12-02). The suite runs files on two workers in collection order (`--no-loadscope-reorder`
# in pyproject.toml: xdist would otherwise order them by their number of tests, which put
# test_restarts' three tests of 45-55 s each last, alone on one worker for minutes); the long ones go
# first, as in the longest-processing-time rule, so the short ones fill in at the end.
LONGEST_FIRST = (
    "test_netns.py",  # ~320
    "test_hostile.py",  # ~185
    "test_restarts.py",  # ~170
    "test_swarm.py",  # ~135
    "test_stops.py",  # ~120
    "test_elastic.py",  # ~115
    "test_region.py",  # ~90
    "test_theta_agreement.py",  # ~75
    "test_hf.py",  # ~55
    "test_demo.py",  # ~55
    "test_checkpoint.py",  # ~50
    "test_round_model.py",  # ~45
    "test_cli.py",  # ~30 (alone, after its refused values moved into the test's process)
)


def pytest_collection_modifyitems(items: list) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest as collected
