"""The links of a cluster and the path of every transfer over them.

A link is one direction of one wire that transfers share: a switch port's way out of or into a
device, a node's bus (both directions at once), a network card's way out of or into its node. A
transfer from device a to device b crosses

- inside a node with a switch: a's port out, b's port in;
- inside a node with a bus: the node's bus;
- between nodes: the way out of a's card, the way into b's card (the wires between the cards, the
  switches of the data-centre network, are taken to be faster than the cards).

`Network` numbers the links and answers paths; the simulator shares the links between the flows
crossing them (`dapple_ir.sim.link_sharing`) and the planner adds up what each link carries per
iteration (`dapple_ir.planner.cost_model`). Both use `ring` for a ring allreduce, priced once in
`dapple_ir.pricing.collectives`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dapple_ir.cluster.spec import ClusterSpec


@dataclass(frozen=True, slots=True)
class LinkInfo:
    """One shared link: its name for reports, bandwidth in bytes/s, and whether it is a network card."""

    name: str
    bandwidth: float
    card: bool


@dataclass
class Network:
    """The links of `cluster`, numbered, and the path between every pair of devices."""

    cluster: ClusterSpec
    links: list[LinkInfo] = field(default_factory=list)
    _out: list[int] = field(default_factory=list)
    _in: list[int] = field(default_factory=list)
    _card_out: list[int] = field(default_factory=list)
    _card_in: list[int] = field(default_factory=list)
    _paths: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    _cards: list[int] = field(default_factory=list)
    memo: dict[object, object] = field(default_factory=dict, repr=False, compare=False)
    """Prices the layers above work out per device group and keep for the network's life
    (`dapple_ir.pricing.collectives.ring_allreduce`)."""

    def __post_init__(self) -> None:
        spec = self.cluster
        per, cards = spec.devices_per_node, spec.card_count
        intra, inter = spec.intra.bandwidth, spec.inter.bandwidth
        for node in range(spec.nodes):
            first = node * per
            if spec.fabric == "bus":
                bus = self._add(f"n{node} bus", intra, card=False)
                self._out += [bus] * per
                self._in += [bus] * per
            else:
                for d in range(first, first + per):
                    self._out.append(self._add(f"dev{d} port out", intra, card=False))
                    self._in.append(self._add(f"dev{d} port in", intra, card=False))
            outs = [self._add(f"n{node} card{c} out", inter, card=True) for c in range(cards)]
            ins = [self._add(f"n{node} card{c} in", inter, card=True) for c in range(cards)]
            for d in range(first, first + per):
                card = spec.card_of(d)
                self._card_out.append(outs[card])
                self._card_in.append(ins[card])
        self._cards = [k for k, link in enumerate(self.links) if link.card]

    def _add(self, name: str, bandwidth: float, *, card: bool) -> int:
        self.links.append(LinkInfo(name, bandwidth, card))
        return len(self.links) - 1

    @property
    def card_links(self) -> list[int]:
        """Ids of the links that are network cards, in link order."""
        return self._cards

    def path(self, a: int, b: int) -> tuple[int, ...]:
        """The links a transfer from device `a` to device `b` crosses (none from a device to itself)."""
        key = (a, b)
        found = self._paths.get(key)
        if found is not None:
            return found
        if a == b:
            found = ()
        elif self.cluster.node_of(a) != self.cluster.node_of(b):
            found = (self._card_out[a], self._card_in[b])
        elif self._out[a] == self._in[b]:
            found = (self._out[a],)  # the node's bus
        else:
            found = (self._out[a], self._in[b])
        self._paths[key] = found
        return found

    def latency(self, a: int, b: int) -> float:
        return self.cluster.link(a, b).latency

    def ring(self, devices: Sequence[int]) -> list[tuple[int, int]]:
        """The (sender, receiver) steps of a ring allreduce over `devices`: in device order, so the ring
        crosses between two nodes twice at most per node boundary, as NCCL's rings do."""
        order = sorted(set(devices))
        if len(order) < 2:
            return []
        return [(order[i], order[(i + 1) % len(order)]) for i in range(len(order))]
