"""A part of a plan whose data-parallel replicas are images of one another, simulated as one replica.

The replicas of a plan meet only in their collectives (the gradient allreduce, a tied parameter's, ZeRO's
reduce-scatter and all-gather): before those, each replica's ranks send only to each other. Where every replica of
a part (`dapple_ir.sim.parts`) is an image of replica 0 (`replica_quotient`) the part's simulation is symmetric:
each replica's ranks do at each moment what replica 0's do, on links of their own that are images of replica 0's,
so a simulation of replica 0 alone gives every rank its timeline. Megatron-scale plans simulate their thousands of
ranks as the ranks of one pipeline.

Replica d's ranks are an image of replica 0's (the part's ranks of each replica, ascending, rank i onto rank i)
where, instruction by instruction, each program holds its counterpart's with:
- the same kind, stage, value, gradient flag, rows and parameter, and the same costs (`rank_alike`: device kind,
  stages, compute, host and optimizer prices; no shared cores, no slower receives), a tensor_allreduce of each
  value priced alike;
- its microbatches renamed by one map per replica (microbatch numbers match a send with its receive, and a
  replica sends only to itself; they pair a forward with its backward);
- at its sends and receives, its peers the counterparts of the other's (a send's links and latency the images of
  the other's under one map of links per replica, keeping bandwidths, no link on two replicas' paths);
- its collectives over the same group, which holds as many ranks of each replica; each step of the group's ring
  crosses only links of some replica's, and each link of replica 0's is crossed by as many steps as each of its
  images.
The simulator then runs replica 0's ranks with link sharing's weights (`dapple_ir.sim.link_sharing`): each of its
transfers counts for the R replicas' on bandwidths R times the links', and each step of a ring, mapped onto
replica 0's links (`ReplicaQuotient.rings`), for itself; a link then carries R times the flows its images carry in
the whole part, and every flow's rate is the whole part's. A ring starts when replica 0's members are all there
(the others are there at the same time). Anything else (a replay, shared cores, another map, a ring over links no
transfer crosses) leaves the part to be simulated whole.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import compress, count
from operator import attrgetter

from dapple_ir.ir import Instr, InstrKind, RankProgram
from dapple_ir.ir.scale import picked

#: What a replica's instruction holds as its counterpart does, compared a program at a time.
_SAME = attrgetter("kind", "stage", "value", "grad", "rows", "param")
_MB, _PEER, _KIND = attrgetter("mb"), attrgetter("peer"), attrgetter("kind._value_")
_SEND = InstrKind.SEND.value
_TENSOR = InstrKind.TENSOR_ALLREDUCE.value

#: (links a send from one rank to another takes time on, its latency).
Route = Callable[[int, int], tuple[tuple[int, ...], float]]


@dataclass
class ReplicaQuotient:
    """The ranks of replica 0 of a part, simulated for all its replicas (`replica_quotient`)."""

    ranks: list[int]
    """Replica 0's ranks of the part, ascending."""
    replicas: int
    """How many replicas it runs for: each of its transfers counts for as many flows on its links."""
    others: list[int]
    """The other replicas' ranks of the part (their timelines are their counterparts')."""
    rings: dict[tuple[int, ...], list[tuple[int, ...]]] = field(default_factory=dict)
    """Per collective group (ascending ranks): the links of each step of its ring, mapped onto replica 0's (none where
    the ring takes no time on any link). Each counts as one flow (`dapple_ir.sim.link_sharing`)."""
    present: dict[tuple[int, ...], int] = field(default_factory=dict)
    """Per collective group: how many of its members are replica 0's (the ring starts when they are all there)."""


def replica_quotient(
    part: list[int],
    programs: Sequence[RankProgram],
    rank_alike: Callable[[int, int], bool],
    route: Route,
    ring_paths: Callable[[tuple[int, ...]], list[tuple[int, ...]]],
    tensor_price: Callable[[int, Instr], float],
    bandwidth: Sequence[float],
    places: Callable[[int], tuple[list[int], list[int]]],
) -> ReplicaQuotient | None:
    """Replica 0 of `part` standing for every replica of it, where each is an image of it (the module docstring);
    None elsewhere, or where the part has one replica. `route(src, dst)`: a send's links and latency;
    `ring_paths(group)`: the links of each step of a ring over `group` that take time; `tensor_price(rank, instr)`:
    a tensor_allreduce's seconds on `rank`; `bandwidth`: each link's; `places(rank)`: where its program names a peer,
    and where it joins a collective (`dapple_ir.sim.parts.Meetings.of`, found once for the parts too)."""
    by_replica: dict[int, list[int]] = {}
    for r in part:
        by_replica.setdefault(programs[r].attrs.replica or 0, []).append(r)
    if len(by_replica) < 2 or 0 not in by_replica or len({len(ranks) for ranks in by_replica.values()}) != 1:
        return None
    base = by_replica[0]
    read = {r: _Read(programs[r].instrs, *places(r)) for r in base}
    links = _LinkMap(bandwidth)
    groups = {tuple(sorted(programs[r].instrs[i].group or ())) for r in base for i in read[r].collectives}
    for d, ranks in by_replica.items():
        if d == 0:
            continue
        onto: dict[int | None, int | None] = dict(zip(base, ranks, strict=True))
        onto[None] = None
        renamed: dict[int | None, int | None] = {None: None}
        for r, s in zip(base, ranks, strict=True):
            if not (rank_alike(r, s) and _image(programs, read[r], r, s, onto, renamed, tensor_price)):
                return None
            if not _routes_image(read[r].sent_to, r, s, onto, route, links, d):
                return None
    others = [r for d, ranks in by_replica.items() if d != 0 for r in ranks]
    quotient = ReplicaQuotient(base, len(by_replica), others)
    mine = set(base)
    for group in groups:
        found = _ring_image(group, by_replica, ring_paths, links)
        if found is None:
            return None
        quotient.rings[group] = found
        quotient.present[group] = sum(1 for r in group if r in mine)
    return quotient


