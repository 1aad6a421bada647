"""The simulator's independent parts (`dapple_ir.sim.parts`): a tensor-parallel plan's member planes found as parts,
the copies among them simulated once by `predict`, and `predict` equal to the whole simulation to the bit; a part
that differs from its look-alike in a link, a cost or an instruction is simulated on its own."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from functools import cache

import pytest

from dapple_ir import api
from dapple_ir.cluster.spec import ClusterSpec
from dapple_ir.cluster.toml_file import resolve_cluster
from dapple_ir.ir import InstrKind, Module, RankProgram
from dapple_ir.pricing.ops import OpPrices
from dapple_ir.sim import simulator
from dapple_ir.sim.simulator import BACKWARD_INPUT_FRACTION, predict, simulate
from tests.paths import ROOT

MEGATRON = str(ROOT / "examples" / "megatron_gpt.py") + ":factory_tiny"

#: Megatron's configurations on the tiny model: (cluster, compile keywords). T = 2 and 4, with data parallelism and
#: interleaving, pipeline transfers inside a node (ports) and across nodes (network cards).
PLANS = {
    "T2 D2 P2 interleaved": (
        "2x4xA100-80GB",
        dict(stages=4, virtual=2, schedule="interleaved", microbatches=8, tensor_parallel=2, data_parallel=2),
    ),
    "T4 D2 P2 1f1b": (
        "4x4xA100-80GB",
        dict(stages=2, schedule="1f1b", microbatches=8, tensor_parallel=4, data_parallel=2),
    ),
    "T2 D4 P1": ("2x4xA100-80GB", dict(stages=1, schedule="1f1b", microbatches=8, tensor_parallel=2, data_parallel=4)),
}


@cache
def _compiled(name: str) -> Module:
    cluster, options = PLANS[name]
    forced = dict(recompute="all", replication="round-robin", precision="fp16", **options)
    return api.compile(MEGATRON, cluster=cluster, global_batch=16, **forced).module  # type: ignore[arg-type]


def _simulator(module: Module, cluster: ClusterSpec) -> simulator._Simulator:
    fractions = simulator._fractions(module, BACKWARD_INPUT_FRACTION)
    return simulator._Simulator(module, cluster, fractions, OpPrices(module, cluster))


def _whole(sim: simulator._Simulator) -> float:
    """The iteration of every part simulated (the reference `predict` must equal)."""
    state = sim.engine({})
    return max(max(e, default=0.0) for e in state.ends)


@pytest.mark.parametrize("name", list(PLANS))
def test_the_members_of_each_tensor_group_are_parts_and_copies_run_once(name: str) -> None:
    module = _compiled(name)
    cluster = resolve_cluster(PLANS[name][0])
    sim = _simulator(module, cluster)
    tp = module.stages[0].tp
    assert len(sim.parts) == tp  # one plane per tensor rank: each member has its own port and network card
    assert all({module.programs[r].attrs.tensor_rank or 0 for r in part} == {k} for k, part in enumerate(sim.parts))
    assert len(sim.distinct_parts()) == 1
    result = simulate(module, cluster=cluster)
    assert predict(module, cluster=cluster, prices=OpPrices(module, cluster)) == (
        result.iteration_s,
        max(result.peak_bytes),
    )
    assert sim.iteration_and_peak()[0] == _whole(sim) == result.iteration_s


def test_members_behind_one_card_share_it_and_are_one_part() -> None:
    """One network card per node: every member's inter-node transfers cross it, so no plane is on its own."""
    module = _compiled("T4 D2 P2 1f1b")
    cluster = dataclasses.replace(resolve_cluster("4x4xA100-80GB"), cards=1)
    sim = _simulator(module, cluster)
    assert len(sim.parts) == 1
    result = simulate(module, cluster=cluster)
    assert predict(module, cluster=cluster, prices=OpPrices(module, cluster))[0] == result.iteration_s


