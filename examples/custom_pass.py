"""A custom pass, tutorial-sized: pin every op of one module to a chosen pipeline stage.

Run it from the command line without installing anything:

    dapple opt plan.dapple --pass-plugin examples/custom_pass.py -p 'pin-module{module=head,stage=1}'

or register it from Python by importing this file. `docs/custom-pass.md` walks through it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dapple_ir.errors import DappleError
from dapple_ir.ir import Module
from dapple_ir.registry import Pass, PassContext, option, register_pass


@register_pass
@dataclass(frozen=True)
class PinModule(Pass):
    """Move every op whose module path starts with `module` into stage number `stage`."""

    name = "pin-module"
    module: str = option("", "module path prefix, e.g. blocks.3 or head")
    stage: int = option(0, "0-based index of the stage to pin it to")

    def apply(self, ctx: PassContext, module: Module) -> None:
        if not module.stages:
            raise DappleError("pin-module needs stages: run it after `plan` (or on a planned IR file)")
        if not 0 <= self.stage < len(module.stages):
            raise DappleError(f"pin-module: stage {self.stage} does not exist; the plan has {len(module.stages)}")
        pinned = [op for op in module.ops if (op.attrs.module_path or "").startswith(self.module)]
        if not pinned:
            raise DappleError(f"pin-module: no op comes from a module whose path starts with '{self.module}'")
        target = module.stages[self.stage]
        for stage in module.stages:
            stage.ops = [op for op in stage.ops if op not in pinned]
        order = {op: i for i, op in enumerate(module.ops)}
        target.ops = sorted([*target.ops, *pinned], key=order.__getitem__)
        self._check_forward_flow(module)
        ctx.log(f"pin-module: moved {len(pinned)} op(s) of '{self.module}' to stage @{target.name}")

    def _check_forward_flow(self, module: Module) -> None:
        # A pipeline only sends forward: no op may read a value computed by a later stage.
        index = {op: i for i, stage in enumerate(module.stages) for op in stage.ops}
        for op in module.ops:
            for operand in op.operands:
                if index[operand] > index[op]:
                    raise DappleError(
                        f"pin-module: after pinning '{self.module}' to stage {self.stage}, %{op.name} "
                        f"(stage {index[op]}) would read %{operand.name} from the later stage "
                        f"{index[operand]}; pin to a stage that keeps the data flowing forward"
                    )