class _Read:
    """What `_image` reads of one of replica 0's programs, once for all its images."""

    def __init__(self, instrs: list[Instr], named: list[int], joined: list[int]) -> None:
        self.same = list(map(_SAME, instrs))
        self.moves = named
        """Where it names a peer (its sends and receives)."""
        moved = picked(instrs, named)
        self.peers = list(map(_PEER, moved))
        self.mbs = list(map(_MB, instrs))
        """Every microbatch: a send's and its receive's match them, and the memory (where receives are posted)
        pairs each forward's with its backward's."""
        self.collectives = joined
        """Where its collectives are."""
        first: dict[object, int] = {}
        for i in compress(count(), map(_TENSOR.__eq__, map(_KIND, instrs))):
            first.setdefault(instrs[i].value, i)
        self.tensor = list(first.values())
        """Where the first tensor_allreduce of each value is."""
        self.sent_to = set(compress(self.peers, map(_SEND.__eq__, map(_KIND, moved))))
        """The ranks it sends to."""


def _image(
    programs: Sequence[RankProgram],
    read: _Read,
    r: int,
    s: int,
    onto: dict[int | None, int | None],
    renamed: dict[int | None, int | None],
    tensor_price: Callable[[int, Instr], float],
) -> bool:
    """Whether rank `s`'s program is rank `r`'s (`read`) with its peers mapped by `onto`, its microbatches renamed by
    one map (`renamed`, extended here: one per replica, shared by its ranks), its collectives over the same groups
    and its tensor_allreduces priced alike."""
    mine, theirs = programs[r].instrs, programs[s].instrs
    if len(mine) != len(theirs) or read.same != list(map(_SAME, theirs)):
        return False
    if list(map(onto.get, read.peers)) != list(map(_PEER, picked(theirs, read.moves))):
        return False
    their_mbs = list(map(_MB, theirs))
    local = dict(zip(read.mbs, their_mbs, strict=True))
    if list(map(local.get, read.mbs)) != their_mbs:
        return False
    if list(map(renamed.get, local.keys(), local.values())) != list(local.values()):
        return False  # renamed otherwise on another rank of the replica
    renamed.update(local)
    if len(set(renamed.values())) != len(renamed):
        return False  # two microbatches renamed to one
    for i in read.collectives:
        a, b = mine[i], theirs[i]
        if a.group is None or b.group != a.group or r not in a.group or s not in b.group:
            return False
    return all(tensor_price(r, mine[i]) == tensor_price(s, theirs[i]) for i in read.tensor)


class _LinkMap:
    """Each link a replica's sends cross, onto replica 0's link it is the image of, with its replica: one map per
    replica, one-to-one, keeping bandwidths, no link on two replicas' paths."""

    def __init__(self, bandwidth: Sequence[float]) -> None:
        self.bandwidth = bandwidth
        self.owner: dict[int, tuple[int, int]] = {}
        """Link -> (replica, replica 0's link it is the image of)."""
        self.image: dict[tuple[int, int], int] = {}
        """(replica, replica 0's link) -> the replica's link."""

    def add(self, d: int, path: tuple[int, ...], base: tuple[int, ...]) -> bool:
        if len(path) != len(base):
            return False
        for link, pre in zip(path, base, strict=True):
            if self.owner.setdefault(link, (d, pre)) != (d, pre) or self.image.setdefault((d, pre), link) != link:
                return False
            if self.bandwidth[link] != self.bandwidth[pre]:
                return False
        return True


def _routes_image(
    sent_to: set[int | None],
    r: int,
    s: int,
    onto: dict[int | None, int | None],
    route: Route,
    links: _LinkMap,
    d: int,
) -> bool:
    """Whether each send of rank `s` (replica `d`'s image of rank `r`, which sends to `sent_to`) takes the images of
    the links of `r`'s counterpart send (extending `links`), with its latency."""
    for peer in sent_to:
        assert peer is not None
        path, latency = route(r, peer)
        their_path, their_latency = route(s, onto[peer])  # type: ignore[arg-type]
        if latency != their_latency or not (links.add(0, path, path) and links.add(d, their_path, path)):
            return False
    return True


def _ring_image(
    group: tuple[int, ...],
    by_replica: dict[int, list[int]],
    ring_paths: Callable[[tuple[int, ...]], list[tuple[int, ...]]],
    links: _LinkMap,
) -> list[tuple[int, ...]] | None:
    """The ring of a collective over `group`: each step's links mapped onto replica 0's. None where the group does not
    hold as many ranks of every replica, or a step crosses a link of no replica's, or a replica's link is crossed by
    more steps than its images are."""
    owner = {r: d for d, ranks in by_replica.items() for r in ranks}
    held = Counter(owner.get(r, -1) for r in group)
    if set(held) != set(by_replica) or len(set(held.values())) != 1:
        return None
    paths = ring_paths(group)
    if any(link not in links.owner for path in paths for link in path):
        return None
    crossed = Counter(links.owner[link] for path in paths for link in path)
    by_link: dict[int, dict[int, int]] = {}
    for (d, pre), n in crossed.items():
        by_link.setdefault(pre, {})[d] = n
    if any(len(counts) != len(by_replica) or len(set(counts.values())) != 1 for counts in by_link.values()):
        return None
    return [tuple(links.owner[link][1] for link in path) for path in paths]
