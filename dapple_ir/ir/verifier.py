"""Structural verifier of the IR, separate from the parser.

Checks SSA (one definition, defined before use), operand types where the op kind fixes them,
references to parameters (read at their declared type), layer and stage membership, that stages
form a DAG on distinct non-negative devices, that rank programs refer to existing stages, values,
ranks and microbatches on distinct devices, and that every number is in range (`ranges`). Errors
name the culprit and reprint the IR around it.
Deadlock freedom and memory fit are whole-plan properties checked by the `verify` pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import compress, count, repeat
from operator import attrgetter, eq, is_
from typing import Any

from dapple_ir.errors import VerifyError
from dapple_ir.ir import (
    COLLECTIVE_KINDS,
    COMPUTE_KINDS,
    Instr,
    InstrKind,
    Layer,
    Module,
    Op,
    OpKind,
    RankProgram,
    Stage,
    TensorType,
    TupleType,
)
from dapple_ir.ir.printer import Namer, format_type, print_module
from dapple_ir.ir.ranges import attr_problems, batch_problem, stage_cycle, type_problem
from dapple_ir.ir.scale import HeldAlike, picked

_CONTEXT_LINES = 3

_Shapes = dict[tuple[object, ...], tuple[int, tuple[int, ...]]]
"""`_Verifier.may_break`'s program shapes: each one's first rank and the indices of its sharded collectives."""


def verify_module(module: Module) -> None:
    """Raise `VerifyError` at the first broken invariant."""
    _Verifier(module).run()


def neighbourhood(module: Module, line_matches: Callable[[int, str], bool]) -> str:
    """The printed module's lines around the first line `line_matches(index, text)`, marked `>`."""
    lines = print_module(module).splitlines()
    hit = next((i for i, text in enumerate(lines) if line_matches(i, text)), None)
    if hit is None:
        return ""
    lo, hi = max(hit - _CONTEXT_LINES, 0), min(hit + _CONTEXT_LINES + 1, len(lines))
    return "\n".join(("> " if i == hit else "  ") + lines[i] for i in range(lo, hi))


