"""The training thread yields the CPU to the peer's syncs (``peer/cpu.py``)."""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from p2p_cocodc.peer.cpu import TRAIN_NICENESS, training_yields_cpu

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="thread priorities are set on Linux only")


def niceness(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def test_the_thread_that_calls_it_runs_at_a_lower_priority_and_the_others_keep_theirs() -> None:
    mine = niceness(threading.get_native_id())
    with ThreadPoolExecutor(1, initializer=training_yields_cpu) as pool:
        trainer = pool.submit(lambda: niceness(threading.get_native_id())).result()
    assert trainer == min(mine + TRAIN_NICENESS, 19)
    assert niceness(threading.get_native_id()) == mine
