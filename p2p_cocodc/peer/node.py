"""The peer: one region's asyncio program (uvloop), the node that owns its parts.

- ``lobby.py`` decides, from the board's records, whether this peer starts a run with the others or
  joins one under way, which data shard it reads, where a resumed swarm goes on, and its donors.
- ``presence.py`` keeps it on the board (heartbeat), its view of the others, the θ̄ agreement and
  the lapse watch.
- ``syncs.py`` is its replica and its syncs: the driver of the replica loop (``run/loop.py``).

The node starts the DHT and the swarm's servers, takes the peer through its lifecycle (``Lifecycle``:
every transition in ``_become``) and ends it. Its parts never reach back into it: what they need
is handed to them.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

from p2p_cocodc.algorithms.devices import resolve_device
from p2p_cocodc.algorithms.strategies import AlgoSettings
from p2p_cocodc.config.join import SwarmOptions
from p2p_cocodc.config.schema import AUTO
from p2p_cocodc.config.train import TrainConfig
from p2p_cocodc.errors import Stopped, UserError
from p2p_cocodc.models.hf import model_identity
from p2p_cocodc.ops.monitoring import PeerMetrics
from p2p_cocodc.ops.progress import Phases, Progress
from p2p_cocodc.peer import lobby
from p2p_cocodc.peer.presence import Presence
from p2p_cocodc.peer.region import Region
from p2p_cocodc.peer.syncs import SwarmReplica, board_fields, host_buffers, metrics_sample
from p2p_cocodc.run.checkpoint import Checkpoint, CheckpointWriter, committed, read_checkpoint
from p2p_cocodc.run.loop import ReplicaLoop
from p2p_cocodc.run.records import Records, RunLog
from p2p_cocodc.run.setup import TrainingSetup
from p2p_cocodc.swarm.connections import Connections
from p2p_cocodc.swarm.dht import bootstrap_endings, p2pd_socket, parse_bootstrap, start_dht, stop_dht
from p2p_cocodc.swarm.exchange import EXCHANGE_PROTOCOL, FragmentExchange
from p2p_cocodc.swarm.records import Board, PeerRecord, peers_key
from p2p_cocodc.swarm.run_options import fingerprint, option_view
from p2p_cocodc.swarm.state_transfer import Pulled, StateServer, StateUnavailable, pull_state
from p2p_cocodc.swarm.trust import Membership, check_identity

log = logging.getLogger(__name__)

# a stopping peer says "leaving" on the board for this long at most: a signal to its whole process
# group has stopped its DHT too, and the others see its record lapse anyway (docs/swarm.md)
LEAVE_ANNOUNCE_S = 3.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# A start-up that failed waits this long at most for the event loop to run the handler of a signal
# that came while the loop was blocked (``start_dht`` blocks it): the start-up failed because of it.
SIGNAL_NOTICE_S = 0.5
BEFORE_TRAINING = "before training"
WAITING = f"while waiting for peers, {BEFORE_TRAINING}"

T = TypeVar("T")


class Lifecycle(enum.StrEnum):
    """What this peer's record says it is doing (the others read it: only "training" peers are in
    rounds and give their state to joiners)."""

    WAITING = "waiting"  # for --workers peers, or for a run under way to show itself
    JOINING = "joining"  # taking the swarm's state (a joiner, or a peer that fell out of the swarm)
    TRAINING = "training"
    LEAVING = "leaving"  # stopped by a signal: no new round counts on it
    DONE = "done"


# Every transition a peer makes; anything else is a bug of ours (``Peer._become``).
TRANSITIONS: dict[Lifecycle, frozenset[Lifecycle]] = {
    Lifecycle.WAITING: frozenset({Lifecycle.TRAINING, Lifecycle.JOINING}),
    # DONE: the run ended while it caught up with the swarm (``SwarmReplica.catching_up``)
    Lifecycle.JOINING: frozenset({Lifecycle.TRAINING, Lifecycle.JOINING, Lifecycle.LEAVING, Lifecycle.DONE}),
    # back to WAITING: a peer of the starting set left before step 1 (``lobby.Left``)
    Lifecycle.TRAINING: frozenset({Lifecycle.WAITING, Lifecycle.JOINING, Lifecycle.LEAVING, Lifecycle.DONE}),
    # a signal arrives while a sync that decides it must take the state again is settled
    Lifecycle.LEAVING: frozenset({Lifecycle.JOINING, Lifecycle.TRAINING, Lifecycle.DONE}),
    Lifecycle.DONE: frozenset(),
}


def shared_options(setup: TrainingSetup, settings: AlgoSettings) -> dict[str, Any]:
    """What every peer of a run must share: algorithm, optimizers, model, data, codec, how slices are
    screened and combined, M. Its fingerprint is what peers compare."""
    cfg = setup.cfg
    digest = hashlib.sha256(setup.tokens.train.numpy().tobytes()).hexdigest()[:16]
    algo = asdict(settings)
    for name in ("overlap", "transmissions"):  # 'auto' is agreed in the lobby, not compared
        if getattr(cfg, name) == AUTO:
            algo[name] = AUTO
    return {
        "algo": algo,
        "inner": asdict(setup.inner),
        "model": model_identity(cfg.model, setup.base),  # an hf: model by content, not by path
        "data": digest,
        "vocab": setup.tokens.vocab_size,
        "seq_len": cfg.seq_len,
        "batch_size": cfg.batch_size,
        "seed": cfg.seed,
        "codec": [cfg.wire_codec, cfg.paced_wire_codec, cfg.topk, cfg.error_feedback],
        "final_sync": cfg.final_sync,
        "aggregation": asdict(cfg.aggregation()),
        "workers": cfg.workers,
        "data_shards": cfg.data_shards,
        "exchange": EXCHANGE_PROTOCOL,  # a release that speaks another round protocol is another run
    }


def saved_shape(state: dict[str, Any], otherwise: tuple[int, int]) -> tuple[int, int]:
    """The τ and N a checkpoint's run synced with (``otherwise`` for a checkpoint older than that
    record); ValueError if it holds something else."""
    if "sync_shape" not in state:
        return otherwise
    tau, n = (int(x) for x in state["sync_shape"])
    if tau < 0 or n < 1:
        raise ValueError(f"its sync_shape {[tau, n]} is no τ and N")
    return tau, n


# a joiner further behind the swarm than this many seconds of its steps catches up untrained
# (``SwarmReplica.catching_up``) instead of training as a member that every round would wait for
CATCH_UP_S = 5.0
LOBBY_LOOK_S = 0.25  # how often a peer in the lobby reads the board (the heartbeat: once a second)


def start_paced(replica: SwarmReplica, pace: int) -> None:
    """Start with send slots every ``pace`` steps (``lobby.starting_pace``; 0: the schedule's own),
    recorded for ``simulate --events``: on a thin link the first syncs would otherwise go out at
    the schedule's own spacing, before any round's result has paced the swarm, and stall it."""
    strategy = replica.strategy
    if pace <= 0 or strategy.send_spacing() is None:
        return
    strategy.pace_from_start(pace)
    replica.records.write({"kind": "start", "pace": strategy.send_spacing()})
    log.warning(
        "the swarm starts sending a fragment every %d steps: the pace its slowest declared link "
        "keeps up with (--bandwidth-mbps)",
        strategy.send_spacing(),
    )


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
        self.initial_peers, bootstrap_key_id = parse_bootstrap(opts.bootstrap)
        self.membership.check_admitted(bootstrap_key_id, f"--bootstrap {opts.bootstrap}")
        if not cfg.resume:  # a run that ended says so at once; --resume goes on with one
            lobby.check_not_ended_at_bootstrap(bootstrap_endings(opts.bootstrap), opts.run_id, cfg.steps)
        self.cfg = cfg
        self.opts = opts
        self.metrics = metrics if metrics is not None else PeerMetrics()  # served with --metrics-port
        self.setup = TrainingSetup(cfg, region.placement if region is not None else None)
        step_time = self.setup.step_time() if self.setup.needs_step_time() else cfg.step_time
        link = (cfg.latency_ms / 1000.0, cfg.bandwidth_mbps * 1e6, step_time)
        self.settings = self.setup.settings(*link, paced=cfg.algo == "cocodc", asks_pace=opts.pace == "link")
        shared = shared_options(self.setup, self.settings)
        self.fingerprint = fingerprint(shared)
        self.options = option_view(shared)  # published, so a mismatched peer can say what differs
        step_time = first_step_time(self.setup, step_time, opts.min_step_s)  # on the board before step 1
        self.replica = SwarmReplica(
            self.setup, self.settings, region, self.metrics, opts.pace, opts.round_timeout_s, step_time
        )
        self.replica.min_step_s = opts.min_step_s
        self.lifecycle = Lifecycle.WAITING
        self.peer_id = ""  # known once its DHT is up (``run``)
        self.progress: Phases = Progress("", cfg.steps, 0, None)  # quiet, unless ``run`` is given one
        self.records = Records(None)
        self.presence: Presence | None = None
        self.exchange: FragmentExchange | None = None
        self.state_server: StateServer | None = None
        self.p2p: Any = None
        self.connections = Connections()  # to every peer of the run, from the lobby on
        self.joins_recorded: set[tuple[str, int]] = set()  # (peer, joined_at) written to --out
        self.replica.shard_index = opts.shard[0] if opts.shard else None
        data = self.setup.data_sha256() if cfg.checkpoint_dir is not None else ""  # hashes every token
        self.checkpoints = (
            CheckpointWriter(cfg.checkpoint_dir, cfg.checkpoint_every, cfg.computing_options(), data)
            if cfg.checkpoint_dir is not None
            else None
        )
        self.resume = resume  # the newest checkpoint of --checkpoint-dir, with --resume
        # τ and N as this peer worked them out (a resumed run: as its checkpoint's run agreed them),
        # then as the swarm agreed them (the lobby's Sync shape rule)
        self.proposed = (self.settings.overlap, self.settings.transmissions)
        self.proposed_pace = (
            0 if opts.pace == "fixed" else lobby.declared_pace(self.replica, cfg.bandwidth_mbps, step_time)
        )
        self.sync_shape: tuple[int, int] | None = None
        if resume is not None:  # it keeps its data shard
            resume.check_data(data)
            self.replica.shard_index = resume.restore(lambda state: int(state["shard"]))
            self.proposed = resume.restore(lambda state: saved_shape(state, self.proposed))

    @property
    def name(self) -> str:
        """What operators see this peer as: --region, else the first 12 characters of its peer id."""
        return self.opts.region or self.peer_id[:12]

    @property
    def step(self) -> int:
        return self.replica.step

    def _seat(self) -> lobby.Seat:
        """This peer as the lobby sees it (``peer/lobby.py``)."""
        return lobby.Seat(
            peer_id=self.peer_id,
            run_id=self.opts.run_id,
            fingerprint=self.fingerprint,
            key_id=self.membership.key_id,
            is_open=self.membership.is_open,
            workers=self.cfg.workers,
            data_shards=self.cfg.data_shards,
            steps=self.cfg.steps,
            shard=self.replica.shard_index,
            resume_step=self.resume.step if self.resume is not None else None,
            can_take_state=self.replica.strategy.takes_state,
        )

    def _move(self, state: Lifecycle) -> None:
        """The one place this peer's lifecycle moves; the heartbeat publishes it within a beat."""
        if state not in TRANSITIONS[self.lifecycle]:
            raise RuntimeError(f"a peer cannot go from {self.lifecycle.value} to {state.value}")
        self.lifecycle = state
        before_training = (Lifecycle.WAITING, Lifecycle.JOINING, Lifecycle.TRAINING)
        if self.exchange is not None and state in before_training:
            self.exchange.set_joining(state is not Lifecycle.TRAINING)  # no round counts on a joiner
        if self.state_server is not None and state in before_training:
            self.state_server.serving = state is Lifecycle.TRAINING  # a joiner's state is behind

    async def _become(self, state: Lifecycle, last: bool = False) -> None:
        """``_move``, and say so on the board at once (``last``: trying again for a while)."""
        self._move(state)
        if self.presence is not None:
            await self.presence.announce(state.value, last=last)

    # ---- the run ----

    async def run(
        self,
        log_file: RunLog,
        progress: Phases | None = None,
        signalled: Callable[[], signal.Signals | None] | None = None,
    ) -> dict[str, Any]:
        """The peer's whole life; SIGINT and SIGTERM stop it (``_on_signal``) while it runs, and its
        caller's handlers of them are back when it returns. ``signalled``: the signal that came
        before this run took them over, if one did (its caller noted it): the peer stops at once."""
        stop = asyncio.Event()
        with stop_signals_to(asyncio.get_running_loop(), lambda sig: self._on_signal(sig, stop)):
            first = signalled() if signalled is not None else None
            if first is not None:
                self._on_signal(first, stop)
            return await self._run(log_file, progress, stop)

    async def _run(self, log_file: RunLog, progress: Phases | None, stop: asyncio.Event) -> dict[str, Any]:
        self.records = self.replica.records = Records(log_file, listener=self._on_record)
        if self.opts.identity is not None:
            check_identity(self.opts.identity)
        if self.membership.is_open:
            log.warning(
                "run %r is open: any peer that reaches the bootstrap may join it and send updates; to admit "
                "only your peers, create a key (p2p-cocodc keygen swarm.key) and give every peer "
                "--swarm-key-file swarm.key, or certify each peer with an owner key (docs/security.md)",
                self.opts.run_id,
            )
        starting = f"while starting, {BEFORE_TRAINING}"
        self._check_stop(stop, starting)
        dht = daemon_socket = p2p = None
        try:
            try:
                # Created on the main thread: the at-fork death signal is tied to the forking thread.
                dht = start_dht(
                    self.initial_peers,
                    self.opts.host,
                    self.opts.port,
                    self.opts.announce,
                    self.opts.identity,
                    self.membership,
                    protected=[peers_key(self.opts.run_id)],
                    left_to_parent=host_buffers(self.replica),
                )
                daemon_socket = p2pd_socket(dht)
                p2p = self.p2p = await dht.replicate_p2p()
            except Exception:
                # A signal to the whole process group also ends the helpers being started (p2pd,
                # torch_shm_manager), and the start-up fails because of it: that is a stop. The
                # loop runs the signal's handler only once it runs again (start_dht blocks it).
                with suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), SIGNAL_NOTICE_S)
                self._check_stop(stop, starting)
                raise
            self._check_stop(stop, starting)
            self.peer_id = p2p.peer_id.to_base58()
            self.metrics.identify(
                run_id=self.opts.run_id, region=self.name, peer_id=self.peer_id, algo=self.cfg.algo
            )
            if progress is not None:
                self.progress = progress
                progress.named(self.name)
            return await self._take_part(p2p, dht, stop)
        except ConnectionError as exc:
            raise UserError(f"the swarm's DHT does not answer ({exc}); is the bootstrap still up?") from None
        finally:
            if self.presence is not None:
                self.presence.stop()
            self.replica.close()
            await self.connections.stop()
            if p2p is not None:
                await p2p.shutdown()  # removes its client socket file
            if dht is not None:
                stop_dht(dht, daemon_socket)

    async def _take_part(self, p2p: Any, dht: Any, stop: asyncio.Event) -> dict[str, Any]:
        """On the board, in the lobby, then training with the swarm until the run ends or a signal."""
        # A record outlives 8 heartbeats: a peer briefly starved of CPU must not vanish from the
        # board (a leader would form rounds without it); a dead one is gone within 8 s.
        board = Board(dht, self.opts.run_id, self.peer_id, ttl_s=8 * self.opts.heartbeat_s)
        presence = self.presence = Presence(
            board,
            lambda record: lobby.same_run(record, self._seat()),
            self._record,
            dict(algo=self.cfg.algo, model=self.cfg.model, workers=self.cfg.workers, options=self.options),
            self.opts.heartbeat_s,
            on_records=self._on_board,
            on_lapse=lambda: self._move(Lifecycle.JOINING),  # the next beat must not say "training"
            can_rejoin=self.replica.strategy.takes_state,
            carrying=lambda: self.exchange is not None and self.exchange.carrying(),
        )
        first = await self._first_look(presence)
        await presence.first_refresh(self.membership.key_id)
        presence.start()
        self.connections.start(p2p, lambda: lobby.peers_to_reach(presence.view, self._seat()))
        admitted = await self._wait_for_peers(stop, board, first)
        replica = self.replica
        self.exchange = FragmentExchange(
            p2p,
            self.opts.run_id,
            self.setup.codec,
            replica.shard_index,  # type: ignore[arg-type]
            self.fingerprint,
            lambda: presence.view,
            self.opts.round_timeout_s,
            record_ttl_s=board.ttl_s,
            link_mbps=self.cfg.bandwidth_mbps,
            round_bytes=replica.round_bytes(),
            key_id=self.membership.key_id,
            max_frame=replica.max_message_bytes(),
            aggregation=self.cfg.aggregation(),
            cosines=replica.screening,
        )
        self.exchange.set_joining(isinstance(admitted, lobby.Join))
        await self.exchange.start()
        if replica.strategy.takes_state:
            self.state_server = StateServer(
                p2p,
                self.opts.run_id,
                self.fingerprint,
                lambda: replica.step,
                replica.shared_state,
                self.cfg.steps,
                admits=self.exchange.is_member,  # the same peers the exchange hears, bans included
                link_mbps=self.cfg.bandwidth_mbps,
            )
            await self.state_server.start()
        replica.attach(self.exchange, self.state_server, presence, stop, self._take_state, self._sample)
        while isinstance(admitted, lobby.Start):
            await self._become(Lifecycle.TRAINING)
            self._record_join(self.peer_id, replica.joined_at)
            left = await self._wait_for_start(stop, admitted.live)
            if left is None:
                replica.rerun_in_flight()
                break
            log.warning(
                "%s left the starting set before step 1: waiting for peers again",
                ", ".join(f"peer {presence.name_of(p)}" for p in left.peers),  # its region, else its id
            )
            await self._become(Lifecycle.WAITING)
            admitted = await self._wait_for_peers(stop, board, {})
        if isinstance(admitted, lobby.Join):
            await self._take_state()
        leave = asyncio.create_task(self._leave_when(stop))
        presence.watch()
        try:
            replica.start_training()
            setup, records, progress = self.setup, self.records, self.progress
            loop = ReplicaLoop(
                replica, setup, self.settings, records, replica.eval_model, progress, self.checkpoints
            )
            summary = await loop.run(resumed=self.resume is not None)
        finally:
            if stop.is_set():  # the others must read "leaving" before anything else
                await asyncio.wait({leave}, timeout=min(board.timeout, LEAVE_ANNOUNCE_S))
            leave.cancel()
        # the summary is written; a run that ended says so for long (a signal stopped the DHT too)
        await self._become(Lifecycle.DONE, last=self.replica.stopped_by is None)
        await self.exchange.stop()
        if self.state_server is not None:
            await self.state_server.stop()
        return summary

    async def _leave_when(self, stop: asyncio.Event) -> None:
        """On SIGINT/SIGTERM, say so on the board at once: new rounds form without this peer (not
        after its record lapses), while the rounds it is in still complete."""
        await stop.wait()
        self._move(Lifecycle.LEAVING)
        if self.exchange is not None:
            await self.exchange.say_bye()
        if self.presence is not None:
            await self.presence.announce(self.lifecycle.value)

    # ---- the board: what this peer publishes, what it reads ----

    def _record(self) -> PeerRecord:
        return PeerRecord(
            state=self.lifecycle.value,
            num_shards=self.cfg.data_shards,
            fingerprint=self.fingerprint,
            resume_step=self.resume.step if self.resume is not None else -1,
            key_id=self.membership.key_id,
            region=self.name,
            proposed_shape=list(self.proposed),
            starting_pace=self.proposed_pace,
            sync_shape=list(self.sync_shape) if self.sync_shape is not None else [],
            **board_fields(self.replica),
        )

    def _on_board(self, fresh: dict[str, PeerRecord]) -> None:
        """A fresh read of the board: a join record for every peer of the run seen training."""
        for peer, record in fresh.items():
            if lobby.same_run(record, self._seat()) and record.state in ("training", "leaving", "done"):
                self._record_join(peer, record.joined_at, record.shard)
        self._sample()

    def _on_record(self, record: dict[str, Any]) -> None:
        self.metrics.record(record)
        self._sample()

    def _sample(self) -> None:
        """Hand this peer's numbers to its metrics (``ops/monitoring.py``): after every step and
        record, and every heartbeat. A scrape reads only this sample, never the live counters."""
        view = self.presence.view if self.presence is not None else {}
        self.metrics.sample = metrics_sample(self.replica, self.lifecycle.value, view)

    def _record_join(self, peer: str, joined_at: int, shard: int | None = None) -> None:
        """One record in --out per peer (and per time it took the state) this peer learns of: the
        data shard whose replica starts after step ``joined_at``. ``simulate --events`` replays it."""
        shard = self.replica.shard_index if peer == self.peer_id else shard
        if self.records.log is None or shard is None or (peer, joined_at) in self.joins_recorded:
            return
        self.joins_recorded.add((peer, joined_at))
        self.records.write({"kind": "join", "shard": shard, "step": joined_at, "peer": peer})

    # ---- the lobby: start, join, resume ----

    async def _first_look(self, presence: Presence) -> dict[str, int]:
        """The board before this peer's record is on it (``lobby.admit``'s first look): a peer there
        reading its --shard came first, and this one is refused before anyone sees it. Only refusals
        count here (a start or join is decided once this peer is on the board). A read that fails
        leaves the view empty: a clash is then seen on later looks, and settled by id. Returns the
        steps first seen, for ``_wait_for_peers``."""
        try:
            await presence.refresh(publish=False)
        except ConnectionError as exc:
            log.info("first board read failed (%s)", exc)
        return lobby.admit(presence.view, self._seat(), None)[1]

    async def _wait_for_peers(
        self, stop: asyncio.Event, board: Board, first: dict[str, int]
    ) -> lobby.Start | lobby.Join:
        """Block until this peer can train, and settle its data shard: ``Join`` when the run is under
        way, ``Start`` once --workers peers of this run are live (it starts with them). ``first``: peer
        -> the step its record showed when first read here, from the earlier looks."""
        assert self.presence is not None
        deadline = time.monotonic() + self.opts.wait_peers_s
        while True:
            decision, first = lobby.admit(self.presence.view, self._seat(), first)
            if isinstance(decision, lobby.Mismatch):
                infos = await board.run_infos()
                raise lobby.mismatch_error(self._seat(), decision.peer, self.options, infos)
            if isinstance(decision, lobby.Join):
                if self.resume is not None:  # its data shard stays; its state is behind the swarm's
                    log.warning(
                        "the swarm went on without this peer: it takes the others' state, not its "
                        "checkpoint of step %d",
                        self.resume.step,
                    )
                    self.resume = None
                self.replica.shard_index = decision.shard
                return decision
            if decision.live is not None:
                here = sorted(self.presence.name_of(p) for p in decision.live if p != self.peer_id)
                self.progress.waiting([self.name, *here], self.cfg.workers)
            if isinstance(decision, lobby.Start):
                self.replica.shard_index = decision.shard
                view, live = self.presence.view, decision.live
                self._sync_with(lobby.starting_shape(view, live, self.proposed))
                if decision.resume_step is not None:
                    self._resume_at(decision.resume_step)
                else:  # a checkpoint holds its run's pace
                    start_paced(self.replica, lobby.starting_pace(view, live, self.proposed_pace))
                return decision
            self._check_wait(stop, deadline, decision.reason)
            await self.presence.look(LOBBY_LOOK_S)

    def _sync_with(self, shape: tuple[int, int]) -> None:
        """Train with τ, N = ``shape``, the run's (before the first step, or taking a state)."""
        self.sync_shape = shape
        if shape == (self.settings.overlap, self.settings.transmissions):
            return
        if shape != self.proposed:
            log.warning(
                "the swarm syncs with --overlap %d --transmissions %d (this peer worked out %d and %d)",
                *shape,
                *self.proposed,
            )
        self.settings = self.cfg.algo_settings(overlap=shape[0], transmissions=shape[1])
        self.replica.sync_with(self.settings)

    def _resume_at(self, step: int) -> None:
        """A whole swarm restarted with --resume goes on from ``step``: this peer's checkpoint of it."""
        assert self.resume is not None and self.cfg.checkpoint_dir is not None
        if step != self.resume.step:
            found = dict(committed(Path(self.cfg.checkpoint_dir)))
            if step not in found:
                raise UserError(
                    f"the swarm resumes after step {step}, and --checkpoint-dir {self.cfg.checkpoint_dir} "
                    "no longer holds that checkpoint: resume with the checkpoint folders the run wrote"
                )
            self.resume = read_checkpoint(found[step], self.cfg.computing_options())
        self.resume.restore(self.replica.load_state)
        log.warning("resuming the run after step %d from %s", self.step, self.resume.path)

    async def _wait_for_start(self, stop: asyncio.Event, live: tuple[str, ...]) -> lobby.Left | None:
        """Start step 1 only once every peer shows 'training': then all agree on each round's leader.
        ``Left`` (back to the lobby) when a peer of ``live``, the starting set, left before."""
        assert self.presence is not None
        deadline = time.monotonic() + self.opts.wait_peers_s
        while (waiting := lobby.started(self.presence.view, self._seat(), live)) is not None:
            if isinstance(waiting, lobby.Left):
                return waiting
            self._check_wait(stop, deadline, waiting.reason)
            await self.presence.look(LOBBY_LOOK_S)
        return None

    def _on_signal(self, sig: signal.Signals, stop: asyncio.Event) -> None:
        """SIGINT or SIGTERM: the peer stops, and exits with 128 + the first signal's number. A
        second signal changes nothing: the stop under way still writes the summary and --save."""
        if self.replica.stopped_by is None:
            self.replica.stopped_by = sig.name
            log.warning("stopping on %s", sig.name)
        else:
            log.warning("%s: already stopping (on %s)", sig.name, self.replica.stopped_by)
        stop.set()

    def _check_stop(self, stop: asyncio.Event, where: str) -> None:
        check_stop(stop, self.replica.stopped_by, where)

    def _check_wait(self, stop: asyncio.Event, deadline: float, what: str, where: str = WAITING) -> None:
        assert self.presence is not None
        self.presence.check()
        self._check_stop(stop, where)
        if time.monotonic() > deadline:
            raise UserError(
                f"{what} run {self.opts.run_id!r} within {self.opts.wait_peers_s:.0f} s "
                "(--wait-peers); start the others, or lower --workers"
            )

    async def _take_state(self) -> None:
        """Take the swarm's shared state at the end of a step S from live peers and go on from
        there (``swarm/state_transfer.py``): a peer joining a run under way, or one that fell out of
        it. Until it has, its record says "joining": no round counts on it. The syncs in flight at
        S it did not take part in; it fetches their averages and applies them when they are due,
        like every other peer."""
        presence, replica, stop = self.presence, self.replica, self.replica.stop
        assert presence is not None
        # a peer taking the state again has trained, and stops without a summary (not the swarm's θ̄)
        where = (
            f"while joining, {BEFORE_TRAINING}"
            if replica.train_started is None
            else f"while taking the swarm's state again after step {replica.step}"
        )
        presence.resyncing()  # its θ̄ is about to be replaced by the swarm's
        replica.cancel_syncs()
        await self._become(Lifecycle.JOINING)  # the others stop counting on us at once
        self.progress.joining([])
        deadline = time.monotonic() + self.opts.wait_peers_s
        while True:
            presence.check()
            found = lobby.find_donors(presence.view, self._seat(), presence.distrusted)
            if isinstance(found, lobby.Donors):
                donors = list(found.peers)
                self._sync_with(lobby.swarm_shape(presence.view, donors) or self.proposed)
                self.progress.joining([presence.name_of(d) for d in donors])
                break
            self._check_wait(stop, deadline, found.reason, where)
            await asyncio.sleep(0.2)
        view = presence.view
        step_time = max(view[d].step_time_s for d in donors)
        # a donor's step on the board is as old as its record's refresh (``Board.due``) and our read:
        # a donor past it answers with the step it is at, and the next ask goes just beyond that
        ahead = min(max(view[d].step for d in donors) + 2, self.cfg.steps)
        joining = replica.train_started is None
        if joining:
            lobby.check_steps_left(ahead, self._seat())  # before a pull that leaves nothing to train
        try:
            # a donor may take minutes to answer (it waits to reach the step asked, or it is stopped):
            # a signal must not wait for it
            run = (self.p2p, self.opts.run_id, self.fingerprint)
            pull = pull_state(*run, donors, ahead, step_time, self.cfg.steps, self.cfg.bandwidth_mbps)
            pulled = await unless_stopped(pull, stop, lambda: self._check_stop(stop, where))
        except StateUnavailable as exc:
            raise UserError(f"could not take the swarm's state in run {self.opts.run_id!r}: {exc}") from None
        if joining:  # a peer taking the state again may take the run's last one: it ends with the swarm's θ̄
            lobby.check_steps_left(pulled.step, self._seat())
        replica.join_from(pulled.state, pulled.step)
        presence.took_state(pulled.donors, pulled.step)
        if took_state(pulled, len(replica.pending), presence.swarm_step()):
            replica.catching_up = self._caught_up
            return
        await self._become(Lifecycle.TRAINING)
        self._record_join(self.peer_id, replica.joined_at)

    async def _caught_up(self) -> None:
        """A joiner that was catching up has reached the swarm's step: from now on it trains with it."""
        await self._become(Lifecycle.TRAINING)
        self._record_join(self.peer_id, self.replica.joined_at)


