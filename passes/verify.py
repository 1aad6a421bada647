"""The `verify` pass: the structural verifier, then the whole-plan checks once rank programs exist.

Plan checks: every forward has its backward on the right rank, the programs cannot deadlock, every kept
tensor is freed exactly once, and (when a cluster is known: the module's `cluster` attribute or the
context's) every rank's static peak memory fits its device.
"""

from __future__ import annotations

from dataclasses import dataclass

from dapple_ir.analysis.plan_checks import run_plan_checks
from dapple_ir.ir import Module
from dapple_ir.ir.scale import Held, collector_paused, held_alike
from dapple_ir.ir.verifier import verify_module
from dapple_ir.registry import Pass, PassContext, register_pass
from dapple_ir.sim.parts import meeting_parts


@register_pass
@dataclass(frozen=True)
class Verify(Pass):
    """Check the IR's invariants (SSA, types, stages; program deadlock, frees, memory) and stop at the first broken."""

    name = "verify"
    verifies = True

    def apply(self, ctx: PassContext, module: Module) -> None:
        with collector_paused():  # a thousand ranks' programs are millions of instructions to walk
            verify_module(module)
        self.apply_verified(ctx, module)

    def apply_verified(self, ctx: PassContext, module: Module) -> None:
        """`apply` on a module that `verify_module` has passed, changed by nothing since (as the pass manager hands it
        on where it verifies after every pass): the plan checks alone."""
        with collector_paused():  # the same walks
            text = module.attrs.cluster or ctx.cluster
            held = held_alike(module.programs)  # read once for the parts and every check
            run_plan_checks(module, ctx.cluster_spec(text) if text else None, _meeting(module, held), held)


def _meeting(module: Module, held: list[Held]) -> list[int] | None:
    """Where tensor groups run, the ranks of one part of each set of copies (`dapple_ir.sim.parts.meeting_parts`: the
    members of a group meet only their counterparts in other groups): the deadlock check need run on no others.
    None elsewhere, where the ranks are one part. `held`: `held_alike` of the programs."""
    if not module.programs or all(stage.tp == 1 for stage in module.stages):
        return None
    return sorted(rank for part in meeting_parts(module.programs, held) for rank in part)
