"""Run records: JSON lines written as a run goes, and the fingerprint of the global parameters."""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

from p2p_cocodc.errors import UserError

if TYPE_CHECKING:
    from p2p_cocodc.ops.sinks import RecordSink


def params_sha256(state: dict[str, torch.Tensor]) -> str:
    """sha256 over θ̄ as float32 little-endian bytes, in state_dict order: equal runs, equal hash."""
    digest = hashlib.sha256()
    for tensor in state.values():
        digest.update(tensor.detach().to(torch.float32).contiguous().numpy().astype("<f4").tobytes())
    return digest.hexdigest()


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


class RunLog:
    """Appends one JSON object per line and flushes, so a killed run keeps what it measured; hands
    every record to ``sinks`` too (--log-to: TensorBoard, W&B; ``sinks.py``), and closes them."""

    def __init__(self, path: str | None, sinks: Sequence[RecordSink] = ()) -> None:
        self._file: IO[str] | None = None
        self._path = path
        self._sinks = list(sinks)
        if path is not None:
            try:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
            except OSError as exc:
                self.close()
                raise UserError(f"--out {path}: cannot write it ({exc.strerror})") from None

    def write(self, record: dict[str, Any]) -> None:
        for sink in self._sinks:
            sink.write(record)
        if self._file is not None:
            try:
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()
            except OSError as exc:  # a full disk, /dev/full: the run cannot keep its records
                self._abandon()
                raise UserError(f"--out {self._path}: cannot write it ({exc.strerror or exc})") from None

    def close(self) -> None:
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            sink.close()
        if self._file is not None:
            try:
                self._file.close()
            except OSError as exc:
                raise UserError(f"--out {self._path}: cannot write it ({exc.strerror or exc})") from None
            finally:
                self._file = None

    def _abandon(self) -> None:
        """Drop the file without flushing what it could not write (its close would fail again)."""
        assert self._file is not None
        try:
            os.close(self._file.fileno())
        except OSError:
            pass
        self._file = None


class Records:
    """The records of one run: each written to its ``RunLog`` as it comes, and kept, so that a
    checkpoint holds them and a resumed run writes them again first. ``listener`` sees every record
    written (a peer's metrics). After ``close`` nothing more is written (a run's summary stays its
    last record); closing the ``RunLog`` is its owner's business."""

    def __init__(self, log: RunLog | None, listener: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.log = log
        self.listener = listener
        self.kept: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        if self.log is None:
            return
        self.log.write(record)
        self.kept.append(record)
        if self.listener is not None:
            self.listener(record)

    def replay(self) -> None:
        """Write the kept records again (a resumed run's: those before its checkpoint)."""
        if self.log is not None:
            for record in self.kept:
                self.log.write(record)

    def evals(self) -> list[dict[str, Any]]:
        return [record for record in self.kept if record["kind"] == "eval"]

    def close(self) -> None:
        self.log = None


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """All records of a run file; a corrupt line is an error that names the file and line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read run file {path}: {exc}") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{path}:{number} is not a JSON record") from None
        if not isinstance(record, dict) or "kind" not in record:
            raise UserError(f"{path}:{number} is not a p2p-cocodc record (no 'kind')")
        records.append(record)
    return records
