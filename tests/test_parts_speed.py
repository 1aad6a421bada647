"""The shortcuts of `dapple_ir.sim.parts.CopyCheck` against the slow walk they stand for: a tensor group's member is
compared with its lead at the lead's meeting places, and found to hold the lead's very instructions elsewhere, either
from `Meetings.held` (what `independent_parts` found in the same look, as `meeting_parts` runs them) or by comparing
the two programs whole by identity (`alike_elsewhere`, as the simulator asks). Whatever a member holds, at its own
places or at those it shares, each way answers what comparing every instruction of every rank answers."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator

import pytest

from dapple_ir.ir import Instr, InstrKind, Module, ProgramAttrs, RankProgram
from dapple_ir.ir.scale import held_alike
from dapple_ir.sim.parts import CopyCheck, Meetings, _no_ring, independent_parts
from tests.test_sim_parts import _compiled

_FIELD_NAMES = ("kind", "stage", "value", "grad", "mb", "rows", "param")


def _walked(programs: list[RankProgram], rep: list[int], part: list[int]) -> bool:
    """Whether `part` is a copy of `rep` (links not counted), every instruction of every rank compared."""
    onto = dict(zip(rep, part, strict=True))
    for r, s in zip(rep, part, strict=True):
        mine, theirs = programs[r].instrs, programs[s].instrs
        if len(mine) != len(theirs):
            return False
        for a, b in zip(mine, theirs, strict=True):
            if any(getattr(a, name) != getattr(b, name) for name in _FIELD_NAMES):
                return False
            if (onto.get(a.peer) if a.peer is not None else None) != b.peer:
                return False
            kept = a.group is None or a.kind is InstrKind.TENSOR_ALLREDUCE
            if (a.group if kept else tuple(onto.get(g, -1) for g in a.group or ())) != b.group:
                return False
    return True


def _check(programs: list[RankProgram], meetings: Meetings | None) -> CopyCheck:
    return CopyCheck(programs, lambda _r, _s: True, lambda _a, _b: (), lambda _a, _b: 0.0, _no_ring, [], meetings)


def _ways(programs: list[RankProgram]) -> dict[str, CopyCheck]:
    """A `CopyCheck` that finds a member's other places by comparing it whole (the simulator's), and one that takes
    them from `independent_parts`'s look (`meeting_parts`'s)."""
    meetings = Meetings(programs)
    independent_parts(programs, lambda _a, _b: (), lambda _instr: [], meetings)
    return {"compared whole": _check(programs, None), "found by independent_parts": _check(programs, meetings)}


def _changes(module: Module, rep: list[int], part: list[int]) -> Iterator[tuple[str, bool]]:
    """The member's program changed, in turn, at its own places and at places it shares with its lead; with whether
    the part stays a copy."""
    member, lead = part[0], rep[0]
    instrs = module.programs[member].instrs
    held = held_alike(module.programs)[member]
    assert held is not None and held[0] == lead
    own = held[1]
    shared = [k for k in range(len(instrs)) if k not in set(own)]
    send = next(k for k in own if instrs[k].kind is InstrKind.SEND)
    allreduce = next(k for k in own if instrs[k].kind is InstrKind.ALLREDUCE)
    compute = next(k for k in shared if instrs[k].kind is InstrKind.FORWARD)
    tensor = next(k for k in shared if instrs[k].kind is InstrKind.TENSOR_ALLREDUCE)
    assert instrs[tensor].group is not None
    other_group = tuple(reversed(instrs[tensor].group))
    mb = instrs[compute].mb
    assert mb is not None
    yield "as compiled", True
    for where, k, change, copies in (
        ("own send, another microbatch", send, dict(mb=(instrs[send].mb or 0) + 1), False),
        ("own send, to the lead's plane", send, dict(peer=rep[1]), False),
        ("own allreduce, another group", allreduce, dict(group=(member, rep[1])), False),
        ("shared place, an equal instruction of its own", compute, {}, True),
        ("shared place, another microbatch", compute, dict(mb=mb + 1), False),
        ("shared place, a send", compute, dict(kind=InstrKind.SEND, peer=part[1]), False),
        ("shared place, a group", compute, dict(group=(member, part[1])), False),
        ("shared tensor_allreduce, another group", tensor, dict(group=other_group), False),
    ):
        was = instrs[k]
        instrs[k] = dataclasses.replace(was, **change)  # type: ignore[arg-type]
        yield where, copies
        instrs[k] = was
    # The very instruction the lead and the member hold, changed in place: the member's still the lead's.
    was_mb = instrs[compute].mb
    instrs[compute].mb = mb + 1
    yield "shared place changed in place", True
    instrs[compute].mb = was_mb


@pytest.mark.parametrize("name", ["T2 D2 P2 interleaved", "T4 D2 P2 1f1b"])
def test_each_shortcut_answers_what_the_whole_walk_answers(name: str) -> None:
    module = copy.deepcopy(_compiled(name))
    programs = module.programs
    rep, part = independent_parts(programs, lambda _a, _b: (), lambda _instr: [])[:2]
    answers = []
    for where, copies in _changes(module, rep, part):
        assert _walked(programs, rep, part) is copies, where
        for way, check in _ways(programs).items():
            assert check.copies(rep, part) is copies, (where, way)
        answers.append(copies)
    assert set(answers) == {True, False}


def test_the_shortcuts_are_taken() -> None:
    """As compiled, each way compares a member at its lead's meeting places alone."""
    programs = _compiled("T2 D2 P2 interleaved").programs
    rep, part = independent_parts(programs, lambda _a, _b: (), lambda _instr: [])[:2]
    for way, check in _ways(programs).items():
        assert check.copies(rep, part), way
        for r in rep:
            assert check.looked_at(r, []).places == sorted(set(check.meeting_places(r))), way
    compared, found = _ways(programs).values()
    compared.copies(rep, part)
    found.copies(rep, part)
    assert set(compared.templates) == set(rep) and not found.templates


def test_a_template_is_not_trusted_at_places_it_was_not_given() -> None:
    """`alike_elsewhere` writes a copy's instructions into its list of the rank's: asked of other places, it starts
    from the rank's again (else the first copy's instructions would pass for the rank's)."""
    a, b, x, y = (Instr(InstrKind.FORWARD, mb=k) for k in range(4))
    programs: list[RankProgram] = [
        RankProgram(f"rank{k}", instrs, ProgramAttrs(rank=k)) for k, instrs in enumerate([[a, b], [x, b], [x, y]])
    ]
    check = _check(programs, None)
    assert check.alike_elsewhere(0, [0], programs[1].instrs, [x])
    assert not check.alike_elsewhere(0, [1], programs[2].instrs, [y])
    assert check.alike_elsewhere(0, [0, 1], programs[2].instrs, [x, y])
