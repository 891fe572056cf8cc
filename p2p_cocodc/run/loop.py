"""THE replica loop: what every driver does around inner steps, written once.

Both drivers run it: the simulator (M replicas in one process, an in-memory exchange, a virtual
clock: ``run/simulator.py``) and the peer (one replica, the swarm, the wall clock:
``peer/syncs.py``). What differs between them is the ``Driver``; the loop owns the order of things:

    while steps remain and no stop was asked for:
        driver.before_step()                      # the peer: is it still in the swarm?
        read the losses of steps ≤ t-2; finite?   # else: "training diverged"
        loss = driver.train_step(t)               # every local replica (ddp: its gradient round)
        apply due results; [read every loss;] send; apply due results   (``algorithms/strategies.py``)
        at the last step, with --final-sync: driver.final_sync(t), then apply/send/apply again
        until no closing round is left (one fragment each)
        driver.after_boundary(t)                  # joiners replayed, exclusions, state server
        evaluate θ̄ every --eval-every steps and at the end
        checkpoint when due
    driver.finish(); evaluate if the last step was not; the summary (and --save) once

A step's loss may come back unread (a tensor on the replica's device): reading it makes the host
wait for the device to finish that step. So the loop reads a loss two steps late, and the device
has a step queued while the host does the boundary's work; every loss is read before a send (a
replica whose loss is not finite sends nothing), an evaluation, a checkpoint and the end.

A replica that learns its θ̄ is no longer the swarm's raises ``Rejoin`` (the driver takes the
state again and the loop goes on from the step it took); one whose syncs keep failing raises
``SyncsFailing`` (the loop ends, and the summary says why). A stop (SIGINT/SIGTERM) is honoured
between steps: a checkpoint of that step is written (with --checkpoint-dir), then the driver says
how the run ends (``Driver.stopped``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from p2p_cocodc.errors import UserError
from p2p_cocodc.run.checkpoint import CheckpointWriter
from p2p_cocodc.run.records import Records
from p2p_cocodc.run.setup import TrainingSetup, save_run, summary_record

log = logging.getLogger(__name__)


def read_losses(losses: list[float | torch.Tensor]) -> list[float]:
    """The values of losses a driver returned (a tensor is read from its device: a wait for it)."""
    return [float(loss) for loss in losses]


class Rejoin(Exception):
    """This replica's θ̄ can no longer be trusted to be the swarm's (it was stopped past its record's
    lifetime, or a round completed without it and its average is gone): take the state again."""


class SyncsFailing(Exception):
    """Every sync of the last rounds of every fragment failed: this replica is not training with a
    swarm. The run stops, and its summary says why (``failure``): never a success."""


class Progress(Protocol):
    """What the loop tells whoever shows progress (``ops/progress.py``)."""

    def training(self, step: int) -> None: ...

    def evaluating(self) -> None: ...

    def step(self, step: int, record: dict[str, Any]) -> None: ...


class StepCallback:
    """``Progress`` from a plain ``callback(step, eval record or {})`` (the simulator's API)."""

    def __init__(self, callback: Callable[[int, dict[str, Any]], None] | None) -> None:
        self.callback = callback

    def training(self, step: int) -> None:
        pass

    def evaluating(self) -> None:
        pass

    def step(self, step: int, record: dict[str, Any]) -> None:
        if self.callback is not None:
            self.callback(step, record)


class Driver(Protocol):
    """The part of a run that differs between the simulator and the peer."""

    step: int  # inner steps done; a driver may move it (a peer that took the swarm's state)
    bytes_sent: int
    stall_s: float

    def stop_signal(self) -> str | None:
        """The name of the signal that asked the run to stop, if one did."""

    async def stopped(self, step: int, checkpoint: Path | None) -> None:
        """The run stops after ``step`` (``checkpoint``: the one just written): raise to end it
        now, or return to end it like a finished run (summary, --save to a partial folder)."""

    async def before_step(self) -> None: ...

    async def train_step(self, step: int) -> float | torch.Tensor | None:
        """One inner step of every local replica; the mean train loss (a tensor: not read yet), or
        None where no replica trained this step (``--inner-share``)."""

    def due(self, step: int) -> list[int]: ...

    def final_sync(self, step: int) -> None:
        """``step`` is the run's last (--final-sync): every replica's ``strategy.close(step)``."""

    def sends_after(self, step: int) -> list[int]:
        """The fragments to send after ``step`` (none once a stop was asked for, for a driver that
        notices one during a step)."""

    def send(self, p: int, step: int) -> None: ...

    async def apply(self, p: int, step: int) -> bool:
        """Apply fragment ``p``'s result (waiting for it): False if a stop interrupted the wait."""

    async def after_boundary(self, step: int) -> None: ...

    def step_done(self, step: int) -> None: ...

    async def rejoin(self, why: Rejoin) -> None: ...

    async def compute(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` where the replica's computations run (the peer: its training thread)."""

    def clock_field(self) -> dict[str, float]:
        """The clock an eval record reports: ``sim_time_s``, or ``wall_time_s``."""

    async def evaluated(
        self, step: int, state: dict[str, torch.Tensor], record: dict[str, Any], started: float
    ) -> None:
        """θ̄ after ``step`` (``state``) was evaluated (``record``), the evaluation having started at
        ``started`` (``time.perf_counter``)."""

    def global_state(self) -> dict[str, torch.Tensor]: ...

    def checkpoint_state(self) -> dict[str, Any]: ...

    async def finish(self, stopping: bool) -> None: ...

    def unfinished(self, failure: str | None) -> str | None: ...

    def summary_fields(self, failure: str | None) -> dict[str, Any]: ...


class ReplicaLoop:
    """Trains ``driver``'s replicas from its current step to --steps; ``run`` returns the summary."""

    def __init__(
        self,
        driver: Driver,
        setup: TrainingSetup,
        settings: Any,
        records: Records,
        eval_model: torch.nn.Module,
        progress: Progress | None = None,
        checkpoints: CheckpointWriter | None = None,
    ) -> None:
        self.driver = driver
        self.setup = setup
        self.settings = settings
        self.records = records
        self.eval_model = eval_model
        self.progress: Progress = progress if progress is not None else StepCallback(None)
        self.checkpoints = checkpoints
        self.checkpointed: tuple[int, Path] | None = None  # the step and folder of the last checkpoint
        self.train_losses: list[float] = []  # since the last evaluation
        self.unread: list[tuple[int, float | torch.Tensor]] = []  # (step, loss) of losses not read yet

    async def run(self, resumed: bool = False) -> dict[str, Any]:
        """A resumed run first writes the records of the steps before its checkpoint (``--out``
        ends as an uninterrupted run's would); a fresh one evaluates θ̄ where it starts."""
        cfg, driver = self.setup.cfg, self.driver
        if resumed and self.records.kept:
            self.records.replay()
        else:
            await self._evaluate(driver.step)
        self.progress.training(driver.step)
        failure = None  # why the replica stopped training with the swarm, if it did
        while True:
            received = driver.stop_signal()
            if received is not None:
                await self._read_losses()
                written = None
                if self.checkpoints is not None:
                    done = self.checkpointed is not None and self.checkpointed[0] == driver.step
                    written = self.checkpointed[1] if done else await self._checkpoint()  # type: ignore[index]
                await driver.stopped(driver.step, written)
                break
            if driver.step >= cfg.steps:
                break
            step = driver.step + 1
            try:
                await driver.before_step()
                await self._read_losses(keep=1)  # the device may still run step - 1
                loss = await driver.train_step(step)
                if loss is not None:  # None: this replica's region trains a share of the steps, not this one
                    self.unread.append((step, loss))
                driver.step = step
                await self._boundary(step)
                if step == cfg.steps and cfg.final_sync:
                    driver.final_sync(step)  # closing rounds: θ̄ ends holding all the training,
                    while await self._boundary(step):  # one at a time, as a paced link carries them
                        pass
            except Rejoin as exc:
                await driver.rejoin(exc)
                self.progress.training(driver.step)
                continue
            except SyncsFailing as exc:
                log.error("%s", exc)
                failure = str(exc)
                break
            await driver.after_boundary(step)
            record: dict[str, Any] = {}
            if step % cfg.eval_every == 0 or step == cfg.steps:
                record = await self._evaluate(step)
            self.progress.step(step, record)
            driver.step_done(step)
            if self.checkpoints is not None and self.checkpoints.due(step, cfg.steps):
                await self._checkpoint()  # after the step's records: the checkpoint holds them
        await driver.finish(driver.stop_signal() is not None)
        evals = self.records.evals()
        if evals[-1]["step"] != driver.step:
            await self._evaluate(driver.step)
            evals = self.records.evals()
        return self._summary(evals[0], evals[-1], failure)

    async def _boundary(self, step: int) -> bool:
        """Between two steps: results due now are applied, the schedule's sends start, and a result
        due at once (τ = 0) is applied too (a wait a stop interrupted ends it). True if it sent any,
        and no stop interrupted it."""
        if not await self._apply_due(step):
            return False
        sends = self.driver.sends_after(step)
        if sends:
            await self._read_losses()
        for p in sends:
            self.driver.send(p, step)
        return await self._apply_due(step) and bool(sends)

    async def _apply_due(self, step: int) -> bool:
        for p in self.driver.due(step):
            if not await self.driver.apply(p, step):
                return False
        return True

    async def _read_losses(self, keep: int = 0) -> None:
        """Read every unread loss but the last ``keep`` (in the driver's training thread: it waits
        for the device to finish those steps); UserError at the first that is not finite."""
        ready = self.unread[: len(self.unread) - keep]
        if not ready:
            return
        del self.unread[: len(ready)]
        values = await self.driver.compute(read_losses, [loss for _, loss in ready])
        for (step, _), loss in zip(ready, values, strict=True):
            if not math.isfinite(loss):
                raise UserError(f"training diverged at step {step} (loss {loss}): lower --lr or --outer-lr")
            self.train_losses.append(loss)

    async def _evaluate(self, step: int) -> dict[str, Any]:
        """Validation loss of θ̄ after ``step``, with the run's clock, train loss, bytes and stall."""
        await self._read_losses()
        self.progress.evaluating()
        driver = self.driver
        state = driver.global_state()
        started = time.perf_counter()
        workers = self.setup.cfg.workers
        record = await driver.compute(self.setup.eval_record, self.eval_model, state, step, workers)
        await driver.evaluated(step, state, record, started)
        losses = self.train_losses
        record.update(
            driver.clock_field(),
            train_loss=sum(losses) / len(losses) if losses else None,
            bytes_sent=driver.bytes_sent,
            stall_s=driver.stall_s,
        )
        losses.clear()
        self.records.write(record)
        return record

    async def _checkpoint(self) -> Path:
        assert self.checkpoints is not None
        await self._read_losses()
        step = self.driver.step
        state = self.driver.checkpoint_state()
        path = await self.driver.compute(self.checkpoints.write, step, state)
        self.checkpointed = (step, path)
        log.info("checkpoint of step %d written to %s", step, path)
        return path

    def _summary(self, first: dict[str, Any], last: dict[str, Any], failure: str | None) -> dict[str, Any]:
        """The run's last record; θ̄ written to --save (a run that did not finish with the swarm: to
        its partial folder)."""
        driver, cfg = self.driver, self.setup.cfg
        state = driver.global_state()
        saved = None  # what save_run wrote (--save, or a fallback folder when --save failed)
        if cfg.save is not None:
            saved = save_run(self.setup, state, last["step"], first, last, driver.unfinished(failure))
        fields = driver.summary_fields(failure)
        summary = summary_record(self.setup, self.settings, first, last, state, saved, **fields)
        self.records.write(summary)
        self.records.close()  # the summary stays the last record
        return summary
