"""The round machine's butterfly (its RUNNING phase, ``swarm/round.py``): the round's slices, the
parts and means this peer holds of them, and their deliveries.

A vector is cut into S = M·C slices (``algorithms/butterfly.py``): member j of the M owns slices
j, j + M, ..., each a piece of its share. Every member sends its encoding of each slice to the
slice's owner (a PART), the owner reduces a slice as soon as every member's part of it is in and
sends the mean to every member (a RESULT), and each member assembles the S means. An owner of
several pieces reduces and sends back the first while the later ones are on their way
(``swarm/lanes.py`` sends a peer's pieces in order on one stream). Deliveries are re-sent until
acknowledged, per piece (acknowledgements and re-sends are kept by the piece's number, 0 for a
member's only slice).

``Butterfly`` is a part of ``RoundMachine`` (its state is the machine's, set up there)."""

from __future__ import annotations

import torch

from p2p_cocodc.algorithms.butterfly import round_slice_sizes
from p2p_cocodc.algorithms.inner_share import weight
from p2p_cocodc.swarm.messages import Code, Members, Part, Result
from p2p_cocodc.swarm.round_events import Completed, Compute, Effect, Job, Phase, short


class Butterfly:
    """The butterfly's steps and bookkeeping, for ``RoundMachine`` (which sets up its state)."""

    me: str
    members: Members | None
    vector: torch.Tensor | None
    sizes: list[int]  # of the S slices
    slices: list[bytes] | None  # this peer's encodings of them
    parts: dict[tuple[str, int], bytes]  # (member, slice) -> its encoding, for the slices this peer owns
    results: dict[int, bytes]  # slice -> its owner's encoded mean

    def _check_size(self, sender: str, msg: Part, now: float, out: list[Effect]) -> None:
        if self.sizes and msg.numel != self.sizes[msg.index]:
            why = f"peer {short(sender)} sent slice {msg.index} of {msg.numel} values"
            self._recover(now, out, f"{why}, expected {self.sizes[msg.index]}")

    def _enter_group(self, now: float, out: list[Effect]) -> None:
        assert self.members is not None and self.vector is not None
        if not self._is_member(self.me):
            self._recover(now, out, "not in the round's group (too late for its leader)")
            return
        self.phase = Phase.RUNNING
        self.adopted_at = max(self.adopted_at, self.started_at)
        if len(self.members) == 1:  # the average is our own vector (read only, never written: no copy)
            self._settle(Completed(self.vector, self.members, self.pace, by_butterfly=True), now, out)
            return
        self.sizes = round_slice_sizes(self.vector.numel(), len(self.members), self.codec, self.piece_bytes)
        for sender, s in list(self.parts):
            if sender != self.me and len(self.parts[(sender, s)]) != self.codec.wire_bytes(self.sizes[s]):
                self._recover(now, out, f"peer {short(sender)} sent a slice of the wrong size")
                return
        self.jobs_out.add("encode")
        out.append(Compute(Job("encode", (self.vector, self._slices()))))

    def _run(self, now: float, out: list[Effect]) -> None:
        assert self.members is not None
        peers = [p for p, _ in self.members]
        if self.slices is not None:
            for s, data in enumerate(self.slices):
                if (owner := peers[s % len(peers)]) != self.me:
                    self._deliver(out, owner, Code.PART, s, data, now)
        for s in self._mine() if self.slices is not None else ():
            if s not in self.results and f"reduce {s}" not in self.jobs_out and self._all_parts(s):
                self.jobs_out.add(f"reduce {s}")
                kept = tuple(p for p in peers if p not in self.replayed)  # a replayed slice never counts
                earlier = tuple(self.earlier_cosines.get(p, ()) for p in kept)
                inputs = ([self.parts[(p, s)] for p in kept], self.sizes[s], self.aggregation, kept, earlier)
                weights = tuple(weight(*self.recent.get(p, (0, 0))) for p in kept)
                out.append(Compute(Job("reduce", (*inputs, len(peers), weights, s))))  # M: the mean's format
        for s in self._mine():
            for peer in peers if s in self.results else ():
                if peer != self.me:
                    self._deliver(out, peer, Code.RESULT, s, self.results[s], now)
        if len(self.results) == self._slices() and "assemble" not in self.jobs_out:
            self.jobs_out.add("assemble")
            means = [self.results[s] for s in range(self._slices())]
            out.append(Compute(Job("assemble", (means, list(self.sizes), len(peers)))))
            return
        wire = self.codec.round_bytes(self.vector.numel() if self.vector is not None else 0, len(peers))
        if now >= self.deadlines.allreduce_by(self.adopted_at, wire):
            self._recover(now, out, "the all-reduce timed out")
            return
        missing = [p for p in peers if not self._has_all_of(p)]
        gone = [p for p in missing if p != self.me and p not in self.present(now) - self.gave_up]
        if gone:
            self._recover(now, out, f"member {short(gone[0])} is gone")

    def _deliver(self, out: list[Effect], peer: str, code: Code, index: int, data: bytes, now: float) -> None:
        """Send a PART or RESULT until the member acknowledges it (or is gone)."""
        if (code, peer, self._piece(index)) in self.acked or peer in self.finished_with:
            return
        if peer not in self.present(now):
            return  # a member that is leaving still needs our slices: it is finishing this round
        if self._due(code, peer, now, self.deadlines.resend_after(len(data)), index):
            assert self.members is not None
            recent = self.recent[self.me] if code == Code.PART else (0, 0)
            message = (Part if code == Code.PART else Result)(
                self.round_id, self.members, self.pace, index, self.sizes[index], data, *recent
            )
            self._send(out, peer, message, now)

    def _undelivered_results(self, now: float) -> list[str]:
        if (
            not isinstance(self.outcome, Completed)
            or not self.outcome.by_butterfly
            or not self._reduced_all()
        ):
            return []
        if now >= self.deadlines.allreduce_by(self.adopted_at, 0) + self.deadlines.answer_s:
            return []
        peers = [p for p, _ in self.outcome.members if p != self.me]
        unacked = [
            p for p in peers if any((Code.RESULT, p, self._piece(s)) not in self.acked for s in self._mine())
        ]
        return [p for p in unacked if p not in self.finished_with and p in self.present(now)]

    def _deliver_results(self, now: float, out: list[Effect]) -> None:
        for peer in self._undelivered_results(now):
            for s in self._mine():
                self._deliver(out, peer, Code.RESULT, s, self.results[s], now)

    def _slices(self) -> int:
        """S: the round's slices, M·C (``pieces_per_member``); M before this peer cut its vector."""
        return len(self.sizes) or len(self.members or ())

    def _piece(self, index: int) -> int:
        """Which of its owner's pieces slice ``index`` is (always 0 with one slice a member)."""
        count = len(self.members or ())
        return index // count if self._slices() > count else 0

    def _owned(self, peer: str) -> range:
        """The slices ``peer`` owns: member j of M owns j, j + M, ... (none if it is not a member)."""
        peers = [p for p, _ in self.members or ()]
        return range(peers.index(peer), self._slices(), len(peers)) if peer in peers else range(0)

    def _mine(self) -> range:
        return self._owned(self.me)

    def _all_parts(self, s: int) -> bool:
        return all((p, s) in self.parts for p, _ in self.members or ())

    def _has_all_of(self, peer: str) -> bool:
        """Whether we hold everything ``peer`` owes us: its parts of our slices, the means of its own."""
        owed = all((peer, s) in self.parts for s in self._mine())
        return owed and all(s in self.results for s in self._owned(peer))

    def _reduced_all(self) -> bool:
        """Whether this peer, a member, holds the means of all its slices."""
        mine = self._mine()
        return len(mine) > 0 and all(s in self.results for s in mine)

    def _reduced_any(self) -> bool:
        """Whether a mean of ours is sent or under way: our group can no longer be left for another."""
        return any(k.startswith("reduce") for k in self.jobs_out) or any(
            s in self.results for s in self._mine()
        )

    def _ran_with(self, sender: str) -> bool:
        """Whether ``sender`` sent us a part, or we hold a mean it owns."""
        return any(p == sender for p, _ in self.parts) or any(s in self.results for s in self._owned(sender))
