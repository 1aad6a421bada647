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
from dapple_ir.analysis.plan_checks import check_compute_order, check_memory, find_deadlock, run_plan_checks
from dapple_ir.cluster.toml_file import resolve_cluster
from dapple_ir.errors import VerifyError
from dapple_ir.ir import COMPUTE_KINDS, InstrKind, Module, RankProgram
from dapple_ir.ir.printer import Namer, format_instr
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


BREAKS: dict[str, Callable[[Module], None]] = {
    "as compiled": lambda _m: None,
    "a member runs a backward before its forward": _swap_first_backward_and_forward,
    "a member misses a backward": _drop_last_backward,
    "a member misses a microbatch": _drop_a_microbatch,
    "a member claims another replica": _claim_another_replica,
    "two members trade tensor ranks": _swap_tensor_ranks,
}


@pytest.mark.parametrize("name", list(BREAKS))
def test_compute_order_agrees_with_a_walk_over_every_instruction(name: str) -> None:
    module = copy.deepcopy(_compiled())
    BREAKS[name](module)
    expected = _order_walked_whole(module)
    if expected is None:
        check_compute_order(module)
        return
    with pytest.raises(VerifyError) as caught:
        check_compute_order(module)
    assert str(caught.value).startswith(expected)


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
    meeting = _meeting(module)
    assert meeting is not None and {module.programs[r].attrs.tensor_rank or 0 for r in meeting} == {0}
    run_plan_checks(module, None, meeting)
    program = _member(module)
    index = next(i for i, instr in enumerate(program.instrs) if instr.kind is InstrKind.RECV)
    program.instrs = list(program.instrs)
    program.instrs[index] = dataclasses.replace(program.instrs[index], mb=99)
    meeting = _meeting(module)
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
