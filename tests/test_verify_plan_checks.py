"""The plan checks on a tensor-parallel plan, where the members of a group share their computations and
`check_compute_order` checks each shared sequence once: the same verdict, to the message, as a walk over every
instruction of every rank, on the plan as compiled and on members broken one way or another."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from functools import cache

import pytest

from dapple_ir import api
from dapple_ir.analysis.peak_memory import Sizes, program_peak, program_shape
from dapple_ir.analysis.plan_checks import (
    check_compute_order,
    check_memory,
    check_optimizer_steps,
    find_deadlock,
    run_plan_checks,
)
from dapple_ir.cluster.toml_file import resolve_cluster
from dapple_ir.errors import VerifyError
from dapple_ir.ir import COMPUTE_KINDS, InstrKind, Module, RankProgram
from dapple_ir.ir.printer import Namer, format_instr
from dapple_ir.ir.scale import held_alike
from dapple_ir.passes.verify import _meeting
from tests.paths import ROOT

MEGATRON = str(ROOT / "examples" / "megatron_gpt.py") + ":factory_tiny"


@cache
def _compiled() -> Module:
    forced = dict(
        stages=4, virtual=2, schedule="interleaved", microbatches=8, tensor_parallel=2, data_parallel=2,
        recompute="all", replication="round-robin", precision="fp16",
    )  # fmt: skip
    return api.compile(MEGATRON, cluster="2x4xA100-80GB", global_batch=16, **forced).module  # type: ignore[arg-type]


def _order_walked_whole(module: Module) -> str | None:
    """`check_compute_order`'s first problem, every computation of every rank looked at."""
    owner = {
        (name, p.attrs.replica or 0, p.attrs.tensor_rank or 0): index
        for index, p in enumerate(module.programs)
        for name in p.attrs.stages or ()
    }
    need = {
        InstrKind.FORWARD: [],
        InstrKind.BACKWARD: [InstrKind.FORWARD],
        InstrKind.BACKWARD_INPUT: [InstrKind.FORWARD],
        InstrKind.BACKWARD_WEIGHT: [InstrKind.FORWARD, InstrKind.BACKWARD_INPUT],
    }
    done: dict[tuple[object, ...], list[InstrKind]] = {}
    namer = Namer(module.ops)
    for index, program in enumerate(module.programs):
        k = program.attrs.tensor_rank or 0
        for i, instr in enumerate(program.instrs):
            if instr.kind not in COMPUTE_KINDS or instr.stage is None or instr.mb is None:
                continue
            stage, mb = instr.stage, instr.mb
            replica = (program.attrs.replica or 0) if stage.split else mb % stage.replicas
            where = f"verify: rank {program.rank} instruction {i} `{format_instr(instr, namer)}`"
            if owner.get((stage.name, replica, k)) != index:
                expected = owner.get((stage.name, replica, k))
                return (
                    f"{where}: microbatch {mb} of @{stage.name} belongs to replica {replica}, which is rank {expected}"
                )
            before = done.setdefault((stage, mb, replica, k), [])
            if before != need[instr.kind]:
                return where
            before.append(instr.kind)
    for stage in module.stages:
        for mb in range(module.attrs.microbatches or 0):
            for k in range(stage.tp):
                got = done.get((stage, mb, mb % stage.replicas, k), [])
                if got != [InstrKind.FORWARD, InstrKind.BACKWARD]:
                    member = f" tensor rank {k}" if stage.tp > 1 else ""
                    return f"verify: @{stage.name}{member} mb={mb} runs"
    return None


def _member(module: Module) -> RankProgram:
    """The last rank of tensor rank 1: its computations are its lead's very instructions."""
    return [p for p in module.programs if p.attrs.tensor_rank == 1][-1]


def _swap_first_backward_and_forward(module: Module) -> None:
    program = _member(module)
    instrs = program.instrs = list(program.instrs)
    b = next(i for i, instr in enumerate(instrs) if instr.kind is InstrKind.BACKWARD)
    f = max(i for i in range(b) if instrs[i].kind is InstrKind.FORWARD and instrs[i].mb == instrs[b].mb)
    instrs[f], instrs[b] = instrs[b], instrs[f]


def _drop_last_backward(module: Module) -> None:
    program = _member(module)
    b = max(i for i, instr in enumerate(program.instrs) if instr.kind is InstrKind.BACKWARD)
    program.instrs = program.instrs[:b] + program.instrs[b + 1 :]


