"""What a plan pushes through each link per iteration, and the floor that puts under its time.

Per iteration, a cut between stages a and b moves each microbatch's activation from the replicas
that hold its rows in a to those that take them in b, and its gradient back (`cut_pieces`: round
robin, microbatch m lives whole on replica m % R; split, replica j of R holds rows
[j b // R, (j + 1) b // R) of every microbatch); a replicated stage's ring allreduce moves 2(n-1)/n of its
gradient bytes over each step of the ring (`dapple_ir.pricing.collectives.RingAllreduce`). A link can
carry no more than its bandwidth, so no iteration is shorter than the busiest link's bytes /
bandwidth: the *card floor* when taken over the network cards, which is what the cost model adds to
its pipeline formula (`cost_model.evaluate`), the DP carries per card (`dp.solve`) and the ILP
bounds (`ilp.solve_ilp`). The simulator shares the same links between the same flows, so its
iteration is never below the floor either.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

from dapple_ir.cluster.topology import Network


def cut_pieces(
    a: Sequence[int], b: Sequence[int], microbatch: int, split: tuple[bool, bool] = (False, False), rows: int = 1
) -> list[tuple[int, int, float]]:
    """(source device, destination device, share of the microbatch's bytes) of each piece the cut
    from stage devices `a` to `b` moves for `microbatch` of `rows` samples: the rows a producer
    replica holds and a consumer replica takes (`split`: whether a, b split each microbatch; a
    round-robin stage holds it whole on replica m % R). Pieces on one device move nothing."""
    held = _holders(a, split[0], microbatch, rows)
    taken = _holders(b, split[1], microbatch, rows)
    pieces = []
    for src, lo, hi in held:
        for dst, lo2, hi2 in taken:
            common = min(hi, hi2) - max(lo, lo2)
            if common > 0 and src != dst:
                pieces.append((src, dst, common / rows))
    return pieces


def _holders(devices: Sequence[int], split: bool, microbatch: int, rows: int) -> list[tuple[int, int, int]]:
    """(device, first row, end row) of the replicas holding a microbatch of `rows` samples."""
    r = len(devices)
    if not split or r == 1:
        return [(devices[microbatch % r], 0, rows)]
    return [(devices[j], j * rows // r, (j + 1) * rows // r) for j in range(r)]


def cut_period(a: Sequence[int], b: Sequence[int], split: tuple[bool, bool] = (False, False)) -> int:
    """After how many microbatches the cut's pieces repeat (a split stage's are the same for all)."""
    return math.lcm(1 if split[0] else len(a), 1 if split[1] else len(b))


def cut_crossings(
    network: Network,
    a: Sequence[int],
    b: Sequence[int],
    microbatches: int,
    split: tuple[bool, bool] = (False, False),
    rows: int = 1,
) -> dict[int, float]:
    """Per link: how much of the cut crosses it in an iteration, activations (a to b) and gradients
    (b to a) together, in units of one microbatch's cut bytes (`cut_pieces`: a whole transfer
    counts 1, a piece of a split stage its share of the rows)."""
    counts: dict[int, float] = defaultdict(float)
    period = cut_period(a, b, split)
    # Microbatch m and m + period travel between the same replicas.
    for m in range(min(microbatches, period)):
        times = (microbatches - m + period - 1) // period
        for src, dst, share in cut_pieces(a, b, m, split, rows):
            for link in network.path(src, dst):
                counts[link] += times * share
            for link in network.path(dst, src):
                counts[link] += times * share
    return counts


def cut_s(
    network: Network, a: Sequence[int], b: Sequence[int], split: tuple[bool, bool], rows: int
) -> tuple[float, float]:
    """(seconds per byte, latency) of one microbatch's cut: the pieces that cross it at once share
    the links they cross, so it takes the busiest link's load over its bandwidth, plus the slowest
    piece's latency. At once: a split producer's pieces of one microbatch (its replicas run each
    microbatch together); a round-robin producer's replicas run R microbatches side by side, so R
    consecutive microbatches cross together. The slowest such group of the `cut_period` counts."""
    together = 1 if split[0] or len(a) == 1 else len(a)
    period = math.lcm(cut_period(a, b, split), together)
    per_byte, latency = 0.0, 0.0
    for first in range(0, period, together):
        loads: dict[int, float] = defaultdict(float)
        for m in range(first, first + together):
            for src, dst, share in cut_pieces(a, b, m, split, rows):
                latency = max(latency, network.latency(src, dst))
                for link in network.path(src, dst):
                    loads[link] += share
        per_byte = max(per_byte, *(load / network.links[k].bandwidth for k, load in loads.items()), 0.0)
    return per_byte, latency


def busiest(network: Network, loads: dict[int, float], links: Sequence[int] | None = None) -> tuple[int, float]:
    """(link, seconds at full bandwidth) of the busiest of `links` (all loaded links by default);
    (-1, 0.0) when none carries anything."""
    best, seconds = -1, 0.0
    for link in links if links is not None else loads:
        load = loads.get(link, 0.0)
        if load > 0 and load / network.links[link].bandwidth > seconds:
            best, seconds = link, load / network.links[link].bandwidth
    return best, seconds
