"""A peer's hearing of the board (``peer/presence.py`` ``Hearing``), on made-up times: a process
stopped for a minute, five or thirty (SIGSTOP, a suspended VM) does not count its sleep as the
DHT's silence, so on waking it resyncs instead of giving the swarm up; a DHT silent while the
process runs is still given up. And the heartbeat's reads and publishes wait while a round's
slices are on the link, never longer than half a record's lifetime (``held_back``)."""

from __future__ import annotations

import pytest

from p2p_cocodc.peer.presence import Hearing, held_back

BEAT = 1.0  # --heartbeat
TTL = 8.0  # a record's lifetime
GIVE_UP = 60.0  # Board.give_up_s on a healthy link


def beats(hearing: Hearing, start: float, end: float) -> None:
    t = start
    while t < end:
        t += BEAT
        hearing.beat(t)


@pytest.mark.parametrize("stopped_s", [60.0, 300.0, 1800.0])
def test_a_stopped_process_does_not_count_its_sleep(stopped_s: float) -> None:
    hearing = Hearing(0.0, frozen_after_s=TTL - BEAT)
    beats(hearing, 0.0, 10.0)
    hearing.read(10.0)
    landed_at = 10.0  # the last publish that reached another node, before the stop
    woke = 10.0 + stopped_s
    assert hearing.beat(woke)  # the first beat after the stop says so
    assert hearing.silent_s(woke, landed_at) == 0.0 and hearing.blind_s(woke) == 0.0
    # awake and still unheard: given up once it has been so for GIVE_UP seconds of its own time
    beats(hearing, woke, woke + GIVE_UP + 1)
    assert hearing.silent_s(woke + GIVE_UP + 1, landed_at) > GIVE_UP
    assert hearing.blind_s(woke + GIVE_UP + 1) > GIVE_UP


def test_a_dht_silent_while_the_process_runs_is_given_up() -> None:
    hearing = Hearing(0.0, frozen_after_s=TTL - BEAT)
    beats(hearing, 0.0, GIVE_UP + 2)
    assert hearing.silent_s(GIVE_UP + 2, landed_at=0.0) > GIVE_UP
    hearing.read(30.0)
    assert hearing.blind_s(GIVE_UP + 2) == GIVE_UP + 2 - 30.0


def test_a_late_beat_under_load_is_no_stop() -> None:
    hearing = Hearing(0.0, frozen_after_s=TTL - BEAT)
    assert not hearing.beat(3.0)  # 3 s late: a busy machine, not a stopped process
    assert hearing.silent_s(3.0, landed_at=0.0) == 3.0
    assert hearing.beat(3.0 + TTL)  # a whole record lifetime without a beat: it was stopped


def test_the_board_waits_for_a_rounds_slices_at_most_half_a_record_lifetime() -> None:
    last_ok = 100.0
    # nothing on the link: every beat reads, and publishes when due
    assert not any(held_back(False, last_ok + dt, last_ok, TTL) for dt in (0.0, 1.0, 3.9, 10.0))
    # a round's slices on the link: held up to 4 s (half of 8) after the last success, then not
    assert all(held_back(True, last_ok + dt, last_ok, TTL) for dt in (0.0, 1.0, 2.0, 3.9))
    assert not any(held_back(True, last_ok + dt, last_ok, TTL) for dt in (4.0, 5.0, 30.0))
