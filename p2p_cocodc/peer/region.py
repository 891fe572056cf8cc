"""One region's processes under torchrun: G ranks train the region's replica with data parallelism,
and rank 0 alone speaks to the swarm::

    torchrun --nproc-per-node G -m p2p_cocodc join --bootstrap HOST:PORT ... [--region-parallel fsdp]

Every rank builds the same replica (same seed; rank 0's is also sent to the others at the start)
and trains on its 1/G of each batch: ``--batch-size`` is the region's, so a region computes the same
step whatever its G (the G gradients are averaged into the batch's, to rounding). Rank 0 runs the
peer: θ̄, the outer step, the exchange, evaluation, checkpoints and records. Before each inner step
it tells the other ranks what to do with an ``Order`` (one small broadcast): the step and data shard
to train, the parameters the swarm's results changed since the last step (sent from rank 0 next, so
every rank's replica stays rank 0's), or the whole trainer state (after taking the swarm's state or
resuming), or the end. Between orders the other ranks wait; every wait has the process group's
deadline.

How the ranks hold the replica (``--region-parallel``):

- **ddp** (torch's DistributedDataParallel): every rank holds all of it, parameters, gradients and
  AdamW's moments: 16 bytes per parameter on each device. Rank 0's replica is the one the peer reads
  and writes.
- **fsdp** (FSDP2's ``fully_shard``, per block of the model's layer lists, then the whole model):
  each rank holds 1/G of the parameters, gradients and moments (16/G bytes per parameter), and
  gathers a block's parameters only while it computes with them. The peer's fragments, θ̄ and
  outer step stay as they are, on rank 0's host: rank 0 keeps the whole replica there
  (``shards.py``'s ``HostReplica``, 4 bytes per parameter of host memory beside θ̄'s). Before the
  peer reads a fragment of it (a send's snapshot, a merge), an order has the ranks gather that
  fragment's parameters into it (``collect``); what the peer writes there goes back to the shards
  with the next order, scattered from rank 0. Only the fragments a sync touches cross between host
  and devices, as in a one-process region on a GPU, where the same bytes go to the host for the
  snapshot.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from p2p_cocodc.algorithms.devices import Placement, resolve_device
from p2p_cocodc.algorithms.inner import InnerTrainer
from p2p_cocodc.config.train import TrainConfig
from p2p_cocodc.errors import UserError
from p2p_cocodc.models.data import Shard
from p2p_cocodc.names import AVERAGE_GRADIENTS
from p2p_cocodc.peer.shards import HostReplica, Shards, shard_model
from p2p_cocodc.run.checkpoint import join_state, split_state
from p2p_cocodc.run.records import params_sha256
from p2p_cocodc.run.setup import TrainingSetup

log = logging.getLogger(__name__)

WAIT_S = 1800.0  # the longest a rank waits for the others (rank 0 may wait --wait-peers, stall, evaluate)
PARALLEL = ("ddp", "fsdp")  # how a region's ranks hold its replica (module docstring)
BETWEEN = -1  # an order's step when it trains none: only what it carries, between two steps


@dataclass(frozen=True)
class Order:
    """What rank 0 tells the other ranks before each inner step (step 0: the region is done;
    ``BETWEEN``: no step, only what follows)."""

    step: int
    shard: int = -1
    params: tuple[int, ...] = ()  # indices into model.parameters() whose values follow
    whole: bool = False  # the trainer's whole state follows (model and AdamW)
    collect: tuple[int, ...] = ()  # fsdp: parameters the ranks gather into rank 0's host replica
    collect_state: bool = False  # fsdp: the whole trainer state, gathered to rank 0 (a checkpoint)
    failed: bool = False  # with step 0: rank 0 ended with an error (it said which)
    replica_sha256: str = ""  # with step 0 (ddp): rank 0's replica, which every rank's must equal


@dataclass
class Region:
    """This process's place in its region's torchrun world (``from_env``), and the collectives the
    region's ranks run together."""

    rank: int
    world: int
    local_rank: int
    parallel: str = "ddp"  # how the ranks hold the replica (PARALLEL)
    placement: Placement = field(default_factory=Placement)  # this rank's device (``start``)
    trainer: InnerTrainer | None = None  # the replica the ranks train, wrapped or sharded (``wrap``)
    shards: Shards | None = None  # an fsdp region's: this rank's shards, rank 0's host replica
    changed: set[int] = field(default_factory=set)  # rank 0: parameters changed since the last order
    whole: bool = False  # rank 0: the trainer was replaced since the last order

    @classmethod
    def from_env(cls, parallel: str = "ddp") -> Region | None:
        """The region this process is a rank of, from torchrun's variables; None outside torchrun
        (or in a world of one)."""
        try:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
        except ValueError:
            raise UserError("WORLD_SIZE, RANK and LOCAL_RANK must be integers (torchrun sets them)") from None
        if world <= 1:
            return None
        if not 0 <= rank < world:
            raise UserError(f"RANK {rank} is outside the world of WORLD_SIZE {world}")
        return cls(rank, world, local, parallel)

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def _placement_for(self, cfg: TrainConfig) -> Placement:
        """This rank's device: --device auto or cuda gives rank r the GPU cuda:LOCAL_RANK."""
        if cfg.device.startswith("cuda:"):
            raise UserError(
                f"--device {cfg.device} under torchrun: use --device cuda or auto (each rank takes the GPU "
                "cuda:LOCAL_RANK), or limit the GPUs with CUDA_VISIBLE_DEVICES"
            )
        device = resolve_device(cfg.device)
        if device.type == "cuda":
            if self.local_rank >= torch.cuda.device_count():
                raise UserError(
                    f"LOCAL_RANK {self.local_rank}, but this machine has {torch.cuda.device_count()} CUDA "
                    "devices: start at most that many processes per node (--nproc-per-node)"
                )
            device = torch.device(f"cuda:{self.local_rank}")
            torch.cuda.set_device(device)
        return Placement(device, cfg.precision)

    @contextlib.contextmanager
    def joined(self, cfg: TrainConfig, swarm: dict[str, Any]) -> Iterator[None]:
        """While open, this rank is in its region's process group (``start``); left on the way out."""
        try:
            self.start(cfg, swarm)
            yield
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    def start(self, cfg: TrainConfig, swarm: dict[str, Any]) -> None:
        """Settle this rank's device, join the region's process group and check that every rank
        was given the same options."""
        if cfg.algo in AVERAGE_GRADIENTS:
            raise UserError(
                "--algo ddp under torchrun: a ddp region would need the swarm's gradients on every rank; "
                "use a DiLoCo-family --algo, or one process per region"
            )
        if cfg.batch_size % self.world:
            raise UserError(
                f"--batch-size {cfg.batch_size} is the region's batch, cut among its {self.world} ranks: "
                f"make it a multiple of {self.world}"
            )
        self.placement = self._placement_for(cfg)
        backend = "nccl" if self.placement.device.type == "cuda" else "gloo"
        try:
            dist.init_process_group(backend, timeout=timedelta(seconds=WAIT_S))
        except (RuntimeError, ValueError) as exc:
            raise UserError(f"could not join this region's torchrun world ({exc})") from None
        mine = {**asdict(cfg), **swarm}
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, mine)
        for rank, theirs in enumerate(everyone):
            differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
            if differ:
                name = differ[0]
                raise UserError(
                    f"rank {rank} of this region was started with --{name.replace('_', '-')} "
                    f"{theirs.get(name)!r}, rank {self.rank} with {mine.get(name)!r}: give every rank the "
                    "same options"
                )

    @contextlib.contextmanager
    def leading(self) -> Iterator[None]:
        """Rank 0 while it runs the peer: on the way out, however it ends, the other ranks are told
        to stop waiting for orders (only once they wait for them: before they built their replica,
        rank 0's exit makes torchrun end them)."""
        failed = True
        try:
            yield
            failed = False
        finally:
            if self.trainer is not None:  # the others wait for orders
                try:
                    self._end(failed)
                except RuntimeError as exc:  # a rank already gone: torchrun ends the rest
                    log.warning("could not tell this region's other ranks to stop (%s)", exc)

    def _end(self, failed: bool) -> None:
        """The last order: what changed after the last step (results due at it), and (ddp) the
        hash of the replica every rank must now hold; or only that rank 0 failed."""
        if failed:
            dist.broadcast_object_list([Order(0, failed=True)], src=0)
            return
        assert self.trainer is not None
        digest = "" if self.shards is not None else params_sha256(self.trainer.model.state_dict())
        self._share(self._order(0, replica_sha256=digest))

    def wrap(self, trainer: InnerTrainer) -> InnerTrainer | HostReplica:
        """Train ``trainer``'s model over the region's ranks (a collective: every rank), wrapped in
        DDP or sharded with FSDP2; what the peer reads and writes as its replica: the trainer, or
        (rank 0 of an fsdp region) the whole replica on the host."""
        self.trainer = trainer
        if self.parallel == "ddp":  # DDP sends rank 0's parameters to the others as it starts
            device = trainer.placement.device
            device_ids = [device.index] if device.type == "cuda" else None
            trainer.set_forward(nn.parallel.DistributedDataParallel(trainer.model, device_ids=device_ids))
            return trainer
        host = HostReplica(copy.deepcopy(trainer.model).to("cpu"), self.collect_state) if self.leads else None
        shard_model(trainer.model)
        trainer.reset()  # AdamW over the shards
        trainer.set_forward(trainer.model)
        self.shards = Shards(trainer, self.rank, self.world, host)
        self.shards.scatter_model()  # every rank starts from rank 0's parameters
        return host or trainer

    def rows(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of the region's batch."""
        n = x.shape[0] // self.world
        return x[self.rank * n : (self.rank + 1) * n], y[self.rank * n : (self.rank + 1) * n]

    def mean(self, loss: torch.Tensor, device: torch.device) -> float:
        """The mean of every rank's loss: the region batch's loss."""
        value = loss.to(device, torch.float64).reshape(1)
        dist.all_reduce(value)
        return float(value) / self.world

    def summary_fields(self) -> dict[str, Any]:
        """What a region's summary record adds: its ranks, how they hold the replica, and the bytes
        of parameters rank 0's device holds (all of them with ddp, its shard with fsdp)."""
        assert self.trainer is not None
        if self.shards is not None:
            held = self.shards.held_bytes()
        else:
            held = sum(p.numel() * p.element_size() for p in self.trainer.model.parameters())
        fields = {"region_ranks": self.world, "region_parallel": self.parallel}
        return {**fields, "region_param_bytes_per_rank": held}

    # ---- rank 0 ----

    def lead_step(self, shard: int, x: torch.Tensor, y: torch.Tensor, step: int) -> float:
        """Rank 0's inner step: the order, then the changed parameters or state, then its rows."""
        self._share(self._order(step, shard))
        return self._train(x, y, step)

    def changed_params(self, tensors: list[torch.Tensor], model: nn.Module) -> None:
        """Rank 0 wrote these parameters (a fragment's merge): they go to the others with the next order."""
        self.changed.update(_indices(tensors, model))

    def collect(self, tensors: list[torch.Tensor], model: nn.Module) -> None:
        """Rank 0 is about to read these parameters of its replica: in an fsdp region, the ranks
        gather them from their shards into the host replica first (what rank 0 changed since the
        last order goes to the shards before). A DDP region's rank 0 holds its replica already."""
        if self.shards is not None:
            self._share(self._order(BETWEEN, collect=tuple(_indices(tensors, model))))

    def collect_state(self) -> dict[str, Any]:
        """An fsdp region's whole trainer state, gathered to rank 0's host: the replica's
        parameters and buffers and AdamW's moments, as a one-process region's trainer holds them."""
        assert self.shards is not None and self.shards.host is not None
        adamw = self._share(self._order(BETWEEN, collect_state=True))
        return {"model": dict(self.shards.host.model.state_dict()), "adamw": adamw}

    def _order(self, step: int, shard: int = -1, **what: Any) -> Order:
        """The next order, carrying what rank 0 changed since the last one (and forgetting it)."""
        order = Order(step, shard, tuple(sorted(self.changed)), self.whole, **what)
        self.changed, self.whole = set(), False
        return order

    # ---- ranks 1 … G-1 ----

    def follow(self, batch: Any) -> None:
        """Train as rank 0 orders until it is done; ``batch(shard, step)`` gives the region's batch.
        UserError if rank 0 ended with an error or is gone."""
        assert self.trainer is not None
        try:
            while True:
                box: list[Any] = [None]
                dist.broadcast_object_list(box, src=0)
                order = box[0]
                if not isinstance(order, Order):
                    raise UserError(f"rank 0 of this region sent {order!r}, not an order")
                if order.step == 0 and order.failed:
                    raise UserError(
                        f"rank 0 of this region failed (its output says why); rank {self.rank} stops"
                    )
                self._share(order)
                if order.step == 0:
                    self._check_replica(order.replica_sha256)
                    return
                if order.step != BETWEEN:
                    self._train(*batch(order.shard, order.step), order.step)
        except (RuntimeError, dist.DistBackendError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UserError(f"rank 0 of this region is gone ({first}); this rank stops") from None

    def _check_replica(self, expected: str) -> None:
        """A ddp rank's replica at the end must be rank 0's, bit for bit (an fsdp rank holds a shard)."""
        assert self.trainer is not None
        if not expected:
            return
        mine = params_sha256(self.trainer.model.state_dict())
        if mine != expected:
            raise UserError(
                f"rank {self.rank}'s replica ended as {mine[:16]}, rank 0's as {expected[:16]}: the "
                "region's ranks diverged (a bug)"
            )

    # ---- both ----

    def _share(self, order: Order) -> dict[str, Any] | None:
        """Every rank's part of an order: rank 0 sends it, then what it carries crosses (fsdp,
        ``collect_state``: rank 0 gets AdamW's state back)."""
        if self.leads:
            dist.broadcast_object_list([order], src=0)
        if self.shards is not None:
            return self.shards.share(order.whole, order.params, order.collect, order.collect_state)
        assert self.trainer is not None
        trainer = self.trainer
        if order.whole:  # sent as CPU tensors: each rank loads them onto its own device
            box = [split_state(trainer.state_dict()) if self.leads else None]
            dist.broadcast_object_list(box, src=0)
            if not self.leads:
                skeleton, tensors = box[0]
                trainer.load_state_dict(join_state(skeleton, tensors, Path("rank 0's trainer state")))
        params = list(trainer.model.parameters())
        with torch.no_grad():
            for i in order.params:
                dist.broadcast(params[i].data, src=0)
        return None

    def _train(self, x: torch.Tensor, y: torch.Tensor, step: int) -> float:
        assert self.trainer is not None
        loss = self.trainer.step(*self.rows(x, y), step)
        return self.mean(loss, self.trainer.placement.device)


def _indices(tensors: list[torch.Tensor], model: nn.Module) -> list[int]:
    ids = {id(t) for t in tensors}
    return [i for i, p in enumerate(model.parameters()) if id(p) in ids]


def follow_region(cfg: TrainConfig, region: Region) -> None:
    """Ranks 1 … G-1: build the region's replica and train it as rank 0 orders (``Region.follow``)."""
    setup = TrainingSetup(cfg, region.placement)
    trainer = setup.trainer()
    try:
        region.wrap(trainer)  # a collective: rank 0 joins it once its peer is set up
    except (RuntimeError, dist.DistBackendError):  # it stopped before (a dead bootstrap, a bad file)
        raise UserError(
            f"rank 0 of this region failed before training (its output says why); rank {region.rank} stops"
        ) from None
    shards: dict[int, Shard] = {}

    def batch(shard: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if shard not in shards:
            shards[shard] = setup.shard(shard, cfg.data_shards)
        return shards[shard].batch(step - 1)

    region.follow(batch)
