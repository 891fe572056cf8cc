"""An fsdp region's replica (``--region-parallel fsdp``, ``region.py``): sharded across the region's
ranks with FSDP2, and whole on rank 0's host for the peer.

``shard_model`` applies FSDP2's ``fully_shard`` per block, so each rank holds 1/G of every parameter,
of its gradient and of AdamW's moments (dim 0 cut as ``torch.chunk`` cuts it). ``HostReplica`` is
rank 0's whole copy, the model the peer's strategy reads and writes. ``Shards`` moves values
between the two, as the region's orders say, with collectives every rank runs together:

- a fragment the peer reads (a send's snapshot, a merge): every rank's parts of its parameters
  flattened into one buffer, one gather to rank 0, the whole tensors copied into the host replica;
- a fragment the peer wrote (a merge): rank 0 cuts each whole tensor into the ranks' parts, one
  flat buffer per rank, one scatter;
- both in buckets of at most ``BUCKET`` values, so rank 0's device holds at most that much of a
  fragment whole at a time (the other ranks, their parts of it);
- a whole trainer state (taking the swarm's state, a resume): parameters and buffers, then AdamW's
  moments, a tensor at a time (no buffer of the model's size on any device);
- the whole trainer state gathered to rank 0 (a checkpoint), a tensor at a time, in the format of a
  one-process trainer's ``state_dict``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from p2p_cocodc.algorithms.devices import Placement
from p2p_cocodc.algorithms.inner import InnerTrainer, adamw_groups, checked_adamw_state
from p2p_cocodc.errors import UserError

BUCKET = 1 << 26  # values one flat collective moves at most (256 MB in fp32), a larger tensor alone


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

    blocks: list[nn.Module] = []
    inside: set[int] = set()  # modules within a block already chosen (a MoE layer's experts)
    for module in model.modules():  # parents before children: the outermost layer lists
        if isinstance(module, nn.ModuleList) and id(module) not in inside:
            blocks += list(module)
            inside.update(id(m) for block in module for m in block.modules())
    for block in blocks:
        fully_shard(block)
    fully_shard(model)


class HostReplica:
    """Rank 0's whole copy of an fsdp region's replica, on the host: the model the peer's strategy
    reads and writes (snapshots, merges, the swarm's state taken), while the ranks train its shards.
    ``Region.collect`` brings parameters up to date from the shards before the peer reads them;
    what the peer writes goes to the shards with the next order. Its trainer state is the shards'
    (``state_dict`` gathers it, with ``gather_state``: an order to every rank); one loaded, or
    reset, reaches the ranks with the next order."""

    def __init__(self, model: nn.Module, gather_state: Callable[[], dict[str, Any]]) -> None:
        self.model = model
        self.gather_state = gather_state
        self.placement = Placement()  # the host
        self.adamw: dict[str, Any] | None = None  # AdamW's state to hand the ranks (None: fresh)

    def state_dict(self) -> dict[str, Any]:
        """The region's trainer state, as a one-process region's ``InnerTrainer.state_dict``."""
        return self.gather_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        params = [p.detach() for p in self.model.parameters()]
        checked_adamw_state(state["adamw"]["state"], params)
        self.adamw = state["adamw"]

    def reset(self) -> None:
        self.adamw = None


class Shards:
    """The shards of an fsdp region's replica on this rank (``trainer``, its model sharded by
    ``shard_model``), and rank 0's ``host`` replica (None on the other ranks)."""

    def __init__(self, trainer: InnerTrainer, rank: int, world: int, host: HostReplica | None) -> None:
        self.trainer = trainer
        self.rank = rank
        self.world = world
        self.host = host

    def held_bytes(self) -> int:
        """The bytes of parameters this rank's device holds: its shards."""
        return sum(p.to_local().numel() * p.element_size() for p in self._shards())

    def share(
        self, whole: bool, params: tuple[int, ...], collect: tuple[int, ...], collect_state: bool
    ) -> dict[str, Any] | None:
        """Every rank's part of an order (``region.py``'s ``Order``): the whole trainer state from
        rank 0, the parameters it changed, the parameters it reads, or the whole trainer state to
        it (then AdamW's part is returned on rank 0)."""
        if whole:
            self.scatter_model()
            self._scatter_adamw()
        shards = self._shards()
        host = list(self.host.model.parameters()) if self.host is not None else None
        if params:  # a merge's fragment: scattered from rank 0, a bucket at a time
            fulls = [host[i] for i in params] if host is not None else None
            self._scatter_fragment(fulls, [shards[i] for i in params])
        if collect:  # a fragment the peer reads: gathered to rank 0, a bucket at a time
            into = [host[i] for i in collect] if host is not None else None
            self._gather_fragment([shards[i] for i in collect], into)
        if not collect_state:
            return None
        for i, shard in enumerate(shards):  # the whole replica, a tensor at a time
            self._gather(shard, host[i] if host is not None else None)
        return self._gather_adamw()

    def _shards(self) -> list[Any]:
        return list(self.trainer.model.parameters())

    def _scatter(self, full: torch.Tensor | None, shard: Any) -> None:
        """Rank 0's ``full`` tensor (on its host; None elsewhere) into every rank's ``shard`` of it."""
        device = shard.device
        source = (
            full.detach().to(device)
            if full is not None
            else torch.empty(shard.shape, dtype=shard.dtype, device=device)
        )
        # imported here: DTensor takes half a second to import, and only an fsdp region needs it
        from torch.distributed.tensor import distribute_tensor

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
        flattened into one buffer per bucket, one gather to rank 0 per bucket (not per parameter)."""
        for bucket in self._buckets(shards):
            mine = [shards[i] for i in bucket]
            self._gather_bucket(mine, [into[i] for i in bucket] if into is not None else None)

    def _gather_bucket(self, shards: list[Any], into: list[torch.Tensor] | None) -> None:
        parts, sizes, width = self._flat_layout(shards)
        flat = torch.zeros(width, dtype=shards[0].dtype, device=shards[0].device)
        flat[: sizes[self.rank]] = torch.cat([shard.detach().to_local().reshape(-1) for shard in shards])
        everyone = [torch.empty_like(flat) for _ in range(self.world)] if into is not None else None
        dist.gather(flat, everyone, dst=0)
        if into is None or everyone is None:
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
        flat buffer per rank and bucket, one scatter per bucket."""
        for bucket in self._buckets(shards):
            mine = [shards[i] for i in bucket]
            self._scatter_bucket([fulls[i] for i in bucket] if fulls is not None else None, mine)

    def _scatter_bucket(self, fulls: list[torch.Tensor] | None, shards: list[Any]) -> None:
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

    @staticmethod
    def _buckets(shards: list[Any]) -> list[list[int]]:
        """Consecutive shards grouped so that a bucket's whole tensors hold at most ``BUCKET``
        values (a larger tensor alone): what one collective moves, and rank 0's device holds whole
        for a moment, stays bounded whatever the fragment's size."""
        buckets: list[list[int]] = []
        held = 0
        for i, shard in enumerate(shards):
            if not buckets or held + shard.numel() > BUCKET:
                buckets.append([])
                held = 0
            buckets[-1].append(i)
            held += shard.numel()
        return buckets

    def _gather(self, shard: Any, into: torch.Tensor | None) -> torch.Tensor:
        """Every rank's part of ``shard``, whole (a collective); copied ``into`` rank 0's host tensor."""
        full = shard.detach().full_tensor()
        if into is not None:
            with torch.no_grad():
                into.copy_(full)
        return full

    def scatter_model(self) -> None:
        """Rank 0's host replica, parameters and buffers, into every rank's shards."""
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
        saved = self.host.adamw if self.host is not None else None
        box = [None if saved is None else {k: float(s["step"]) for k, s in saved["state"].items()}]
        dist.broadcast_object_list(box, src=0)
        self.trainer.reset()
        if box[0] is None:
            return
        shards = self._shards()
        on_device = any(
            group.get(k) for group in self.trainer.optimizer.param_groups for k in ("fused", "capturable")
        )
        for key, step in sorted(box[0].items(), key=lambda kv: int(kv[0])):
            shard = shards[int(key)]
            moments = {}
            for name in ("exp_avg", "exp_avg_sq"):
                moment = torch.zeros_like(shard)
                self._scatter(saved["state"][key][name] if saved is not None else None, moment)
                moments[name] = moment
            count = torch.tensor(step, dtype=torch.float32, device=shard.device if on_device else "cpu")
            self.trainer.optimizer.state[shard] = {"step": count, **moments}
        if self.host is not None:
            self.host.adamw = None  # handed over: the moments live in the shards now

    def _gather_adamw(self) -> dict[str, Any] | None:
        """Every rank's AdamW moments, whole, to rank 0's host: its trainer state's "adamw" part
        (None on the other ranks)."""
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
