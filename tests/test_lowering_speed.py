"""The shortcuts that make `lower-comm` and `insert-frees` fast at a thousand ranks give what the plain walks give:
transfers memoised by microbatch residue, free points found once for programs read alike."""

from __future__ import annotations

import dataclasses

import pytest

from dapple_ir.analysis import lowering
from dapple_ir.ir import Instr, InstrKind, Module, Op, RankProgram, Stage
from dapple_ir.pass_manager import PassManager, build_pipeline
from dapple_ir.passes import insert_frees
from dapple_ir.registry import PassContext
from tests.pipeline_fixtures import chain_module


def _scheduled(replicas: list[int], microbatches: int, skip: bool = False) -> Module:
    module = chain_module([1] * len(replicas), replicas, skip=skip)
    PassManager(build_pipeline(f"schedule{{kind=1f1b,microbatches={microbatches}}}")).run(module, PassContext())
    return module


@pytest.mark.parametrize(
    ("replicas", "skip"), [([2, 3, 1], False), ([3, 2, 2], True), ([1, 4, 2], True)], ids=["2-3-1", "3-2-2", "1-4-2"]
)
def test_transfers_memoised_by_microbatch_residue_are_each_microbatchs_own(replicas: list[int], skip: bool) -> None:
    """`pieces` keeps one answer for the microbatches alike modulo the producer's and the consumer's replica counts:
    each is what a lowering that never answered before finds for that microbatch."""
    module = _scheduled(replicas, 12, skip)
    memoised = lowering._Lowering(module)
    for c in memoised.crossings:
        for mb in range(12):
            assert memoised.pieces(c, mb) == lowering._Lowering(module).pieces(c, mb), (c.value.name, mb)


def _frees_of(
    program: RankProgram, module: Module, made: dict[object, list[insert_frees._Freed]]
) -> list[tuple[int, list[Instr]]]:
    readers: dict[Op, list[Stage]] = {}
    for stage in module.stages:
        for v in {v for op in stage.ops for v in op.operands}:
            readers.setdefault(v, []).append(stage)
    definers = {op: s for s in module.stages for op in s.ops}
    return insert_frees._with_frees(program, readers, definers, made)[1]


def _read(points: list[tuple[int, list[Instr]]]) -> list[tuple[int, list[tuple[object, ...]]]]:
    """Where each free goes and what it frees (free instructions made apart are other objects)."""
    return [(at, [(f.stage, f.value, f.grad, f.mb) for f in frees]) for at, frees in points]


def test_free_points_are_shared_only_by_programs_read_alike_whole() -> None:
    """Programs that read alike in their first instructions but not after get frees of their own, the same as alone;
    those alike but for peers share the very free points."""
    module = _scheduled([1, 1], 12)
    (first, _second) = lowering.lowered_programs(module)
    backwards = [k for k, i in enumerate(first.instrs) if i.kind is InstrKind.BACKWARD]
    late, last = backwards[-2], backwards[-1]
    assert late > insert_frees._PROBED  # differs past what `_with_frees` compares first
    swapped = list(first.instrs)
    swapped[late], swapped[last] = swapped[last], swapped[late]
    other = RankProgram("other", swapped, first.attrs)
    repeered = RankProgram("repeered", [dataclasses.replace(i, peer=7) for i in first.instrs], first.attrs)
    made: dict[object, list[insert_frees._Freed]] = {}
    own = _frees_of(first, module, made)
    assert _read(_frees_of(other, module, made)) == _read(_frees_of(other, module, {})) != _read(own)
    assert _frees_of(repeered, module, made) is own
