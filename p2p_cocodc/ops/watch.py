"""What the bootstrap keeps so that operators can watch a run: each peer's history, a word on its
health, and how the runs it saw end ended, served by its HTTP server (``/history``, ``/status``) and
drawn by the page in web/.

Records come from untrusted peers, so everything kept is bounded: at most ``MAX_SERIES`` peers
(all runs together) are followed, the one seen longest ago dropped first, and each keeps at most
``MAX_POINTS`` points. A full series drops every other point and takes points half as often from
then on, so it always spans the whole run at an even spacing (a ring buffer would keep only its
last minutes, and a long run's perplexity curve is what an operator wants to see).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from p2p_cocodc.peer.lobby import run_end
from p2p_cocodc.swarm.records import PeerRecord

POINT_FIELDS = ("t", "step", "val_ppl", "tokens_per_s", "bytes_sent", "bytes_received", "stall_s")
MAX_SERIES = 64
MAX_ENDED = 16  # ended runs remembered (with their peers' last records), all runs together
MAX_POINTS = 512  # even: thinning a full series keeps its newest point
FIRST_SPACING_S = 1.0
# the status page: file name -> content type; served at /status.html (and /), /status.js, /status.css
PAGE_FILES = {
    "status.html": "text/html; charset=utf-8",
    "status.js": "text/javascript; charset=utf-8",
    "status.css": "text/css; charset=utf-8",
}


def page_files() -> dict[str, tuple[str, bytes]]:
    """{file name: (content type, bytes)} of the status page, read from the package."""
    web = resources.files("p2p_cocodc") / "web"
    return {name: (kind, (web / name).read_bytes()) for name, kind in PAGE_FILES.items()}


@dataclass
class Series:
    """One peer's points: tuples in ``POINT_FIELDS`` order, oldest first."""

    region: str
    seen: float  # when its record was last read
    points: list[tuple[Any, ...]] = field(default_factory=list)
    spacing_s: float = FIRST_SPACING_S

    def add(self, point: tuple[Any, ...]) -> None:
        """The newest point follows each read until it lies ``spacing_s`` past the one before;
        then it stays, and the next read starts a new newest point."""
        if len(self.points) >= 2 and self.points[-1][0] - self.points[-2][0] < self.spacing_s:
            self.points[-1] = point
            return
        self.points.append(point)
        if len(self.points) > MAX_POINTS:
            del self.points[1::2]
            self.spacing_s *= 2


class History:
    """The series of every peer the bootstrap has read, by (run id, peer id)."""

    def __init__(self) -> None:
        self.series: dict[tuple[str, str], Series] = {}

    def add(self, run_id: str, peer: str, record: PeerRecord, now: float) -> None:
        key = (run_id, peer)
        series = self.series.get(key)
        if series is None:
            if len(self.series) >= MAX_SERIES:  # the one seen longest ago goes (the shortest of those)
                oldest = min(self.series.items(), key=lambda item: (item[1].seen, len(item[1].points)))
                del self.series[oldest[0]]
            series = self.series[key] = Series(record.region, now)
        series.region = record.region
        series.seen = now
        series.add(
            (
                round(now, 1),
                record.step,
                record.val_ppl if record.val_ppl >= 0 else None,  # none yet: a gap in the chart
                round(record.tokens_per_s, 1),
                record.bytes_sent,
                record.bytes_received,
                round(record.stall_s, 2),
            )
        )

    def to_json(self) -> dict[str, Any]:
        """{"fields": POINT_FIELDS, "runs": {run id: {peer id: {"region", "points"}}}}"""
        runs: dict[str, dict[str, Any]] = {}
        for (run_id, peer), series in self.series.items():
            runs.setdefault(run_id, {})[peer] = {"region": series.region, "points": series.points}
        return {"fields": POINT_FIELDS, "runs": runs}


