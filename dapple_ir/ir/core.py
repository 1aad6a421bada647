"""The pipeline IR: a module of parameters, SSA ops, layers, stages and per-rank programs.

Every class here is a slotted dataclass. Values compare by identity (an `Op` *is* the SSA value it
defines); names are hints that the printer makes unique. Semantic data lives in typed attribute
records (`OpAttrs`, `StageAttrs`, ...); the printer and the parser read their field lists, so adding
a field to one of them extends the text form with no other change.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, fields

# ----------------------------------------------------------------------------------------- types

#: Bytes per element of each dtype the IR knows, keyed by its short text name.
DTYPE_BYTES: dict[str, int] = {
    "f64": 8,
    "f32": 4,
    "f16": 2,
    "bf16": 2,
    "i64": 8,
    "i32": 4,
    "i16": 2,
    "i8": 1,
    "u8": 1,
    "bool": 1,
    "c64": 8,
}

#: The dtypes whose values carry gradients (floating and complex).
FLOAT_DTYPES: frozenset[str] = frozenset({"f64", "f32", "f16", "bf16", "c64"})

#: The 16-bit precisions a plan may train in (`ModuleAttrs.precision`), each with the IR dtype of the values
#: autocast makes 16-bit under it. fp32, the default, is the attribute's absence.
HALF_PRECISIONS: dict[str, str] = {"bf16": "bf16", "fp16": "f16"}

#: Short callee names of the softmax-like ops, which normalise along one dimension (`OpAttrs.dim`): torch's, and a
#: masked softmax of one kernel under the name Megatron-LM gives it (`examples/megatron_gpt.py`).
NORMALISING_CALLEES: frozenset[str] = frozenset(
    {"softmax", "log_softmax", "_softmax", "_log_softmax", "scale_mask_softmax"}
)


@dataclass(frozen=True, slots=True)
class TensorType:
    """A dense tensor: element type and static shape (`f32[4,1024,1600]`, `f32[]` for a scalar)."""

    dtype: str
    """Short element-type name, a key of `DTYPE_BYTES`."""
    shape: tuple[int, ...]
    """Static extents, outermost first; the batch dimension, where there is one, is dimension 0."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, slots=True)
class TupleType:
    """A tuple of values, as returned by e.g. `nn.LSTM` or `torch.split`."""

    elements: tuple[Type, ...]
    """The element types, in order."""

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.elements)


@dataclass(frozen=True, slots=True)
class OpaqueType:
    """A non-tensor value (a Python int from `size()`, None) or a tensor of unknown shape."""

    @property
    def nbytes(self) -> int:
        return 0


Type = TensorType | TupleType | OpaqueType

# ------------------------------------------------------------------------------------ attributes


class AttrRecord:
    """Base of the typed attribute records: all fields optional, printed in declaration order."""

    __slots__ = ()

    def items(self) -> Iterator[tuple[str, object]]:
        """The set (non-None) attributes, in declaration order."""
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is not None:
                yield f.name, value


@dataclass(slots=True)
class ModuleAttrs(AttrRecord):
    """Module-wide facts: batch sizes the shapes and costs describe, the plan's global choices."""

    batch: int | None = None
    """Batch size that the op result types were captured at (dimension 0 of the inputs)."""
    cost_batch: int | None = None
    """Batch size that the op costs (times, activation bytes) describe; set by `annotate-cost`."""
    global_batch: int | None = None
    """Samples per optimizer step, over all data-parallel replicas."""
    microbatches: int | None = None
    """Microbatches per optimizer step (M), over the whole pipeline."""
    microbatch_size: int | None = None
    """Samples per microbatch (b); global_batch = microbatches * microbatch_size."""
    schedule: str | None = None
    """Name of the schedule the programs follow (`gpipe`, `1f1b`, `interleaved`, `zb-h1`, ...)."""
    cluster: str | None = None
    """Cluster shorthand (`2x8xV100-16GB`) or path of a cluster TOML file."""
    optimizer: str | None = None
    """Optimizer the memory model assumes (`sgd`, `adam`, `adamw`)."""
    precision: str | None = None
    """`bf16` or `fp16`: the plan trains under torch.autocast in that dtype (matmul-class ops in 16-bit, fp32
    master weights, gradients and optimizer state; `dapple_ir.analysis.precision`). Absent: fp32."""
    source: str | None = None
    """Where the module came from: a model spec or `profile:path`."""
    capture_method: str | None = None
    """`fx`, `export` or `profile`."""
    predicted_iteration_s: float | None = None
    """Iteration time the planner's simulation predicts for this plan."""


