"""Collectives as plans of steps over links: the one ring allreduce every layer prices.

A ring allreduce over n devices (`Network.ring`: device order) runs n steps at once, each sending
2(n-1)/n of the bytes from one member to the next; the steps share the links they cross, so the ring
ends when its slowest step does: bytes x 2(n-1)/n x (the busiest link's steps / its bandwidth), plus
2(n-1) rounds of the slowest hop's latency, plus the members' own reduction of (n-1)/n of the bytes on
the host (`DeviceKind.reduce_per_byte`; 0 on the GPU presets, measured by `dapple calibrate` on CPU).

`RingAllreduce` holds that plan once for a device group: its time alone (`seconds`), its linear
coefficients for the solvers (`per_byte_s`, `fixed_s`: the time is exactly affine in the bytes), and
its flows for the simulator and the link-load sums (`steps`, `crossings`, `step_bytes`, `host_s`).

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


def ring_shard_bytes(nbytes: float, members: int) -> float:
    """Bytes each step of a ring reduce-scatter or all-gather over `members` devices sends: (n-1)/n of them."""
    return (members - 1) / members * nbytes if members > 1 else 0.0


def ring_step_bytes(nbytes: float, members: int) -> float:
    """Bytes each step of a ring allreduce (a reduce-scatter, then an all-gather) sends: 2(n-1)/n of them."""
    return 2 * ring_shard_bytes(nbytes, members)


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

    def seconds(self, nbytes: float) -> float:
        """The ring alone on the network: `fixed_s + per_byte_s x nbytes`; 0 for nothing to reduce."""
        if self.members <= 1 or nbytes <= 0:
            return 0.0
        return self.fixed_s + self.per_byte_s * nbytes

    def step_bytes(self, nbytes: float) -> float:
        """Bytes each step sends (`ring_step_bytes`)."""
        return ring_step_bytes(nbytes, self.members)

    def shard_step_bytes(self, nbytes: float) -> float:
        """Bytes each step of the reduce-scatter or the all-gather half sends (`ring_shard_bytes`)."""
        return ring_shard_bytes(nbytes, self.members)

    def reduce_scatter_s(self, nbytes: float) -> float:
        """The reduce-scatter half alone: half the links' time and rounds, all of the hosts' reduction."""
        if self.members <= 1 or nbytes <= 0:
            return 0.0
        return self.fixed_s / 2 + (self.link_per_byte_s / 2 + self.host_per_byte_s) * nbytes

    def all_gather_s(self, nbytes: float) -> float:
        """The all-gather half alone: the other half of the links' time and rounds."""
        if self.members <= 1 or nbytes <= 0:
            return 0.0
        return self.fixed_s / 2 + self.link_per_byte_s / 2 * nbytes

    def host_s(self, nbytes: float) -> float:
        """The members' reduction on the host after the links (the simulator adds it to the ring's end)."""
        return self.host_per_byte_s * nbytes if self.members > 1 and nbytes > 0 else 0.0

    def latency_s(self, nbytes: float) -> float:
        """The rounds' latency, paid only when there are bytes."""
        return self.fixed_s if self.members > 1 and nbytes > 0 else 0.0


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
