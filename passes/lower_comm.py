"""`lower-comm`: add data loading, send/recv pairs, gradient allreduces and the optimizer step.

Where each send, recv and allreduce goes, and why that keeps a deadlock-free compute order
deadlock-free, is `dapple_ir.analysis.lowering`'s to say (`schedule` checks hand-written orders with it).
Where `plan` handed on the lowering it simulated (`ir.scale.TrialLowering`) and the programs are its compute
instructions, this pass takes that lowering's instructions: the same as it would make.
"""

from __future__ import annotations

from dataclasses import dataclass

from dapple_ir.analysis.lowering import lowered_with_leads
from dapple_ir.errors import ScheduleError
from dapple_ir.ir import Module, scale
from dapple_ir.registry import Pass, PassContext, register_pass


@register_pass
@dataclass(frozen=True)
class LowerComm(Pass):
    """Add load_microbatch, send/recv of activations and gradients, allreduces and the optimizer step."""

    name = "lower-comm"

    def apply(self, ctx: PassContext, module: Module) -> None:
        if not module.programs:
            raise ScheduleError("lower-comm: the module has no rank programs; run `schedule` first")
        handed = scale.handed(module)
        with scale.collector_paused():  # a thousand ranks' programs are millions of instructions
            taken = handed.lowered(module) if handed is not None else None
        leads: dict[int, int] = {}
        if taken is None:
            scale.hand_over(None)  # the programs are not the trial's: no pass after this one could take it
            programs, leads = lowered_with_leads(module)
            taken = [lowered.instrs for lowered in programs]
        for program, instrs in zip(module.programs, taken, strict=True):
            program.instrs = instrs
        if scale.is_trial(module):  # what the plan's `lower-comm` may take, and `insert-frees` compare with
            scale.note(module, "lowered", [list(instrs) for instrs in taken])
            scale.note(module, "leads", leads)
