"""The independent parts of a plan, for the simulator, and the parts that are copies of one another.

Two ranks are in one part where one sends to the other, where both take part in one collective over the links
(`allreduce`, `reduce_scatter`, `all_gather`; a `tensor_allreduce` is priced as each member's own time and
orders nothing between them), where flows of theirs could cross one link, or where they take turns on one node's
cores. Ranks of different parts never wait on one another and never share a link's bandwidth, so the simulator
runs each part on its own clock, queue and links (`_Simulator.engine`): what a part computes then depends on
nothing outside it.

A part is a *copy* of an earlier one where an order-keeping map of its ranks onto the earlier part's takes every
program onto the other's instruction by instruction (sends and receives to the mapped peers, collectives over the
mapped group, every other instruction the same), every rank onto one of the same device kind, replica, stages and
costs, and every link its flows cross onto a distinct link of the same bandwidth that the earlier part's matching
flows cross, latencies and ring prices alike. Then the two parts' simulations from time 0 make the very same
floating-point operations in the very same order, and the copy's timeline is the earlier part's: the members of
a tensor-parallel group, each with its own network card, are T such parts, simulated once
(`_Simulator.iteration_and_peak`, what `predict` runs). Without the devices and links (`meeting_parts`), the same
check says which parts a check of the programs against each other (the deadlock check) need not run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import compress, count, repeat
from operator import attrgetter, is_, is_not

from dapple_ir.ir import COLLECTIVE_KINDS, Instr, InstrKind, RankProgram
from dapple_ir.ir.scale import HeldAlike, picked

_TENSOR = InstrKind.TENSOR_ALLREDUCE
#: An instruction's kind by its text, its peer, its group: read for millions of instructions without a Python call each.
_KIND, _PEER, _GROUP, _KIND_OF = attrgetter("kind._value_"), attrgetter("peer"), attrgetter("group"), attrgetter("kind")
#: What an instruction and its counterpart in a copy hold alike.
_FIELDS = attrgetter("kind", "stage", "value", "grad", "mb", "rows", "param")
_COLLECTIVE = frozenset(kind.value for kind in COLLECTIVE_KINDS)

#: The links (`Network` ids) a transfer or a ring step crosses where it takes time; () where it takes none.
Route = Callable[[int, int], tuple[int, ...]]


def independent_parts(
    programs: Sequence[RankProgram], route: Route, ring_routes: Callable[[Instr], list[tuple[int, ...]]]
) -> list[list[int]]:
    """The parts of the ranks (each ascending, in order of their first rank): `route(src, dst)` the links of a
    send between two ranks, `ring_routes(instr)` those of a collective's steps. Ranks on shared cores are the
    caller's to join (`join`)."""
    parent = list(range(len(programs)))
    on_link: dict[int, int] = {}
    for rank, (peers, collectives) in enumerate(_meetings(programs)):
        # Each peer once, and the collectives alone. A rank that only receives from a peer is given the links of a
        # send to it too: a part may only grow by that.
        for peer in peers:
            _link_ranks(parent, on_link, rank, route(rank, peer))
            _union(parent, rank, peer)
        for instr in collectives:
            assert instr.group is not None
            for member in instr.group:
                _union(parent, rank, member)
            for links in ring_routes(instr):
                _link_ranks(parent, on_link, rank, links)
    return _grouped(parent)


def _meetings(programs: Sequence[RankProgram]) -> Iterator[tuple[set[int], list[Instr]]]:
    """Each program's peers and its collectives, found without a Python call per instruction (a thousand ranks'
    programs are millions of them). A program that holds an earlier one's very instructions but at a few places
    (`HeldAlike`: a tensor group's member) holds the other's elsewhere: read there at the other's places that name a
    peer or join a collective alone."""
    alike = HeldAlike(programs)
    places: dict[int, tuple[list[int], list[int]]] = {}
    for index, program in enumerate(programs):
        instrs = program.instrs
        found = alike.find(index)
        if found is None:
            named, joined = places[index] = _meeting_places(instrs)
            yield {instrs[k].peer for k in named}, [instrs[k] for k in joined]  # type: ignore[misc]
            continue
        other, at = found
        own, (named, joined) = set(at), places[other]
        mine = picked(instrs, at)
        peers = set(map(_PEER, mine)) - {None} | {instrs[k].peer for k in named if k not in own}
        collectives = [i for i in mine if i.kind._value_ in _COLLECTIVE] + [instrs[k] for k in joined if k not in own]
        yield peers, collectives  # type: ignore[misc]


