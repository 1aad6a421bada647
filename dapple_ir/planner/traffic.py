"""What a plan pushes through each link per iteration, and the floor that puts under its time.

Per iteration, a cut between stages a and b moves each microbatch's activation from replica
m % |a| to m % |b| and its gradient back; a replicated stage's ring allreduce moves 2(n-1)/n of its
gradient bytes over each step of the ring (`dapple_ir.cluster.topology.Network.ring`). A link can
carry no more than its bandwidth, so no iteration is shorter than the busiest link's bytes /
bandwidth: the *card floor* when taken over the network cards, which is what the cost model adds to
its pipeline formula (`cost_model.evaluate`), the DP carries per card (`dp.solve`) and the ILP
bounds (`ilp.solve_ilp`). The simulator shares the same links between the same flows, so its
iteration is never below the floor either.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from dapple_ir.cluster.topology import Network


def cut_crossings(network: Network, a: Sequence[int], b: Sequence[int], microbatches: int) -> Counter[int]:
    """Per link: how many of the cut's transfers cross it in an iteration, activations (a to b) and
    gradients (b to a) together; each carries the cut's bytes for one microbatch."""
    counts: Counter[int] = Counter()
    period = math.lcm(len(a), len(b))
    # Microbatch m and m + period travel between the same two replicas.
    for m in range(min(microbatches, period)):
        src, dst = a[m % len(a)], b[m % len(b)]
        if src == dst:
            continue
        times = (microbatches - m + period - 1) // period
        for link in network.path(src, dst):
            counts[link] += times
        for link in network.path(dst, src):
            counts[link] += times
    return counts


def ring_crossings(network: Network, devices: Sequence[int]) -> Counter[int]:
    """Per link: how many steps of the ring allreduce over `devices` cross it; each step carries
    `ring_step_bytes` of the gradients."""
    return network.ring_load(devices)


def ring_step_bytes(nbytes: float, replicas: int) -> float:
    """Bytes each step of a ring allreduce over `replicas` devices sends: 2(n-1)/n of the gradients."""
    return 2 * (replicas - 1) / replicas * nbytes if replicas > 1 else 0.0


def busiest(network: Network, loads: dict[int, float], links: Sequence[int] | None = None) -> tuple[int, float]:
    """(link, seconds at full bandwidth) of the busiest of `links` (all loaded links by default);
    (-1, 0.0) when none carries anything."""
    best, seconds = -1, 0.0
    for link in links if links is not None else loads:
        load = loads.get(link, 0.0)
        if load > 0 and load / network.links[link].bandwidth > seconds:
            best, seconds = link, load / network.links[link].bandwidth
    return best, seconds
