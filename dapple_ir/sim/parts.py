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
from itertools import compress, count
from operator import is_not

from dapple_ir.ir import COLLECTIVE_KINDS, Instr, InstrKind, RankProgram
from dapple_ir.ir.scale import Held, held_alike, picked

_TENSOR, _SEND = InstrKind.TENSOR_ALLREDUCE, InstrKind.SEND
_COLLECTIVE = frozenset(kind.value for kind in COLLECTIVE_KINDS)

#: The links (`Network` ids) a transfer or a ring step crosses where it takes time; () where it takes none.
Route = Callable[[int, int], tuple[int, ...]]


def independent_parts(
    programs: Sequence[RankProgram],
    route: Route,
    ring_routes: Callable[[Instr], list[tuple[int, ...]]],
    meetings: Meetings | None = None,
) -> list[list[int]]:
    """The parts of the ranks (each ascending, in order of their first rank): `route(src, dst)` the links of a
    send between two ranks, `ring_routes(instr)` those of a collective's steps. Ranks on shared cores are the
    caller's to join (`join`). `meetings`: what this look at the programs found so far, kept for the next."""
    parent = list(range(len(programs)))
    on_link: dict[int, int] = {}
    for rank, (peers, collectives) in enumerate(_meetings(meetings or Meetings(programs))):
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


class Meetings:
    """What one look at a plan's programs finds of them for both `independent_parts` and `CopyCheck` (as
    `meeting_parts` runs them one after the other): the programs that hold an earlier one's very instructions but at a
    few places (`HeldAlike`: a tensor group's members), and where each other program names a peer or joins a
    collective. Kept for one look only: a pass may change the programs before the next."""

    def __init__(self, programs: Sequence[RankProgram]) -> None:
        self.programs = programs
        self.held: list[Held] | None = None
        """Each program's `HeldAlike.find`, once `independent_parts` found them."""
        self.places: dict[int, tuple[list[int], list[int]]] = {}
        """Each program's `_meeting_places`, once asked (`of`)."""

    def of(self, index: int) -> tuple[list[int], list[int]]:
        """Where program `index` names a peer, and where it joins a collective (`_meeting_places`): found once."""
        found = self.places.get(index)
        if found is None:
            found = self.places[index] = _meeting_places(self.programs[index].instrs)
        return found


def _meetings(meetings: Meetings) -> Iterator[tuple[set[int], list[Instr]]]:
    """Each program's peers and its collectives, found without a Python call per instruction (a thousand ranks'
    programs are millions of them). A program that holds an earlier one's very instructions but at a few places
    (`HeldAlike`: a tensor group's member) holds the other's elsewhere: read there at the other's places that name a
    peer or join a collective alone."""
    programs = meetings.programs
    if meetings.held is None:
        meetings.held = held_alike(programs)
    for index, (program, found) in enumerate(zip(programs, meetings.held, strict=True)):
        instrs = program.instrs
        if found is None:
            named, joined = meetings.of(index)
            yield {instrs[k].peer for k in named}, [instrs[k] for k in joined]  # type: ignore[misc]
            continue
        other, at = found
        own, (named, joined) = set(at), meetings.of(other)
        mine = picked(instrs, at)
        peers = {i.peer for i in mine} - {None}
        collectives = [i for i in mine if i.kind._value_ in _COLLECTIVE]
        # Where the other names a peer or joins a collective, a member holds instructions of its own: asked in C.
        if not own.issuperset(named):
            peers |= {instrs[k].peer for k in named if k not in own}  # type: ignore[misc]
        if not own.issuperset(joined):
            collectives += [instrs[k] for k in joined if k not in own]
        yield peers, collectives  # type: ignore[misc]


