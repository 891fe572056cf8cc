"""Checkpoints (``--checkpoint-dir``), written atomically, that a run resumes from bit-exactly (the
final θ̄ of ``--save`` is p2p_cocodc.models.saved's).

A checkpoint of step t is two files in the checkpoint folder:

- ``step-<t>.safetensors``: every tensor of the run's state, named by its path in the state
  (``workers/0/trainer/model/wte.weight``);
- ``step-<t>.json``: the rest of the state (steps, clocks, schedules, records), each tensor replaced
  by ``{"$tensor": name, "dtype": …, "shape": …}``, under an identity block: format version,
  package version, the options and the data the run computes with, and the size and sha256 of
  the tensor file.

The JSON is written last: it is what makes a checkpoint exist. Each file goes to a temporary file
in the same folder, is flushed and fsynced, renamed over its name, and the folder is fsynced; a
run killed while writing leaves at most an orphan tensor file or a temporary file, which the next
write removes, never a checkpoint that is half there. Checkpoints older than the newest ``KEEP``
are deleted only after the new one is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from p2p_cocodc import __version__
from p2p_cocodc.errors import UserError

if TYPE_CHECKING:
    from p2p_cocodc.config.train import TrainConfig

FORMAT = "p2p-cocodc checkpoint"
FORMAT_VERSION = 2  # 2: a CoCoDC schedule's spacing, and the spacing of each result in flight
KEEP = 3  # checkpoints kept in a folder: the newest three
TENSOR = "$tensor"  # the key that marks a tensor's place in the JSON skeleton
_COMMITTED = re.compile(r"step-(\d+)\.json")
_OURS = re.compile(r"step-(\d+)\.(json|safetensors)")
_TEMPORARY = re.compile(r"\.step-\d+\.(json|safetensors)\.tmp-\d+")

T = TypeVar("T")


# ---- atomic files ----


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` all at once: readers see the old file or the new one, never a
    part, even if this process dies or the machine loses power (temp file, fsync, rename, fsync
    of the folder). Raises OSError; leaves no temporary file behind on any error."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- state <-> files ----


def split_state(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """A nested state (dicts with str keys, lists, tensors, int/float/bool/str/None) as a JSON-able
    skeleton plus its tensors by path; the tensors are contiguous CPU copies."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: tuple[str, ...]) -> Any:
        if isinstance(value, torch.Tensor):
            name = "/".join(path)
            if name in tensors:
                raise ValueError(f"two tensors at {name}")
            tensors[name] = value.detach().to("cpu").contiguous().clone()
            return {TENSOR: name, "dtype": _dtype_name(value.dtype), "shape": list(value.shape)}
        if isinstance(value, dict):
            if any(not isinstance(k, str) or k == TENSOR for k in value):
                raise TypeError(f"state keys at {'/'.join(path)} must be strings other than {TENSOR}")
            return {k: walk(v, (*path, k)) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [walk(v, (*path, str(i))) for i, v in enumerate(value)]
        if value is None or isinstance(value, bool | int | float | str):
            return value
        raise TypeError(f"cannot store a {type(value).__name__} at {'/'.join(path)}")

    return walk(state, ()), tensors


def join_state(skeleton: Any, tensors: dict[str, torch.Tensor], where: Path) -> Any:
    """Inverse of ``split_state``; every tensor must be there with its recorded dtype and shape,
    and no other, or UserError naming ``where``."""
    used: set[str] = set()

    def walk(value: Any) -> Any:
        if isinstance(value, dict) and TENSOR in value:
            name = value[TENSOR]
            if name not in tensors:
                raise UserError(f"{where} lacks tensor {name!r}: the checkpoint is damaged")
            tensor = tensors[name]
            expected = (value.get("dtype"), value.get("shape"))
            if (_dtype_name(tensor.dtype), list(tensor.shape)) != expected:
                raise UserError(
                    f"{where}: tensor {name!r} is {_dtype_name(tensor.dtype)} {list(tensor.shape)}, the "
                    f"checkpoint says {expected[0]} {expected[1]}: the checkpoint is damaged"
                )
            used.add(name)
            return tensor
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    state = walk(skeleton)
    extra = sorted(set(tensors) - used)
    if extra:
        raise UserError(
            f"{where} holds tensors the checkpoint does not list ({extra[0]!r}, …): it is damaged"
        )
    return state


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- checkpoints ----


@dataclass
class Checkpoint:
    """A checkpoint read back and checked against the options of the run that resumes it."""

    path: Path  # its JSON file
    step: int
    meta: dict[str, Any]  # the whole JSON document
    state: Any  # the state, tensors in place

    def check_data(self, data_sha256: str) -> None:
        """Refuse a checkpoint written for other training data."""
        there = str(self.meta.get("data_sha256"))
        if there != data_sha256:
            raise UserError(
                f"{self.path} was written for other training data (sha256 {there[:12]}… there, "
                f"{data_sha256[:12]}… here): resume with the --data and --tokenizer it was written with"
            )

    def restore(self, load: Callable[[Any], T]) -> T:
        """``load(state)``; a state that does not fit (a tensor of another shape, a missing key) is
        the checkpoint's fault and becomes a UserError naming it."""
        try:
            return load(self.state)
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as exc:
            detail = f"it lacks {exc}" if isinstance(exc, KeyError) else " ".join(str(exc).split())
            raise UserError(f"{self.path} does not fit this run ({detail})") from None


def committed(folder: Path) -> list[tuple[int, Path]]:
    """The checkpoints of a folder (their JSON files), oldest first."""
    if not folder.is_dir():
        return []
    found = [(int(m[1]), entry) for entry in folder.iterdir() if (m := _COMMITTED.fullmatch(entry.name))]
    return sorted(found)


def find_resume_point(cfg: TrainConfig) -> Checkpoint | None:
    """Before any set-up. With ``--resume``: the newest checkpoint of ``--checkpoint-dir``, read and
    checked against the options. Without: None, after making sure the folder holds no checkpoint
    (a fresh run would mix its checkpoints with another run's)."""
    if cfg.checkpoint_dir is None:
        return None
    folder = Path(cfg.checkpoint_dir)
    found = committed(folder)
    if not cfg.resume:
        if found:
            raise UserError(
                f"--checkpoint-dir {folder} already holds checkpoints (newest {found[-1][1].name}): add "
                "--resume to continue that run, or give an empty folder"
            )
        return None
    if not found:
        raise UserError(
            f"--resume: --checkpoint-dir {folder} holds no checkpoint (step-*.json); run without "
            "--resume to start"
        )
    return read_checkpoint(found[-1][1], cfg.computing_options())


def read_checkpoint(path: Path, options: dict[str, Any]) -> Checkpoint:
    """Read a checkpoint and check it: format, options, tensor file. UserError names what is wrong."""
    damaged = "the checkpoint is damaged: delete it to resume from the one before"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({exc.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path} is not valid JSON ({exc}); {damaged}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UserError(f'{path} is not a p2p-cocodc checkpoint (no "format": "{FORMAT}")')
    if meta.get("format_version") != FORMAT_VERSION:
        raise UserError(
            f"{path} is checkpoint format version {meta.get('format_version')!r} (written by p2p-cocodc "
            f"{meta.get('package_version')}); this p2p-cocodc {__version__} reads version {FORMAT_VERSION}"
        )
    differences = _differences(meta.get("options"), options)
    if differences:
        raise UserError(
            f"{path} is from a run with other options ({differences}): resume with the options it was "
            "written with, or use another --checkpoint-dir"
        )
    try:
        step, tensors_meta = meta["step"], meta["tensors"]
        tensor_file = path.parent / tensors_meta["file"]
        expected_bytes, expected_sha = tensors_meta["bytes"], tensors_meta["sha256"]
        skeleton = meta["state"]
    except (KeyError, TypeError) as exc:
        raise UserError(f"{path} lacks {exc}; {damaged}") from None
    named = _COMMITTED.fullmatch(path.name)
    if not isinstance(step, int) or named is None or int(named[1]) != step:
        raise UserError(f"{path} says it is step {step!r}; {damaged}")
    try:
        blob = tensor_file.read_bytes()
    except OSError as exc:
        raise UserError(f"{tensor_file}: cannot read it ({exc.strerror}); {damaged}") from None
    if len(blob) != expected_bytes:
        raise UserError(f"{tensor_file} has {len(blob)} bytes, {path.name} says {expected_bytes}; {damaged}")
    if hashlib.sha256(blob).hexdigest() != expected_sha:
        raise UserError(f"{tensor_file}: its sha256 differs from the one in {path.name}; {damaged}")
    try:
        tensors = load_tensors(blob)
    except SafetensorError as exc:
        raise UserError(f"{tensor_file} is not a safetensors file ({exc}); {damaged}") from None
    return Checkpoint(path, step, meta, join_state(skeleton, tensors, tensor_file))


def _differences(there: Any, here: dict[str, Any], shown: int = 4) -> str:
    """The options that differ, as '--lr 0.002 there, 0.001 here; …' (empty if none)."""
    if not isinstance(there, dict):
        return "it records no options"
    missing = object()
    names = [n for n in {**there, **here} if there.get(n, missing) != here.get(n, missing)]
    parts = [
        f"--{n.replace('_', '-')} {_show(there.get(n, missing), missing)} there, "
        f"{_show(here.get(n, missing), missing)} here"
        for n in names[:shown]
    ]
    if len(names) > shown:
        parts.append(f"and {len(names) - shown} more")
    return "; ".join(parts)


def _show(value: Any, missing: object) -> str:
    return "(no such option)" if value is missing else json.dumps(value)


class CheckpointWriter:
    """Writes a run's checkpoints into one folder: every ``every`` steps (0: never on a schedule),
    at the last step, and whenever the driver asks; keeps the newest ``KEEP``."""

    def __init__(self, folder: str, every: int, options: dict[str, Any], data_sha256: str) -> None:
        self.folder = Path(folder)
        self.every = every
        self.identity = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "package_version": __version__,
            "options": options,
            "data_sha256": data_sha256,
        }

    def due(self, step: int, last_step: int) -> bool:
        return step == last_step or (self.every > 0 and step % self.every == 0)

    def write(self, step: int, state: Any) -> Path:
        """Write the checkpoint of ``step`` (tensors first, JSON last), then drop the old ones.
        Returns the JSON file's path; UserError if the folder cannot be written."""
        skeleton, tensors = split_state(state)
        blob = save_tensors(tensors, metadata={"format": FORMAT, "step": str(step)})
        tensor_file = self.folder / f"step-{step:08d}.safetensors"
        path = self.folder / f"step-{step:08d}.json"
        meta = {
            **self.identity,
            "step": step,
            "tensors": {
                "file": tensor_file.name,
                "bytes": len(blob),
                "sha256": hashlib.sha256(blob).hexdigest(),
            },
            "state": skeleton,
        }
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write(tensor_file, blob)
            atomic_write(path, json.dumps(meta).encode("utf-8"))
            self._prune()
        except OSError as exc:
            raise UserError(
                f"--checkpoint-dir {self.folder}: cannot write a checkpoint ({exc.strerror})"
            ) from None
        return path

    def _prune(self) -> None:
        """Delete checkpoints beyond the newest KEEP (JSON first, so none is ever half there), tensor
        files no checkpoint owns, and temporary files of writes that were killed."""
        keep = {step for step, _ in committed(self.folder)[-KEEP:]}
        doomed = []
        for entry in self.folder.iterdir():
            ours = _OURS.fullmatch(entry.name)
            if (ours and int(ours[1]) not in keep) or _TEMPORARY.fullmatch(entry.name):
                doomed.append(entry)
        for entry in sorted(doomed, key=lambda e: not e.name.endswith(".json")):
            entry.unlink(missing_ok=True)
