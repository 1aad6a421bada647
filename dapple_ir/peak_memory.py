"""Static peak memory of rank programs, shared by `insert-frees`, the verifier, the simulator and the planner.

A rank holds its static bytes (parameters, gradients and optimizer state of the stages it hosts, counted
once even when a tied parameter sits in two of them) plus what is live at the instruction being run:
  * `forward @s mb=m` keeps the stage's activations (`memory.activation_bytes`) until `free @s mb=m`;
  * `recv %v mb=m` and `recv grad %v mb=m` hold the transfer (`transfer_bytes`) until the matching free.
Without free instructions (before `insert-frees`) nothing is released; `activation_peak_microbatches`
reads compute instructions only and works on any program.
"""

from __future__ import annotations

from dataclasses import dataclass

from dapple_ir import memory
from dapple_ir.ir import Instr, InstrKind, Module, Op, RankProgram, Stage


def transfer_bytes(module: Module, value: Op) -> float:
    """Bytes of `value` for one microbatch: `out_bytes` is at the module's batch, scale it to b."""
    b, batch = module.attrs.microbatch_size, module.attrs.batch
    if not b or not batch:
        return value.out_bytes
    return value.out_bytes * b / batch


@dataclass(frozen=True, slots=True)
class RankPeak:
    """Where and how high a rank's memory peaks."""

    rank: int
    static_bytes: float
    """Parameters, gradients, optimizer state and buffers of the hosted stages."""
    live_bytes: float
    """Activations and received tensors live at the worst instruction."""
    index: int
    """Index of the worst instruction in the program (-1 for a program without allocations)."""

    @property
    def total(self) -> float:
        return self.static_bytes + self.live_bytes


def hosted_stages(module: Module, program: RankProgram) -> list[Stage]:
    """Stages the program hosts: its `stages` attribute, else the stages its instructions name."""
    if program.attrs.stages is not None:
        return [module.stage(name) for name in program.attrs.stages]
    seen: list[Stage] = []
    for instr in program.instrs:
        if instr.stage is not None and instr.stage not in seen and instr.kind is not InstrKind.ALLREDUCE:
            seen.append(instr.stage)
    return seen


def _key(instr: Instr) -> tuple[object, ...]:
    if instr.kind is InstrKind.FORWARD or (instr.kind is InstrKind.FREE and instr.stage is not None):
        return ("stage", instr.stage, instr.mb)
    return ("grad" if instr.grad else "value", instr.value, instr.mb)


def program_peak(module: Module, program: RankProgram) -> RankPeak:
    """The rank's static bytes and its live bytes at the worst instruction."""
    stages = hosted_stages(module, program)
    static = memory.static_bytes(module, [op for s in stages for op in s.ops])
    act = {s: memory.activation_bytes(module, s.ops) for s in module.stages}
    live: dict[tuple[object, ...], float] = {}
    total, peak, where = 0.0, 0.0, -1
    for index, instr in enumerate(program.instrs):
        if instr.kind is InstrKind.FORWARD and instr.stage is not None:
            size = act[instr.stage]
        elif instr.kind is InstrKind.RECV and instr.value is not None:
            size = transfer_bytes(module, instr.value)
        elif instr.kind is InstrKind.FREE:
            total -= live.pop(_key(instr), 0.0)
            continue
        else:
            continue
        key = _key(instr)
        live[key] = live.get(key, 0.0) + size
        total += size
        if total > peak:
            peak, where = total, index
    return RankPeak(program.rank, static, peak, where)


def peak_bytes_per_rank(module: Module) -> dict[int, float]:
    """Static peak memory of every rank, by rank."""
    return {index: program_peak(module, p).total for index, p in enumerate(module.programs)}


def activation_peak_microbatches(program: RankProgram) -> int:
    """Most stage-microbatches whose activations the rank holds at once (forward done, not yet released).

    A stage's activations are released by its backward, or by its backward_weight when the backward is split.
    """
    live, peak = 0, 0
    for instr in program.instrs:
        if instr.kind is InstrKind.FORWARD:
            live += 1
            peak = max(peak, live)
        elif instr.kind in (InstrKind.BACKWARD, InstrKind.BACKWARD_WEIGHT):
            live -= 1
    return peak
