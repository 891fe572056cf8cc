"""A trained model as a folder: what ``--save DIR`` writes, and what ``generate`` and ``eval`` load.

DIR holds, for every kind of model:

- ``p2p-cocodc.json``: the format and its version; the model (a preset name, ``module:factory`` or
  the ``hf:`` model the run started from) and the options that shape it (vocabulary size, sequence
  length, tokenizer); θ̄'s sha256 (the run's ``global_params_sha256``); and the run's facts (steps,
  whether it finished, its last perplexity, its options, the package version, its data);
- preset and plug-in models: ``model.safetensors``, θ̄ under the trainer's parameter names in
  float32 (``safetensors.torch.load_file`` loads it into the same model), and the tokenizer:
  ``tokenizer.json`` (a `tokenizers` file) for ``bpe4096``, nothing for ``byte``;
- ``hf:`` models: what ``save_pretrained`` writes (config, float32 weights under the HF model's own
  names, the tokenizer), so ``AutoModelForCausalLM.from_pretrained(DIR)`` loads it as well.

The folder is made beside its place and renamed in, so it is whole or absent; an existing one is
replaced only with ``--force`` and only if an earlier ``--save`` wrote it. A run that did not finish
(stopped by a signal, failed, or left with a θ̄ that is not the swarm's) writes ``DIR.partial-step-T``
instead (T: the steps it made), so that it never passes for a finished one. ``load_saved`` checks
what it reads (θ̄ must hash to the sha256 the folder records) and says in one line what is wrong
with a folder that is missing, damaged or not a saved model.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from safetensors.torch import save as save_tensors
from torch import nn

from p2p_cocodc import __version__
from p2p_cocodc.errors import UserError
from p2p_cocodc.models.build import build_model
from p2p_cocodc.models.data import BpeTokenizer, ByteTokenizer, Tokenizer
from p2p_cocodc.models.gpt import PRESETS
from p2p_cocodc.names import HF_PREFIX
from p2p_cocodc.run.records import params_sha256

if TYPE_CHECKING:
    from p2p_cocodc.config.train import TrainConfig

FORMAT = "p2p-cocodc model"
FORMAT_VERSION = 1
CONFIG_FILE = "p2p-cocodc.json"  # written last: what makes a folder a saved model
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
KINDS = ("preset", "factory", "hf")
# what p2p-cocodc.json must hold, and of which type
REQUIRED = {
    "format_version": int,
    "model": str,
    "model_kind": str,
    "vocab_size": int,
    "seq_len": int,
    "tokenizer": str,
    "global_params_sha256": str,
    "run": dict,
}
TYPE_NAMES = {int: "an int", str: "a string", dict: "an object"}

log = logging.getLogger(__name__)


def model_kind(spec: str) -> str:
    if spec.startswith(HF_PREFIX):
        return "hf"
    return "preset" if spec in PRESETS else "factory"


def partial_path(path: str, steps: int) -> str:
    """Where an unfinished run's θ̄ goes: never under the name of a finished one."""
    return f"{path}.partial-step-{steps}"


# ---- writing ----