class Endings:
    """The runs the bootstrap saw end, each with the step it ended at (every peer of it on the board
    done: ``peer/lobby.py`` ``run_end``), its --steps as its peers published them, when it was seen
    to end, and its peers' last records. Their done records leave the board 2 minutes after the end;
    kept here, ``p2p-cocodc status`` asked later still says how the run ended. At most ``MAX_ENDED``
    runs (the one that ended longest ago goes first); a run id seen taking part again (a new run
    under it) is forgotten."""

    def __init__(self) -> None:
        self.runs: dict[str, dict[str, Any]] = {}

    def read(
        self, run_id: str, records: dict[str, PeerRecord], info: Any, views: dict[str, Any], now: float
    ) -> None:
        """One read of a run's records (``views``: as /status shows them), at wall time ``now``."""
        step = run_end(records.values())
        if step is None:
            if records:  # some peer takes part: not an ended run (any more)
                self.runs.pop(run_id, None)
            return
        known = self.runs.get(run_id)
        options = info.get("options") if isinstance(info, dict) else None
        steps = options.get("--steps") if isinstance(options, dict) else None
        self.runs[run_id] = {
            "step": max(step, known["step"]) if known else step,
            "steps": steps if isinstance(steps, int) and not isinstance(steps, bool) else None,
            "at": known["at"] if known else now,
            "info": info,
            "peers": {**(known["peers"] if known else {}), **views},  # a record gone meanwhile stays
        }
        if len(self.runs) > MAX_ENDED:
            del self.runs[min(self.runs, key=lambda r: self.runs[r]["at"])]

    def to_json(self) -> dict[str, Any]:
        """{run id: {"step", "steps", "at", "info", "peers": {peer id: its last record's view}}}"""
        return self.runs


def health(records: dict[str, PeerRecord], ages: dict[str, float]) -> dict[str, list[str]]:
    """Words on each peer of one run, from its record, its age (seconds since it was written) and
    the others' records; none when all is well:

    - ``stale record N s``: not rewritten for half its lifetime (4 missed heartbeats on a good link)
    - ``other options``: a configuration or swarm key that most of the run's peers do not share
    - ``behind``: a fragment more than one sync behind the furthest training peer's
    - ``θ̄ differs``: at the step of its latest digest, most peers hold another θ̄
    - ``θ̄ in doubt``: it could not learn whether a sync completed, and the θ̄ vote has not settled it
    - ``refused N``: it refused N messages (from non-members, or past the per-peer limits)
    - ``refused by K``, ``outlier for K``: K peers refused its messages, or left its slices out
    """
    words: dict[str, list[str]] = {p: [] for p in records}
    usual = _majority(Counter((r.fingerprint, r.key_id) for r in records.values()))
    same = {p: r for p, r in records.items() if (r.fingerprint, r.key_id) == usual}
    training = [r.versions for r in same.values() if r.state == "training"]
    furthest = [max(v) for v in zip(*training, strict=False)] if training else []
    digests: dict[int, Counter[str]] = {}
    for r in same.values():
        if r.theta_step >= 0:
            digests.setdefault(r.theta_step, Counter())[r.theta_sha] += 1
    refused_by: Counter[str] = Counter()
    outlier_for: Counter[str] = Counter()
    for q, r in records.items():
        refused_by.update(p for p in r.refused if p != q)
        outlier_for.update(p for p in r.outliers if p != q)
    for p, r in records.items():
        said = words[p]
        if ages[p] > r.ttl_s / 2 and r.state not in ("leaving", "done"):
            said.append(f"stale record {ages[p]:.0f} s")
        if p not in same:
            said.append("other options")
            continue
        if r.state == "training" and len(r.versions) == len(furthest):
            if any(v < f - 1 for v, f in zip(r.versions, furthest, strict=True)):
                said.append("behind")
        if r.theta_step >= 0 and _majority(digests[r.theta_step]) not in (None, r.theta_sha):
            said.append("θ̄ differs")
        if 0 <= r.theta_doubt and r.joined_at <= r.theta_doubt:  # not since taken the swarm's state
            said.append("θ̄ in doubt")
    for p, said in words.items():
        if refused := sum(records[p].refused.values()):
            said.append(f"refused {refused}")
        if refused_by[p]:
            said.append(f"refused by {refused_by[p]}")
        if outlier_for[p]:
            said.append(f"outlier for {outlier_for[p]}")
    return words


def _majority(counts: Counter[Any]) -> Any:
    """The value counted more often than all the others together, or None."""
    if not counts:
        return None
    value, count = counts.most_common(1)[0]
    return value if 2 * count > counts.total() else None
