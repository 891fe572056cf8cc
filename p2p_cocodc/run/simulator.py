"""The simulator: M replicas in one process, the core's strategies, an in-memory exchange and a
virtual clock that says what the run would cost over a WAN.

Clock model: every replica computes in parallel, one inner step costs ``step_time`` seconds. A
fragment sync is a butterfly all-reduce: each replica owns 1/M of the fragment, receives the others'
encoded slices, averages in fp32 and sends its encoded average back, so a replica's link carries
(M−1)/M of the encoded fragment and of its encoded average (``Codec.round_bytes``: 2(M−1)/M of the
fragment for a dense codec) and lossy codecs quantize twice. Transfer time = latency +
bytes / bandwidth; transfers on a link are serialised. A result that is not back when due stalls
training (DiLoCo and DDP are due at once, so they always stall for the whole transfer).

A simulation's whole state (replicas, inner and outer optimizers, schedules, syncs in flight with
their averaged results, clock, records so far, RNG) is ``state_dict()``; a checkpoint of it resumes
bit-exactly (``Simulation.resumed``).
"""

from __future__ import annotations

import asyncio
import copy
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from p2p_cocodc.algorithms.aggregation import CosineRecord
from p2p_cocodc.algorithms.butterfly import butterfly_mean
from p2p_cocodc.algorithms.codecs import Codec
from p2p_cocodc.algorithms.inner import InnerTrainer
from p2p_cocodc.algorithms.inner_share import RegionShare, auto_share, weight
from p2p_cocodc.algorithms.state import expect_tensor
from p2p_cocodc.algorithms.strategies import ReplicaStrategy
from p2p_cocodc.config.train import TrainConfig
from p2p_cocodc.errors import Stopped, UserError
from p2p_cocodc.models.data import Shard
from p2p_cocodc.names import AVERAGE_GRADIENTS
from p2p_cocodc.run.checkpoint import Checkpoint, CheckpointWriter
from p2p_cocodc.run.loop import Rejoin, ReplicaLoop, StepCallback
from p2p_cocodc.run.records import Records, RunLog
from p2p_cocodc.run.replay import read_events
from p2p_cocodc.run.setup import TrainingSetup, allreduce_wire_bytes, save_run


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


@dataclass
class Worker:
    trainer: InnerTrainer
    shard: Shard
    strategy: ReplicaStrategy


@dataclass
class PendingResult:
    averaged: torch.Tensor | None  # None: the round failed (replayed), every worker abandons it
    arrives_at: float
    round_id: str = ""
    spacing: int = 0  # the send-slot spacing a replayed round agreed on (0: none)
    judged: list[Judged] = field(default_factory=list)  # what its slice owners record once it is applied


@dataclass
class Judged:
    """What the owner of one slice of a round measured: each member's c_i (``CosineRecord.add``)."""

    owner: int  # the owner's data shard
    members: list[int | str]  # the ids its record knows the members by
    cosines: list[float]


