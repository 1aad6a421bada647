"""Static peak memory of rank programs, shared by `insert-frees`, the verifier, the simulator and the planner.

A rank holds its static bytes (parameters, gradients and optimizer state of the stages it hosts, counted
once even when a tied parameter sits in two of them; a `zero = 1` stage's replica holds 1/R of its own
parameters' optimizer state) plus what is live at the instruction being run:
  * `forward @s mb=m` keeps the stage's activations (`memory.activation_bytes`) until `free @s mb=m`;
  * `recv %v mb=m` and `recv grad %v mb=m` hold the transfer (`transfer_bytes`) until the matching free,
    from the point its receive is posted (`recv_posts`: up to one compute ahead, where memory allows);
  * `backward_input @s mb=m` keeps what the weight pass restarts from (`weight_pass_bytes`) until
    `free @s mb=m`;
  * a recomputing stage (`recompute`) keeps only its checkpoints at its forward: the model inputs and targets
    it reads (`loaded_bytes`) and the values its later segments start from (`activation_checkpoints.checkpoint_values`:
    a block's input) until `free @s mb=m`, the received tensors as transfers (freed after its backward
    anyway); its `backward` holds the largest segment's rerun activations (less the loaded inputs, which the
    ops reading them save) while it runs, and a split `backward_input` holds them until `free @s mb=m`.
Without free instructions (before `insert-frees`) nothing is released; `activation_peak_microbatches`
reads compute instructions only and works on any program.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from functools import cached_property
from operator import attrgetter
from typing import Any

from dapple_ir.analysis import activation_checkpoints, memory
from dapple_ir.analysis.lowering import early_post_points
from dapple_ir.analysis.stage_graph import crossings, values_needing_grad
from dapple_ir.ir import (
    COLLECTIVE_KINDS,
    COMPUTE_KINDS,
    Instr,
    InstrKind,
    Module,
    Op,
    OpKind,
    RankProgram,
    Stage,
)
from dapple_ir.schedules import StageMemory


def transfer_bytes(module: Module, value: Op, rows: tuple[int, int] | None = None, whole: float | None = None) -> float:
    """Bytes of `value` for one microbatch (`out_bytes` is at the module's batch, scaled to b), or for
    its `rows` of the microbatch (a piece a split stage sends or receives); `whole`: bytes at the module's batch
    other than `out_bytes` (what a tensor group's sum of it moves, `tensor_shards.summed_bytes`)."""
    b, batch = module.attrs.microbatch_size, module.attrs.batch
    at_batch = value.out_bytes if whole is None else whole
    if not b or not batch:
        return at_batch
    n = rows[1] - rows[0] if rows is not None else b
    return at_batch * n / batch


def replica_rows(module: Module, replica: int) -> Callable[[Stage], tuple[int, int]]:
    """The rows [lo, hi) of each microbatch that replica `replica` of a stage computes (`Stage.rows`):
    all b of them unless the stage splits its microbatches."""
    b = module.attrs.microbatch_size or 0

    def rows(stage: Stage) -> tuple[int, int]:
        return stage.rows(replica, b) if b else (0, 0)

    return rows


def _share(module: Module, replica: int) -> Callable[[Stage], float]:
    """Fraction of each microbatch a replica's stages compute: what scales their activations."""
    b = module.attrs.microbatch_size or 0
    rows = replica_rows(module, replica)

    def share(stage: Stage) -> float:
        if not stage.split or not b:
            return 1.0
        lo, hi = rows(stage)
        return (hi - lo) / b

    return share


def weight_pass_bytes(module: Module, stage: Stage) -> float:
    """Bytes a split backward keeps from `backward_input` to `backward_weight`, for one microbatch.

    The input pass stops where each parameter's branch leaves the path back to the stage's inputs; the
    gradient flowing into that op (the size of its output, `weight_ops`) waits there for the weight pass. A
    stage none of whose inputs come from another stage hands no gradient back: its weight pass is its whole
    backward, and it keeps nothing extra.
    """
    return sum(transfer_bytes(module, op) for op in weight_ops(module, stage))


def weight_ops(module: Module, stage: Stage) -> list[Op]:
    """The ops of `stage` whose parameters a split backward reaches by a weight pass of their own
    (`param_ops`). Empty where the stage hands no gradient back (`hands_back`): its one weight pass is its whole
    backward."""
    return param_ops(module, stage.ops) if hands_back(stage.ops, values_needing_grad(module)) else []


def hands_back(ops: list[Op], needing_grad: AbstractSet[Op]) -> bool:
    """Does a stage of `ops` send a gradient back (`gradient_reads`)?"""
    return next(gradient_reads(ops, needing_grad), None) is not None


def gradient_reads(ops: list[Op], needing_grad: AbstractSet[Op]) -> Iterator[Op]:
    """The values made outside `ops` that `ops` read and that need a gradient (`stage_graph.values_needing_grad`,
    what `lower-comm` sends gradients back for; an imported profile's opaque layer results among them): a stage
    reading one hands a gradient back. Parameters and model inputs are every stage's own."""
    own = set(ops)
    local = (OpKind.INPUT, OpKind.GET_ATTR)
    return (v for op in ops for v in op.operands if v not in own and v.kind not in local and v in needing_grad)


def param_ops(module: Module, ops: list[Op]) -> list[Op]:
    """The ops among `ops` that read a trainable parameter, directly or through a `get_attr` (an imported
    profile's op with `param_bytes`, too)."""
    trainable = {p.name for p in module.params if not p.attrs.buffer}
    weight_reads = {op for op in ops if op.kind is OpKind.GET_ATTR and trainable & set(op.attrs.params or ())}
    found = []
    for op in ops:
        reads = bool(trainable & set(op.attrs.params or ())) or (op.attrs.param_bytes or 0.0) > 0
        if op.kind is not OpKind.GET_ATTR and (reads or any(v in weight_reads for v in op.operands)):
            found.append(op)
    return found


def loaded_bytes(module: Module, stage: Stage) -> float:
    """Bytes of the model inputs and targets (`input` ops) the stage's ops read, for one microbatch."""
    return _loaded_of(module, stage.ops)


def _loaded_of(module: Module, ops: list[Op]) -> float:
    read = {v for op in ops for v in op.operands if v.kind is OpKind.INPUT}
    return sum(transfer_bytes(module, v) for v in read)


@dataclass(frozen=True, slots=True)
class RankPeak:
    """Where and how high a rank's memory peaks."""

    rank: int
    static_bytes: float
    """Parameters, gradients, optimizer state and buffers of the hosted stages."""
    live_bytes: float
    """Activations and received tensors live at the worst instruction."""
    index: int
    """Index of the worst instruction in the program (-1 for a program without allocations)."""

    @property
    def total(self) -> float:
        return self.static_bytes + self.live_bytes


def hosted_stages(module: Module, program: RankProgram) -> list[Stage]:
    """Stages the program hosts: its `stages` attribute, else the stages its instructions name."""
    if program.attrs.stages is not None:
        return [module.stage(name) for name in program.attrs.stages]
    seen: list[Stage] = []
    for instr in program.instrs:
        if instr.stage is not None and instr.stage not in seen and instr.kind not in COLLECTIVE_KINDS:
            seen.append(instr.stage)
    return seen


_STAGE_KEYED = (InstrKind.FORWARD, InstrKind.BACKWARD_INPUT)


def _key(instr: Instr) -> tuple[object, ...]:
    if instr.kind in _STAGE_KEYED or (instr.kind is InstrKind.FREE and instr.stage is not None):
        return ("stage", instr.stage, instr.mb)
    return ("grad" if instr.grad else "value", instr.value, instr.mb)


@dataclass
class Sizes:
    """Byte sizes of one module's stages and values, each computed once.

    Every rank program of a plan asks for the same few stages' sizes: one `Sizes` shared by all of a
    pass's (or a simulation's) programs turns per-rank rescans of the stages into lookups. Only valid
    while the module's stages and ops stay as they are.
    """

    module: Module
    act: dict[Stage, float] = field(default_factory=dict)
    held: dict[Stage, float] = field(default_factory=dict)
    inputs: dict[Stage, float] = field(default_factory=dict)
    kept: dict[Stage, float] = field(default_factory=dict)
    reruns: dict[Stage, float] = field(default_factory=dict)
    transfer: dict[Op, float] = field(default_factory=dict)
    params: dict[tuple[Stage, ...], float] = field(default_factory=dict)
    static: dict[tuple[Stage, ...], float] = field(default_factory=dict)
    shapes: dict[tuple[object, ...], _Shape] = field(default_factory=dict)
    """`posted_changes` of each program shape (`program_shape`): replicas of a stage share one."""

    @cached_property
    def starts(self) -> frozenset[int]:
        """The module's `activation_checkpoints.layer_block_starts`, found once (they read every op)."""
        return activation_checkpoints.layer_block_starts(self.module)

    def activation(self, stage: Stage) -> float:
        return _memo(self.act, stage, lambda: memory.activation_bytes(self.module, stage.ops, stage.tp))

    def weight_pass(self, stage: Stage) -> float:
        return _memo(self.held, stage, lambda: weight_pass_bytes(self.module, stage))

    def loaded(self, stage: Stage) -> float:
        """Bytes of the model inputs and targets the stage reads, for one microbatch: what a recomputing
        stage keeps from its forward to rerun it (its received tensors are held as transfers)."""
        return _memo(self.inputs, stage, lambda: loaded_bytes(self.module, stage))

    def checkpointed(self, stage: Stage) -> float:
        """What a recomputing stage's forward keeps for one microbatch: the model inputs and targets it reads
        (`loaded`) and the values its later checkpoint segments start from
        (`activation_checkpoints.checkpoint_values`)."""
        return _memo(self.kept, stage, lambda: self.loaded(stage) + self._checkpoints(stage))

    def _checkpoints(self, stage: Stage) -> float:
        values = activation_checkpoints.checkpoint_values(self.module, stage, self.starts)
        return sum(self.transferred(v) for v in values)

    def rerun(self, stage: Stage) -> float:
        """What a recomputing stage's backward adds while it runs: the largest checkpoint segment's activations,
        less the loaded inputs it already keeps (the ops that read them save those very tensors)."""
        return _memo(self.reruns, stage, lambda: self._rerun(stage))

    def _rerun(self, stage: Stage) -> float:
        module = self.module
        return max(
            max(0.0, memory.activation_bytes(module, ops, stage.tp) - _loaded_of(module, ops))
            for ops in activation_checkpoints.segments(module, stage, self.starts)
        )

    def transferred(self, value: Op) -> float:
        return _memo(self.transfer, value, lambda: transfer_bytes(self.module, value))

    def moved(self, instr: Instr) -> float:
        """Bytes a send or recv moves: its value's, or the share of them its `rows` hold."""
        assert instr.value is not None
        whole = self.transferred(instr.value)
        if instr.rows is None or not self.module.attrs.microbatch_size:
            return whole
        return whole * (instr.rows[1] - instr.rows[0]) / self.module.attrs.microbatch_size

    def param_bytes(self, stages: list[Stage] | tuple[Stage, ...]) -> float:
        """Trainable parameter bytes the stages read (`Module.param_bytes_of`)."""
        return _memo(self.params, tuple(stages), lambda: self.module.param_bytes_of(_ops(stages), _tp(stages)))

    def static_of(self, stages: list[Stage]) -> float:
        """Parameters, gradients and optimizer state of the stages a rank hosts; a sharded stage's (ZeRO-1)
        replica holds 1/R of its own parameters' state (`memory.sharded_state_saving`)."""
        return _memo(self.static, tuple(stages), lambda: self._static(stages))

    def _static(self, stages: list[Stage]) -> float:
        factor = memory.optimizer_state_factor(self.module.attrs.optimizer)
        saved = sum(
            memory.sharded_state_saving(memory.shardable_param_bytes(self.module, s), factor, s.replicas)
            for s in stages
            if s.sharded
        )
        return memory.static_bytes(self.module, _ops(stages), _tp(stages)) - saved


def _tp(stages: list[Stage] | tuple[Stage, ...]) -> int:
    """The tensor-parallel degree of the stages one rank hosts (virtual stages share their devices, so their T)."""
    return stages[0].tp if stages else 1


def _ops(stages: list[Stage] | tuple[Stage, ...]) -> list[Op]:
    return [op for s in stages for op in s.ops]


def _memo(table: dict[Any, float], key: Any, compute: Callable[[], float]) -> float:
    if key not in table:
        table[key] = compute()
    return table[key]


def memory_changes(
    module: Module, program: RankProgram, sizes: Sizes | None = None, posts: dict[int, int] | None = None
) -> Iterator[tuple[int, float]]:
    """(instruction index, bytes allocated or released: negative) for each instruction that changes the
    rank's live bytes, in program order. A free of something the rank never allocated (a value it sent,
    say) releases nothing and is left out. A receive posted early (`recv_posts`, or `posts` where the
    caller already has them) holds its buffer from the instruction it is posted before, not from its `recv`."""
    sizes = sizes or Sizes(module)
    if posts is None:
        return iter(posted_changes(module, program, sizes)[1])
    return iter(_posted(_changes(module, program, sizes), posts))


def posted_changes(
    module: Module, program: RankProgram, sizes: Sizes | None = None, shape_key: tuple[object, ...] | None = None
) -> tuple[dict[int, int], list[tuple[int, float]]]:
    """`recv_posts` and `memory_changes` under those posts, for the price of one walk over the program; worked out
    once per program shape (`program_shape`, or `shape_key` where the caller has it) that `sizes` has seen, the answer
    shared: callers read it, never change it."""
    shape = _shape(module, program, sizes or Sizes(module), shape_key)
    return shape.posts, shape.changes


@dataclass(frozen=True, slots=True)
class _Shape:
    """What memory does on every program of one shape (`program_shape`)."""

    posts: dict[int, int]
    """`recv_posts`."""
    changes: list[tuple[int, float]]
    """`memory_changes` under those posts."""
    live: float
    """The most bytes live at once (0 for a program without allocations)."""
    index: int
    """Where they are first live (-1 for a program without allocations)."""


def _shape(module: Module, program: RankProgram, sizes: Sizes, key: tuple[object, ...] | None = None) -> _Shape:
    key = program_shape(module, program) if key is None else key
    found = sizes.shapes.get(key)
    if found is None:
        base = _changes(module, program, sizes)
        posts = _posts(program, sizes, base, None)
        changes = _posted(base, posts)
        total, live, index = 0.0, 0.0, -1
        for at, change in changes:
            total += change
            if total > live:
                live, index = total, at
        found = sizes.shapes[key] = _Shape(posts, changes, live, index)
    return found


def program_shape(module: Module, program: RankProgram) -> tuple[object, ...]:
    """What a program's memory depends on: each instruction less the ranks it names (peers, groups), the
    microbatches numbered in order of first appearance, and the replica where a split stage's share depends on it.
    The members of a tensor group run one program; the replicas of a stage run it on microbatches of their own."""
    instrs = program.instrs
    mbs = [instr.mb for instr in instrs]
    labels = {mb: n for n, mb in enumerate(dict.fromkeys(mbs))}
    split = any(s.split for s in module.stages)
    return (
        program.attrs.replica if split else None,
        tuple(map(_SHAPE_FIELDS, instrs)),
        tuple(map(labels.__getitem__, mbs)),
    )


#: What `program_shape` reads of each instruction; the kind by its text (hashing an enum member runs Python code).
_SHAPE_FIELDS = attrgetter("kind._value_", "stage", "value", "grad", "rows")


def _changes(module: Module, program: RankProgram, sizes: Sizes) -> list[tuple[int, float, int]]:
    """(instruction index, bytes, receive) for each change with every receive posted at its `recv`, in program
    order: `receive` is the index of the `recv` whose buffer the change allocates (what a post moves), else -1."""
    live: dict[tuple[object, ...], float] = {}
    share = _share(module, program.attrs.replica or 0)
    found: list[tuple[int, float, int]] = []
    k_free, k_fwd, k_bin, k_bwd, k_recv = (
        InstrKind.FREE,
        InstrKind.FORWARD,
        InstrKind.BACKWARD_INPUT,
        InstrKind.BACKWARD,
        InstrKind.RECV,
    )
    for index, instr in enumerate(program.instrs):
        kind, stage = instr.kind, instr.stage
        receive = -1
        if kind is k_free:
            size = -live.pop(_key(instr), 0.0)
        elif kind is k_fwd and stage is not None:
            # A recomputing stage's forward keeps only its inputs: the received ones are held as
            # transfers until its backward anyway, the loaded ones (model inputs, targets) count here.
            size = share(stage) * (sizes.checkpointed(stage) if stage.recompute else sizes.activation(stage))
        elif kind is k_bin and stage is not None:
            # The rerun forward's activations stay until the weight pass when the backward is split.
            size = share(stage) * (sizes.weight_pass(stage) + (sizes.rerun(stage) if stage.recompute else 0.0))
        elif kind is k_bwd and stage is not None and stage.recompute:
            # The rerun forward's activations live while the backward runs, then go.
            act = share(stage) * sizes.rerun(stage)
            if act > 0:
                found.append((index, act, -1))
                found.append((index, -act, -1))
            continue
        elif kind is k_recv and instr.value is not None:
            size, receive = sizes.moved(instr), index
        else:
            continue
        if size > 0:
            key = _key(instr)
            live[key] = live.get(key, 0.0) + size
        if size:
            found.append((index, size, receive))
    return found


def _posted(base: list[tuple[int, float, int]], posts: dict[int, int]) -> list[tuple[int, float]]:
    """`_changes`' list with each receive in `posts` allocating at the instruction it is posted before, ahead of
    that instruction's own change (receives posted at one point in program order)."""
    if not posts:
        return [(index, size) for index, size, _ in base]
    moved = sorted((posts[receive], receive, size) for _, size, receive in base if receive in posts)
    found: list[tuple[int, float]] = []
    j, left = 0, len(moved)
    for index, size, receive in base:
        while j < left and moved[j][0] <= index:
            found.append((moved[j][0], moved[j][2]))
            j += 1
        if receive not in posts:
            found.append((index, size))
    found.extend((post, size) for post, _, size in moved[j:])
    return found


def recv_posts(
    module: Module, program: RankProgram, sizes: Sizes | None = None, headroom: float | None = None
) -> dict[int, int]:
    """recv index -> index of the instruction its receive is posted before, for the receives posted early.

    Each receive `lowering.early_post_points` allows is posted there when its buffer, held from that point
    to its `recv`, keeps the rank within the peak it has with every receive posted at its `recv` plus one
    compute's receives (`post_headroom`): early posting hides transfers behind compute and costs at most the
    inputs of one compute more than the schedule holds, the buffers torch's schedules post ahead too. Every
    byte of it is counted (`memory_changes`), so the verifier, the planner's finalists and the simulator see
    the peak the runtime reaches. Taken in program order, so an earlier receive has the first claim on the
    headroom. `headroom`: bytes in place of `post_headroom`'s (0: posts only within the peak, the rule before
    the headroom, which the runtime benchmark's ablation measures against).
    """
    sizes = sizes or Sizes(module)
    if headroom is None:
        return dict(_shape(module, program, sizes).posts)
    return _posts(program, sizes, _changes(module, program, sizes), headroom)


def _posts(
    program: RankProgram, sizes: Sizes, base: list[tuple[int, float, int]], headroom: float | None
) -> dict[int, int]:
    """`recv_posts` from the program's changes with every receive at its `recv` (`_changes`)."""
    candidates = early_post_points(program.instrs)
    if not candidates:
        return {}
    level = [0.0] * len(program.instrs)  # live bytes while each instruction runs
    total, at = 0.0, 0
    for index, size, _ in base:
        if index > at:
            level[at:index] = [total] * (index - at)
            at = index
        total += size
    level[at:] = [total] * (len(level) - at)
    peak = max(level)
    posts: dict[int, int] = {}
    for recv, post in sorted(candidates.items()):
        size = sizes.moved(program.instrs[recv])
        held = max(level[post:recv]) + size
        if held > peak:
            if headroom is None:  # worked out once a post needs it
                headroom = post_headroom(program, sizes)
            if held > peak + headroom:
                continue
        for index in range(post, recv):
            level[index] += size
        posts[recv] = post
    return posts


def post_headroom(program: RankProgram, sizes: Sizes) -> float:
    """What early posts may hold above the rank's peak: the most bytes one compute waits for, its receives
    since the compute before it (without headroom a last stage's next input would wait for its recv under
    1F1B and ZB-H1, and its sender's transport thread would have to answer the late post mid-compute)."""
    most, waiting = 0.0, 0.0
    for instr in program.instrs:
        if instr.kind is InstrKind.RECV and instr.value is not None:
            waiting += sizes.moved(instr)
        elif instr.kind in COMPUTE_KINDS:
            most, waiting = max(most, waiting), 0.0
    return most


def program_peak(
    module: Module, program: RankProgram, sizes: Sizes | None = None, shape_key: tuple[object, ...] | None = None
) -> RankPeak:
    """The rank's static bytes and its live bytes at the worst instruction (`sizes`: shared across ranks;
    `shape_key`: the program's `program_shape`, where the caller has it)."""
    sizes = sizes or Sizes(module)
    static = sizes.static_of(hosted_stages(module, program))
    shape = _shape(module, program, sizes, shape_key)
    return RankPeak(program.rank, static, shape.live, shape.index)


def peak_bytes_per_rank(module: Module) -> dict[int, float]:
    """Static peak memory of every rank, by rank."""
    sizes = Sizes(module)
    return {index: program_peak(module, p, sizes).total for index, p in enumerate(module.programs)}


def stage_memory(module: Module, sizes: Sizes | None = None) -> tuple[StageMemory, ...]:
    """What one microbatch of each stage holds on its first replica's rank, in pipeline order, as this module
    counts it: the bytes a schedule weighs its orders by (`ScheduleRequest.memory`). Needs placed stages (the
    rank's static bytes are those of every stage on the same devices)."""
    sizes = sizes or Sizes(module)
    share = _share(module, 0)
    received = dict.fromkeys(module.stages, 0.0)
    gradients = dict.fromkeys(module.stages, 0.0)
    carry_grad = values_needing_grad(module)
    for c in crossings(module):
        received[c.consumer] += share(c.consumer) * sizes.transferred(c.value)
        if c.value in carry_grad:
            gradients[c.producer] += share(c.producer) * sizes.transferred(c.value)
    found = []
    for stage in module.stages:
        mates = [s for s in module.stages if s.attrs.devices == stage.attrs.devices]
        kept = sizes.checkpointed(stage) if stage.recompute else sizes.activation(stage)
        rerun = sizes.rerun(stage) if stage.recompute else 0.0
        found.append(
            StageMemory(
                static=sizes.static_of(mates),
                activation=share(stage) * kept,
                received=received[stage],
                gradient=gradients[stage],
                weight_pass=share(stage) * sizes.weight_pass(stage),
                rerun=share(stage) * rerun,
            )
        )
    return tuple(found)


def activation_peak_microbatches(program: RankProgram) -> int:
    """Most stage-microbatches whose activations the rank holds at once (forward done, not yet released).

    A stage's activations are released by its backward, or by its backward_weight when the backward is split.
    """
    live, peak = 0, 0
    for instr in program.instrs:
        if instr.kind is InstrKind.FORWARD:
            live += 1
            peak = max(peak, live)
        elif instr.kind in (InstrKind.BACKWARD, InstrKind.BACKWARD_WEIGHT):
            live -= 1
    return peak
