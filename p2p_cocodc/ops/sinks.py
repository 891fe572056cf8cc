"""``--log-to tensorboard,wandb``: the run's records also go to TensorBoard and Weights & Biases.

``RunLog`` (metrics.py) hands every record it writes to these sinks, so both drivers log alike:
each evaluation of θ̄ as scalars ``eval/<field>`` at its inner step (``val_ppl``, ``val_loss``,
``train_loss``, ``bytes_sent``, ``stall_s``, ``tokens``, and ``sim_time_s`` or ``wall_time_s``),
and the summary's numbers (``final_val_ppl``, ``bytes_sent``, ``stall_s``, ``rounds_done``, …): in
TensorBoard as scalars ``summary/<field>`` at the last step, in W&B as the run's summary. Each run
logs into a folder of its own under ``--log-dir`` (TensorBoard: ``DIR/NAME``; W&B: ``DIR/wandb/``),
named after what it is (``streaming-…`` for a simulation, ``RUN_ID-REGION-…`` for a peer) and when
it started. Both packages are optional extras, imported only when asked for: a missing one is one
line naming the extra to install. W&B runs offline (files only, ``wandb sync`` uploads them later)
unless ``WANDB_MODE`` is set or an API key is at hand (``WANDB_API_KEY``, or ``wandb login``).
"""

from __future__ import annotations

import json
import math
import netrc
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from p2p_cocodc.config.train import TrainConfig
from p2p_cocodc.errors import UserError

DEFAULT_LOG_DIR = "runs"  # TensorBoard's own default folder
WANDB_PROJECT = "p2p-cocodc"  # unless WANDB_PROJECT says otherwise
WANDB_HOST = "api.wandb.ai"  # where `wandb login` keeps its key in ~/.netrc
WANDB_MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")  # what wandb.init accepts
EXTRAS = {"tensorboard": ("torch.utils.tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


class RecordSink(Protocol):
    """Somewhere a run's records go besides --out."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def check_sinks(cfg: TrainConfig) -> None:
    """Before any slow work: each --log-to package can be imported (else the extra to install)."""
    for name in _names(cfg):
        module, extra = EXTRAS[name]
        try:
            __import__(module)
        except ImportError as exc:
            raise UserError(
                f"--log-to {name} needs the {extra} package ({exc}): pip install -e '.[{extra}]'"
            ) from None
        if name == "wandb" and wandb_mode() not in WANDB_MODES:
            raise UserError(f"WANDB_MODE={wandb_mode()!r}: use online, offline or disabled, or unset it")


def log_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.log_dir or DEFAULT_LOG_DIR)


def open_sinks(cfg: TrainConfig, name: str, group: str | None = None) -> list[RecordSink]:
    """The sinks --log-to asks for; ``name`` says which run this is (a start time is added, so a
    run started again logs beside the first), ``group`` which runs belong together (a swarm's)."""
    stamped = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    sinks: list[RecordSink] = []
    try:
        for sink in _names(cfg):
            if sink == "tensorboard":
                sinks.append(TensorBoardSink(log_dir(cfg) / stamped, cfg))
            else:
                sinks.append(WandbSink(log_dir(cfg), stamped, group, cfg))
    except BaseException:
        for opened in sinks:
            opened.close()
        raise
    return sinks


def _names(cfg: TrainConfig) -> list[str]:
    return cfg.log_to.split(",") if cfg.log_to else []


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a record, by field (``step`` and flags left out): what a chart can plot."""
    return {
        key: float(value)
        for key, value in record.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and key != "step"
    }


class TensorBoardSink:
    """Scalars in TensorBoard event files (``torch.utils.tensorboard``), the config as text."""

    def __init__(self, folder: Path, cfg: TrainConfig) -> None:
        from torch.utils.tensorboard import SummaryWriter

        try:
            self.writer = SummaryWriter(log_dir=str(folder))
        except OSError as exc:
            raise UserError(f"--log-dir {folder.parent}: cannot write it ({exc.strerror or exc})") from None
        self.writer.add_text("config", f"```\n{json.dumps(asdict(cfg), indent=2)}\n```")
        print(f"TensorBoard logs in {folder}: tensorboard --logdir {folder.parent}", file=sys.stderr)

    def write(self, record: dict[str, Any]) -> None:
        if record["kind"] == "eval":
            for key, value in scalars(record).items():
                self.writer.add_scalar(f"eval/{key}", value, record["step"])
        elif record["kind"] == "summary":
            for key, value in scalars(record).items():
                self.writer.add_scalar(f"summary/{key}", value, record["steps"])

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run: each evaluation is a history row at its step, the summary the run's summary."""

    def __init__(self, folder: Path, name: str, group: str | None, cfg: TrainConfig) -> None:
        import wandb

        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", WANDB_PROJECT),
                name=name,
                group=group,
                dir=str(folder),
                config=asdict(cfg),
                mode=wandb_mode(),
                # stdout and stderr stay ours (progress bars, logs): one line says where the run is
                settings=wandb.Settings(console="off", silent=True),
            )
        except wandb.errors.Error as exc:  # a bad API key, WANDB_MODE or project
            raise UserError(f"--log-to wandb: {exc} (WANDB_MODE=offline logs without an account)") from None
        offline = self.run.settings.mode == "offline"
        where = f"offline: wandb sync {self.run.settings.sync_dir} uploads it" if offline else self.run.url
        print(f"W&B run {name} {where}", file=sys.stderr, flush=True)

    def write(self, record: dict[str, Any]) -> None:
        if record["kind"] == "eval":
            values = {f"eval/{key}": v for key, v in scalars(record).items() if math.isfinite(v)}
            self.run.log(values, step=record["step"])
        elif record["kind"] == "summary":
            self.run.summary.update(scalars(record))

    def close(self) -> None:
        self.run.finish()


def wandb_mode() -> str:
    """WANDB_MODE when set; online with an API key at hand; else offline: no account, no network."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        logged_in = netrc.netrc().authenticators(WANDB_HOST) is not None
    except (OSError, netrc.NetrcParseError):
        logged_in = False
    return "online" if logged_in else "offline"
