"""The plan checks' shortcuts for programs that hold an earlier one's very instructions give what each program's own
walk gives.

A tensor group's member holds its lead's computations, sums and frees (`HeldAlike`): `program_shapes` gives it its
lead's shape where what it holds of its own matches, and works its shape out otherwise. Here the labels are held to
`program_shape` pair by pair, on plans as compiled and on members changed at a place of their own in each field the
shape reads, and in their replica.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import pytest

from dapple_ir.analysis.peak_memory import program_shape
from dapple_ir.analysis.plan_checks import program_shapes
from dapple_ir.ir import Instr, InstrKind, Module
from dapple_ir.ir.scale import HeldAlike
from tests.test_compile_scale import _compiled

_PLANS = ["tensor groups, round-robin, recompute", "tensor groups, split", "zero", "interleaved, recompute"]


def _assert_labels_are_shapes(module: Module) -> None:
    labels = program_shapes(module)
    shapes = [program_shape(module, p) for p in module.programs]
    for i, shape in enumerate(shapes):
        for j, other in enumerate(shapes):
            assert (labels[i] == labels[j]) == (shape == other), (i, j)


@pytest.mark.parametrize("name", _PLANS)
def test_shape_labels_are_equal_where_the_shapes_are(name: str) -> None:
    _assert_labels_are_shapes(_compiled(name))


def _own_send(module: Module) -> tuple[int, int]:
    """A member of a tensor group and the place of its last send, one of its own (not its lead's instruction)."""
    alike = HeldAlike(module.programs)
    found = [alike.find(index) for index in range(len(module.programs))]
    member = max(index for index, held in enumerate(found) if held is not None)
    held = found[member]
    assert held is not None
    instrs = module.programs[member].instrs
    return member, max(k for k in held[1] if instrs[k].kind is InstrKind.SEND)


CHANGES: dict[str, Callable[[Instr], Instr]] = {
    "rows": lambda i: dataclasses.replace(i, rows=(0, 1)),
    "grad": lambda i: dataclasses.replace(i, grad=not i.grad),
    "microbatch": lambda i: dataclasses.replace(i, mb=0),
    "kind": lambda i: dataclasses.replace(i, kind=InstrKind.RECV),
    "value": lambda i: dataclasses.replace(i, value=None),
    "stage": lambda i: dataclasses.replace(i, stage=None),
    "peer only": lambda i: dataclasses.replace(i, peer=0),
}


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("name", ["tensor groups, round-robin, recompute", "tensor groups, split"])
def test_a_member_changed_at_a_place_of_its_own_gets_its_own_shape(name: str, change: str) -> None:
    module = copy.deepcopy(_compiled(name))
    member, index = _own_send(module)
    instrs = module.programs[member].instrs
    instrs[index] = CHANGES[change](instrs[index])
    _assert_labels_are_shapes(module)


def test_a_member_of_another_replica_of_a_split_stage_gets_its_own_shape() -> None:
    module = copy.deepcopy(_compiled("tensor groups, split"))
    member, _index = _own_send(module)
    program = module.programs[member]
    program.attrs = dataclasses.replace(program.attrs, replica=1 - (program.attrs.replica or 0))
    _assert_labels_are_shapes(module)


def test_a_member_whose_own_places_number_microbatches_apart_gets_its_own_shape() -> None:
    """Its own instructions alone are numbered as its lead's (each microbatch moved by the same count), but not
    together with the computations it shares: the microbatches are compared as they are."""
    module = copy.deepcopy(_compiled("tensor groups, round-robin, recompute"))
    member, _index = _own_send(module)
    held = HeldAlike(module.programs)
    found = [held.find(index) for index in range(member + 1)][member]
    assert found is not None
    instrs = module.programs[member].instrs
    moved = (module.attrs.microbatches or 0) + 1
    for k in found[1]:
        if instrs[k].mb is not None:
            instrs[k] = dataclasses.replace(instrs[k], mb=(instrs[k].mb or 0) + moved)
    _assert_labels_are_shapes(module)


def test_members_with_their_own_instructions_at_other_places_are_each_held_at_theirs() -> None:
    """Two members of one lead hold copies at two neighbouring places: the first a copy of the lead's instruction
    there (its lead's shape), the second a copy of that same instruction one place later (a shape of its own)."""
    module = copy.deepcopy(_compiled("tensor groups, split"))
    alike = HeldAlike(module.programs)
    found = [alike.find(index) for index in range(len(module.programs))]
    lead = next(h[0] for h in found if h is not None)
    first, second = [index for index, h in enumerate(found) if h is not None and h[0] == lead][:2]
    held = found[first]
    assert held is not None
    instrs = module.programs[lead].instrs
    p = next(
        k
        for k in range(len(instrs) - 1)
        if k not in held[1] and k + 1 not in held[1] and instrs[k].value is not instrs[k + 1].value
    )
    module.programs[first].instrs[p] = dataclasses.replace(instrs[p])
    module.programs[second].instrs[p + 1] = dataclasses.replace(instrs[p])
    labels = program_shapes(module)
    assert labels[first] == labels[lead] != labels[second]
    _assert_labels_are_shapes(module)


def test_the_checks_that_run_are_decided_past_a_first_rank_that_lacks_frees_or_transfers() -> None:
    """`run_plan_checks` reads kinds until a rank that meets others and a free are found: a first rank without frees
    leaves the frees check to the ranks after it, one without transfers or collectives the deadlock check."""
    from dapple_ir.analysis.plan_checks import run_plan_checks
    from dapple_ir.errors import VerifyError

    meets = {InstrKind.SEND, InstrKind.RECV, InstrKind.ALLREDUCE, InstrKind.REDUCE_SCATTER, InstrKind.ALL_GATHER}
    for dropped, says in ((meets, "deadlock"), ({InstrKind.FREE}, "rank 0 never frees")):
        module = copy.deepcopy(_compiled("round-robin, recompute"))
        first = module.programs[0]
        first.instrs = [i for i in first.instrs if i.kind not in dropped]
        with pytest.raises(VerifyError, match=says):
            run_plan_checks(module)