@dataclass(slots=True)
class ParamAttrs(AttrRecord):
    """Facts about one parameter or buffer."""

    buffer: bool | None = None
    """True for a buffer (running statistics): no gradient, no optimizer state."""
    shared: bool | None = None
    """True when ops in different parts of the model read it (tied embedding and LM head)."""
    tp_dim: int | None = None
    """The dimension a stage's tensor group splits (`StageAttrs.tp`, set by the `tensor-parallel` pass): member k
    of T holds the k-th contiguous 1/T of it (of each of its `tp_parts` equal parts). Absent: whole on every member."""
    tp_parts: int | None = None
    """Equal parts of the `tp_dim` dimension that are each split over the tensor group (a fused QKV weight: 3, so
    member k holds its heads of Q, of K and of V). Absent: 1."""


@dataclass(slots=True)
class OpAttrs(AttrRecord):
    """Typed attributes of an op: where it came from and what it costs."""

    module_path: str | None = None
    """Innermost `nn.Module` the op was traced inside (`blocks.3.mlp.0`)."""
    index: int | None = None
    """Position of an `input` among the model's inputs, or of a tuple element for `getitem`."""
    dim: int | None = None
    """The dimension a normalising op (softmax, log-softmax) works along, counted from the start: what a
    tensor-parallel split may not cut (`analysis.split_rules`)."""
    label: str | None = None
    """Human description of an imported profile node (`Conv2d(64, 64, ...)`)."""
    fwd_flops: float | None = None
    """Forward floating-point operations at `batch`."""
    bwd_flops: float | None = None
    """Backward floating-point operations at `batch`."""
    mem_bytes: float | None = None
    """Bytes the forward reads and writes at `batch` (roofline memory term)."""
    op_class: str | None = None
    """Efficiency class of the op for the roofline (`matmul`, `conv`, `attention`, `elementwise`)."""
    fwd_s: float | None = None
    """Forward time in seconds for a microbatch of `cost_batch` samples."""
    bwd_s: float | None = None
    """Backward time in seconds for a microbatch of `cost_batch` samples."""
    act_bytes: float | None = None
    """Bytes kept alive for the backward pass, for `cost_batch` samples."""
    out_bytes: float | None = None
    """Bytes of the result at the module's `batch`, where the result type does not tell: an imported profile's
    node, or a value a 16-bit plan holds narrower than captured (`annotate-cost{precision=bf16}`)."""
    param_bytes: float | None = None
    """Parameter bytes of an op whose parameters are not listed (imported profiles)."""
    params: tuple[str, ...] | None = None
    """Names of the parameters and buffers the op reads."""
    tp_role: str | None = None
    """Megatron-LM's tensor-parallel pattern the op belongs to (set by the `tensor-parallel` pass; used where its
    stage has `tp` > 1): `col`, a column-parallel matmul (weight split on its output features, input whole, result
    split on its last dimension); `row`, a row-parallel matmul (weight split on its input features, input split
    on its last dimension, its partial result summed over the tensor group before its bias, if any, is added);
    `vocab`, a vocabulary-parallel embedding (weight split on its rows, each member's rows for the indices in its
    range summed over the group); `loss`, a cross-entropy over logits split on their classes (each member's
    log-sum-exp and target logits summed over the group; a whole result)."""
    tp_dim: int | None = None
    """The dimension of the op's result that a tensor group splits (each member computes its contiguous 1/T, of
    each of `tp_parts` equal parts); absent: every member computes the whole result (replicated)."""
    tp_parts: int | None = None
    """Equal parts of the result's `tp_dim` that are each split over the group (a fused QKV result: 3). Absent: 1."""
    loc: str | None = None
    """Source location `file:line` of the Python code that created the op (not semantic)."""


