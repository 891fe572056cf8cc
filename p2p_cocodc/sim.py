"""The simulator: M replicas in one process, the core's strategies, an in-memory exchange and a
virtual clock that says what the run would cost over a WAN.

Clock model: every replica computes in parallel, one inner step costs ``step_time`` seconds. A
fragment sync is a butterfly all-reduce: each replica owns 1/M of the fragment, receives the others'
encoded slices, averages in fp32 and sends its encoded average back, so a replica's link carries
2(M−1)/M of the encoded fragment and lossy codecs quantize twice. Transfer time = latency +
bytes / bandwidth; transfers on a link are serialised. A result that is not back when due stalls
training (DiLoCo and DDP are due at once, so they always stall for the whole transfer).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from p2p_cocodc.algorithms.inner import InnerTrainer
from p2p_cocodc.algorithms.strategies import DataParallel, Strategy
from p2p_cocodc.codecs import Codec, decode_mean
from p2p_cocodc.config import TrainConfig
from p2p_cocodc.data import Shard
from p2p_cocodc.errors import UserError
from p2p_cocodc.metrics import RunLog
from p2p_cocodc.training import TrainingSetup, allreduce_wire_bytes, summary_record


@dataclass
class Link:
    """One replica's WAN link: transfers queue behind each other."""

    latency_s: float
    bandwidth_bps: float
    free_at: float = 0.0

    def transfer_time(self, num_bytes: float) -> float:
        return self.latency_s + 8.0 * num_bytes / self.bandwidth_bps

    def send(self, now: float, num_bytes: float) -> float:
        """Queue a transfer at time ``now``; returns when it has fully arrived."""
        self.free_at = max(self.free_at, now) + self.transfer_time(num_bytes)
        return self.free_at


def allreduce(payloads: list[torch.Tensor], codec: Codec) -> torch.Tensor:
    """The average every replica receives: encoded slices averaged in fp32, the average re-encoded."""
    if len(payloads) == 1:
        return payloads[0].clone()
    numel = payloads[0].numel()
    mean = decode_mean([codec.encode(x) for x in payloads], codec, numel)
    return codec.decode(codec.encode(mean), numel)


@dataclass
class Worker:
    trainer: InnerTrainer
    shard: Shard
    strategy: Strategy | DataParallel


@dataclass
class PendingResult:
    averaged: torch.Tensor
    arrives_at: float


class Simulation:
    """Builds M identical replicas and runs them; ``run`` writes records and returns the summary."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.setup = setup = TrainingSetup(cfg)
        self.num_params = setup.num_params
        self.codec = setup.codec
        self.link = Link(cfg.latency_ms / 1000.0, cfg.bandwidth_mbps * 1e6)
        self.step_time = setup.step_time() if setup.needs_step_time() else cfg.step_time
        self.settings = setup.settings(self.link.latency_s, self.link.bandwidth_bps, self.step_time)
        self.workers = []
        for i in range(cfg.workers):
            trainer, strategy = setup.replica(self.settings)
            self.workers.append(Worker(trainer, setup.shard(i, cfg.workers), strategy))
        self.eval_model = copy.deepcopy(setup.base)
        self.clock = 0.0
        self.stall = 0.0
        self.bytes_sent = 0
        self.pending: dict[int, PendingResult] = {}

    # ---- the run ----

    def run(self, log: RunLog, progress: Callable[[int, dict[str, float]], None] | None = None) -> dict:
        cfg = self.cfg
        train_losses: list[float] = []
        self._evaluate(0, log, train_losses)
        for step in range(1, cfg.steps + 1):
            started = time.perf_counter()
            train_losses.append(self._inner_step(step))
            compute = time.perf_counter() - started
            self.clock += self.step_time if self.step_time is not None else compute / cfg.workers
            if isinstance(self.workers[0].strategy, Strategy):
                self._apply_due(step)
                self._send(step)
                self._apply_due(step)
            if step % cfg.eval_every == 0 or step == cfg.steps:
                record = self._evaluate(step, log, train_losses)
                if progress is not None:
                    progress(step, record)
            elif progress is not None:
                progress(step, {})
        summary = summary_record(
            self.setup,
            self.settings,
            self.first_eval,
            self.last_eval,
            self.global_state(),
            bytes_sent=self.bytes_sent,
            stall_s=self.stall,
            sim_time_s=self.clock,
            step_time_s=self.step_time,
        )
        log.write(summary)
        return summary

    def _inner_step(self, step: int) -> float:
        """One inner step on every replica (DDP: with the gradient all-reduce between)."""
        losses = [w.trainer.backward(*w.shard.batch(step - 1)) for w in self.workers]
        strategies = [w.strategy for w in self.workers]
        if isinstance(strategies[0], DataParallel):
            grads = [s.gradient_payload() for s in strategies]  # type: ignore[union-attr]
            averaged = allreduce(grads, self.codec)
            wire = allreduce_wire_bytes(self.codec, averaged.numel(), len(grads))
            for s in strategies:
                s.apply_gradients(averaged)  # type: ignore[union-attr]
            self._transfer_and_wait(wire)
        for w in self.workers:
            w.trainer.update(step)
        loss = sum(losses) / len(losses)
        if not math.isfinite(loss):
            raise UserError(f"training diverged at step {step} (loss {loss}): lower --lr or --outer-lr")
        return loss

    def _transfer_and_wait(self, wire: int) -> None:
        arrives = self.link.send(self.clock, wire)
        self.bytes_sent += wire
        self._wait_until(arrives)

    def _wait_until(self, t: float) -> None:
        if t > self.clock:
            self.stall += t - self.clock
            self.clock = t

    def _agreed(self, choices: list[list[int]], what: str) -> list[int]:
        if any(c != choices[0] for c in choices):
            raise RuntimeError(f"replicas disagree on the fragments {what}: {choices}")
        return choices[0]

    def _fragment_strategies(self) -> list[Strategy]:
        """The replicas' fragment strategies (only called when the algorithm is not ddp)."""
        return [w.strategy for w in self.workers]  # type: ignore[misc]

    def _send(self, step: int) -> None:
        strategies = self._fragment_strategies()
        for p in self._agreed([s.sends_after(step) for s in strategies], f"to send at step {step}"):
            averaged = allreduce([s.payload(p, step) for s in strategies], self.codec)
            wire = allreduce_wire_bytes(self.codec, averaged.numel(), len(strategies))
            self.bytes_sent += wire
            self.pending[p] = PendingResult(averaged, self.link.send(self.clock, wire))

    def _apply_due(self, step: int) -> None:
        strategies = self._fragment_strategies()
        for p in self._agreed([s.due(step) for s in strategies], f"due at step {step}"):
            result = self.pending.pop(p)
            self._wait_until(result.arrives_at)
            for s in strategies:
                s.apply(p, result.averaged, step)

    # ---- evaluation ----

    def global_state(self) -> dict[str, torch.Tensor]:
        """θ̄ of replica 0 (every replica holds the same θ̄; tests check it)."""
        return self.workers[0].strategy.global_state()

    def _evaluate(self, step: int, log: RunLog, train_losses: list[float]) -> dict[str, Any]:
        record = self.setup.eval_record(self.eval_model, self.global_state(), step, self.cfg.workers)
        record.update(
            sim_time_s=self.clock,
            train_loss=sum(train_losses) / len(train_losses) if train_losses else None,
            bytes_sent=self.bytes_sent,
            stall_s=self.stall,
        )
        train_losses.clear()
        log.write(record)
        if step == 0:
            self.first_eval = record
        self.last_eval = record
        return record
