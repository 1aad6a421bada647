"""`insert-frees`: release every kept tensor right after its last use, then record each rank's peak memory.

Release points, for microbatch m on one rank:
  * `free @s mb=m`: the stage's saved activations, after its backward (after backward_weight when split);
  * `free %v mb=m`: a received activation, after the release of the last stage on the rank that reads it;
  * `free grad %v mb=m`: a received gradient, after the release of the stage that defines v.
Frees follow the sends that directly follow that compute, so gradients leave before memory is returned.
`program.attrs.peak_bytes` is then the static peak of `dapple_ir.analysis.peak_memory`.
Where `plan` handed on the lowering it simulated (`ir.scale.TrialLowering`) and the programs hold its instructions,
the frees are that lowering's (the same as this pass makes); the peaks are always counted here, of the program shapes
the trial noted. A trial (`ir.scale.noting`) counts no peaks: nothing reads them, and `plan` rewrites the costs after.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import compress, count
from operator import attrgetter

from dapple_ir.analysis.peak_memory import Sizes, program_peak, program_shape
from dapple_ir.errors import ScheduleError
from dapple_ir.ir import Instr, InstrKind, Module, Op, RankProgram, Stage, scale
from dapple_ir.ir.scale import collector_paused
from dapple_ir.registry import Pass, PassContext, register_pass

_RELEASE = (InstrKind.BACKWARD, InstrKind.BACKWARD_WEIGHT)


@register_pass
@dataclass(frozen=True)
class InsertFrees(Pass):
    """Free saved activations and received tensors after their last use; store each rank's peak bytes."""

    name = "insert-frees"

    def apply(self, ctx: PassContext, module: Module) -> None:
        if not module.programs:
            raise ScheduleError("insert-frees: the module has no rank programs; run `schedule` first")
        readers: dict[Op, list[Stage]] = {}
        for stage in module.stages:
            for v in {v for op in stage.ops for v in op.operands}:
                readers.setdefault(v, []).append(stage)
        definers = {op: s for s in module.stages for op in s.ops}
        handed = scale.handed(module)
        scale.hand_over(None)
        with collector_paused():
            taken = handed.freed(module) if handed is not None else None
            if taken is not None:
                for program, instrs in zip(module.programs, taken[0], strict=True):
                    program.instrs = instrs
            keys = taken[1] if taken is not None else None
            if keys is None:
                keys = _with_shapes(module, readers, definers, taken is None)
            if scale.is_trial(module):  # what `plan` simulates: nothing reads its peaks, counted again after
                scale.note(module, "shapes", keys)
                return
            sizes = Sizes(module)
            peaks: dict[tuple[int, tuple[str, ...] | None], float] = {}
            for program, key in zip(module.programs, keys, strict=True):
                # The programs of one shape object and the same hosted stages have one peak: asked once.
                alike = (id(key), program.attrs.stages)
                peak = peaks.get(alike) if program.attrs.stages is not None else None
                if peak is None:
                    peak = peaks[alike] = program_peak(module, program, sizes, key).total
                program.attrs.peak_bytes = peak


def _with_shapes(
    module: Module, readers: dict[Op, list[Stage]], definers: dict[Op, Stage], add_frees: bool
) -> list[tuple[object, ...]]:
    """Each program's `program_shape`, its frees first put in place where `add_frees` (else its instructions are
    taken as they are)."""
    # Programs that differ only in peers and groups (a tensor group's members) get their frees at the same places:
    # found once per program of the same instructions otherwise (`_FREES_READ`).
    made: dict[object, list[_Freed]] = {}
    # Programs given the same frees differ from each other only in what `program_shape` leaves out (peers, groups)
    # and reads apart (rows, replica): where those match too, the shape is worked out once.
    shapes: dict[tuple[object, ...], tuple[object, ...]] = {}
    keys: list[tuple[object, ...]] = []
    found: list[list[tuple[int, list[Instr]]]] = []
    leads = _leads(module) if add_frees else {}
    for k, program in enumerate(module.programs):
        if not add_frees:
            keys.append(program_shape(module, program))
            continue
        lead = leads.get(k)
        if lead is not None:  # its lead's but for peers and groups, which neither frees nor shapes read
            found.append(found[lead])
            # `lower-comm` makes no frees (`lowering.lowered_with_leads`): its programs are taken as they are.
            program.instrs = _spliced(program.instrs, found[lead])
            keys.append(keys[lead])
            continue
        program.instrs, points = _with_frees(program, readers, definers, made)
        found.append(points)
        same = (id(points), program.attrs.replica, tuple(map(_ROWS, program.instrs)))
        key = shapes.get(same)
        if key is None:
            key = shapes[same] = program_shape(module, program)
        keys.append(key)
    return keys


def _leads(module: Module) -> dict[int, int]:
    """In a trial (`ir.scale.noting`) whose programs are what its `lower-comm` made: the lead of each tensor-group
    member lowered from its lead's instructions (`lowering.as_member`: peers and groups its own, the rest the lead's);
    else none."""
    leads, lowered = scale.noted(module, "leads"), scale.noted(module, "lowered")
    if not isinstance(leads, dict) or not isinstance(lowered, list):
        return {}
    # Instructions compare equal only to themselves: this compares identities, element by element, in C.
    return leads if [p.instrs for p in module.programs] == lowered else {}


def _release_index(instrs: list[Instr], kinds: list[str] | None = None) -> dict[tuple[Stage, int], int]:
    """Index of the compute that releases each (stage, mb): its backward_weight if split, else its backward (`kinds`:
    each instruction's kind's text, where the caller read them)."""
    result: dict[tuple[Stage, int], int] = {}
    kinds = list(map(_KIND, instrs)) if kinds is None else kinds
    for index in compress(count(), map(_RELEASE_KINDS.__contains__, kinds)):
        instr = instrs[index]
        if instr.stage is not None and instr.mb is not None:
            result[(instr.stage, instr.mb)] = index
    return result


