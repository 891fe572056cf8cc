"""The peer: one region's asyncio program (uvloop) driving the core's strategy over the swarm.

Each inner step runs in a dedicated training thread, so the event loop stays free to serve the
fragment exchange of other peers. Between two steps the loop applies every fragment result that is
due (waiting for it if it is not back: that wait is the recorded stall) and starts the syncs the
schedule asks for as background tasks. A heartbeat task publishes this peer's record and refreshes
its view of the others. Peer i computes exactly what simulator worker i computes.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
import math
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from p2p_cocodc.algorithms.devices import HostCopy, peak_memory_bytes, resolve_device
from p2p_cocodc.algorithms.schedules import AdaptiveSchedule, paced_spacing
from p2p_cocodc.algorithms.state import expect_list, expect_tensor
from p2p_cocodc.algorithms.strategies import AlgoSettings, DataParallel, PreparedResult, Strategy
from p2p_cocodc.config.join import SwarmOptions
from p2p_cocodc.config.train import TrainConfig
from p2p_cocodc.errors import UserError
from p2p_cocodc.models.hf import model_identity
from p2p_cocodc.ops.monitoring import PeerMetrics, PeerSample
from p2p_cocodc.ops.progress import Phases, Progress
from p2p_cocodc.peer.region import Region
from p2p_cocodc.run.checkpoint import Checkpoint, CheckpointWriter, committed, read_checkpoint
from p2p_cocodc.run.records import RunLog, params_sha256
from p2p_cocodc.run.setup import TrainingSetup, allreduce_wire_bytes, save_run, summary_record
from p2p_cocodc.swarm.agreement import Agreement, Verdict
from p2p_cocodc.swarm.dht import p2pd_socket, parse_bootstrap, start_dht, stop_dht
from p2p_cocodc.swarm.exchange import FragmentExchange, RoundFailed, RoundLost
from p2p_cocodc.swarm.records import NONE_YET, Board, PeerRecord, peers_key
from p2p_cocodc.swarm.run_options import differences, fingerprint, option_view
from p2p_cocodc.swarm.state_transfer import StateServer, StateUnavailable, pull_state
from p2p_cocodc.swarm.trust import Membership, check_identity

log = logging.getLogger(__name__)

STOP_GRACE_S = 3.0  # on SIGINT/SIGTERM, how long syncs in flight may still take
FAILING_STREAK = 3  # this many syncs of every fragment failing in a row: the swarm is not syncing
FIRST_PUBLISH_S = 15.0  # a new peer's DHT may need a few seconds to know another node
MAX_RESYNCS = 5  # a peer that had to take the swarm's state again this often stops
DONORS = 3  # a joiner asks this many live peers for the state (at least 2 where there are)


class Resync(Exception):
    """This peer's θ̄ can no longer be trusted to be the swarm's (it was stopped past its record's
    lifetime, or a round completed without it and its average is gone): take the state again."""


class SyncsFailing(Exception):
    """Every sync of the last ``FAILING_STREAK`` rounds of every fragment failed: this peer is not
    training with a swarm. It stops, and its summary says why (``failure``): never a success."""


def shared_options(setup: TrainingSetup, settings: AlgoSettings) -> dict[str, Any]:
    """What every peer of a run must share: algorithm, optimizers, model, data, codec, how slices are
    screened and combined, M. Its fingerprint is what peers compare."""
    cfg = setup.cfg
    digest = hashlib.sha256(setup.tokens.train.numpy().tobytes()).hexdigest()[:16]
    return {
        "algo": asdict(settings),
        "inner": asdict(setup.inner),
        "model": model_identity(cfg.model, setup.base),  # an hf: model by content, not by path
        "data": digest,
        "vocab": setup.tokens.vocab_size,
        "seq_len": cfg.seq_len,
        "batch_size": cfg.batch_size,
        "seed": cfg.seed,
        "codec": cfg.codec,
        "aggregation": asdict(cfg.aggregation()),
        "workers": cfg.workers,
        "data_shards": cfg.data_shards,
    }


def fragment_round(p: int, step: int) -> str:
    """The id of the round that syncs fragment ``p`` sent after inner step ``step``."""
    return f"f{p}:{step}"


class Peer:
    """One region of a run; ``run`` trains, writes records like ``simulate``, returns the summary."""

    def __init__(
        self,
        cfg: TrainConfig,
        opts: SwarmOptions,
        resume: Checkpoint | None = None,
        region: Region | None = None,
        metrics: PeerMetrics | None = None,
    ) -> None:
        opts.check_shard(cfg.data_shards)
        # before any slow work: key, certificate and identity files and the device checked (this
        # machine's faults first), then the bootstrap asked
        self.membership = Membership.from_options(
            opts.swarm_key_file, opts.owner, opts.certificate, opts.identity
        )
        if region is None:  # a region's ranks settled theirs (``Region.start``)
            resolve_device(cfg.device)
        self.initial_peers = parse_bootstrap(opts.bootstrap)
        self.cfg = cfg
        self.opts = opts
        self.region = region  # rank 0 of a region of several processes (torchrun): ``region.py``
        self.metrics = metrics if metrics is not None else PeerMetrics()  # served with --metrics-port
        self.setup = TrainingSetup(cfg, region.placement if region is not None else None)
        step_time = self.setup.step_time() if self.setup.needs_step_time() else cfg.step_time
        self.settings = self.setup.settings(cfg.latency_ms / 1000.0, cfg.bandwidth_mbps * 1e6, step_time)
        shared = shared_options(self.setup, self.settings)
        self.fingerprint = fingerprint(shared)
        self.options = option_view(shared)  # published, so a mismatched peer can say what differs
        self.trainer, self.strategy = self.setup.replica(self.settings)
        if region is not None:
            region.wrap(self.trainer)
        self.eval_model = self.setup.eval_model()
        self.train_pool = ThreadPoolExecutor(1, thread_name_prefix="train")
        self.view: dict[str, PeerRecord] = {}
        self.last_seen: dict[str, float] = {}  # peer id -> when its record was last read
        self.state = "waiting"
        self.step = 0
        self.step_time_s = step_time or 0.0
        self.stall_s = 0.0
        self.eval_s = 0.0  # evaluation time, kept out of the training throughput
        self.steps_trained = 0  # inner steps this process trained (a joiner's run starts past step 0)
        self.train_started: float | None = None  # perf_counter when training began (after the wait)
        self.val_ppl = NONE_YET  # the latest evaluation of θ̄
        self.peer_id = ""  # known once its DHT is up (``run``)
        self.versions = [0] * len(self.strategy.fragments) if isinstance(self.strategy, Strategy) else [0]
        self.pending: dict[int, asyncio.Task[PreparedResult]] = {}
        self.failed_in_a_row = 0  # syncs that failed since the last one that completed
        self.paced_before = False  # the swarm has sent less than configured, and this peer said so
        self.run_log: RunLog | None = None
        self.progress: Phases = Progress("", cfg.steps, 0, None)  # quiet, unless ``run`` is given one
        self.shard_index: int | None = opts.shard[0] if opts.shard else None
        self.exchange: FragmentExchange | None = None
        self.state_server: StateServer | None = None
        self.p2p: Any = None
        self.heartbeat: asyncio.Task[None] | None = None
        self.watchdog: asyncio.Task[None] | None = None
        self.joined_at = 0  # the step whose end this peer took the swarm's state at (0: started the run)
        self.resyncs = 0  # times this peer took the state again after it fell out of the swarm
        self.joins_recorded: set[tuple[str, int]] = set()  # (peer, joined_at) written to --out
        self.agreement = Agreement()  # this peer's θ̄ digests, compared with the others' (swarm/agreement.py)
        self.disputed: dict[str, int] = {}  # peer -> the latest step where its θ̄ differed from ours
        self.distrusted: set[str] = set()  # peers whose θ̄ split off from the majority's: never donors
        self.split_from: Verdict | None = None  # a majority holds another θ̄: take the swarm's state
        self.unsettled: Verdict | None = None  # the latest disagreement no majority could settle
        self.written: list[dict[str, Any]] = []  # every record written to --out (checkpoints keep them)
        data = self.setup.data_sha256() if cfg.checkpoint_dir is not None else ""  # hashes every token
        self.checkpoints = (
            CheckpointWriter(cfg.checkpoint_dir, cfg.checkpoint_every, cfg.computing_options(), data)
            if cfg.checkpoint_dir is not None
            else None
        )
        self.resume = resume  # the newest checkpoint of --checkpoint-dir, with --resume
        self.checkpointed = -1  # the step of the last checkpoint written
        if resume is not None:  # it keeps its data shard
            resume.check_data(data)
            self.shard_index = resume.restore(lambda state: int(state["shard"]))

    @property
    def name(self) -> str:
        """What operators see this peer as: --region, else the first 12 characters of its peer id."""
        return self.opts.region or self.peer_id[:12]

    # ---- lifecycle ----

    async def run(self, log_file: RunLog, progress: Phases | None = None) -> dict[str, Any]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        self.run_log = log_file
        if self.opts.identity is not None:
            check_identity(self.opts.identity)
        if self.membership.is_open:
            log.warning(
                "run %r is open: any peer that reaches the bootstrap may join it and send updates; to admit "
                "only your peers, create a key (p2p-cocodc keygen swarm.key) and give every peer "
                "--swarm-key-file swarm.key, or certify each peer with an owner key (docs/security.md)",
                self.opts.run_id,
            )
        # Created on the main thread: the at-fork death signal is tied to the forking thread.
        dht = start_dht(
            self.initial_peers,
            self.opts.host,
            self.opts.port,
            self.opts.announce,
            self.opts.identity,
            self.membership,
            protected=[peers_key(self.opts.run_id)],
        )
        daemon_socket = p2pd_socket(dht)
        p2p = None
        try:
            p2p = self.p2p = await dht.replicate_p2p()
            self.peer_id = p2p.peer_id.to_base58()
            self.metrics.identify(
                run_id=self.opts.run_id, region=self.name, peer_id=self.peer_id, algo=self.cfg.algo
            )
            if progress is not None:
                self.progress = progress
                progress.named(self.name)
            # A record outlives 8 heartbeats: a peer briefly starved of CPU must not vanish from the
            # board (a leader would form rounds without it); a dead one is gone within 8 s.
            board = Board(dht, self.opts.run_id, self.peer_id, ttl_s=8 * self.opts.heartbeat_s)
            await self._first_refresh(board)
            self.heartbeat = asyncio.create_task(self._heartbeat(board))
            under_way = await self._wait_for_peers(stop, board)
            self.exchange = FragmentExchange(
                p2p,
                self.opts.run_id,
                self.setup.codec,
                self.shard_index,  # type: ignore[arg-type]
                self.fingerprint,
                lambda: self.view,
                self.opts.round_timeout_s,
                record_ttl_s=board.ttl_s,
                link_mbps=self.cfg.bandwidth_mbps,
                round_bytes=self._round_bytes(),
                key_id=self.membership.key_id,
                max_frame=self._max_message_bytes(),
                aggregation=self.cfg.aggregation(),
            )
            self.exchange.set_joining(under_way)
            await self.exchange.start()
            if isinstance(self.strategy, Strategy):
                self.state_server = StateServer(
                    p2p,
                    self.opts.run_id,
                    self.fingerprint,
                    lambda: self.step,
                    self._shared_state,
                    admits=self.exchange.is_member,  # the same peers the exchange hears, bans included
                )
                await self.state_server.start()
            if under_way:
                await self._take_state(board, stop)
            else:
                self.state = "training"
                await self._announce(board)
                self._record_join(self.peer_id, self.joined_at)
                await self._wait_for_start(stop)
                self._rerun_in_flight()
            leave = asyncio.create_task(self._leave_when(stop, board))
            self.watchdog = asyncio.create_task(self._watch_for_lapse(board))
            try:
                summary = await self._train(log_file, stop, board)
            finally:
                if stop.is_set():  # the others must read "leaving" before anything else
                    await asyncio.wait({leave}, timeout=board.timeout)
                leave.cancel()
            self.state = "done"
            await self._announce(board)  # the summary is written; if it fails, others see us expire
            await self.exchange.stop()
            if self.state_server is not None:
                await self.state_server.stop()
            return summary
        except ConnectionError as exc:
            raise UserError(f"the swarm's DHT does not answer ({exc}); is the bootstrap still up?") from None
        finally:
            for task in (self.heartbeat, self.watchdog):
                if task is not None:
                    task.cancel()
            for task in self.pending.values():
                task.cancel()
            self.train_pool.shutdown(wait=True, cancel_futures=True)
            if p2p is not None:
                await p2p.shutdown()  # removes its client socket file
            stop_dht(dht, daemon_socket)
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    async def _first_refresh(self, board: Board) -> None:
        """The first record: a DHT that has just started may not know another node yet (a store then
        reaches nobody), so it is tried for ``FIRST_PUBLISH_S`` before the DHT counts as silent."""
        deadline = time.monotonic() + FIRST_PUBLISH_S
        while True:
            try:
                await self._refresh(board)
                return
            except ConnectionError as exc:
                if time.monotonic() > deadline:
                    raise UserError(
                        f"no other DHT node took this peer's record in {FIRST_PUBLISH_S:.0f} s ({exc}): "
                        "nodes that require a swarm key or an owner's certificate refuse records without "
                        f"it; check --swarm-key-file, or --owner and --certificate (this peer: "
                        f"{self.membership.key_id})"
                    ) from None
                log.info("first board publish failed (%s); trying again", exc)
                await asyncio.sleep(self.opts.heartbeat_s)

    async def _watch_for_lapse(self, board: Board) -> None:
        """Notice that this process was stopped (SIGSTOP, a suspended VM, swap) for longer than its
        record lives: the others have taken it for gone and gone on without it, so it must not
        carry on as if it were still in their rounds: it takes the swarm's state again."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.opts.heartbeat_s)
            now = time.monotonic()
            if now - last > board.ttl_s - self.opts.heartbeat_s:  # its last record may have lapsed
                what = (
                    f"this peer was stopped for {now - last:.0f} s, longer than its board record lives "
                    f"({board.ttl_s:.0f} s): the swarm has gone on without it"
                )
                if not isinstance(self.strategy, Strategy):
                    raise UserError(f"{what}, and a ddp peer cannot take the swarm's state again; it stops")
                self.state = "joining"  # the next heartbeat must not say "training" any more
                raise Resync(what)
            last = now

    async def _leave_when(self, stop: asyncio.Event, board: Board) -> None:
        """On SIGINT/SIGTERM, say so on the board at once: new rounds form without this peer (not
        after its record lapses), while the rounds it is in still complete."""
        await stop.wait()
        self.state = "leaving"
        if self.exchange is not None:
            await self.exchange.say_bye()
        await self._announce(board)

    async def _announce(self, board: Board) -> None:
        """Publish a change of this peer's state at once. A store the DHT does not take (a miss
        under load, or a DHT that knows no other node yet) is not fatal here: the heartbeat
        publishes the record again within a beat, and ends the peer if the DHT stays silent."""
        try:
            await self._refresh(board)
        except ConnectionError as exc:
            log.warning("could not announce %r on the board yet (%s); the heartbeat will", self.state, exc)

    def _record(self) -> PeerRecord:
        ex = self.exchange
        return PeerRecord(
            state=self.state,
            step=self.step,
            shard=self.shard_index,
            num_shards=self.cfg.data_shards,
            step_time_s=self.step_time_s,
            bandwidth_mbps=ex.stats.bandwidth_mbps if ex else 0.0,
            fingerprint=self.fingerprint,
            versions=list(self.versions),
            stall_s=self.stall_s,
            bytes_sent=ex.stats.bytes_sent if ex else 0,
            joined_at=self.joined_at,
            resume_step=self.resume.step if self.resume is not None else -1,
            key_id=self.membership.key_id,
            refused=self._refused(),
            outliers=dict(ex.outliers.most_common(4)) if ex else {},
            theta_step=self.agreement.latest()[0],
            theta_sha=self.agreement.latest()[1],
            region=self.name,
            tokens_per_s=self._tokens_per_s(),
            val_ppl=self.val_ppl,
            bytes_received=ex.stats.bytes_received if ex else 0,
            last_round_s=ex.stats.last_round_s if ex else NONE_YET,
        )

    def _tokens_per_s(self) -> float:
        """Tokens this process trained per second since training began, evaluations left out (the
        wait for peers comes before): what the summary reports and the record shows meanwhile."""
        if self.train_started is None:
            return 0.0
        training_s = time.perf_counter() - self.train_started - self.eval_s
        return self.steps_trained * self.cfg.batch_size * self.cfg.seq_len / max(training_s, 1e-9)

    def _refused(self, count: int = 4) -> dict[str, int]:
        """The peers this peer refused most (non-members, limits exceeded), by its exchange and its
        state server: what its record and summary name."""
        tally: Counter[str] = Counter()
        for server in (self.exchange, self.state_server):
            if server is not None:
                tally += server.limiter.refused
        return dict(tally.most_common(count))

    def _same_run(self, record: PeerRecord) -> bool:
        """A record of a peer of this run: our configuration, and our swarm key (or none, both)."""
        return record.fingerprint == self.fingerprint and record.key_id == self.membership.key_id

    async def _refresh(self, board: Board, publish: bool = True, read: bool = True) -> None:
        """Publish this peer's record and update the view of the others. A peer stays in the view
        for its record's lifetime (the one it published, at least ours) after it was last read: a
        DHT read under load can miss a live record, and a leader must not form a round without a
        peer that is still there."""
        if publish:
            run_info = {
                "algo": self.cfg.algo,
                "model": self.cfg.model,
                "workers": self.cfg.workers,
                "options": self.options,
            }
            await board.publish(self._record(), run_info)
        if not read:
            return
        fresh = await board.peers()
        for peer, record in fresh.items():
            if self._same_run(record) and record.state in ("training", "leaving", "done"):
                self._record_join(peer, record.joined_at, record.shard)
        now = time.monotonic()
        self.last_seen.update(dict.fromkeys(fresh, now))
        view = {**self.view, **fresh}
        self.view = {p: r for p, r in view.items() if now - self.last_seen[p] <= max(board.ttl_s, r.ttl_s)}
        self._compare_theta()
        self._sample_metrics()

    def _compare_theta(self) -> None:
        """Compare our θ̄ digests with those on the board: name the peers that disagree, and take the
        swarm's state again when a strict majority holds another θ̄ (``swarm/agreement.py``)."""
        others = {
            p: (r.theta_step, r.theta_sha)
            for p, r in self.view.items()
            if p != self.peer_id and self._same_run(r) and r.theta_step >= 0 and r.state != "joining"
        }
        for verdict in self.agreement.compare(others):
            new = [p for p in verdict.disputed if self.disputed.get(p, -1) < verdict.step]
            for peer in verdict.disputed:
                self.disputed[peer] = verdict.step
            if verdict.behind:
                self.split_from = verdict
                outcome = "a majority holds another θ̄: this peer takes the swarm's state again"
            elif verdict.settled:
                self.distrusted.update(verdict.disputed)  # split off from the majority: never a donor
                outcome = "a majority holds this peer's θ̄"
            else:
                outcome = "no majority: nobody can tell which θ̄ is the swarm's"
            self.unsettled = None if verdict.settled else verdict
            if new:
                who = ", ".join(p[:12] for p in new)
                log.warning("θ̄ after step %d differs here and on %s (%s)", verdict.step, who, outcome)

    async def _heartbeat(self, board: Board) -> None:
        """Keep this peer on the board and its view fresh without ever waiting on a slow DHT call.

        Each beat starts a publish unless one is still in flight (a slow store is never cancelled to
        start the next one: it is skipped instead), and a read unless one is in flight. The peer
        gives up only when no publish has reached another node, or no read has succeeded, for
        ``board.give_up_s`` (max(60 s, 4 record lifetimes)), long after the others dropped it."""
        publishing: asyncio.Task[None] | None = None
        reading: asyncio.Task[None] | None = None
        read_ok = time.monotonic()
        last_error = "none"
        summary_at = time.monotonic()
        lapsed_warned = False
        try:
            while True:
                await asyncio.sleep(self.opts.heartbeat_s)
                if not board.dht.is_alive():  # not congestion: nothing will answer again
                    raise UserError(
                        "lost the swarm's DHT: its process has died; this peer can no longer train with "
                        "the others"
                    )
                for task in (publishing, reading):
                    if task is not None and task.done() and (exc := task.exception()) is not None:
                        if not isinstance(exc, ConnectionError):
                            raise exc
                        last_error = str(exc)
                        log.warning("notice board unreachable: %s", exc)
                    elif task is reading and task is not None and task.done():
                        read_ok = time.monotonic()
                if publishing is not None and publishing.done():
                    publishing = None
                if reading is not None and reading.done():
                    reading = None
                if publishing is None and not board.publishing:
                    publishing = asyncio.create_task(self._refresh(board, read=False))
                else:
                    board.skipped += 1
                if reading is None:
                    reading = asyncio.create_task(self._refresh(board, publish=False))
                now = time.monotonic()
                silent, blind = now - board.landed_at, now - read_ok
                if max(silent, blind) > board.give_up_s:
                    what = (
                        f"no publish reached another node for {silent:.0f} s"
                        if silent > board.give_up_s
                        else f"no read of the board succeeded for {blind:.0f} s"
                    )
                    raise UserError(
                        f"lost the swarm's DHT: {what} (the limit is max(60 s, 4 record lifetimes) = "
                        f"{board.give_up_s:.0f} s; last error: {last_error}); the others no longer see "
                        "this peer, so it can no longer train with them"
                    )
                if silent > board.landed_lifetime_s and not lapsed_warned:
                    log.warning(
                        "no publish reached another node for %.0f s: this peer's record (lifetime %.0f s) "
                        "has probably lapsed on the others' boards",
                        silent,
                        board.landed_lifetime_s,
                    )
                lapsed_warned = silent > board.landed_lifetime_s
                if now - summary_at >= 30:
                    log.info("notice board: %s", board.stats())
                    summary_at = now
        finally:
            for task in (publishing, reading):
                if task is not None:
                    task.cancel()
            log.info("notice board: %s", board.stats())

    def _check_split(self) -> None:
        if self.split_from is not None:
            verdict, self.split_from = self.split_from, None
            raise Resync(
                f"θ̄ after step {verdict.step} differs from the one a majority of the peers hold (this "
                f"peer's disagrees with {', '.join(p[:12] for p in verdict.disputed)})"
            )

    def _check_swarm(self) -> None:
        """Raise what ended the heartbeat or the lapse watchdog (they end only with an error)."""
        for task in (self.heartbeat, self.watchdog):
            if task is not None and task.done() and not task.cancelled():
                task.result()

    async def _wait_for_peers(self, stop: asyncio.Event, board: Board) -> bool:
        """Block until this peer can train, and settle its data shard: True when the run is under
        way (it joins it), False once --workers peers of this run are live (it starts with them).

        A run counts as under way only once a training peer's step has moved while this peer
        watched: right after a whole swarm was killed, the dead peers' records still say "training"
        for a record lifetime, and a peer restarted (or resumed) then must not try to join them."""
        deadline = time.monotonic() + self.opts.wait_peers_s
        first_step: dict[str, int] = {}  # peer -> the step its record showed when first read here
        while True:
            same = {p: r for p, r in self.view.items() if self._same_run(r)}
            await self._check_not_odd_one_out(same, board)
            # our own record may be a stale one of this identity's previous process: not a peer;
            # a peer that resumed from its checkpoint of step C waits at C for the others to resume
            training = {p: r for p, r in same.items() if r.state == "training" and p != self.peer_id}
            moving = {p for p, r in training.items() if r.step > first_step.setdefault(p, r.step)}
            if self.resume is not None:  # a killed swarm's records (past step 0, not resumed, still)
                # lapse within a lifetime, or the restarted process overwrites them: wait them out
                dead = {p for p, r in training.items() if r.step > 0 > r.resume_step and p not in moving}
                same = {p: r for p, r in same.items() if p not in dead}
                training = {p: r for p, r in training.items() if p not in dead}
            past_start = any(r.step > max(r.resume_step, 0) for r in training.values())
            if (len(training) >= self.cfg.workers or past_start) and not moving:
                # under way, or the records of a dead swarm: which one shows within a lifetime
                self._check_wait(stop, deadline, "no training peer moved in")
                await asyncio.sleep(0.2)
                continue
            if len(training) >= self.cfg.workers or past_start:
                if not isinstance(self.strategy, Strategy):
                    raise UserError(
                        f"run {self.opts.run_id!r} is under way, and a ddp run cannot take a peer in "
                        "progress: use another --run-id, or a DiLoCo-family --algo"
                    )
                if self.resume is not None:  # its data shard stays; its state is behind the swarm's
                    log.warning(
                        "the swarm went on without this peer: it takes the others' state, not its "
                        "checkpoint of step %d",
                        self.resume.step,
                    )
                    self.resume = None
                self._take_free_shard(same)
                return True
            live = sorted(p for p, r in same.items() if r.state in ("waiting", "training"))
            here = sorted(self._name_of(p) for p in live if p != self.peer_id)
            self.progress.waiting([self.name, *here], self.cfg.workers)
            if len(live) >= self.cfg.workers and self.peer_id in live:
                self._settle_shard(live, same)
                if self.resume is not None or any(same[p].resume_step >= 0 for p in live):
                    self._resume_with(live, same)
                return False
            self._check_wait(stop, deadline, f"only {len(live)} of --workers {self.cfg.workers} peers joined")
            await asyncio.sleep(0.2)

    def _name_of(self, peer: str) -> str:
        """Another peer as operators see it: the region its record names, else its peer id's start."""
        record = self.view.get(peer)
        return record.region if record is not None and record.region else peer[:12]

    async def _check_not_odd_one_out(self, same: dict[str, PeerRecord], board: Board) -> None:
        """Stop with one line when every other peer of this run id has another configuration or
        another swarm key; when some share ours, the others are ignored (a stranger's record must
        not stop a run, and in a keyed run the DHT does not even store it)."""
        others = {
            p: r for p, r in self.view.items() if p != self.peer_id and r.state in ("waiting", "training")
        }
        if not others or same.keys() - {self.peer_id}:
            return
        keys = sorted({r.key_id for r in others.values()} - {self.membership.key_id})
        run = self.opts.run_id
        if keys and self.membership.is_open:  # a keyed peer's DHT never returns an open peer's record
            raise UserError(
                f"run {run!r} admits only holders of its swarm key or of its owner's certificate (key id "
                f"{keys[0]}): pass --swarm-key-file, or --owner and --certificate, as its owner gave them; "
                "or pick another --run-id"
            )
        peer = sorted(others)[0]
        differ = differences(self.options, (await board.run_infos()).get(peer, {}).get("options"))
        which = f" ({'; '.join(differ)})" if differ else ""
        raise UserError(
            f"peer {peer[:12]} of run {run!r} trains with other options{which}: start every peer with the "
            "same options (or profile), or pick another --run-id"
        )

    def _resume_with(self, live: list[str], records: dict[str, PeerRecord]) -> None:
        """A whole swarm restarted with --resume: every peer goes on from the newest step all of them
        hold a checkpoint of (a peer killed before its last checkpoint holds an older one)."""
        fresh = [p[:12] for p in live if records[p].resume_step < 0]
        if fresh:
            raise UserError(
                f"peers {', '.join(fresh)} start run {self.opts.run_id!r} afresh while others resume it: "
                "start every peer with --resume (and its --checkpoint-dir), or none"
            )
        assert self.resume is not None and self.cfg.checkpoint_dir is not None
        step = min(records[p].resume_step for p in live)
        if step != self.resume.step:
            found = dict(committed(Path(self.cfg.checkpoint_dir)))
            if step not in found:
                raise UserError(
                    f"the swarm resumes after step {step}, and --checkpoint-dir {self.cfg.checkpoint_dir} "
                    "no longer holds that checkpoint: resume with the checkpoint folders the run wrote"
                )
            self.resume = read_checkpoint(found[step], self.cfg.computing_options())
        self.resume.restore(self._load_state)
        log.warning("resuming the run after step %d from %s", self.step, self.resume.path)

    def _checkpoint_state(self) -> dict[str, Any]:
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
            "records": list(self.written),
            "rng": {"torch": torch.get_rng_state()},
        }

    def _load_state(self, state: dict[str, Any]) -> None:
        if int(state["shard"]) != self.shard_index:
            raise ValueError(f"it reads data shard {state['shard']}, this peer {self.shard_index}")
        self.trainer.load_state_dict(state["trainer"])
        if self.region is not None:
            self.region.whole = True
        self.strategy.load_state_dict(state["strategy"])
        self.versions = expect_list(state["versions"], len(self.versions), int, "fragment versions")
        self.step, self.joined_at = int(state["step"]), int(state["joined_at"])
        self.written = list(state["records"])
        torch.set_rng_state(expect_tensor(state["rng"]["torch"], torch.get_rng_state(), "torch RNG state"))

    def _rerun_in_flight(self) -> None:
        """After a whole-swarm resume: run again the syncs in flight at the checkpoint, with the
        payloads they had (θ̄_p has not moved since the send: Δ_p = θ̄_p − snapshot_p)."""
        assert self.exchange is not None
        if not isinstance(self.strategy, Strategy):
            return
        for p, sync in self.strategy.in_flight.items():
            vector = self.strategy.outer_gradient(p, sync.snapshot.cpu())
            self.pending[p] = asyncio.create_task(self._round(p, sync.sent_step, vector, self._pace_wish()))

    async def _write_checkpoint(self) -> None:
        assert self.checkpoints is not None
        path = await asyncio.to_thread(self.checkpoints.write, self.step, self._checkpoint_state())
        self.checkpointed = self.step
        log.info("checkpoint of step %d written to %s", self.step, path)

    def _take_free_shard(self, records: dict[str, PeerRecord]) -> None:
        """A data shard no live peer reads, for a peer joining a run under way: its --shard, or the
        one this identity read before (a restart), or the first free one."""
        taken = self._shards_taken(records)
        shards = self.cfg.data_shards
        if self.shard_index is not None:
            return
        free = [i for i in range(shards) if i not in taken]
        if not free:
            raise UserError(
                f"run {self.opts.run_id!r} is full: its peers read all {shards} data shards (--max-peers "
                f"{shards}); wait for a peer to leave, or start the run with a larger --max-peers"
            )
        before = records.get(self.peer_id)
        self.shard_index = before.shard if before is not None and before.shard in free else free[0]

    async def _take_state(self, board: Board, stop: asyncio.Event) -> None:
        """Take the swarm's shared state at the end of a step S from live peers and go on from
        there (``swarm/state_transfer.py``): a peer joining a run under way, or one that fell out of
        it. Until it has, its record says "joining": no round counts on it. The syncs in flight at
        S it did not take part in; it fetches their averages and applies them when they are due,
        like every other peer."""
        assert isinstance(self.strategy, Strategy) and self.exchange is not None
        self.state = "joining"
        self.exchange.set_joining(True)
        self.agreement.forget()  # its θ̄ is about to be replaced by the swarm's
        self.split_from = self.unsettled = None
        if self.state_server is not None:
            self.state_server.serving = False  # our state is behind: never hand it to a joiner
        for task in self.pending.values():
            task.cancel()
        self.pending.clear()
        await self._announce(board)  # the others stop counting on us at once
        self.progress.joining([])
        deadline = time.monotonic() + self.opts.wait_peers_s
        while True:
            self._check_swarm()
            donors = sorted(
                (
                    p
                    for p, r in self.view.items()
                    if p != self.peer_id
                    and self._same_run(r)
                    and r.state == "training"
                    and p not in self.distrusted
                ),
                key=lambda p: (-self.view[p].step, p),
            )[:DONORS]
            if donors:
                self.progress.joining([self._name_of(d) for d in donors])
                break
            if any(r.state == "done" and self._same_run(r) for r in self.view.values()):
                raise UserError(
                    f"run {self.opts.run_id!r} has finished without this peer: no peer trains any more to "
                    "take the swarm's state from"
                )
            self._check_wait(stop, deadline, "no peer to take the swarm's state from in")
            await asyncio.sleep(0.2)
        step_time = max(max(self.view[d].step_time_s for d in donors), 1e-3)
        margin = max(2, math.ceil(2 * self.opts.heartbeat_s / step_time))
        ahead = max(self.view[d].step for d in donors) + margin
        try:
            pulled = await pull_state(self.p2p, self.opts.run_id, self.fingerprint, donors, ahead, margin)
        except StateUnavailable as exc:
            raise UserError(f"could not take the swarm's state in run {self.opts.run_id!r}: {exc}") from None
        if pulled.step >= self.cfg.steps:
            raise UserError(
                f"run {self.opts.run_id!r} is at step {pulled.step} of --steps {self.cfg.steps}: nothing "
                "left to train"
            )
        self.trainer.reset()  # a fresh AdamW; join_from sets every parameter to θ̄
        self.strategy = self.setup.strategy(self.trainer.model, self.settings)
        assert isinstance(self.strategy, Strategy)
        if self.region is not None:
            self.region.whole = True
        try:
            self.strategy.join_from(pulled.state["strategy"])
            versions = expect_list(pulled.state["versions"], len(self.versions), int, "fragment versions")
        except (ValueError, KeyError, TypeError) as exc:
            raise UserError(f"the state the donors sent does not fit this run ({exc})") from None
        self.versions = versions
        self.step = self.joined_at = pulled.step
        for p, sync in self.strategy.in_flight.items():
            size = torch.zeros_like(self.strategy.outer[p].global_params)
            self.pending[p] = asyncio.create_task(self._round(p, sync.sent_step, size, pace=None))
        self.state = "training"
        self.exchange.set_joining(False)
        self.failed_in_a_row = 0
        if self.state_server is not None:
            self.state_server.serving = True
        await self._announce(board)
        self._record_join(self.peer_id, self.joined_at)
        log.warning(
            "took the swarm's state at the end of step %d from %d donors (%s): %.1f MB in %.1f s; "
            "fetching the %d syncs in flight",
            pulled.step,
            len(pulled.donors),
            ", ".join(d[:12] for d in pulled.donors),
            pulled.num_bytes / 1e6,
            pulled.seconds,
            len(self.pending),
        )

    def _largest_round(self) -> int:
        """Values averaged in the largest round: the largest fragment (ddp: the whole model)."""
        if isinstance(self.strategy, Strategy):
            return max(outer.global_params.numel() for outer in self.strategy.outer)
        return self.setup.num_params

    def _round_bytes(self) -> int:
        """What this peer sends in the largest round: a butterfly over up to --max-peers members."""
        return allreduce_wire_bytes(self.setup.codec, self._largest_round(), self.cfg.data_shards)

    def _max_message_bytes(self) -> int:
        """The largest message of the run: the largest round's average in fp32 (a FETCH answer), or
        a slice of it encoded with the run's codec, plus room for the message's other fields."""
        numel = self._largest_round()
        return max(4 * numel, self.setup.codec.wire_bytes(numel)) + 64 * 1024

    def _shared_state(self) -> dict[str, Any]:
        """A copy of what every live peer holds identically now, for a joiner (a step boundary)."""
        assert isinstance(self.strategy, Strategy)
        return {"strategy": copy.deepcopy(self.strategy.shared_state()), "versions": list(self.versions)}

    def _log(self, record: dict[str, Any]) -> None:
        """Write one record to --out (and keep it: a checkpoint holds the records so far)."""
        assert self.run_log is not None
        self.run_log.write(record)
        self.written.append(record)
        self.metrics.record(record)
        self._sample_metrics()

    def _sample_metrics(self) -> None:
        """Hand this peer's numbers to its metrics (``monitoring.py``): after every step and record,
        and every heartbeat. A scrape reads only this sample, never the live counters."""
        ex, cfg = self.exchange, self.cfg
        servers = [s for s in (ex, self.state_server) if s is not None]
        self.metrics.sample = PeerSample(
            state=self.state,
            step=self.step,
            inner_steps=self.steps_trained,
            tokens=self.steps_trained * cfg.batch_size * cfg.seq_len,
            step_seconds=self.step_time_s,
            tokens_per_second=self._tokens_per_s(),
            stall_seconds=self.stall_s,
            sent_bytes=ex.stats.bytes_sent if ex else 0,
            resent_bytes=ex.stats.bytes_resent if ex else 0,
            served_bytes=ex.stats.bytes_served if ex else 0,
            received_bytes=ex.stats.bytes_received if ex else 0,
            rounds_completed=ex.stats.rounds_done if ex else 0,
            rounds_failed=ex.stats.rounds_failed if ex else 0,
            resyncs=self.resyncs,
            refused=sum(sum(s.limiter.refused.values()) for s in servers),
            outliers=sum(ex.outliers.values()) if ex else 0,
            board=dict(Counter(r.state for r in self.view.values())),
        )

    def _record_join(self, peer: str, joined_at: int, shard: int | None = None) -> None:
        """One record in --out per peer (and per time it took the state) this peer learns of: the
        data shard whose replica starts after step ``joined_at``. ``simulate --events`` replays it."""
        shard = self.shard_index if peer == self.peer_id else shard
        if self.run_log is None or shard is None or (peer, joined_at) in self.joins_recorded:
            return
        self.joins_recorded.add((peer, joined_at))
        self._log({"kind": "join", "shard": shard, "step": joined_at, "peer": peer})

    async def _wait_for_start(self, stop: asyncio.Event) -> None:
        """Start step 1 only once every peer shows 'training': then all agree on each round's leader."""
        deadline = time.monotonic() + self.opts.wait_peers_s
        while True:
            training = [r for r in self.view.values() if self._same_run(r) and r.state == "training"]
            if len(training) >= self.cfg.workers:
                return
            self._check_wait(stop, deadline, f"only {len(training)} of {self.cfg.workers} peers started")
            await asyncio.sleep(0.2)

    def _check_wait(self, stop: asyncio.Event, deadline: float, what: str) -> None:
        self._check_swarm()
        if stop.is_set():
            raise UserError("interrupted while waiting for peers")
        if time.monotonic() > deadline:
            raise UserError(
                f"{what} run {self.opts.run_id!r} within {self.opts.wait_peers_s:.0f} s "
                "(--wait-peers); start the others, or lower --workers"
            )

    def _settle_shard(self, live: list[str], records: dict[str, PeerRecord]) -> None:
        """Keep --shard, or take a shard no live peer reads: peers without one, in id order, take
        the free shards in order (every peer computes the same split from the same board)."""
        if len(live) > self.cfg.workers:
            raise UserError(
                f"{len(live)} peers joined run {self.opts.run_id!r} but --workers is {self.cfg.workers}: "
                "give every peer the same --workers, or use another --run-id"
            )
        taken = self._shards_taken(records)
        if self.shard_index is None:
            free = [i for i in range(self.cfg.workers) if i not in taken]
            unsettled = [p for p in live if records[p].shard is None or p == self.peer_id]
            self.shard_index = free[unsettled.index(self.peer_id)]

    def _shards_taken(self, records: dict[str, PeerRecord]) -> dict[int, str]:
        """The data shards other peers of the run read (shard -> peer; finished peers read none);
        UserError if this peer's own --shard (or checkpoint's shard) is among them."""
        taken = {
            r.shard: p
            for p, r in records.items()
            if r.shard is not None and p != self.peer_id and r.state != "done"
        }
        if self.shard_index in taken:
            raise UserError(
                f"--shard {self.shard_index}/{self.cfg.data_shards} is already read by peer "
                f"{taken[self.shard_index][:12]}: give each peer its own shard"
            )
        return taken

    # ---- training ----

    async def _in_train_thread(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.train_pool, fn, *args)

    async def _train(self, log_file: RunLog, stop: asyncio.Event, board: Board) -> dict[str, Any]:
        cfg = self.cfg
        assert self.shard_index is not None and self.exchange is not None
        shard = self.setup.shard(self.shard_index, cfg.data_shards)
        started = self.train_started = time.perf_counter()
        train_losses: list[float] = []
        failure = None  # why this peer stopped training with the swarm, if it did
        if self.resume is not None and self.written:  # --out as the uninterrupted run's, then on
            for record in self.written:
                log_file.write(record)
            evals = [r for r in self.written if r["kind"] == "eval"]
            first, last = evals[0], evals[-1]
        else:
            first = last = await self._evaluate(self.step, started, train_losses, log_file)
        self.progress.training(self.step)
        while self.step < cfg.steps:
            if stop.is_set():
                log.warning("stopping after step %d on a signal", self.step)
                if self.checkpoints is not None and self.checkpointed != self.step:
                    await self._write_checkpoint()
                break
            step = self.step + 1
            try:
                self._check_swarm()
                self._check_split()
                t0 = time.perf_counter()
                train_losses.append(await self._inner_step(step, *shard.batch(step - 1)))
                elapsed = time.perf_counter() - t0
                self.step_time_s = elapsed if step == 1 else 0.9 * self.step_time_s + 0.1 * elapsed
                self.step = step
                self.steps_trained += 1
                if isinstance(self.strategy, Strategy):
                    await self._apply_due(step, stop)
                    if not stop.is_set():
                        self._send(step)
                        await self._apply_due(step, stop)
            except Resync as exc:
                await self._resync(board, stop, exc)
                self.progress.training(self.step)
                continue
            except SyncsFailing as exc:
                log.error("%s", exc)
                failure = str(exc)
                break
            if self.state_server is not None:
                self.state_server.step_done(step)
            if step % cfg.eval_every == 0 or step == cfg.steps:
                last = await self._evaluate(step, started, train_losses, log_file)
            self.progress.step(step, last if last["step"] == step else {})
            self._sample_metrics()
            if self.checkpoints is not None and self.checkpoints.due(step, cfg.steps):
                await self._write_checkpoint()  # after the step's records: the checkpoint holds them
        await self._finish_in_flight(STOP_GRACE_S if stop.is_set() else self.opts.round_timeout_s * 2)
        if last["step"] != self.step:
            last = await self._evaluate(self.step, started, train_losses, log_file)
        stats = self.exchange.stats
        wall = time.perf_counter() - started
        global_state = self.strategy.global_state()
        unfinished = self._unfinished(failure)
        saved = None
        if cfg.save is not None:
            saved = save_run(self.setup, global_state, last["step"], first, last, unfinished)
        summary = summary_record(
            self.setup,
            self.settings,
            first,
            last,
            global_state,
            saved,
            bytes_sent=stats.bytes_sent,
            stall_s=self.stall_s,
            wall_time_s=wall,
            step_time_s=self.step_time_s,
            tokens_per_s=self._tokens_per_s(),
            peak_memory_bytes=peak_memory_bytes(self.setup.placement.device),
            rounds_done=stats.rounds_done,
            rounds_failed=stats.rounds_failed,
            bytes_resent=stats.bytes_resent,
            bytes_served=stats.bytes_served,
            peer_id=self.peer_id,
            shard=self.shard_index,
            joined_at=self.joined_at,
            resyncs=self.resyncs,
            state_copy_s=self.state_server.copy_s if self.state_server else 0.0,
            send_spacing=self._send_spacing(),
            key_id=self.membership.key_id,
            refused=self._refused(count=16),
            outliers=dict(self.exchange.outliers.most_common(16)),
            accused=dict(self.exchange.accused.most_common(16)),
            theta_disputed=dict(self.disputed),
            theta_unsettled_step=self.unsettled.step if self.unsettled is not None else None,
            theta_behind_step=self.split_from.step if self.split_from is not None else None,
            failure=failure,
        )
        self._log(summary)
        self.run_log = None  # the summary stays the last record: joins seen after it are not written
        return summary

    def _unfinished(self, failure: str | None) -> str | None:
        """Why this peer's θ̄ is not a finished run's (its --save goes to a partial folder), if it is not."""
        if failure is not None:
            return failure
        if self.split_from is not None or self.unsettled is not None:
            return "its θ̄ is not the one the swarm holds"
        if self.step < self.cfg.steps:
            return f"stopped after step {self.step} of {self.cfg.steps}"
        return None

    async def _resync(self, board: Board, stop: asyncio.Event, why: Resync) -> None:
        """This peer fell out of the swarm (``Resync``): take the swarm's state again, as a joiner."""
        self.resyncs += 1
        if self.resyncs > MAX_RESYNCS:
            raise UserError(
                f"{why}; this peer had to take the swarm's state {MAX_RESYNCS} times already, so it stops: "
                "is this machine stopped or cut off again and again?"
            )
        log.warning("%s: taking the swarm's state again (resync %d)", why, self.resyncs)
        if self.watchdog is not None and self.watchdog.done():  # it ended with this Resync
            self.watchdog = asyncio.create_task(self._watch_for_lapse(board))
        await self._take_state(board, stop)

    async def _inner_step(self, step: int, x: torch.Tensor, y: torch.Tensor) -> float:
        if self.region is not None:
            region = self.region
            loss = await self._in_train_thread(region.lead_step, self.trainer, self.shard_index, x, y, step)
        elif not isinstance(self.strategy, DataParallel):
            loss = await self._in_train_thread(self.trainer.step, x, y, step)
        else:  # ddp: the gradient all-reduce sits between backward and the optimizer step
            assert self.exchange is not None
            loss = await self._in_train_thread(self.trainer.backward, x, y)
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
            self.strategy.apply_gradients(averaged)
            await self._in_train_thread(self.trainer.update, step)
        if not torch.isfinite(torch.tensor(loss)):
            raise UserError(f"training diverged at step {step} (loss {loss}): lower --lr or --outer-lr")
        return loss

    def _send(self, step: int) -> None:
        """Start the syncs the schedule asks for after ``step``. Between two steps only the snapshots
        are taken (on the device); their copies to the host, the outer gradients, the exchange and
        the outer step the result leads to run in the sync's task (``_sync``)."""
        assert isinstance(self.strategy, Strategy)
        for p in self.strategy.sends_after(step):
            snapshot = self.setup.placement.to_host(self.strategy.send(p, step))
            self.pending[p] = asyncio.create_task(self._sync(p, step, snapshot, self._pace_wish()))

    async def _sync(self, p: int, step: int, snapshot: HostCopy, pace: int) -> PreparedResult:
        """One fragment sync, off the training thread: Δ_p = θ̄_p − θ_p from the snapshot's host
        copy, the round, then the result prepared for ``Strategy.apply`` (the outer step on the
        CPU, the new θ̄_p copied to the device) so that applying it between two steps costs only
        the merge."""
        assert isinstance(self.strategy, Strategy)
        return await self._round(p, step, self.strategy.outer_gradient(p, await snapshot.ready()), pace)

    async def _round(self, p: int, sent_step: int, vector: torch.Tensor, pace: int | None) -> PreparedResult:
        """The round of fragment p sent after ``sent_step``: with ``vector`` and the ``pace`` this
        peer asks for, or (``pace`` None: a sync in flight when this peer took the swarm's state)
        only fetching its average; then the result prepared for ``Strategy.apply``."""
        assert isinstance(self.strategy, Strategy) and self.exchange is not None
        strategy = self.strategy
        round_id = fragment_round(p, sent_step)
        take_part = pace is not None
        started = time.perf_counter()
        averaged = await self.exchange.allreduce(round_id, vector, sent_step, take_part, pace or 0)
        self.metrics.round_seconds.observe(time.perf_counter() - started)
        return await asyncio.to_thread(strategy.prepare, p, averaged)

    def _paced(self, was: int | None, round_id: str) -> None:
        """Say that the swarm's pace changed: a warning the first time it sends less than asked."""
        schedule = self.strategy.schedule  # type: ignore[union-attr] - only CoCoDC's is paced
        now = schedule.spacing
        first = not self.paced_before and now > schedule.base_spacing
        self.paced_before |= first
        log.log(
            logging.WARNING if first else logging.INFO,
            "the swarm now sends a fragment every %s steps (was %s): round %s agreed on the pace its "
            "slowest link keeps up with%s",
            now,
            was,
            round_id,
            " (further changes are logged with --verbose)" if first else "",
        )

    def _send_spacing(self) -> int | None:
        """Steps between send slots now (CoCoDC's paced schedule), None for the other algorithms."""
        schedule = getattr(self.strategy, "schedule", None)
        return schedule.spacing if isinstance(schedule, AdaptiveSchedule) else None

    def _pace_wish(self) -> int:
        """The send-slot spacing this peer's link keeps up with (CoCoDC only; 0: none): each round's
        group takes the largest its members ask for, and every peer applies it with the round. The
        link's busy time per round is measured (``LinkMeter``); until a delivery was acknowledged,
        it is what the declared link (--bandwidth-mbps) would take for a round's bytes."""
        assert isinstance(self.strategy, Strategy) and self.exchange is not None
        schedule = self.strategy.schedule
        if not isinstance(schedule, AdaptiveSchedule) or self.opts.pace == "fixed":
            return 0
        measured = self.exchange.link.busy_per_round_s()
        busy = measured or 8.0 * self.exchange.round_bytes / (self.cfg.bandwidth_mbps * 1e6)
        return paced_spacing(schedule.base_spacing, self.cfg.inner_steps, busy, self.step_time_s)

    async def _apply_due(self, step: int, stop: asyncio.Event) -> None:
        assert isinstance(self.strategy, Strategy)
        for p in self.strategy.due(step):
            task = self.pending[p]
            waited = time.perf_counter()
            stopping = asyncio.ensure_future(stop.wait())
            guards = {t for t in (self.heartbeat, self.watchdog) if t is not None}
            try:  # a signal, or a lost swarm, is noticed while a sync is still running
                await asyncio.wait({task, stopping, *guards}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopping.cancel()
                self.stall_s += time.perf_counter() - waited
            self._check_swarm()
            if not task.done():
                return
            del self.pending[p]
            round_id = fragment_round(p, self.strategy.in_flight[p].sent_step)
            try:
                prepared = task.result()
            except RoundFailed as exc:
                self._sync_failed(p, step, exc)
                self._record_round(round_id, completed=False)
                continue
            self.failed_in_a_row = 0
            self._record_round(round_id, completed=True)
            was = self._send_spacing()
            self.strategy.apply(p, prepared, step, spacing=self.exchange.groups[round_id].pace)
            if self.region is not None:
                self.region.changed_params(self.strategy.fragments[p].params, self.trainer.model)
            self.versions[p] += 1
            if self._send_spacing() != was:
                self._paced(was, round_id)

    def _record_round(self, round_id: str, completed: bool) -> None:
        """One record in --out for every sync this peer settles: the round's group (data shards, in
        member order), the pace it agreed on and whether it completed. ``simulate --events``
        replays them."""
        assert self.exchange is not None
        group = self.exchange.groups.get(round_id) if completed else None
        members, pace = (list(group.shards), group.pace) if group is not None else ([], 0)
        record = {"kind": "round", "round": round_id, "step": self.step, "members": members, "pace": pace}
        self._log({**record, "completed": completed})

    def _sync_failed(self, p: int, step: int, exc: RoundFailed) -> None:
        """A sync that failed on every live peer alike is abandoned alike (θ̄ stays identical); one
        the others completed without us (``RoundLost``) leaves θ̄ behind theirs, so this peer takes
        the swarm's state again; and syncs that keep failing mean it is not training with a swarm."""
        assert isinstance(self.strategy, Strategy)
        if isinstance(exc, RoundLost):
            raise Resync(
                f"the swarm completed the sync of fragment {p} sent after step "
                f"{self.strategy.in_flight[p].sent_step} without this peer, and its average is no longer "
                f"kept ({exc})"
            )
        log.warning("sync of fragment %d after step %d failed on every peer (%s); skipped", p, step, exc)
        self.strategy.abandon(p)
        self.failed_in_a_row += 1
        if self.failed_in_a_row >= FAILING_STREAK * len(self.strategy.fragments):
            raise SyncsFailing(
                f"the last {self.failed_in_a_row} syncs all failed (last: {exc}); this peer is not "
                "training with the swarm. Check that the other peers are reachable (--announce, "
                "firewall) and alive (the bootstrap's /status)"
            )

    async def _finish_in_flight(self, timeout: float) -> None:
        """Let the syncs still running finish (the other peers need our slices); apply none of
        them, as the simulator's run ends with them unapplied. Stopped by a signal, the other peers
        are likely stopping too: wait only briefly."""
        if self.pending:
            await asyncio.wait(self.pending.values(), timeout=timeout)
        for task in self.pending.values():
            if not task.done():
                task.cancel()
            elif not task.cancelled() and task.exception() is not None:
                log.info("a final sync failed: %s", task.exception())
        self.pending.clear()

    async def _evaluate(
        self, step: int, started: float, train_losses: list[float], log_file: RunLog
    ) -> dict[str, Any]:
        self.progress.evaluating()
        state = self.strategy.global_state()
        eval_started = time.perf_counter()
        record = await self._in_train_thread(
            self.setup.eval_record, self.eval_model, state, step, self.cfg.workers
        )
        self.agreement.record(step, await self._in_train_thread(params_sha256, state))
        self.eval_s += time.perf_counter() - eval_started
        self.val_ppl = min(record["val_ppl"], 1e308)  # a record's numbers are finite (inf: loss past 700)
        record.update(
            wall_time_s=time.perf_counter() - started,
            train_loss=sum(train_losses) / len(train_losses) if train_losses else None,
            bytes_sent=self.exchange.stats.bytes_sent if self.exchange else 0,
            stall_s=self.stall_s,
        )
        train_losses.clear()
        self._log(record)
        return record
