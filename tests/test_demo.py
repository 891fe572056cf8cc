"""``p2p-cocodc demo`` end to end: a bootstrap and three peers as real processes, a results table, and
nothing left running afterwards — on success and on Ctrl-C."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

from tests.swarm_procs import CLI, ENV, descendants, end_group, group_members, run_cli, wait_for
from tests.tiny_options import TINY_MODEL, TINY_SYNCS

SMALL = [*TINY_MODEL, "--steps", "16", *TINY_SYNCS]


def start_demo(workdir: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        CLI + ["demo", "--quiet", "--workdir", str(workdir), *SMALL, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        start_new_session=True,
    )


def group_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None  # it ended meanwhile


def watch_groups(demo: subprocess.Popen[str], timeout: float) -> set[int]:
    """Until the demo exits, collect the process groups of everything under it: the bootstrap's and each
    peer's (with their DHT processes and p2pd), and those of torch_shm_manager, which calls setsid.
    Once the demo has exited, every one of those groups must be empty."""
    groups: set[int] = set()
    deadline = time.monotonic() + timeout
    while demo.poll() is None and time.monotonic() < deadline:
        groups |= {g for g in map(group_of, descendants(demo.pid)) if g is not None}
        time.sleep(0.2)
    return groups - {demo.pid}


ROW = re.compile(r"^(\d+)\s+(\d+)/3\s+([\d.]+) → ([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$")


def test_demo_trains_three_peers_and_leaves_nothing_behind(tmp_path: Path) -> None:
    demo = start_demo(tmp_path / "work")
    try:
        groups = watch_groups(demo, timeout=150)
        out, err = demo.communicate(timeout=10)
    finally:
        end_group(demo)
    assert demo.returncode == 0, err[-3000:]
    assert len(groups) >= 4, "expected a bootstrap and three peers, each in its own process group"
    assert all(group_members(g) == [] for g in groups), "the demo left processes behind"

    rows = [m.groups() for m in map(ROW.match, out.splitlines()) if m]
    assert [(peer, shard) for peer, shard, *_ in rows] == [("0", "0"), ("1", "1"), ("2", "2")], out
    assert all(float(after) < float(before) for _, _, before, after, *_ in rows), out
    assert all(float(mb) > 0 for *_, mb, _, _ in rows), out
    assert "θ̄ sha256: all 3 peers agree" in out, out
    assert all((tmp_path / "work" / f"peer{i}.log").exists() for i in range(3))


def _has_records(path: Path) -> bool:
    return path.exists() and path.stat().st_size > 0


def test_ctrl_c_stops_every_process_and_exits_130(tmp_path: Path) -> None:
    work = tmp_path / "work"
    demo = start_demo(work, "--steps", "100000")
    try:
        # interrupt once every peer trains: then the bootstrap, the peers and all their helpers run
        def training() -> bool:
            assert demo.poll() is None, demo.communicate()[1][-3000:]
            # a record file is opened at start; its first record (step 0) is written once training runs
            return all(_has_records(work / f"peer{i}.jsonl") for i in range(3))

        wait_for(training, 90, "the peers to start training")
        groups = {g for g in map(group_of, descendants(demo.pid)) if g is not None} - {demo.pid}
        demo.send_signal(signal.SIGINT)  # what Ctrl-C sends; the children, in their own groups, get nothing
        # the demo gives its children TERM_GRACE_S, SIGKILLs the stragglers, then waits on strays
        _, err = demo.communicate(timeout=120)
    finally:
        end_group(demo)
    assert demo.returncode == 130, err[-3000:]
    assert "interrupted" in err and "Traceback" not in err
    assert len(groups) >= 4
    assert all(group_members(g) == [] for g in groups), "the demo left processes behind"


def test_a_failing_process_ends_the_demo_with_one_error_line(tmp_path: Path) -> None:
    (tmp_path / "bootstrap.id").write_bytes(b"not a key")  # the bootstrap exits 2 on it at once
    done = run_cli(["demo", "--quiet", "--workdir", str(tmp_path), *SMALL], tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith("error: bootstrap exited with code 2") and "not a private key" in errors[0]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "peer0.log").exists()


def test_the_demo_points_at_the_status_page_not_its_json(tmp_path: Path) -> None:
    """The address it prints is the page (``/``), not ``/status``, the JSON the page reads."""
    (tmp_path / "bootstrap.id").write_bytes(b"not a key")  # it prints the address, then fails at once
    done = run_cli(["demo", "--quiet", "--workdir", str(tmp_path), *SMALL], tmp_path, timeout=120)
    pages = [m.group(1) for m in re.finditer(r"status page (http://\S+)", done.stderr)]
    assert len(pages) == 1, done.stderr
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", pages[0]), pages