def _meeting_places(instrs: list[Instr]) -> tuple[list[int], list[int]]:
    """Where a program names a peer, and where it joins a collective: found without a Python call per instruction
    (a thousand ranks' programs are millions of them)."""
    named = list(compress(count(), map(is_not, map(_PEER, instrs), repeat(None))))
    joined = list(compress(count(), map(_COLLECTIVE.__contains__, map(_KIND, instrs))))
    return named, joined


def join(parts: list[list[int]], together: Sequence[Sequence[int]]) -> list[list[int]]:
    """`parts` with the parts of each list of ranks in `together` made one (ranks that take turns on cores)."""
    parent = list(range(sum(len(p) for p in parts)))
    for part in parts:
        for rank in part[1:]:
            _union(parent, part[0], rank)
    for ranks in together:
        for rank in ranks[1:]:
            _union(parent, ranks[0], rank)
    return _grouped(parent)


def _link_ranks(parent: list[int], on_link: dict[int, int], rank: int, links: tuple[int, ...]) -> None:
    for link in links:
        _union(parent, on_link.setdefault(link, rank), rank)


def _find(parent: list[int], a: int) -> int:
    while parent[a] != a:
        parent[a] = parent[parent[a]]
        a = parent[a]
    return a


def _union(parent: list[int], a: int, b: int) -> None:
    ra, rb = _find(parent, a), _find(parent, b)
    if ra != rb:
        parent[max(ra, rb)] = min(ra, rb)


def _grouped(parent: list[int]) -> list[list[int]]:
    by_root: dict[int, list[int]] = {}
    for rank in range(len(parent)):
        by_root.setdefault(_find(parent, rank), []).append(rank)
    return list(by_root.values())


class CopyCheck:
    """Whether a part is a copy of another (see the module docstring). `same_rank(r, s)`: rank `s` runs on a device of
    rank `r`'s kind, with its replica, stages, costs and start; `route(src, dst)`: the links of a send, with
    `latency(src, dst)`; `ring(instr, rank)`: the links of each step of a collective of `rank` and the ring's
    price (anything comparable). Where the receives are posted, and what memory does, follows: both depend on a
    program's shape (`peak_memory.program_shape`: each instruction less its peer and group, the microbatches, the
    replica), which a copy's programs share with their counterparts."""

    def __init__(
        self,
        programs: Sequence[RankProgram],
        same_rank: Callable[[int, int], bool],
        route: Route,
        latency: Callable[[int, int], float],
        ring: Callable[[Instr, int], tuple[list[tuple[int, ...]], object]],
        bandwidth: Sequence[float],
    ) -> None:
        self.programs = programs
        self.same_rank = same_rank
        self.route = route
        self.latency = latency
        self.ring = ring
        self.bandwidth = bandwidth
        self.meets: dict[int, list[int]] = {}
        """Where each rank's program names a peer, then where it joins a collective (`meeting_places`)."""
        self.looked: dict[int, tuple[list[int], _Looked]] = {}
        """Each rank's last `looked_at`: what it was asked and answered."""

    def distinct(self, parts: list[list[int]]) -> list[list[int]]:
        """The parts that are no copy of an earlier one, in order."""
        programs = self.programs
        by_shape: dict[tuple[int, ...], list[list[int]]] = {}
        found = []
        for part in parts:
            alike = by_shape.setdefault(tuple(len(programs[r].instrs) for r in part), [])
            if not any(self.copies(rep, part) for rep in alike):
                alike.append(part)
                found.append(part)
        return found

    def copies(self, rep: list[int], part: list[int]) -> bool:
        """Whether `part` is a copy of `rep`, rank i of one onto rank i of the other."""
        programs = self.programs
        if len(rep) != len(part) or any(
            len(programs[r].instrs) != len(programs[s].instrs) for r, s in zip(rep, part, strict=True)
        ):
            return False
        onto = dict(zip(rep, part, strict=True))
        links: dict[int, int] = {}
        back: dict[int, int] = {}
        rings: set[tuple[int, ...]] = set()
        for r, s in zip(rep, part, strict=True):
            if not self.same_rank(r, s):
                return False
            mine, theirs = programs[r].instrs, programs[s].instrs
            # Where the two programs hold other instructions, and where they must (their peers and groups differ):
            # found without a Python call per instruction; elsewhere both hold the very same instruction.
            looked = self.looked_at(r, list(compress(count(), map(is_not, mine, theirs))))
            mine_at, theirs_at = looked.instrs, [theirs[i] for i in looked.places]
            if not _same_instrs(looked, theirs_at, onto):
                return False
            sends = compress(map(_PEER, mine_at), map(is_, map(_KIND_OF, mine_at), repeat(InstrKind.SEND)))
            for peer in set(sends):
                if not self.same_route(r, peer, s, onto[peer], links, back):
                    return False
            for j in compress(count(), map(_COLLECTIVE.__contains__, map(_KIND, mine_at))):
                a, b = mine_at[j], theirs_at[j]
                assert a.group is not None
                if a.group in rings:
                    continue
                rings.add(a.group)
                (paths, price), (their_paths, their_price) = self.ring(a, r), self.ring(b, s)
                if price != their_price or not self.same_links(paths, their_paths, links, back):
                    return False
        return True

    def looked_at(self, rank: int, other: list[int]) -> _Looked:
        """The rank's instructions where a program held to its copy holds others (`other`, ascending) or must differ
        (`meeting_places`), with what `_same_instrs` reads of them. The last answer is kept for the rank: its copies
        hold instructions of their own at the same places."""
        kept = self.looked.get(rank)
        if kept is None or kept[0] != other:
            look = set(other)
            look.update(self.meeting_places(rank))
            places = list(look)
            instrs = [self.programs[rank].instrs[i] for i in places]
            grouped = set(compress(count(), map(is_not, map(_GROUP, instrs), repeat(None))))
            kept = self.looked[rank] = (other, _Looked(places, instrs, list(map(_FIELDS, instrs)), grouped))
        return kept[1]

    def meeting_places(self, rank: int) -> list[int]:
        """Where the rank's program names a peer, then where it joins a collective: found once per rank (a part is
        held to each of its copies' in turn), while the programs are unchanged (one `CopyCheck` per look at them)."""
        found = self.meets.get(rank)
        if found is None:
            named, joined = _meeting_places(self.programs[rank].instrs)
            found = self.meets[rank] = named + joined
        return found

    def same_route(
        self, r: int, peer: int, s: int, their_peer: int, links: dict[int, int], back: dict[int, int]
    ) -> bool:
        if self.latency(r, peer) != self.latency(s, their_peer):
            return False
        return self.same_links([self.route(r, peer)], [self.route(s, their_peer)], links, back)

    def same_links(
        self,
        mine: list[tuple[int, ...]],
        theirs: list[tuple[int, ...]],
        links: dict[int, int],
        back: dict[int, int],
    ) -> bool:
        """Whether `theirs` are `mine` under one map of links, one-to-one and keeping bandwidths (extended here)."""
        if len(mine) != len(theirs):
            return False
        bandwidth = self.bandwidth
        for path, their_path in zip(mine, theirs, strict=True):
            if len(path) != len(their_path):
                return False
            for a, b in zip(path, their_path, strict=True):
                if links.setdefault(a, b) != b or back.setdefault(b, a) != a or bandwidth[a] != bandwidth[b]:
                    return False
        return True


