"""The structure hash: a digest of the model a module describes, blind to the plan and to costs."""

from __future__ import annotations

import hashlib

from dapple_ir.ir.core import Module, ModuleAttrs, Op, OpAttrs
from dapple_ir.ir.printer import print_module


def structure_hash(module: Module) -> str:
    """SHA-256 of the module's structure: its text with only the structural attributes kept.

    A plan records it to check later that the model it runs is the one it was planned for. Kept:
    ops, operands, types, targets, parameters (with buffer/shared), module paths, getitem indices,
    the batch and the capture method. Left out: source locations and the spec text (moving the
    checkout must not invalidate a plan) and costs (passes and calibration change those).
    """
    # A stripped copy: layers, stages and programs are the plan's, not the model's, so they are left out.
    copies: dict[Op, Op] = {}
    for op in module.ops:
        attrs = OpAttrs(module_path=op.attrs.module_path, index=op.attrs.index, params=op.attrs.params)
        operands = [copies[o] for o in op.operands if o in copies]
        copies[op] = Op(op.name, op.kind, operands, op.type, op.target, attrs)
    skeleton = Module(
        module.name,
        params=module.params,
        ops=list(copies.values()),
        attrs=ModuleAttrs(batch=module.attrs.batch, capture_method=module.attrs.capture_method),
    )
    text = print_module(skeleton)
    return hashlib.sha256(text.encode()).hexdigest()