def took_state(pulled: Pulled, in_flight: int, swarm: tuple[int, float] | None) -> bool:
    """Say that this peer took the swarm's state; whether it is far enough behind the swarm
    (``swarm``: its furthest step and step time, ``Presence.swarm_step``) to catch up untrained."""
    took = (
        f"took the swarm's state at the end of step {pulled.step} from {len(pulled.donors)} donors "
        f"({', '.join(d[:12] for d in pulled.donors)}): {pulled.num_bytes / 1e6:.1f} MB in "
        f"{pulled.seconds:.1f} s; fetching the {in_flight} syncs in flight"
    )
    lead, step_s = (swarm[0] - pulled.step, swarm[1]) if swarm is not None else (0, 0.0)
    if lead * step_s <= CATCH_UP_S:
        log.warning("%s", took)
        return False
    log.warning(
        "%s. The swarm is %d steps (%.0f s) further: this peer catches up on its rounds' averages, "
        "untrained and counted on by no round, and trains with it from the step it reaches it",
        took,
        lead,
        lead * step_s,
    )
    return True


def first_step_time(setup: TrainingSetup, step_time: float | None, min_step_s: float) -> float | None:
    """The step time a replica starts with, on the board before step 1: ``step_time`` (auto's
    measurement, or --step-time). With --inner-share auto, which chooses its share for step 1 from
    its own and the others' (it trained every step until their first records came, and they waited
    for it), measured now if not yet, a --min-step-time floor included as in its steps."""
    if setup.cfg.inner_shares() is not None:
        return step_time
    return max(step_time if step_time is not None else setup.step_time(), min_step_s)


