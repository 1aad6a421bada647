"""What makes a thousand ranks compile fast gives the answers the per-rank computation gives.

Replicas of a stage, and the members of a tensor group, run programs of one shape (`peak_memory.program_shape`): the
same instructions on microbatches of their own, naming other peers and groups. Their memory (where receives are
posted, each change, the peak) is worked out once per shape and shared. Here every rank's shared answer is held
against the same rank's program walked alone (`_changes`, `_posts`, `_posted`), on small plans where sharing could
go wrong: uneven split replicas (each replica's share of a microbatch its own), the zero-bubble split, interleaved
virtual stages, tensor groups with recomputation, ZeRO-1. The garbage collector's pause is held to restore its state.
The verifier walks one program of each shape whole: a plan broken on a rank that shares its shape with one before it
fails with the message (rank, instruction, problem) of a walk over every instruction.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
from collections.abc import Callable
from functools import cache

import pytest

from dapple_ir import api
from dapple_ir.analysis import lowering, peak_memory, plan_checks
from dapple_ir.analysis.peak_memory import Sizes, posted_changes, program_peak, recv_posts
from dapple_ir.cluster.toml_file import resolve_cluster
from dapple_ir.errors import VerifyError
from dapple_ir.ir import COMPUTE_KINDS, Instr, InstrKind, Module, RankProgram, scale, verifier
from dapple_ir.ir.printer import print_module
from dapple_ir.ir.scale import collector_paused
from dapple_ir.ir.verifier import verify_module
from dapple_ir.passes import insert_frees, plan
from dapple_ir.pricing.ops import OpPrices
from dapple_ir.sim import simulator
from tests.paths import ROOT

GPT = str(ROOT / "examples" / "gpt.py") + ":factory"

PLANS: dict[str, dict[str, object]] = {
    "uneven split, zb-h1": dict(
        cluster="1x8xA100-80GB", stages=2, data_parallel=3, replication="split", schedule="zb-h1", microbatches=4
    ),
    "round-robin, recompute": dict(
        cluster="2x4xV100-16GB", stages=2, replication="round-robin", recompute="all", microbatches=8
    ),
    "interleaved": dict(cluster="1x8xA100-80GB", stages=4, schedule="interleaved", virtual=2, microbatches=8),
    "tensor groups, round-robin, recompute": dict(
        cluster="2x8xA100-80GB",
        stages=2,
        tensor_parallel=2,
        data_parallel=4,
        replication="round-robin",
        recompute="all",
        microbatches=16,
    ),
    "tensor groups, split": dict(
        cluster="2x8xA100-80GB", stages=2, tensor_parallel=4, data_parallel=2, replication="split", microbatches=8
    ),
    "zero": dict(cluster="1x8xA100-80GB", stages=2, zero="all", microbatches=8),
    "interleaved, recompute": dict(
        cluster="1x8xA100-80GB", stages=4, schedule="interleaved", virtual=2, recompute="all", microbatches=8
    ),
}


@cache
def _compiled(name: str) -> Module:
    return api.compile(GPT, global_batch=64, **PLANS[name]).module  # type: ignore[arg-type]


def _walked_alone(module: Module, program: RankProgram) -> tuple[dict[int, int], list[tuple[int, float]], float, int]:
    """The program's posts, changes, most live bytes and where, from a walk of it alone (nothing shared)."""
    sizes = Sizes(module)
    base = peak_memory._changes(module, program, sizes)
    posts = peak_memory._posts(program, sizes, base, None)
    changes = peak_memory._posted(base, posts)
    total, live, where = 0.0, 0.0, -1
    for index, change in changes:
        total += change
        if total > live:
            live, where = total, index
    return posts, changes, live, where


@pytest.mark.parametrize("name", list(PLANS))
def test_each_ranks_shared_memory_equals_its_own_walk(name: str) -> None:
    module = _compiled(name)
    shared = Sizes(module)
    for program in module.programs:
        posts, changes, live, where = _walked_alone(module, program)
        assert posted_changes(module, program, shared) == (posts, changes), program.name
        assert recv_posts(module, program, shared) == posts
        peak = program_peak(module, program, shared)
        assert (peak.live_bytes, peak.index) == (live, where), program.name
        assert program.attrs.peak_bytes == peak.total
    if not any(s.split for s in module.stages):  # replicas of a split stage may each hold a share of their own
        assert len(shared.shapes) < len(module.programs)


