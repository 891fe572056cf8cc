"""A hostile member of a swarm, for the hostile-peer tests: a real peer (``p2p-cocodc join``, with the
swarm key) with one behaviour changed. Run it as ``python -m tests.hostile_peer MODES join ...``:

- ``scale``: every outer gradient it sends is 10× its real one;
- ``flip``: every outer gradient it sends points the other way (−1×);
- ``replay``: it sends, in every round of a fragment, its first outer gradient of that fragment;
- ``flood``: at every round it reaches, it also opens 40 rounds that never end on every peer;
- ``forge``: at every round it reaches, it hands every peer a group of that peer alone (each would
  complete the round alone, and θ̄ would split);
- ``pairs``: at every round it reaches, it hands each peer behind it in that round's line, and in
  the line of the next three rounds of the same fragment, a group of the two of them, which it
  never runs (issue 19's forged-groups attack: the list passes the "forged list of one" check);
- ``nan``: every outer gradient it sends is NaN (a broken region: every round it is in fails);
- ``drift``: right before its last evaluation, its θ̄ moves by 1e-3 in one value: a split no round
  sees, which only the peers' comparison of θ̄ digests can catch.
- ``drift-early``: the same, right before its first evaluation after step 0 (mid-run).
- ``mute``: in the run's first round (``MUTED``), it hears nothing and says nothing, while it stays
  on the board (a peer the others cannot reach, though it reaches the DHT: every peer of that round
  settles it undecided).

MODES is a comma-separated list. Everything else is the landed peer, unchanged.
"""

from __future__ import annotations

import sys

import torch

from p2p_cocodc.peer.syncs import SwarmReplica
from p2p_cocodc.swarm.exchange import FragmentExchange
from p2p_cocodc.swarm.lanes import Lanes
from p2p_cocodc.swarm.messages import Group, Join
from p2p_cocodc.swarm.round_events import leader_rank

MODES = ("scale", "flip", "replay", "flood", "forge", "pairs", "nan", "drift", "drift-early", "mute")
MUTED = "f0:4"  # the first round of the tests' runs (TINY_SYNCS: fragment 0 is sent after step 4)


def by_shard(member: tuple[str, int]) -> int:
    return member[1]


def corrupt(modes: set[str]) -> None:
    honest = FragmentExchange.allreduce
    first: dict[str, torch.Tensor] = {}
    last_step: dict[str, int] = {}  # fragment -> the step of its last round here

    async def allreduce(
        self, round_id, vector, step, take_part=True, pace=0, recent=(0, 0), codec=None, earlier=None
    ):  # type: ignore[no-untyped-def]
        if take_part:
            if "scale" in modes:
                vector = vector * 10.0
            if "flip" in modes:
                vector = -vector
            if "nan" in modes:
                vector = torch.full_like(vector, float("nan"))
            if "replay" in modes:
                vector = first.setdefault(round_id.split(":")[0], vector.clone())
            if "flood" in modes:
                for peer in self._board():
                    for i in range(40):
                        self.lanes.send(peer, [Join(f"flood-{step}-{i}", self.shard, self.fingerprint)])
            if "forge" in modes:
                for peer, record in self.board_view().items():
                    if peer != self.peer_id and record.shard is not None:
                        self.lanes.send(peer, [Group(round_id, ((peer, record.shard),), 0)])
            if "pairs" in modes:
                fragment = round_id.split(":")[0]
                every = step - last_step.get(fragment, step)
                last_step[fragment] = step
                ahead = [f"{fragment}:{step + k * every}" for k in range(1, 4)] if every > 0 else []
                for rid in [round_id, *ahead]:
                    for peer, record in self.board_view().items():
                        if peer == self.peer_id or record.shard is None:
                            continue
                        if leader_rank(rid, self.peer_id) < leader_rank(rid, peer):
                            pair = sorted([(self.peer_id, self.shard), (peer, record.shard)], key=by_shard)
                            self.lanes.send(peer, [Group(rid, tuple(pair), 0)])
        return await honest(self, round_id, vector, step, take_part, pace, recent, codec, earlier)

    FragmentExchange.allreduce = allreduce  # type: ignore[method-assign]
    if modes & {"drift", "drift-early"}:
        evaluated = SwarmReplica.evaluated

        async def drifted(self, step, state, record, started):  # type: ignore[no-untyped-def]
            if step == (self.cfg.steps if "drift" in modes else self.cfg.eval_every):
                with torch.no_grad():
                    self.strategy.outer[0].global_params[0] += 1e-3
            return await evaluated(self, step, state, record, started)

        SwarmReplica.evaluated = drifted  # type: ignore[method-assign]
    if "mute" in modes:
        receive, send = FragmentExchange.receive, Lanes.send

        def deaf(self, sender, message):  # type: ignore[no-untyped-def]
            if getattr(message, "round_id", None) != MUTED:
                receive(self, sender, message)

        def silent(self, to, messages):  # type: ignore[no-untyped-def]
            if kept := [m for m in messages if getattr(m, "round_id", None) != MUTED]:
                send(self, to, kept)

        FragmentExchange.receive = deaf  # type: ignore[method-assign]
        Lanes.send = silent  # type: ignore[method-assign]


def main() -> None:
    modes = set(sys.argv[1].split(","))
    unknown = modes - set(MODES)
    if unknown:
        sys.exit(f"unknown modes {sorted(unknown)}: use {', '.join(MODES)}")
    corrupt(modes)
    from p2p_cocodc.cli.main import main as cli_main

    sys.argv = ["p2p-cocodc", *sys.argv[2:]]
    cli_main()


if __name__ == "__main__":
    main()