def _drop_a_microbatch(module: Module) -> None:
    """The member runs neither the forward nor the backward of its last microbatch: every run it has is complete."""
    program = _member(module)
    mb = max(instr.mb for instr in program.instrs if instr.kind is InstrKind.FORWARD and instr.mb is not None)
    program.instrs = [i for i in program.instrs if not (i.kind in COMPUTE_KINDS and i.mb == mb)]


def _claim_another_replica(module: Module) -> None:
    """The member says it is replica 1 of its stages while running replica 0's microbatches: its shape is its lead's
    only where the replica is not part of it."""
    program = _member(module)
    program.attrs = dataclasses.replace(program.attrs, replica=1 - (program.attrs.replica or 0))


def _swap_tensor_ranks(module: Module) -> None:
    """Two members of one group trade tensor ranks: each runs what it ran, but owns the other's work."""
    member = _member(module)
    lead = next(
        p for p in module.programs if p.attrs.stages == member.attrs.stages and p.attrs.replica == member.attrs.replica
    )
    lead.attrs, member.attrs = (
        dataclasses.replace(lead.attrs, tensor_rank=1),
        dataclasses.replace(member.attrs, tensor_rank=None),
    )


def _last_backward_made_a_send(module: Module) -> None:
    """The member holds a send where its lead holds its last backward: a place of its own where only the lead
    computes."""
    program = _member(module)
    instrs = program.instrs = list(program.instrs)
    last = max(i for i, instr in enumerate(instrs) if instr.kind is InstrKind.BACKWARD)
    instrs[last] = dataclasses.replace(instrs[last], kind=InstrKind.SEND)


def _send_made_a_second_backward(module: Module) -> None:
    """The member holds a copy of its last backward where its lead holds a send: a place of its own where only the
    member computes."""
    program = _member(module)
    instrs = program.instrs = list(program.instrs)
    last = max(i for i, instr in enumerate(instrs) if instr.kind is InstrKind.BACKWARD)
    send = next(i for i, instr in enumerate(instrs) if instr.kind is InstrKind.SEND)
    instrs[send] = dataclasses.replace(instrs[last])


BREAKS: dict[str, Callable[[Module], None]] = {
    "as compiled": lambda _m: None,
    "a member runs a backward before its forward": _swap_first_backward_and_forward,
    "a member misses a backward": _drop_last_backward,
    "a member misses a microbatch": _drop_a_microbatch,
    "a member claims another replica": _claim_another_replica,
    "two members trade tensor ranks": _swap_tensor_ranks,
    "a member holds a send where its lead computes": _last_backward_made_a_send,
    "a member computes where its lead sends": _send_made_a_second_backward,
}


@pytest.mark.parametrize("held", [False, True], ids=["alone", "held alike"])
@pytest.mark.parametrize("name", list(BREAKS))
def test_compute_order_agrees_with_a_walk_over_every_instruction(name: str, held: bool) -> None:
    """Also given what each member holds of its lead's (`held_alike`, as `run_plan_checks` gives it)."""
    module = copy.deepcopy(_compiled())
    BREAKS[name](module)
    given = held_alike(module.programs) if held else None
    expected = _order_walked_whole(module)
    if expected is None:
        check_compute_order(module, given)
        return
    with pytest.raises(VerifyError) as caught:
        check_compute_order(module, given)
    assert str(caught.value).startswith(expected)


def _step_before_last_computation(module: Module) -> None:
    program = _member(module)
    instrs = program.instrs = list(program.instrs)
    step = next(i for i, instr in enumerate(instrs) if instr.kind is InstrKind.OPTIMIZER_STEP)
    last = max(i for i, instr in enumerate(instrs) if instr.kind in COMPUTE_KINDS)
    instrs.insert(last, instrs.pop(step))


def _second_step(module: Module) -> None:
    """The member holds its step again where its lead holds a send."""
    program = _member(module)
    instrs = program.instrs = list(program.instrs)
    send = next(i for i, instr in enumerate(instrs) if instr.kind is InstrKind.SEND)
    instrs[send] = next(i for i in instrs if i.kind is InstrKind.OPTIMIZER_STEP)


def _compute_after_an_early_step(module: Module) -> None:
    """Lead and member take their (shared) step right after their last computation, and the member computes again
    where its lead sends or reduces after that."""
    member = _member(module)
    held = held_alike(module.programs)[module.programs.index(member)]
    assert held is not None
    lead = module.programs[held[0]]
    for program in (lead, member):
        instrs = program.instrs = list(program.instrs)
        step = instrs.pop(next(i for i, instr in enumerate(instrs) if instr.kind is InstrKind.OPTIMIZER_STEP))
        instrs.insert(max(i for i, instr in enumerate(instrs) if instr.kind in COMPUTE_KINDS) + 1, step)
    at = next(i for i, instr in enumerate(member.instrs) if instr.kind is InstrKind.OPTIMIZER_STEP)
    own = next(i for i in range(at + 1, len(member.instrs)) if member.instrs[i] is not lead.instrs[i])
    member.instrs[own] = dataclasses.replace(member.instrs[at - 1])