def test_split_replicas_of_uneven_shares_are_shapes_of_their_own() -> None:
    module = _compiled("uneven split, zb-h1")
    stage = module.stages[0]
    b = module.attrs.microbatch_size or 0
    assert stage.split and len({stage.rows(j, b)[1] - stage.rows(j, b)[0] for j in range(stage.replicas)}) > 1
    keys = {peak_memory.program_shape(module, p) for p in module.programs if p.attrs.stages == (stage.name,)}
    assert len(keys) == stage.replicas


def test_a_shape_ignores_peers_and_names_of_microbatches_but_not_their_pairing() -> None:
    module = _compiled("round-robin, recompute")
    program = module.programs[0]
    key = peak_memory.program_shape(module, program)
    moved = [dataclasses.replace(i, peer=None if i.peer is None else i.peer + 100) for i in program.instrs]
    assert peak_memory.program_shape(module, dataclasses.replace(program, instrs=moved)) == key
    renamed = [dataclasses.replace(i, mb=None if i.mb is None else 1000 - i.mb) for i in program.instrs]
    assert peak_memory.program_shape(module, dataclasses.replace(program, instrs=renamed)) == key
    # The first free of a stage's activations released for another microbatch: another shape.
    index = next(k for k, i in enumerate(program.instrs) if i.kind is InstrKind.FREE and i.stage is not None)
    other = next(i.mb for i in program.instrs if i.mb is not None and i.mb != program.instrs[index].mb)
    swapped = list(program.instrs)
    swapped[index] = dataclasses.replace(swapped[index], mb=other)
    assert peak_memory.program_shape(module, dataclasses.replace(program, instrs=swapped)) != key


def test_the_collector_pause_restores_the_collectors_state() -> None:
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        assert not gc.isenabled()
        raise RuntimeError
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


# ------------------------------------------------------------------ the verifier, once per program shape


def _first_problem_walked_whole(module: Module) -> str | None:
    """The verifier's first instruction problem, from every instruction of every rank (no shapes shared)."""
    checker = verifier._Verifier(module)
    n = len(module.programs)
    for rank, program in enumerate(module.programs):
        for index, instr in enumerate(program.instrs):
            problem = checker.instr_problem(instr, rank, n)
            if problem:
                return f"verify: {program.name}, instruction {index}: {problem}"
    return None


def _broken(name: str, kind: InstrKind, change: Callable[[Instr, int], Instr]) -> Module:
    """Plan `name` with `change` (given the instruction and its rank) made to the last rank's first `kind`: a
    program that shares its shape with a rank before it."""
    module = copy.deepcopy(_compiled(name))
    rank = max(r for r, p in enumerate(module.programs) if any(i.kind is kind for i in p.instrs))
    instrs = module.programs[rank].instrs
    index = next(k for k, i in enumerate(instrs) if i.kind is kind)
    instrs[index] = change(instrs[index], rank)
    return module


