"""Collectives as plans of steps over links: the one ring allreduce every layer prices.

A ring allreduce over n devices (`Network.ring`: device order) runs n steps at once, each sending
2(n-1)/n of the bytes from one member to the next; the steps share the links they cross, so the ring
ends when its slowest step does: bytes x 2(n-1)/n x (the busiest link's steps / its bandwidth), plus
2(n-1) rounds of the slowest hop's latency, plus the members' own reduction of (n-1)/n of the bytes on
the host (`DeviceKind.reduce_per_byte`; 0 on the GPU presets, measured by `dapple calibrate` on CPU).

`RingAllreduce` holds that plan once for a device group: its time alone (`seconds`), its linear
coefficients for the solvers (`per_byte_s`, `fixed_s`: the time is exactly affine in the bytes), and
its flows for the simulator and the link-load sums (`steps`, `crossings`, `collective_step_bytes`, `beyond_links_s`).

A sharded stage (ZeRO-1) runs the allreduce's two halves apart, on the same ring: a reduce-scatter (n-1 steps
of (n-1)/n of the bytes in all, the hosts' reduction included) before the optimizer step, and an all-gather
(the same bytes, nothing to reduce) after it (`reduce_scatter_s`, `all_gather_s`, `shard_step_bytes`). The
two together move and cost exactly what the allreduce does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from dapple_ir.cluster.topology import Network


def ring_step_ratio(members: int) -> tuple[int, int]:
    """(numerator, denominator) of the bytes each step of a ring allreduce over `members` devices sends per reduced
    byte, 2(n-1)/n (a reduce-scatter, then an all-gather): whole numbers, for a solver that keeps integers."""
    return (2 * (members - 1), members) if members > 1 else (0, 1)


def ring_step_bytes(nbytes: float, members: int) -> float:
    """Bytes each step of a ring allreduce sends: 2(n-1)/n of the reduced bytes (`ring_step_ratio`)."""
    numerator, denominator = ring_step_ratio(members)
    return numerator * nbytes / denominator


@dataclass(frozen=True)
class RingAllreduce:
    """A ring allreduce over one device group on one network: its steps, the links they cross, and its price."""

    members: int
    """Distinct devices in the ring (1: nothing to reduce, every price 0)."""
    steps: tuple[tuple[int, int], ...]
    """(sender, receiver) of each step, in ring order."""
    crossings: Counter[int]
    """Per link: how many of the ring's steps cross it."""
    link_per_byte_s: float
    """Seconds per reduced byte on the links: 2(n-1)/n over the busiest link's bandwidth share."""
    host_per_byte_s: float
    """Seconds per reduced byte of the members' own reduction: (n-1)/n at the slowest member's rate."""
    fixed_s: float
    """2(n-1) rounds of the slowest hop's latency (paid only when there are bytes to reduce)."""

    @property
    def per_byte_s(self) -> float:
        """The solvers' linear coefficient: seconds per reduced byte, links and hosts together."""
        return self.link_per_byte_s + self.host_per_byte_s

    def beyond_links_s(self, kind: str, nbytes: float) -> float:
        """What collective `kind` (`allreduce`, or one of its halves: `reduce_scatter`, `all_gather`) of `nbytes`
        costs beyond its steps' bytes on the links: its share of the rounds' latency, and the hosts' reduction (in
        the allreduce and the reduce-scatter; an all-gather reduces nothing). 0 for nothing to reduce."""
        if self.members <= 1 or nbytes <= 0:
            return 0.0
        reduce = self.host_per_byte_s * nbytes if kind != "all_gather" else 0.0
        return self.fixed_s * _RING_SHARE[kind] + reduce

    def collective_step_bytes(self, kind: str, nbytes: float) -> float:
        """Bytes each step of collective `kind` sends: 2(n-1)/n of `nbytes` for the allreduce, half that for a half."""
        return ring_step_bytes(nbytes, self.members) * _RING_SHARE[kind]

    def collective_s(self, kind: str, nbytes: float) -> float:
        """Collective `kind` alone on the network: its links' share plus what it costs beyond them."""
        if self.members <= 1 or nbytes <= 0:
            return 0.0
        return self.link_per_byte_s * _RING_SHARE[kind] * nbytes + self.beyond_links_s(kind, nbytes)

    def seconds(self, nbytes: float) -> float:
        """The allreduce alone on the network: `fixed_s + per_byte_s x nbytes`; 0 for nothing to reduce."""
        return self.collective_s("allreduce", nbytes)

    def step_bytes(self, nbytes: float) -> float:
        """Bytes each step of the allreduce sends (`ring_step_bytes`)."""
        return self.collective_step_bytes("allreduce", nbytes)

    def shard_step_bytes(self, nbytes: float) -> float:
        """Bytes each step of the reduce-scatter or the all-gather half sends."""
        return self.collective_step_bytes("reduce_scatter", nbytes)

    def reduce_scatter_s(self, nbytes: float) -> float:
        """The reduce-scatter half alone: half the links' time and rounds, all of the hosts' reduction."""
        return self.collective_s("reduce_scatter", nbytes)

    def all_gather_s(self, nbytes: float) -> float:
        """The all-gather half alone: the other half of the links' time and rounds."""
        return self.collective_s("all_gather", nbytes)


#: Each collective's share of the allreduce's steps and rounds: ZeRO-1's reduce-scatter and all-gather are its halves.
_RING_SHARE = {"allreduce": 1.0, "reduce_scatter": 0.5, "all_gather": 0.5}


def ring_allreduce(network: Network, devices: Sequence[int]) -> RingAllreduce:
    """The ring allreduce over `devices` on `network` (cached per group: a plan asks for a group many times)."""
    key = tuple(sorted(set(devices)))
    found = network.memo.get(("ring", key))
    if isinstance(found, RingAllreduce):
        return found
    n = len(key)
    steps = tuple(network.ring(key))
    crossings: Counter[int] = Counter()
    for a, b in steps:
        crossings.update(network.path(a, b))
    if n <= 1:
        found = RingAllreduce(n, steps, crossings, 0.0, 0.0, 0.0)
    else:
        slowest = max((count / network.links[k].bandwidth for k, count in crossings.items()), default=0.0)
        latency = max((network.latency(a, b) for a, b in steps), default=0.0)
        reduce = max(network.cluster.device(d).reduce_per_byte for d in key)
        found = RingAllreduce(
            n, steps, crossings, ring_step_bytes(1.0, n) * slowest, (n - 1) / n * reduce, 2 * (n - 1) * latency
        )
    network.memo[("ring", key)] = found
    return found


def allreduce_s(network: Network, nbytes: float, devices: Sequence[int]) -> float:
    """A ring allreduce of `nbytes` over `devices`, alone on `network` (`RingAllreduce.seconds`)."""
    return ring_allreduce(network, devices).seconds(nbytes)