def _last_computation_made_a_send(module: Module) -> None:
    """The member's last computation becomes a send: a place of its own where its lead computes."""
    program = _member(module)
    instrs = program.instrs = list(program.instrs)
    last = max(i for i, instr in enumerate(instrs) if instr.kind in COMPUTE_KINDS)
    instrs[last] = dataclasses.replace(instrs[last], kind=InstrKind.SEND)


@pytest.mark.parametrize(
    "change", [_step_before_last_computation, _second_step, _last_computation_made_a_send, _compute_after_an_early_step]
)
def test_a_members_optimizer_step_is_checked_where_it_differs_from_its_leads(change: Callable[[Module], None]) -> None:
    """`check_optimizer_steps` given `held_alike` says what it says without, naming the member."""
    module = copy.deepcopy(_compiled())
    change(module)
    messages = []
    for given in (held_alike(module.programs), None):
        try:
            check_optimizer_steps(module, given)
            messages.append("passes")
        except VerifyError as exc:
            messages.append(str(exc))
    assert messages[0] == messages[1]
    if change is not _last_computation_made_a_send:
        assert f"rank {_member(module).rank}" in messages[0]


def test_a_member_whose_receive_never_comes_deadlocks() -> None:
    module = copy.deepcopy(_compiled())
    program = _member(module)
    index = next(i for i, instr in enumerate(program.instrs) if instr.kind is InstrKind.RECV)
    program.instrs = list(program.instrs)
    program.instrs[index] = dataclasses.replace(program.instrs[index], mb=99)
    problem = find_deadlock(module.programs, module)
    assert problem is not None and f"rank {program.rank} instruction {index}" in problem
    assert find_deadlock(_compiled().programs, _compiled()) is None


def test_the_deadlock_check_runs_one_plane_and_finds_a_broken_copy() -> None:
    """The verify pass runs the deadlock check on one part of each set of copies (`sim.parts.meeting_parts`): one
    tensor rank's plane here. A member of the other plane whose receive never comes makes its plane no copy, and the
    check finds it, naming the instruction the check over every rank names."""
    module = copy.deepcopy(_compiled())
    meeting = _meeting(module, held_alike(module.programs))
    assert meeting is not None and {module.programs[r].attrs.tensor_rank or 0 for r in meeting} == {0}
    run_plan_checks(module, None, meeting)
    program = _member(module)
    index = next(i for i, instr in enumerate(program.instrs) if instr.kind is InstrKind.RECV)
    program.instrs = list(program.instrs)
    program.instrs[index] = dataclasses.replace(program.instrs[index], mb=99)
    meeting = _meeting(module, held_alike(module.programs))
    assert meeting is not None and program.rank in meeting
    with pytest.raises(VerifyError) as caught:
        run_plan_checks(module, None, meeting)
    assert str(caught.value) == f"verify: the programs deadlock: {find_deadlock(module.programs, module)}"


def test_memory_is_checked_once_per_shape_and_a_member_that_holds_more_is_found() -> None:
    """`check_memory` with the programs' shapes (as `run_plan_checks` passes them) says what it says without: a
    member that never frees one activation (a shape of its own) is the one rank over a capacity between the two."""
    module = copy.deepcopy(_compiled())
    cluster = resolve_cluster("2x4xA100-80GB")
    sizes = Sizes(module)
    peak = max(program_peak(module, p, sizes).total for p in module.programs)
    program = _member(module)
    index = next(i for i, instr in enumerate(program.instrs) if instr.kind is InstrKind.FREE and instr.stage)
    program.instrs = program.instrs[:index] + program.instrs[index + 1 :]
    worst = program_peak(module, program, Sizes(module)).total
    assert worst > peak
    shapes = [program_shape(module, p) for p in module.programs]
    for capacity in (peak, (peak + worst) / 2, peak / 2):
        kinds = tuple(dataclasses.replace(kind, memory_bytes=capacity) for kind in cluster.node_kinds)
        small = dataclasses.replace(cluster, node_kinds=kinds)
        messages = []
        for given in (shapes, None):
            try:
                check_memory(module, small, given)
                messages.append("fits")
            except VerifyError as exc:
                messages.append(str(exc))
        assert messages[0] == messages[1]
        if capacity == (peak + worst) / 2:
            assert f"rank {program.rank} on device" in messages[0]
