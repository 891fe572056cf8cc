"""What every driver builds the same way from one config: data, model, replicas, evaluation.

The simulator builds M replicas from it and a peer builds one; because both go through here, peer i
of a swarm and worker i of a simulation start from identical weights and read identical batches.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from p2p_cocodc.algorithms.codecs import Codec, SyncCodecs, get_codec
from p2p_cocodc.algorithms.devices import Placement
from p2p_cocodc.algorithms.fragments import make_fragments
from p2p_cocodc.algorithms.inner import InnerTrainer, evaluate
from p2p_cocodc.algorithms.strategies import AlgoSettings, ReplicaStrategy, make_strategy
from p2p_cocodc.config.derived import Link
from p2p_cocodc.config.train import AUTO, TrainConfig
from p2p_cocodc.errors import UserError
from p2p_cocodc.models.build import build_model, count_parameters
from p2p_cocodc.models.data import Shard, load_corpus, load_tokenizer, tokenize_corpus, validation_batches
from p2p_cocodc.models.hf import hf_tokenizer, is_hf_model
from p2p_cocodc.models.saved import save_model
from p2p_cocodc.run.records import params_sha256, perplexity

log = logging.getLogger(__name__)


class TrainingSetup:
    """Tokenized data, the initial model (seeded, on the CPU), optimizer settings, codec, validation
    batches, and where replicas compute (``placement``: --device and --precision, or the device a
    region's process was given)."""

    def __init__(self, cfg: TrainConfig, placement: Placement | None = None) -> None:
        self.cfg = cfg
        self.placement = placement or Placement.from_options(cfg.device, cfg.precision)
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        corpus = load_corpus(cfg.data)
        hf = is_hf_model(cfg.model)
        self.tokenizer = hf_tokenizer(cfg) if hf else load_tokenizer(cfg.tokenizer, corpus)
        self.tokens = tokenize_corpus(corpus, self.tokenizer)
        torch.manual_seed(cfg.seed)
        self.base = build_model(cfg.model, self.tokens.vocab_size, cfg.seq_len)
        self.num_params = count_parameters(self.base)
        self.inner = cfg.inner_settings()
        self.codec: Codec = get_codec(cfg.wire_codec, cfg.topk)
        self.codecs = sync_codecs(self.codec, cfg.paced_wire_codec, cfg.topk, cfg.error_feedback)
        self.val_batches = validation_batches(self.tokens.val, cfg.seq_len, cfg.batch_size, cfg.eval_batches)

    def data_sha256(self) -> str:
        """sha256 over the token ids (int64, native byte order) of the train and validation splits:
        the data a run sees."""
        digest = hashlib.sha256()
        for split in (self.tokens.train, self.tokens.val):
            digest.update(split.numel().to_bytes(8, "little"))
            digest.update(split.contiguous().numpy())  # hashed in place, no copy
        return digest.hexdigest()

    def shard(self, index: int, count: int) -> Shard:
        """Worker ``index`` of ``count`` reads this disjoint, deterministic part of the train split."""
        return Shard(self.tokens.train, self.cfg.seq_len, self.cfg.batch_size, index, count, self.cfg.seed)

    def replica(self, settings: AlgoSettings) -> tuple[InnerTrainer, ReplicaStrategy]:
        """A fresh copy of the initial model on the replica's device, with its inner optimizer and
        strategy."""
        trainer = self.trainer()
        return trainer, self.strategy(trainer.model, settings)

    def trainer(self) -> InnerTrainer:
        """A fresh copy of the initial model on the replica's device, with its inner optimizer."""
        model = copy.deepcopy(self.base).to(self.placement.device)
        return InnerTrainer(model, self.inner, self.placement, self.cfg.compile)

    def strategy(
        self, model: nn.Module, settings: AlgoSettings, placement: Placement | None = None
    ) -> ReplicaStrategy:
        """The strategy of a replica ``model`` on ``placement`` (default: the replica's device);
        θ̄ starts as the model's parameters."""
        where = placement or self.placement
        return make_strategy(model, settings, self.inner.decay_between, where, self.codecs)

    def eval_model(self) -> nn.Module:
        """A copy of the model on the replica's device, that evaluations load θ̄ into."""
        return copy.deepcopy(self.base).to(self.placement.device)

    def needs_step_time(self) -> bool:
        return AUTO in (self.cfg.overlap, self.cfg.transmissions)

    def step_time(self) -> float:
        """The configured seconds per inner step, or a measurement on a throwaway copy."""
        if self.cfg.step_time is not None:
            return self.cfg.step_time
        trainer = InnerTrainer(self.eval_model(), self.inner, self.placement)
        return measure_step_time(trainer, self.shard(0, self.cfg.data_shards))

    def settings(
        self,
        latency_s: float,
        bandwidth_bps: float,
        step_time: float | None,
        paced: bool = False,
        asks_pace: bool = False,
    ) -> AlgoSettings:
        """The core's settings, with --overlap auto / --transmissions auto turned into numbers
        from the link and the step time (which auto needs); ``paced``: a peer whose swarm widens
        the send pace, where a transfer longer than H steps makes τ = H − 1 instead of an error;
        ``asks_pace``: such a peer asks for that pace itself (--pace link), and its N is at least K."""
        cfg = self.cfg
        if not self.needs_step_time():
            return cfg.algo_settings()
        assert step_time is not None
        if cfg.algo in ("streaming", "cocodc"):
            sizes = [f.numel for f in make_fragments(self.base, cfg.fragments, cfg.pattern)]
        else:
            sizes = [self.num_params]
        wire = [allreduce_wire_bytes(self.codec, n, cfg.workers) for n in sizes]
        return cfg.algo_settings(link=Link(wire, latency_s, bandwidth_bps, step_time, paced, asks_pace))

    def eval_record(
        self, model: nn.Module, global_state: dict[str, torch.Tensor], step: int, replicas: int
    ) -> dict[str, Any]:
        """Validation loss of θ̄ (loaded into ``model``): the fields every eval record shares."""
        model.load_state_dict(global_state)
        loss = evaluate(model, self.val_batches, self.placement)
        return {
            "kind": "eval",
            "step": step,
            "val_loss": loss,
            "val_ppl": perplexity(loss),
            "tokens": step * replicas * self.cfg.batch_size * self.cfg.seq_len,
        }


def summary_record(
    setup: TrainingSetup,
    settings: AlgoSettings,
    first: dict[str, Any],
    last: dict[str, Any],
    global_state: dict[str, torch.Tensor],
    saved: Saved | None = None,
    **measured: Any,
) -> dict[str, Any]:
    """The last record of every run, simulated or real (``saved``: what ``save_run`` wrote)."""
    cfg = setup.cfg
    digest = params_sha256(global_state)
    return {
        "kind": "summary",
        "algo": cfg.algo,
        "steps": last["step"],
        "final_val_loss": last["val_loss"],
        "final_val_ppl": last["val_ppl"],
        "initial_val_ppl": first["val_ppl"],
        **measured,
        "overlap": settings.overlap,
        "transmissions": settings.transmissions,
        "num_params": setup.num_params,
        "global_params_sha256": digest,
        "saved": saved.folder if saved else None,  # the folder θ̄ was written to, if any
        "save_failed": saved.failed if saved else None,  # why --save itself could not be written
        "config": asdict(cfg),
    }


@dataclass(frozen=True)
class Saved:
    """Where θ̄ went: ``folder`` written (--save, its partial name, or a fallback folder when that
    failed), and why --save itself could not be written (``failed``), if it could not."""

    folder: str | None
    failed: str | None = None


def save_run(
    setup: TrainingSetup,
    global_state: dict[str, torch.Tensor],
    steps: int,
    first: dict[str, Any],
    last: dict[str, Any],
    unfinished: str | None = None,
) -> Saved:
    """Write θ̄ after ``steps`` steps to --save (a run that did not finish: to its partial name)
    with the run's facts, ``first`` and ``last`` being its first and last eval records. A --save
    that cannot be written (its disk filled, its parent became a file) never loses the model: θ̄ goes
    to a fallback folder beside --out (or in the working directory), and ``Saved`` says both."""
    cfg = setup.cfg
    run = {
        "algo": cfg.algo,
        "steps": steps,
        "finished": unfinished is None,
        "unfinished": unfinished,
        "final_val_loss": last["val_loss"],
        "final_val_ppl": last["val_ppl"],
        "evaluated_at_step": last["step"],
        "initial_val_ppl": first["val_ppl"],
        "data": cfg.data
        if cfg.data is None or cfg.data.startswith("builtin:")
        else str(Path(cfg.data).resolve()),
        "data_sha256": setup.data_sha256(),
        "options": cfg.computing_options(),
    }
    try:
        return Saved(save_model(cfg, setup.base, setup.tokenizer, global_state, run))
    except UserError as exc:
        failed = str(exc)
    fallback = fallback_folder(cfg, steps)
    log.warning("%s; saving θ̄ to %s instead", failed, fallback)
    try:
        elsewhere = replace(cfg, save=fallback, force=False)
        folder = save_model(elsewhere, setup.base, setup.tokenizer, global_state, run)
    except UserError as exc:
        return Saved(None, f"{failed}; the fallback failed too ({exc})")
    return Saved(folder, failed)


def fallback_folder(cfg: TrainConfig, steps: int) -> str:
    """A new folder for θ̄ when --save fails: beside --out, else in the working directory."""
    parent = Path(cfg.out).resolve().parent if cfg.out is not None else Path.cwd()
    name = parent / f"p2p-cocodc-{cfg.algo}-step-{steps}"
    folder, n = name, 1
    while folder.exists():
        folder, n = name.with_name(f"{name.name}.{n}"), n + 1
    return str(folder)


def sync_codecs(steady: Codec, paced: str | None, topk: float, feedback: bool) -> SyncCodecs:
    """The run's codecs (``SyncCodecs``): --codec, and --paced-codec resolved (``paced``), which must
    send fewer bytes than --codec; UserError if it does not."""
    if paced is None:
        return SyncCodecs(steady, None, feedback)
    coarse = get_codec(paced, topk)
    n = 1 << 20
    if coarse.round_bytes(n, 2) >= steady.round_bytes(n, 2):
        raise UserError(
            f"--paced-codec {paced} sends as many bytes as --codec {steady.name} or more; a paced link "
            "needs a coarser one (or 'same')"
        )
    return SyncCodecs(steady, coarse, feedback)


def allreduce_wire_bytes(codec: Codec, numel: int, replicas: int) -> int:
    """Bytes one replica sends in a butterfly all-reduce of ``numel`` values: (M − 1)/M of the slices,
    and its own slice's mean to the M − 1 others, averaged over the members."""
    return math.ceil((replicas - 1) * codec.round_bytes(numel, replicas) / replicas)


def measure_step_time(trainer: InnerTrainer, shard: Shard, repeats: int = 3) -> float:
    """Median seconds of one inner step of a throwaway trainer (a replica's is left untouched)."""
    float(trainer.step(*shard.batch(0), 1))  # warm-up: allocations, kernels
    times = []
    for i in range(repeats):
        started = time.perf_counter()
        float(trainer.step(*shard.batch(i + 1), 1))  # float: the step has run on the device
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]
