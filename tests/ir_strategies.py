"""Hypothesis strategies that build random, structurally valid IR modules (test support)."""

from __future__ import annotations

from hypothesis import strategies as st

from dapple_ir.ir import (
    DTYPE_BYTES,
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

names = st.from_regex(r"[a-z_][a-z0-9_]{0,6}(\.[a-z0-9_]{1,4}){0,2}", fullmatch=True)
odd_names = st.text(alphabet='abc -+<>"\\é', min_size=1, max_size=6)
symbol_names = st.one_of(names, odd_names)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
tensor_types = st.builds(
    TensorType, st.sampled_from(sorted(DTYPE_BYTES)), st.lists(st.integers(0, 64), max_size=3).map(tuple)
)
types: st.SearchStrategy[Type] = st.recursive(
    st.one_of(tensor_types, st.just(OpaqueType())),
    lambda inner: st.lists(inner, max_size=3).map(lambda es: TupleType(tuple(es))),
    max_leaves=4,
)


@st.composite
def modules(draw: st.DrawFn) -> Module:
    params = [
        Param(n, draw(tensor_types), ParamAttrs(buffer=draw(st.sampled_from([None, True, False]))))
        for n in draw(st.lists(symbol_names, max_size=4, unique=True))
    ]
    ops: list[Op] = []
    for i in range(draw(st.integers(1, 8))):
        kind = OpKind.INPUT if i == 0 else draw(st.sampled_from([k for k in OpKind if k is not OpKind.INPUT]))
        operands = [] if kind is OpKind.INPUT else draw(st.lists(st.sampled_from(ops), max_size=3))
        attrs = OpAttrs(
            module_path=draw(st.none() | names),
            index=draw(st.none() | st.integers(-5, 5)),
            fwd_s=draw(st.none() | finite),
            act_bytes=draw(st.none() | finite),
            params=draw(
                st.none() | st.lists(st.sampled_from([p.name for p in params] or ["x"]), max_size=2).map(tuple)
            ),
            label=draw(st.none() | st.text(max_size=8)),
        )
        target = draw(st.none() | symbol_names) if kind is not OpKind.INPUT else None
        ops.append(Op(draw(names), kind, operands, draw(types), target, attrs))
    cut = draw(st.integers(0, len(ops)))
    recompute = draw(st.sampled_from([None, True, False]))
    stages = [
        Stage("s0", ops[:cut], StageAttrs(replicas=1, devices=(0,), recompute=recompute)),
        Stage("s1", ops[cut:]),
    ]
    layers = [Layer("L0", ops[:cut], LayerAttrs(cut_bytes=draw(finite)))]
    programs = []
    for r in range(draw(st.integers(0, 3))):
        instrs = []
        for _ in range(draw(st.integers(0, 5))):
            kind = draw(st.sampled_from(list(InstrKind)))
            instr = Instr(
                kind,
                mb=draw(st.none() | st.integers(0, 99)),
                peer=draw(st.none() | st.integers(0, 9)) if kind in (InstrKind.SEND, InstrKind.RECV) else None,
                group=draw(st.none() | st.lists(st.integers(0, 9), max_size=3).map(tuple)),
            )
            # An instruction names at most one thing: a stage, a value (or its gradient) or a parameter.
            ref = draw(st.sampled_from(["none", "stage", "value", "param"]))
            if ref == "stage":
                instr.stage = draw(st.sampled_from(stages))
            elif ref == "value":
                instr.value = draw(st.sampled_from(ops))
                instr.grad = draw(st.booleans())
            elif ref == "param":
                instr.param = draw(symbol_names)
            instrs.append(instr)
        attrs = ProgramAttrs(rank=r, stages=draw(st.none() | st.just(("s0",))), peak_bytes=draw(st.none() | finite))
        programs.append(RankProgram(f"rank{r}", instrs, attrs))
    module_attrs = ModuleAttrs(
        batch=draw(st.none() | st.integers(1, 64)), schedule=draw(st.none() | st.text(max_size=5))
    )
    return Module(draw(symbol_names), params, ops, layers, stages, programs, module_attrs)