class Simulation:
    """Builds M identical replicas and runs them; ``run`` writes records and returns the summary.
    With --events, the replicas are those the swarm run recorded, by data shard, each from the
    step it joined at.

    Besides the evaluations and the summary, a round whose slice owners screened members out
    (``--aggregate``, docs/algorithms.md) writes ``{"kind": "exclusion", "round": "f2:96", "step":
    96, "excluded": [3]}``: the data shards left out of at least one slice of its average.

    ``step_time`` replaces the configured or measured seconds per inner step (a resumed run keeps
    the interrupted run's, so that ``--overlap auto`` resolves the same)."""

    def __init__(self, cfg: TrainConfig, step_time: float | None = None) -> None:
        self.cfg = cfg
        self.setup = setup = TrainingSetup(cfg)
        self.num_params = setup.num_params
        self.codec = setup.codec  # ddp's gradient rounds; a fragment's sync takes its own (``SyncCodecs``)
        self.aggregation = cfg.aggregation()
        self.link = Link(cfg.latency_ms / 1000.0, cfg.bandwidth_mbps * 1e6)
        if step_time is None:
            step_time = setup.step_time() if setup.needs_step_time() else cfg.step_time
        self.step_time = step_time
        self.settings = setup.settings(self.link.latency_s, self.link.bandwidth_bps, self.step_time)
        # uneven regions: shard i trains share_steps[i] of every H steps and runs at speeds[i]
        self.speeds = cfg.speeds()
        shares = cfg.inner_shares() or [auto_share(1.0 / v, 1.0) for v in self.speeds]
        self.shares = [RegionShare(share, self.settings.inner_steps) for share in shares]
        self.events = read_events(cfg.events, cfg.data_shards) if cfg.events else None
        joins = self.events.joins if self.events is not None else {}
        if cfg.algo in AVERAGE_GRADIENTS and joins.keys() - {0}:
            raise UserError(
                f"--events {cfg.events} records peers joining a run under way, which a ddp run cannot take"
            )
        if joins and 0 not in joins:
            raise UserError(
                f"--events {cfg.events} has no join records at step 0 (the peers that started the run): "
                "replay the --out of a peer that took part in the whole run"
            )
        # by data shard, in shard order; a shard that has not joined (yet) has no replica
        self.workers: dict[int, Worker] = {i: self._fresh_worker(i) for i in joins.get(0, range(cfg.workers))}
        if self.events is not None and self.events.start_pace:  # the pace the swarm started with
            for worker in self.workers.values():
                worker.strategy.pace_from_start(self.events.start_pace)
        self.eval_model = setup.eval_model()
        self.step = 0  # inner steps done
        self.clock = 0.0
        self.measured_step_s = 0.0  # without --step-time: the last measured seconds of one replica's step
        self.stall_s = 0.0
        self.closing = False  # after the last step, with --final-sync
        self.bytes_sent = 0
        self.pending: dict[int, PendingResult] = {}
        self.train_losses: list[float] = []  # since the last evaluation
        self.records = Records(None)  # every record written so far (``run`` gives it the run's log)
        self._stop: Callable[[], signal.Signals | None] = lambda: None  # ``run``'s stop request
        self._received: signal.Signals | None = None
        self.exclusions: list[tuple[str, list[int]]] = []  # this step's rounds that left shards out
        # each data shard's record of the members' cosines at the slices it owned (its screening memory)
        self.cosine_records: dict[int, CosineRecord] = {}

    @classmethod
    def resumed(cls, cfg: TrainConfig, checkpoint: Checkpoint) -> Simulation:
        """The simulation as it was at ``checkpoint``'s step (already checked against ``cfg``'s
        options); UserError if its data or its state does not fit."""
        step_time = checkpoint.restore(lambda state: state["clock"]["step_time"])
        if step_time is not None and not isinstance(step_time, float):
            raise UserError(f"{checkpoint.path} records a step time of {step_time!r} s: it is damaged")
        sim = cls(cfg, step_time=step_time)
        checkpoint.check_data(sim.setup.data_sha256())
        checkpoint.restore(sim.load_state_dict)
        return sim

    # ---- the run ----

    def run(
        self,
        log: RunLog,
        progress: Callable[[int, dict[str, float]], None] | None = None,
        checkpoints: CheckpointWriter | None = None,
        stop: Callable[[], signal.Signals | None] | None = None,
    ) -> dict:
        """Train from the current step to --steps with the replica loop (``run/loop.py``) and return
        the summary (also written to ``log``).

        A resumed simulation first writes the records of the steps before its checkpoint, so ``log``
        ends as an uninterrupted run's would. ``checkpoints`` writes the state when it is due and
        after the last step. ``stop`` is asked after every step: a signal there ends the run, after
        checkpointing that step when ``checkpoints`` is given (and writing --save's partial folder),
        with ``Stopped``."""
        self._stop = stop or (lambda: None)
        resumed = bool(self.records.kept)
        self.records.log = log
        shown = StepCallback(progress)
        loop = ReplicaLoop(self, self.setup, self.settings, self.records, self.eval_model, shown, checkpoints)
        loop.train_losses = self.train_losses
        return asyncio.run(loop.run(resumed=resumed))

    # ---- the driver of the replica loop ----

    def stop_signal(self) -> str | None:
        self._received = self._stop()
        return None if self._received is None else self._received.name

    async def stopped(self, step: int, checkpoint: Path | None) -> None:
        """A simulation stopped by a signal ends with ``Stopped`` (its --save to the partial folder)."""
        received = self._received
        assert received is not None
        if self.cfg.save is not None:  # written as DIR.partial-step-T, never as a finished run's DIR
            evals = self.records.evals()
            why = f"stopped by {received.name}"
            save_run(self.setup, self.global_state(), step, evals[0], evals[-1], why)
        how = (
            f"checkpoint written to {checkpoint}; to continue, run the same command with --resume"
            if checkpoint is not None
            else "no checkpoint written (no --checkpoint-dir)"
        )
        where = f"after step {step} of {self.cfg.steps}"
        raise Stopped(f"stopped by {received.name} {where}: {how}", 128 + received)

    async def before_step(self) -> None:
        pass

    async def train_step(self, step: int) -> float | None:
        """One inner step on every replica that trains this step (with ddp, the gradient round
        between backward and update; with --inner-share, a replica trains only its share of the
        steps), then the clock moves on by a step's time at the slowest replica's pace. None: no
        replica trained this step."""
        started = time.perf_counter()
        training = [w for i, w in self.workers.items() if self.shares[i].trains(step)]
        losses = [float(w.trainer.backward(*w.shard.batch(step - 1))) for w in training]
        # a gradient round the replayed swarm failed: every peer skipped the step's update
        skipped = self._any_worker().strategy.averages_gradients and not self._average_gradients(step)
        if not skipped:
            for w in training:
                w.trainer.update(step)
        compute = time.perf_counter() - started
        if self.step_time is None and training:
            self.measured_step_s = compute / len(training)
        # seconds per step of the slowest replica, its trained steps spread evenly over the window
        pace = max(self.shares[i].fraction / self.speeds[i] for i in self.workers)
        self.clock += (self.step_time if self.step_time is not None else self.measured_step_s) * pace
        return sum(losses) / len(losses) if losses else None

    def _average_gradients(self, step: int) -> bool:
        """The gradient round of ``step`` (False: it failed, as the replayed swarm's did)."""
        strategies = {i: w.strategy for i, w in self.workers.items()}
        payloads = {i: s.gradient_payload() for i, s in strategies.items()}
        averaged, wire, judged = self._average(f"g:{step}", step, payloads, self.codec)
        if wire < 0:
            raise UserError(f"--events {self.cfg.events} has no record of round g:{step}")
        self._transfer_and_wait(wire)
        if averaged is None:
            return False
        self._record_cosines(judged)
        for s in strategies.values():
            s.apply_gradients(averaged)
        return True

    def due(self, step: int) -> list[int]:
        return self._agreed([w.strategy.due(step) for w in self.workers.values()], f"due at step {step}")

    def final_sync(self, step: int) -> None:
        self.closing = True  # the waits for the closing rounds are no stall of training
        for worker in self.workers.values():
            worker.strategy.close(step)

    def sends_after(self, step: int) -> list[int]:
        choices = [w.strategy.sends_after(step) for w in self.workers.values()]
        return self._agreed(choices, f"to send at step {step}")

    async def after_boundary(self, step: int) -> None:
        self._take_joiners(step)
        self._write_exclusions(step)

    def step_done(self, step: int) -> None:
        pass

    async def rejoin(self, why: Rejoin) -> None:
        raise AssertionError(f"a simulated replica never rejoins ({why})")

    async def compute(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    def clock_field(self) -> dict[str, float]:
        return {"sim_time_s": self.clock}

    async def evaluated(
        self, step: int, state: dict[str, torch.Tensor], record: dict[str, Any], started: float
    ) -> None:
        pass

    def checkpoint_state(self) -> dict[str, Any]:
        return self.state_dict()

    async def finish(self, stopping: bool) -> None:
        pass

    def unfinished(self, failure: str | None) -> str | None:
        return None

    def summary_fields(self, failure: str | None) -> dict[str, Any]:
        return {
            "bytes_sent": self.bytes_sent,
            "stall_s": self.stall_s,
            "sim_time_s": self.clock,
            "step_time_s": self.step_time,
        }

    def _transfer_and_wait(self, wire: int) -> None:
        arrives = self.link.send(self.clock, wire)
        self.bytes_sent += wire
        self._wait_until(arrives)

    def _wait_until(self, t: float) -> None:
        if t > self.clock:
            self.stall_s += 0.0 if self.closing else t - self.clock
            self.clock = t

    def _agreed(self, choices: list[list[int]], what: str) -> list[int]:
        if any(c != choices[0] for c in choices):
            raise RuntimeError(f"replicas disagree on the fragments {what}: {choices}")
        return choices[0]

    def _any_worker(self) -> Worker:
        """A live replica: they all hold the same θ̄, schedule and syncs in flight."""
        return next(iter(self.workers.values()))

    def _fresh_worker(self, shard: int) -> Worker:
        """A replica of the initial model with a fresh inner optimizer, reading data shard ``shard``."""
        trainer, strategy = self.setup.replica(self.settings)
        return Worker(trainer, self.setup.shard(shard, self.cfg.data_shards), strategy)

    def _take_joiners(self, step: int) -> None:
        """Each shard that --events says joins after ``step`` gets a fresh replica that takes over
        the shared state of a live one (θ̄ at ``step``), replacing the shard's old replica if any."""
        shards = self.events.joins.get(step, ()) if self.events is not None else ()
        for i in shards:
            donor = self._any_worker().strategy  # ddp runs with joiners are refused
            worker = self._fresh_worker(i)
            worker.strategy.join_from(donor.shared_state())  # type: ignore[attr-defined]
            self.workers[i] = worker
            self.cosine_records.pop(i, None)  # its peer's screening memory starts afresh too
            for pending in self.pending.values():  # what its old replica measured is gone with it
                pending.judged = [j for j in pending.judged if j.owner != i]
        if shards:
            self.workers = dict(sorted(self.workers.items()))

    def _group(self, round_id: str) -> tuple[int, ...] | None:
        """The data shards a round averages: every live replica's, or with --events those of the
        group the swarm formed; None if the swarm's round failed. KeyError if --events has no such
        round."""
        if self.events is None:
            return tuple(self.workers)
        record = self.events.rounds[round_id]
        return record.members if record.completed else None

    def _pace(self, round_id: str) -> int:
        """The send-slot spacing the swarm agreed with a round (only replays have one)."""
        record = self.events.rounds.get(round_id) if self.events is not None else None
        return record.pace if record is not None else 0

    def _average(
        self, round_id: str, step: int, payloads: dict[int, torch.Tensor], codec: Codec
    ) -> tuple[torch.Tensor | None, int, list[Judged]]:
        """A round's aggregate of the payloads by data shard in ``codec`` (None if it failed), the
        bytes one replica's link carried, and what its slice owners measured, for their records
        once it is applied; the data shards its slice owners screened out are kept for an
        exclusion record."""
        try:
            group = self._group(round_id)
        except KeyError:
            return None, -1, []
        if group is None:
            return None, 0, []
        missing = [i for i in group if i not in payloads]
        if missing:
            raise UserError(
                f"--events {self.cfg.events}: round {round_id} averages data shard {missing[0]}, which no "
                "join record starts before it"
            )
        owners = [self._cosine_record(i) for i in group]
        # the owners remember members by peer id in a swarm (a shard whose peer came back with a
        # new id is a new member to them)
        ids = [self.events.member(i, step) for i in group] if self.events is not None else group
        weights = [weight(*self.shares[i].recent(step)) for i in group]
        averaged, excluded, cosines = butterfly_mean(
            [payloads[i] for i in group], codec, self.aggregation, owners, ids, weights
        )
        if excluded:
            self.exclusions.append((round_id, [group[i] for i in excluded]))
        judged = [Judged(owner, list(ids), list(c)) for owner, c in zip(group, cosines, strict=True) if c]
        return averaged, allreduce_wire_bytes(codec, averaged.numel(), len(group)), judged

    def _cosine_record(self, shard: int) -> CosineRecord:
        if shard not in self.cosine_records:
            self.cosine_records[shard] = CosineRecord(self.aggregation.outlier_window)
        return self.cosine_records[shard]

    def send(self, p: int, step: int) -> None:
        """Every replica's payload of fragment ``p`` averaged at once; the result arrives on the
        virtual clock when the link has carried its bytes."""
        strategies = {i: w.strategy for i, w in self.workers.items()}
        round_id = f"f{p}:{step}"
        payloads = {i: s.payload(p, step) for i, s in strategies.items()}  # type: ignore[attr-defined]
        codec = next(iter(strategies.values())).sync_codec(p)  # type: ignore[attr-defined]
        averaged, wire, judged = self._average(round_id, step, payloads, codec)  # the codec its send took
        self.bytes_sent += max(wire, 0)
        arrives = self.link.send(self.clock, max(wire, 0))
        missing = round_id if wire < 0 else ""
        self.pending[p] = PendingResult(averaged, arrives, missing, self._pace(round_id), judged)

    async def apply(self, p: int, step: int) -> bool:
        """Wait (on the virtual clock) for fragment ``p``'s result and apply it on every replica, or
        abandon it on every replica where the replayed swarm's round failed."""
        result = self.pending.pop(p)
        if result.round_id:
            closing = (
                " (a run without closing rounds: replay it with --no-final-sync)" if self.closing else ""
            )
            raise UserError(
                f"--events {self.cfg.events} has no record of round {result.round_id}, which this run "
                f"applies at step {step}: replay the --out of a peer that took part in the whole run"
                + closing
            )
        self._wait_until(result.arrives_at)
        for w in self.workers.values():
            if result.averaged is None:
                w.strategy.abandon(p)  # type: ignore[attr-defined]
            else:
                w.strategy.apply(p, result.averaged, step, spacing=result.spacing)  # type: ignore[attr-defined]
        self._record_cosines(result.judged)
        return True

    def _record_cosines(self, judged: list[Judged]) -> None:
        """The owners' records take what they measured in a round being applied."""
        for j in judged:
            self._cosine_record(j.owner).add(j.members, j.cosines)

    def _write_exclusions(self, step: int) -> None:
        """The exclusion records of the rounds averaged after ``step``."""
        for round_id, shards in self.exclusions:
            self.records.write({"kind": "exclusion", "round": round_id, "step": step, "excluded": shards})
        self.exclusions.clear()

    # ---- evaluation ----

    def global_state(self) -> dict[str, torch.Tensor]:
        """θ̄ of a live replica (every replica holds the same θ̄; tests check it)."""
        return self._any_worker().strategy.global_state()

    # ---- state ----

    def state_dict(self) -> dict[str, Any]:
        """Everything the run needs to go on bit-exactly after ``step``: each replica's parameters
        and AdamW state, its strategy's θ̄, outer momentum, schedule and syncs in flight, the
        averaged results in flight and when they arrive, the clock and link, counters, the train
        losses since the last evaluation, the records so far, and torch's CPU RNG. The data
        position is the step itself (``Shard.batch`` is a function of it). Tensors are live."""
        return {
            "step": self.step,
            "clock": {
                "now": self.clock,
                "stall": self.stall_s,
                "link_free_at": self.link.free_at,
                "step_time": self.step_time,
            },
            "bytes_sent": self.bytes_sent,
            "settings": self._resolved(),
            "workers": [
                {"trainer": w.trainer.state_dict(), "strategy": w.strategy.state_dict()}
                for w in self.workers.values()
            ],
            "pending": [
                {
                    "fragment": p,
                    "averaged": r.averaged,
                    "arrives_at": r.arrives_at,
                    "spacing": r.spacing,
                    "judged": [[j.owner, j.members, j.cosines] for j in r.judged],
                }
                for p, r in self.pending.items()
            ],
            "train_losses": list(self.train_losses),
            "cosine_records": [[shard, r.state_dict()] for shard, r in self.cosine_records.items()],
            "records": copy.deepcopy(self.records.kept),
            "rng": {"torch": torch.get_rng_state()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take over a ``state_dict()`` of a simulation with the same options and data (sets
        torch's CPU RNG too). ValueError, KeyError or RuntimeError if it does not fit."""
        if state["settings"] != self._resolved():
            raise ValueError(f"its run synced with {state['settings']}, this one with {self._resolved()}")
        if len(state["workers"]) != len(self.workers):
            raise ValueError(f"it holds {len(state['workers'])} workers, this run {len(self.workers)}")
        for worker, saved in zip(self.workers.values(), state["workers"], strict=True):
            worker.trainer.load_state_dict(saved["trainer"])
            worker.strategy.load_state_dict(saved["strategy"])
        pending = {}
        for result in state["pending"]:
            p = result["fragment"]
            in_flight = [p in w.strategy.in_flight for w in self.workers.values()]
            if not isinstance(p, int) or p in pending or not all(in_flight):
                raise ValueError(f"an averaged result for fragment {p!r}, which is not in flight")
            like = self._any_worker().strategy.outer[p].global_params  # type: ignore[union-attr]
            averaged = expect_tensor(result["averaged"], like, f"averaged result of fragment {p}")
            spacing = result["spacing"]
            if not isinstance(spacing, int) or spacing < 0:
                raise ValueError(f"the spacing agreed with fragment {p}'s result is {spacing!r}")
            judged = [Judged(int(o), list(m), list(map(float, c))) for o, m, c in result.get("judged", [])]
            arrives = float(result["arrives_at"])
            pending[p] = PendingResult(averaged.clone(), arrives, spacing=spacing, judged=judged)
        strategy = self._any_worker().strategy
        if set(pending) != set(strategy.in_flight):
            raise ValueError("the syncs in flight and the averaged results in flight differ")
        self.pending = pending
        clock = state["clock"]
        self.clock, self.stall_s = float(clock["now"]), float(clock["stall"])
        self.link.free_at = float(clock["link_free_at"])
        self.bytes_sent = int(state["bytes_sent"])
        self.step = int(state["step"])
        self.train_losses = [float(x) for x in state["train_losses"]]
        self.cosine_records = {}
        for shard, saved in state.get("cosine_records", []):  # older checkpoints: every member new
            self._cosine_record(int(shard)).load_state_dict(saved)
        self.records.kept = list(state["records"])
        if not self.records.kept or self.records.kept[-1]["step"] > self.step:
            raise ValueError(f"its records do not end at or before step {self.step}")
        torch.set_rng_state(expect_tensor(state["rng"]["torch"], torch.get_rng_state(), "torch RNG state"))

    def _resolved(self) -> dict[str, int]:
        """The settings a run resolves from the link and step time (--overlap/--transmissions auto)."""
        return {"overlap": self.settings.overlap, "transmissions": self.settings.transmissions}