class _Verifier:
    def __init__(self, module: Module) -> None:
        self.module = module
        self.namer = Namer(module.ops)
        self.op_set = set(module.ops)
        self.stage_set = set(module.stages)
        self.param_names = {p.name for p in module.params}
        self.param_types = {p.name: p.type for p in module.params}
        self.alike = HeldAlike(module.programs)
        self.keyed: dict[int, _Keyed] = {}
        """The programs `may_break` keyed by their shape and found to pass, by rank."""

    def op_error(self, op: Op, message: str) -> VerifyError:
        name = self.namer(op)
        where = neighbourhood(self.module, lambda _i, text: text.strip().startswith(f"{name} ="))
        return VerifyError(f"verify: op {name}: {message}\n{where}")

    def instr_error(self, program: RankProgram, index: int, message: str) -> VerifyError:
        header = f"program @{program.name}"
        state = {"start": -1}

        def match(i: int, text: str) -> bool:
            if text.strip().startswith(header):
                state["start"] = i
            return state["start"] >= 0 and i == state["start"] + 1 + index

        where = neighbourhood(self.module, match)
        return VerifyError(f"verify: {program.name}, instruction {index}: {message}\n{where}")

    def run(self) -> None:
        self.check_numbers()
        self.check_params()
        self.check_ops()
        self.check_groups("layer", self.module.layers, require_all=bool(self.module.layers))
        self.check_groups("stage", self.module.stages, require_all=bool(self.module.stages))
        self.check_stages()
        self.check_tensor_parallel()
        self.check_programs()

    def check_numbers(self) -> None:
        module = self.module
        for problem in attr_problems(module.attrs):
            raise VerifyError(f"verify: module @{module.name}: {problem}")
        for p in module.params:
            for problem in _problems(type_problem(p.type), attr_problems(p.attrs)):
                raise VerifyError(f"verify: parameter @{p.name}: {problem}")
        for op in module.ops:
            for problem in _problems(type_problem(op.type), attr_problems(op.attrs)):
                raise self.op_error(op, problem)
        groups: list[Layer | Stage | RankProgram] = [*module.layers, *module.stages, *module.programs]
        for group in groups:
            for problem in attr_problems(group.attrs):
                raise VerifyError(f"verify: @{group.name}: {problem}")
        mismatch = batch_problem(module)
        if mismatch:
            raise VerifyError(f"verify: {mismatch}")

    def check_params(self) -> None:
        seen: set[str] = set()
        for p in self.module.params:
            if p.name in seen:
                raise VerifyError(f"verify: parameter @{p.name} is declared twice")
            seen.add(p.name)

    def check_ops(self) -> None:
        params = {p.name for p in self.module.params}
        defined: set[Op] = set()
        in_module = set(self.module.ops)
        for op in self.module.ops:
            if op in defined:
                raise self.op_error(op, "is defined twice (SSA values have one definition)")
            for operand in op.operands:
                if operand not in in_module:
                    raise self.op_error(op, f"reads %{operand.name}, which is not an op of this module")
                if operand not in defined:
                    raise self.op_error(op, f"reads {self.namer(operand)} before its definition")
            defined.add(op)
            for name in op.attrs.params or ():
                if name not in params:
                    raise self.op_error(op, f"reads parameter @{name}, which is not declared")
            self.check_op_types(op, params)

    def check_op_types(self, op: Op, params: set[str]) -> None:
        if op.kind is OpKind.INPUT and op.operands:
            raise self.op_error(op, "an input takes no operands")
        calls = (OpKind.CALL_MODULE, OpKind.CALL_FUNCTION, OpKind.CALL_METHOD, OpKind.GET_ATTR)
        if op.kind in calls and op.target is None:
            raise self.op_error(op, f"{op.kind.value} needs a target (@callee)")
        if op.kind is OpKind.GET_ATTR and op.target not in params:
            raise self.op_error(op, f"get_attr reads @{op.target}, which is not a declared parameter")
        if op.kind is OpKind.GET_ATTR and op.type != self.param_types[str(op.target)]:
            declared = self.param_types[str(op.target)]
            raise self.op_error(
                op,
                f"reads @{op.target} as {format_type(op.type)} but the parameter is declared {format_type(declared)}",
            )
        if op.kind is OpKind.OUTPUT:
            if len(op.operands) != 1:
                raise self.op_error(op, f"output takes exactly one operand, not {len(op.operands)}")
            if op.type != op.operands[0].type:
                raise self.op_error(op, "output type differs from its operand's type")
        if op.target in ("operator.getitem", "getitem") and op.operands:
            self.check_getitem(op)

    def check_getitem(self, op: Op) -> None:
        source = op.operands[0].type
        index = op.attrs.index
        if not isinstance(source, TupleType) or index is None:
            return
        if not 0 <= index < len(source.elements):
            raise self.op_error(op, f"getitem index {index} is out of range for a {len(source.elements)}-tuple")
        if op.type != source.elements[index]:
            raise self.op_error(op, "getitem result type differs from the tuple element it reads")

    def check_groups(self, kind: str, groups: list, require_all: bool) -> None:  # type: ignore[type-arg]
        owner: dict[Op, str] = {}
        in_module = set(self.module.ops)
        names: set[str] = set()
        for group in groups:
            if group.name in names:
                raise VerifyError(f"verify: {kind} @{group.name} is declared twice")
            names.add(group.name)
            for op in group.ops:
                if op not in in_module:
                    raise VerifyError(f"verify: {kind} @{group.name} holds %{op.name}, not an op of this module")
                if op in owner:
                    raise self.op_error(op, f"is in both {kind} @{owner[op]} and {kind} @{group.name}")
                owner[op] = group.name
        if not require_all:
            return
        for op in self.module.ops:
            if op not in owner:
                raise self.op_error(op, f"is in no {kind} (every op belongs to exactly one {kind})")

    def check_stages(self) -> None:
        for stage in self.module.stages:
            devices = stage.attrs.devices
            if stage.replicas < 1:
                raise VerifyError(f"verify: stage @{stage.name} has {stage.replicas} replicas; at least 1")
            if devices is not None and len(devices) != stage.replicas * stage.tp:
                per = f" of tp = {stage.tp} devices each" if stage.tp > 1 else ""
                raise VerifyError(
                    f"verify: stage @{stage.name} has {stage.replicas} replicas{per} but "
                    f"{len(devices)} devices {list(devices)}; give {stage.replicas * stage.tp} devices, replica-major"
                )
            if devices is not None and len(set(devices)) != len(devices):
                raise VerifyError(f"verify: stage @{stage.name} puts two replicas on one device: {list(devices)}")
        cycle = stage_cycle(self.module)
        if cycle:
            path = " -> ".join(f"@{name}" for name in cycle)
            raise VerifyError(f"verify: stages form a cycle ({path}): a pipeline's values must flow one way")

    def check_tensor_parallel(self) -> None:
        """Stages on tensor groups (`tp` > 1): their split dimensions divide, no split value crosses their edge."""
        users = None
        for stage in self.module.stages:
            if stage.tp == 1:
                continue
            users = users if users is not None else self.module.users()
            problem = tensor_split_problem(self.module, stage.ops, stage.tp, users)
            if problem:
                raise VerifyError(
                    f"verify: stage @{stage.name} runs on tensor groups of tp = {stage.tp} devices, but {problem}; "
                    "give the stage a degree its split dimensions divide by, or cut it at the end of a pattern"
                )

    def check_programs(self) -> None:
        n = len(self.module.programs)
        on_device: dict[int, str] = {}
        shapes: _Shapes = {}
        stage_names = {s.name for s in self.stage_set}
        for index, program in enumerate(self.module.programs):
            device = program.attrs.device
            if device is not None and device in on_device:
                raise VerifyError(
                    f"verify: programs @{on_device[device]} and @{program.name} both run on device {device}; "
                    "each rank needs a device of its own"
                )
            if device is not None:
                on_device[device] = program.name
            if program.attrs.rank is not None and program.attrs.rank != index:
                raise VerifyError(
                    f"verify: program @{program.name} says rank = {program.attrs.rank} but is "
                    f"program number {index}; programs are listed in rank order"
                )
            for stage_name in program.attrs.stages or ():
                if stage_name not in stage_names:
                    raise VerifyError(
                        f"verify: program @{program.name} hosts stage @{stage_name}, which is not declared"
                    )
            if not self.may_break(program, index, n, shapes):
                continue
            for i, instr in enumerate(program.instrs):  # the walk that finds the first problem and names it
                problem = self.instr_problem(instr, index, n)
                if problem:
                    raise self.instr_error(program, i, problem)

    def may_break(self, program: RankProgram, rank: int, n_ranks: int, shapes: _Shapes) -> bool:
        """Whether an instruction of `program` may have a problem (`instr_problem`); False only where none has.

        Replicas of a stage and the members of a tensor group run programs of one shape: the same kinds, stages,
        values and parameters, the same fields unset, on microbatches, peers and groups of their own. What
        `instr_problem` finds from the shape alone is found on the first program of each shape (`shape_problem`,
        walked whole where that finds something); the others are held to it by what differs: their microbatches,
        peers and groups, each as a set, and (a sharded collective's group is as large as its stage's replicas) their
        sharded collectives one by one. `shapes`: each shape's first rank and where its sharded collectives are (the
        kinds are part of the shape: found once). A program that holds the very instructions of one keyed before at
        most places is held to that one instead (`alike_verdict`): its shape is then found at those places alone."""
        instrs = program.instrs
        if not instrs:
            return False
        found = self.alike.find(rank)
        verdict = self.alike_verdict(program, rank, n_ranks, *found) if found is not None else None
        if verdict is not None:
            return verdict
        columns = _columns(instrs)
        kinds, stages, values, params, mbs, peers, groups = columns
        named, grouped = set(peers) - {None}, set(groups) - {None}
        if self.ranks_problem(mbs, named, grouped, rank, n_ranks):
            return True
        key = (kinds, stages, values, params, (_nones(mbs), _nones(peers), _nones(groups)))
        first = shapes.get(key)
        if first is None:
            first = shapes[key] = (rank, tuple(i for i, kind in enumerate(kinds) if kind in _SHARD_VALUES))
        self.keyed[rank] = _Keyed(first[1], named, grouped)
        if first[0] == rank:
            return self.shape_problem(instrs, columns, rank, n_ranks)  # the first program of its shape
        return any(self.shard_problem(instrs[i], rank, n_ranks) for i in first[1])

    def shape_problem(self, instrs: list[Instr], columns: _Columns, rank: int, n_ranks: int) -> bool:
        """Whether an instruction of a program whose microbatches, peers and groups pass (`ranks_problem`) may have a
        problem. Once every stage and value it names is the module's, what `instr_problem` finds of an instruction
        depends only on its kind, stage, parameter and group, and on which of its value, microbatch and peer are
        unset: one instruction of each such class is asked."""
        kinds, stages, values, params, mbs, peers, groups = columns
        if not (set(stages) - {None} <= self.stage_set and set(values) - {None} <= self.op_set):
            return True
        alike = zip(kinds, stages, params, groups, _nones(values), _nones(mbs), _nones(peers), strict=True)
        return any(self.instr_problem(instr, rank, n_ranks) for instr in dict(zip(alike, instrs, strict=True)).values())

    def ranks_problem(
        self, mbs: tuple[int | None, ...], named: set[int], grouped: set[tuple[int, ...]], rank: int, n_ranks: int
    ) -> bool:
        """Whether a microbatch is out of range, a peer in `named` is this rank or out of range, or a group in
        `grouped` leaves this rank out or names a rank out of range."""
        numbered: set[int] = set(mbs) - {None}  # type: ignore[assignment]
        last = self.module.attrs.microbatches
        if numbered and (min(numbered) < 0 or (last is not None and max(numbered) >= last)):
            return True
        if named and (rank in named or min(named) < 0 or max(named) >= n_ranks):
            return True
        return any(rank not in g or min(g) < 0 or max(g) >= n_ranks for g in grouped)

    def alike_verdict(self, program: RankProgram, rank: int, n_ranks: int, other: int, at: list[int]) -> bool | None:
        """`may_break`'s verdict from program `other`, whose very instructions this one holds but at places `at`
        (`HeldAlike`); None where `other` was not keyed, or where the two differ at `at` in more than microbatches,
        peers and groups (their shapes may then differ).

        Every instruction of the other passed (or `check_programs` raised): held here, it passes unless it names
        this rank as its peer or leaves it out of its group, which the other's few peers and groups tell. This
        program's own instructions are held as `may_break` holds a program of the other's shape: their microbatches,
        peers and groups as sets, and the shape's sharded collectives one by one."""
        keyed = self.keyed.get(other)
        if keyed is None:
            return None
        instrs, theirs = program.instrs, self.module.programs[other].instrs
        mine = _columns(picked(instrs, at))
        if (mine[:4], tuple(map(_nones, mine[4:]))) != keyed.held_at(theirs, at):
            return None
        if self.ranks_problem(mine[4], set(mine[5]) - {None}, set(mine[6]) - {None}, rank, n_ranks):
            return True
        if not keyed.held_apart(theirs, set(at), rank):
            return True
        return any(self.shard_problem(instrs[i], rank, n_ranks) for i in keyed.sharded)

    def instr_problem(self, instr: Instr, rank: int, n_ranks: int) -> str | None:
        kind = instr.kind
        microbatches = self.module.attrs.microbatches
        if instr.stage is not None and instr.stage not in self.stage_set:
            return f"refers to stage @{instr.stage.name}, which is not a stage of this module"
        if instr.value is not None and instr.value not in self.op_set:
            return f"refers to %{instr.value.name}, which is not an op of this module"
        if instr.mb is not None and (instr.mb < 0 or (microbatches is not None and instr.mb >= microbatches)):
            return f"microbatch {instr.mb} is out of range 0..{(microbatches or 1) - 1}"
        if kind in (InstrKind.SEND, InstrKind.RECV):
            if instr.value is None or instr.peer is None or instr.mb is None:
                return f"{kind.value} needs a value, a microbatch and a peer rank"
            if not 0 <= instr.peer < n_ranks or instr.peer == rank:
                return f"peer rank {instr.peer} is not another rank of 0..{n_ranks - 1}"
        if kind in COMPUTE_KINDS and (instr.stage is None or instr.mb is None):
            return f"{kind.value} needs a stage and a microbatch"
        if kind is InstrKind.FREE and (instr.mb is None or (instr.stage is None) == (instr.value is None)):
            return "free needs a microbatch and exactly one of a stage or a value"
        if kind is InstrKind.ALLREDUCE:
            return self.allreduce_problem(instr, rank, n_ranks)
        if kind is InstrKind.TENSOR_ALLREDUCE:
            return self.tensor_problem(instr, rank, n_ranks)
        if kind in COLLECTIVE_KINDS:
            return self.shard_problem(instr, rank, n_ranks)
        return None

    def shard_problem(self, instr: Instr, rank: int, n_ranks: int) -> str | None:
        """A reduce_scatter or all_gather: a sharded stage's collective over exactly its replicas' ranks."""
        name = instr.kind.value
        if instr.group is None or instr.stage is None or instr.param is not None:
            return f"{name} needs a stage and a group (no param: a tied parameter is allreduced whole)"
        if not instr.stage.sharded:
            return f"{name} of stage @{instr.stage.name}, which does not shard its optimizer state (no zero = 1)"
        if rank not in instr.group or len(instr.group) != instr.stage.replicas:
            return (
                f"{name} group {list(instr.group)} must be this rank ({rank}) and the other replicas of "
                f"@{instr.stage.name} ({instr.stage.replicas} ranks)"
            )
        if any(not 0 <= r < n_ranks for r in instr.group):
            return f"{name} group {list(instr.group)} names a rank outside 0..{n_ranks - 1}"
        return None

    def tensor_problem(self, instr: Instr, rank: int, n_ranks: int) -> str | None:
        """A tensor_allreduce: a value summed over a tensor group that holds this rank."""
        if instr.value is None or instr.mb is None or instr.group is None:
            return "tensor_allreduce needs a value, a microbatch and a group"
        if rank not in instr.group or any(not 0 <= r < n_ranks for r in instr.group):
            return f"tensor_allreduce group {list(instr.group)} must hold this rank ({rank}), within 0..{n_ranks - 1}"
        return None

    def allreduce_problem(self, instr: Instr, rank: int, n_ranks: int) -> str | None:
        if instr.group is None or (instr.stage is None) == (instr.param is None):
            return "allreduce needs a group and exactly one of a stage or a param"
        if rank not in instr.group:
            return f"allreduce group {list(instr.group)} does not include this rank ({rank})"
        if any(not 0 <= r < n_ranks for r in instr.group):
            return f"allreduce group {list(instr.group)} names a rank outside 0..{n_ranks - 1}"
        if instr.param is not None and instr.param not in self.param_names:
            return f"allreduce of parameter @{instr.param}, which is not declared"
        return None


