"""`insert-frees`: release every kept tensor right after its last use, then record each rank's peak memory.

Release points, for microbatch m on one rank:
  * `free @s mb=m`: the stage's saved activations, after its backward (after backward_weight when split);
  * `free %v mb=m`: a received activation, after the release of the last stage on the rank that reads it;
  * `free grad %v mb=m`: a received gradient, after the release of the stage that defines v.
Frees follow the sends that directly follow that compute, so gradients leave before memory is returned.
`program.attrs.peak_bytes` is then the static peak of `dapple_ir.analysis.peak_memory`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dapple_ir.analysis.peak_memory import Sizes, program_peak
from dapple_ir.errors import ScheduleError
from dapple_ir.ir import Instr, InstrKind, Module, Op, RankProgram, Stage
from dapple_ir.ir.scale import collector_paused
from dapple_ir.registry import Pass, PassContext, register_pass

_RELEASE = (InstrKind.BACKWARD, InstrKind.BACKWARD_WEIGHT)


@register_pass
@dataclass(frozen=True)
class InsertFrees(Pass):
    """Free saved activations and received tensors after their last use; store each rank's peak bytes."""

    name = "insert-frees"

    def apply(self, ctx: PassContext, module: Module) -> None:
        if not module.programs:
            raise ScheduleError("insert-frees: the module has no rank programs; run `schedule` first")
        readers: dict[Op, list[Stage]] = {}
        for stage in module.stages:
            for v in {v for op in stage.ops for v in op.operands}:
                readers.setdefault(v, []).append(stage)
        definers = {op: s for s in module.stages for op in s.ops}
        with collector_paused():
            for program in module.programs:
                program.instrs = _with_frees(program, readers, definers)
            sizes = Sizes(module)
            for program in module.programs:
                program.attrs.peak_bytes = program_peak(module, program, sizes).total


def _release_index(instrs: list[Instr]) -> dict[tuple[Stage, int], int]:
    """Index of the compute that releases each (stage, mb): its backward_weight if split, else its backward."""
    result: dict[tuple[Stage, int], int] = {}
    backward, backward_weight = _RELEASE
    for index, instr in enumerate(instrs):
        kind = instr.kind
        if (kind is backward or kind is backward_weight) and instr.stage is not None and instr.mb is not None:
            result[(instr.stage, instr.mb)] = index
    return result


def _with_frees(program: RankProgram, readers: dict[Op, list[Stage]], definers: dict[Op, Stage]) -> list[Instr]:
    # Kinds compare by identity in the loops below: hashing an enum member runs Python code, too slow per instruction.
    free_kind, forward, recv, send = InstrKind.FREE, InstrKind.FORWARD, InstrKind.RECV, InstrKind.SEND
    instrs = [i for i in program.instrs if i.kind is not free_kind]
    release = _release_index(instrs)
    frees: dict[int, list[Instr]] = {}

    made: set[tuple[object, ...]] = set()

    def free_after(index: int | None, free: Instr) -> None:
        # Gradients of one value from several consumers accumulate in one buffer: one free releases it.
        key = (free.stage, free.value, free.grad, free.mb)
        if key in made:
            return
        made.add(key)
        if index is None:
            raise ScheduleError(f"insert-frees: {program.name} never releases {_freed(free)}; is its backward missing?")
        frees.setdefault(index, []).append(free)

    for instr in instrs:
        kind, stage, value, mb = instr.kind, instr.stage, instr.value, instr.mb
        if kind is forward and stage is not None and mb is not None:
            free_after(release.get((stage, mb)), Instr(free_kind, stage=stage, mb=mb))
        if kind is not recv or value is None or mb is None:
            continue
        if instr.grad:
            free_after(release.get((definers[value], mb)), Instr(free_kind, value=value, grad=True, mb=mb))
            continue
        users = [release.get((s, mb)) for s in readers.get(value, [])]
        last = max((i for i in users if i is not None), default=None)
        free_after(last, Instr(free_kind, value=value, mb=mb))
    out: list[Instr] = []
    pending: list[Instr] = []
    for index, instr in enumerate(instrs):
        if pending and instr.kind is not send:
            out += pending
            pending = []
        out.append(instr)
        here = frees.get(index)
        if here is not None:
            pending += sorted(here, key=_free_order)
    return out + pending


def _free_order(free: Instr) -> int:
    """The stage's own activations first, then received values, then received gradients."""
    return 0 if free.stage is not None else 1 + free.grad


def _freed(free: Instr) -> str:
    """What a free releases, for an error."""
    if free.stage is not None:
        return f"@{free.stage.name} mb={free.mb}"
    assert free.value is not None
    return f"{'grad ' if free.grad else ''}%{free.value.name} mb={free.mb}"