def check_save_target(path: str, force: bool) -> None:
    """``path`` must be new, an empty folder, or (with ``force``) a folder an earlier --save wrote;
    a file, or a folder with anything else in it, is never replaced."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--save {path} is a file; --save writes a folder (weights, config, tokenizer)")
    try:
        empty = not folder.is_dir() or not any(folder.iterdir())
    except OSError as exc:
        raise UserError(f"--save {path}: cannot read it ({exc.strerror})") from None
    if empty:
        return
    if not (folder / CONFIG_FILE).is_file():
        raise UserError(
            f"--save {path} is a folder with other files in it; give a new or empty folder "
            "(--force replaces only a model an earlier --save wrote)"
        )
    if not force:
        raise UserError(
            f"--save {path} already holds a saved model; give a new name, or --force to replace it"
        )


def save_model(
    cfg: TrainConfig,
    base: nn.Module,
    tokenizer: Tokenizer,
    state: dict[str, torch.Tensor],
    run: dict[str, Any],
) -> str | None:
    """Write θ̄ (``state``) with the run's model (``base``: one built from its options), tokenizer and
    facts (``run``) to --save, or to its partial name when ``run["finished"]`` is false; returns the
    folder written. An unfinished run whose partial name is taken writes nothing (and says so): its
    end is not worth an error."""
    assert cfg.save is not None
    target = cfg.save if run["finished"] else partial_path(cfg.save, run["steps"])
    try:
        check_save_target(target, cfg.force)
    except UserError as exc:
        if run["finished"]:
            raise
        log.warning("the run did not finish (%s), and θ̄ was not saved: %s", run["unfinished"], exc)
        return None
    kind = model_kind(cfg.model)
    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "package_version": __version__,
        "model": cfg.model,
        "model_kind": kind,
        "vocab_size": tokenizer.vocab_size,
        "seq_len": cfg.seq_len,
        "tokenizer": "hf" if kind == "hf" else tokenizer.name,
        "global_params_sha256": params_sha256(state),
        "run": run,
    }
    try:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=Path(target).parent, prefix=f".{Path(target).name}.tmp-"))
        try:
            umask = os.umask(0)
            os.umask(umask)
            staging.chmod(0o777 & ~umask)  # mkdtemp's folder is private; a saved model is not
            if kind == "hf":
                from p2p_cocodc.models.hf import write_pretrained

                write_pretrained(base, state, staging)
            else:
                # copies: θ̄'s tensors are views of one buffer per fragment, which safetensors refuses
                tensors = {name: t.detach().to(torch.float32).clone() for name, t in state.items()}
                metadata = {"global_params_sha256": config["global_params_sha256"], "algo": cfg.algo}
                (staging / WEIGHTS_FILE).write_bytes(save_tensors(tensors, metadata=metadata))
                if isinstance(tokenizer, BpeTokenizer):
                    (staging / TOKENIZER_FILE).write_text(tokenizer.json_text, encoding="utf-8")
            (staging / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
            _sync(staging)
            _swap_in(staging, Path(target))
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    except OSError as exc:
        raise UserError(f"--save {target}: cannot write it ({exc.strerror or exc})") from None
    if not run["finished"]:
        log.warning("the run did not finish (%s): θ̄ saved to %s, not %s", run["unfinished"], target, cfg.save)
    return target


def _sync(folder: Path) -> None:
    """Every file of ``folder`` on disk before the folder is renamed into place."""
    for file in folder.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _swap_in(staging: Path, target: Path) -> None:
    """Rename ``staging`` to ``target``; what was there (checked replaceable) is moved aside, then removed."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        target.rename(old)
    staging.rename(target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---- reading ----


def load_saved(path: str) -> tuple[nn.Module, Tokenizer, dict[str, Any]]:
    """The model (float32, on the CPU, in eval mode), the tokenizer and the config of a folder
    --save wrote; UserError in one line if it is missing, damaged or not a saved model."""
    folder = Path(path)
    config = read_config(folder)
    if config["model_kind"] == "hf":
        model, tokenizer = _load_hf(folder, config)
    else:
        tokenizer = _load_tokenizer(folder, config)
        model = build_model(config["model"], config["vocab_size"], config["seq_len"])
        state = _load_weights(folder)
        try:
            model.load_state_dict(state)
        except RuntimeError as exc:
            reason = " ".join(str(exc).split())[:300]
            raise UserError(
                f"{folder / WEIGHTS_FILE} does not fit model {config['model']!r}: {reason}"
            ) from None
    if params_sha256(model.state_dict()) != config["global_params_sha256"]:
        raise UserError(
            f"{folder}: its weights do not hash to the sha256 {CONFIG_FILE} records: the folder is damaged"
        )
    model.eval()
    return model, tokenizer, config


def read_config(folder: Path) -> dict[str, Any]:
    """The folder's p2p-cocodc.json, checked for what loading needs."""
    if not folder.exists():
        raise UserError(f"{folder}: no such folder; give the folder `--save DIR` wrote")
    if not folder.is_dir():
        raise UserError(f"{folder} is a file; give the folder `--save DIR` wrote")
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise UserError(f"{folder} has no {CONFIG_FILE}: it is not a model `--save` wrote, or it is damaged")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{file} cannot be read ({exc}): the folder is damaged") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise UserError(f"{file} is not the config of a model `--save` wrote")
    for key, kind in REQUIRED.items():
        value = config.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise UserError(
                f"{file}: {key} should be {TYPE_NAMES[kind]}, not {value!r}: the folder is damaged"
            )
    if config["format_version"] > FORMAT_VERSION:
        raise UserError(
            f"{folder} was written by p2p-cocodc {config.get('package_version')} (format "
            f"{config['format_version']}), this is {__version__} (format {FORMAT_VERSION}): upgrade"
        )
    if config["model_kind"] not in KINDS or min(config["vocab_size"], config["seq_len"]) < 1:
        raise UserError(f"{file}: model_kind, vocab_size or seq_len is out of range: the folder is damaged")
    return config


def _load_weights(folder: Path) -> dict[str, torch.Tensor]:
    file = folder / WEIGHTS_FILE
    if not file.is_file():
        raise UserError(f"{folder} has no {WEIGHTS_FILE}: the folder is damaged")
    with _damaged(file):
        return load_file(file)


@contextlib.contextmanager
def _damaged(file: Path) -> Iterator[None]:
    """A safetensors file that cannot be read (truncated, garbled) as one line naming it."""
    try:
        yield
    except (SafetensorError, OSError, ValueError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise UserError(f"{file} is damaged ({reason}); save the model again") from None


def _load_tokenizer(folder: Path, config: dict[str, Any]) -> Tokenizer:
    name = config["tokenizer"]
    tokenizer: Tokenizer
    if name == "byte":
        tokenizer = ByteTokenizer()
    elif name == "bpe4096":
        file = folder / TOKENIZER_FILE
        try:
            tokenizer = BpeTokenizer(file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise UserError(f"{folder} has no {TOKENIZER_FILE}: the folder is damaged") from None
        except Exception as exc:  # noqa: BLE001 - tokenizers raises its own kinds for a bad file
            raise UserError(f"{file} is damaged ({' '.join(str(exc).split())[:200]})") from None
    else:
        raise UserError(f"{folder / CONFIG_FILE}: unknown tokenizer {name!r}: the folder is damaged")
    if tokenizer.vocab_size != config["vocab_size"]:
        raise UserError(
            f"{folder}: its tokenizer has {tokenizer.vocab_size} tokens, its model {config['vocab_size']}: "
            "the folder is damaged"
        )
    return tokenizer


def _load_hf(folder: Path, config: dict[str, Any]) -> tuple[nn.Module, Tokenizer]:
    """An hf: model from its own saved folder (what from_pretrained loads)."""
    from p2p_cocodc.models.hf import build_hf_model, folder_tokenizer

    weights = folder / WEIGHTS_FILE
    if weights.is_file():  # a damaged file is named here; from_pretrained would say it less plainly
        with _damaged(weights), safe_open(weights, "pt") as file:
            file.keys()
    spec = f"{HF_PREFIX}{folder}"
    try:
        return build_hf_model(spec, config["vocab_size"], config["seq_len"]), folder_tokenizer(spec)
    except UserError as exc:
        raise UserError(f"{folder}: the saved Hugging Face model does not load: {exc}") from None
