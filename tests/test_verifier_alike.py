"""The verifier's shortcuts give, field by field, the verdict of a walk over every instruction of every rank.

`_Verifier.may_break` asks `instr_problem` of one instruction per class of a shape's first program (`shape_problem`),
holds later programs of the shape to it, and a program that holds the very instructions of an earlier one at most
places (a tensor group's member, `HeldAlike`) to that one at the places where it holds its own. Here one field of one
instruction of each kind, on a shape's first rank, on a member or replica after it, and on the last rank, is set to
each value that breaks it (and to some that do not), either in a new instruction put in its place or in the very
object, which the members of a tensor group share; `verify_module` must say what the walk over every instruction
says, or pass where the walk finds nothing.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator

import pytest

from dapple_ir.errors import VerifyError
from dapple_ir.ir import Instr, Module, verifier
from dapple_ir.ir.scale import HeldAlike
from dapple_ir.ir.verifier import verify_module
from tests.test_compile_scale import _compiled, _first_problem_walked_whole

_PLANS = ["tensor groups, round-robin, recompute", "tensor groups, split", "zero", "uneven split, zb-h1"]


def _values(module: Module, rank: int, instr: Instr) -> Iterator[tuple[str, object]]:
    """Values of each field that break an instruction (of some kind) or leave it whole."""
    n = len(module.programs)
    group = instr.group or (rank,)
    yield from [("stage", None), ("stage", copy.copy(module.stages[0])), ("stage", module.stages[-1])]
    yield from [("value", None), ("value", copy.copy(module.ops[0])), ("value", module.ops[-1])]
    yield from [("mb", None), ("mb", -1), ("mb", module.attrs.microbatches), ("mb", 0)]
    yield from [("peer", None), ("peer", rank), ("peer", n), ("peer", (rank + 1) % n)]
    yield from [("group", None), ("group", (rank,)), ("group", tuple(r for r in group if r != rank) or (n,))]
    yield from [("group", (*group, n)), ("group", tuple(range(n)))]
    yield from [("param", None), ("param", "nowhere"), ("param", module.params[0].name)]


def _verdict(module: Module) -> str | None:
    try:
        verify_module(module)
    except VerifyError as exc:
        return str(exc).splitlines()[0]
    return None


def _cases(module: Module) -> Iterator[tuple[int, int, str, object]]:
    """(rank, instruction index, field, value): the first instruction of each kind of a few ranks."""
    n = len(module.programs)
    for rank in sorted({0, 1, n // 2, n - 1}):
        instrs = module.programs[rank].instrs
        firsts = {instr.kind: index for index, instr in reversed(list(enumerate(instrs)))}
        for index in sorted(firsts.values()):
            for name, value in _values(module, rank, instrs[index]):
                yield rank, index, name, value


@pytest.mark.parametrize("in_place", [False, True], ids=["replaced", "in place"])
@pytest.mark.parametrize("name", _PLANS)
def test_each_field_broken_anywhere_fails_as_walked_whole(
    name: str, in_place: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = copy.deepcopy(_compiled(name))
    monkeypatch.setattr(verifier, "neighbourhood", lambda *_args: "")  # the first line is compared
    wrong = []
    for rank, index, field, value in _cases(module):
        instrs = module.programs[rank].instrs
        instr = instrs[index]
        was = getattr(instr, field)
        if in_place:
            setattr(instr, field, value)
        else:
            instrs[index] = dataclasses.replace(instr)
            setattr(instrs[index], field, value)
        expected, got = _first_problem_walked_whole(module), _verdict(module)
        if got != expected:
            wrong.append(f"rank {rank} instruction {index} {field} = {value!r}: {got!r}, walked whole {expected!r}")
        setattr(instr, field, was)
        instrs[index] = instr
    assert not wrong, "\n".join(wrong[:10])
    assert _verdict(module) is None


def test_a_tensor_groups_members_are_held_to_their_lead() -> None:
    """The members of each tensor group hold their lead's very instructions but at their transfers and collectives."""
    module = _compiled("tensor groups, round-robin, recompute")
    alike = HeldAlike(module.programs)
    found = [alike.find(index) for index in range(len(module.programs))]
    for index, program in enumerate(module.programs):
        if not program.attrs.tensor_rank:
            assert found[index] is None
            continue
        held = found[index]
        assert held is not None
        lead = module.programs[held[0]]
        assert lead.attrs.tensor_rank is None and lead.attrs.stages == program.attrs.stages
        assert held[1] == [k for k, (a, b) in enumerate(zip(program.instrs, lead.instrs, strict=True)) if a is not b]
        assert held[1] and all(program.instrs[k].peer is not None or program.instrs[k].group for k in held[1])


def test_a_keyed_programs_instructions_are_read_at_the_places_asked() -> None:
    """`_Keyed.held_at` keeps its last answer for the next member: asked at other places, it reads those."""
    module = _compiled("tensor groups, round-robin, recompute")
    instrs = module.programs[0].instrs
    keyed = verifier._Keyed((), set(), set())
    for places in ([0, 1], [0, 1], [2, 5], [len(instrs) - 1], []):
        columns = verifier._columns([instrs[k] for k in places])
        assert keyed.held_at(instrs, places) == (columns[:4], tuple(map(verifier._nones, columns[4:])))
