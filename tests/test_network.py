"""The network in the simulator: transfers and allreduce steps share the links on their path.

References: closed forms for one flow at a time (latency + bytes / bandwidth, as before links were
shared), a ring allreduce alone (counted here from the cluster's cards and ports, not by the
topology module), and the equal-sharing arithmetic of an allreduce that overlaps an activation;
and, for random plans on random clusters, the physical bounds no iteration may beat: any link's
bytes / bandwidth (recounted from the rank programs) and any device's compute.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dapple_ir.analysis.peak_memory import transfer_bytes
from dapple_ir.cluster.spec import PRESETS, ClusterSpec, Link
from dapple_ir.frontend.profile_import import import_profile
from dapple_ir.ir import (
    Instr,
    InstrKind,
    Module,
    ModuleAttrs,
    Op,
    OpAttrs,
    OpKind,
    Param,
    ProgramAttrs,
    RankProgram,
    Stage,
    StageAttrs,
    TensorType,
)
from dapple_ir.pass_manager import PassManager, build_pipeline
from dapple_ir.passes.plan import write_costs_at_microbatch
from dapple_ir.planner.cost_model import Candidate, StageChoice, problem_from_module
from dapple_ir.planner.search import write_stages
from dapple_ir.sim.simulator import SimulationResult, simulate
from tests.pipeline_fixtures import write_chain_profile
from tests.test_simulator import gpipe_order, pipeline_module

F, B = InstrKind.FORWARD, InstrKind.BACKWARD
KIND = dataclasses.replace(PRESETS["V100-16GB"], memory_bytes=1e15)


# --------------------------------------------------------------------------------- clusters


@st.composite
def clusters(draw: st.DrawFn) -> ClusterSpec:
    """1-3 nodes of 1-4 devices, a switch or a bus, 1 card per node up to one per device."""
    nodes = draw(st.integers(1, 3))
    per = draw(st.integers(1, 4))
    intra_bw = draw(st.sampled_from([1e9, 4e9, 25e9]))
    inter_bw = draw(st.sampled_from([b for b in (2.5e8, 1e9, 4e9) if b <= intra_bw]))
    intra = Link(intra_bw, draw(st.sampled_from([0.0, 5e-6, 1e-4])))
    inter = Link(inter_bw, draw(st.sampled_from([0.0, 2e-5, 1e-4])))
    fabric = draw(st.sampled_from(["switch", "bus"]))
    cards = draw(st.integers(1, per))
    return ClusterSpec((KIND,) * nodes, per, intra, inter, name="drawn", fabric=fabric, cards=cards)


def _resources(spec: ClusterSpec, a: int, b: int) -> tuple[list[tuple], float]:  # type: ignore[type-arg]
    """What a transfer a -> b occupies, named here from the spec's own terms, and its bandwidth."""
    if spec.node_of(a) != spec.node_of(b):
        return [("card out", spec.node_of(a), spec.card_of(a)), ("card in", spec.node_of(b), spec.card_of(b))], (
            spec.inter.bandwidth
        )
    if spec.fabric == "bus":
        return [("bus", spec.node_of(a))], spec.intra.bandwidth
    return [("port out", a), ("port in", b)], spec.intra.bandwidth


def ring_alone_s(spec: ClusterSpec, nbytes: float, devices: list[int]) -> float:
    """A ring allreduce alone: each of the n steps (sorted devices, the last back to the first) sends
    2(n-1)/n of the bytes; a resource's bandwidth is split equally among the steps on it; the ring
    ends with its slowest step, plus 2(n-1) latencies of its slowest hop."""
    order = sorted(devices)
    n = len(order)
    if n < 2 or nbytes <= 0:
        return 0.0
    steps = [(order[i], order[(i + 1) % n]) for i in range(n)]
    count: Counter = Counter()  # type: ignore[type-arg]
    bandwidth = {}
    for a, b in steps:
        names, bw = _resources(spec, a, b)
        for name in names:
            count[name] += 1
            bandwidth[name] = bw
    slowest = max(count[name] / bandwidth[name] for name in count)
    latency = max(spec.link(a, b).latency for a, b in steps)
    return 2 * (n - 1) / n * nbytes * slowest + 2 * (n - 1) * latency


# ------------------------------------------------------------------ one flow at a time


