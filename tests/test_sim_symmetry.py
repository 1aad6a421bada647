"""A part whose data-parallel replicas are images of its first runs as that one (`dapple_ir.sim.symmetry`), and its
prediction is the whole part's.

Each plan here is simulated three ways: `predict` (the quotient where it applies), `predict` with the quotient
refused (every replica's ranks simulated), and the simulator's whole engine; the three iterations and peaks must be
equal to the last bit. Plans whose replicas are not images (a slower rank, a microbatch renamed on one rank only, a
slower link under one replica, a collective over another group) must be refused the quotient, and still predict as
the whole engine does. Link sharing's weights are held to as many unit flows on links of their own.
"""

from __future__ import annotations

import copy
import dataclasses
import heapq
from functools import cache

import pytest

from dapple_ir import api
from dapple_ir.cluster.spec import ClusterSpec
from dapple_ir.cluster.toml_file import resolve_cluster
from dapple_ir.ir import InstrKind, Module
from dapple_ir.pricing.ops import OpPrices
from dapple_ir.sim import simulator
from dapple_ir.sim.link_sharing import LinkSharing
from dapple_ir.sim.simulator import BACKWARD_INPUT_FRACTION
from tests.paths import ROOT

MEGATRON = str(ROOT / "examples" / "megatron_gpt.py") + ":factory_tiny"
GPT = str(ROOT / "examples" / "gpt.py") + ":factory"

#: (model, cluster, compile keywords): replicas across nodes and inside one, interleaving, the zero-bubble split,
#: GPipe, ZeRO-1's reduce-scatter and all-gather, tensor groups, three replicas, a tied embedding (the GPT example).
PLANS = {
    "T2 D2 P2 interleaved": (
        MEGATRON,
        "8x2xA100-80GB",
        dict(stages=4, virtual=2, schedule="interleaved", microbatches=8, tensor_parallel=2, data_parallel=2),
    ),
    "D4 P2 1f1b across nodes": (MEGATRON, "8x1xA100-80GB", dict(stages=2, data_parallel=4, microbatches=8)),
    "D3 P2 1f1b": (MEGATRON, "6x1xA100-80GB", dict(stages=2, data_parallel=3, microbatches=12)),
    "D2 P2 zb-h1": (GPT, "4x1xA100-80GB", dict(stages=2, data_parallel=2, schedule="zb-h1", microbatches=8)),
    "D2 P3 gpipe": (GPT, "6x1xA100-80GB", dict(stages=3, data_parallel=2, schedule="gpipe", microbatches=8)),
    "D2 P2 zero": (GPT, "4x1xA100-80GB", dict(stages=2, data_parallel=2, zero="all", microbatches=8)),
}

#: Plans refused the quotient, whose prediction is still the whole part's: replicas on one node, whose rings cross
#: links no transfer of theirs does (the links are then no replica's own). The first is the interleaved plan above on
#: nodes of four.
SHARED = {
    "T2 D2 P2 interleaved, two nodes": (MEGATRON, "2x4xA100-80GB", PLANS["T2 D2 P2 interleaved"][2]),
    "T2 D2 P2 inside a node": (MEGATRON, "1x8xA100-80GB", dict(stages=2, tensor_parallel=2, data_parallel=2)),
}


@cache
def _compiled(name: str) -> Module:
    model, cluster, options = {**PLANS, **SHARED}[name]
    forced = dict(replication="round-robin", precision="bf16", **options)
    return api.compile(model, cluster=cluster, global_batch=48, **forced).module  # type: ignore[arg-type]


def _simulator(module: Module, cluster: ClusterSpec) -> simulator._Simulator:
    fractions = simulator._fractions(module, BACKWARD_INPUT_FRACTION)
    return simulator._Simulator(module, cluster, fractions, OpPrices(module, cluster))


