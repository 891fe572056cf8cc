"""Test-wide settings."""

import atexit
import os
import shutil
import signal
import tempfile

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

# A suite started in the background by a non-interactive shell (``.ci/run &``) inherits SIGINT
# ignored, and so would every process it starts: the tests that press Ctrl-C on a peer, the demo or
# `status` would find it deaf. Their processes get the default disposition, as from a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