@dataclass(slots=True)
class LayerAttrs(AttrRecord):
    """Summed costs of a coarsened layer, at the module's `cost_batch`."""

    fwd_s: float | None = None
    """Forward time of the layer's ops."""
    bwd_s: float | None = None
    """Backward time of the layer's ops."""
    param_bytes: float | None = None
    """Bytes of parameters the layer owns."""
    act_bytes: float | None = None
    """Activation bytes the layer keeps for backward."""
    cut_bytes: float | None = None
    """Bytes of all values that cross the cut after this layer (0 for the last layer)."""


@dataclass(slots=True)
class StageAttrs(AttrRecord):
    """Placement of a stage."""

    replicas: int | None = None
    """Data-parallel copies of the stage. Round robin (the default): replica j runs the microbatches m
    with m % replicas == j, whole. With `split`, every replica runs every microbatch on its rows."""
    devices: tuple[int, ...] | None = None
    """Device id of each replica, in replica order."""
    split: bool | None = None
    """DAPPLE's data parallelism inside a stage: replica j of R runs rows [j b / R, (j + 1) b / R)
    (integer division) of every microbatch of b samples, and the boundary to a stage sliced otherwise
    re-slices the batch dimension (`Stage.rows`)."""
    recompute: bool | None = None
    """Activation recomputation: the forward keeps only the stage's inputs (the values it receives)
    per microbatch and is rerun, with grad, right before that microbatch's backward."""
    tp: int | None = None
    """Tensor-parallel degree T (Megatron-LM's intra-layer parallelism; absent: 1). Each replica runs on a tensor
    group of T devices of one node: `devices` lists replicas * T ids, replica-major (replica j's group is
    devices[j*T:(j+1)*T], member k its tensor rank k). Ops with `tp_role` or `tp_dim` compute 1/T of their width
    on each member; the rest are replicated in the group."""
    zero: int | None = None
    """Sharded optimizer state (ZeRO stage; only 1, Megatron's distributed optimizer): each of the stage's R
    replicas keeps the optimizer state of one contiguous 1/R of the stage's parameters (flattened, tied ones
    left whole), its gradients reduce-scattered, its shard stepped, the parameters all-gathered after the step."""


@dataclass(slots=True)
class ProgramAttrs(AttrRecord):
    """Which rank a program runs on and what it holds."""

    rank: int | None = None
    """Process rank that runs the program."""
    device: int | None = None
    """Global device id the rank runs on."""
    replica: int | None = None
    """Replica index of the stages this rank hosts."""
    tensor_rank: int | None = None
    """Member index of this rank in the tensor groups (`StageAttrs.tp`) of the stages it hosts; absent: 0."""
    stages: tuple[str, ...] | None = None
    """Names of the stages this rank hosts (several for interleaved schedules)."""
    peak_bytes: float | None = None
    """Static peak memory of the rank, set by `insert-frees`."""


# ---------------------------------------------------------------------------------------- graph


class OpKind(enum.Enum):
    """The closed set of op kinds."""

    INPUT = "input"
    """A model input (or loss target), split into microbatches along dimension 0."""
    GET_ATTR = "get_attr"
    """Reads a parameter or buffer as a value."""
    CALL_MODULE = "call_module"
    """Calls a leaf `nn.Module` (target: its path)."""
    CALL_FUNCTION = "call_function"
    """Calls a free function (target: its qualified name)."""
    CALL_METHOD = "call_method"
    """Calls a tensor method (target: the method name)."""
    LAYER = "layer"
    """An opaque layer of an imported profile: costs only, not executable."""
    OUTPUT = "output"
    """The module's result: the scalar loss."""