BREAKS: dict[str, tuple[str, InstrKind, Callable[[Instr, int], Instr]]] = {
    "tensor group without the rank": (
        "tensor groups, round-robin, recompute",
        InstrKind.TENSOR_ALLREDUCE,
        lambda i, r: dataclasses.replace(i, group=tuple(g for g in i.group or () if g != r)),
    ),
    "tensor group past the last rank": (
        "tensor groups, split",
        InstrKind.TENSOR_ALLREDUCE,
        lambda i, r: dataclasses.replace(i, group=(*(i.group or ()), 99)),
    ),
    "send to itself": ("round-robin, recompute", InstrKind.SEND, lambda i, r: dataclasses.replace(i, peer=r)),
    "microbatch out of range": ("interleaved", InstrKind.FORWARD, lambda i, r: dataclasses.replace(i, mb=8)),
    "receive without a peer": ("uneven split, zb-h1", InstrKind.RECV, lambda i, r: dataclasses.replace(i, peer=None)),
    "allreduce without the rank": (
        "round-robin, recompute",
        InstrKind.ALLREDUCE,
        lambda i, r: dataclasses.replace(i, group=tuple(g for g in i.group or () if g != r)),
    ),
    "sharded group of the wrong size": (
        "zero",
        InstrKind.REDUCE_SCATTER,
        lambda i, r: dataclasses.replace(i, group=(r,)),
    ),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_the_verifier_passes_each_plan_walked_whole_or_by_shape(name: str) -> None:
    module = _compiled(name)
    assert _first_problem_walked_whole(module) is None
    verify_module(module)


@pytest.mark.parametrize("what", list(BREAKS))
def test_a_broken_rank_sharing_a_shape_fails_as_walked_whole(what: str) -> None:
    module = _broken(*BREAKS[what])
    expected = _first_problem_walked_whole(module)
    assert expected is not None
    with pytest.raises(VerifyError) as info:
        verify_module(module)
    assert str(info.value).splitlines()[0] == expected


@pytest.mark.parametrize("name", ["round-robin, recompute", "tensor groups, split"])
def test_frees_checked_once_per_shape_still_name_the_rank_that_breaks(name: str) -> None:
    module = copy.deepcopy(_compiled(name))
    rank = len(module.programs) - 1
    instrs = module.programs[rank].instrs
    instrs.pop(max(k for k, i in enumerate(instrs) if i.kind is InstrKind.FREE))
    with pytest.raises(VerifyError, match=f"verify: rank {rank} never frees"):
        plan_checks.check_frees(module)
    plan_checks.check_frees(_compiled(name))


# ------------------------------------------------------------------ the lowering, made once for many ranks


def _fields(programs: list[RankProgram]) -> list[list[tuple[object, ...]]]:
    return [
        [(i.kind, i.stage, i.value, i.grad, i.mb, i.peer, i.rows, i.group, i.param) for i in p.instrs] for p in programs
    ]


@pytest.mark.parametrize("name", list(PLANS))
def test_each_ranks_shared_lowering_equals_its_own(name: str) -> None:
    """`lower-comm` makes a tensor group's sums once for all its members, `insert-frees` finds the frees once for the
    programs alike but for peers, `schedule` makes a shared order's instructions once: each rank lowered alone, by a
    lowering and free points of its own, gets the same instructions."""
    module = _compiled(name)
    free = InstrKind.FREE
    readers: dict[object, list[object]] = {}
    for stage in module.stages:
        for v in {v for op in stage.ops for v in op.operands}:
            readers.setdefault(v, []).append(stage)
    definers = {op: s for s in module.stages for op in s.ops}
    computes = [
        RankProgram(p.name, [dataclasses.replace(i) for i in p.instrs if i.kind in COMPUTE_KINDS], p.attrs)
        for p in module.programs
    ]
    scheduled = dataclasses.replace(module, programs=computes)
    alone = []
    for rank, program in enumerate(module.programs):
        lowered = lowering._Lowering(scheduled).lower(rank, computes[rank])
        lowered_program = RankProgram(program.name, [i for i in lowered if i.kind is not free], program.attrs)
        freed, _ = insert_frees._with_frees(lowered_program, readers, definers, {})  # type: ignore[arg-type]
        alone.append(RankProgram(program.name, freed, program.attrs))
    assert _fields(module.programs) == _fields(alone)
    if any(s.tp > 1 for s in module.stages):  # the members share their sums' very instructions
        reduces = [i for p in module.programs for i in p.instrs if i.kind is InstrKind.TENSOR_ALLREDUCE]
        assert len({id(i) for i in reduces}) < len(reduces)


@pytest.mark.parametrize("name", ["round-robin, recompute", "interleaved, recompute", "tensor groups, split", "zero"])
def test_the_lowering_plan_hands_on_gives_the_plan_lowered_again(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`plan` hands the lowering it simulated to `lower-comm` and `insert-frees`, which take it: the plan is the one
    lowered again by those passes, printed and in plan.json alike."""
    taken: list[str] = []
    lowered, freed = scale.TrialLowering.lowered, scale.TrialLowering.freed

    def spy(method: Callable[..., object], what: str) -> Callable[..., object]:
        def spied(self: scale.TrialLowering, module: Module) -> object:
            found = method(self, module)
            taken.append(what if found is not None else f"not {what}")
            return found

        return spied

    monkeypatch.setattr(scale.TrialLowering, "lowered", spy(lowered, "lowered"))
    monkeypatch.setattr(scale.TrialLowering, "freed", spy(freed, "freed"))
    fast = api.compile(GPT, global_batch=64, **PLANS[name])  # type: ignore[arg-type]
    assert taken == ["lowered", "freed"]
    monkeypatch.setattr(plan, "hand_over", lambda _trial: scale.hand_over(None))
    again = api.compile(GPT, global_batch=64, **PLANS[name])  # type: ignore[arg-type]
    assert taken == ["lowered", "freed"]
    assert print_module(fast.module) == print_module(again.module)
    assert fast.plan == again.plan


def test_a_handed_lowering_is_refused_where_the_programs_are_not_its_own() -> None:
    module = copy.deepcopy(_compiled("round-robin, recompute"))
    final = [RankProgram(p.name, list(p.instrs), dataclasses.replace(p.attrs)) for p in module.programs]
    graph = (list(module.ops), list(module.params))
    trial = scale.TrialLowering(module, module.stages, module.attrs.microbatch_size, final, graph)
    free = InstrKind.FREE
    for p in module.programs:
        p.instrs = [i for i in p.instrs if i.kind in COMPUTE_KINDS]
    assert trial.lowered(module) is not None
    module.ops = [copy.copy(op) if k == 0 else op for k, op in enumerate(module.ops)]  # another graph
    assert trial.lowered(module) is None
    module.ops = graph[0]
    instrs = module.programs[1].instrs
    instrs[0] = dataclasses.replace(instrs[0], mb=(instrs[0].mb or 0) + 1)
    assert trial.lowered(module) is None
    for p, q in zip(module.programs, final, strict=True):
        p.instrs = [i for i in q.instrs if i.kind is not free]
    assert trial.freed(module) is not None
    module.programs[0].instrs = [dataclasses.replace(i) for i in module.programs[0].instrs]  # alike, but not the same
    assert trial.freed(module) is None
    assert trial.freed(copy.deepcopy(module)) is None


@pytest.mark.parametrize("name", list(PLANS))
def test_the_planners_prediction_is_the_simulations_iteration_and_peak(name: str) -> None:
    """`simulator.predict` (what `plan` ranks by: the run without the timeline's curves and the critical path, each
    program shape's peak walked once) gives `simulate`'s iteration and worst peak, to the bit."""
    module = _compiled(name)
    cluster = resolve_cluster(PLANS[name]["cluster"])  # type: ignore[arg-type]
    prices = OpPrices(module, cluster)
    result = simulator.simulate(module, cluster=cluster, prices=prices)
    assert simulator.predict(module, cluster=cluster, prices=prices) == (result.iteration_s, max(result.peak_bytes))


def _step_problem_walked_whole(module: Module) -> str | None:
    """`plan_checks.check_optimizer_steps`'s first problem, from lists of every step and every computation."""
    for program in module.programs:
        steps = [k for k, i in enumerate(program.instrs) if i.kind is InstrKind.OPTIMIZER_STEP]
        computes = [k for k, i in enumerate(program.instrs) if i.kind in COMPUTE_KINDS]
        if not computes:
            continue
        if len(steps) != 1:
            return f"verify: rank {program.rank} ({program.name}) has {len(steps)} optimizer steps"
        if steps[0] < computes[-1]:
            return f"verify: {plan_checks._where(module, program, steps[0])} comes before the rank's last computation"
    return None


@pytest.mark.parametrize("move", ["twice", "early", "none"])
def test_optimizer_steps_found_from_the_end_fail_as_walked_whole(move: str) -> None:
    module = copy.deepcopy(_compiled("tensor groups, round-robin, recompute"))
    instrs = module.programs[-1].instrs
    step = next(k for k, i in enumerate(instrs) if i.kind is InstrKind.OPTIMIZER_STEP)
    if move == "twice":
        instrs.append(instrs[step])
    elif move == "early":
        instrs.insert(1, instrs.pop(step))
    else:
        instrs.pop(step)
    expected = _step_problem_walked_whole(module)
    assert expected is not None
    with pytest.raises(VerifyError) as info:
        plan_checks.check_optimizer_steps(module)
    assert str(info.value).startswith(expected)
    plan_checks.check_optimizer_steps(_compiled("tensor groups, round-robin, recompute"))
