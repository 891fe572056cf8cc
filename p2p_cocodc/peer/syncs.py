"""A peer's replica and its syncs: the ``Driver`` the replica loop (``run/loop.py``) drives on a
peer, one replica trained against the swarm on the wall clock.

- Each inner step runs in a dedicated training thread, so the event loop stays free to serve the
  other peers' fragment exchanges (ddp: the gradient round runs between backward and update).
- A send takes only the snapshot between steps (on the device); the copy to the host, the outer
  gradient, the round, the outer step its result leads to and the schedule's score of it run in
  the sync's task, in worker threads: never on the event loop, which the next step waits for. What
  is left between two steps (the snapshot, the merge) is timed: ``sync_boundary_s``.
- A result due is waited for (the wait is the recorded stall), then merged; a round that failed on
  every peer alike is abandoned alike (θ̄ stays identical); one the others completed without this
  peer (``RoundLost``) leaves θ̄ behind theirs, so the replica takes the swarm's state again
  (``Rejoin``); syncs that keep failing mean it is not training with a swarm (``SyncsFailing``).
- CoCoDC's pace: each round's group takes the largest send-slot spacing its members ask for, and
  every peer applies it with the round.

Peer i computes exactly what simulator worker i computes.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from p2p_cocodc.algorithms.aggregation import CosineRecord
from p2p_cocodc.algorithms.codecs import Codec
from p2p_cocodc.algorithms.devices import HostCopy, StepTimer, peak_memory_bytes
from p2p_cocodc.algorithms.inner_share import RegionShare
from p2p_cocodc.algorithms.schedules import NARROW_AFTER_ROUNDS, RoundCost
from p2p_cocodc.algorithms.state import expect_list, expect_tensor
from p2p_cocodc.algorithms.strategies import AlgoSettings, PreparedResult
from p2p_cocodc.config.derived import declared_busy_s
from p2p_cocodc.errors import UserError
from p2p_cocodc.models.data import Shard
from p2p_cocodc.ops.monitoring import PeerMetrics, PeerSample
from p2p_cocodc.peer.cpu import training_yields_cpu
from p2p_cocodc.peer.in_flight import SentWith, load_screening, screening_state, sent_with
from p2p_cocodc.peer.presence import Presence
from p2p_cocodc.peer.region import Region
from p2p_cocodc.run.loop import Rejoin, SyncsFailing
from p2p_cocodc.run.records import Records, params_sha256
from p2p_cocodc.run.setup import TrainingSetup, allreduce_wire_bytes
from p2p_cocodc.swarm.exchange import (
    FragmentExchange,
    RoundFailed,
    RoundLost,
    RoundUndecided,
    ScreeningMemory,
)
from p2p_cocodc.swarm.records import NONE_YET
from p2p_cocodc.swarm.state_transfer import StateServer

log = logging.getLogger(__name__)

STOP_GRACE_S = 3.0  # on SIGINT/SIGTERM, how long syncs in flight may still take
FAILING_STREAK = 3  # this many syncs of every fragment failing in a row: the swarm is not syncing
MAX_RESYNCS = 5  # a peer that had to take the swarm's state again this often stops


def say_paced(schedule: Any, was: int | None, round_id: str, said_before: bool) -> bool:
    """Say that the swarm's pace changed (``schedule``: the paced one): a warning the first time it
    sends less than asked, then info. Returns whether this was that first time."""
    now = schedule.spacing
    first = not said_before and now > schedule.base_spacing
    log.log(
        logging.WARNING if first else logging.INFO,
        "the swarm now sends a fragment every %s steps (was %s): round %s agreed on the pace in which "
        "its slowest member's link carries a round and its syncs land%s",
        now,
        was,
        round_id,
        " (further changes are logged with --verbose)" if first else "",
    )
    return first


def fragment_round(p: int, step: int) -> str:
    """The id of the round that syncs fragment ``p`` sent after inner step ``step``."""
    return f"f{p}:{step}"


class SwarmReplica:
    """One peer's replica, trained with the swarm. Built with the replica; ``attach`` gives it the
    swarm's parts once they run, and ``take_state`` (the peer's) how to take the swarm's state again."""

    def __init__(
        self,
        setup: TrainingSetup,
        settings: AlgoSettings,
        region: Region | None,
        metrics: PeerMetrics,
        pace: str,
        round_timeout_s: float,
        step_time_s: float | None,
    ) -> None:
        self.setup = setup
        self.cfg = setup.cfg
        self.settings = settings
        self.region = region  # rank 0 of a region of several processes (torchrun): ``region.py``
        self.metrics = metrics
        self.pace = pace
        self.round_timeout_s = round_timeout_s
        trainer = setup.trainer()
        # what the peer reads and writes as its replica: the trainer, or an fsdp region's host copy
        self.trainer = region.wrap(trainer) if region is not None else trainer
        self.strategy = setup.strategy(self.trainer.model, settings, self.trainer.placement)
        self.eval_model = setup.eval_model()
        self.train_pool = ThreadPoolExecutor(1, thread_name_prefix="train", initializer=training_yields_cpu)
        self.step = 0
        self.step_time_s = step_time_s or 0.0
        self.min_step_s = 0.0  # --min-step-time: a slower region emulated
        self.share = RegionShare((setup.cfg.inner_shares() or [None])[0], settings.inner_steps, step_time_s)
        self.step_timer = StepTimer(setup.placement.device)
        self.stall_s = 0.0
        self.boundary_s = 0.0  # time between steps spent on sync work (snapshot, send, merge), waits left out
        self.eval_s = 0.0  # evaluation time, kept out of the training throughput
        self.steps_trained = 0  # inner steps this process trained (a joiner's run starts past step 0)
        self.train_started: float | None = None  # perf_counter when training began (after the wait)
        self.trained_s: float | None = None  # training_s when the run ended (before the last syncs)
        self.finish_s = 0.0  # how long the end waited for the syncs in flight and the last θ̄'s digests
        self.final_sync_s: float | None = None  # --final-sync: the waits for the closing rounds, once begun
        self.val_ppl = NONE_YET  # the latest evaluation of θ̄
        self.versions = [0] * max(1, len(self.strategy.fragments))
        self.shard_index: int | None = None
        self.joined_at = 0  # the step whose end this replica took the swarm's state at (0: started the run)
        self.resyncs = 0  # times it took the state again after it fell out of the swarm
        self.pending: dict[int, asyncio.Task[PreparedResult]] = {}
        self.sent_with: dict[int, SentWith] = {}  # each fragment's last send: its pace, screening memory
        self.screening = CosineRecord(setup.cfg.aggregation().outlier_window)  # the exchange judges by it
        self.failed_in_a_row = 0  # syncs that failed since the last one that completed
        self.paced_before = False  # the swarm has sent less than configured, and this peer said so
        self.data: Shard | None = None
        # given by ``attach`` once the swarm's parts run
        self.exchange: FragmentExchange | None = None
        self.state_server: StateServer | None = None
        self.presence: Presence | None = None
        self.records = Records(None)  # the run's records (the peer gives it its own): a checkpoint holds them
        self.stop = asyncio.Event()
        self.take_state: Callable[[], Awaitable[None]] | None = None
        # a joiner far behind the swarm (``node.CATCH_UP_S``) catches up untrained: what to call once
        # it has reached it
        self.catching_up: Callable[[], Awaitable[None]] | None = None
        self.on_step: Callable[[], None] = lambda: None
        self.peer_id = ""
        self.stopped_by: str | None = None  # the signal that stopped the peer, if one did

    def attach(
        self,
        exchange: FragmentExchange,
        state_server: StateServer | None,
        presence: Presence,
        stop: asyncio.Event,
        take_state: Callable[[], Awaitable[None]],
        on_step: Callable[[], None],
    ) -> None:
        """The swarm's parts, the stop request, how to resync, what to call after each step (metrics)."""
        self.exchange, self.state_server, self.presence = exchange, state_server, presence
        self.stop, self.take_state = stop, take_state
        self.on_step = on_step
        self.peer_id = presence.peer_id

    # ---- sizes ----

    def round_bytes(self, codec: Codec | None = None) -> int:
        """What this peer sends in the largest round, a butterfly over up to --max-peers members, in
        ``codec`` (default: --codec, the steady one; a paced one sends less)."""
        codec = codec or self.setup.codec
        return allreduce_wire_bytes(codec, self.strategy.largest_round(), self.cfg.data_shards)

    def max_message_bytes(self) -> int:
        """The largest message of the run: the largest round's average in fp32 (a FETCH answer), or
        a slice of it encoded with either of the run's codecs, plus room for the message's other fields."""
        numel = self.strategy.largest_round()
        return max(4 * numel, self.setup.codecs.largest(numel)) + 64 * 1024

    @property
    def bytes_sent(self) -> int:
        return self.exchange.stats.bytes_sent if self.exchange is not None else 0

    def tokens_per_s(self) -> float:
        """Tokens this process trained per second since training began, evaluations left out (the
        wait for peers comes before, the end's wait for the last syncs after): what the summary
        reports and the record shows meanwhile."""
        if self.train_started is None:
            return 0.0
        return self.steps_trained * self.cfg.batch_size * self.cfg.seq_len / max(self.training_s(), 1e-9)

    def training_s(self) -> float:
        """Seconds since training began until now or, once the run ends, until its last step was
        done; evaluations left out."""
        if self.trained_s is not None:
            return self.trained_s
        assert self.train_started is not None
        return time.perf_counter() - self.train_started - self.eval_s

    # ---- state: checkpoints, a joiner's, a resumed run's ----

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything this peer needs to go on after ``self.step`` bit-exactly, with the others: its
        replica and AdamW state, its strategy (θ̄, outer momentum, schedule, syncs in flight with
        their snapshots: a resumed swarm runs those syncs again with the same payloads), fragment
        versions, data shard, the records written so far, torch's RNG. Tensors are live."""
        return {
            "step": self.step,
            "shard": self.shard_index,
            "joined_at": self.joined_at,
            "versions": list(self.versions),
            "trainer": self.trainer.state_dict(),
            "strategy": self.strategy.state_dict(),
            "sync_shape": [self.settings.overlap, self.settings.transmissions],  # the swarm's τ and N
            "records": list(self.records.kept),
            "rng": {"torch": torch.get_rng_state()},
            "screening": screening_state(self.screening, self.sent_with, self.strategy.in_flight),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        if int(state["shard"]) != self.shard_index:
            raise ValueError(f"it reads data shard {state['shard']}, this peer {self.shard_index}")
        self.trainer.load_state_dict(state["trainer"])
        if self.region is not None:
            self.region.whole = True
        self.strategy.load_state_dict(state["strategy"])
        self.versions = expect_list(state["versions"], len(self.versions), int, "fragment versions")
        self.step, self.joined_at = int(state["step"]), int(state["joined_at"])
        self.records.kept = list(state["records"])
        torch.set_rng_state(expect_tensor(state["rng"]["torch"], torch.get_rng_state(), "torch RNG state"))
        self.sent_with = load_screening(state.get("screening"), self.screening)

    def shared_state(self) -> dict[str, Any]:
        """A copy of what every live peer holds identically now, for a joiner (a step boundary)."""
        return {"strategy": copy.deepcopy(self.strategy.shared_state()), "versions": list(self.versions)}

    def sync_with(self, settings: AlgoSettings) -> None:
        """From now on ``settings`` (the swarm's τ and N): before the first step, a resume or a
        take-over of the swarm's state, the strategy is built for them again."""
        self.settings = settings
        self.strategy = self.setup.strategy(self.trainer.model, settings, self.trainer.placement)

    def join_from(self, state: dict[str, Any], step: int) -> None:
        """Become the replica of a peer that takes the swarm's shared state at the end of ``step``:
        a fresh AdamW, every parameter set to θ̄; the syncs in flight then it fetches the averages
        of, and applies them when they are due, like every other peer."""
        self.cancel_syncs()
        self.trainer.reset()
        self.strategy = self.setup.strategy(self.trainer.model, self.settings, self.trainer.placement)
        if self.region is not None:
            self.region.whole = True
        try:
            self.strategy.join_from(state["strategy"])  # type: ignore[attr-defined]
            versions = expect_list(state["versions"], len(self.versions), int, "fragment versions")
        except (ValueError, KeyError, TypeError) as exc:
            raise UserError(f"the state the donors sent does not fit this run ({exc})") from None
        self.versions = versions
        self.step = self.joined_at = step
        for p, sync in self.strategy.in_flight.items():
            size = torch.zeros_like(self.strategy.outer[p].global_params)  # type: ignore[attr-defined]
            self.pending[p] = asyncio.create_task(self._round(p, sync.sent_step, size, None, None))
        self.failed_in_a_row = 0

    def rerun_in_flight(self) -> None:
        """After a whole-swarm resume: run again the syncs in flight at the checkpoint, with the
        payloads they had (θ̄_p has not moved since the send: Δ_p = θ̄_p − snapshot_p)."""
        for p, sync in self.strategy.in_flight.items():
            vector = self.strategy.outer_gradient(p, sync.snapshot.cpu())  # type: ignore[attr-defined]
            known = sent_with(self.sent_with, p, sync.sent_step)
            pace, memory = (known.pace, known.memory) if known else (pace_wish(self), None)
            self.pending[p] = asyncio.create_task(self._round(p, sync.sent_step, vector, pace, memory))

    def cancel_syncs(self) -> None:
        for task in self.pending.values():
            task.cancel()
        self.pending.clear()

    def close(self) -> None:
        self.cancel_syncs()
        self.train_pool.shutdown(wait=True, cancel_futures=True)

    # ---- the replica loop's driver ----

    def start_training(self) -> None:
        """From now on this replica trains (``tokens_per_s`` counts from here): its data shard read."""
        assert self.shard_index is not None
        self.data = self.setup.shard(self.shard_index, self.cfg.data_shards)
        self.setup.placement.reserve_host_memory([f.numel for f in self.strategy.fragments])
        self.train_started = time.perf_counter()

    def stop_signal(self) -> str | None:
        return "a signal" if self.stop.is_set() else None

    async def stopped(self, step: int, checkpoint: Path | None) -> None:
        log.warning("stopping after step %d on a signal", step)

    async def before_step(self) -> None:
        assert self.presence is not None
        self.presence.check()
        self.presence.check_split()
        swarm = self.presence.swarm_step() if self.catching_up is not None else None
        if self.catching_up is not None and swarm is None and self.presence.run_finished():
            raise UserError(not_caught_up(self, "finished"))
        if self.catching_up is not None and swarm is not None and swarm[0] <= self.step:
            caught_up, self.catching_up = self.catching_up, None
            log.warning("caught up with the swarm at the end of step %d: trains with it from here", self.step)
            # θ ← θ̄, a fresh AdamW, the syncs in flight fetched: what a joiner taking the state now holds
            self.join_from(self.shared_state(), self.step)
            await caught_up()

    async def train_step(self, step: int) -> float | torch.Tensor | None:
        """One inner step, or None on a step this region's share leaves out (``--inner-share``)."""
        assert self.data is not None
        if self.catching_up is not None:
            return None
        if self.presence is not None and self.share.choose(self.presence.fastest_step_s):
            log.info("trains %s from step %d (--inner-share auto)", self.share, step)
        if not self.share.trains(step):
            return None
        self.step_timer.step_starts()
        started = time.perf_counter()
        loss = await self._inner_step(step, *self.data.batch(step - 1))
        if self.min_step_s:  # a slower region: its step time (its pace, its 'auto') includes the wait
            await asyncio.sleep(self.min_step_s - (time.perf_counter() - started))
        elapsed = self.step_timer.step_done(time.perf_counter() - started)
        elapsed = time.perf_counter() - started if self.min_step_s else elapsed
        if elapsed is not None:
            first = step == 1 or self.step_time_s == 0.0
            self.step_time_s = elapsed if first else 0.9 * self.step_time_s + 0.1 * elapsed
            self.share.measured(elapsed)
        self.steps_trained += 1
        return loss

    async def _inner_step(self, step: int, x: torch.Tensor, y: torch.Tensor) -> float | torch.Tensor:
        if self.region is not None:
            region = self.region
            return await self.compute(region.lead_step, self.shard_index, x, y, step)
        if not self.strategy.averages_gradients:
            return await self.compute(self.trainer.step, x, y, step)
        # the gradient all-reduce sits between backward and the optimizer step
        assert self.exchange is not None
        loss = await self.compute(self.trainer.backward, x, y)
        started = time.perf_counter()
        try:
            averaged = await self.exchange.allreduce(f"g:{step}", self.strategy.gradient_payload(), step)
            self.metrics.round_seconds.observe(time.perf_counter() - started)
        except RoundLost as exc:
            raise UserError(
                f"the swarm averaged the gradients of step {step} without this peer and that average "
                f"is gone ({exc}); this peer's model is no longer the swarm's, so it stops"
            ) from None
        except RoundFailed as exc:
            log.warning("gradient all-reduce of step %d failed (%s); step skipped", step, exc)
            self._record_round(f"g:{step}", completed=False)
            return loss
        finally:
            self.stall_s += time.perf_counter() - started
        self._record_round(f"g:{step}", completed=True)
        self.exchange.applied(f"g:{step}")
        self.strategy.apply_gradients(averaged)
        await self.compute(self.trainer.update, step)
        return loss

    def due(self, step: int) -> list[int]:
        return self.strategy.due(step)

    def final_sync(self, step: int) -> None:
        """Closing rounds: their waits are no stall of training, which has ended (``final_sync_s``)."""
        self.trained_s = self.training_s()
        self.final_sync_s = 0.0
        self.strategy.close(step)

    def sends_after(self, step: int) -> list[int]:
        return [] if self.stop.is_set() else self.strategy.sends_after(step)

    def send(self, p: int, step: int) -> None:
        """Start the sync of fragment ``p`` after ``step``. Between two steps only the snapshot is
        taken (on the device); its copy to the host, the outer gradient, the exchange and the outer
        step the result leads to run in the sync's task (``_sync``)."""
        started = time.perf_counter()
        if self.catching_up is not None:  # no round counts on it yet: it only takes the average
            self.strategy.send(p, step)  # type: ignore[attr-defined]
            size = torch.zeros_like(self.strategy.outer[p].global_params)  # type: ignore[attr-defined]
            self.pending[p] = asyncio.create_task(self._round(p, step, size, None, None))
            return
        if self.region is not None:  # an fsdp region gathers the fragment from its ranks' shards
            self.region.collect(self.strategy.fragments[p].params, self.trainer.model)
        snapshot = self.trainer.placement.to_host(self.strategy.send(p, step))  # type: ignore[attr-defined]
        assert self.exchange is not None
        sent = self.sent_with[p] = SentWith(step, pace_wish(self), self.exchange.screening_memory())
        self.pending[p] = asyncio.create_task(self._sync(p, step, snapshot, sent.pace, sent.memory, started))
        self.boundary_s += time.perf_counter() - started

    async def _sync(
        self, p: int, step: int, snapshot: HostCopy, pace: int, memory: ScreeningMemory, sent_at: float
    ) -> PreparedResult:
        """One fragment sync, off the training thread and the event loop: Δ_p = θ̄_p − θ_p from
        the snapshot's host copy (in a worker thread), the round, then the result prepared for
        ``Strategy.apply`` (the outer step on the CPU, the new θ̄_p copied to the device) so that
        applying it between two steps costs only the merge. How long that took from ``sent_at``
        (the send, ``time.perf_counter``), less the wait for the round's other members, is the
        sync's landing time (``LinkMeter.landed``). ``memory``: the screening memory at the send."""
        assert self.exchange is not None
        strategy = self.strategy

        def outer_gradient() -> torch.Tensor:
            return strategy.outer_gradient(p, snapshot.wait())  # type: ignore[attr-defined]

        prepared = await self._round(p, step, await asyncio.to_thread(outer_gradient), pace, memory)
        waited = self.exchange.groups[fragment_round(p, step)].arrival_wait_s
        self.exchange.link.landed(strategy.sync_codec(p).name, time.perf_counter() - sent_at - waited)  # type: ignore[attr-defined]
        return prepared

    async def _round(
        self, p: int, sent_step: int, vector: torch.Tensor, pace: int | None, memory: ScreeningMemory | None
    ) -> PreparedResult:
        """The round of fragment p sent after ``sent_step``: with ``vector``, the ``pace`` this peer
        asks for and its screening memory at the send, or (``pace`` None: a sync in flight when this
        peer took the swarm's state) only fetching its average; then it prepared for ``apply``."""
        assert self.exchange is not None
        strategy = self.strategy
        round_id = fragment_round(p, sent_step)
        take_part = pace is not None
        started = time.perf_counter()
        recent = self.share.recent(sent_step)
        codec = strategy.sync_codec(p)  # type: ignore[attr-defined]
        averaged = await self.exchange.allreduce(
            round_id, vector, sent_step, take_part, pace or 0, recent, codec, memory
        )
        self.metrics.round_seconds.observe(time.perf_counter() - started)
        return await asyncio.to_thread(strategy.prepare, p, averaged)  # type: ignore[attr-defined]

    async def apply(self, p: int, step: int) -> bool:
        assert self.exchange is not None and self.presence is not None
        task = self.pending[p]
        waited = time.perf_counter()
        stopping = asyncio.ensure_future(self.stop.wait())
        try:  # a signal, or a lost swarm, is noticed while a sync is still running
            await asyncio.wait({task, stopping, *self.presence.guards()}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if self.final_sync_s is None:
                self.stall_s += time.perf_counter() - waited
            else:
                self.final_sync_s += time.perf_counter() - waited
        self.presence.check()
        if not task.done():
            return False
        started = time.perf_counter()
        try:
            return self._apply_result(p, step, task)
        finally:
            self.boundary_s += time.perf_counter() - started

    def _apply_result(self, p: int, step: int, task: asyncio.Task[PreparedResult]) -> bool:
        """Fold the sync of fragment ``p``, done, into the replica (or abandon it, if it failed)."""
        assert self.exchange is not None
        del self.pending[p]
        strategy = self.strategy
        round_id = fragment_round(p, strategy.in_flight[p].sent_step)
        try:
            prepared = task.result()
        except RoundFailed as exc:
            sync_failed(self, p, step, exc)
            self._record_round(round_id, completed=False)
            return True
        self.failed_in_a_row = 0
        self._record_round(round_id, completed=True, codec=strategy.sync_codec(p).name)  # type: ignore[attr-defined]
        self.exchange.applied(round_id)
        was = strategy.send_spacing()
        if self.region is not None:  # the merge reads the fragment's local progress
            self.region.collect(strategy.fragments[p].params, self.trainer.model)
        strategy.apply(p, prepared, step, spacing=self.exchange.groups[round_id].pace)  # type: ignore[attr-defined]
        if self.region is not None:
            self.region.changed_params(strategy.fragments[p].params, self.trainer.model)
        self.versions[p] += 1
        if strategy.send_spacing() != was:
            self.paced_before |= say_paced(strategy.schedule, was, round_id, self.paced_before)  # type: ignore[attr-defined]
        return True

    def _record_round(self, round_id: str, completed: bool, codec: str | None = None) -> None:
        """One record in --out for every sync this peer settles: the round's group (data shards, in
        member order), the pace it agreed on, whether it completed and, for a fragment's completed
        round, the wire codec its payloads took (``SyncCodecs``: it follows from the pace the
        schedule held at the send, so a replay needs only the pace). ``simulate --events`` replays
        them."""
        assert self.exchange is not None
        group = self.exchange.groups.get(round_id) if completed else None
        members, pace = (list(group.shards), group.pace) if group is not None else ([], 0)
        record = {"kind": "round", "round": round_id, "step": self.step, "members": members, "pace": pace}
        self.records.write({**record, "completed": completed, **({"codec": codec} if codec else {})})

    async def after_boundary(self, step: int) -> None:
        if self.state_server is not None:
            self.state_server.step_done(step)

    def step_done(self, step: int) -> None:
        self.on_step()

    async def rejoin(self, why: Rejoin) -> None:
        """This peer fell out of the swarm: take the swarm's state again, as a joiner."""
        assert self.take_state is not None and self.presence is not None
        self.resyncs += 1
        if self.resyncs > MAX_RESYNCS:
            raise UserError(
                f"{why}; this peer had to take the swarm's state {MAX_RESYNCS} times already, so it stops: "
                "is this machine stopped or cut off again and again?"
            )
        log.warning("%s: taking the swarm's state again (resync %d)", why, self.resyncs)
        self.presence.watch()  # the lapse watch ended with this Rejoin, if it raised it
        await self.take_state()

    async def compute(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.train_pool, fn, *args)

    def clock_field(self) -> dict[str, float]:
        assert self.train_started is not None
        return {"wall_time_s": time.perf_counter() - self.train_started}

    async def evaluated(
        self, step: int, state: dict[str, torch.Tensor], record: dict[str, Any], started: float
    ) -> None:
        assert self.presence is not None
        self.presence.agreement.record(step, await self.compute(params_sha256, state))
        self.eval_s += time.perf_counter() - started
        self.val_ppl = min(record["val_ppl"], 1e308)  # a record's numbers are finite (inf: loss past 700)

    def global_state(self) -> dict[str, torch.Tensor]:
        return self.strategy.global_state()

    async def finish(self, stopping: bool) -> None:
        """Let the syncs still running finish (the other peers need our slices; after closing
        rounds none is left); apply none of them, as the simulator's run ends with them unapplied.
        Stopped by a signal, the other peers are likely stopping too: wait only briefly."""
        if self.train_started is not None:
            self.trained_s = self.training_s()
        started = time.perf_counter()
        await finish_syncs(self, stopping)
        self.finish_s = time.perf_counter() - started

    def unfinished(self, failure: str | None) -> str | None:
        """Why this peer's θ̄ is not a finished run's (its --save goes to a partial folder), if it is not."""
        assert self.presence is not None
        if (failure := failure_at_end(self, failure)) is not None:
            return failure
        if self.presence.split_from is not None or self.presence.unsettled is not None:
            return "its θ̄ is not the one the swarm holds"
        if self.step < self.cfg.steps:
            return f"stopped after step {self.step} of {self.cfg.steps}"
        return None

    def summary_fields(self, failure: str | None) -> dict[str, Any]:
        return peer_summary(self, failure)


def sync_failed(replica: SwarmReplica, p: int, step: int, exc: RoundFailed) -> None:
    """A sync that failed on every live peer alike is abandoned alike (θ̄ stays identical); one the
    others completed without us (``RoundLost``) leaves θ̄ behind theirs: this peer takes the swarm's
    state again; one it could not learn the outcome of (``RoundUndecided``) is abandoned too, θ̄ in
    doubt until the digests settle it (``swarm/agreement.py``: peers that all took the state at
    once had nobody to take it from). Syncs that keep failing: it is not training with a swarm."""
    strategy = replica.strategy
    assert replica.presence is not None
    sent = strategy.in_flight[p].sent_step
    if isinstance(exc, RoundUndecided):
        log.warning(
            "this peer could not learn whether the swarm completed the sync of fragment %d sent after "
            "step %d (%s); it goes on as if it failed, and holds θ̄ in doubt until the peers' θ̄ "
            "digests show which θ̄ the swarm holds",
            p,
            sent,
            exc,
        )
        replica.presence.doubt(step)
    elif isinstance(exc, RoundLost):
        raise Rejoin(
            f"the swarm completed the sync of fragment {p} sent after step {sent} without this peer, "
            f"and its average is no longer kept ({exc})"
        )
    else:
        log.warning("sync of fragment %d after step %d failed on every peer (%s); skipped", p, step, exc)
    strategy.abandon(p)  # type: ignore[attr-defined]
    replica.failed_in_a_row += 1
    if replica.failed_in_a_row >= FAILING_STREAK * len(strategy.fragments):
        raise SyncsFailing(
            f"the last {replica.failed_in_a_row} syncs all failed (last: {exc}); this peer is not "
            "training with the swarm. Check that the other peers are reachable (--announce, "
            "firewall) and alive (the bootstrap's /status)"
        )


async def finish_syncs(replica: SwarmReplica, stopping: bool) -> None:
    """The end of ``SwarmReplica.finish``: the syncs in flight awaited (briefly when stopping), and
    after the last step the last θ̄ compared with every peer's."""
    timeout = STOP_GRACE_S if stopping else replica.round_timeout_s * 2
    if replica.pending:
        await asyncio.wait(replica.pending.values(), timeout=timeout)
    for task in replica.pending.values():
        if not task.done():
            task.cancel()
        elif not task.cancelled() and task.exception() is not None:
            log.info("a final sync failed: %s", task.exception())
    replica.pending.clear()
    if not stopping and replica.step == replica.cfg.steps:  # the last θ̄ compared with every peer's
        assert replica.presence is not None
        missing = await replica.presence.agree_at(replica.step, replica.round_timeout_s)
        if missing:
            log.warning(
                "θ̄ after the last step %d could not be compared with %s: no digest of it came within "
                "%.0f s (--round-timeout)",
                replica.step,
                ", ".join(p[:12] for p in missing),
                replica.round_timeout_s,
            )


def host_buffers(replica: SwarmReplica) -> list[tuple[int, int]]:
    """The memory (address, bytes) of a replica's tensors in host memory: the model as built, the
    replica and its evaluation copy where they train on the CPU, θ̄ and the outer momentum."""
    tensors = [
        *replica.setup.base.state_dict().values(),
        *replica.eval_model.state_dict().values(),
        *replica.trainer.model.state_dict().values(),
        *[t for outer in replica.strategy.state_dict().get("outer", []) for t in outer.values()],
    ]
    storages = [t.untyped_storage() for t in tensors if t.device.type == "cpu"]
    return [(s.data_ptr(), s.nbytes()) for s in storages]


def pace_wish(replica: SwarmReplica) -> int:
    """The send-slot spacing this peer's link keeps up with (0: none, or --pace fixed): each
    round's group takes the largest its members ask for. The link's busy time per round and the
    time a sync takes to land are measured (``LinkMeter``) on the rounds of the codec a sync
    sent now takes, else on those of the run's other codec (``SyncCodecs``), scaled by their
    bytes; until a delivery was acknowledged, the busy time is what the declared link
    (--bandwidth-mbps) would take for a round's bytes."""
    assert replica.exchange is not None
    if replica.pace == "fixed" or replica.strategy.send_spacing() is None:
        return 0
    link, now, codecs = replica.exchange.link, replica.strategy.next_codec(), replica.setup.codecs.all()  # type: ignore[attr-defined]

    def round_cost(codec: Codec) -> RoundCost:
        measured = link.round_s(codec, [now, *codecs], replica.round_bytes)
        busy = measured or declared_busy_s(replica.round_bytes(codec), replica.cfg.bandwidth_mbps)
        return RoundCost(busy, link.landing_s(codec, [now, *codecs], replica.round_bytes))

    # measured over enough rounds to narrow: their landings, and their deliveries where any was
    # bulk (a round of small payloads has none: its link time stays the declared one)
    landed, timed = link.landed_rounds(now.name), link.rounds(now.name)
    settled = landed >= NARROW_AFTER_ROUNDS and (not timed or timed >= NARROW_AFTER_ROUNDS)
    return replica.strategy.pace_wish(round_cost, replica.step_time_s, settled)


def not_caught_up(replica: SwarmReplica, ended: str) -> str:
    """The line for a run that ``ended`` while this peer still caught up with the swarm."""
    return (
        f"the run {ended} before this peer caught up with the swarm (from step {replica.joined_at}, where "
        f"it took the state, to step {replica.step}): it trained no step with it from there"
    )


def failure_at_end(replica: SwarmReplica, failure: str | None) -> str | None:
    """Why the run failed: the loop's reason, or, for a run that reached --steps though none of its
    syncs completed (too few failed in a row for ``SyncsFailing``), or still catching up with the
    swarm, that it never trained with the swarm: such a run must not report success."""
    assert replica.exchange is not None
    stats = replica.exchange.stats
    if failure is None and replica.catching_up is not None:
        return not_caught_up(replica, "ended")
    if (
        failure is None
        and replica.step >= replica.cfg.steps
        and stats.rounds_failed
        and not stats.rounds_done
    ):
        return (
            f"none of this peer's {stats.rounds_failed} syncs completed (each failed on every peer and was "
            "skipped), so it never trained with the swarm. Declare a thin link's speed (--bandwidth-mbps) "
            "so the rounds' deadlines allow for it, and check that the peers reach each other"
        )
    return failure


def peer_summary(replica: SwarmReplica, failure: str | None) -> dict[str, Any]:
    """What a peer's summary record adds to a run's: its traffic, stalls and sync work, rounds,
    identity and joins, who it refused, screened out or accused, and how its θ̄ agreed."""
    assert replica.exchange is not None and replica.presence is not None
    stats, presence = replica.exchange.stats, replica.presence
    assert replica.train_started is not None
    return {
        "bytes_sent": stats.bytes_sent,
        "stall_s": replica.stall_s,
        "sync_boundary_s": replica.boundary_s,
        "sync_boundary_share": replica.boundary_s / max(replica.training_s(), 1e-9),
        "wall_time_s": time.perf_counter() - replica.train_started,
        "finish_s": replica.finish_s,
        "final_sync_s": replica.final_sync_s,
        "step_time_s": replica.step_time_s,
        "tokens_per_s": replica.tokens_per_s(),
        "steps_trained": replica.steps_trained,  # fewer than the steps with --inner-share below 1
        "inner_share": replica.share.fraction,  # the last one chosen
        "peak_memory_bytes": peak_memory_bytes(replica.setup.placement.device),
        **(replica.region.summary_fields() if replica.region is not None else {}),
        "rounds_done": stats.rounds_done,
        # from this peer's arrival at a round to its average: the others' arrival included
        "mean_round_s": stats.rounds_s / stats.rounds_done if stats.rounds_done else None,
        # from the group's adoption (every member present) to the average: the transfers alone
        "butterflies": stats.butterflies,
        "mean_butterfly_s": stats.butterflies_s / stats.butterflies if stats.butterflies else None,
        # from a sync's send to its result, less the wait for the others, by codec (the pace's D)
        "sync_landing_s": replica.exchange.link.landing_medians(),
        "rounds_failed": stats.rounds_failed,
        "bytes_resent": stats.bytes_resent,
        "bytes_served": stats.bytes_served,
        "peer_id": replica.peer_id,
        "shard": replica.shard_index,
        "joined_at": replica.joined_at,
        "resyncs": replica.resyncs,
        "state_copy_s": replica.state_server.copy_s if replica.state_server else 0.0,
        "send_spacing": replica.strategy.send_spacing(),
        "key_id": replica.exchange.key_id,
        "refused": refused_most(replica, 16),
        "outliers": dict(replica.exchange.outliers.most_common(16)),
        "accused": dict(replica.exchange.accused.most_common(16)),
        "theta_disputed": dict(presence.disputed),
        "theta_unsettled_step": presence.unsettled.step if presence.unsettled is not None else None,
        "theta_split": {d: list(peers) for d, peers in presence.unsettled.holders}
        if presence.unsettled is not None
        else None,
        "theta_behind_step": presence.split_from.step if presence.split_from is not None else None,
        "failure": failure_at_end(replica, failure),
        "stopped_by": replica.stopped_by,
    }


def refused_most(replica: SwarmReplica, count: int = 4) -> dict[str, int]:
    """The peers this peer refused most (non-members, limits exceeded), by its exchange and its
    state server: what its record and summary name."""
    tally: Counter[str] = Counter()
    for server in (replica.exchange, replica.state_server):
        if server is not None:
            tally += server.limiter.refused
    return dict(tally.most_common(count))


def board_fields(replica: SwarmReplica) -> dict[str, Any]:
    """What a peer's board record says of its replica: progress, traffic, whom it refused or left
    out, its θ̄ digests (``swarm/records.py``'s PeerRecord; the peer adds who it is)."""
    ex, presence = replica.exchange, replica.presence
    theta_step, theta_sha = presence.agreement.latest() if presence is not None else (-1, "")
    return {
        "step": replica.step,
        "shard": replica.shard_index,
        "step_time_s": replica.step_time_s,
        "bandwidth_mbps": ex.stats.bandwidth_mbps if ex else 0.0,
        "versions": list(replica.versions),
        "stall_s": replica.stall_s,
        "bytes_sent": ex.stats.bytes_sent if ex else 0,
        "joined_at": replica.joined_at,
        "refused": refused_most(replica),
        "outliers": dict(ex.outliers.most_common(4)) if ex else {},
        "theta_step": theta_step,
        "theta_sha": theta_sha,
        "theta_earlier": presence.agreement.earlier() if presence is not None else [],
        "theta_doubt": presence.agreement.doubt if presence is not None else -1,
        "tokens_per_s": replica.tokens_per_s(),
        "val_ppl": replica.val_ppl,
        "bytes_received": ex.stats.bytes_received if ex else 0,
        "last_round_s": ex.stats.last_round_s if ex else NONE_YET,
    }


def metrics_sample(replica: SwarmReplica, state: str, board: dict[str, Any]) -> PeerSample:
    """A peer's numbers for its metrics (``ops/monitoring.py``), ``board`` the records it reads."""
    ex, cfg = replica.exchange, replica.cfg
    servers = [s for s in (ex, replica.state_server) if s is not None]
    return PeerSample(
        state=state,
        step=replica.step,
        inner_steps=replica.steps_trained,
        tokens=replica.steps_trained * cfg.batch_size * cfg.seq_len,
        step_seconds=replica.step_time_s,
        tokens_per_second=replica.tokens_per_s(),
        stall_seconds=replica.stall_s,
        sent_bytes=ex.stats.bytes_sent if ex else 0,
        resent_bytes=ex.stats.bytes_resent if ex else 0,
        served_bytes=ex.stats.bytes_served if ex else 0,
        received_bytes=ex.stats.bytes_received if ex else 0,
        rounds_completed=ex.stats.rounds_done if ex else 0,
        rounds_failed=ex.stats.rounds_failed if ex else 0,
        resyncs=replica.resyncs,
        refused=sum(sum(s.limiter.refused.values()) for s in servers),
        outliers=sum(ex.outliers.values()) if ex else 0,
        board=dict(Counter(r.state for r in board.values())),
    )