#: What `may_break` reads of each instruction; the kind by its text (hashing an enum member runs Python code).
_FIELDS = attrgetter("kind._value_", "stage", "value", "param", "mb", "peer", "group")
_PEER, _GROUP = attrgetter("peer"), attrgetter("group")
_SHARD_VALUES = frozenset({InstrKind.REDUCE_SCATTER.value, InstrKind.ALL_GATHER.value})


@dataclass
class _Keyed:
    """A program `may_break` keyed by its shape, found to pass: what a program that holds its very instructions at
    most places is held to (`_Verifier.alike_verdict`)."""

    sharded: tuple[int, ...]
    """Where its shape's sharded collectives are."""
    peers: set[int]
    """Its peers."""
    groups: set[tuple[int, ...]]
    """Its instructions' groups."""
    places: dict[object, frozenset[int]] = field(default_factory=dict)
    """Where each peer or group is among its instructions, found when first asked (`held_apart`)."""
    last: tuple[list[int], tuple[_Columns, tuple[tuple[bool, ...], ...]]] | None = None
    """What `held_at` was last asked and answered."""

    def held_at(self, instrs: list[Instr], at: list[int]) -> tuple[_Columns, tuple[tuple[bool, ...], ...]]:
        """Its instructions (`instrs`) at places `at`: their first four columns (`_FIELDS`) and which of the last
        three are unset. The last answer is kept: the members of a tensor group hold their own at the same places."""
        if self.last is None or self.last[0] != at:
            columns = _columns(picked(instrs, at))
            self.last = (at, (columns[:4], tuple(map(_nones, columns[4:]))))
        return self.last[1]

    def held_apart(self, instrs: list[Instr], own: set[int], rank: int) -> bool:
        """Whether a program with instructions of its own at `own`, and this one's (`instrs`) elsewhere, holds none
        of this one's that names `rank` as its peer or leaves it out of its group."""
        peers = [peer for peer in self.peers if peer == rank]
        groups = [group for group in self.groups if rank not in group]
        for key, read in [*((p, _PEER) for p in peers), *((g, _GROUP) for g in groups)]:
            places = self.places.get(key)
            if places is None:
                places = self.places[key] = frozenset(compress(count(), map(eq, map(read, instrs), repeat(key))))
            if not places <= own:
                return False
        return True


