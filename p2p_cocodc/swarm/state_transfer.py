"""Handing the swarm's state to a peer that joins a run in progress, or comes back to it.

Every live peer holds the same shared state at the end of every inner step S (θ̄ and the outer
momentum of every fragment, the schedule's state, which syncs are in flight, the fragment versions):
that is what "θ̄ is bit-identical everywhere" means. A joiner picks a step S a little ahead of the
peers it sees, asks several of them (donors) for their state at S, checks that they describe the
same bytes (one digest over every chunk's sha256), and downloads the chunks from all of them at
once, checking each one. A donor copies its state in memory when it finishes step S (the only
moment its training waits: a memcpy of θ̄ and the momentum) and serves the copy from its event loop
while its training thread goes on.

The protocol ``p2p-cocodc/{run}/state/1`` is request/response on one libp2p stream, msgpack frames
(``swarm/wire.py``):

- ``{"want": "manifest", "step": S, "fingerprint": F}`` is answered ``{"ok": true, "manifest": M}``
  once the donor has finished step S, or ``{"ok": false, "step": X, "detail": why}`` (X: the donor's
  step; X ≥ S means it is past S, and the joiner asks again further ahead);
- ``{"want": "chunk", "step": S, "index": i}`` is answered ``{"ok": true, "data": bytes}``, or
  ``{"ok": false, ...}``.

A manifest ``M`` is ``{"step", "skeleton", "tensors": [[dtype, shape], ...], "size", "chunk_bytes",
"chunks": [sha256 hex, ...], "digest"}``: the state's structure with tensors replaced by
``{"__tensor__": i}``, and the tensors' bytes concatenated in order and cut into chunks.
``parse_manifest`` is the one place a donor's answer becomes data: bounded and type-checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from p2p_cocodc.swarm.limits import Limits, PeerLimiter
from p2p_cocodc.swarm.wire import (
    MAX_FRAME,
    MIN_LINK_MBPS,
    SLOWEST_LINK_MBPS,
    BadMessage,
    close_when_read,
    is_index,
    read_frame,
    transfer_allowance_s,
    write_frame,
)

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # 4.6 s on a 2 Mbit/s link: a chunk given up costs no more than that again
MAX_CHUNKS = 1 << 18  # 256 GiB of state
MAX_TENSORS = 1 << 16
MAX_DEPTH = 16
ASK_TIMEOUT_S = 30.0  # opening a stream and one small frame
ASK_BYTES = 4096  # a request is a small map
ADMIT_WAIT_S = 5.0  # how long a request waits for its asker's record to reach our board
SNAPSHOT_WAIT_S = 90.0  # how long a donor waits to reach the asked step before it answers
MAX_STEPS_AHEAD = 10_000  # a donor does not promise a state further ahead than this
KEEP_S = 300.0  # a snapshot is dropped this long after it was last asked for
MAX_SNAPSHOTS = 2  # at most this many copies of the state at once
STREAMS_PER_DONOR = 2
ATTEMPTS = 6  # asks before a joiner gives up (each ask the donors did not answer waits up to 2 min)
# before each new ask after one that too few donors answered (a dial that failed under load, a donor
# whose daemon has not yet learnt this peer's address, one busy with other joiners), the joiner waits
# this long: 7 s over 4 asks, then it gives up. Asked again at once, a failed dial failed again at once
UNANSWERED_PAUSES_S = (1.0, 2.0, 4.0)
TENSOR_KEY = "__tensor__"
DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32)
}


def chunk_link_mbps(link_mbps: float, streams: int) -> float:
    """The rate a chunk's deadline assumes (``ASK_TIMEOUT_S`` plus its size at this rate), on one
    end of a link of ``link_mbps`` (declared) that ``streams`` chunks in flight share.

    Unlike a round, taking the state has no step waiting on it: a chunk given up too early costs the
    whole join (its donors are dropped after two), one given up late only the time a dead donor
    holds it. So the allowance assumes the slowest link deadlines plan for (``MIN_LINK_MBPS``, or
    the declared link where slower), not the declared one: on a 2 Mbit/s link, six 1 MiB chunks take
    28 s together, and 4 MiB ones took longer than the 33 s they were given."""
    return min(link_mbps, MIN_LINK_MBPS) / streams


class StateUnavailable(Exception):
    """No consistent state could be had from the donors; the reason says why."""


# ---- packing ----


def pack(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """The state's structure with each tensor replaced by ``{"__tensor__": i}``, and the tensors."""
    tensors: list[torch.Tensor] = []

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value.detach().to("cpu").contiguous())
            return {TENSOR_KEY: len(tensors) - 1}
        if isinstance(value, dict):
            return {str(k): walk(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [walk(v) for v in value]
        return value

    return walk(state), tensors


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


@dataclass(frozen=True)
class Snapshot:
    """One donor's state at the end of a step, ready to serve."""

    manifest: dict[str, Any]
    blob: bytes

    def chunk(self, index: int) -> bytes:
        size = self.manifest["chunk_bytes"]
        return self.blob[index * size : (index + 1) * size]


def make_snapshot(step: int, state: Any, chunk_bytes: int = CHUNK_BYTES) -> Snapshot:
    """Pack ``state`` (a copy nobody writes to any more) into a manifest and its bytes."""
    skeleton, tensors = pack(state)
    blob = b"".join(tensor_bytes(t) for t in tensors)
    starts = range(0, max(len(blob), 1), chunk_bytes)
    chunks = [hashlib.sha256(blob[i : i + chunk_bytes]).hexdigest() for i in starts]
    meta = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]
    manifest = {
        "step": step,
        "skeleton": skeleton,
        "tensors": meta,
        "size": len(blob),
        "chunk_bytes": chunk_bytes,
        "chunks": chunks,
    }
    manifest["digest"] = digest(manifest)
    return Snapshot(manifest, blob)


def digest(manifest: dict[str, Any]) -> str:
    """One hash over the structure, the tensors' types and shapes, and every chunk's hash."""
    body = {k: manifest[k] for k in ("step", "skeleton", "tensors", "size", "chunk_bytes", "chunks")}
    return hashlib.sha256(msgpack.packb(body, use_bin_type=True)).hexdigest()


def unpack(manifest: dict[str, Any], blob: bytes) -> Any:
    """The state a (checked) manifest and its bytes describe; tensors own their memory."""
    tensors = []
    offset = 0
    for dtype_name, shape in manifest["tensors"]:
        dtype = DTYPES[dtype_name]
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes:
            raw = torch.frombuffer(bytearray(blob[offset : offset + nbytes]), dtype=torch.uint8)
            tensors.append(raw.view(dtype).reshape(shape))
        else:
            tensors.append(torch.empty(shape, dtype=dtype))
        offset += nbytes

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {TENSOR_KEY}:
                return tensors[value[TENSOR_KEY]]
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return walk(manifest["skeleton"])


def parse_manifest(value: Any, step: int) -> dict[str, Any]:
    """A donor's manifest for ``step``, checked: sizes bounded and consistent, digest right."""
    if not isinstance(value, dict):
        raise BadMessage("a manifest must be a map")
    keys = {"step", "skeleton", "tensors", "size", "chunk_bytes", "chunks", "digest"}
    if set(value) != keys:
        raise BadMessage(f"a manifest has the keys {sorted(keys)}")
    tensors, chunks, size = value["tensors"], value["chunks"], value["size"]
    chunk_bytes = value["chunk_bytes"]
    if value["step"] != step:
        raise BadMessage(f"the manifest is of step {value['step']!r}, not {step}")
    if not is_index(chunk_bytes) or not 0 < chunk_bytes <= MAX_FRAME // 2:
        raise BadMessage("'chunk_bytes' must be a positive size below the frame limit")
    if not isinstance(tensors, list) or len(tensors) > MAX_TENSORS:
        raise BadMessage(f"'tensors' must be a list of at most {MAX_TENSORS}")
    total = 0
    for item in tensors:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not isinstance(item[0], str)
            or item[0] not in DTYPES
            or not isinstance(item[1], list)
            or len(item[1]) > 8
            or not all(is_index(n) for n in item[1])
        ):
            raise BadMessage("each tensor must be [dtype, shape] with a known dtype")
        try:  # strides must fit in 64 bits too (an empty tensor with huge other dimensions)
            torch.empty(item[1], dtype=DTYPES[item[0]], device="meta")
        except RuntimeError:
            raise BadMessage(f"a tensor of shape {item[1]} cannot be laid out") from None
        total += math.prod(item[1]) * torch.empty((), dtype=DTYPES[item[0]]).element_size()
    if not is_index(size) or size != total:
        raise BadMessage(f"'size' {size!r} is not the tensors' {total} bytes")
    expected_chunks = max(1, math.ceil(size / chunk_bytes))
    if not isinstance(chunks, list) or len(chunks) != expected_chunks or expected_chunks > MAX_CHUNKS:
        raise BadMessage(f"'chunks' must list {expected_chunks} hashes")
    if not all(isinstance(h, str) and len(h) == 64 for h in chunks):
        raise BadMessage("each chunk hash must be a sha256 hex string")
    _check_skeleton(value["skeleton"], len(tensors), 0)
    if value["digest"] != digest(value):
        raise BadMessage("the manifest's digest does not match its contents")
    return value