def _whole(module: Module, cluster: ClusterSpec) -> tuple[float, float]:
    """The iteration and peak with every replica's ranks simulated: the quotient refused, and the whole engine."""
    refused = _simulator(module, cluster)
    refused.replica_quotient = lambda _part: None  # type: ignore[method-assign]
    predicted = refused.iteration_and_peak()
    state = _simulator(module, cluster).engine({})
    assert predicted[0] == max(max(e, default=0.0) for e in state.ends)
    return predicted


@pytest.mark.parametrize("name", list(PLANS))
def test_replica_zero_predicts_what_every_replica_simulated_predicts(name: str) -> None:
    module = _compiled(name)
    cluster = resolve_cluster(PLANS[name][1])
    sim = _simulator(module, cluster)
    quotients = [sim.replica_quotient(part) for part in sim.distinct_parts()]
    assert any(q is not None for q in quotients), "the quotient should apply here"
    for q in quotients:
        if q is not None:
            assert len(q.ranks) * q.replicas == len(q.ranks) + len(q.others)
    assert _simulator(module, cluster).iteration_and_peak() == _whole(module, cluster)


@pytest.mark.parametrize("name", list(SHARED))
def test_replicas_that_share_links_are_simulated_whole(name: str) -> None:
    module = _compiled(name)
    cluster = resolve_cluster(SHARED[name][1])
    sim = _simulator(module, cluster)
    assert all(sim.replica_quotient(part) is None for part in sim.distinct_parts())
    assert sim.iteration_and_peak() == _whole(module, cluster)


def _replica_rank(module: Module, replica: int) -> int:
    return next(r for r, p in enumerate(module.programs) if (p.attrs.replica or 0) == replica)


def test_a_replica_that_computes_slower_is_no_image() -> None:
    module = _compiled("D4 P2 1f1b across nodes")
    cluster = resolve_cluster("8x1xA100-80GB")
    sim = _simulator(module, cluster)
    costs = sim.of_rank[_replica_rank(module, 2)]
    stage = next(iter(costs.fwd))
    costs.fwd[stage] *= 1.5
    assert all(sim.replica_quotient(part) is None for part in sim.distinct_parts())
    assert sim.iteration_and_peak()[0] == max(max(e, default=0.0) for e in sim.engine({}).ends)


def test_a_replica_whose_ranks_rename_microbatches_apart_is_no_image() -> None:
    """One rank of replica 1 has two of its microbatches swapped throughout: alone it is an image of its counterpart,
    but not under the map its replica's other ranks give."""
    module = copy.deepcopy(_compiled("D4 P2 1f1b across nodes"))
    cluster = resolve_cluster("8x1xA100-80GB")
    rank = _replica_rank(module, 1)
    program = module.programs[rank]
    a, b = sorted({i.mb for i in program.instrs if i.mb is not None})[:2]
    swap = {a: b, b: a}
    program.instrs = [dataclasses.replace(i, mb=swap.get(i.mb, i.mb)) for i in program.instrs]  # type: ignore[arg-type]
    sim = _simulator(module, cluster)
    assert all(sim.replica_quotient(part) is None for part in sim.parts)


@pytest.mark.parametrize("change", ["microbatch", "peer", "group", "stage"])
def test_a_replica_whose_program_differs_is_no_image(change: str) -> None:
    module = copy.deepcopy(_compiled("D4 P2 1f1b across nodes"))
    cluster = resolve_cluster("8x1xA100-80GB")
    rank = _replica_rank(module, 1)
    program = module.programs[rank]
    kind = InstrKind.ALLREDUCE if change == "group" else InstrKind.FORWARD if change == "stage" else InstrKind.SEND
    index = next(i for i, instr in enumerate(program.instrs) if instr.kind is kind)
    instr = program.instrs[index]
    if change == "microbatch":  # one send renamed as no other instruction of the replica is
        replaced = dataclasses.replace(instr, mb=(instr.mb or 0) + 1)
    elif change == "peer":  # to a rank of another replica
        stranger = next(r for r in range(len(module.programs)) if r not in (rank, instr.peer))
        replaced = dataclasses.replace(instr, peer=stranger)
    elif change == "group":
        assert instr.group is not None
        replaced = dataclasses.replace(instr, group=tuple(sorted({*instr.group[:-1], rank})))
    else:
        replaced = dataclasses.replace(instr, stage=next(s for s in module.stages if s is not instr.stage))
    program.instrs[index] = replaced
    sim = _simulator(module, cluster)
    assert all(sim.replica_quotient(part) is None for part in sim.parts)