def test_a_slower_link_under_one_part_makes_it_no_copy() -> None:
    module = _compiled("T2 D2 P2 interleaved")
    cluster = resolve_cluster("2x4xA100-80GB")
    sim = _simulator(module, cluster)
    lead, other = sim.parts
    # A card link that only the second plane's transfers cross, at a ten-thousandth of its bandwidth.
    card = next(k for k in sim.route_links(other[0], _send_peer(module, other)) if sim.network.links[k].card)
    sim.bandwidth[card] /= 1e4
    assert len(sim.distinct_parts()) == 2
    ends = sim.engine({}).ends
    assert max(max(ends[r]) for r in other) > max(max(ends[r]) for r in lead)
    assert sim.iteration_and_peak()[0] == _whole(sim) > simulate(module, cluster=cluster).iteration_s


def test_a_part_whose_compute_or_instructions_differ_is_no_copy() -> None:
    module = _compiled("T2 D2 P2 interleaved")
    cluster = resolve_cluster("2x4xA100-80GB")
    sim = _simulator(module, cluster)
    rank = sim.parts[1][0]
    costs = sim.of_rank[rank]
    stage = next(iter(costs.fwd))
    costs.fwd[stage] *= 1.5  # this member alone computes slower
    assert len(sim.distinct_parts()) == 2
    assert sim.iteration_and_peak()[0] == _whole(sim)

    module = copy.deepcopy(module)
    program = module.programs[sim.parts[1][0]]
    index = next(i for i, instr in enumerate(program.instrs) if instr.kind is InstrKind.SEND)
    program.instrs[index] = dataclasses.replace(program.instrs[index], mb=(program.instrs[index].mb or 0) + 1)
    assert len(_simulator(module, cluster).distinct_parts()) == 2

    # A send to another rank of the same part, and a collective over another group of it: the same fields but a peer,
    # or a group, that is not the counterpart's.
    module = copy.deepcopy(_compiled("T2 D2 P2 interleaved"))
    part = _simulator(module, cluster).parts[1]
    program = module.programs[part[0]]
    index = next(i for i, instr in enumerate(program.instrs) if instr.kind is InstrKind.SEND)
    other = next(r for r in part if r not in (part[0], program.instrs[index].peer))
    program.instrs[index] = dataclasses.replace(program.instrs[index], peer=other)
    assert len(_simulator(module, cluster).distinct_parts()) == 2
    module = copy.deepcopy(_compiled("T2 D2 P2 interleaved"))
    program = module.programs[part[0]]
    index = next(i for i, instr in enumerate(program.instrs) if instr.kind is InstrKind.ALLREDUCE)
    assert program.instrs[index].group == (part[0], part[1])
    program.instrs[index] = dataclasses.replace(program.instrs[index], group=(part[0], part[2]))
    assert len(_simulator(module, cluster).distinct_parts()) == 2


def _send_peer(module: Module, part: list[int]) -> int:
    for rank in part:
        for instr in module.programs[rank].instrs:
            if instr.kind is InstrKind.SEND and instr.peer is not None:
                return instr.peer
    raise AssertionError("the part sends nothing")


@pytest.mark.parametrize("name", list(PLANS))
def test_each_ranks_meeting_places_are_its_own_however_asked(name: str) -> None:
    """`CopyCheck.meeting_places`, found once per rank: each rank's peers' places, then its collectives', in order."""
    from dapple_ir.sim.parts import CopyCheck

    programs = _compiled(name).programs
    check = CopyCheck(programs, lambda _r, _s: True, lambda _a, _b: (), lambda _a, _b: 0.0, lambda _i, _r: ([], 0), [])
    collectives = {InstrKind.ALLREDUCE, InstrKind.REDUCE_SCATTER, InstrKind.ALL_GATHER}
    for rank in [*reversed(range(len(programs))), *range(len(programs))]:
        instrs = programs[rank].instrs
        peers = [k for k, i in enumerate(instrs) if i.peer is not None]
        assert check.meeting_places(rank) == peers + [k for k, i in enumerate(instrs) if i.kind in collectives]
    assert all(check.meetings.places.values())