@dataclass(eq=False, slots=True)
class Param:
    """A parameter or buffer of the model."""

    name: str
    """Dotted path in the original model (`blocks.0.mlp.0.weight`)."""
    type: TensorType
    """Shape and element type."""
    attrs: ParamAttrs = field(default_factory=ParamAttrs)
    """Typed attributes."""

    @property
    def nbytes(self) -> int:
        return self.type.nbytes

    def member_bytes(self, tp: int) -> float:
        """Bytes one member of a tensor group of `tp` holds: 1/tp of a parameter it splits (`ParamAttrs.tp_dim`)."""
        return self.nbytes / tp if tp > 1 and self.attrs.tp_dim is not None else float(self.nbytes)


@dataclass(eq=False, slots=True)
class Op:
    """One operation in SSA form; the op is also the value it defines."""

    name: str
    """Name hint for the result (the printer makes names unique)."""
    kind: OpKind
    """What the op does."""
    operands: list[Op]
    """Values the op reads, in order."""
    type: Type
    """Type of the result."""
    target: str | None = None
    """Callee: module path (call_module), qualified function (call_function), method name
    (call_method), parameter (get_attr), profile node id (layer)."""
    attrs: OpAttrs = field(default_factory=OpAttrs)
    """Typed attributes."""

    @property
    def tensor_split(self) -> bool:
        """Does a tensor group (`StageAttrs.tp` > 1) split the op's work: a column- or row-parallel matmul, or an op
        on split values (`OpAttrs.tp_role`, `tp_dim`)? Each member then does 1/T of it and holds 1/T of its result
        (a row-parallel op's result is whole after the sum, its saved input split)."""
        return self.attrs.tp_role is not None or self.attrs.tp_dim is not None

    @property
    def read_params(self) -> tuple[str, ...]:
        """Names of the parameters the op reads, once each: those it lists (`OpAttrs.params`) and a `get_attr`'s
        target."""
        names = tuple(self.attrs.params or ())
        if self.kind is OpKind.GET_ATTR and self.target is not None and self.target not in names:
            names += (self.target,)
        return names

    @property
    def out_bytes(self) -> float:
        """Bytes of the result at the module's batch (the attribute wins where set)."""
        if self.attrs.out_bytes is not None:
            return self.attrs.out_bytes
        return float(self.type.nbytes)

    def __repr__(self) -> str:
        return f"Op(%{self.name} = {self.kind.value})"


@dataclass(eq=False, slots=True)
class Layer:
    """A group of consecutive ops the planner treats as one unit (made by `coarsen`)."""

    name: str
    """Name (`L0`)."""
    ops: list[Op]
    """Member ops, in module order."""
    attrs: LayerAttrs = field(default_factory=LayerAttrs)
    """Summed costs and the bytes crossing the cut after it."""


@dataclass(eq=False, slots=True)
class Stage:
    """A pipeline stage: a set of ops, replicated over devices."""

    name: str
    """Name (`s0`); stages run in list order along the pipeline."""
    ops: list[Op]
    """Member ops, in module order."""
    attrs: StageAttrs = field(default_factory=StageAttrs)
    """Replication and placement."""

    @property
    def replicas(self) -> int:
        return self.attrs.replicas or 1

    @property
    def recompute(self) -> bool:
        return bool(self.attrs.recompute)

    @property
    def tp(self) -> int:
        """Tensor-parallel degree (`StageAttrs.tp`); 1 when unset."""
        return self.attrs.tp or 1

    def group_devices(self, replica: int) -> tuple[int, ...]:
        """The devices of `replica`'s tensor group, member order."""
        t = self.tp
        return (self.attrs.devices or ())[replica * t : (replica + 1) * t]

    @property
    def sharded(self) -> bool:
        """Do the replicas shard the optimizer state (`StageAttrs.zero`)? Only with two replicas or more."""
        return bool(self.attrs.zero) and self.replicas > 1

    @property
    def split(self) -> bool:
        """Do the replicas split each microbatch (`StageAttrs.split`), rather than take whole ones in turn?"""
        return bool(self.attrs.split) and self.replicas > 1

    def rows(self, replica: int, microbatch_size: int) -> tuple[int, int]:
        """Rows [lo, hi) of a microbatch of `microbatch_size` samples that `replica` computes: a split
        stage's replica j of R takes [j b // R, (j + 1) b // R); a round-robin replica, the whole microbatch."""
        if not self.split:
            return 0, microbatch_size
        r = self.replicas
        return replica * microbatch_size // r, (replica + 1) * microbatch_size // r