@dataclass(frozen=True)
class _Looked:
    """A rank's instructions at the places its copy's are compared (`CopyCheck.looked_at`)."""

    places: list[int]
    """The places, in the order compared."""
    instrs: list[Instr]
    """Its instructions there."""
    fields: list[tuple[object, ...]]
    """What the copy's must hold alike there (`_FIELDS`)."""
    grouped: set[int]
    """Which of them (indices into `instrs`) have a group."""


def _same_instrs(mine: _Looked, theirs: list[Instr], onto: dict[int, int]) -> bool:
    """Whether each of `theirs` is the one of `mine` at its place with its peer, or its collective's group, mapped by
    `onto` (a tensor group kept as it is): compared field by field a list at a time, the groups one by one (a
    program has few)."""
    if mine.fields != list(map(_FIELDS, theirs)):
        return False
    # A part holds every peer of its ranks: a peer maps to a peer, and no peer to no peer.
    if list(map(onto.get, map(_PEER, mine.instrs))) != list(map(_PEER, theirs)):
        return False
    grouped = mine.grouped | set(compress(count(), map(is_not, map(_GROUP, theirs), repeat(None))))
    for j in grouped:
        a, b = mine.instrs[j], theirs[j]
        if a.group is None or b.group is None:
            return False
        if (a.group if a.kind is _TENSOR else tuple(onto.get(g, -1) for g in a.group)) != b.group:
            return False
    return True


def meeting_parts(programs: Sequence[RankProgram]) -> list[list[int]]:
    """The ranks in parts that meet no rank outside (sends, receives, collectives; links not counted), one part of
    each set of copies among them (instruction by instruction, whatever the devices): what a check of the programs
    against each other, as a deadlock check, needs to run."""
    parts = independent_parts(programs, lambda _src, _dst: (), lambda _instr: [])
    check = CopyCheck(programs, lambda _r, _s: True, lambda _src, _dst: (), lambda _src, _dst: 0.0, _no_ring, [])
    return check.distinct(parts)


def _no_ring(_instr: Instr, _rank: int) -> tuple[list[tuple[int, ...]], object]:
    return [], None