def check_stop(stop: asyncio.Event, stopped_by: str | None, where: str) -> None:
    """Stopped (exit code 128 + the signal) once a SIGINT or SIGTERM came: the peer stops ``where``."""
    if stop.is_set():
        sig = signal.Signals[stopped_by or "SIGINT"]
        raise Stopped(f"stopped by {sig.name} {where}", 128 + sig)


async def unless_stopped(work: Awaitable[T], stop: asyncio.Event, stopped: Callable[[], None]) -> T:
    """``work``'s result; given up (cancelled) when ``stop`` is set first, then ``stopped()`` (which
    raises Stopped)."""
    task = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # its streams closed before the peer shuts p2p down
    if task.cancelled():
        stopped()
    return task.result()


@contextmanager
def stop_signals_to(
    loop: asyncio.AbstractEventLoop, handler: Callable[[signal.Signals], None]
) -> Iterator[None]:
    """Inside, SIGINT and SIGTERM call ``handler(sig)`` on ``loop``; after, the caller's handlers
    are back, never the default action in between. Python handlers that schedule ``handler``, not
    the loop's ``add_signal_handler``: removing that one puts the default action back until the
    caller's is set again, and a second SIGTERM in that gap ended the peer by the signal (-15).
    System calls restart after them (``siginterrupt(sig, False)``, as the loop's own handlers do):
    torch's start of its shared-memory manager (in ``start_dht``) spins for ever on a read that
    a signal interrupted (EINTR), and the peer then never saw the signal."""

    def schedule(signum: int, frame: Any) -> None:
        loop.call_soon_threadsafe(handler, signal.Signals(signum))

    previous = {sig: signal.signal(sig, schedule) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        signal.siginterrupt(sig, False)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, signal.SIG_DFL if old is None else old)