@settings(max_examples=60, deadline=None)
@given(spec=clusters(), data=st.data())
def test_one_transfer_at_a_time_is_latency_plus_bytes_over_bandwidth(spec: ClusterSpec, data: st.DataObject) -> None:
    """Three stages, one microbatch: every transfer runs alone; the iteration is the compute plus
    four transfers, each latency + bytes / bandwidth of its link (the closed form before sharing)."""
    devices = data.draw(st.permutations(range(spec.num_devices)).map(lambda p: p[:3]))
    stages = len(devices)
    out_bytes = data.draw(st.sampled_from([0.0, 1e3, 3e7, 2e9]))
    module = pipeline_module(stages, 1, [gpipe_order(s, stages, 1) for s in range(stages)], out_bytes=out_bytes)
    for program, device in zip(module.programs, devices, strict=True):
        program.attrs.device = device
    result = simulate(module, cluster=spec)
    hops = [spec.link(devices[k], devices[k + 1]).transfer_s(out_bytes) for k in range(stages - 1)]
    assert result.iteration_s == pytest.approx(stages * (1.0 + 2.0) + 2 * sum(hops), rel=1e-9)


def _replicated_stage(group: list[int], param_elems: int) -> Module:
    """One stage replicated on `group`: each replica runs F and B of one microbatch (3 s) and then the
    stage's allreduce of 4 * param_elems bytes."""
    x = Op("x", OpKind.INPUT, [], TensorType("f32", (2, 4)))
    h = Op("h", OpKind.CALL_MODULE, [x], x.type, "lin", OpAttrs(fwd_s=1.0, bwd_s=2.0, params=("w",)))
    loss = Op("loss", OpKind.OUTPUT, [h], h.type)
    stage = Stage("s0", [x, h, loss], StageAttrs(replicas=len(group), devices=tuple(group)))
    module = Module(
        "dp",
        [Param("w", TensorType("f32", (param_elems,)))],
        [x, h, loss],
        stages=[stage],
        attrs=ModuleAttrs(microbatches=len(group), optimizer="sgd"),
    )
    ranks = tuple(range(len(group)))
    for rank, device in enumerate(group):
        instrs = [Instr(F, stage, mb=rank), Instr(B, stage, mb=rank), Instr(InstrKind.ALLREDUCE, stage, group=ranks)]
        module.programs.append(RankProgram(f"rank{rank}", instrs, ProgramAttrs(rank=rank, device=device)))
    return module


@settings(max_examples=60, deadline=None)
@given(spec=clusters(), data=st.data())
def test_an_allreduce_alone_is_its_ring_closed_form(spec: ClusterSpec, data: st.DataObject) -> None:
    size = data.draw(st.integers(2, spec.num_devices)) if spec.num_devices > 1 else 1
    group = data.draw(st.permutations(range(spec.num_devices)).map(lambda p: list(p[:size])))
    elems = data.draw(st.sampled_from([0, 1000, 25_000_000]))
    result = simulate(_replicated_stage(group, elems), cluster=spec)
    assert result.iteration_s == pytest.approx(3.0 + ring_alone_s(spec, 4.0 * elems, group), rel=1e-9)


# --------------------------------------------------------------- an allreduce beside a send


