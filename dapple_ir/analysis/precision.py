"""Mixed precision as a plan property: which values torch.autocast makes 16-bit, and which peak prices an op.

A plan's precision (`ModuleAttrs.precision`; absent means fp32) is what the runtime trains under: fp32 runs
every op as captured; bf16 and fp16 run each stage's forward under `torch.autocast(device, dtype)` with the
parameters, their gradients and the optimizer state kept in fp32 (torch.autocast's semantics: master weights
are never 16-bit, so static memory is the fp32 plan's). The cost model follows autocast's policy on a GPU:

- matmul-class ops (`op_class` matmul, conv or attention: linear, matmul, mm, bmm, addmm, baddbmm, conv,
  scaled-dot-product attention, which is what capture counts FLOPs for) run in 16-bit at the device's 16-bit
  tensor-core peak, and their results are 16-bit;
- an op autocast widens (softmax, log-softmax, layer and group norm, losses, exp/log/pow, sums: the fp32 list
  in `_WIDENING_NAMES`) and an op that reads a parameter or buffer (embedding, norm affine: fp32 weights
  promote) give fp32;
- a cast to another tensor's dtype (`type_as`, `to(tensor)`) gives that tensor's; an operator a library
  defines (`torch.ops.<library>.<op>`, not torch's own) is on none of autocast's lists: the rule below;
- any other op gives 16-bit exactly when every floating value it reads is 16-bit (type promotion: an add of an
  fp32 residual and a 16-bit projection is fp32), and runs at its dtype's rate.

So a transformer's residual stream stays fp32 (the block's output is `x + proj(...)`), while the attention
scores, MLP hidden values and projections are 16-bit. Those values cross cuts, are saved for backward and
counted at 2 bytes an element; everything else at its captured size. A 32-bit value that a matmul reads is
saved by autocast as its 16-bit cast, which this count keeps at 32 bits (an overestimate, never an under).
What autocast saves beyond the captured values is the memory model's (`memory.autocast_saved_bytes`, which the
planner's per-layer bytes and the IR's peak both read): the 16-bit copy of each weight a matmul wanting a
gradient reads, one per microbatch in flight whatever its size (autocast's cast cache lives for one forward), and
the 16-bit casts of the fp32 values a stage receives or loads that its matmuls read.
CPU autocast keeps norms and softmax in 16-bit where the input is; the runtime sends whatever autocast made
(the transport's header carries the dtype), so only the price differs, not the numerics.
Torch-free: planning and simulation never load torch.
"""

from __future__ import annotations

from dapple_ir.errors import DappleError
from dapple_ir.ir import FLOAT_DTYPES, HALF_PRECISIONS, Module, Op, OpKind, TensorType, TupleType

#: The precisions a plan may train in, by their command-line name.
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")

#: IR dtype of the values autocast makes 16-bit under each 16-bit precision.
HALF_DTYPE = HALF_PRECISIONS

#: Efficiency classes of the ops autocast runs in 16-bit.
MATMUL_CLASSES: frozenset[str] = frozenset({"matmul", "conv", "attention"})

#: Callee names autocast runs in fp32 whatever their inputs (its CUDA fp32 list), and the fragments that mark the
#: rest of that list (softmax, layer/group/batch norm, every loss).
_WIDENING_NAMES = frozenset(
    {
        "exp",
        "expm1",
        "log",
        "log1p",
        "log2",
        "log10",
        "pow",
        "__pow__",
        "rsqrt",
        "reciprocal",
        "sum",
        "prod",
        "cumsum",
        "softplus",
    }
)
_WIDENING_FRAGMENTS = ("softmax", "norm", "loss", "entropy")

#: Casts to another tensor's dtype (Megatron's softmax in fp32 cast back with `.type_as(v)`).
_CASTS_LIKE = frozenset({"type_as", "to"})


def check_precision(precision: str) -> str:
    """`precision` if it is one of `PRECISIONS`; else an error that lists them."""
    if precision not in PRECISIONS:
        raise DappleError(f"precision must be one of {', '.join(PRECISIONS)}, not '{precision}'")
    return precision


def precision_of(module: Module) -> str:
    """The module's precision (fp32 where the attribute is absent)."""
    return module.attrs.precision or "fp32"


def is_half(precision: str) -> bool:
    return precision in HALF_DTYPE


def matmul_dtype(precision: str, captured: str) -> str:
    """The dtype whose peak prices a matmul-class op captured in `captured` under `precision`."""
    return HALF_DTYPE.get(precision, captured)


def is_matmul_class(op: Op) -> bool:
    return op.attrs.op_class in MATMUL_CLASSES and op.attrs.fwd_flops is not None


def default_precision(peak_flops: dict[str, float]) -> str:
    """bf16 on a device with a bf16 tensor-core rate above its fp32 one (A100, H100, H200), else fp32 (a CPU;
    a V100 has no bf16 units, and its fp16 needs loss scaling, so it is chosen, never assumed)."""
    return "bf16" if peak_flops.get("bf16", 0.0) > peak_flops.get("f32", 0.0) else "fp32"


def sixteen_bit_values(module: Module, precision: str) -> set[Op]:
    """The ops whose results autocast makes 16-bit under `precision` (the rules of the module docstring)."""
    if not is_half(precision):
        return set()
    half: set[Op] = set()
    for op in module.ops:
        if _becomes_half(op, half):
            half.add(op)
    return half


def _becomes_half(op: Op, half: set[Op]) -> bool:
    if op.kind in (OpKind.INPUT, OpKind.OUTPUT, OpKind.GET_ATTR, OpKind.LAYER) or not _floating(op):
        return False
    if is_matmul_class(op):
        return True
    callee = (op.target or "").lower().rsplit(".", 1)[-1]
    if callee in _CASTS_LIKE and len(op.operands) > 1 and _floating(op.operands[1]):
        # `a.type_as(b)` and `a.to(b)` take b's dtype: 16-bit where autocast made b so.
        return op.operands[1] in half
    widened = callee in _WIDENING_NAMES or any(f in callee for f in _WIDENING_FRAGMENTS)
    if op.attrs.params or (widened and not _custom_op(op)):
        return False
    read = [v for v in op.operands if _floating(v)]
    return bool(read) and all(v in half for v in read)


def _custom_op(op: Op) -> bool:
    """Is `op` a call of an operator a library defined (`torch.library.custom_op`), which autocast's lists never
    name: it runs in the dtype its inputs come in."""
    target = op.target or ""
    return op.kind is OpKind.CALL_FUNCTION and target.startswith("torch.ops.") and not target.startswith(_TORCH_OPS)


#: Operator namespaces of torch itself, which autocast's policy covers.
_TORCH_OPS = ("torch.ops.aten.", "torch.ops.prims.", "torch.ops.quantized.")


def _floating(op: Op) -> bool:
    t = op.type
    if isinstance(t, TupleType):
        return any(isinstance(e, TensorType) and e.dtype in FLOAT_DTYPES for e in t.elements)
    return isinstance(t, TensorType) and t.dtype in FLOAT_DTYPES


def half_fraction(op: Op) -> float:
    """Bytes of `op`'s result in 16-bit per byte as captured (1 where it was captured 16-bit or narrower)."""
    t = op.type
    elements = t.elements if isinstance(t, TupleType) else (t,)
    sizes = [e for e in elements if isinstance(e, TensorType)]
    captured = sum(e.nbytes for e in sizes)
    if not captured:
        return 1.0
    narrow = sum(min(e.nbytes, e.numel * 2) if e.dtype in FLOAT_DTYPES else e.nbytes for e in sizes)
    return narrow / captured
