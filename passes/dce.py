"""Dead-code elimination: drop ops whose result nothing reads."""

from __future__ import annotations

from dataclasses import dataclass

from dapple_ir.ir import Module, OpKind
from dapple_ir.registry import Pass, PassContext, register_pass

# Inputs stay: they are the model's signature, read or not. Outputs are what the model is for.
_KEPT = (OpKind.INPUT, OpKind.OUTPUT)


@register_pass
@dataclass(frozen=True)
class DeadCodeElimination(Pass):
    """Remove ops whose results are never read (inputs and the output always stay)."""

    name = "dce"

    def apply(self, ctx: PassContext, module: Module) -> None:
        users = module.users()
        live = set()
        for op in reversed(module.ops):
            if op.kind in _KEPT or any(u in live for u in users[op]):
                live.add(op)
        dead = [op for op in module.ops if op not in live]
        if not dead:
            return
        module.ops = [op for op in module.ops if op in live]
        for layer in module.layers:
            layer.ops = [op for op in layer.ops if op in live]
        for stage in module.stages:
            stage.ops = [op for op in stage.ops if op in live]
        ctx.log(f"dce: removed {len(dead)} op(s): {', '.join('%' + op.name for op in dead[:8])}")