def test_a_ranks_instructions_looked_at_are_those_at_the_places_asked() -> None:
    """`CopyCheck.looked_at` keeps its last answer for a rank's next copy: asked of other places, it looks there."""
    from dapple_ir.ir import COLLECTIVE_KINDS
    from dapple_ir.sim.parts import CopyCheck

    programs = _compiled("T2 D2 P2 interleaved").programs
    check = CopyCheck(programs, lambda _r, _s: True, lambda _a, _b: (), lambda _a, _b: 0.0, lambda _i, _r: ([], 0), [])
    instrs = programs[0].instrs
    for other in ([], [0, 1], [0, 1], [2, 3], [len(instrs) - 1], []):
        looked = check.looked_at(0, other)
        assert set(looked.places) == set(other) | set(check.meeting_places(0))
        assert looked.instrs == [instrs[k] for k in looked.places]
        assert looked.fields == [(i.kind, i.stage, i.value, i.grad, i.mb, i.rows, i.param) for i in looked.instrs]
        assert looked.grouped == [j for j, i in enumerate(looked.instrs) if i.group is not None]
        assert looked.peers == [i.peer for i in looked.instrs] and looked.groups == [i.group for i in looked.instrs]
        assert looked.sent_to == {i.peer for i in looked.instrs if i.kind is InstrKind.SEND}
        assert looked.joined == [j for j, i in enumerate(looked.instrs) if i.kind in COLLECTIVE_KINDS]


def _parts_read_whole(programs: list[RankProgram]) -> list[list[int]]:
    """`independent_parts` from every instruction of every rank, a link per pair of ranks a transfer joins."""
    from dapple_ir.ir import COLLECTIVE_KINDS
    from dapple_ir.sim import parts

    parent, on_link = list(range(len(programs))), dict[int, int]()
    for rank, program in enumerate(programs):
        for peer in {i.peer for i in program.instrs} - {None}:
            assert peer is not None
            parts._link_ranks(parent, on_link, rank, (min(rank, peer) * 1000 + max(rank, peer),))
            parts._union(parent, rank, peer)
        for instr in program.instrs:
            for member in instr.group or () if instr.kind in COLLECTIVE_KINDS else ():
                parts._union(parent, rank, member)
    return parts._grouped(parent)


def _member_changes(module: Module) -> Iterator[str]:
    """The plan changed, in turn, at a member's own send, at a place it shares with its lead, and back."""
    from dapple_ir.ir.scale import HeldAlike

    alike = HeldAlike(module.programs)
    member, (lead, at) = next((k, h) for k in range(len(module.programs)) if (h := alike.find(k)) is not None)
    instrs = module.programs[member].instrs
    plane = module.programs[member].attrs.tensor_rank
    other = next(r for r, p in enumerate(module.programs) if p.attrs.tensor_rank != plane)
    shared = next(k for k in range(len(instrs)) if k not in at)
    yield "as compiled"
    for where, k, change, in_place in (
        ("own place sends to another plane", at[-1], dict(kind=InstrKind.SEND, peer=other), False),
        ("shared place sends", shared, dict(kind=InstrKind.SEND, peer=other), False),
        ("shared place allreduces", shared, dict(kind=InstrKind.ALLREDUCE, group=(member, other)), False),
        ("lead and member send, in place", shared, dict(kind=InstrKind.SEND, peer=other), True),
        ("lead and member allreduce, in place", shared, dict(kind=InstrKind.ALLREDUCE, group=(member, other)), True),
    ):
        was = instrs[k]
        instrs[k] = was if in_place else dataclasses.replace(was)
        before = {name: getattr(was, name) for name in change}
        for name, value in change.items():
            setattr(instrs[k], name, value)
        yield where
        for name, value in before.items():
            setattr(was, name, value)
        instrs[k] = was
    assert lead < member


@pytest.mark.parametrize("name", list(PLANS))
def test_independent_parts_read_at_a_members_own_places_are_those_read_whole(name: str) -> None:
    """`independent_parts` reads a member's peers and collectives where it holds instructions of its own (and where
    its lead names a peer or joins a collective): the parts of every instruction read, whatever the member holds."""
    from dapple_ir.sim.parts import independent_parts

    module = copy.deepcopy(_compiled(name))
    programs = module.programs
    joined = 0
    for where in _member_changes(module):
        found = independent_parts(programs, lambda a, b: (min(a, b) * 1000 + max(a, b),), lambda _instr: [])
        assert found == _parts_read_whole(programs), where
        joined += len(found) < len(_parts_read_whole(_compiled(name).programs))
    assert joined == 5
