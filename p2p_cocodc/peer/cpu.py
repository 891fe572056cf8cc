"""The peer's threads on a busy CPU: training yields to the syncs.

A peer trains in one thread (``SwarmReplica.train_pool``) while its event loop, the exchange's
arithmetic (worker threads), its DHT process and the libp2p daemon carry its syncs. Where training
keeps every core busy (a CPU region, or several peers on one machine), the syncs waited for the CPU
behind it. Three nodes exchanging q2 fragments of `small` over 2 Mbit/s links 100 ms apart took a
median 1.57 s a round with raw TCP moving the same bytes, 1.73-1.76 s with the exchange alone,
1.88-1.89 s with a training thread beside each exchange, and 1.74-1.79 s with that thread at
niceness +10 (``benchmarks/exchange_floor.py``, docs/hivemind-baseline.md). A sync needs the CPU
for tens of milliseconds a round, so training loses little; on a GPU region its thread mostly
waits on the device.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

TRAIN_NICENESS = 10  # added to the training thread's niceness (Linux): the syncs' threads run first


def training_yields_cpu() -> None:
    """Lower the calling thread's CPU priority by ``TRAIN_NICENESS`` (a thread pool's initializer).
    Linux only, where a thread's id names it to ``setpriority``; raising one's own niceness needs no
    privilege. Elsewhere, or if refused, the thread keeps its priority."""
    if sys.platform != "linux":
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + TRAIN_NICENESS)
    except OSError as exc:
        log.info("the training thread keeps its CPU priority (%s)", exc)
