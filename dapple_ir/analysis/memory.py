"""The memory model that planning, `insert-frees` and the verifier share.

Costs in the IR describe `cost_batch` samples; a microbatch of b samples scales activation bytes and
compute times linearly by b / cost_batch (DAPPLE's planner does the same).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dapple_ir.analysis.precision import is_half, is_matmul_class, precision_of
from dapple_ir.errors import DappleError
from dapple_ir.ir import DTYPE_BYTES, FLOAT_DTYPES, Module, Op, OpKind, Stage, TensorType

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


def batch_scale(module: Module, rows: int | None = None) -> float:
    """Factor from the module's cost batch to a microbatch of `rows` samples (default: the module's microbatch size;
    1 when either is unset)."""
    b = rows or module.attrs.microbatch_size
    c = module.attrs.cost_batch or module.attrs.batch
    if not b or not c:
        return 1.0
    return b / c


def activation_bytes(module: Module, ops: list[Op], tp: int = 1, rows: int | None = None) -> float:
    """Bytes `ops` (a stage) keep for backward for one microbatch of `rows` samples (default: the module's
    microbatch), on one member of a tensor group of `tp` (1/tp of what the ops it splits keep, `Op.tensor_split`),
    autocast's 16-bit casts included (`autocast_saved_bytes`)."""
    return _captured_bytes(module, ops, tp, rows) + autocast_saved_bytes(module, ops, tp, rows)


def layer_activation_bytes(
    module: Module, layers: Sequence[Sequence[Op]], tp: int = 1, rows: int | None = None
) -> list[float]:
    """What each of `layers` (a coarsened module's layers, in order) adds to `activation_bytes` of a stage of whole
    layers, for one microbatch of `rows` samples: its ops' captured bytes, and autocast's copies as a stage holding
    every layer counts them (`autocast_saved_bytes` of all the layers, each copy in the layer of the matmul saving it).

    A stage of layers [lo, hi) keeps their sum plus what its boundaries add, which depends on where they fall and is
    not counted here (the planner's per-layer sums leave it out; the plan it returns is priced by `activation_bytes`):
    the 16-bit casts of the fp32 values it receives that its matmuls read, the copy of a weight that a matmul of
    another stage also reads, and the copies of weights whose matmul wants a gradient only through a received value.
    """
    saved = _autocast_saved_by_op(module, [op for layer in layers for op in layer], tp, rows)
    return [_captured_bytes(module, layer, tp, rows) + sum(saved.get(op, 0.0) for op in layer) for layer in layers]


def _captured_bytes(module: Module, ops: Sequence[Op], tp: int, rows: int | None) -> float:
    """Capture's `act_bytes` of `ops` for one microbatch of `rows` samples, one member's share of the split ops."""
    return batch_scale(module, rows) * sum(
        (op.attrs.act_bytes or 0.0) / (tp if tp > 1 and op.tensor_split else 1) for op in ops
    )


#: Bytes of an element of the 16-bit formats autocast casts to.
_HALF_BYTES = 2


def autocast_saved_bytes(module: Module, ops: list[Op], tp: int = 1, rows: int | None = None) -> float:
    """What autocast adds to what `ops` (a stage) keep for backward, for one microbatch (of `rows` samples; default:
    the module's microbatch), under a 16-bit precision (0 under fp32).

    A matmul-class op (`precision.is_matmul_class`) runs on 16-bit casts of what it reads, and autograd saves the
    casts, not the fp32 originals (measured on the CPU, `bench/memory.py`):
      * the 16-bit copy of each weight (a trainable parameter of 2+ dimensions: a bias is not needed by the
        backward) it reads, where its input's gradient is wanted (the copy is what that gradient multiplies by).
        Autocast caches a parameter's cast within one forward only, so every microbatch in flight holds its own
        copies: 2 bytes per weight element (of the member's slice), whatever the batch;
      * the 16-bit copy of each fp32 model input or value from outside `ops` it reads (a value received from another
        stage; each op reading it casts it anew): the rank holds the fp32 original until the backward anyway. An fp32
        value computed among `ops` is counted at its captured 32 bits where the matmul saves it (capture's
        `act_bytes`), what its cast replaces: an overestimate of 2 bytes an element.
    Not counted: an op autocast widens to fp32 (a loss) saves the fp32 cast of a 16-bit value it reads, which capture
    counts at 16 bits: 2 bytes an element under (16 KiB of the benchmark MLP's 2.7 MiB on its last stage).
    """
    return sum(_autocast_saved_by_op(module, ops, tp, rows).values())


def _autocast_saved_by_op(module: Module, ops: Sequence[Op], tp: int, rows: int | None) -> dict[Op, float]:
    """`autocast_saved_bytes` of the stage `ops` by the matmul that saves each copy (a weight's: the first of its
    matmuls that wants it)."""
    if not is_half(precision_of(module)):
        return {}
    # A value's bytes for one microbatch are peak_memory's rule, which reads this module's rules in turn.
    from dapple_ir.analysis.peak_memory import transfer_bytes

    inside = set(ops)
    wanting = _wanting_grad(module, ops)
    params = {p.name: p for p in module.params if not p.attrs.buffer}
    copied: set[str] = set()
    saved: dict[Op, float] = {}
    for op in ops:
        if not is_matmul_class(op):
            continue
        nbytes = 0.0
        if any(v in wanting for v in op.operands if v.kind is not OpKind.GET_ATTR):
            for name in _param_names(op):
                param = params.get(name)
                if param is None or name in copied or len(param.type.shape) < 2:
                    continue
                copied.add(name)
                nbytes += param.member_bytes(tp) * _HALF_BYTES / DTYPE_BYTES[param.type.dtype]
        for v in op.operands:
            if (v not in inside or v.kind is OpKind.INPUT) and v.kind is not OpKind.GET_ATTR and _fp32(v):
                nbytes += transfer_bytes(module, v, (0, rows) if rows else None) * _HALF_BYTES / DTYPE_BYTES["f32"]
        saved[op] = nbytes
    return saved


def _wanting_grad(module: Module, ops: Sequence[Op]) -> set[Op]:
    """The values `ops` read or compute whose gradient the runtime's backward computes: every floating value from
    another stage (the runtime makes it a leaf that wants a gradient), and what is computed from a trainable parameter
    or from such a value; not the model's inputs."""
    trainable = {p.name for p in module.params if not p.attrs.buffer}
    inside = set(ops)
    wanting = {v for op in ops for v in op.operands if v not in inside and v.kind not in _NO_GRAD and is_floating(v)}
    for op in ops:
        if trainable & set(_param_names(op)) or any(v in wanting for v in op.operands):
            wanting.add(op)
    return wanting


_NO_GRAD = (OpKind.INPUT, OpKind.GET_ATTR)


def _param_names(op: Op) -> list[str]:
    """The parameters `op` reads: its own (`call_module`) and those of the `get_attr`s among its operands."""
    return [
        *(op.attrs.params or ()),
        *(n for v in op.operands if v.kind is OpKind.GET_ATTR for n in v.attrs.params or ()),
    ]


def is_floating(value: Op) -> bool:
    """Is `value` a floating tensor (one the runtime hands gradients back for: its stage inputs become autograd
    leaves)?"""
    return isinstance(value.type, TensorType) and value.type.dtype in FLOAT_DTYPES


def _fp32(value: Op) -> bool:
    """A 32-bit floating value as the plan runs it: not one autocast made 16-bit (`precision.sixteen_bit_values`
    narrowed its `out_bytes`)."""
    t = value.type
    return isinstance(t, TensorType) and t.dtype == "f32" and value.out_bytes >= t.nbytes
