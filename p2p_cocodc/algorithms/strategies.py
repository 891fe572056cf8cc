"""The strategies: what one replica does around its inner steps. Both drivers call them the same way
(``run/loop.py``), whatever the algorithm: every strategy, ddp's included, is a ``ReplicaStrategy``.

After inner step t a driver calls, in this order::

    for p in strategy.due(t):        apply(p, averaged Δ_p, t)   # results whose time has come
    for p in strategy.sends_after(t): exchange payload(p, t)      # start the fragment's sync
    for p in strategy.due(t):        apply(p, averaged Δ_p, t)   # τ = 0: the sync just started

The averaged Δ_p is the mean over replicas of the payloads; a driver gets it however it can (in
memory, or over the swarm). Schedules only depend on data every replica holds identically, so all
replicas send the same fragments at the same steps.

A strategy whose ``averages_gradients`` is true (ddp) syncs no fragments: its replicas' gradients
are averaged between backward and the optimizer step of every inner step instead
(``gradient_payload`` → the average → ``apply_gradients``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from p2p_cocodc.algorithms.codecs import Codec, SyncCodecs, get_codec
from p2p_cocodc.algorithms.compensation import compensate_per_step, compensate_per_tensor
from p2p_cocodc.algorithms.devices import DeviceCopy, Placement
from p2p_cocodc.algorithms.fragments import Fragment, make_fragments
from p2p_cocodc.algorithms.outer import OuterOptimizer, OuterSettings, OuterStep
from p2p_cocodc.algorithms.schedules import (
    AdaptiveSchedule,
    FixedSchedule,
    RoundCost,
    Schedule,
    delta_rms,
    paced_codec_spacing,
    paced_spacing,
)
from p2p_cocodc.algorithms.state import expect_tensor
from p2p_cocodc.errors import UserError
from p2p_cocodc.names import ALGORITHMS, DC_RULES


@dataclass(frozen=True)
class AlgoSettings:
    """Everything the core needs to know about the algorithm; validated on construction."""

    algo: str = "cocodc"
    inner_steps: int = 48
    fragments: int = 4
    pattern: str = "strided"
    overlap: int = 12
    alpha: float = 0.5
    dc_lambda: float = 1.0
    dc_rule: str = "tensor"
    dc_lambda_max: float = 10.0
    dc_wd_debias: bool = False
    dc_alpha: float = 0.5
    transmissions: int = 4
    outer: OuterSettings = field(default_factory=OuterSettings)

    def __post_init__(self) -> None:
        if self.algo not in ALGORITHMS:
            raise UserError(f"unknown --algo {self.algo!r}: use one of {', '.join(ALGORITHMS)}")
        if self.dc_rule not in DC_RULES:
            raise UserError(f"unknown --dc-rule {self.dc_rule!r}: use one of {', '.join(DC_RULES)}")
        if self.inner_steps < 1:
            raise UserError(f"--inner-steps must be ≥ 1, got {self.inner_steps}")
        if self.overlap < 0 or (self.algo != "ddp" and self.overlap >= self.inner_steps):
            raise UserError(
                f"--overlap {self.overlap} must be in [0, --inner-steps {self.inner_steps}): a sync "
                "must land before the same fragment is sent again"
            )
        if self.algo == "diloco" and self.overlap:
            raise UserError("diloco blocks on every sync: use --overlap 0, or --algo streaming")
        if self.algo == "streaming" and self.inner_steps % self.fragments:
            raise UserError(
                f"streaming needs --inner-steps ({self.inner_steps}) divisible by --fragments "
                f"({self.fragments}) so each fragment syncs every H steps at its own offset"
            )
        if self.algo == "cocodc" and not 1 <= self.transmissions <= self.inner_steps:
            raise UserError(
                f"--transmissions {self.transmissions} must be between 1 and --inner-steps "
                f"{self.inner_steps} (one send slot every ⌊H/N⌋ steps)"
            )
        for name, value in (("alpha", self.alpha), ("dc-alpha", self.dc_alpha)):
            if not 0.0 <= value <= 1.0:
                raise UserError(f"--{name} must be in [0, 1], got {value}")
        if self.dc_lambda < 0 or self.dc_lambda_max < 0:
            raise UserError("--dc-lambda and --dc-lambda-max must be ≥ 0")
        o = self.outer
        if o.lr <= 0 or not 0 <= o.momentum < 1 or o.gap_penalty <= 0:
            raise UserError(
                "outer optimizer needs --outer-lr > 0, --outer-momentum in [0, 1), --gap-penalty > 0"
            )
        if o.momentum_clip is not None and o.momentum_clip <= 0:
            raise UserError(f"--momentum-clip must be > 0, got {o.momentum_clip}")


@dataclass
class PendingSync:
    """What a replica keeps for a fragment between its send and the arrival of the result: θ_p at
    the send (on the replica's device), and when it was sent and is due."""

    snapshot: torch.Tensor
    sent_step: int
    due_step: int
    residual: torch.Tensor | None = None  # error feedback: Δ_p − what was sent of it (CPU), once computed
    paced: bool = False  # sent while a link paced the swarm: encoded with ``SyncCodecs.paced``


@dataclass
class PreparedResult:
    """An averaged Δ_p turned early into the outer step it leads to (computed on the CPU, θ̄
    unchanged), with the new θ̄_p already on its way to the replica's device."""

    averaged: torch.Tensor
    outer: OuterStep
    on_device: DeviceCopy
    changes: int  # the outer optimizer's ``changes`` after the peek: stale if it moved since
    rms: float | None  # rms(averaged Δ_p), for a schedule that scores fragments by it (else None)


class ReplicaStrategy:
    """What a driver asks of one replica's algorithm, ddp's included. The defaults are those of an
    algorithm that syncs no fragments and keeps no state beyond its replica."""

    averages_gradients = False  # every inner step: gradients averaged between backward and update
    takes_state = True  # a replica may take over a live one's ``shared_state()`` (join a run under way)
    fragments: list[Fragment]  # what it syncs (none: ddp)
    in_flight: dict[int, PendingSync]  # its syncs sent and not yet applied

    def sends_after(self, step: int) -> list[int]:
        return []

    def due(self, step: int) -> list[int]:
        return []

    def close(self, step: int) -> None:
        """``step`` is the run's last (--final-sync): what an algorithm that syncs fragments does then
        (``Strategy.close``); nothing for the others."""

    def largest_round(self) -> int:
        """Values averaged in the largest round this algorithm runs."""
        raise NotImplementedError

    def send_spacing(self) -> int | None:
        """Steps between send slots now, for an algorithm whose schedule can be paced; else None."""
        return None

    def pace_from_start(self, spacing: int) -> None:
        """Send slots every ``spacing`` steps from the first step on, for an algorithm whose schedule
        can be paced; nothing for the others (their ``send_spacing`` is None)."""

    def pace_wish(
        self, round_cost: Callable[[Codec], RoundCost], step_time_s: float, settled: bool = True
    ) -> int:
        """The send-slot spacing a link keeps up with where a round in codec c costs
        ``round_cost(c)`` (its link time and the time a sync takes to land), for an algorithm whose
        schedule can be paced (0: it cannot, or needs not); ``settled``: measured over enough rounds
        to narrow the pace (``paced_spacing``)."""
        return 0

    def gradient_payload(self) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not average gradients")

    def apply_gradients(self, averaged: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not average gradients")

    def global_state(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError


class Strategy(ReplicaStrategy):
    """One replica's DiLoCo-family state: θ̄ and outer momentum per fragment (fp32, on the CPU:
    ``devices.py``), syncs in flight. The replica may live on any device; ``placement`` moves
    fragments between it and the host."""

    def __init__(
        self,
        model: nn.Module,
        fragments: list[Fragment],
        schedule: Schedule,
        overlap: int,
        outer: OuterSettings,
        placement: Placement | None = None,
        codecs: SyncCodecs | None = None,
    ) -> None:
        self.model = model
        self.fragments = fragments
        self.schedule = schedule
        self.overlap = overlap
        self.placement = placement or Placement()
        self.outer = [OuterOptimizer(f.read(), outer) for f in fragments]
        self.in_flight: dict[int, PendingSync] = {}
        self.codecs = codecs if codecs is not None else SyncCodecs(get_codec("fp32"))
        self.kept_share = 0.0  # ρ: the share of its deviation from θ̄_p the merge leaves in the replica
        self.sent_after: dict[int, int] = {}  # fragment -> the step it was last sent after, in this process
        self.closed_at: int | None = None  # the run's last step, once ``close`` was called
        self.final_sends: list[int] = []  # what ``close`` has left to send at the last step

    def sends_after(self, step: int) -> list[int]:
        if self.closed_at == step:  # closing rounds, one at a time: each is applied before the next
            return [self.final_sends.pop(0)] if self.final_sends else []
        return self.schedule.select(step, self.in_flight.keys())

    def close(self, step: int) -> None:
        """``step`` is the run's last: every sync in flight is due now, and ``sends_after(step)``
        then gives, one per call, every fragment not sent after ``step`` itself, each sent with τ = 0
        (a closing round), so that θ̄ ends holding every replica's training instead of leaving out
        the steps since each fragment's last sync. A fragment the schedule sent after ``step``
        holds no training that sync does not carry, so it is not sent again. One at a time: a paced
        link carries one round at once, and a round's deadlines assume the link is its own."""
        sent_now = {p for p, sent in self.sent_after.items() if sent == step}
        for p, sync in self.in_flight.items():
            sync.due_step = min(sync.due_step, step)
            if sync.sent_step == step:  # a sync a joiner took over with the state counts too
                sent_now.add(p)
        self.closed_at = step
        self.final_sends = [p for p in range(len(self.fragments)) if p not in sent_now]

    def largest_round(self) -> int:
        return max(outer.global_params.numel() for outer in self.outer)

    def payload(self, p: int, step: int) -> torch.Tensor:
        """Snapshot fragment p and return this replica's outer gradient Δ = θ̄_p − θ_p (waiting for
        the snapshot's copy to the host: a driver that must not wait uses ``send`` and
        ``outer_gradient``)."""
        return self.outer_gradient(p, self.placement.to_host(self.send(p, step)).wait())

    def send(self, p: int, step: int) -> torch.Tensor:
        """Record the sync of fragment p sent after ``step``; returns θ_p's snapshot (a new fp32
        tensor on the replica's device)."""
        if p in self.in_flight:
            raise RuntimeError(f"fragment {p} is already in flight")
        snapshot = self.fragments[p].read()
        closing = self.closed_at == step  # a closing round (``close``) is applied at once: τ = 0
        due = step if closing else step + self.schedule.overlap(self.overlap)
        self.in_flight[p] = PendingSync(snapshot, step, due, paced=self.schedule.bandwidth_paced())
        self.sent_after[p] = step
        self.schedule.record_send(p, step)
        return snapshot

    def outer_gradient(self, p: int, snapshot: torch.Tensor) -> torch.Tensor:
        """Δ_p = θ̄_p − θ_p on the CPU, from a host copy of the snapshot ``send`` returned (θ̄_p does
        not move while p is in flight, so this may run after the send, and again with the same
        result).

        With error feedback (a lossy codec C): what is sent is C(Δ_p), and e_p = Δ_p − C(Δ_p), what
        the codec left out, stays in the replica: ``apply`` merges as without it, then
        θ_p ← θ_p − (1 − ρ)·e_p, where ρ is the share of the replica's deviation from θ̄_p that the
        merge itself keeps (diloco 0, streaming α, cocodc --dc-alpha). The replica is then e_p
        further from θ̄_p than the merge alone leaves it, so the next Δ_p = θ̄_p − θ_p holds e_p
        and the codec's error is sent later instead of lost, while the replica trains on from its
        own progress. A sync that fails changes nothing: Δ_p still holds everything."""
        delta = self.outer[p].global_params - snapshot
        codec = self.sync_codec(p)
        if not self.codecs.feeds_back(codec):
            return delta
        sent = codec.roundtrip(delta)
        self.in_flight[p].residual = delta.sub_(sent)
        return sent

    def next_codec(self) -> Codec:
        """The wire codec of a sync sent now (``SyncCodecs``: the paced one while a link paces the
        swarm)."""
        return self.codecs.at(self.schedule.bandwidth_paced())

    def sync_codec(self, p: int) -> Codec:
        """The wire codec of fragment p's sync in flight: the paced one (``SyncCodecs``) if it was
        sent while a link paced the swarm."""
        return self.codecs.at(self.in_flight[p].paced)

    def due(self, step: int) -> list[int]:
        """Fragments whose result must be applied now, in the order they were sent."""
        ready = [(s.due_step, p) for p, s in self.in_flight.items() if s.due_step <= step]
        return [p for _, p in sorted(ready)]

    def prepare(self, p: int, averaged: torch.Tensor) -> PreparedResult:
        """The outer step an averaged Δ_p leads to, computed now without changing θ̄, the new θ̄_p's
        copy to the device started, and rms(Δ_p) for an adaptive schedule: what ``apply`` does
        first, for a driver that gets the result before it is due and must not spend the training
        thread's (or its event loop's) time on it."""
        outer = self.outer[p]
        step = outer.peek(averaged)
        on_device = self.placement.to_device(step.global_params)
        score = delta_rms(averaged) if self.schedule.scores_results else None
        return PreparedResult(averaged, step, on_device, outer.changes, score)

    def apply(self, p: int, averaged: torch.Tensor | PreparedResult, step: int, spacing: int = 0) -> None:
        """Outer step on θ̄_p with the averaged Δ_p (or the step ``prepare`` computed from it), then
        fold the new global into the replica, on its device. ``spacing`` > 0: the send-slot
        spacing agreed with this result (a swarm's pace), taken by the schedule from the next slot
        on."""
        if not isinstance(averaged, PreparedResult):
            averaged = self.prepare(p, averaged)
        elif averaged.changes != self.outer[p].changes:  # θ̄_p changed, or was peeked, since: again
            averaged = self.prepare(p, averaged.averaged)
        pending = self.in_flight.pop(p)
        self.outer[p].take(averaged.outer)
        fragment = self.fragments[p]
        merged = self.merge(fragment, averaged.on_device.get(), pending, step)
        if pending.residual is not None:  # None: no error feedback, or a sync this replica took over
            merged = merged.sub(pending.residual.to(merged.device), alpha=1.0 - self.kept_share)  # may be θ̄
        fragment.write(merged)
        self.schedule.record_result(p, averaged.rms)
        if spacing:
            self.schedule.set_spacing(spacing, step)

    def abandon(self, p: int) -> None:
        """The sync of fragment p failed: θ̄_p and the replica stay as they are, p may be sent again.

        Consistent across replicas as long as every replica abandons the same syncs."""
        self.in_flight.pop(p)

    def merge(
        self, fragment: Fragment, new_global: torch.Tensor, pending: PendingSync, step: int
    ) -> torch.Tensor:
        """DiLoCo: the replica restarts from the new global fragment."""
        return new_global

    def global_state(self) -> dict[str, torch.Tensor]:
        """θ̄ as a state dict (model order) on the CPU, for evaluation and the run's fingerprint."""
        values: dict[str, torch.Tensor] = {}
        for fragment, outer in zip(self.fragments, self.outer, strict=True):
            chunks = fragment.per_tensor(outer.global_params)
            for name, param, chunk in zip(fragment.names, fragment.params, chunks, strict=True):
                values[name] = chunk.view_as(param)
        return {k: values[k] if k in values else v.detach().cpu() for k, v in self.model.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        """Everything this object adds to the replica, to resume bit-exactly: ``shared_state()``
        with each sync in flight's snapshot added, and with error feedback its residual e_p once
        computed. The replica's own parameters belong to its InnerTrainer, and the averaged results a
        driver holds for the syncs in flight belong to the driver. Tensors are the live ones, not
        copies."""
        state = self.shared_state()
        for sync, pending in zip(state["in_flight"], self.in_flight.values(), strict=True):
            sync["snapshot"] = pending.snapshot
            if pending.residual is not None:
                sync["residual"] = pending.residual
        return state

    def shared_state(self) -> dict[str, Any]:
        """What every replica of a run holds identically after a step, and a joiner takes over:
        ``{"outer": [{"global_params", "momentum"} per fragment], "schedule": the schedule's
        state, "in_flight": [{"fragment", "sent_step", "due_step", "paced"} per sync, in send
        order]}``,
        tensors and plain values only. The snapshots of the syncs in flight are left out: each
        replica's own θ_p at the send. Tensors are the live ones, not copies."""
        return {
            "outer": [outer.state_dict() for outer in self.outer],
            "schedule": self.schedule.state_dict(),
            "in_flight": [
                {"fragment": p, "sent_step": s.sent_step, "due_step": s.due_step, "paced": s.paced}
                for p, s in self.in_flight.items()
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take over a ``state_dict()`` of a strategy of the same algorithm and fragment split."""

        def saved_snapshot(p: int, sync: dict[str, Any]) -> torch.Tensor:
            like = self.outer[p].global_params
            value = sync["snapshot"]
            value = value.cpu() if isinstance(value, torch.Tensor) else value
            saved = expect_tensor(value, like, f"snapshot of fragment {p}")
            return saved.to(self.placement.device, copy=True)

        self._load_shared(state, saved_snapshot)
        for sync in state["in_flight"]:
            if self.codecs.feedback and sync.get("residual") is not None:
                p = sync["fragment"]
                residual = expect_tensor(
                    sync["residual"], self.outer[p].global_params, f"residual of fragment {p}"
                )
                self.in_flight[p].residual = residual.clone()

    def join_from(self, shared: dict[str, Any]) -> None:
        """Become a replica that joins the run after step S, given a ``shared_state()`` taken then.

        θ̄ and the outer momentum and the schedule are taken over, and the replica's parameters are
        set to θ̄ (θ ← θ̄ for every fragment): the joiner starts from the global model. The syncs in
        flight at S are taken over with snapshot θ̄_p at S: the joiner did not send them, so when
        their averaged Δ_p arrives it applies it like any sync in flight, z_p = outer step of θ̄_p,
        merged against its local progress since S (g = θ̄_p(S) − θ_p(now) for CoCoDC). The inner
        optimizer is not part of it: the caller builds this strategy on a fresh replica. Everything
        taken is copied, so ``shared`` may hold a live replica's tensors; ValueError if it does not
        fit."""
        self._load_shared(
            shared, lambda p, sync: self.outer[p].global_params.to(self.placement.device, copy=True)
        )
        for fragment, outer in zip(self.fragments, self.outer, strict=True):
            fragment.write(outer.global_params)

    def _load_shared(
        self, state: dict[str, Any], snapshot_of: Callable[[int, dict[str, Any]], torch.Tensor]
    ) -> None:
        """Load the outer optimizers, the schedule and the syncs in flight (the snapshot of a sync
        from ``snapshot_of(fragment, sync record)``); ValueError if ``state`` does not fit."""
        if len(state["outer"]) != len(self.outer):
            raise ValueError(
                f"the state has {len(state['outer'])} fragments, this strategy {len(self.outer)}"
            )
        for outer, saved in zip(self.outer, state["outer"], strict=True):
            outer.load_state_dict(saved)
        self.schedule.load_state_dict(state["schedule"])
        in_flight: dict[int, PendingSync] = {}
        for sync in state["in_flight"]:
            p = sync["fragment"]
            if not isinstance(p, int) or not 0 <= p < len(self.outer) or p in in_flight:
                raise ValueError(f"a sync in flight names fragment {p!r}")
            paced = sync.get("paced", False)  # absent from the state of an earlier release: unpaced
            if not isinstance(paced, bool):
                raise ValueError(f"the sync in flight of fragment {p} says paced={paced!r}")
            sent, due = int(sync["sent_step"]), int(sync["due_step"])
            in_flight[p] = PendingSync(snapshot_of(p, sync), sent, due, paced=paced)
        self.in_flight = in_flight


class Streaming(Strategy):
    """Streaming DiLoCo: θ_p ← α·θ_p(now) + (1 − α)·z_p."""

    def __init__(
        self,
        model: nn.Module,
        fragments: list[Fragment],
        settings: AlgoSettings,
        placement: Placement | None = None,
        codecs: SyncCodecs | None = None,
    ) -> None:
        schedule = FixedSchedule(settings.inner_steps, len(fragments))
        super().__init__(model, fragments, schedule, settings.overlap, settings.outer, placement, codecs)
        self.alpha = self.kept_share = settings.alpha

    def merge(
        self, fragment: Fragment, new_global: torch.Tensor, pending: PendingSync, step: int
    ) -> torch.Tensor:
        return torch.lerp(new_global, fragment.read(), self.alpha)


class CoCoDC(Strategy):
    """CoCoDC: adaptive transmission plus Taylor delay compensation of the local progress."""

    def __init__(
        self,
        model: nn.Module,
        fragments: list[Fragment],
        settings: AlgoSettings,
        decay_between: Callable[[int, int], float] | None = None,
        placement: Placement | None = None,
        codecs: SyncCodecs | None = None,
    ) -> None:
        self.schedule: AdaptiveSchedule = AdaptiveSchedule(
            settings.inner_steps, len(fragments), settings.transmissions
        )
        super().__init__(model, fragments, self.schedule, settings.overlap, settings.outer, placement, codecs)
        self.settings = settings
        self.kept_share = settings.dc_alpha
        self.decay_between = decay_between
        if settings.dc_wd_debias and decay_between is None:
            raise ValueError("weight-decay debias needs the inner LR schedule (decay_between)")

    def send_spacing(self) -> int | None:
        return self.schedule.spacing

    def pace_from_start(self, spacing: int) -> None:
        """Send slots every ``spacing`` steps from the first step on: the pace a swarm agreed before
        it started (``peer/lobby.py``: ``starting_pace``), so that its first syncs are paced too."""
        self.schedule.set_spacing(spacing)

    def pace_wish(
        self, round_cost: Callable[[Codec], RoundCost], step_time_s: float, settled: bool = True
    ) -> int:
        base, spacing, steps = self.schedule.base_spacing, self.schedule.spacing, self.settings.inner_steps
        steady, coarse = round_cost(self.codecs.steady), self.codecs.paced
        if coarse is None:
            busy, landing = steady
            return paced_spacing(base, steps, busy, step_time_s, spacing, settled, self.overlap, landing)
        return paced_codec_spacing(
            base, steps, steady, round_cost(coarse), step_time_s, spacing, settled, self.overlap
        )

    def merge(
        self, fragment: Fragment, new_global: torch.Tensor, pending: PendingSync, step: int
    ) -> torch.Tensor:
        s = self.settings
        z = fragment.per_tensor(new_global)
        snap = fragment.per_tensor(pending.snapshot)
        current = fragment.read()
        now = fragment.per_tensor(current)
        if s.dc_rule == "tensor":
            merged = compensate_per_tensor(z, snap, now, s.dc_lambda)
        else:
            decay = None
            if s.dc_wd_debias and self.decay_between is not None:
                decay = self.decay_between(pending.sent_step, step)
            merged = compensate_per_step(
                z, snap, now, s.dc_lambda, step - pending.sent_step, s.dc_lambda_max, decay
            )
        compensated = torch.cat([m.reshape(-1) for m in merged])
        # dc_alpha damps the jump like Streaming's α: only (1 − α) of the displacement is applied.
        return torch.lerp(compensated, current, s.dc_alpha) if s.dc_alpha else compensated


class DataParallel(ReplicaStrategy):
    """The ddp baseline: gradients averaged every step; θ̄ is the (identical) replica itself. A run
    under way cannot take a new replica: nothing but the replica and its AdamW state is shared."""

    averages_gradients = True
    takes_state = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.fragments = []
        self.in_flight = {}

    def largest_round(self) -> int:
        """The whole model (every parameter, as the run's size counts them)."""
        return sum(p.numel() for p in self.model.parameters())

    def gradient_payload(self) -> torch.Tensor:
        """The replica's gradients as one fp32 vector on the CPU (ddp blocks on every step anyway)."""
        return torch.cat([p.grad.reshape(-1).float() for p in self.params]).cpu()  # type: ignore[union-attr]

    def apply_gradients(self, averaged: torch.Tensor) -> None:
        for p, chunk in zip(self.params, averaged.split([p.numel() for p in self.params]), strict=True):
            p.grad.copy_(chunk.view_as(p))  # type: ignore[union-attr]

    def global_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        """Nothing: θ̄ is the replica itself, saved with its InnerTrainer."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"ddp keeps no state of its own, got keys {sorted(state)}")


def make_strategy(
    model: nn.Module,
    settings: AlgoSettings,
    decay_between: Callable[[int, int], float] | None = None,
    placement: Placement | None = None,
    codecs: SyncCodecs | None = None,
) -> ReplicaStrategy:
    """The strategy object of one replica for ``settings.algo``; the replica lives on
    ``placement``'s device (default: the CPU). ``codecs``: the wire codecs of its syncs, and whether
    it feeds a lossy one's error back into its outer gradients (default: fp32; ddp keeps none)."""
    if settings.algo == "ddp":
        return DataParallel(model)
    if settings.algo == "diloco":
        whole_model = make_fragments(model, 1, "sequential")
        schedule = FixedSchedule(settings.inner_steps, 1)
        return Strategy(model, whole_model, schedule, 0, settings.outer, placement, codecs)
    fragments = make_fragments(model, settings.fragments, settings.pattern)
    if settings.algo == "streaming":
        return Streaming(model, fragments, settings, placement, codecs)
    return CoCoDC(model, fragments, settings, decay_between, placement, codecs)
