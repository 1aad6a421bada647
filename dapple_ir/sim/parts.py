"""The independent parts of a plan, for the simulator, and the parts that are copies of one another.

Two ranks are in one part where one sends to the other, where both take part in one collective over the links
(`allreduce`, `reduce_scatter`, `all_gather`; a `tensor_allreduce` is priced as each member's own time and
orders nothing between them), where flows of theirs could cross one link, or where they take turns on one node's
cores. Ranks of different parts never wait on one another and never share a link's bandwidth, so the simulator
runs each part on its own clock, queue and links (`_Simulator.engine`): what a part computes then depends on
nothing outside it.

A part is a *copy* of an earlier one where an order-keeping map of its ranks onto the earlier part's takes every
program onto the other's instruction by instruction (sends and receives to the mapped peers, collectives over the
mapped group, every other instruction the same), every rank onto one of the same device kind, replica, stages,
costs and start, and every link its flows cross onto a distinct link of the same bandwidth that the earlier
part's matching flows cross, latencies and ring prices alike. Then the two parts' simulations make the very same
floating-point operations in the very same order, and the copy's timeline is the earlier part's: the members of
a tensor-parallel group, each with its own network card, are T such parts, simulated once (`_Simulator.predict`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import compress, count, repeat
from operator import attrgetter, is_not

from dapple_ir.ir import COLLECTIVE_KINDS, Instr, InstrKind, RankProgram

_TENSOR = InstrKind.TENSOR_ALLREDUCE
#: An instruction's kind by its text, its peer, its group: read for millions of instructions without a Python call each.
_KIND, _PEER = attrgetter("kind._value_"), attrgetter("peer")
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
    send = InstrKind.SEND.value
    for rank, program in enumerate(programs):
        instrs = program.instrs
        # Each peer once, and the collectives alone: a thousand ranks' programs are millions of instructions.
        for kind, peer in set(zip(map(_KIND, instrs), map(_PEER, instrs), strict=True)):
            if peer is None:
                continue
            if kind == send:
                _link_ranks(parent, on_link, rank, route(rank, peer))
            _union(parent, rank, peer)
        for instr in compress(instrs, map(_COLLECTIVE.__contains__, map(_KIND, instrs))):
            assert instr.group is not None
            for member in instr.group:
                _union(parent, rank, member)
            for links in ring_routes(instr):
                _link_ranks(parent, on_link, rank, links)
    return _grouped(parent)


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
    price (anything comparable); `posts(rank)`: per instruction, the receives posted before it (None: none), each a
    key whose fourth and fifth entries are the sending and receiving ranks."""

    def __init__(
        self,
        programs: Sequence[RankProgram],
        same_rank: Callable[[int, int], bool],
        route: Route,
        latency: Callable[[int, int], float],
        ring: Callable[[Instr, int], tuple[list[tuple[int, ...]], object]],
        posts: Callable[[int], list[list[tuple] | None]],  # type: ignore[type-arg]
        bandwidth: Sequence[float],
    ) -> None:
        self.programs = programs
        self.same_rank = same_rank
        self.route = route
        self.latency = latency
        self.ring = ring
        self.posts = posts
        self.bandwidth = bandwidth

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
        routes: set[tuple[int, int]] = set()
        rings: set[tuple[int, ...]] = set()
        for r, s in zip(rep, part, strict=True):
            if not self.same_rank(r, s) or not self.same_posts(r, s, onto):
                return False
            mine, theirs = programs[r].instrs, programs[s].instrs
            # Where the two programs hold other instructions, and where they must (their peers and groups differ):
            # found without a Python call per instruction; elsewhere both hold the very same instruction.
            look = set(compress(count(), map(is_not, mine, theirs)))
            look.update(compress(count(), map(is_not, map(_PEER, mine), repeat(None))))
            look.update(compress(count(), map(_COLLECTIVE.__contains__, map(_KIND, mine))))
            for i in look:
                a, b = mine[i], theirs[i]
                if not _same_instr(a, b, onto):
                    return False
                if a.peer is not None and a.kind is InstrKind.SEND and (r, a.peer) not in routes:
                    routes.add((r, a.peer))
                    if not self.same_route(r, a.peer, s, onto[a.peer], links, back):
                        return False
                elif a.group is not None and a.kind in COLLECTIVE_KINDS and a.group not in rings:
                    rings.add(a.group)
                    (paths, price), (their_paths, their_price) = self.ring(a, r), self.ring(b, s)
                    if price != their_price or not self.same_links(paths, their_paths, links, back):
                        return False
        return True

    def same_posts(self, r: int, s: int, onto: dict[int, int]) -> bool:
        mine, theirs = self.posts(r), self.posts(s)
        where = list(compress(count(), map(is_not, mine, repeat(None))))
        if where != list(compress(count(), map(is_not, theirs, repeat(None)))):
            return False
        for i in where:
            a_posts, b_posts = mine[i], theirs[i]
            assert a_posts is not None and b_posts is not None
            if len(a_posts) != len(b_posts):
                return False
            for a, b in zip(a_posts, b_posts, strict=True):
                if a[:3] != b[:3] or onto.get(a[3]) != b[3] or onto.get(a[4]) != b[4]:
                    return False
        return True

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


def _same_instr(a: Instr, b: Instr, onto: dict[int, int]) -> bool:
    """Whether `b` is `a` with its peer, or its collective's group, mapped by `onto` (a tensor group kept as it is)."""
    if a.kind is not b.kind or a.stage is not b.stage or a.value is not b.value or a.param != b.param:
        return False
    if a.grad != b.grad or a.mb != b.mb or a.rows != b.rows:
        return False
    if a.peer is not None or b.peer is not None:
        return a.peer is not None and onto.get(a.peer) == b.peer
    if a.group is None or b.group is None:
        return a.group == b.group
    if a.kind is _TENSOR:
        return a.group == b.group
    return tuple(onto.get(g, -1) for g in a.group) == b.group
