"""Working on the IR of a thousand ranks: millions of rank-program instructions made or walked at once."""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from itertools import compress, count
from operator import attrgetter, is_not, itemgetter

from dapple_ir.ir.core import COMPUTE_KINDS, Instr, InstrKind, Module, Op, Param, RankProgram, Stage


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a block that makes or walks millions of lasting objects (the rank
    programs' instructions of a thousand ranks, a simulation of them): each full collection walks every object
    alive, and such a block sets off several, which took more time than the block's own work. Reference counting
    still frees all that is not in a cycle; the collector runs again after the block, with all it tracks counted old
    (`gc.freeze` then `gc.unfreeze`: the oldest generation), so that its next collection of the young does not walk
    each object the block made (seconds at a thousand ranks); cycles among them are freed by a full collection."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.freeze()
            gc.unfreeze()
            gc.enable()


@dataclass(eq=False)
class TrialLowering:
    """The lowering (`schedule`, `lower-comm`, `insert-frees`) that `plan` ran on a copy of `module` to simulate the
    plan it chose, handed on (`hand_over`) so that `lower-comm` and `insert-frees` take its instructions instead of
    making them again: at a thousand ranks, millions of them. `plan` gave the module the trial's stages (the same
    objects, once it checked that they are what it writes), so the trial's instructions name the module's stages.
    `schedule` takes the trial's compute instructions too. Each pass takes the trial's answer only where its input is
    what the trial's was (`scheduled`, `lowered`, `freed`), so what it writes is what it would have computed. The
    trial's peaks are neither counted (nothing reads a trial's) nor taken: `plan` rewrites the ops' costs after it
    simulates, and `insert-frees` counts the bytes, of the shapes the trial found (`freed`)."""

    module: Module
    """The module the trial was lowered for."""
    stages: list[Stage]
    """The trial's stages, which `plan` gave the module."""
    microbatch_size: int | None
    """The trial's microbatch size: the one module attribute the communication reads besides the stages and graph."""
    programs: list[RankProgram]
    """The trial's programs as `insert-frees` left them."""
    graph: tuple[list[Op], list[Param]] = ([], [])
    """The ops and parameters the trial read (the module's, shared): a pass that puts others in their place after
    `plan` gets no trial's answer."""
    notes: dict[str, object] = field(default_factory=dict)
    """What the trial's passes noted for the hand-over (`note`): `schedule` its inputs and each rank's compute
    instructions, `insert-frees` each program's `peak_memory.program_shape`."""

    def scheduled(self, module: Module, inputs: object) -> list[list[Instr]] | None:
        """Each rank's compute instructions as `schedule` writes them for `module`, where `inputs` (all the pass's
        programs are made from) equal those it noted for the trial; else None."""
        noted = self.notes.get("schedule")
        if not isinstance(noted, tuple) or noted[0] != inputs or not self._same_graph(module):
            return None
        return [list(instrs) for instrs in noted[1]]

    def lowered(self, module: Module) -> list[list[Instr]] | None:
        """Each rank's instructions as `lower-comm` writes them for `module`, where its programs' instructions are
        the trial's compute instructions (equal field by field, in order); else None."""
        if not self._same_plan(module):
            return None
        lowered = self._lowered()
        noted = self.notes.get("schedule")
        if isinstance(noted, tuple) and all(map(list.__eq__, [p.instrs for p in module.programs], noted[1])):
            return lowered  # the very compute instructions `scheduled` handed on (compared by identity, in C)
        for program, trial in zip(module.programs, lowered, strict=True):
            if _fields(program.instrs) != _fields([i for i in trial if i.kind._value_ in _COMPUTE]):
                return None
        return lowered

    def freed(self, module: Module) -> tuple[list[list[Instr]], list[tuple[object, ...]] | None] | None:
        """Each rank's instructions as `insert-frees` writes them for `module`, where its programs hold the very
        instruction objects of the trial's less its frees (as `lowered` handed them on), with each program's
        `peak_memory.program_shape` as the trial's `insert-frees` noted it (None where it noted none: a shape reads the
        instructions, the replica and which stages split, never the ops' costs); else None."""
        if not self._same_plan(module):
            return None
        # Instructions compare equal only to themselves: this compares identities, element by element, in C.
        if [p.instrs for p in module.programs] != self._lowered():
            return None
        shapes = self.notes.get("shapes")
        return [p.instrs for p in self.programs], shapes if isinstance(shapes, list) else None

    def _lowered(self) -> list[list[Instr]]:
        """Each of the trial's programs less its frees: as its `lower-comm` noted them (`lowered`), else found anew.
        Lists of their own, so that a pass that changes what it took changes nothing here."""
        noted = self.notes.get("lowered")
        if isinstance(noted, list):
            return [list(instrs) for instrs in noted]
        free = InstrKind.FREE
        return [[i for i in p.instrs if i.kind is not free] for p in self.programs]

    def _same_graph(self, module: Module) -> bool:
        return (
            module is self.module
            and (module.ops, module.params) == self.graph
            and len(module.stages) == len(self.stages)
            and all(a is b for a, b in zip(module.stages, self.stages, strict=True))
        )

    def _same_plan(self, module: Module) -> bool:
        return (
            self._same_graph(module)
            and module.attrs.microbatch_size == self.microbatch_size
            and len(module.programs) == len(self.programs)
            and all(_placed(a) == _placed(b) for a, b in zip(module.programs, self.programs, strict=True))
        )


def _placed(program: RankProgram) -> tuple[object, ...]:
    """A program's name and attributes but its peak (which `insert-frees` writes last)."""
    return (program.name, replace(program.attrs, peak_bytes=None))


#: `COMPUTE_KINDS` by their text (hashing an enum member runs Python code, too slow per instruction).
_COMPUTE = frozenset(kind.value for kind in COMPUTE_KINDS)
#: Every field of an instruction, for comparing programs made apart.
_fields_of = attrgetter(*(f.name for f in fields(Instr)))


def _fields(instrs: list[Instr]) -> list[tuple[object, ...]]:
    return list(map(_fields_of, instrs))


class HeldAlike:
    """Programs that hold the very instruction objects of an earlier one at all but a few places (the members of a
    tensor group hold their lead's computations, sums and frees: only their transfers and collectives are their
    own). Whatever is found of the earlier one's instructions holds for such a program's at every other place."""

    def __init__(self, programs: Sequence[RankProgram]) -> None:
        self.programs = programs
        self.firsts: dict[Instr, int] = {}
        """A few instructions (`_PROBES`) of each program held alike to no earlier one, to the program's index."""

    def find(self, index: int) -> Held:
        """The earlier program whose instructions program `index` holds at all but at most half its places, with
        those places, ascending; None where there is none (then later programs may be held to this one). Asked of
        each program in order."""
        instrs = self.programs[index].instrs
        n = len(instrs)
        probes = [instrs[n * k // _PROBES] for k in range(_PROBES)] if n else []
        other = next((self.firsts[probe] for probe in probes if probe in self.firsts), None)
        theirs = self.programs[other].instrs if other is not None else ()
        if other is not None and len(theirs) == n:
            at = list(compress(count(), map(is_not, instrs, theirs)))
            if 2 * len(at) <= n:
                return other, at
        for probe in probes:
            self.firsts.setdefault(probe, index)
        return None


_PROBES = 8

Held = tuple[int, list[int]] | None
"""`HeldAlike.find`'s answer: the earlier program and the places where this one holds instructions of its own."""


def held_alike(programs: Sequence[RankProgram]) -> list[Held]:
    """`HeldAlike.find` of each program, in order."""
    alike = HeldAlike(programs)
    return [alike.find(index) for index in range(len(programs))]


def picked(instrs: list[Instr], places: list[int]) -> Sequence[Instr]:
    """The instructions at `places`, picked without a Python call each."""
    return itemgetter(*places)(instrs) if len(places) > 1 else [instrs[i] for i in places]


_noting: list[tuple[Module, dict[str, object]]] = []
"""The trial `plan` lowers now (`noting`), with what its passes noted so far."""


@contextmanager
def noting(trial: Module) -> Iterator[dict[str, object]]:
    """While `plan` lowers `trial`: what its lowering passes note (`note`) for the hand-over, by name."""
    notes: dict[str, object] = {}
    _noting[:] = [(trial, notes)]
    try:
        yield notes
    finally:
        _noting.clear()


def is_trial(module: Module) -> bool:
    """Whether `module` is a trial `plan` lowers now (`noting`): a pass may then leave out what no one reads of it."""
    return any(m is module for m, _ in _noting)


def noted(module: Module, name: str) -> object:
    """What a pass noted under `name` for the hand-over of `module`'s trial lowering (`note`), where it is one and a
    pass did; else None."""
    return next((notes.get(name) for trial, notes in _noting if trial is module), None)


def note(module: Module, name: str, value: object) -> None:
    """Note `value` under `name` for the hand-over of `module`'s trial lowering, where it is one (else nothing)."""
    for trial, notes in _noting:
        if trial is module:
            notes[name] = value


_handed: list[TrialLowering] = []
"""The trial lowering `plan` handed on last (one at most): `insert-frees` takes it back."""


def hand_over(trial: TrialLowering | None) -> None:
    """Hand `trial` on to the passes that lower its module (None: nothing), in place of any handed before."""
    _handed[:] = [trial] if trial is not None else []


def handed(module: Module) -> TrialLowering | None:
    """The trial lowering handed on for `module`, if any."""
    return next((t for t in _handed if t.module is module), None)
