"""The structure hash: a digest of the model a module describes, blind to the plan and to costs."""

from __future__ import annotations

import hashlib

from dapple_ir.ir.core import Module, ModuleAttrs, Op, OpAttrs
from dapple_ir.ir.printer import Namer, format_op, print_module


def structure_hash(module: Module) -> str:
    """SHA-256 of the module's structure: its text with only the structural attributes kept.

    A plan records it to check later that the model it runs is the one it was planned for. Kept:
    ops, operands, types, targets, parameters (with buffer/shared), module paths, getitem indices,
    the batch and the capture method. Left out: source locations and the spec text (moving the
    checkout must not invalidate a plan) and costs (passes and calibration change those).
    """
    text = print_module(_skeleton(module))
    return hashlib.sha256(text.encode()).hexdigest()


def first_difference(planned: Module, current: Module) -> str | None:
    """Where two modules' structures first differ, in words (None when they do not).

    Names the first op that differs by index, with its text on each side, or else the first
    parameter or module attribute, so that a stale plan says what changed rather than only that
    something did.
    """
    old, new = _skeleton(planned), _skeleton(current)
    old_namer, new_namer = Namer(old.ops), Namer(new.ops)
    for i, (a, b) in enumerate(zip(old.ops, new.ops, strict=False)):
        line_a, line_b = format_op(a, old_namer), format_op(b, new_namer)
        if line_a != line_b:
            return f"op #{i} is `{line_a}` in the plan but `{line_b}` in the model now"
    if len(old.ops) != len(new.ops):
        shorter, longer, side = (old, new, "the model now") if len(old.ops) < len(new.ops) else (new, old, "the plan")
        first = len(shorter.ops)
        extra = format_op(longer.ops[first], Namer(longer.ops))
        return f"{side} has {len(longer.ops) - first} more op(s), from op #{first} `{extra}`"
    for a_param, b_param in zip(old.params, new.params, strict=False):
        if (a_param.name, a_param.type, a_param.attrs) != (b_param.name, b_param.type, b_param.attrs):
            return f"parameter @{a_param.name} in the plan is @{b_param.name} in the model now"
    if len(old.params) != len(new.params):
        return f"the plan has {len(old.params)} parameters, the model now {len(new.params)}"
    if old.attrs != new.attrs:
        return (
            f"the plan was captured at batch {old.attrs.batch} by {old.attrs.capture_method}, the model now at batch "
            f"{new.attrs.batch} by {new.attrs.capture_method}"
        )
    return None


def _skeleton(module: Module) -> Module:
    """A stripped copy: layers, stages and programs are the plan's, not the model's, so they are left out."""
    copies: dict[Op, Op] = {}
    for op in module.ops:
        attrs = OpAttrs(module_path=op.attrs.module_path, index=op.attrs.index, params=op.attrs.params)
        operands = [copies[o] for o in op.operands if o in copies]
        copies[op] = Op(op.name, op.kind, operands, op.type, op.target, attrs)
    return Module(
        module.name,
        params=module.params,
        ops=list(copies.values()),
        attrs=ModuleAttrs(batch=module.attrs.batch, capture_method=module.attrs.capture_method),
    )
