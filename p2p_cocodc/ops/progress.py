"""Progress of long runs (simulate, join, demo) that tells the truth.

A run reports its phases through ``Phases`` (the peer and the simulator never draw anything): waiting
for peers, joining a run under way, training, evaluating, each step. ``Progress`` shows them on a
terminal as one tqdm bar per run, named after its region (or algorithm), and anywhere else (a file,
a pipe, a CI log) as plain timestamped lines, without cursor codes. Its rate and ETA count training
time only: the clock stops while the run waits for peers, takes the swarm's state or evaluates.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, Protocol, TextIO

from tqdm import tqdm


class Phases(Protocol):
    """What a run tells its progress display."""

    def named(self, name: str) -> None:
        """This run's name, once known (a peer without --region is named by its peer id)."""

    def waiting(self, here: Sequence[str], needed: int) -> None:
        """Waiting for ``needed`` peers to start the run; ``here`` names those present, this one first."""

    def joining(self, donors: Sequence[str]) -> None:
        """Taking the swarm's state (from ``donors``, once chosen) to train on from there."""

    def training(self, step: int) -> None:
        """Training (again) from ``step``: the clock runs."""

    def evaluating(self) -> None:
        """Evaluating θ̄: not step time; the clock runs again at the next ``step``."""

    def step(self, step: int, record: Mapping[str, Any]) -> None:
        """``step`` is done; ``record`` is its evaluation (val_ppl, stall_s), or empty."""


