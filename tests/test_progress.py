"""Progress that tells the truth: who a peer waits for, rates and ETAs that leave the waits out, log
lines above the bars, and plain lines without cursor codes when stderr is not a terminal."""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path

from p2p_cocodc.ops.progress import Progress, progress_bars
from tests.swarm_procs import end_group, spawn, start_bootstrap
from tests.tiny_options import TWO_PEERS

STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ")


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Terminal(io.StringIO):
    """What tqdm writes to a terminal, kept; it says it is one."""

    def isatty(self) -> bool:
        return True


def lines_of(stream: io.StringIO) -> list[str]:
    """The plain lines written, each checked for its timestamp, which is then cut off."""
    lines = stream.getvalue().splitlines()
    assert all(STAMP.match(line) for line in lines), lines
    return [STAMP.sub("", line) for line in lines]


def eval_record(ppl: float, stall_s: float) -> dict[str, float]:
    return {"val_ppl": ppl, "stall_s": stall_s}


def test_plain_lines_name_who_is_here_and_rates_leave_out_waits_and_evaluations() -> None:
    clock, out = FakeClock(), io.StringIO()
    progress = Progress("", 100, 1000, out, now=clock)
    progress.named("us-east")
    progress.waiting(["us-east"], 3)
    clock.t += 600  # ten minutes alone
    progress.waiting(["us-east"], 3)  # reported every poll, written once
    progress.waiting(["us-east", "eu-west"], 3)
    clock.t += 300
    progress.waiting(["us-east", "ap-south", "eu-west"], 3)
    progress.training(0)
    for step in range(1, 11):  # 2 s per step
        clock.t += 2
        if step == 10:
            progress.evaluating()
            clock.t += 30  # evaluation is not step time
        progress.step(step, eval_record(123.4, 1.5) if step == 10 else {})
    progress.joining([])  # fell out of the swarm: takes the state again
    clock.t += 100
    progress.joining(["eu-west", "ap-south"])
    clock.t += 20
    progress.training(10)
    for step in range(11, 21):
        clock.t += 2
        progress.step(step, eval_record(99.0, 2.0) if step == 20 else {})
    assert lines_of(out) == [
        "us-east: waiting for peers 1/3 (here: us-east)",
        "us-east: waiting for peers 2/3 (here: us-east, eu-west)",
        "us-east: waiting for peers 3/3 (here: us-east, ap-south, eu-west)",
        "us-east: training from step 0/100",
        # 10 steps in 20 s of training: 0.5 step/s, 1000 tokens a step; 90 steps left take 180 s
        "us-east: step 10/100, val ppl 123.40, 500 tokens/s, stall 1.5 s, eta 03:00",
        "us-east: joining: taking the swarm's state",
        "us-east: joining: taking the state from 2 donors (eu-west, ap-south)",
        "us-east: training from step 10/100",
        "us-east: step 20/100, val ppl 99.00, 500 tokens/s, stall 2.0 s, eta 02:40",
    ]


def test_a_joiner_counts_only_the_steps_it_trained() -> None:
    clock, out = FakeClock(), io.StringIO()
    progress = Progress("eu-west", 100, 10, out, now=clock)
    progress.joining(["us-east"])
    clock.t += 50
    progress.training(60)  # the donors' 60 steps are not this peer's work
    for step in range(61, 71):
        clock.t += 1
        progress.step(step, eval_record(50.0, 0.0) if step == 70 else {})
    assert lines_of(out)[-1] == "eu-west: step 70/100, val ppl 50.00, 10 tokens/s, stall 0.0 s, eta 00:30"


def test_the_bar_shows_the_wait_then_the_training_rate() -> None:
    clock, screen = FakeClock(), Terminal()
    with progress_bars(["us-east"], 100, 1000, quiet=False, stream=screen) as (progress,):
        progress.clock.now = clock
        progress.waiting(["us-east", "eu-west"], 3)
        assert str(progress.bar) == "us-east: waiting for peers 2/3 (here: us-east, eu-west)"
        clock.t += 3600  # an hour of waiting
        progress.training(0)
        for step in range(1, 11):
            clock.t += 2
            progress.step(step, {})
        shown = str(progress.bar)
    assert shown.startswith("us-east:  10%|") and "10/100 [00:20<03:00,  2.00s/step]" in shown, shown


def test_a_log_record_while_a_bar_is_drawn_gets_its_own_line() -> None:
    screen = Terminal()
    logger = logging.getLogger("tests.progress")
    handler = logging.StreamHandler(screen)  # what configure_logging sets up on stderr
    logger.addHandler(handler)
    try:
        with progress_bars(["us-east"], 24, 1, quiet=False, stream=screen) as (progress,):
            progress.training(0)
            progress.step(1, {})
            logger.warning("a sync failed")
            drawn_after = screen.getvalue().split("a sync failed\n", 1)[1]
    finally:
        logger.removeHandler(handler)
    before = screen.getvalue().split("a sync failed", 1)[0]
    assert before.endswith("\r"), repr(before[-80:])  # the bar's line was cleared, the cursor at its start
    assert "us-east:" in drawn_after  # and the bar is drawn again below the record
    assert handler.stream is screen  # the handler writes straight to the stream again


def test_quiet_shows_nothing() -> None:
    screen = Terminal()
    with progress_bars(["us-east"], 24, 1, quiet=True, stream=screen) as (progress,):
        progress.waiting(["us-east"], 2)
        progress.training(0)
        progress.step(8, eval_record(10.0, 0.0))
    assert screen.getvalue() == ""


def test_join_piped_to_a_file_writes_plain_lines_naming_the_peers(tmp_path: Path) -> None:
    boot = start_bootstrap(tmp_path)
    options = [a for a in TWO_PEERS if a != "--quiet"]
    peers = []
    try:
        for i, region in enumerate(("us-east", "eu-west")):
            args = ["join", "--bootstrap", boot.host_port, "--run-id", "progress", *options]
            args += ["--region", region, "--shard", f"{i}/2"]
            peers.append(spawn(args, tmp_path, f"{region}.log"))  # stdout and stderr to a file
        for region, proc in zip(("us-east", "eu-west"), peers, strict=True):
            assert proc.wait(timeout=180) == 0, (tmp_path / f"{region}.log").read_text()[-3000:]
    finally:
        for proc in [*peers, boot.proc]:
            end_group(proc)
    for region, other in (("us-east", "eu-west"), ("eu-west", "us-east")):
        text = (tmp_path / f"{region}.log").read_text()
        assert "\x1b[" not in text and "\r" not in text, text[-2000:]
        lines = [STAMP.sub("", line) for line in text.splitlines() if STAMP.match(line)]
        assert f"{region}: waiting for peers 2/2 (here: {region}, {other})" in lines, text[-2000:]
        assert f"{region}: training from step 0/24" in lines, text[-2000:]
        evals = [line for line in lines if line.startswith(f"{region}: step ")]
        assert [e.split(",")[0] for e in evals] == [f"{region}: step {s}/24" for s in (8, 16, 24)], evals
        assert all(re.search(r"val ppl [\d.]+, [\d,]+ tokens/s, stall [\d.]+ s", e) for e in evals), evals