def test_a_slower_link_under_one_replica_makes_it_no_image() -> None:
    module = _compiled("D4 P2 1f1b across nodes")
    cluster = resolve_cluster("8x1xA100-80GB")
    sim = _simulator(module, cluster)
    rank = _replica_rank(module, 3)
    peer = next(i.peer for i in module.programs[rank].instrs if i.kind is InstrKind.SEND)
    assert peer is not None
    link = sim.route_links(rank, peer)[0]
    sim.bandwidth[link] /= 1e3
    assert all(sim.replica_quotient(part) is None for part in sim.distinct_parts())
    ends = sim.engine({}).ends
    assert sim.iteration_and_peak()[0] == max(max(e, default=0.0) for e in ends)


def _ends(sharing: LinkSharing, starts: list[tuple[float, tuple[int, ...], float, int]]) -> dict[int, float]:
    """When each flow ends: the flows (time, links, bytes, weight) started in time order between the end events."""
    ends: dict[int, float] = {}
    events: list[tuple[float, int, int, int]] = []
    version: dict[int, int] = {}
    ticket = 0
    pending = sorted(starts, key=lambda s: s[0])
    while pending or events:
        if pending and (not events or pending[0][0] <= events[0][0]):
            t, links, nbytes, weight = pending.pop(0)
            flow, moved = sharing.start(t, links, nbytes, weight)
            ends[flow] = -1.0
        else:
            t, _ticket, bundle, v = heapq.heappop(events)
            if version.get(bundle) != v or not sharing.is_current(bundle, v):
                continue
            done, moved = sharing.finish(t, bundle)
            for flow in done:
                ends[flow] = t
        for bundle, end, v in moved:
            version[bundle] = v
            heapq.heappush(events, (end, ticket, bundle, v))
            ticket += 1
    return ends


def test_a_flow_of_weight_r_moves_as_each_of_r_flows_on_links_of_their_own() -> None:
    """Three replicas' transfers on links of their own (0-1, 2-3, 4-5), a ring step from each onto the next one's
    second link, against one replica's transfers of weight 3 on links of three times the bandwidth with the three
    steps mapped onto its links."""
    bandwidth = [1e9, 2e9] * 3
    whole = LinkSharing(list(bandwidth))
    flows = []
    for d in range(3):
        flows += [(0.0, (2 * d,), 4e6, 1), (0.001, (2 * d, 2 * d + 1), 3e6, 1)]
        flows.append((0.002, (2 * d, 2 * ((d + 1) % 3) + 1), 2e6, 1))
    whole_ends = _ends(whole, flows)
    one = LinkSharing([b * 3 for b in bandwidth[:2]])
    quotient = [(0.0, (0,), 4e6, 3), (0.001, (0, 1), 3e6, 3)] + [(0.002, (0, 1), 2e6, 1)] * 3
    one_ends = _ends(one, quotient)
    # Flow ids in start order: the whole's replica 0 transfers are 0 and 3, its ring steps 6, 7, 8; the quotient's
    # transfers 0 and 1, its ring steps 2, 3, 4.
    assert [one_ends[0], one_ends[1]] == [whole_ends[0], whole_ends[3]]
    assert sorted(one_ends[k] for k in (2, 3, 4)) == sorted(whole_ends[k] for k in (6, 7, 8))