def _with_frees(
    program: RankProgram, readers: dict[Op, list[Stage]], definers: dict[Op, Stage], made: dict[object, list[_Freed]]
) -> tuple[list[Instr], list[tuple[int, list[Instr]]]]:
    """The program's instructions with its frees, and where those go (`made`'s entry: shared by the programs whose
    instructions `_FREES_READ` reads alike, which get the very same free instructions)."""
    instrs = _unfreed(program)
    # Programs told apart by their first instructions (most are, at a thousand ranks) are not read whole.
    alike = made.setdefault((len(instrs), *map(_FREES_READ, instrs[:_PROBED])), [])
    reads = list(map(_FREES_READ, instrs)) if alike else None
    for other in alike:
        if other.reads is None:
            other.reads = list(map(_FREES_READ, other.instrs))
        if other.reads == reads:
            return _spliced(instrs, other.points), other.points
    points = _free_points(program, instrs, readers, definers)
    alike.append(_Freed(instrs, points, reads))
    return _spliced(instrs, points), points


@dataclass(slots=True)
class _Freed:
    """A program's instructions less its frees, where `_free_points` puts those, and what `_FREES_READ` reads of the
    instructions (once another program could be alike)."""

    instrs: list[Instr]
    points: list[tuple[int, list[Instr]]]
    reads: list[tuple[object, ...]] | None


def _unfreed(program: RankProgram) -> list[Instr]:
    """The program's instructions less any frees."""
    free_kind = InstrKind.FREE  # kinds compare by identity: hashing an enum member runs Python code
    return [i for i in program.instrs if i.kind is not free_kind]


def _spliced(instrs: list[Instr], points: list[tuple[int, list[Instr]]]) -> list[Instr]:
    """`instrs` with each list of frees in `points` put in before the instruction at its index."""
    out: list[Instr] = []
    start = 0
    for at, frees in points:
        out += instrs[start:at]
        out += frees
        start = at
    out += instrs[start:]
    return out


#: What of each instruction decides where the frees go: not the peers, rows or groups.
_FREES_READ = attrgetter("kind._value_", "stage", "value", "grad", "mb")
#: How many of a program's first instructions `_with_frees` compares before all of them.
_PROBED = 16
#: An instruction's kind's text: the loops over every instruction compare texts (hashing an enum member runs Python
#: code, too slow per instruction).
_KIND = attrgetter("kind._value_")
#: The kinds of the computes that release a stage's saved activations (`_RELEASE`), by text.
_RELEASE_KINDS = frozenset(kind.value for kind in _RELEASE)
#: The kinds of the instructions that make something to free (a forward's activations, a received tensor), by text.
_FREED_KINDS = frozenset({InstrKind.FORWARD.value, InstrKind.RECV.value})
_ROWS = attrgetter("rows")


def _free_points(
    program: RankProgram, instrs: list[Instr], readers: dict[Op, list[Stage]], definers: dict[Op, Stage]
) -> list[tuple[int, list[Instr]]]:
    """(index into `instrs`, the frees that go right before it) in order: after the compute that releases them and
    the sends that follow it."""
    # Kinds compare by identity (or text) in the loops below: hashing an enum member runs Python code, too slow per
    # instruction; and the instructions that make nothing to free (most: the tensor groups' sums) are skipped in C.
    free_kind, forward = InstrKind.FREE, InstrKind.FORWARD
    send = InstrKind.SEND
    kinds = list(map(_KIND, instrs))
    release = _release_index(instrs, kinds)
    frees: dict[int, list[Instr]] = {}

    made: set[tuple[object, ...]] = set()

    def free_after(index: int | None, stage: Stage | None, value: Op | None, grad: bool, mb: int) -> None:
        # Gradients of one value from several consumers accumulate in one buffer: one free releases it.
        key = (stage, value, grad, mb)
        if key in made:
            return
        made.add(key)
        free = Instr(free_kind, stage, value, grad, mb)
        if index is None:
            raise ScheduleError(f"insert-frees: {program.name} never releases {_freed(free)}; is its backward missing?")
        frees.setdefault(index, []).append(free)

    for at in compress(count(), map(_FREED_KINDS.__contains__, kinds)):
        instr = instrs[at]
        kind, stage, value, mb = instr.kind, instr.stage, instr.value, instr.mb
        if kind is forward:
            if stage is not None and mb is not None:
                free_after(release.get((stage, mb)), stage, None, False, mb)
            continue
        if value is None or mb is None:  # a recv
            continue
        if instr.grad:
            free_after(release.get((definers[value], mb)), None, value, True, mb)
            continue
        last = None  # the last release of a stage of the rank that reads it
        for reader in readers.get(value, ()):
            index = release.get((reader, mb))
            if index is not None and (last is None or index > last):
                last = index
        free_after(last, None, value, False, mb)
    points: list[tuple[int, list[Instr]]] = []
    for index in sorted(frees):
        at = index + 1
        while at < len(instrs) and instrs[at].kind is send:
            at += 1
        if points and points[-1][0] == at:
            points[-1][1].extend(sorted(frees[index], key=_free_order))
        else:
            points.append((at, sorted(frees[index], key=_free_order)))
    return points


def _free_order(free: Instr) -> int:
    """The stage's own activations first, then received values, then received gradients."""
    return 0 if free.stage is not None else 1 + free.grad


def _freed(free: Instr) -> str:
    """What a free releases, for an error."""
    if free.stage is not None:
        return f"@{free.stage.name} mb={free.mb}"
    assert free.value is not None
    return f"{'grad ' if free.grad else ''}%{free.value.name} mb={free.mb}"