# ---------------------------------------------------------------------------------- programs


class InstrKind(enum.Enum):
    """The closed set of rank-program instructions."""

    LOAD_MICROBATCH = "load_microbatch"
    """Load the inputs (first stage) or targets (last stage) of microbatch `mb`."""
    FORWARD = "forward"
    """Run `stage` forward on microbatch `mb`."""
    BACKWARD = "backward"
    """Run `stage` backward (input and weight gradients) on microbatch `mb`."""
    BACKWARD_INPUT = "backward_input"
    """Zero-bubble: gradient with respect to the stage's inputs only."""
    BACKWARD_WEIGHT = "backward_weight"
    """Zero-bubble: gradient with respect to the stage's parameters, deferred."""
    SEND = "send"
    """Send `value` (or its gradient when `grad`) of microbatch `mb` to rank `peer`."""
    RECV = "recv"
    """Receive `value` (or its gradient when `grad`) of microbatch `mb` from rank `peer`."""
    FREE = "free"
    """Release `value` (or its gradient), or the saved activations of `stage`, for microbatch `mb`."""
    ALLREDUCE = "allreduce"
    """Sum the gradients of `stage` (or of the tied parameter `param`) over ranks `group`. A stage's
    allreduce leaves out parameters that another stage also reads (tied): each of those is summed once,
    by its own `allreduce param @p` over every rank holding it."""
    REDUCE_SCATTER = "reduce_scatter"
    """A sharded stage's (`StageAttrs.zero`) `allreduce`: sum the gradients of `stage` over ranks `group`, each
    member keeping only its shard of the sum (member k of n: the k-th of n equal pieces of the flattened
    gradients, tied parameters left out as for `allreduce`)."""
    ALL_GATHER = "all_gather"
    """After the optimizer step: every member of `group` sends its stepped shard of `stage`'s parameters to the
    others, so each replica holds the whole stepped parameters again."""
    TENSOR_ALLREDUCE = "tensor_allreduce"
    """Tensor parallelism (`StageAttrs.tp`): sum over the stage's tensor group `group` the partial result of the
    row-parallel op `value` (Megatron's g, in the forward), or with `grad` the partial gradient of `value`, the
    whole input of column-parallel ops (Megatron's f, in the backward). It runs inside the compute instruction
    before it (`stage`, `mb`), at that op; it is listed so that the plan shows, prices and simulates it."""
    OPTIMIZER_STEP = "optimizer_step"
    """Apply the optimizer to this rank's parameters (a sharded stage: its shard) and clear their gradients."""


#: The instructions that run a stage's computation (every other kind moves, frees or reduces data).
COMPUTE_KINDS: frozenset[InstrKind] = frozenset(
    {InstrKind.FORWARD, InstrKind.BACKWARD, InstrKind.BACKWARD_INPUT, InstrKind.BACKWARD_WEIGHT}
)

#: The collectives over a stage's replica group (or a tied parameter's holders).
COLLECTIVE_KINDS: frozenset[InstrKind] = frozenset(
    {InstrKind.ALLREDUCE, InstrKind.REDUCE_SCATTER, InstrKind.ALL_GATHER}
)