def _overlap_module(grad_bytes: float, act_bytes: float) -> Module:
    """Two nodes of two devices, one card each. Ranks 0 and 1 (devices 0 and 2) reduce a stage's
    gradients at t = 3 s; rank 2 (device 1) sends an activation to rank 3 (device 3) at t = 3 s too.
    The ring's step 0 -> 2 and the send 1 -> 3 both leave through node 0's card and enter node 1's."""
    module = _replicated_stage([0, 2], int(grad_bytes // 4))
    t = TensorType("f32", (2, 4))
    u = Op("u", OpKind.INPUT, [], t)
    a = Op("a", OpKind.CALL_FUNCTION, [u], t, "torch.relu", OpAttrs(fwd_s=3.0, out_bytes=act_bytes))
    b = Op("b", OpKind.CALL_FUNCTION, [a], t, "torch.relu", OpAttrs(fwd_s=1.0))
    s1 = Stage("s1", [u, a], StageAttrs(replicas=1, devices=(1,)))
    s2 = Stage("s2", [b], StageAttrs(replicas=1, devices=(3,)))
    module.ops += [u, a, b]
    module.stages += [s1, s2]
    send = Instr(InstrKind.SEND, value=a, mb=0, peer=3)
    recv = Instr(InstrKind.RECV, value=a, mb=0, peer=2)
    module.programs.append(RankProgram("rank2", [Instr(F, s1, mb=0), send], ProgramAttrs(rank=2, device=1)))
    module.programs.append(RankProgram("rank3", [recv, Instr(F, s2, mb=0)], ProgramAttrs(rank=3, device=3)))
    return module


def _card_cluster() -> ClusterSpec:
    return ClusterSpec((KIND, KIND), 2, Link(100e9, 0.0), Link(1e9, 1e-3), name="two cards", cards=1)


def _ring_end_and_arrival(result: SimulationResult) -> tuple[float, float]:
    ring = max(e.end_s for e in result.events() if e.instr.kind is InstrKind.ALLREDUCE)
    arrival = next(e.end_s for e in result.events() if e.instr.kind is InstrKind.SEND)
    return ring, arrival


@settings(max_examples=40, deadline=None)
@given(grad=st.integers(1, 4000).map(lambda k: k * 1e6), act=st.integers(1, 4000).map(lambda k: k * 1e6))
def test_an_allreduce_beside_activation_traffic_slows_both(grad: float, act: float) -> None:
    """Each ring step carries G (2(n-1)/n of G for n = 2); the send carries A. On node 0's card the
    step 0 -> 2 and the send share 1 GB/s equally until the smaller is through at 3 + 2 min(G, A) / C;
    the other then runs alone: the larger ends at 3 + (G + A) / C. Latency 1 ms per hop."""
    cluster, c, lat = _card_cluster(), 1e9, 1e-3
    ring_alone, _ = _ring_end_and_arrival(simulate(_overlap_module(grad, 0.0), cluster=cluster))
    _, arrival_alone = _ring_end_and_arrival(simulate(_overlap_module(0.0, act), cluster=cluster))
    ring, arrival = _ring_end_and_arrival(simulate(_overlap_module(grad, act), cluster=cluster))
    assert ring_alone == pytest.approx(3.0 + grad / c + 2 * lat)
    assert arrival_alone == pytest.approx(3.0 + act / c + lat)
    small, large = min(grad, act), max(grad, act)
    ends = {"small": 3.0 + 2 * small / c, "large": 3.0 + (small + large) / c}
    assert ring == pytest.approx((ends["small"] if grad <= act else ends["large"]) + 2 * lat)
    assert arrival == pytest.approx((ends["small"] if act < grad else ends["large"]) + lat)
    assert ring > ring_alone and arrival > arrival_alone


# ---------------------------------------------------------- physical bounds on random plans


def card_bytes(module: Module, spec: ClusterSpec) -> Counter:  # type: ignore[type-arg]
    """Bytes through each (node, card, direction) per iteration, recounted from the rank programs: every
    send between nodes, and every step of every allreduce's ring (sorted devices) between nodes. A
    stage's allreduce sums its trainable parameters but those an `allreduce param` sums on its own."""
    loads: Counter = Counter()  # type: ignore[type-arg]
    devices = [p.attrs.device for p in module.programs]
    instrs = [instr for program in module.programs for instr in program.instrs]
    alone = {instr.param for instr in instrs if instr.kind is InstrKind.ALLREDUCE and instr.param}

    def through(a: int, b: int, nbytes: float) -> None:
        if spec.node_of(a) != spec.node_of(b):
            loads[(spec.node_of(a), spec.card_of(a), "out")] += nbytes
            loads[(spec.node_of(b), spec.card_of(b), "in")] += nbytes

    def reduced_bytes(instr: Instr) -> float:
        if instr.param is not None:
            return float(module.param(instr.param).nbytes)
        assert instr.stage is not None
        names = {n for op in instr.stage.ops for n in op.attrs.params or ()} & alone
        return module.param_bytes_of(instr.stage.ops) - sum(module.param(n).nbytes for n in names)

    seen: set[tuple] = set()  # type: ignore[type-arg]
    for rank, program in enumerate(module.programs):
        count: Counter = Counter()  # type: ignore[type-arg]
        for instr in program.instrs:
            if instr.kind is InstrKind.SEND:
                assert instr.value is not None and instr.peer is not None
                through(devices[rank], devices[instr.peer], transfer_bytes(module, instr.value, instr.rows))  # type: ignore[arg-type]
            if instr.kind is InstrKind.ALLREDUCE:
                assert instr.group is not None
                what = (instr.stage.name if instr.stage else instr.param, instr.group)
                key = (*what, count[what])
                count[what] += 1
                if key in seen:
                    continue
                seen.add(key)
                group = sorted(devices[r] for r in instr.group)  # type: ignore[misc]
                n, nbytes = len(group), reduced_bytes(instr)
                for i in range(n):
                    through(group[i], group[(i + 1) % n], 2 * (n - 1) / n * nbytes)
    return loads


def lowered(module: Module, spec: ClusterSpec, cand: Candidate, global_batch: int) -> Module:
    """`cand` written into a copy of `module` and lowered by the real passes, as the plan pass scores it."""
    problem = problem_from_module(module, spec, global_batch)
    # A copy of the ops too: the plan pass scores a candidate with every op's cost at its microbatch size.
    trial = dataclasses.replace(copy.deepcopy(module), stages=[], programs=[])
    write_stages(trial, problem, cand)
    write_costs_at_microbatch(trial, problem, cand)
    PassManager(build_pipeline(f"schedule{{kind={cand.schedule}}},lower-comm,insert-frees")).run(trial)
    return trial


def _chain_profile(tmp: Path, layers: list[tuple[float, float, float]]) -> Module:
    """A chain profile: per layer (forward ms, activation bytes, parameter bytes), backward 2x forward."""
    module = import_profile(str(write_chain_profile(tmp / "chain-pbs-8.txt", layers)))
    PassManager(build_pipeline("coarsen")).run(module)
    return module


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=clusters(), data=st.data())
def test_no_iteration_beats_a_link_or_a_device(tmp_path: Path, spec: ClusterSpec, data: st.DataObject) -> None:
    layers = data.draw(
        st.lists(
            st.tuples(
                st.sampled_from([0.5, 2.0, 8.0]),
                st.sampled_from([0.0, 1e6, 4e8]),
                st.sampled_from([0.0, 1e6, 2e9]),
            ),
            min_size=1,
            max_size=4,
        )
    )
    module = _chain_profile(tmp_path, layers)
    stages = data.draw(st.integers(1, min(len(module.layers), spec.num_devices)))
    inner = list(range(1, len(module.layers)))
    cuts = sorted(data.draw(st.permutations(inner).map(lambda p: p[: stages - 1])))
    bounds = [0, *cuts, len(module.layers)]
    replicas = data.draw(
        st.lists(st.integers(1, 3), min_size=stages, max_size=stages).filter(lambda r: sum(r) <= spec.num_devices)
    )
    devices = data.draw(st.permutations(range(spec.num_devices)))
    placed, start = [], 0
    for r in replicas:
        placed.append(tuple(devices[start : start + r]))
        start += r
    microbatches = data.draw(st.sampled_from([m for m in (4, 8, 16) if m >= max(replicas)]))
    schedule = data.draw(st.sampled_from(["gpipe", "1f1b", "zb-h1"]))
    chosen = tuple(StageChoice(bounds[k], bounds[k + 1], placed[k]) for k in range(stages))
    trial = lowered(module, spec, Candidate(chosen, microbatches, schedule), global_batch=32)
    result = simulate(trial, cluster=spec)
    assert result.iteration_s >= max(result.busy_s) * (1 - 1e-12)
    for load in result.links:
        assert result.iteration_s >= load.busy_s * (1 - 1e-12), load
    # The simulator's card accounting is the recount's.
    recount = card_bytes(trial, spec)
    cards = {tuple(load.name.split()): load for load in result.links if " card" in load.name}
    for (node, card, way), nbytes in recount.items():
        if nbytes == 0:
            continue
        load = cards[(f"n{node}", f"card{card}", way)]
        assert load.nbytes == pytest.approx(nbytes, rel=1e-9)
        assert result.iteration_s >= nbytes / spec.inter.bandwidth * (1 - 1e-12)
    assert sum(load.nbytes for load in result.links if "card" in load.name) == pytest.approx(sum(recount.values()))
