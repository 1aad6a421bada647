"""The IR: data structures (`core`), text form (`printer`, `parser`) and structural checks (`verifier`).

`from dapple_ir.ir import Module, Op, ...` is the public way to reach the data structures; the
printer, parser and verifier are modules of their own (`dapple_ir.ir.parser.parse_module`, ...).
Imports nothing from the rest of dapple_ir except `errors` and `units`.
"""

from dapple_ir.ir.core import (
    COLLECTIVE_KINDS,
    COMPUTE_KINDS,
    DTYPE_BYTES,
    FLOAT_DTYPES,
    HALF_PRECISIONS,
    INPUT_GRAD_KINDS,
    AttrRecord,
    Instr,
    InstrKind,
    Layer,
    LayerAttrs,
    Module,
    ModuleAttrs,
    Op,
    OpaqueType,
    OpAttrs,
    OpKind,
    Param,
    ParamAttrs,
    ProgramAttrs,
    RankProgram,
    Stage,
    StageAttrs,
    TensorType,
    TupleType,
    Type,
)

__all__ = [
    "COLLECTIVE_KINDS",
    "COMPUTE_KINDS",
    "DTYPE_BYTES",
    "FLOAT_DTYPES",
    "HALF_PRECISIONS",
    "INPUT_GRAD_KINDS",
    "AttrRecord",
    "Instr",
    "InstrKind",
    "Layer",
    "LayerAttrs",
    "Module",
    "ModuleAttrs",
    "Op",
    "OpAttrs",
    "OpKind",
    "OpaqueType",
    "Param",
    "ParamAttrs",
    "ProgramAttrs",
    "RankProgram",
    "Stage",
    "StageAttrs",
    "TensorType",
    "TupleType",
    "Type",
]