def _meeting_places(instrs: list[Instr]) -> tuple[list[int], list[int]]:
    """Where a program names a peer, and where it joins a collective: one loop, whose attribute reads the
    interpreter specializes (faster than mapping `attrgetter`s over a thousand ranks' millions of instructions)."""
    named: list[int] = []
    joined: list[int] = []
    for k, instr in enumerate(instrs):
        if instr.peer is not None:
            named.append(k)
        if instr.kind._value_ in _COLLECTIVE:
            joined.append(k)
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
        meetings: Meetings | None = None,
    ) -> None:
        self.programs = programs
        self.same_rank = same_rank
        self.route = route
        self.latency = latency
        self.ring = ring
        self.bandwidth = bandwidth
        self.meetings = meetings or Meetings(programs)
        """What this look at the programs found of them (`independent_parts` may have found it first)."""
        self.looked: dict[int, tuple[list[int], _Looked]] = {}
        """Each rank's last `looked_at`: what it was asked and answered."""
        self.templates: dict[int, tuple[list[int], list[Instr]]] = {}
        """Per rank, places and a list of its instructions but at those places (`alike_elsewhere`)."""

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
        rings: set[tuple[object, ...]] = set()
        for r, s in zip(rep, part, strict=True):
            if not self.same_rank(r, s):
                return False
            looked, theirs_at = self.looked_for(r, s)
            if not _same_instrs(looked, theirs_at, onto):
                return False
            for peer in looked.sent_to:
                if not self.same_route(r, peer, s, onto[peer], links, back):
                    return False
            for j in looked.joined:
                a, b = looked.instrs[j], theirs_at[j]
                assert a.group is not None
                # A ring is its group's, priced by what it reduces (its fields): each such ring is compared once.
                ring = (a.group, *looked.fields[j])
                if ring in rings:
                    continue
                rings.add(ring)
                (paths, price), (their_paths, their_price) = self.ring(a, r), self.ring(b, s)
                if price != their_price or not self.same_links(paths, their_paths, links, back):
                    return False
        return True

    def looked_for(self, rank: int, copy: int) -> tuple[_Looked, Sequence[Instr]]:
        """What the rank's program is compared at with program `copy` (as long): its meeting places and wherever else
        `copy` holds other instructions (`looked_at`), with `copy`'s instructions there. Where the other places are
        known (`Meetings.held`: `copy` is held to the rank's) they are taken; else a copy held to the rank's (a tensor
        group's member to its lead) is first compared at the meeting places alone, and then found to hold the rank's
        very instructions everywhere else (`alike_elsewhere`)."""
        theirs = self.programs[copy].instrs
        held = self.meetings.held[copy] if self.meetings.held is not None else None
        if held is not None and held[0] == rank:
            looked = self.looked_at(rank, held[1])
            return looked, picked(theirs, looked.places)
        looked = self.looked_at(rank, [])
        theirs_at = picked(theirs, looked.places)
        if self.alike_elsewhere(rank, looked.places, theirs, theirs_at):
            return looked, theirs_at
        looked = self.looked_at(rank, list(compress(count(), map(is_not, self.programs[rank].instrs, theirs))))
        return looked, picked(theirs, looked.places)

    def alike_elsewhere(self, rank: int, places: list[int], theirs: list[Instr], theirs_at: Sequence[Instr]) -> bool:
        """Whether `theirs` (as long as the rank's program, `theirs_at` its instructions at `places`) holds the rank's
        very instructions everywhere but at `places`. A list of the rank's instructions takes `theirs_at` at `places`
        and is compared with `theirs` whole: in C, by identity, without touching an instruction held alike (as a
        walk over them would, each a cache miss among millions)."""
        kept = self.templates.get(rank)
        if kept is None or kept[0] != places:  # the list holds another copy's instructions at the places it was given
            kept = self.templates[rank] = (places, list(self.programs[rank].instrs))
        template = kept[1]
        any(map(template.__setitem__, places, theirs_at))  # each returns None: this only runs them, in C
        return template == theirs

    def looked_at(self, rank: int, other: list[int]) -> _Looked:
        """The rank's instructions where a program held to its copy holds others (`other`, ascending) or must differ
        (`meeting_places`), ascending, with what `_same_instrs` reads of them. The last answer is kept for the rank:
        its copies hold instructions of their own at the same places."""
        kept = self.looked.get(rank)
        if kept is not None and (other == kept[0] or other == kept[1].places):
            return kept[1]
        places = sorted(set(self.meeting_places(rank)).union(other))
        if kept is None or places != kept[1].places:
            kept = self.looked[rank] = (other, _Looked.of(places, list(picked(self.programs[rank].instrs, places))))
        return kept[1]

    def meeting_places(self, rank: int) -> list[int]:
        """Where the rank's program names a peer, then where it joins a collective (`Meetings.of`)."""
        named, joined = self.meetings.of(rank)
        return named + joined

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
    """A rank's instructions at the places its copy's are compared (`CopyCheck.looked_at`), and what is read of them
    for every copy."""

    places: list[int]
    """The places, in the order compared."""
    instrs: list[Instr]
    """Its instructions there."""
    fields: list[tuple[object, ...]]
    """What the copy's must hold alike there (`_FIELDS`)."""
    peers: list[int | None]
    """Their peers."""
    groups: list[tuple[int, ...] | None]
    """Their groups."""
    grouped: list[int]
    """Which of them (indices into `instrs`) have a group."""
    sent_to: set[int]
    """The peers its sends among them go to."""
    joined: list[int]
    """Which of them are collectives."""

    @staticmethod
    def of(places: list[int], instrs: list[Instr]) -> _Looked:
        groups = [i.group for i in instrs]
        return _Looked(
            places,
            instrs,
            _fields(instrs),
            [i.peer for i in instrs],
            groups,
            [j for j, group in enumerate(groups) if group is not None],
            {i.peer for i in instrs if i.kind is _SEND},  # type: ignore[misc]
            [j for j, i in enumerate(instrs) if i.kind._value_ in _COLLECTIVE],
        )


