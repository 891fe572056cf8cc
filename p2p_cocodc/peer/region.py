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
  (``HostReplica``, 4 bytes per parameter of host memory beside θ̄'s). Before the peer reads a
  fragment of it (a send's snapshot, a merge), an order has the ranks gather that fragment's
  parameters into it (``collect``); what the peer writes there goes back to the shards with the next
  order, scattered from rank 0. Only the fragments a sync touches cross between host and devices,
  as in a one-process region on a GPU, where the same bytes go to the host for the snapshot.
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
from torch.distributed.tensor import DTensor, distribute_tensor

from p2p_cocodc.algorithms.devices import Placement, resolve_device
from p2p_cocodc.algorithms.inner import InnerTrainer, adamw_groups, checked_adamw_state
from p2p_cocodc.config.train import TrainConfig
from p2p_cocodc.errors import UserError
from p2p_cocodc.models.data import Shard
from p2p_cocodc.names import AVERAGE_GRADIENTS
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


def shard_model(model: nn.Module) -> None:
    """FSDP2 over ``model``, in place: each block of its layer lists (the transformer's layers, in
    this project's GPTs and in Hugging Face models alike) is one unit gathered at a time, and the
    rest (embeddings, final norm, head) the root's."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # public from torch 2.6
        raise UserError(
            f"--region-parallel fsdp needs FSDP2's fully_shard, in torch 2.6 and later (this is torch "
            f"{torch.__version__}): upgrade torch, or use --region-parallel ddp"
        ) from None

    for module in list(model.modules()):
        if isinstance(module, nn.ModuleList):
            for block in module:
                fully_shard(block)
    fully_shard(model)


class HostReplica:
    """Rank 0's whole copy of an fsdp region's replica, on the host: the model the peer's strategy
    reads and writes (snapshots, merges, the swarm's state taken), while the ranks train its shards.
    ``Region.collect`` brings parameters up to date from the shards before the peer reads them;
    what the peer writes goes to the shards with the next order. Its trainer state is the shards'
    (``state_dict`` gathers it); one loaded, or reset, reaches the ranks with the next order."""

    def __init__(self, model: nn.Module, region: Region) -> None:
        self.model = model
        self.region = region
        self.placement = Placement()  # the host
        self.adamw: dict[str, Any] | None = None  # AdamW's state to hand the ranks (None: fresh)

    def state_dict(self) -> dict[str, Any]:
        """The region's trainer state, as a one-process region's ``InnerTrainer.state_dict``."""
        return self.region.collect_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        params = [p.detach() for p in self.model.parameters()]
        checked_adamw_state(state["adamw"]["state"], params)
        self.adamw = state["adamw"]

    def reset(self) -> None:
        self.adamw = None


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
    host: HostReplica | None = None  # rank 0 of an fsdp region: the whole replica, on the host
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
        digest = "" if self.host is not None else params_sha256(self.trainer.model.state_dict())
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
        if self.leads:
            self.host = HostReplica(copy.deepcopy(trainer.model).to("cpu"), self)
        shard_model(trainer.model)
        trainer.reset()  # AdamW over the shards
        trainer.set_forward(trainer.model)
        self._scatter_model()  # every rank starts from rank 0's parameters
        return self.host or trainer

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
        params = [p.to_local() if isinstance(p, DTensor) else p for p in self.trainer.model.parameters()]
        held = sum(p.numel() * p.element_size() for p in params)
        return {
            "region_ranks": self.world,
            "region_parallel": self.parallel,
            "region_param_bytes_per_rank": held,
        }

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
        if self.host is not None:
            self._share(self._order(BETWEEN, collect=tuple(_indices(tensors, model))))

    def collect_state(self) -> dict[str, Any]:
        """An fsdp region's whole trainer state, gathered to rank 0's host: the replica's
        parameters and buffers and AdamW's moments, as a one-process region's trainer holds them."""
        assert self.host is not None
        adamw = self._share(self._order(BETWEEN, collect_state=True))
        return {"model": dict(self.host.model.state_dict()), "adamw": adamw}

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
        if self.parallel == "fsdp":
            return self._share_shards(order)
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

    # ---- fsdp: shards on the devices, the whole replica on rank 0's host ----

    def _share_shards(self, order: Order) -> dict[str, Any] | None:
        if order.whole:
            self._scatter_model()
            self._scatter_adamw()
        shards = self._shards()
        host = list(self.host.model.parameters()) if self.host is not None else None
        if order.params:  # a merge's fragment: one scatter
            fulls = [host[i] for i in order.params] if host is not None else None
            self._scatter_fragment(fulls, [shards[i] for i in order.params])
        if order.collect:  # a fragment the peer reads: one all-gather
            into = [host[i] for i in order.collect] if host is not None else None
            self._gather_fragment([shards[i] for i in order.collect], into)
        if not order.collect_state:
            return None
        for i, shard in enumerate(shards):  # the whole replica, a tensor at a time
            self._gather(shard, host[i] if host is not None else None)
        return self._gather_adamw()

    def _shards(self) -> list[Any]:
        assert self.trainer is not None
        return list(self.trainer.model.parameters())

    def _scatter(self, full: torch.Tensor | None, shard: Any) -> None:
        """Rank 0's ``full`` tensor (on its host; None elsewhere) into every rank's ``shard`` of it."""
        device = shard.device
        source = (
            full.detach().to(device)
            if full is not None
            else torch.empty(shard.shape, dtype=shard.dtype, device=device)
        )
        piece = distribute_tensor(source, shard.device_mesh, shard.placements)  # from rank 0
        with torch.no_grad():
            shard.to_local().copy_(piece.to_local())

    def _parts(self, shard: Any) -> list[torch.Size]:
        """The shape of each rank's part of ``shard``: FSDP2 cuts dim 0 as ``torch.chunk`` does,
        and ranks past the last chunk hold empty parts."""
        chunks = [c.shape for c in torch.chunk(torch.empty(shard.shape, device="meta"), self.world, dim=0)]
        return chunks + [torch.Size((0, *shard.shape[1:]))] * (self.world - len(chunks))

    def _flat_layout(self, shards: list[Any]) -> tuple[list[list[torch.Size]], list[int], int]:
        """Each shard's parts per rank, each rank's total numel, and the widest (the buffers' size)."""
        parts = [self._parts(shard) for shard in shards]
        sizes = [sum(p[r].numel() for p in parts) for r in range(self.world)]
        for shard, p in zip(shards, parts, strict=True):
            if shard.to_local().shape != p[self.rank] or shard.dtype != shards[0].dtype:
                raise RuntimeError(f"a shard of {tuple(shard.shape)} is not cut as FSDP2's dim-0 chunks")
        return parts, sizes, max(sizes)

    def _gather_fragment(self, shards: list[Any], into: list[torch.Tensor] | None) -> None:
        """A fragment's parameters, whole, copied ``into`` rank 0's host tensors: every rank's parts
        flattened into one buffer, one all-gather (a collective per fragment, not per parameter)."""
        parts, sizes, width = self._flat_layout(shards)
        flat = torch.zeros(width, dtype=shards[0].dtype, device=shards[0].device)
        flat[: sizes[self.rank]] = torch.cat([shard.detach().to_local().reshape(-1) for shard in shards])
        everyone = [torch.empty_like(flat) for _ in range(self.world)]
        dist.all_gather(everyone, flat)
        if into is None:
            return
        cut = [
            buffer[:size].split([p[r].numel() for p in parts])
            for r, (buffer, size) in enumerate(zip(everyone, sizes, strict=True))
        ]
        with torch.no_grad():
            for i, (target, p) in enumerate(zip(into, parts, strict=True)):
                target.copy_(torch.cat([cut[r][i].view(p[r]) for r in range(self.world)]))

    def _scatter_fragment(self, fulls: list[torch.Tensor] | None, shards: list[Any]) -> None:
        """Rank 0's whole tensors of a fragment (None elsewhere) into every rank's parts of them: one
        flat buffer per rank, one scatter."""
        parts, sizes, width = self._flat_layout(shards)
        dtype, device = shards[0].dtype, shards[0].device
        mine = torch.empty(width, dtype=dtype, device=device)
        sent = None
        if fulls is not None:
            pieces = [
                full.detach().split([p[r][0] for r in range(self.world)])
                for full, p in zip(fulls, parts, strict=True)
            ]
            sent = [torch.zeros(width, dtype=dtype, device=device) for _ in range(self.world)]
            for r, buffer in enumerate(sent):
                buffer[: sizes[r]] = torch.cat([piece[r].reshape(-1) for piece in pieces]).to(device)
        dist.scatter(mine, sent, src=0)
        with torch.no_grad():
            for shard, piece, p in zip(
                shards,
                mine[: sizes[self.rank]].split([p[self.rank].numel() for p in parts]),
                parts,
                strict=True,
            ):
                shard.to_local().copy_(piece.view(p[self.rank]))

    def _gather(self, shard: Any, into: torch.Tensor | None) -> torch.Tensor:
        """Every rank's part of ``shard``, whole (a collective); copied ``into`` rank 0's host tensor."""
        full = shard.detach().full_tensor()
        if into is not None:
            with torch.no_grad():
                into.copy_(full)
        return full

    def _scatter_model(self) -> None:
        """Rank 0's host replica, parameters and buffers, into every rank's shards."""
        assert self.trainer is not None
        host = self.host.model if self.host is not None else None
        sources = list(host.parameters()) if host is not None else [None] * len(self._shards())
        for source, shard in zip(sources, self._shards(), strict=True):
            self._scatter(source, shard)
        mine = list(self.trainer.model.buffers())
        theirs = list(host.buffers()) if host is not None else mine
        for buffer, source in zip(mine, theirs, strict=True):
            sent = source.to(buffer.device) if host is not None else buffer
            dist.broadcast(sent, src=0)
            buffer.copy_(sent)

    def _scatter_adamw(self) -> None:
        """A fresh AdamW on every rank, then rank 0's host replica's AdamW moments (if it holds
        any: a checkpoint's, or a resumed run's) into each rank's shards of them."""
        assert self.trainer is not None
        saved = self.host.adamw if self.host is not None else None
        box = [None if saved is None else {k: float(s["step"]) for k, s in saved["state"].items()}]
        dist.broadcast_object_list(box, src=0)
        self.trainer.reset()
        if box[0] is None:
            return
        shards = self._shards()
        for key, step in sorted(box[0].items(), key=lambda kv: int(kv[0])):
            shard = shards[int(key)]
            moments = {}
            for name in ("exp_avg", "exp_avg_sq"):
                moment = torch.zeros_like(shard)
                self._scatter(saved["state"][key][name] if saved is not None else None, moment)
                moments[name] = moment
            on_device = any(
                group.get(k) for group in self.trainer.optimizer.param_groups for k in ("fused", "capturable")
            )
            count = torch.tensor(step, dtype=torch.float32, device=shard.device if on_device else "cpu")
            self.trainer.optimizer.state[shard] = {"step": count, **moments}

    def _gather_adamw(self) -> dict[str, Any] | None:
        """Every rank's AdamW moments, whole, to rank 0's host: its trainer state's "adamw" part
        (None on the other ranks)."""
        assert self.trainer is not None
        optimizer = self.trainer.optimizer
        state = {}
        for i, shard in enumerate(self._shards()):
            kept = optimizer.state.get(shard)
            if not kept:
                continue
            state[str(i)] = {
                "step": kept["step"].detach().to("cpu", copy=True),
                **{n: self._gather(kept[n], None).to("cpu") for n in ("exp_avg", "exp_avg_sq")},
            }
        if self.host is None:
            return None
        return {"state": state, "param_groups": adamw_groups(optimizer)}


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