class TrainingClock:
    """Seconds spent training, and the steps trained in them: pauses do not count."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self.now = now
        self.paused_s = 0.0  # training seconds before the latest pause
        self.since: float | None = None  # when the clock last started running; None: paused
        self.steps = 0  # steps trained while the clock ran
        self.at = 0  # the latest step reported

    def start(self, step: int | None = None) -> None:
        """Run from now; with ``step``, training goes on from there (steps not trained here, such as
        a joiner's before it took the state, do not count)."""
        if step is not None:
            self.at = step
        if self.since is None:
            self.since = self.now()

    def stop(self) -> None:
        if self.since is not None:
            self.paused_s += self.now() - self.since
            self.since = None

    def reached(self, step: int) -> None:
        self.steps += max(step - self.at, 0)
        self.at = step

    def seconds(self) -> float:
        return self.paused_s + (self.now() - self.since if self.since is not None else 0.0)

    def rate(self) -> float | None:
        """Steps per second of training, None before the first step."""
        seconds = self.seconds()
        return self.steps / seconds if self.steps and seconds > 0 else None

    def remaining_s(self, total: int) -> float | None:
        rate = self.rate()
        return (total - self.at) / rate if rate else None


class _Bar(tqdm):
    """A tqdm bar whose elapsed time and rate are a ``TrainingClock``'s (tqdm's own count the waits)."""

    def __init__(self, clock: TrainingClock, **kwargs: Any) -> None:
        self.clock = clock
        super().__init__(**kwargs)

    @property
    def format_dict(self) -> dict[str, Any]:
        values = super().format_dict
        values.update(elapsed=self.clock.seconds(), rate=self.clock.rate() or 0.0)  # 0: tqdm shows '?'
        return values


class Progress:
    """One run's progress on ``stream``: a bar on a terminal, plain timestamped lines elsewhere,
    nothing when ``stream`` is None (--quiet)."""

    def __init__(
        self,
        name: str,
        total: int,
        tokens_per_step: int,
        stream: TextIO | None,
        position: int = 0,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.total = total
        self.tokens_per_step = tokens_per_step  # what this process trains per step, for tokens/s
        self.stream = stream
        self.clock = TrainingClock(now)
        self.phase: str | None = "starting"  # what it is doing instead of training; None: training
        self.bar: _Bar | None = None
        if stream is not None and stream.isatty():
            self.bar = _Bar(
                self.clock,
                total=total,
                unit="step",
                file=stream,
                position=position,
                dynamic_ncols=True,
                bar_format="{desc}",
                desc=self._phase_text(),
            )

    # ---- Phases ----

    def named(self, name: str) -> None:
        self.name = name
        if self.bar is not None and self.phase is not None:
            self._show_phase()

    def waiting(self, here: Sequence[str], needed: int) -> None:
        self._pause(f"waiting for peers {len(here)}/{needed} (here: {', '.join(here)})")

    def joining(self, donors: Sequence[str]) -> None:
        if donors:
            self._pause(f"joining: taking the state from {len(donors)} donors ({', '.join(donors)})")
        else:
            self._pause("joining: taking the swarm's state")

    def training(self, step: int) -> None:
        self.clock.start(step)
        self.phase = None
        if self.bar is not None:
            self.bar.bar_format = None
            self.bar.set_description(self.name, refresh=False)
            self.bar.update(step - self.bar.n)
            self.bar.refresh()
        elif self.stream is not None:
            self._line(f"training from step {step}/{self.total}")

    def evaluating(self) -> None:
        self.clock.stop()

    def step(self, step: int, record: Mapping[str, Any]) -> None:
        self.clock.reached(step)
        if self.phase is None:
            self.clock.start()  # after an evaluation
        if self.bar is not None:
            if record:
                ppl, tokens_s, stall_s = self._measures(record)
                postfix = {"val_ppl": ppl, "tokens/s": tokens_s, "stall_s": stall_s}
                self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(step - self.bar.n)
        elif self.stream is not None and record:
            ppl, tokens_s, stall_s = self._measures(record)
            remaining = self.clock.remaining_s(self.total)
            eta = tqdm.format_interval(remaining) if remaining is not None else "?"
            self._line(
                f"step {step}/{self.total}, val ppl {ppl}, {tokens_s} tokens/s, stall {stall_s} s, eta {eta}"
            )

    # ---- display ----

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def _pause(self, phase: str) -> None:
        self.clock.stop()
        if phase == self.phase:
            return
        self.phase = phase
        if self.bar is not None:
            self._show_phase()
        elif self.stream is not None:
            self._line(phase)

    def _show_phase(self) -> None:
        """The bar shows what the run does instead of training, not a step count that stands still."""
        assert self.bar is not None and self.phase is not None
        self.bar.bar_format = "{desc}"
        self.bar.set_description_str(self._phase_text())

    def _phase_text(self) -> str:
        return f"{self.name}: {self.phase}" if self.name else str(self.phase)

    def _measures(self, record: Mapping[str, Any]) -> tuple[str, str, str]:
        """Validation perplexity, training tokens per second (waits excluded), seconds stalled."""
        rate = self.clock.rate()
        tokens_s = f"{rate * self.tokens_per_step:,.0f}" if rate else "?"
        return f"{record['val_ppl']:.2f}", tokens_s, f"{record['stall_s']:.1f}"

    def _line(self, text: str) -> None:
        assert self.stream is not None
        prefix = f"{self.name}: " if self.name else ""
        self.stream.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {prefix}{text}\n")
        self.stream.flush()


@contextmanager
def progress_bars(
    names: Sequence[str], total: int, tokens_per_step: int, quiet: bool, stream: TextIO | None = None
) -> Iterator[list[Progress]]:
    """One ``Progress`` per name (stacked bars on a terminal) on ``stream`` (stderr), none shown when
    quiet. While bars are drawn, log records go above them; the bars are closed on the way out."""
    out = None if quiet else stream or sys.stderr
    shown = [Progress(name, total, tokens_per_step, out, position=i) for i, name in enumerate(names)]
    drawn = any(p.bar is not None for p in shown)
    try:
        with _logs_above_bars(out) if out is not None and drawn else nullcontext():
            yield shown
    finally:
        for p in shown:
            p.close()


class _AboveBars:
    """A stream for log handlers: each record is written with tqdm.write, which clears the bars on
    the same stream, writes the record on its own line, and draws the bars again below it."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        tqdm.write(text, file=self.stream, end="")

    def flush(self) -> None:
        self.stream.flush()


@contextmanager
def _logs_above_bars(stream: TextIO) -> Iterator[None]:
    """Point every log handler that writes to ``stream`` (ours, hivemind's) through ``_AboveBars``, and
    with them the records of a program that configured none (logging's last resort, on stderr) and
    Python's warnings."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    handlers = [
        h
        for logger in loggers
        if isinstance(logger, logging.Logger)
        for h in logger.handlers
        if isinstance(h, logging.StreamHandler) and h.stream is stream
    ]
    above = _AboveBars(stream)
    for handler in handlers:
        handler.setStream(above)
    last_resort = logging.lastResort
    if stream is sys.stderr:
        logging.lastResort = logging.StreamHandler(above)
        logging.lastResort.setLevel(logging.WARNING)
    logging.captureWarnings(True)
    try:
        yield
    finally:
        logging.captureWarnings(False)
        logging.lastResort = last_resort
        for handler in handlers:
            handler.setStream(stream)
