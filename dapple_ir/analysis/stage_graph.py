"""What crosses stage boundaries: values sent between stages, which of them carry gradients back, and
parameters that several stages read (tied). `lower-comm` lowers these; the runtime and simulator can ask too.

A value crosses from stage p to stage t when an op of t reads it and p defines it; p may be any earlier
stage. Values of `input` ops (each stage that reads them loads them) and of `get_attr` ops (a stage that
reads a parameter holds it) never cross.
"""

from __future__ import annotations

from dataclasses import dataclass

from dapple_ir.errors import ScheduleError
from dapple_ir.ir import FLOAT_DTYPES, Module, Op, OpaqueType, OpKind, Stage, TensorType, TupleType, Type

_LOCAL = (OpKind.INPUT, OpKind.GET_ATTR)


@dataclass(frozen=True, slots=True)
class Crossing:
    """A value defined in `producer` and read in a later `consumer` stage."""

    value: Op
    producer: Stage
    consumer: Stage


def crossings(module: Module) -> list[Crossing]:
    """Every (value, producer stage, consumer stage) that needs a transfer, in consumer then op order."""
    stage_of = module.stage_of()
    position = {s: i for i, s in enumerate(module.stages)}
    result: list[Crossing] = []
    seen: set[tuple[Op, Stage]] = set()
    for stage in module.stages:
        for op in stage.ops:
            for v in op.operands:
                producer = stage_of[v]
                if producer is stage or v.kind in _LOCAL or (v, stage) in seen:
                    continue
                if position[producer] > position[stage]:
                    raise ScheduleError(
                        f"%{op.name} in stage @{stage.name} reads %{v.name} from the later stage "
                        f"@{producer.name}; stages must follow the data flow"
                    )
                seen.add((v, stage))
                result.append(Crossing(v, producer, stage))
    return result


def values_needing_grad(module: Module) -> set[Op]:
    """Float values that depend on a trainable parameter: only their gradients travel back.

    A value of unknown type (a `layer` of an imported profile) counts as float, and its op as owning
    trainable work when it has parameters or backward time: the profile says the layer runs a
    backward, which needs the gradient of its output. Whether a gradient travels never depends on
    how many bytes it has: a zero-byte gradient still orders the backward passes of two stages.
    """
    trainable = {p.name for p in module.params if not p.attrs.buffer}
    result: set[Op] = set()
    for op in module.ops:
        reads = set(op.attrs.params or ()) | ({op.target} if op.kind is OpKind.GET_ATTR and op.target else set())
        own = bool(reads & trainable) or bool(op.attrs.param_bytes)
        if isinstance(op.type, OpaqueType):
            own = own or bool(op.attrs.bwd_s)
        if (own or any(v in result for v in op.operands)) and _is_float(op.type):
            result.add(op)
    return result


def _is_float(t: Type) -> bool:
    if isinstance(t, TensorType):
        return t.dtype in FLOAT_DTYPES
    if isinstance(t, TupleType):
        return any(_is_float(e) for e in t.elements)
    return isinstance(t, OpaqueType)


def tied_params(module: Module) -> dict[str, list[Stage]]:
    """Trainable parameters read by more than one stage, with those stages in pipeline order."""
    stage_of = module.stage_of()
    users = module.users()
    holders: dict[str, set[Stage]] = {}
    for op in module.ops:
        # A get_attr is materialised where it is read, so its readers hold the parameter too.
        stages = {stage_of[op]} | ({stage_of[u] for u in users[op]} if op.kind is OpKind.GET_ATTR else set())
        for name in op.read_params:
            holders.setdefault(name, set()).update(stages)
    buffers = {p.name for p in module.params if p.attrs.buffer}
    order = {s: i for i, s in enumerate(module.stages)}
    return {
        name: sorted(stages, key=order.__getitem__)
        for name, stages in holders.items()
        if len(stages) > 1 and name not in buffers
    }


def batched(module: Module, value: Op) -> bool:
    """Does `value` carry the batch in its dimension 0, so that a split stage can slice its rows?

    A tensor whose dimension 0 equals the module's batch does (the IR's convention: the batch dimension,
    where there is one, is dimension 0); so does every value of an imported profile (a layer's output).
    A tuple or a value of unknown shape does not: it is sent whole.
    """
    if isinstance(value.type, TensorType):
        return bool(value.type.shape) and value.type.shape[0] == module.attrs.batch
    return module.attrs.capture_method == "profile" and isinstance(value.type, OpaqueType)


def batch_dependent(module: Module) -> set[Op]:
    """Values computed from the model's inputs: they differ between the rows of a microbatch."""
    result: set[Op] = set()
    for op in module.ops:
        if op.kind is OpKind.INPUT or any(v in result for v in op.operands):
            result.add(op)
    return result


#: Buffer names of the running statistics of batch normalisation (`nn.BatchNorm*d`).
_BATCH_STATISTICS = ("running_mean", "running_var")


def batch_statistics(ops: list[Op]) -> list[Op]:
    """Ops that normalise over the batch (they read batch norm's running statistics): on a split stage
    each replica would normalise its rows alone, not the microbatch the single device normalises."""
    return [op for op in ops if any(name.endswith(_BATCH_STATISTICS) for name in op.attrs.params or ())]
