"""Whole-plan checks of rank programs: work complete, no deadlock, frees exact, memory fits.

`find_deadlock` runs the programs against each other: a send posts its message and moves on, a recv
waits for the matching send (same value, gradient flag, microbatch and pair of ranks), an allreduce
waits until every rank of its group reaches the same allreduce. When no rank can move, it follows
who waits for whom and reports the cycle.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Collection, Hashable, Sequence
from itertools import chain, compress, count
from operator import attrgetter

from dapple_ir.analysis.peak_memory import Sizes, hosted_stages, program_peak, program_shape
from dapple_ir.cluster.spec import ClusterSpec
from dapple_ir.cluster.toml_file import resolve_cluster
from dapple_ir.errors import VerifyError
from dapple_ir.ir import COLLECTIVE_KINDS, COMPUTE_KINDS, Instr, InstrKind, Module, Op, RankProgram, Stage
from dapple_ir.ir.printer import Namer, format_instr
from dapple_ir.ir.scale import Held, held_alike, picked


def run_plan_checks(
    module: Module,
    cluster: str | ClusterSpec | None = None,
    meeting: Sequence[int] | None = None,
    held: list[Held] | None = None,
) -> None:
    """Every check that applies to the programs as they are (frees and memory only once frees exist). `meeting`: where
    the caller knows every other rank to be in a copy of a part of these (`dapple_ir.sim.parts`: ranks that meet only
    each other, whose programs map onto these instruction by instruction), the deadlock check runs on these alone;
    where they find a problem, on every rank, to name the first. `held`: `held_alike` of the programs as they are,
    where the caller has it."""
    if not module.programs:
        return
    # What a tensor group's members hold of their lead's: read once for all checks.
    held = held if held is not None else held_alike(module.programs)
    check_compute_order(module, held)
    kinds = _kinds_that_decide(module.programs)
    if kinds & _MEETS:
        problem = find_deadlock(module.programs, module, meeting) if meeting is not None else "unknown"
        if problem:
            problem = find_deadlock(module.programs, module)
        if problem:
            raise VerifyError(f"verify: the programs deadlock: {problem}")
    if InstrKind.FREE.value in kinds:
        # Each program's shape, worked out once for both checks (a walk over each of a thousand ranks' programs).
        shapes = program_shapes(module, held)
        check_frees(module, shapes)
        if cluster:
            check_memory(module, cluster, shapes)
    if kinds & {kind.value for kind in _LOWERED}:
        check_optimizer_steps(module, held)


def _kinds_that_decide(programs: list[RankProgram]) -> set[str]:
    """The kinds of the programs' instructions, as far as they decide which checks run: the programs are read until
    one that meets other ranks (`_MEETS`) and a free are found, which decide all (a lowered plan's first rank has
    both: a thousand ranks' programs are millions of instructions)."""
    kinds: set[str] = set()
    for program in programs:
        kinds.update(map(_KIND, program.instrs))
        if InstrKind.FREE.value in kinds and kinds & _MEETS:
            break
    return kinds


def program_shapes(module: Module, held: Sequence[Held] | None = None) -> list[int]:
    """A label of each program's `program_shape`, equal where the shapes are equal and only there. A program that
    holds the very instructions of an earlier one but at a few places (`HeldAlike`: a tensor group's member) has the
    other's shape where the instructions at those places have the other's there, microbatches as they are (so the
    same numbering of them); every other program's shape is worked out. `held`: `held_alike` of the programs, where
    the caller has it."""
    labels: list[int] = []
    known: dict[tuple[object, ...], int] = {}
    held = held if held is not None else held_alike(module.programs)
    # The other's instructions at the places asked last, and their shape: a tensor group's members ask the same.
    theirs: dict[int, tuple[list[int], tuple[object, ...]]] = {}
    for program, found in zip(module.programs, held, strict=True):
        if found is None:
            labels.append(known.setdefault(program_shape(module, program), len(known)))
            continue
        other, at = found
        if other not in theirs or theirs[other][0] != at:
            theirs[other] = (at, _shape_at(module, module.programs[other], at))
        alike_shape = _shape_at(module, program, at) == theirs[other][1]
        labels.append(labels[other] if alike_shape else known.setdefault(program_shape(module, program), len(known)))
    return labels


def _shape_at(module: Module, program: RankProgram, at: list[int]) -> tuple[object, ...]:
    """The `program_shape` of the program's instructions at places `at`, with their microbatches as they are."""
    instrs = list(picked(program.instrs, at))
    return program_shape(module, RankProgram(program.name, instrs, program.attrs)), tuple(map(_MB, instrs))


#: Instructions only lowering adds: once one is there, every rank's program must be complete.
_LOWERED = frozenset({InstrKind.SEND, InstrKind.RECV, InstrKind.FREE, InstrKind.OPTIMIZER_STEP}) | COLLECTIVE_KINDS

#: An instruction's kind by its text: the checks ask it of millions of instructions, and hashing an enum member (to
#: look it up in a set of kinds) runs Python code.
_KIND = attrgetter("kind._value_")
_MB = attrgetter("mb")
_COMPUTE = frozenset(kind.value for kind in COMPUTE_KINDS)
_COLLECTIVE = frozenset(kind.value for kind in COLLECTIVE_KINDS)
_MEETS = _COLLECTIVE | {InstrKind.SEND.value, InstrKind.RECV.value}


def check_optimizer_steps(module: Module, held: Sequence[Held] | None = None) -> None:
    """A lowered rank that computes ends its step with exactly one optimizer step, after its last
    forward or backward (else its parameters never change, or change from half a step's gradients). `held`:
    `held_alike` of the programs, where the caller has it: a rank that holds an earlier one's very instructions but
    at places where neither holds a computation or an optimizer step passes as that one did."""
    step = InstrKind.OPTIMIZER_STEP.value
    for index, program in enumerate(module.programs):
        if held is not None and _alike_at(module.programs, index, held[index], _COMPUTE | {step}):
            continue
        kinds = list(map(_KIND, program.instrs))
        # The last computation, looked for from the end (where it is, before the collectives and the step): a walk
        # over every instruction of a thousand ranks takes seconds.
        last = next((k for k in range(len(kinds) - 1, -1, -1) if kinds[k] in _COMPUTE), None)
        if last is None:
            continue
        steps = kinds.count(step)
        if steps != 1:
            raise VerifyError(
                f"verify: rank {program.rank} ({program.name}) has {steps} optimizer steps; a lowered "
                "program that computes needs exactly one, after its last backward"
            )
        first = kinds.index(step)
        if first < last:
            raise VerifyError(
                f"verify: {_where(module, program, first)} comes before the rank's last computation "
                f"({_where(module, program, last)}); the optimizer step ends the step"
            )


def _alike_at(programs: list[RankProgram], index: int, found: Held, kinds: Collection[str]) -> bool:
    """Whether program `index` holds the very instructions of an earlier one (`found`: `held_alike`'s) but at places
    where neither holds an instruction of `kinds`."""
    if found is None:
        return False
    other, at = found
    own = chain(picked(programs[index].instrs, at), picked(programs[other].instrs, at))
    return not any(map(kinds.__contains__, map(_KIND, own)))


def _where(module: Module | None, program: RankProgram, index: int) -> str:
    namer = Namer(module.ops if module else [])
    return f"rank {program.rank} instruction {index} `{format_instr(program.instrs[index], namer)}`"


# ------------------------------------------------------------------------------ work is complete


#: What one sequence of computations runs, once checked (`_walk_computations`): the (stage, replica) pairs whose owner
#: must be the rank that runs it, its kinds by (stage, mb, replica), per stage how many of those are of a microbatch
#: and replica the plan has, and whether all of those are complete.
_Walked = tuple[set[tuple[Stage, int]], dict[tuple[Stage, int, int], list[InstrKind]], dict[Stage, int], bool]


def check_compute_order(module: Module, held: Sequence[Held] | None = None) -> None:
    """Each stage runs each microbatch's forward once, on the replica that owns it, then its backward once (on every
    member of the replica's tensor group, `StageAttrs.tp`). `held`: `held_alike` of the programs, where the caller has
    it: a rank that holds an earlier one's very instructions but at places where neither holds a computation runs the
    other's computations."""
    m = module.attrs.microbatches or 0
    owner = {
        (name, p.attrs.replica or 0, p.attrs.tensor_rank or 0): index
        for index, p in enumerate(module.programs)
        for name in p.attrs.stages or ()
    }
    # The members of a tensor group run the very same computations (`lower-comm` shares them): where a rank's are
    # those of one checked before, with its replica, only the owners of its (stage, replica) pairs are left to
    # check, and its runs are the other's, under its own tensor rank. A (stage, mb, replica, tensor rank) is run
    # only by the rank that owns it, so each rank's order is checked on its own runs alone.
    checked: dict[tuple[object, ...], _Walked] = {}
    walked: list[tuple[_Walked, int]] = []
    covered = 0
    computed: list[tuple[Instr, ...]] = []
    for index, program in enumerate(module.programs):
        found = held[index] if held is not None else None
        if found is not None and _alike_at(module.programs, index, found, _COMPUTE):
            computes = computed[found[0]]
        else:
            computes = tuple(compress(program.instrs, map(_COMPUTE.__contains__, map(_KIND, program.instrs))))
        computed.append(computes)
        k = program.attrs.tensor_rank or 0
        shape = (program.attrs.replica or 0, computes)
        seen = checked.get(shape)
        if seen is None or not all(owner.get((s.name, replica, k)) == index for s, replica in seen[0]):
            seen = checked.setdefault(shape, _walk_computations(module, index, owner, k))
        walked.append((seen, k))
        covered += sum(n for stage, n in seen[2].items() if k < stage.tp)
    # Complete where the runs of the plan's (stage, mb, replica, tensor rank)s, no two alike, are all there and
    # complete; else the first one missing or incomplete is looked for, in the plan's order.
    expected = sum(m * (stage.replicas if stage.split else 1) * stage.tp for stage in module.stages)
    if covered == expected and all(seen[3] for seen, _k in walked):
        return
    done = {(stage, mb, replica, k): kinds for seen, k in walked for (stage, mb, replica), kinds in seen[1].items()}
    complete = ([InstrKind.FORWARD, InstrKind.BACKWARD], _SPLIT)
    for stage in module.stages:
        for mb in range(m):
            for replica in range(stage.replicas) if stage.split else (mb % stage.replicas,):
                for k in range(stage.tp):
                    if done.get((stage, mb, replica, k)) not in complete:
                        _check_complete(stage, mb, replica, k, done.get((stage, mb, replica, k), []))


def _walk_computations(module: Module, index: int, owner: dict[tuple[str, int, int], int], k: int) -> _Walked:
    """Rank `index`'s computations checked in order (owner, then order: the first problem raised), and what they run."""
    program = module.programs[index]
    instrs, m = program.instrs, module.attrs.microbatches or 0
    pairs: set[tuple[Stage, int]] = set()
    runs: dict[tuple[Stage, int, int], list[InstrKind]] = {}
    for i in compress(count(), map(_COMPUTE.__contains__, map(_KIND, instrs))):
        instr = instrs[i]
        if instr.stage is None or instr.mb is None:
            continue
        stage, mb = instr.stage, instr.mb
        # Every replica of a split stage runs every microbatch (its rows of it).
        replica = (program.attrs.replica or 0) if stage.split else mb % stage.replicas
        expected = owner.get((stage.name, replica, k))
        if expected != index:
            raise VerifyError(
                f"verify: {_where(module, program, i)}: microbatch {mb} of @{stage.name} belongs to replica "
                f"{replica}, which is rank {expected}"
            )
        pairs.add((stage, replica))
        kinds = runs.setdefault((stage, mb, replica), [])
        problem = _order_problem(kinds, instr.kind)
        if problem:
            raise VerifyError(f"verify: {_where(module, program, i)}: {problem}")
        kinds.append(instr.kind)
    stages = set(module.stages)
    planned: dict[Stage, int] = {}
    whole = True
    for (stage, mb, replica), kinds in runs.items():
        if stage in stages and 0 <= mb < m and replica < stage.replicas:
            planned[stage] = planned.get(stage, 0) + 1
            whole = whole and kinds in ([InstrKind.FORWARD, InstrKind.BACKWARD], _SPLIT)
    return pairs, runs, planned, whole


def _check_complete(stage: Stage, mb: int, replica: int, k: int, kinds: list[InstrKind]) -> None:
    if kinds not in ([InstrKind.FORWARD, InstrKind.BACKWARD], _SPLIT):
        got = ", ".join(kind.value for kind in kinds) or "nothing"
        which = f" replica {replica}" if stage.split else ""
        which += f" tensor rank {k}" if stage.tp > 1 else ""
        raise VerifyError(
            f"verify: @{stage.name}{which} mb={mb} runs {got}; every forward needs exactly one backward "
            "(or one backward_input and one backward_weight)"
        )


_SPLIT = [InstrKind.FORWARD, InstrKind.BACKWARD_INPUT, InstrKind.BACKWARD_WEIGHT]


_BEFORE: dict[InstrKind, list[InstrKind]] = {
    InstrKind.FORWARD: [],
    InstrKind.BACKWARD: [InstrKind.FORWARD],
    InstrKind.BACKWARD_INPUT: [InstrKind.FORWARD],
    InstrKind.BACKWARD_WEIGHT: [InstrKind.FORWARD, InstrKind.BACKWARD_INPUT],
}
"""What must already have run for a stage and microbatch before each kind of compute."""


def _order_problem(before: list[InstrKind], kind: InstrKind) -> str | None:
    allowed = _BEFORE[kind]
    if before == allowed:
        return None
    if kind in before:
        return f"{kind.value} of this stage and microbatch runs twice"
    return f"{kind.value} needs {' then '.join(k.value for k in allowed)} first (so far: {before or 'nothing'})"


# ---------------------------------------------------------------------------------------- deadlock


def _collective_key(instr: Instr, occurrence: int) -> tuple[object, ...]:
    return (instr.kind, instr.stage, instr.param, instr.group, occurrence)


def find_deadlock(
    programs: list[RankProgram], module: Module | None = None, ranks: Sequence[int] | None = None
) -> str | None:
    """None when all programs run to the end with every send received; else what goes wrong, with the cycle. `ranks`:
    run only these, which meet no rank outside them (default: all)."""
    n = len(programs)
    ranks = range(n) if ranks is None else ranks
    # Only sends, receives and collectives meet other ranks (the rest never wait): each rank goes from one to the next.
    stops: list[list[int]] = [[] for _ in range(n)]
    for rank in ranks:
        stops[rank] = list(compress(count(), map(_MEETS.__contains__, map(_KIND, programs[rank].instrs))))
    at = [0] * n
    # Messages sent and not yet received, by (sender, receiver, value, gradient, microbatch): a plain dict, read with
    # `get`, for the millions of transfers of a thousand ranks.
    posted: dict[tuple[object, ...], int] = {}
    waiting: dict[tuple[object, ...], int] = {}
    arrived: dict[tuple[object, ...], set[int]] = {}
    seen_collectives: list[Counter[tuple[object, ...]]] = [Counter() for _ in range(n)]
    runnable = deque(ranks)
    send, recv, sent = InstrKind.SEND, InstrKind.RECV, posted.get
    while runnable:
        rank = runnable.popleft()
        instrs, mine = programs[rank].instrs, stops[rank]
        # Only this rank moves its own position here (a collective moves the others'): kept in a local.
        k, end = at[rank], len(mine)
        while k < end:
            instr = instrs[mine[k]]
            kind = instr.kind
            if kind is send:
                key: tuple[object, ...] = (rank, instr.peer, instr.value, instr.grad, instr.mb)
                posted[key] = sent(key, 0) + 1
                if key in waiting:
                    runnable.append(waiting.pop(key))
            elif kind is recv:
                key = (instr.peer, rank, instr.value, instr.grad, instr.mb)
                messages = sent(key, 0)
                if not messages:
                    waiting[key] = rank
                    break
                posted[key] = messages - 1
            else:
                base = (instr.kind, instr.stage, instr.param, instr.group)
                key = _collective_key(instr, seen_collectives[rank][base])
                members = arrived.setdefault(key, set())
                if rank not in members:
                    members.add(rank)
                if members != set(instr.group or ()):
                    break
                seen_collectives[rank][base] += 1
                for other in members - {rank}:
                    seen_collectives[other][base] += 1
                    at[other] += 1
                    runnable.append(other)
            k += 1
        at[rank] = k
    pc = [mine[k] if k < len(mine) else len(p.instrs) for p, mine, k in zip(programs, stops, at, strict=True)]
    stuck = [r for r in range(n) if pc[r] < len(programs[r].instrs)]
    if stuck:
        return _describe_cycle(programs, pc, stuck[0], arrived, seen_collectives, module)
    unreceived = [key for key, count in posted.items() if count]
    if unreceived:
        src, dst, value, grad, mb = unreceived[0]
        name = Namer(module.ops)(value) if module and isinstance(value, Op) else "a value"  # type: ignore[arg-type]
        return f"rank {src} sends {'grad ' if grad else ''}{name} mb={mb} to rank {dst}, which never receives it"
    return None


def _waits_for(
    programs: list[RankProgram],
    pc: list[int],
    rank: int,
    arrived: dict[tuple[object, ...], set[int]],
    seen: list[Counter[tuple[object, ...]]],
) -> int:
    instr = programs[rank].instrs[pc[rank]]
    if instr.kind is InstrKind.RECV:
        assert instr.peer is not None
        return instr.peer
    base = (instr.kind, instr.stage, instr.param, instr.group)
    members = arrived.get(_collective_key(instr, seen[rank][base]), set())
    return min(set(instr.group or ()) - members, default=rank)


def _describe_cycle(
    programs: list[RankProgram],
    pc: list[int],
    start: int,
    arrived: dict[tuple[object, ...], set[int]],
    seen: list[Counter[tuple[object, ...]]],
    module: Module | None,
) -> str:
    chain: list[int] = []
    rank = start
    while rank not in chain:
        chain.append(rank)
        if pc[rank] >= len(programs[rank].instrs):
            steps = [f"{_where(module, programs[r], pc[r])} waits for rank {w}" for r, w in itertools.pairwise(chain)]
            return "; ".join(steps) + f"; rank {rank} has finished its program without getting there"
        rank = _waits_for(programs, pc, rank, arrived, seen)
    cycle = [*chain[chain.index(rank) :], rank]
    steps = [f"{_where(module, programs[r], pc[r])} waits for rank {w}" for r, w in itertools.pairwise(cycle)]
    return "cycle: " + "; ".join(steps)


# ------------------------------------------------------------------------------------------- frees


def _buffer_key(instr: Instr) -> tuple[object, ...]:
    """What a forward, recv or free makes or releases: a stage's activations, a value, or a gradient."""
    if instr.kind is InstrKind.FORWARD or (instr.kind is InstrKind.FREE and instr.stage is not None):
        return ("stage", instr.stage, instr.mb)
    return ("grad" if instr.grad else "value", instr.value, instr.mb)


def check_frees(module: Module, shapes: Sequence[Hashable] | None = None) -> None:
    """Every forward's activations, received value and received gradient is freed exactly once, after use. `shapes`:
    each program's `program_shape`, or a label equal where those are equal and only there (`program_shapes`), where
    the caller has them."""
    touches = {s: _touches(s) for s in module.stages}
    passed: set[Hashable] = set()
    for index, program in enumerate(module.programs):
        # Replicas and tensor-group members run one program on microbatches of their own (`program_shape`, which
        # peak memory shares too): what is freed, and when, depends only on which instructions name the same
        # microbatch, so a program of a shape that passed passes.
        shape = shapes[index] if shapes is not None else program_shape(module, program)
        if shape in passed:
            continue
        passed.add(shape)  # raised below where it does not pass
        live: set[tuple[object, ...]] = set()
        freed: dict[int | None, list[tuple[tuple[object, ...], int]]] = {}
        for i, instr in enumerate(program.instrs):
            if instr.kind in (InstrKind.FORWARD, InstrKind.RECV):
                live.add(_buffer_key(instr))
            elif instr.kind is InstrKind.FREE:
                key = _buffer_key(instr)
                if key not in live:
                    where = _where(module, program, i)
                    raise VerifyError(f"verify: {where} frees what is not live (never made, or freed twice)")
                live.remove(key)
                freed.setdefault(instr.mb, []).append((key, i))
            if instr.kind._value_ not in _COMPUTE or instr.stage is None:
                continue
            for (kind, what, _mb), at in freed.get(instr.mb, []):
                if (kind, what) in touches[instr.stage]:
                    raise VerifyError(
                        f"verify: {_where(module, program, i)} uses what {_where(module, program, at)} already freed"
                    )
        if live:
            kind, what, mb = sorted(live, key=str)[0]
            name = f"@{what.name}" if isinstance(what, Stage) else Namer(module.ops)(what)  # type: ignore[arg-type]
            grad = "grad " if kind == "grad" else ""
            raise VerifyError(f"verify: rank {program.rank} never frees {grad}{name} mb={mb}")


def _touches(stage: Stage) -> set[tuple[str, object]]:
    """Buffers a stage's compute reads: its activations, the values it reads, gradients of what it defines."""
    reads = {("value", v) for op in stage.ops for v in op.operands}
    return {("stage", stage)} | reads | {("grad", op) for op in stage.ops}


# ------------------------------------------------------------------------------------------ memory


def check_memory(module: Module, cluster: str | ClusterSpec, shapes: Sequence[Hashable] | None = None) -> None:
    """Each rank's static peak fits its device; the error names the rank, the instruction and the overflow. `shapes`:
    each program's `program_shape`, or a label equal where those are equal and only there (`program_shapes`), where
    the caller has them: a rank's peak is that of its program's shape on top of its stages' static bytes, so a rank
    of the shape, stages and device memory of one that fits fits."""
    spec = resolve_cluster(cluster) if isinstance(cluster, str) else cluster
    sizes = Sizes(module)
    fitted: set[tuple[object, ...]] = set()
    for index, program in enumerate(module.programs):
        if program.attrs.device is None:
            continue
        capacity = spec.device(program.attrs.device).memory_bytes
        alike = (shapes[index], tuple(hosted_stages(module, program)), capacity) if shapes is not None else None
        if alike in fitted:
            continue
        peak = program_peak(module, program, sizes)
        if peak.total <= capacity:
            if alike is not None:
                fitted.add(alike)
            continue
        at = _where(module, program, peak.index) if peak.index >= 0 else f"rank {program.rank} (static state alone)"
        raise VerifyError(
            f"verify: {at}: rank {program.rank} on device {program.attrs.device} needs {peak.total:.0f} bytes "
            f"({peak.static_bytes:.0f} static + {peak.live_bytes:.0f} live), {peak.total - capacity:.0f} bytes "
            f"more than the device's {capacity:.0f}"
        )