def _check_skeleton(value: Any, num_tensors: int, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise BadMessage("the state is nested too deeply")
    if isinstance(value, dict):
        if set(value) == {TENSOR_KEY}:
            if not is_index(value[TENSOR_KEY]) or value[TENSOR_KEY] >= num_tensors:
                raise BadMessage("a tensor reference points past the tensor list")
            return
        for key, item in value.items():
            if not isinstance(key, str):
                raise BadMessage("state keys must be strings")
            _check_skeleton(item, num_tensors, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_skeleton(item, num_tensors, depth + 1)
    elif isinstance(value, int) and not -(1 << 63) <= value < 1 << 64:
        raise BadMessage("an integer in the state does not fit in 64 bits")
    elif value is not None and not isinstance(value, bool | int | float | str):
        raise BadMessage(f"unexpected {type(value).__name__} in the state")


# ---- the donor ----


class StateServer:
    """Serves this peer's shared state at the steps joiners ask for.

    ``current_step()`` is the last inner step this peer finished; ``shared_state()`` returns a copy
    of its shared state (called on the event loop at a step boundary, while training waits);
    ``last_step`` is the run's last step (--steps): a step past it is refused at once, never waited
    for."""

    def __init__(
        self,
        p2p: Any,
        run_id: str,
        fingerprint: str,
        current_step: Callable[[], int],
        shared_state: Callable[[], Any],
        last_step: int,
        chunk_bytes: int = CHUNK_BYTES,
        admits: Callable[[str], bool] = lambda peer: True,
        link_mbps: float = SLOWEST_LINK_MBPS,
    ) -> None:
        self.p2p = p2p
        self.last_step = last_step
        self.link_mbps = link_mbps  # the run's declared link (--bandwidth-mbps)
        self.admits = admits  # whether a peer is a member of the run (``FragmentExchange.is_member``)
        self.limiter = PeerLimiter(Limits(messages_per_s=20.0, burst=40.0, streams=2 * STREAMS_PER_DONOR))
        self.chunk_bytes = chunk_bytes
        self.protocol = state_protocol(run_id)
        self.fingerprint = fingerprint
        self.current_step = current_step
        self.shared_state = shared_state
        self.snapshots: dict[int, asyncio.Future[Snapshot]] = {}
        self.asked_at: dict[int, float] = {}
        self.copied: set[int] = set()  # steps whose state has been copied (the snapshot may be packing)
        self.served: set[int] = set()  # steps a chunk of which was served: a joiner is downloading them
        self.serving = True
        self.copy_s = 0.0  # training time spent copying the state for joiners (the donor's stall)
        self.served_bytes = 0

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.protocol, self._serve)

    async def stop(self) -> None:
        self.serving = False
        with contextlib.suppress(Exception):  # the daemon may already be gone at shutdown
            await self.p2p.remove_binary_stream_handler(self.protocol)

    def step_done(self, step: int) -> None:
        """Called after every inner step (apply, send, apply done): copy the state if asked for."""
        now = time.monotonic()
        for old in [s for s, t in self.asked_at.items() if now - t > KEEP_S]:
            self._drop(old)
        future = self.snapshots.get(step)
        if future is None or step in self.copied:
            return
        started = time.perf_counter()
        state = self.shared_state()
        self.copy_s += time.perf_counter() - started
        self.copied.add(step)
        task = asyncio.ensure_future(asyncio.to_thread(make_snapshot, step, state, self.chunk_bytes))
        task.add_done_callback(lambda t: _settle(future, t))

    async def _serve(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One request of a member: within per-peer limits (a request is small; answers are chunks)."""
        peer = info.peer_id.to_base58()
        asker = peer[:12]
        why = self.limiter.admit(peer, time.monotonic())
        if why is None:
            why = await self._wait_for_member(peer)
            if why is not None:
                self.limiter.done(peer)
        if why is not None:
            if self.limiter.refuse(peer):
                log.warning("refusing state requests from %s: %s", asker, why)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(write_frame(writer, self._refuse(why)), ASK_TIMEOUT_S)
            await close_when_read(reader, writer, ASK_TIMEOUT_S)
            return
        try:
            ask = await read_frame(reader, ASK_TIMEOUT_S, max_size=ASK_BYTES)
            reply = await self._answer(ask)
            # every stream a joiner may hold here (``limiter``) shares this peer's uplink
            link = chunk_link_mbps(self.link_mbps, 2 * STREAMS_PER_DONOR)
            allowance = transfer_allowance_s(len(reply.get("data", b"")), link)
            await asyncio.wait_for(write_frame(writer, reply), ASK_TIMEOUT_S + allowance)
            await close_when_read(reader, writer, ASK_TIMEOUT_S + allowance)  # closing now may lose it
        except BadMessage as exc:
            log.warning("bad state request from %s: %s", asker, exc)
        except (OSError, TimeoutError, ConnectionError) as exc:
            log.info("state request from %s ended early: %s", asker, exc)
        finally:
            self.limiter.done(peer)
            writer.close()

    async def _wait_for_member(self, peer: str) -> str | None:
        """None once ``peer`` is a member on our board; it may have just said "joining" (a peer that
        was away, whose record had lapsed), so its record is given ``ADMIT_WAIT_S`` to show up."""
        deadline = time.monotonic() + ADMIT_WAIT_S
        while not self.admits(peer):
            if time.monotonic() > deadline:
                return "not a member of this run on my board"
            await asyncio.sleep(0.2)
        return None

    async def _answer(self, ask: dict[str, Any]) -> dict[str, Any]:
        step = ask.get("step")
        if not is_index(step):
            raise BadMessage("a state request needs an int 'step' ≥ 0")
        if not self.serving:
            return self._refuse("this peer is not serving its state (leaving, or resyncing)")
        if ask.get("want") == "manifest":
            if ask.get("fingerprint") != self.fingerprint:
                return self._refuse("your options differ from this run's")
            return await self._manifest(step)
        if ask.get("want") == "chunk":
            index = ask.get("index")
            future = self.snapshots.get(step)
            if not is_index(index) or future is None or not future.done() or future.exception():
                return self._refuse(f"no state of step {step} here")
            snapshot = future.result()
            if index >= len(snapshot.manifest["chunks"]):
                return self._refuse(f"no chunk {index}")
            self.asked_at[step] = time.monotonic()
            self.served.add(step)
            data = snapshot.chunk(index)
            self.served_bytes += len(data)
            return {"ok": True, "data": data}
        raise BadMessage("'want' must be 'manifest' or 'chunk'")

    async def _manifest(self, step: int) -> dict[str, Any]:
        future = self.snapshots.get(step)
        if future is None:
            current = self.current_step()
            if step > self.last_step:
                return self._refuse(f"the run ends at step {self.last_step}")
            if step <= current or step - current > MAX_STEPS_AHEAD:
                return self._refuse(f"this peer is at step {current}")
            unserved = sorted(set(self.snapshots) - self.served)
            if len(self.snapshots) >= MAX_SNAPSHOTS and unserved:
                # nobody downloads it: a joiner that asked for it moved on (its other donors were
                # past that step), and its later asks must not find every copy taken
                self._drop(unserved[0], f"replaced by the state of step {step}")
            if len(self.snapshots) >= MAX_SNAPSHOTS:
                return self._refuse("this peer already holds copies of its state for other joiners")
            future = self.snapshots[step] = asyncio.get_running_loop().create_future()
        self.asked_at[step] = time.monotonic()
        try:
            snapshot = await asyncio.wait_for(asyncio.shield(future), SNAPSHOT_WAIT_S)
        except TimeoutError:
            return self._refuse(f"this peer did not reach step {step} within {SNAPSHOT_WAIT_S:.0f} s")
        except StateUnavailable as exc:  # dropped for a newer step's (``_drop``)
            return self._refuse(str(exc))
        except Exception as exc:  # noqa: BLE001 - packing the copy failed: say so, keep serving
            log.warning("could not pack the state of step %d for a joiner: %s", step, exc)
            return self._refuse(f"this peer could not pack its state of step {step}")
        return {"ok": True, "manifest": snapshot.manifest}

    def _drop(self, step: int, why: str = "") -> None:
        """Forget the copy of ``step``'s state; a joiner still waiting for it is told ``why``."""
        future = self.snapshots.pop(step, None)
        if future is not None and not future.done():
            future.set_exception(StateUnavailable(why or f"the state of step {step} was dropped"))
            future.exception()  # retrieved: a joiner may no longer wait for it
        self.asked_at.pop(step, None)
        self.copied.discard(step)
        self.served.discard(step)

    def _refuse(self, detail: str) -> dict[str, Any]:
        return {"ok": False, "step": self.current_step(), "detail": detail[:200]}


def _settle(future: asyncio.Future[Snapshot], task: asyncio.Future[Snapshot]) -> None:
    if future.done():
        return
    if task.exception() is not None:
        future.set_exception(task.exception())  # type: ignore[arg-type]
    else:
        future.set_result(task.result())


def state_protocol(run_id: str) -> str:
    return f"p2p-cocodc/{run_id}/state/1"


# ---- the joiner ----


@dataclass
class Pulled:
    step: int
    state: Any
    donors: list[str]  # the donors whose manifests agreed
    seconds: float
    num_bytes: int


async def pull_state(
    p2p: Any,
    run_id: str,
    fingerprint: str,
    donors: list[str],
    step: int,
    step_time_s: float,
    last: int,
    link_mbps: float = SLOWEST_LINK_MBPS,
    pause: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> Pulled:
    """The shared state at a step boundary ≥ ``step`` (and ≤ ``last``, the run's last step) that every
    asked donor agrees on.

    Asks every donor for its manifest at ``step``. A donor already past it answers with the step it
    is at: the next ask goes that far plus 2 and the steps (``step_time_s`` each) that two of that
    answer's round trips take, doubled with every ask that came too late (the board's step time can
    be older and slower than the donors are now, and a loaded machine's round trips vary), never
    past ``last`` (a donor would wait for a step its run never reaches, and end before it answers).
    ``link_mbps``: this peer's declared link, which every chunk in flight shares
    (``chunk_link_mbps``). Needs the manifests of min(2, donors) donors, all with one digest (θ̄ is
    bit-identical on live peers: a disagreement means a split swarm, never papered over); after an
    ask that too few answered, it waits (``pause``, the clock) ``UNANSWERED_PAUSES_S`` and asks all
    of them again."""
    started = time.perf_counter()
    need = min(2, len(donors))
    step = min(step, last)
    late = unanswered = 0  # asks that came after the donors had passed the step; asks too few answered
    reasons: list[str] = []
    for attempt in range(ATTEMPTS):
        ask = {"want": "manifest", "step": step, "fingerprint": fingerprint}
        answers = await asyncio.gather(*(_timed_ask(p2p, run_id, d, ask) for d in donors))
        manifests: dict[str, dict[str, Any]] = {}
        past: list[tuple[int, float]] = []  # (the step a donor is at, how long its answer took)
        reasons = []
        for donor, (answer, seconds) in zip(donors, answers, strict=True):
            if isinstance(answer, str):
                reasons.append(f"{donor[:12]}: {answer}")
            elif answer.get("ok") is True:
                try:
                    manifests[donor] = parse_manifest(answer.get("manifest"), step)
                except BadMessage as exc:
                    reasons.append(f"{donor[:12]}: bad manifest ({exc})")
            else:
                at = answer.get("step")
                reasons.append(f"{donor[:12]}: {str(answer.get('detail'))[:200]}")
                if is_index(at) and at >= step:
                    past.append((at, seconds))
        if past:
            furthest, seconds = max(past)
            if furthest >= last:
                raise StateUnavailable(f"the run ended (step {last}) before its state could be taken")
            ahead = 2 + math.ceil(2 * seconds / max(step_time_s, 1e-3))
            step, late = min(furthest + ahead * 2**late, last), late + 1
            continue
        if len(manifests) < need:
            if unanswered < len(UNANSWERED_PAUSES_S) and attempt < ATTEMPTS - 1:
                wait = UNANSWERED_PAUSES_S[unanswered]
                log.info("%d of %d donors gave their state (%s); asking again in %.0f s", len(manifests),
                         need, "; ".join(reasons), wait)  # fmt: skip
                unanswered += 1
                await pause(wait)
                continue
            raise StateUnavailable(
                f"fewer than {need} donors gave their state, asked {attempt + 1} times over "
                f"{time.perf_counter() - started:.0f} s: {'; '.join(reasons)}"
            )
        digests = {m["digest"] for m in manifests.values()}
        if len(digests) > 1:
            raise StateUnavailable(
                f"the donors hold different states at step {step} ({len(digests)} digests): the swarm "
                "is split"
            )
        manifest = next(iter(manifests.values()))
        blob = await _download(p2p, run_id, list(manifests), manifest, link_mbps)
        return Pulled(step, unpack(manifest, blob), list(manifests), time.perf_counter() - started, len(blob))
    raise StateUnavailable(
        f"the donors kept moving past the asked step, or did not reach it (last {step}: {'; '.join(reasons)})"
    )


async def _download(
    p2p: Any, run_id: str, donors: list[str], manifest: dict[str, Any], link_mbps: float
) -> bytes:
    """Every chunk, from all donors at once (``STREAMS_PER_DONOR`` each); a chunk that fails or
    does not match its hash is asked of another donor, and a donor that fails twice is dropped."""
    step, hashes = manifest["step"], manifest["chunks"]
    chunks: dict[int, bytes] = {}
    todo: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(hashes)):
        todo.put_nowait(i)
    failures: dict[str, int] = dict.fromkeys(donors, 0)
    link = chunk_link_mbps(link_mbps, len(donors) * STREAMS_PER_DONOR)

    async def worker(donor: str) -> None:
        while failures[donor] < 2 and len(chunks) < len(hashes):
            try:
                index = todo.get_nowait()
            except asyncio.QueueEmpty:
                if len(chunks) == len(hashes) or all(n >= 2 for n in failures.values()):
                    return
                await asyncio.sleep(0.05)  # another donor holds the last chunks: it may fail them
                continue
            ask = {"want": "chunk", "step": step, "index": index}
            answer = await _ask(p2p, run_id, donor, ask, link)
            data = answer.get("data") if isinstance(answer, dict) and answer.get("ok") is True else None
            if isinstance(data, bytes) and hashlib.sha256(data).hexdigest() == hashes[index]:
                chunks[index] = data
            else:
                failures[donor] += 1
                why = answer if isinstance(answer, str) else str(answer.get("detail", "a wrong hash"))[:200]
                log.warning("chunk %d of the state from %s was bad or missing (%s)", index, donor[:12], why)
                todo.put_nowait(index)

    await asyncio.gather(*(worker(d) for d in donors for _ in range(STREAMS_PER_DONOR)))
    if len(chunks) < len(hashes):
        missing = len(hashes) - len(chunks)
        raise StateUnavailable(f"{missing} chunks of the state could not be had from any donor")
    return b"".join(chunks[i] for i in range(len(hashes)))[: manifest["size"]]


async def _timed_ask(
    p2p: Any, run_id: str, donor: str, ask: dict[str, Any]
) -> tuple[dict[str, Any] | str, float]:
    """``_ask``, and the seconds its answer took."""
    started = time.perf_counter()
    answer = await _ask(p2p, run_id, donor, ask)
    return answer, time.perf_counter() - started


async def _ask(
    p2p: Any, run_id: str, donor: str, ask: dict[str, Any], link_mbps: float = SLOWEST_LINK_MBPS
) -> dict[str, Any] | str:
    """One request to a donor: its answer (allowed its size at ``link_mbps`` on top of
    ``ASK_TIMEOUT_S``), or a string saying what went wrong."""
    from hivemind.p2p import PeerID

    writer = None
    try:
        _, reader, writer = await asyncio.wait_for(
            p2p.call_binary_stream_handler(PeerID.from_base58(donor), state_protocol(run_id)), ASK_TIMEOUT_S
        )
        if asyncio.current_task().cancelling():  # type: ignore[union-attr]
            # cancelled as the stream opened: 3.11's wait_for then returns the stream and drops the
            # cancel, and a stopped joiner waited out the ask to a frozen donor (30 s)
            raise asyncio.CancelledError
        await asyncio.wait_for(write_frame(writer, ask), ASK_TIMEOUT_S)
        wait = SNAPSHOT_WAIT_S + ASK_TIMEOUT_S if ask["want"] == "manifest" else ASK_TIMEOUT_S
        return await read_frame(reader, wait, link_mbps=link_mbps)
    except BadMessage as exc:
        return f"bad answer ({exc})"
    except Exception as exc:  # noqa: BLE001 - p2pd client errors have no common base
        return f"{type(exc).__name__}: {exc}"[:200]
    finally:
        if writer is not None:
            writer.close()
