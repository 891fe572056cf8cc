"""A tqdm progress bar for long runs that shows the latest validation perplexity."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from tqdm import tqdm


class ProgressBar:
    def __init__(self, total: int, disable: bool = False) -> None:
        self._bar = tqdm(total=total, unit="step", disable=disable, dynamic_ncols=True)

    def update(self, step: int, record: dict[str, Any]) -> None:
        if record:
            self._bar.set_postfix(val_ppl=f"{record['val_ppl']:.2f}", stall_s=f"{record['stall_s']:.1f}")
        self._bar.update(step - self._bar.n)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._bar.close()
