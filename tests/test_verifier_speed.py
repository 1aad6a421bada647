"""The verifier's shortcuts for programs that share a shape give the verdict of a walk over every instruction.

A shape's sharded collectives are found once, on its first program (`_Verifier.may_break`): the kinds are part of
the shape, so every later program of it has them at the same places. A later rank whose last sharded collective
breaks, or a plan whose programs host an undeclared stage, fails with the message of the whole walk.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest

from dapple_ir.analysis.peak_memory import Sizes, program_peak, program_shape
from dapple_ir.errors import VerifyError
from dapple_ir.ir import InstrKind, verifier
from dapple_ir.ir.verifier import verify_module
from dapple_ir.pass_manager import PassManager, build_pipeline
from dapple_ir.registry import PassContext
from tests.test_compile_scale import _compiled, _first_problem_walked_whole

_SHARDED = (InstrKind.REDUCE_SCATTER, InstrKind.ALL_GATHER)


def test_each_shape_records_where_its_sharded_collectives_are() -> None:
    module = _compiled("zero")
    checker = verifier._Verifier(module)
    shapes: verifier._Shapes = {}
    n = len(module.programs)
    for rank, program in enumerate(module.programs):
        checker.may_break(program, rank, n, shapes)
    assert len(shapes) < n
    for first, sharded in shapes.values():
        instrs = module.programs[first].instrs
        assert sharded == tuple(k for k, i in enumerate(instrs) if i.kind in _SHARDED)
        assert sharded


@pytest.mark.parametrize("kind", _SHARDED)
def test_a_later_ranks_last_sharded_collective_broken_fails_as_walked_whole(kind: InstrKind) -> None:
    module = copy.deepcopy(_compiled("zero"))
    rank = len(module.programs) - 1
    instrs = module.programs[rank].instrs
    index = max(k for k, i in enumerate(instrs) if i.kind is kind)
    instrs[index] = dataclasses.replace(instrs[index], group=(rank,))
    expected = _first_problem_walked_whole(module)
    assert expected is not None and f"{module.programs[rank].name}, instruction {index}" in expected
    with pytest.raises(VerifyError) as info:
        verify_module(module)
    assert str(info.value).splitlines()[0] == expected


def test_a_program_hosting_an_undeclared_stage_is_named() -> None:
    module = copy.deepcopy(_compiled("zero"))
    program = module.programs[-1]
    program.attrs.stages = (*(program.attrs.stages or ()), "nowhere")
    with pytest.raises(VerifyError, match=f"program @{program.name} hosts stage @nowhere, which is not declared"):
        verify_module(module)


# ------------------------------------------------------------------ insert-frees, one shape per program alike


@pytest.mark.parametrize(
    "name", ["uneven split, zb-h1", "tensor groups, split", "tensor groups, round-robin, recompute"]
)
def test_insert_frees_peaks_from_shared_shapes_equal_each_programs_own(name: str) -> None:
    """`insert-frees` run again (its frees found afresh, no lowering handed on): each peak it records from a shape
    worked out once for programs alike is the peak of the program's own `program_shape`."""
    module = copy.deepcopy(_compiled(name))
    for program in module.programs:
        program.attrs.peak_bytes = None
    PassManager(build_pipeline("insert-frees")).run(module, PassContext())
    sizes = Sizes(module)
    for program in module.programs:
        own = program_peak(module, program, sizes, program_shape(module, program))
        assert program.attrs.peak_bytes == own.total, program.name
    if not any(s.split for s in module.stages):  # a split stage's replicas may each hold a share of their own
        assert len(sizes.shapes) < len(module.programs)
