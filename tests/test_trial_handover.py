"""What `plan` hands on from the trial it simulated (`ir.scale.TrialLowering`) is taken only where it is right.

`schedule` takes the trial's compute instructions where its inputs are the trial's, `insert-frees` the shapes the
trial found for its programs; the trial counts no peaks (nothing reads them). Each plan compiled with the hand-over
is the plan compiled without it, text for text, and a pass asked for another lowering than the trial's gets its
own: a shortcut taken where it should not be shows as another plan.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import weakref
from collections.abc import Callable

import pytest

from dapple_ir import api
from dapple_ir.analysis import lowering
from dapple_ir.analysis.peak_memory import Sizes, program_peak, program_shape
from dapple_ir.cluster.toml_file import resolve_cluster
from dapple_ir.ir import InstrKind, Module, RankProgram, scale
from dapple_ir.ir.parser import parse_module
from dapple_ir.ir.printer import print_module
from dapple_ir.pass_manager import PassManager, build_pipeline
from dapple_ir.passes import plan
from dapple_ir.pricing.ops import OpPrices
from dapple_ir.registry import PassContext, lookup_pass
from dapple_ir.sim import simulator
from tests.test_compile_scale import GPT, PLANS, _fields

ZB_TENSOR_GROUPS = dict(
    cluster="2x8xA100-80GB", stages=2, tensor_parallel=2, data_parallel=2, schedule="zb-h1", microbatches=8
)
ROUND_ROBIN = dict(cluster="2x4xV100-16GB", stages=2, replication="round-robin", microbatches=8)


def _pipeline(plan_options: str, schedule: str) -> str:
    return f"tensor-parallel,annotate-cost,coarsen,plan{{{plan_options}}},{schedule},lower-comm,insert-frees,verify"


def _taken(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The hand-overs the passes take (or not) from here on, in order."""
    taken: list[str] = []
    for name in ("scheduled", "lowered", "freed"):
        method = getattr(scale.TrialLowering, name)

        def spied(self: scale.TrialLowering, *args: object, _method: Callable[..., object] = method) -> object:
            found = _method(self, *args)
            taken.append(_method.__name__ if found is not None else f"not {_method.__name__}")
            return found

        monkeypatch.setattr(scale.TrialLowering, name, spied)
    return taken


def _kept_trials(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Module, dict[str, object]]]:
    """Each trial `plan` lowers from here on, with its notes."""
    trials: list[tuple[Module, dict[str, object]]] = []
    lowered_trial = plan.lowered_trial

    def kept(*args: object) -> tuple[Module, dict[str, object]]:
        trials.append(lowered_trial(*args))  # type: ignore[arg-type]
        return trials[-1]

    monkeypatch.setattr(plan, "lowered_trial", kept)
    return trials


def _compiled_both_ways(monkeypatch: pytest.MonkeyPatch, **options: object) -> tuple[str, str]:
    """The printed plan compiled with the trial's lowering handed on, and without."""
    fast = api.compile(GPT, global_batch=64, **options)  # type: ignore[arg-type]
    with monkeypatch.context() as patched:
        patched.setattr(plan, "hand_over", lambda _trial: scale.hand_over(None))
        again = api.compile(GPT, global_batch=64, **options)  # type: ignore[arg-type]
    return print_module(fast.module), print_module(again.module)