_Columns = tuple[tuple[Any, ...], ...]


def _columns(instrs: Sequence[Instr]) -> _Columns:
    """What `may_break` reads of each instruction (`_FIELDS`), field by field."""
    return tuple(zip(*map(_FIELDS, instrs), strict=True)) or ((),) * 7


def _nones(field: tuple[object, ...]) -> tuple[bool, ...]:
    """Which of a field's entries are unset."""
    return tuple(map(is_, field, repeat(None)))


def _problems(first: str | None, rest: Iterator[str]) -> Iterator[str]:
    if first:
        yield first
    yield from rest


# ------------------------------------------------------------------------------- tensor parallelism


def is_tensor_split(op: Op) -> bool:
    """Does a tensor group hold `op`'s value in pieces (`OpAttrs.tp_dim`)? A parameter read is not such a
    value: every stage loads its own piece of the parameter."""
    return op.attrs.tp_dim is not None and op.kind is not OpKind.GET_ATTR


def tensor_split_problem(module: Module, ops: list[Op], t: int, users: dict[Op, list[Op]] | None = None) -> str | None:
    """Why a stage holding `ops` cannot run on a tensor group of `t` (None: it can): a split dimension of a
    result or parameter that does not divide into `tp_parts` * `t` pieces, or a split value that enters or
    leaves the set (a pattern cut by a stage boundary). `users` (`module.users()`) is computed when not given."""
    if t == 1:
        return None
    for op in ops:
        shapes = [op.type.shape] if isinstance(op.type, TensorType) else []
        if isinstance(op.type, TupleType):
            shapes = [e.shape for e in op.type.elements if isinstance(e, TensorType)]
        for shape in shapes if is_tensor_split(op) else []:
            problem = _divides(f"op %{op.name}", shape, op.attrs.tp_dim, op.attrs.tp_parts, t)
            if problem:
                return problem
    names = {name for op in ops for name in op.attrs.params or ()}
    for p in module.params:
        problem = _divides(f"parameter @{p.name}", p.type.shape, p.attrs.tp_dim, p.attrs.tp_parts, t)
        if p.name in names and problem:
            return problem
    return _split_edge_problem(module, ops, users)