def _same_instrs(mine: _Looked, theirs: Sequence[Instr], onto: dict[int, int]) -> bool:
    """Whether each of `theirs` is the one of `mine` at its place with its peer, or its collective's group, mapped by
    `onto` (a tensor group kept as it is): compared a list at a time (a program has few groups: mapped one by one)."""
    if mine.fields != _fields(theirs):
        return False
    # A part holds every peer of its ranks: a peer maps to a peer, and no peer to no peer.
    if list(map(onto.get, mine.peers)) != [i.peer for i in theirs]:  # type: ignore[arg-type]
        return False
    groups = list(mine.groups)
    for j in mine.grouped:
        group = groups[j]
        assert group is not None
        if mine.instrs[j].kind is not _TENSOR:
            groups[j] = tuple(onto.get(g, -1) for g in group)
    return groups == [i.group for i in theirs]


def _fields(instrs: Sequence[Instr]) -> list[tuple[object, ...]]:
    """What each instruction and its counterpart in a copy hold alike (all but the peer and the group): read in a
    comprehension, whose attribute reads the interpreter specializes (faster than mapping an `attrgetter`)."""
    return [(i.kind, i.stage, i.value, i.grad, i.mb, i.rows, i.param) for i in instrs]


def meeting_parts(programs: Sequence[RankProgram], held: list[Held] | None = None) -> list[list[int]]:
    """The ranks in parts that meet no rank outside (sends, receives, collectives; links not counted), one part of
    each set of copies among them (instruction by instruction, whatever the devices): what a check of the programs
    against each other, as a deadlock check, needs to run. `held`: `held_alike` of the programs, where the caller
    has it."""
    meetings = Meetings(programs)
    meetings.held = held
    parts = independent_parts(programs, lambda _src, _dst: (), lambda _instr: [], meetings)
    check = CopyCheck(
        programs, lambda _r, _s: True, lambda _src, _dst: (), lambda _src, _dst: 0.0, _no_ring, [], meetings
    )
    return check.distinct(parts)


def _no_ring(_instr: Instr, _rank: int) -> tuple[list[tuple[int, ...]], object]:
    return [], None
