"""A hostile member of a swarm, for the hostile-peer tests: a real peer (``p2p-cocodc join``, with the
swarm key) with one behaviour changed. Run it as ``python -m tests.hostile_peer MODES join ...``:

- ``scale``: every outer gradient it sends is 10× its real one;
- ``flip``: every outer gradient it sends points the other way (−1×);
- ``replay``: it sends, in every round of a fragment, its first outer gradient of that fragment;
- ``flood``: at every round it reaches, it also opens 40 rounds that never end on every peer;
- ``forge``: at every round it reaches, it hands every peer a group of that peer alone (each would
  complete the round alone, and θ̄ would split);
- ``nan``: every outer gradient it sends is NaN (a broken region: every round it is in fails);
- ``drift``: right before its last evaluation, its θ̄ moves by 1e-3 in one value: a split no round
  sees, which only the peers' comparison of θ̄ digests can catch.
- ``drift-early``: the same, right before its first evaluation after step 0 (mid-run).

MODES is a comma-separated list. Everything else is the landed peer, unchanged.
"""

from __future__ import annotations

import sys

import torch

from p2p_cocodc.peer.syncs import SwarmReplica
from p2p_cocodc.swarm.exchange import FragmentExchange
from p2p_cocodc.swarm.messages import Group, Join

MODES = ("scale", "flip", "replay", "flood", "forge", "nan", "drift", "drift-early")


def corrupt(modes: set[str]) -> None:
    honest = FragmentExchange.allreduce
    first: dict[str, torch.Tensor] = {}

    async def allreduce(self, round_id, vector, step, take_part=True, pace=0):  # type: ignore[no-untyped-def]
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
                        self._start_send(peer, Join(f"flood-{step}-{i}", self.shard, self.fingerprint))
            if "forge" in modes:
                for peer, record in self.board_view().items():
                    if peer != self.peer_id and record.shard is not None:
                        self._start_send(peer, Group(round_id, ((peer, record.shard),), 0))
        return await honest(self, round_id, vector, step, take_part, pace)

    FragmentExchange.allreduce = allreduce  # type: ignore[method-assign]
    if modes & {"drift", "drift-early"}:
        evaluated = SwarmReplica.evaluated

        async def drifted(self, step, state, record, started):  # type: ignore[no-untyped-def]
            if step == (self.cfg.steps if "drift" in modes else self.cfg.eval_every):
                with torch.no_grad():
                    self.strategy.outer[0].global_params[0] += 1e-3
            return await evaluated(self, step, state, record, started)

        SwarmReplica.evaluated = drifted  # type: ignore[method-assign]


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