def _divides(what: str, shape: tuple[int, ...], dim: int | None, parts: int | None, t: int) -> str | None:
    if dim is None:
        return None
    if not 0 <= dim < len(shape):
        return f"{what} splits dimension {dim}, which its shape {list(shape)} does not have"
    size, parts = shape[dim], parts or 1
    if size % (parts * t) == 0:
        return None
    if parts > 1 and size % parts == 0:
        size_text = f"size {size}: {parts} parts of {size // parts}, which is"
    else:
        size_text = f"size {size}, which is"
    return f"{what} splits dimension {dim} of {list(shape)} ({size_text} not a multiple of T = {t})"


def _split_edge_problem(module: Module, ops: list[Op], users: dict[Op, list[Op]] | None) -> str | None:
    inside = set(ops)
    for op in ops:
        outer = next((o for o in op.operands if is_tensor_split(o) and o not in inside), None)
        if outer is None:
            continue
        what = "row-parallel op" if op.attrs.tp_role == "row" else "op"
        return f"{what} %{op.name} reads split %{outer.name} from another stage (a cut inside a pattern)"
    if not any(is_tensor_split(op) for op in ops):
        return None
    users = users if users is not None else module.users()
    for op in ops:
        reader = next((u for u in users.get(op, ()) if u not in inside), None) if is_tensor_split(op) else None
        if reader is not None:
            return f"split %{op.name} is read by %{reader.name} in another stage (a cut inside a pattern)"
    return None