#: The instructions that compute input gradients (and so send gradients to the previous stage).
INPUT_GRAD_KINDS: frozenset[InstrKind] = frozenset({InstrKind.BACKWARD, InstrKind.BACKWARD_INPUT})


@dataclass(eq=False, slots=True)
class Instr:
    """One instruction of a rank program; which fields are set depends on `kind`."""

    kind: InstrKind
    """What the instruction does."""
    stage: Stage | None = None
    """Stage computed, freed or reduced."""
    value: Op | None = None
    """Value sent, received or freed."""
    grad: bool = False
    """The instruction moves or frees the gradient of `value`, not `value` itself."""
    mb: int | None = None
    """Microbatch index, 0-based over the whole step."""
    peer: int | None = None
    """Rank at the other end of a send or recv."""
    rows: tuple[int, int] | None = None
    """Rows [lo, hi) of the microbatch (dimension 0 of `value`, in microbatch coordinates) that a send or
    recv moves, where a split stage (`StageAttrs.split`) takes or gives part of it; None: all the sender has."""
    group: tuple[int, ...] | None = None
    """Ranks taking part in a collective (`COLLECTIVE_KINDS`)."""
    param: str | None = None
    """Tied parameter whose gradient an allreduce sums across stages."""


@dataclass(eq=False, slots=True)
class RankProgram:
    """What one rank computes, sends, receives, frees, reduces and steps, in order."""

    name: str
    """Name (`rank0`)."""
    instrs: list[Instr]
    """Instructions in execution order."""
    attrs: ProgramAttrs = field(default_factory=ProgramAttrs)
    """Rank, device, replica, hosted stages, peak memory."""

    @property
    def rank(self) -> int:
        return self.attrs.rank if self.attrs.rank is not None else -1


# ------------------------------------------------------------------------------------- module


@dataclass(eq=False, slots=True)
class Module:
    """A whole model and, once planned and lowered, its plan."""

    name: str
    """Model name."""
    params: list[Param] = field(default_factory=list)
    """Parameters and buffers, in model order."""
    ops: list[Op] = field(default_factory=list)
    """Ops in a topological (definition) order."""
    layers: list[Layer] = field(default_factory=list)
    """Coarsened layers, in pipeline order (empty before `coarsen`)."""
    stages: list[Stage] = field(default_factory=list)
    """Pipeline stages, in pipeline order (empty before `plan`)."""
    programs: list[RankProgram] = field(default_factory=list)
    """Per-rank programs, in rank order (empty before `schedule`)."""
    attrs: ModuleAttrs = field(default_factory=ModuleAttrs)
    """Module-wide attributes."""

    # Queries are computed on demand: the IR holds no derived state that a pass could leave stale.

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def users(self) -> dict[Op, list[Op]]:
        """Map from each op to the ops that read it, in module order."""
        result: dict[Op, list[Op]] = {op: [] for op in self.ops}
        for op in self.ops:
            for operand in op.operands:
                result.setdefault(operand, []).append(op)
        return result

    def stage_of(self) -> dict[Op, Stage]:
        """Map from each op to the stage that holds it."""
        return {op: stage for stage in self.stages for op in stage.ops}

    def inputs(self) -> list[Op]:
        return [op for op in self.ops if op.kind is OpKind.INPUT]

    def param_bytes_of(self, ops: list[Op], tp: int = 1) -> float:
        """Bytes of the trainable parameters (and profile `param_bytes`) that `ops` read; with `tp` > 1, what one
        member of a tensor group of `tp` holds of them (1/tp of each parameter it splits, `ParamAttrs.tp_dim`)."""
        table = {p.name: p for p in self.params}
        seen: set[str] = set()
        total = 0.0
        for op in ops:
            total += op.attrs.param_bytes or 0.0
            for name in op.attrs.params or ():
                if name in seen:
                    continue
                seen.add(name)
                p = table[name]
                if not p.attrs.buffer:
                    total += p.member_bytes(tp)
        return total
