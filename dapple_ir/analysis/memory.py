"""The memory model that planning, `insert-frees` and the verifier share.

Costs in the IR describe `cost_batch` samples; a microbatch of b samples scales activation bytes and
compute times linearly by b / cost_batch (DAPPLE's planner does the same).
"""

from __future__ import annotations

import math

from dapple_ir.errors import DappleError
from dapple_ir.ir import Module, Op, Stage

#: Bytes of optimizer state per byte of parameter.
OPTIMIZER_STATE = {"sgd": 0.0, "sgd-momentum": 1.0, "adam": 2.0, "adamw": 2.0}


def optimizer_state_factor(optimizer: str | None) -> float:
    name = (optimizer or "adam").lower()
    custom = _as_factor(name)
    if custom is not None:
        return custom  # a bare number is the multiplier itself (`optimizer = "3"` for Adam + master weights)
    if name not in OPTIMIZER_STATE:
        raise DappleError(
            f"unknown optimizer '{optimizer}'; known: {', '.join(OPTIMIZER_STATE)}, or a number of state bytes "
            "per parameter byte"
        )
    return OPTIMIZER_STATE[name]


def _as_factor(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def static_bytes(module: Module, ops: list[Op], tp: int = 1) -> float:
    """Parameters, their gradients and optimizer state for the parameters `ops` read (one member's share of them in a
    tensor group of `tp`: `Module.param_bytes_of`)."""
    param_bytes = module.param_bytes_of(ops, tp)
    buffers = _buffer_bytes(module, ops)
    return param_bytes * (2.0 + optimizer_state_factor(module.attrs.optimizer)) + buffers


def sharded_state_saving(param_bytes: float, state_factor: float, shards: int) -> float:
    """The optimizer state a replica does not hold when `shards` replicas shard the state of `param_bytes` of
    parameters (ZeRO-1: each holds 1/shards of it; parameters and gradients stay whole)."""
    return param_bytes * state_factor * (1.0 - 1.0 / shards) if shards > 1 else 0.0


def shardable_param_bytes(module: Module, stage: Stage) -> float:
    """Bytes of the parameters a sharded stage shards: those only its ops read (a parameter other stages also
    read is allreduced and stepped whole, `allreduce param`), and an imported profile's unnamed `param_bytes`."""
    others = {n for s in module.stages if s is not stage for op in s.ops for n in op.attrs.params or ()}
    own = {n for op in stage.ops for n in op.attrs.params or ()} - others
    named = sum(p.member_bytes(stage.tp) for p in module.params if p.name in own and not p.attrs.buffer)
    return named + sum(op.attrs.param_bytes or 0.0 for op in stage.ops)


def _buffer_bytes(module: Module, ops: list[Op]) -> float:
    names = {n for op in ops for n in (op.attrs.params or ())}
    return float(sum(p.nbytes for p in module.params if p.name in names and p.attrs.buffer))


def batch_scale(module: Module) -> float:
    """Factor from the module's cost batch to its microbatch size (1 when either is unset)."""
    b = module.attrs.microbatch_size
    c = module.attrs.cost_batch or module.attrs.batch
    if not b or not c:
        return 1.0
    return b / c


def activation_bytes(module: Module, ops: list[Op], tp: int = 1) -> float:
    """Bytes `ops` keep for backward for one microbatch (on one member of a tensor group of `tp`: 1/tp of what the
    ops it splits keep, `Op.tensor_split`)."""
    return batch_scale(module) * sum(
        (op.attrs.act_bytes or 0.0) / (tp if tp > 1 and op.tensor_split else 1) for op in ops
    )