@pytest.mark.parametrize("name", ["uneven split, zb-h1", "tensor groups, round-robin, recompute", "interleaved"])
def test_schedule_and_shapes_handed_on_give_the_plan_lowered_again(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Uneven split replicas have shapes of their own (each its peak), tensor groups share theirs, interleaved
    stages share devices: the plan lowered from the trial's schedule and shapes is the plan lowered afresh."""
    taken = _taken(monkeypatch)
    fast, again = _compiled_both_ways(monkeypatch, **PLANS[name])
    assert taken == ["scheduled", "lowered", "freed"]
    assert fast == again
    module = parse_module(fast)
    for program in module.programs:  # each peak that of the program's own shape, walked alone
        alone = program_peak(module, program, Sizes(module), program_shape(module, program))
        assert program.attrs.peak_bytes == alone.total, program.name


@pytest.mark.parametrize(
    ("plan_options", "schedule"),
    [
        ("stages=2,replication=round-robin,microbatches=8,schedule=1f1b", "schedule{kind=gpipe}"),
        ("stages=2,replication=round-robin,microbatches=8", "schedule{microbatches=16}"),
    ],
)
def test_a_schedule_asked_for_another_order_is_made_afresh(
    plan_options: str, schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `schedule` pass asked for another kind or microbatch count than the plan's takes nothing of the trial: its
    programs are those made without a hand-over."""
    taken = _taken(monkeypatch)
    options = dict(cluster=ROUND_ROBIN["cluster"], pipeline=_pipeline(plan_options, schedule))
    fast, again = _compiled_both_ways(monkeypatch, **options)
    assert taken[:2] == ["not scheduled", "not lowered"]
    assert fast == again


def test_a_trial_counts_no_peaks_and_notes_its_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trial `plan` simulates has no peaks (nothing reads them: the simulator walks memory itself), and notes a
    shape for each program for `insert-frees` to count the plan's peaks by; the plan has every peak."""
    trials = _kept_trials(monkeypatch)
    module = api.compile(GPT, global_batch=64, **ROUND_ROBIN).module  # type: ignore[arg-type]
    assert trials
    for trial, notes in trials:
        assert trial.programs and all(p.attrs.peak_bytes is None for p in trial.programs)
        shapes = notes["shapes"]
        assert isinstance(shapes, list) and len(shapes) == len(trial.programs)
        assert not scale.is_trial(trial)
    assert all(p.attrs.peak_bytes for p in module.programs)


@pytest.mark.parametrize("options", [PLANS["uneven split, zb-h1"], ZB_TENSOR_GROUPS])
def test_a_trial_simulated_by_its_notes_is_the_trial_simulated_alone(
    options: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The simulator walks each program's memory by the shape the trial's `insert-frees` noted, and finds the
    gradients sent on the programs that are no tensor-group member `lower-comm` lowered from its lead (`plan` hands
    both to `predict`): uneven split replicas each of a shape of their own, zero-bubble tensor groups whose input
    passes' share depends on the gradients sent; the prediction of all worked out afresh."""
    trials = _kept_trials(monkeypatch)
    api.compile(GPT, global_batch=64, **options)  # type: ignore[arg-type]
    cluster = resolve_cluster(str(options["cluster"]))
    assert trials
    for trial, notes in trials:
        shapes, leads = notes["shapes"], notes["leads"]
        assert isinstance(shapes, list) and isinstance(leads, dict)
        assert bool(leads) is ("tensor_parallel" in options)
        prices = OpPrices(trial, cluster)
        alone = simulator.predict(trial, cluster=cluster, prices=prices)
        assert simulator.predict(trial, cluster=cluster, prices=prices, shapes=shapes, leads=leads) == alone


def test_noted_lowerings_are_refused_where_the_programs_are_not_the_trials(monkeypatch: pytest.MonkeyPatch) -> None:
    """`lowered` and `freed` compare the programs with what the trial's passes noted: the trial's compute
    instructions, then its communication; an instruction alike but not the trial's own, or another, is refused."""
    handed: list[scale.TrialLowering] = []

    def kept(trial: scale.TrialLowering | None) -> None:
        assert trial is not None and {"schedule", "lowered", "shapes"} <= set(trial.notes)
        handed.append(trial)
        scale.hand_over(trial)

    monkeypatch.setattr(plan, "hand_over", kept)
    module = api.compile(GPT, global_batch=64, **ROUND_ROBIN).module  # type: ignore[arg-type]
    (trial,) = handed
    compute, lowered = trial.notes["schedule"][1], trial.notes["lowered"]  # type: ignore[index]
    assert isinstance(lowered, list)
    for program, instrs in zip(module.programs, compute, strict=True):
        program.instrs = list(instrs)
    assert trial.lowered(module) == lowered
    program = module.programs[-1]
    program.instrs[0] = dataclasses.replace(program.instrs[0], mb=(program.instrs[0].mb or 0) + 1)
    assert trial.lowered(module) is None
    program.instrs[0] = dataclasses.replace(compute[-1][0])  # alike, compared field by field
    assert trial.lowered(module) == lowered
    for program, instrs in zip(module.programs, lowered, strict=True):
        program.instrs = list(instrs)
    assert trial.freed(module) is not None
    program.instrs[0] = dataclasses.replace(program.instrs[0])  # alike, but not the trial's own
    assert trial.freed(module) is None


@pytest.mark.parametrize("lowered_as_given", [True, False])
def test_a_trials_members_take_their_leads_frees_only_from_the_programs_lower_comm_made(lowered_as_given: bool) -> None:
    """In a trial, `insert-frees` gives each tensor-group member the frees and shape of the lead `lower-comm` noted
    for it, where the programs are the ones `lower-comm` noted: here every rank is said to be led by rank 0, which
    is wrong, so frees found for each program afresh must not be those, unless the programs are what was noted."""
    module = copy.deepcopy(api.compile(GPT, global_batch=64, **PLANS["tensor groups, split"]).module)  # type: ignore[arg-type]
    free = InstrKind.FREE
    for program in module.programs:
        program.instrs = [i for i in program.instrs if i.kind is not free]
    alone = dataclasses.replace(
        module, programs=[RankProgram(p.name, list(p.instrs), dataclasses.replace(p.attrs)) for p in module.programs]
    )
    PassManager(build_pipeline("insert-frees")).run(alone, PassContext())
    lowered = [list(p.instrs) for p in module.programs]
    if not lowered_as_given:
        lowered[-1] = [dataclasses.replace(i) for i in lowered[-1]]  # alike, not the very instructions
    with scale.noting(module) as notes:
        notes.update(leads=dict.fromkeys(range(1, len(module.programs)), 0), lowered=lowered)
        lookup_pass("insert-frees").from_options({}).apply(PassContext(), module)
    assert (_fields(module.programs) == _fields(alone.programs)) is not lowered_as_given


def test_what_a_collector_pause_made_is_old_after_it_and_its_cycles_still_freed() -> None:
    """After `collector_paused`, what the block made sits in the collector's oldest generation (its next collection
    of the young walks none of it), and a cycle made there is still freed by a full collection."""

    class Node:
        other: object = None

    with scale.collector_paused():
        kept = Node()
        cycle = Node()
        cycle.other = cycle
        freed = weakref.ref(cycle)
        del cycle
    assert gc.isenabled()
    assert not any(o is kept for o in gc.get_objects(generation=0))
    assert any(o is kept for o in gc.get_objects(generation=2))
    gc.collect()
    assert freed() is None


@pytest.mark.parametrize("name", list(PLANS))
def test_lower_comm_makes_no_frees(name: str) -> None:
    """`insert-frees` takes a trial's tensor-group member from `lower-comm` as it is, its frees to be put in: the
    lowering makes none, even of programs that have them."""
    module = copy.deepcopy(api.compile(GPT, global_batch=64, **PLANS[name]).module)  # type: ignore[arg-type]
    programs, _leads = lowering.lowered_with_leads(module)
    assert all(i.kind is not InstrKind.FREE for p in programs for i in p.instrs)
