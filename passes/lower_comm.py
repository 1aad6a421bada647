"""`lower-comm`: add data loading, send/recv pairs, gradient allreduces and the optimizer step.

Where each send, recv and allreduce goes, and why that keeps a deadlock-free compute order
deadlock-free, is `dapple_ir.analysis.lowering`'s to say (`schedule` checks hand-written orders with it).
"""

from __future__ import annotations

from dataclasses import dataclass

from dapple_ir.analysis.lowering import lowered_programs
from dapple_ir.errors import ScheduleError
from dapple_ir.ir import Module
from dapple_ir.registry import Pass, PassContext, register_pass


@register_pass
@dataclass(frozen=True)
class LowerComm(Pass):
    """Add load_microbatch, send/recv of activations and gradients, allreduces and the optimizer step."""

    name = "lower-comm"

    def apply(self, ctx: PassContext, module: Module) -> None:
        if not module.programs:
            raise ScheduleError("lower-comm: the module has no rank programs; run `schedule` first")
        for program, lowered in zip(module.programs, lowered_programs(module), strict=True):
            program.instrs = lowered.instrs
