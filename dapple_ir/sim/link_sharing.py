"""Flows over shared links: each link's bandwidth is split equally among the flows crossing it.

A flow moves a number of bytes over a path of links (`dapple_ir.cluster.topology.Network.path`). Its
rate is the smallest equal share along its path, `min over its links l of bandwidth_l / flows_l`, and
is recomputed whenever a flow starts or ends on one of its links; between those events it is
constant, so a flow's end is exact, not stepped. No link ever carries more than its bandwidth, so
no schedule of flows ends before any link's bytes / bandwidth.

A flow may count for several on its links (its *weight*; a unit flow counts 1): where the simulator runs one
data-parallel replica for all (`dapple_ir.sim.symmetry`), each of its transfers counts for the R replicas' alike
(weight R, over bandwidths R times the links'), and each step of a ring over the replicas, mapped onto the one
replica's links, for itself (weight 1); each link then holds R times the flows it holds in the whole plan, and
every rate is the whole plan's.

Flows with the same path always move at the same rate, so they are kept together as one *bundle*:
the bundle keeps a clock of the bytes each of its flows has moved since it began (each flow ends
when that clock has advanced by its bytes since the flow joined), and only the bundle's first end
is ever scheduled. A flow that starts or ends changes the rates of the bundles on its own links
only, and each answer lists the bundles whose first end moved, with a version number that makes
earlier end events of the same bundle stale.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

#: (bundle, when its first flow ends at the current rate, version): an end event to (re)schedule.
Reschedule = tuple[int, float, int]

#: Relative slack under which two flows of a bundle end together (float rounding of its clock).
_SAME_END = 1e-12


@dataclass(slots=True)
class _Bundle:
    links: tuple[int, ...]
    ends: list[tuple[float, int]] = field(default_factory=list)
    """(the bundle clock at which the flow is through, flow): a heap."""
    clock: float = 0.0
    """Bytes each flow of the bundle has moved since the bundle was made, as of `since`."""
    rate: float = 0.0
    since: float = 0.0
    version: int = 0
    weight: int = 0
    """The weights of its flows in flight, together."""


@dataclass
class LinkSharing:
    """The flows in flight over links of the given bandwidths (bytes/s; `inf` for a free link)."""

    bandwidth: list[float]
    carried: list[float] = field(default_factory=list)
    """Bytes each link has carried (counted when a flow starts)."""
    _flows_on: list[int] = field(default_factory=list)
    _bundles_on: list[set[int]] = field(default_factory=list)
    _bundles: list[_Bundle] = field(default_factory=list)
    _bundle_of: dict[tuple[int, ...], int] = field(default_factory=dict)
    _next_flow: int = 0
    _weights: dict[int, int] = field(default_factory=dict)
    """Flow -> its weight, where not 1."""

    def __post_init__(self) -> None:
        self.carried = [0.0] * len(self.bandwidth)
        self._flows_on = [0] * len(self.bandwidth)
        self._bundles_on = [set() for _ in self.bandwidth]

    def is_free(self, links: tuple[int, ...]) -> bool:
        """Whether a path costs no time at all (no links, or only links of unbounded bandwidth)."""
        bandwidth = self.bandwidth
        return all(bandwidth[k] == float("inf") for k in links)

    def start(self, now: float, links: tuple[int, ...], nbytes: float, weight: int = 1) -> tuple[int, list[Reschedule]]:
        """Start moving `nbytes` over `links` at `now`, counting `weight` flows on them: the new flow's id, and the
        bundles whose first end moved."""
        flow = self._next_flow
        self._next_flow += 1
        if weight != 1:
            self._weights[flow] = weight
        index = self._bundle_of.get(links)
        if index is None:
            index = self._bundle_of[links] = len(self._bundles)
            self._bundles.append(_Bundle(links, since=now))
        bundle = self._bundles[index]
        bundle.clock += bundle.rate * (now - bundle.since)
        bundle.since = now
        heapq.heappush(bundle.ends, (bundle.clock + nbytes, flow))
        bundle.weight += weight
        carried, flows_on, bundles_on = self.carried, self._flows_on, self._bundles_on
        alone = True
        for k in links:
            carried[k] += nbytes
            alone = alone and flows_on[k] == 0
            flows_on[k] += weight
            bundles_on[k].add(index)
        if alone:
            # Nothing else on its links: nobody's rate moves, and it gets the path's bandwidth.
            return flow, [self._reschedule(now, index)]
        return flow, self._rerate(now, links, index)

    def finish(self, now: float, index: int) -> tuple[list[int], list[Reschedule]]:
        """A bundle's end event came off the queue: the flows that are through, and the bundles whose
        first end moved."""
        bundle = self._bundles[index]
        ends = bundle.ends
        first = ends[0][0]
        bundle.clock, bundle.since = first, now
        done = []
        while ends and ends[0][0] <= first * (1 + _SAME_END):
            done.append(heapq.heappop(ends)[1])
        if not done:
            # Every end event must end a flow, or the event loop reschedules this bundle forever.
            raise RuntimeError(_stalled(index, f"its first flow's end, clock {first!r}, was not reached at {now!r} s"))
        flows_on, bundles_on, weights = self._flows_on, self._bundles_on, self._weights
        through = sum(weights.pop(flow, 1) for flow in done) if weights else len(done)
        bundle.weight -= through
        alone = True
        for k in bundle.links:
            flows_on[k] -= through
            alone = alone and flows_on[k] == bundle.weight
            if not ends:
                bundles_on[k].discard(index)
        if not ends:
            bundle.rate = 0.0
            if alone:
                return done, []
        elif alone:
            return done, [self._reschedule(now, index)]
        return done, self._rerate(now, bundle.links, index)

    def is_current(self, index: int, version: int) -> bool:
        """Whether an end event (bundle, version) still holds."""
        bundle = self._bundles[index]
        return bundle.version == version and bool(bundle.ends)

    def _rerate(self, now: float, links: tuple[int, ...], own: int) -> list[Reschedule]:
        """New rates for the bundles on `links`; `own`, whose first flow changed, is rescheduled anyway."""
        touched: set[int] = set()
        for k in links:
            touched |= self._bundles_on[k]
        bandwidth, flows_on, bundles = self.bandwidth, self._flows_on, self._bundles
        moved: list[Reschedule] = []
        for index in touched:
            bundle = bundles[index]
            rate = min([bandwidth[k] / flows_on[k] for k in bundle.links])
            if rate == bundle.rate and index != own:
                continue
            moved.append(self._reschedule(now, index, rate))
        return moved

    def _reschedule(self, now: float, index: int, rate: float = 0.0) -> Reschedule:
        """Give a bundle a new rate (by default: its path's equal shares) from `now`; its first end."""
        bundle = self._bundles[index]
        if not rate:
            bandwidth, flows_on = self.bandwidth, self._flows_on
            rate = min([bandwidth[k] / flows_on[k] for k in bundle.links])
        bundle.clock += bundle.rate * (now - bundle.since)
        bundle.since, bundle.rate = now, rate
        bundle.version += 1
        end = now + max(0.0, bundle.ends[0][0] - bundle.clock) / rate
        if not end >= now:  # nan compares false: the loop could never pass such an event
            raise RuntimeError(_stalled(index, f"its next end, {end!r} s, is not a time at or after {now!r} s"))
        return index, end, bundle.version


def _stalled(index: int, why: str) -> str:
    return (
        f"internal error: link sharing cannot advance bundle {index}: {why}. A time, byte count or bandwidth that "
        "is not a finite number reached the simulator; the inputs should have been refused with their file and "
        "field before, so this is a bug in dapple-ir"
    )
