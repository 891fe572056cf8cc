"""Per-remote-peer limits, so that no peer can exhaust another: pure bookkeeping, the caller passes
the time. The exchange (``swarm/exchange.py``) and the state server (``swarm/state_transfer.py``)
ask it before they read a message, and refuse what exceeds it; ``refused`` counts refusals by peer,
for the log, the summary and the notice board.

Defaults (``Limits``), and what an honest peer needs of each:

- 200 messages per second from one peer, in bursts of up to 400 (token bucket): a round costs each
  pair of peers a handful of messages, re-sent every 2 s at most;
- 16 messages from one peer read at once, and twice the run's largest message buffered from it:
  an honest peer sends one round's bulk deliveries at a time on each link (``swarm/lanes.py``);
- 16 rounds one peer may open here before this peer reaches them: a peer runs at most a few rounds
  ahead, since it waits for their results (and 64 from all peers, ``exchange.MAX_OPEN_ROUNDS``).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

MAX_TRACKED = 1024  # peers whose rates are remembered (strangers may come with many ids)


@dataclass(frozen=True)
class Limits:
    messages_per_s: float = 200.0
    burst: float = 400.0
    streams: int = 16
    open_rounds: int = 16
    buffered_bytes: int = 2 << 30  # set per run: twice the largest message it can carry


class PeerLimiter:
    """Token buckets, streams and bytes in flight per remote peer."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # peer -> (tokens, at)
        self.reading: Counter[str] = Counter()  # messages being read, by peer
        self.buffered: Counter[str] = Counter()  # bytes announced by messages being read, by peer
        self.refused: Counter[str] = Counter()

    def admit(self, peer: str, now: float) -> str | None:
        """Whether a new message from ``peer`` may be read: None, or why not (the caller counts the
        refusal with ``refuse``). Admitted messages must be released with ``done``."""
        tokens, at = self.buckets.pop(peer, (self.limits.burst, now))
        tokens = min(self.limits.burst, tokens + (now - at) * self.limits.messages_per_s)
        why = None
        if tokens < 1.0:
            why = f"more than {self.limits.messages_per_s:.0f} messages per second"
        elif self.reading[peer] >= self.limits.streams:
            why = f"more than {self.limits.streams} messages at once"
        else:
            tokens -= 1.0
            self.reading[peer] += 1
        self.buckets[peer] = (tokens, now)
        if len(self.buckets) > MAX_TRACKED:
            self.buckets.popitem(last=False)
        return why

    def reserve(self, peer: str, num_bytes: int) -> str | None:
        """Before reading a message's body of ``num_bytes``: None, or why it must not be read."""
        if self.buffered[peer] + num_bytes > self.limits.buffered_bytes:
            return f"more than {self.limits.buffered_bytes} bytes buffered from one peer"
        self.buffered[peer] += num_bytes
        return None

    def done(self, peer: str, num_bytes: int = 0) -> None:
        self.reading[peer] -= 1
        self.buffered[peer] -= num_bytes
        if self.reading[peer] <= 0:
            del self.reading[peer]
            self.buffered.pop(peer, None)

    def refuse(self, peer: str) -> bool:
        """Count a refusal; True for the ones worth a log line (the first, then every 100th)."""
        self.refused[peer] += 1
        if len(self.refused) > MAX_TRACKED:
            least = min(self.refused, key=self.refused.__getitem__)
            del self.refused[least]
        return self.refused[peer] % 100 == 1

    def worst(self, count: int = 4) -> dict[str, int]:
        """The peers refused most often, with their counts (what the board and /status show)."""
        return dict(self.refused.most_common(count))
