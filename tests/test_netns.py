"""The thin-link harness (tests/netns.py): links carry what tbf allows, and nothing is left behind."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.netns import NetnsUnavailable, leftovers, netns_unavailable_reason, tcp_throughput, thin_network


@pytest.fixture(scope="module", autouse=True)
def _namespaces_allowed() -> None:
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(f"this machine does not allow network namespaces: {reason}")


def test_a_shaped_link_carries_about_its_rate_and_nothing_remains_after() -> None:
    with thin_network(2, 8.0) as net:
        a, b = net.nodes
        made = [*net.namespaces, *net.interfaces]
        assert len(made) == 3 + 5 and all(net.suffix in name and len(name) <= 15 for name in made)
        assert set(leftovers(net.suffix)) == set(net.namespaces)  # interfaces live only inside them
        mbps, got = tcp_throughput(net, a, b, 2_000_000)
        assert got == 2_000_000
        # a check of the shaping (goodput is ~95 % of the line rate after headers), not a benchmark
        assert 0.5 * 8.0 <= mbps <= 1.3 * 8.0, f"{mbps:.2f} Mbit/s through an 8 Mbit/s link"
        # the other direction is shaped too, and the switch's own address answers
        back, _ = tcp_throughput(net, b, a, 500_000, port=5202)
        assert 0.5 * 8.0 <= back <= 1.3 * 8.0, f"{back:.2f} Mbit/s back"
        dial = f"import socket; socket.create_connection(('{net.switch_address}', 9), 5)"
        reach = net.run_in(
            a,
            [sys.executable, "-c", dial],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert "ConnectionRefusedError" in reach.stderr, reach.stderr  # reached, nothing listens
    assert leftovers(net.suffix) == []


def test_everything_is_removed_when_the_body_raises() -> None:
    started: list[subprocess.Popen] = []
    with pytest.raises(ZeroDivisionError), thin_network(3, 4.0) as net:
        suffix = net.suffix
        # a process still running inside a namespace must not keep it alive
        started.append(net.popen_in(net.nodes[0], ["sleep", "600"], start_new_session=True))
        1 / 0  # noqa: B018 - the body fails
    assert leftovers(suffix) == []
    assert started[0].wait(timeout=10) != 0


def test_a_reason_instead_of_a_network_when_namespaces_cannot_be_made(monkeypatch) -> None:
    import tests.netns as netns

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert "not running as root" in netns.netns_unavailable_reason()
    with pytest.raises(NetnsUnavailable, match="not running as root"), thin_network(2, 8.0):
        pass
