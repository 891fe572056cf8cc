"""Where a replica computes: its device, the precision of its inner steps, and the copies between
the device and the host that keep the exchange off the training stream.

The split every driver keeps:

- the replica (parameters, AdamW state, inner forward/backward) lives on ``Placement.device``; with
  ``precision="bf16"`` the inner forward/backward run under ``torch.autocast`` in bfloat16 while the
  parameters and AdamW stay fp32;
- θ̄ and the outer optimizer live on the CPU in fp32 (``OuterOptimizer``), so regions with different
  hardware run the same float ops on the same averaged Δ and hold a bit-identical θ̄.

On CUDA a fragment's snapshot goes to pinned host memory on a side stream (``to_host``), and a new
global fragment comes back the same way (``to_device``); the training stream waits for the copy
back on the GPU (``DeviceCopy.get``: an event wait, the one synchronisation point), never the host.
Elsewhere the same calls run without streams: a CPU tensor is its own host copy.
"""

from __future__ import annotations

import contextlib
import resource
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from p2p_cocodc.errors import UserError

DEVICE_CHOICES = "auto, cpu, cuda, cuda:N, mps"


def resolve_device(spec: str) -> torch.device:
    """The torch device ``--device`` names (auto: the first CUDA device when there is one, else the
    CPU); UserError saying what to use instead when this machine does not have it."""
    if spec == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "mps":
        if not torch.backends.mps.is_available():
            raise UserError("--device mps: no Apple GPU torch can use here; use --device cpu or auto")
        return torch.device("mps")
    kind, sep, index = spec.partition(":")
    if kind != "cuda" or (sep and not index.isdigit()):
        raise UserError(f"--device {spec!r}: use one of {DEVICE_CHOICES}")
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise UserError(
            f"--device {spec}: no CUDA device here (torch {torch.__version__} is {build}, or no GPU is "
            "visible); use --device cpu or auto"
        )
    count = torch.cuda.device_count()
    if sep and int(index) >= count:
        raise UserError(f"--device {spec}: there are {count} CUDA device(s) here: cuda:0 to cuda:{count - 1}")
    return torch.device(f"cuda:{int(index) if sep else 0}")


def check_precision(precision: str, device: torch.device) -> None:
    """UserError if ``device`` cannot run ``--precision``."""
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise UserError(f"--precision bf16: {name} has no bfloat16 support; use --precision fp32")
    if precision == "bf16" and device.type == "mps":
        try:
            torch.ones(1, device=device, dtype=torch.bfloat16)
        except (RuntimeError, TypeError):
            raise UserError("--precision bf16: this Apple GPU lacks bfloat16; use --precision fp32") from None


def peak_memory_bytes(device: torch.device) -> int:
    """The most memory this process has held for training: on CUDA the device allocator's peak,
    elsewhere the process's peak resident set (Python and torch included)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@dataclass
class HostCopy:
    """A device tensor on its way to host memory; ``tensor`` is valid once ``wait()`` returned."""

    tensor: torch.Tensor
    event: torch.cuda.Event | None = None

    def wait(self) -> torch.Tensor:
        """Block this thread until the copy has landed (never the training stream)."""
        if self.event is not None:
            self.event.synchronize()
        return self.tensor


@dataclass
class DeviceCopy:
    """A host tensor on its way to the device. ``get`` makes the current (training) stream wait for
    the copy on the GPU and returns the device tensor."""

    tensor: torch.Tensor
    event: torch.cuda.Event | None = None

    def get(self) -> torch.Tensor:
        if self.event is not None:
            main = torch.cuda.current_stream(self.tensor.device)
            main.wait_event(self.event)
            self.tensor.record_stream(main)  # allocated on the side stream, used on this one
        return self.tensor


class StepTimer:
    """Seconds per inner step, as the device ran them. A CUDA step runs after the call that queued
    it returns (the host runs ahead), so there events are recorded before and after each step on
    the stream, and a step's time is read between them once the device has passed both (time the
    device sat idle between steps is not in it); elsewhere a step has run when its call returns,
    and its time is the call's."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.queued: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self.start: torch.cuda.Event | None = None

    def step_starts(self) -> None:
        """Before a step's call (in the thread that queues the step)."""
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()

    def step_done(self, call_s: float) -> float | None:
        """After a step's call (which took ``call_s``), in the same thread: the latest step time
        known, if a new one is."""
        if not self.cuda:
            return call_s
        assert self.start is not None
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.queued.append((self.start, end))
        measured = None
        while self.queued and self.queued[0][1].query():
            start, end = self.queued.popleft()
            measured = start.elapsed_time(end) / 1000.0
        return measured


@dataclass
class Placement:
    """A replica's device and inner precision; copies to and from the device (module docstring)."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    precision: str = "fp32"
    _side: torch.cuda.Stream | None = None

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "bf16"):
            raise UserError(f"--precision {self.precision!r}: use fp32 or bf16")
        check_precision(self.precision, self.device)
        if self.device.type == "cuda":
            self._side = torch.cuda.Stream(self.device)

    @classmethod
    def from_options(cls, device: str, precision: str) -> Placement:
        return cls(resolve_device(device), precision)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The inner forward/backward's precision: bf16 autocast, or nothing for fp32."""
        if self.precision == "fp32":
            yield
            return
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            yield

    def batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch on the device. On CUDA it goes through pinned memory: a copy from pageable
        memory may wait for the device to finish its queued work, and the host must not."""
        if self.device.type == "cpu":
            return x, y
        if self.device.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def reserve_host_memory(self, sizes: list[int]) -> None:
        """Take the pinned host memory the copies of fp32 vectors of these sizes need (a snapshot
        on its way to the host and a θ̄ on its way back, for each) before training, so no
        boundary ever waits for the driver to pin memory: torch keeps freed pinned blocks for reuse."""
        if self._side is not None:
            blocks = [torch.empty(n, pin_memory=True) for n in sizes for _ in range(2)]
            del blocks

    def to_host(self, tensor: torch.Tensor) -> HostCopy:
        """Start copying ``tensor`` (a fresh device tensor, not written again) to host memory."""
        if self._side is None:
            return HostCopy(tensor if tensor.device.type == "cpu" else tensor.cpu())
        side, main = self._side, torch.cuda.current_stream(self.device)
        side.wait_stream(main)  # the tensor was computed on the training stream
        with torch.cuda.stream(side):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        tensor.record_stream(side)  # its memory is not reused before the side stream read it
        return HostCopy(host, event)

    def to_device(self, tensor: torch.Tensor) -> DeviceCopy:
        """Start copying a host tensor to the device. It is staged in pinned memory first, so the
        caller may change ``tensor`` at once (θ̄ may be loaded or stepped in place)."""
        if self._side is None:
            return DeviceCopy(tensor.to(self.device))
        staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        staged.copy_(tensor)
        with torch.cuda.stream(self._side):  # allocated here, so ordered after the side stream only
            out = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
            out.copy_(staged, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._side)
        return DeviceCopy(out, event)
