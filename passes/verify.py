"""The `verify` pass: the structural verifier as an explicit pipeline step."""

from __future__ import annotations

from dataclasses import dataclass

from dapple_ir.ir import Module
from dapple_ir.registry import Pass, PassContext, register_pass
from dapple_ir.verifier import verify_module


@register_pass
@dataclass(frozen=True)
class Verify(Pass):
    """Check the IR's invariants (SSA, types, stages, programs) and stop at the first broken one."""

    name = "verify"

    def apply(self, ctx: PassContext, module: Module) -> None:
        verify_module(module)
