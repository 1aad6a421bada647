"""The simulator against closed forms and hand arithmetic.

Rank programs are built here directly (a small, independent lowering of hand-written schedule orders)
so these tests do not depend on the schedule and lowering passes.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from dapple_ir.analysis import peak_memory
from dapple_ir.cluster.spec import ClusterSpec, DeviceKind, Link
from dapple_ir.cluster.topology import Network
from dapple_ir.errors import DappleError
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
from dapple_ir.ir.parser import parse_module
from dapple_ir.ir.printer import print_module
from dapple_ir.ir.verifier import verify_module
from dapple_ir.pricing.collectives import allreduce_s
from dapple_ir.sim.simulator import SimulationResult, simulate

F, B, BI, W = InstrKind.FORWARD, InstrKind.BACKWARD, InstrKind.BACKWARD_INPUT, InstrKind.BACKWARD_WEIGHT
COMPUTE = (F, B, BI, W, InstrKind.OPTIMIZER_STEP)
Work = tuple[InstrKind, int, int]  # (kind, virtual stage, microbatch)


# ------------------------------------------------------------------------- schedule orders


def gpipe_order(stage: int, stages: int, mbs: int) -> list[Work]:
    return [(F, stage, m) for m in range(mbs)] + [(B, stage, m) for m in range(mbs)]


def one_f_one_b_order(stage: int, stages: int, mbs: int) -> list[Work]:
    warmup = min(stages - stage, mbs)
    order: list[Work] = [(F, stage, m) for m in range(warmup)]
    for k in range(mbs):
        order.append((B, stage, k))
        if warmup + k < mbs:
            order.append((F, stage, warmup + k))
    return order


def zb_h1_order(stage: int, stages: int, mbs: int) -> list[Work]:
    """ZB-H1 (Qi et al. 2024, §2.1): 1f1b's warm-up, B split off, stage i defers its first i W passes."""
    warmup = min(stages - stage, mbs)
    order: list[Work] = [(F, stage, m) for m in range(warmup)]
    for k in range(mbs):
        order.append((BI, stage, k))
        if k >= stage:
            order.append((W, stage, k - stage))
        if warmup + k < mbs:
            order.append((F, stage, warmup + k))
    order += [(W, stage, m) for m in range(max(0, mbs - stage), mbs)]
    return order


def interleaved_order(device: int, devices: int, mbs: int, virtual: int) -> list[Work]:
    """Megatron-LM's interleaved 1f1b: rounds of `devices` microbatches through chunk 0, 1, ..."""
    rounds = [range(i, min(i + devices, mbs)) for i in range(0, mbs, devices)]
    fwd = [(c * devices + device, m) for r in rounds for c in range(virtual) for m in r]
    bwd = [(c * devices + device, m) for r in rounds for c in reversed(range(virtual)) for m in r]
    warmup = min((devices - device - 1) * 2 + (virtual - 1) * devices, len(fwd))
    order: list[Work] = [(F, k, m) for k, m in fwd[:warmup]]
    for i in range(len(fwd) - warmup):
        order += [(F, *fwd[warmup + i]), (B, *bwd[i])]
    order += [(B, k, m) for k, m in bwd[len(fwd) - warmup :]]
    return order


# ---------------------------------------------------------------------- module construction


def pipeline_module(
    devices: int,
    microbatches: int,
    order: list[list[Work]] | None,
    *,
    virtual: int = 1,
    fwd_s: float = 1.0,
    bwd_s: float = 2.0,
    act_bytes: float = 0.0,
    out_bytes: float = 0.0,
    batch: int = 8,
    microbatch_size: int = 8,
    param_elems: int = 0,
    optimizer: str = "sgd",
) -> Module:
    """A chain of `devices * virtual` single-op stages; virtual stage k runs on rank k % devices.

    Lowering: recv before a compute that needs another rank's value, send right after the compute that
    makes it, free the stage's activations after its (weight) backward and received tensors after use.
    Without an `order` the module has stages but no programs (input for the schedule passes).
    """
    n_stages = devices * virtual
    x = Op("x", OpKind.INPUT, [], TensorType("f32", (batch, 4)))
    params = [Param(f"p{k}", TensorType("f32", (param_elems,))) for k in range(n_stages)] if param_elems else []
    ops: list[Op] = [x]
    for k in range(n_stages):
        attrs = OpAttrs(fwd_s=fwd_s, bwd_s=bwd_s, act_bytes=act_bytes, out_bytes=out_bytes)
        if param_elems:
            attrs.params = (f"p{k}",)
        ops.append(Op(f"h{k}", OpKind.CALL_FUNCTION, [ops[-1]], TensorType("f32", (batch, 4)), "torch.relu", attrs))
    out = Op("loss", OpKind.OUTPUT, [ops[-1]], ops[-1].type)
    stage_ops = [[ops[k + 1]] for k in range(n_stages)]
    stage_ops[0].insert(0, x)
    stage_ops[-1].append(out)
    stages = [Stage(f"s{k}", o, StageAttrs(replicas=1, devices=(k % devices,))) for k, o in enumerate(stage_ops)]
    module = Module(
        "chain",
        params=params,
        ops=[*ops, out],
        stages=stages,
        attrs=ModuleAttrs(
            batch=batch,
            cost_batch=batch,
            microbatches=microbatches,
            microbatch_size=microbatch_size,
            optimizer=optimizer,
        ),
    )
    if order is None:
        return module
    for rank in range(devices):
        hosted = tuple(s.name for k, s in enumerate(stages) if k % devices == rank)
        instrs = lower(order[rank], stages, ops[1:], devices)
        instrs.append(Instr(InstrKind.OPTIMIZER_STEP))
        module.programs.append(RankProgram(f"rank{rank}", instrs, ProgramAttrs(rank=rank, device=rank, stages=hosted)))
    return module


def lower(order: list[Work], stages: list[Stage], values: list[Op], devices: int) -> list[Instr]:
    last = len(stages) - 1
    instrs: list[Instr] = []
    for kind, k, m in order:
        stage, home = stages[k], k % devices
        if kind is F:
            if k > 0:
                instrs.append(Instr(InstrKind.RECV, value=values[k - 1], mb=m, peer=(k - 1) % devices))
            instrs.append(Instr(F, stage, mb=m))
            if k < last:
                instrs.append(Instr(InstrKind.SEND, value=values[k], mb=m, peer=(k + 1) % devices))
            continue
        if kind in (B, BI):
            if k < last:
                instrs.append(Instr(InstrKind.RECV, value=values[k], grad=True, mb=m, peer=(k + 1) % devices))
            instrs.append(Instr(kind, stage, mb=m))
            if k > 0:
                instrs.append(Instr(InstrKind.SEND, value=values[k - 1], grad=True, mb=m, peer=(k - 1) % devices))
                instrs.append(Instr(InstrKind.FREE, value=values[k - 1], mb=m))
            if k < last:
                instrs.append(Instr(InstrKind.FREE, value=values[k], grad=True, mb=m))
        if kind is W:
            instrs.append(Instr(W, stage, mb=m))
        if kind in (B, W):
            instrs.append(Instr(InstrKind.FREE, stage, mb=m))
        assert home == (k % devices)
    return instrs


def schedule_module(kind: str, stages: int, microbatches: int, **kwargs: object) -> Module:
    orders = {"gpipe": gpipe_order, "1f1b": one_f_one_b_order, "zb-h1": zb_h1_order}[kind]
    order = [orders(s, stages, microbatches) for s in range(stages)]
    return pipeline_module(stages, microbatches, order, **kwargs)  # type: ignore[arg-type]


def interleaved_module(devices: int, microbatches: int, virtual: int, **kwargs: object) -> Module:
    order = [interleaved_order(d, devices, microbatches, virtual) for d in range(devices)]
    return pipeline_module(devices, microbatches, order, virtual=virtual, **kwargs)  # type: ignore[arg-type]


def test_fixture_programs_are_valid_ir() -> None:
    for module in (schedule_module("1f1b", 3, 5), schedule_module("zb-h1", 3, 5), interleaved_module(2, 4, 2)):
        verify_module(module)
        text = print_module(module)
        assert print_module(parse_module(text)) == text


# ------------------------------------------------------------------------------ closed forms


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "microbatches"), [(1, 4), (2, 1), (2, 4), (3, 5), (4, 8), (8, 16)])
def test_gpipe_and_1f1b_match_closed_form(kind: str, stages: int, microbatches: int) -> None:
    """Equal stages, free communication: (M + S - 1)(F + B), every rank idle (S - 1)/(M + S - 1)."""
    f, b = 1.0, 2.0
    result = simulate(schedule_module(kind, stages, microbatches, fwd_s=f, bwd_s=b))
    assert result.iteration_s == pytest.approx((microbatches + stages - 1) * (f + b))
    for bubble in result.bubble_fraction:
        assert bubble == pytest.approx((stages - 1) / (microbatches + stages - 1))
    assert critical_compute_s(result) == pytest.approx(result.iteration_s)


def critical_compute_s(result: SimulationResult) -> float:
    """Compute time along the critical path: the whole iteration when communication is free."""
    programs = result.module.programs
    return sum(
        result.ends[r][i] - result.starts[r][i]
        for r, i in result.critical_path
        if programs[r].instrs[i].kind in COMPUTE
    )


@pytest.mark.parametrize(("devices", "microbatches", "virtual"), [(2, 4, 2), (4, 8, 2), (4, 16, 3), (3, 6, 4)])
def test_interleaved_matches_megatron_closed_form(devices: int, microbatches: int, virtual: int) -> None:
    """Megatron-LM (Narayanan et al. 2021, §2.2.2): with V chunks per device the bubble shrinks V-fold.

    A device's whole-model share costs F + B per microbatch (each chunk F/V and B/V), so the ideal is
    M(F + B) and the iteration is M(F + B) + (S - 1)(F + B)/V; the bubble fraction relative to the
    ideal time is (S - 1)/(V M). Assumes M is a multiple of S and communication is free.
    """
    f, b = 1.0, 2.0
    module = interleaved_module(devices, microbatches, virtual, fwd_s=f / virtual, bwd_s=b / virtual)
    result = simulate(module)
    ideal = microbatches * (f + b)
    assert result.iteration_s == pytest.approx(ideal + (devices - 1) * (f + b) / virtual)
    assert (result.iteration_s - ideal) / ideal == pytest.approx((devices - 1) / (virtual * microbatches))
    assert critical_compute_s(result) == pytest.approx(result.iteration_s)


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 4), (3, 6), (4, 8), (4, 12), (8, 16)])
def test_zb_h1_matches_zero_bubble_paper(stages: int, microbatches: int) -> None:
    """Zero Bubble (Qi et al., ICLR 2024, §2.1): ZB-H1's bubble is (p - 1)(T_F + T_B - T_W).

    T_B is the input-gradient pass and T_W the weight-gradient pass; the paper's setting has
    T_F = T_B = T_W = T, so the bubble is (p - 1) T, a third of 1f1b's (p - 1)(T_F + T_B + T_W).
    Here a stage's full backward is 2T split evenly (f = 0.5), the first stage's too (the paper's setting; our
    runtime's first stage has no input pass, see the test below), and M >= p.
    """
    t = 1.0
    module = schedule_module("zb-h1", stages, microbatches, fwd_s=t, bwd_s=2 * t)
    result = simulate(module, backward_input_fraction={stage.name: 0.5 for stage in module.stages})
    t_f, t_b, t_w = t, t, t
    assert result.iteration_s == pytest.approx(microbatches * (t_f + t_b + t_w) + (stages - 1) * (t_f + t_b - t_w))
    assert critical_compute_s(result) == pytest.approx(result.iteration_s)
    one_f_one_b = simulate(schedule_module("1f1b", stages, microbatches, fwd_s=t, bwd_s=2 * t))
    ideal = microbatches * 3 * t
    assert result.iteration_s - ideal == pytest.approx((one_f_one_b.iteration_s - ideal) / 3)


def test_backward_input_fraction_splits_backward() -> None:
    """f of a stage's backward goes to its input pass, the rest to its weight pass; a first stage hands no
    gradient back, so its input pass takes nothing (the runtime's has nothing to compute) unless named."""
    module = schedule_module("zb-h1", 2, 1, fwd_s=1.0, bwd_s=4.0)
    first, second = (stage.name for stage in module.stages)

    def split(result: SimulationResult) -> dict[tuple[int, InstrKind], float]:
        return {(e.rank, e.instr.kind): e.end_s - e.start_s for e in result.events() if e.instr.kind in (BI, W)}

    assert split(simulate(module, backward_input_fraction=0.25)) == pytest.approx(
        {(0, BI): 0.0, (0, W): 4.0, (1, BI): 1.0, (1, W): 3.0}
    )
    assert split(simulate(module, backward_input_fraction={first: 0.5})) == pytest.approx(
        {(0, BI): 2.0, (0, W): 2.0, (1, BI): 2.0, (1, W): 2.0}
    )
    with pytest.raises(DappleError, match="names stage @nope"):
        simulate(module, backward_input_fraction={"nope": 0.5})
    with pytest.raises(DappleError, match=f"of @{second} must lie in"):
        simulate(module, backward_input_fraction={second: 1.5})


def test_a_split_backward_pays_one_pass_per_weight_op() -> None:
    """`DeviceKind.split_s`: each stage that hands a gradient back pays `split_backward_overhead` per weight op
    (`peak_memory.weight_ops`: here the one op reading a parameter) and `split_backward_per_byte` per byte of its
    parameters, together c, in its weight pass; the first stage, whose one
    weight pass is its whole backward, and a stage without parameters pay nothing, and so does an unsplit
    schedule. By hand: f = 0.5 of a 4 s backward, so the weight pass is 2 s + c."""
    c = 0.25
    free = Link(math.inf, 0.0)
    kind = DeviceKind("split", math.inf, {"f32": math.inf}, math.inf, split_backward_overhead=c / 2)
    # Each stage's parameter holds 8 f32 (32 bytes): the other half of c is its per-byte part.
    kind = dataclasses.replace(kind, split_backward_per_byte=c / 2 / 32)
    priced = ClusterSpec((kind,), 3, free, free)

    def passes(module: Module, cluster: ClusterSpec | None) -> dict[tuple[int, InstrKind], float]:
        result = simulate(module, cluster=cluster)
        return {(e.rank, e.instr.kind): e.end_s - e.start_s for e in result.events() if e.instr.kind in (BI, W)}

    with_params = schedule_module("zb-h1", 3, 4, fwd_s=1.0, bwd_s=4.0, param_elems=8)
    assert passes(with_params, priced) == pytest.approx(
        {(0, BI): 0.0, (0, W): 4.0, (1, BI): 2.0, (1, W): 2.0 + c, (2, BI): 2.0, (2, W): 2.0 + c}
    )
    assert passes(with_params, None) == pytest.approx(
        {(0, BI): 0.0, (0, W): 4.0, (1, BI): 2.0, (1, W): 2.0, (2, BI): 2.0, (2, W): 2.0}
    )
    no_params = schedule_module("zb-h1", 3, 4, fwd_s=1.0, bwd_s=4.0)
    assert simulate(no_params, cluster=priced).iteration_s == pytest.approx(simulate(no_params).iteration_s)
    unsplit = schedule_module("1f1b", 3, 4, fwd_s=1.0, bwd_s=4.0, param_elems=8)
    assert simulate(unsplit, cluster=priced).iteration_s == pytest.approx(simulate(unsplit).iteration_s)
    # Here c hides in the bubbles (24 s either way); at c = 2 s the middle rank's own work, 4 x (1 + 2 + 2 + 2) s,
    # is past the 24 s.
    dear = ClusterSpec(
        (dataclasses.replace(kind, split_backward_overhead=2.0, split_backward_per_byte=0.0),), 3, free, free
    )
    assert simulate(with_params, cluster=dear).iteration_s >= 4 * (1.0 + 2.0 + 2.0 + 2.0) > 24.0


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "microbatches"), [(1, 4), (2, 4), (4, 8)])
def test_the_hosts_time_per_instruction_lengthens_every_computation(kind: str, stages: int, microbatches: int) -> None:
    """`DeviceKind.instruction_overhead` h on every compute instruction: equal stages of F + h and B + h, so the
    closed form (M + S - 1)(F + B + 2h)."""
    f, b, h = 1.0, 2.0, 0.25
    free = Link(math.inf, 0.0)
    kind_h = DeviceKind("host", math.inf, {"f32": math.inf}, math.inf, instruction_overhead=h)
    module = schedule_module(kind, stages, microbatches, fwd_s=f, bwd_s=b)
    result = simulate(module, cluster=ClusterSpec((kind_h,), stages, free, free))
    assert result.iteration_s == pytest.approx((microbatches + stages - 1) * (f + b + 2 * h))


def test_each_message_costs_the_next_computation() -> None:
    """`DeviceKind.message_overhead` q: each send and receive since a rank's previous compute instruction is paid
    on its next one, or on the optimizer step (the runtime hands sends over at the next instruction that is not a
    send). By hand from the two programs of 1F1B on 2 stages, 3 microbatches (a FREE costs nothing):
    rank 0: F, send, F, send, recv, B, F, send, recv, B, recv, B, step;
    rank 1: recv, F, B, send, recv, F, B, send, recv, F, B, send, step. The step itself costs nothing here."""
    q, h = 0.125, 0.0625
    module = schedule_module("1f1b", 2, 3, fwd_s=1.0, bwd_s=2.0)
    free = Link(math.inf, 0.0)
    priced = DeviceKind("host", math.inf, {"f32": math.inf}, math.inf, instruction_overhead=h, message_overhead=q)
    result = simulate(module, cluster=ClusterSpec((priced,), 2, free, free))
    took: dict[int, list[float]] = {0: [], 1: []}
    for e in result.events():
        if e.instr.kind in (F, B, InstrKind.OPTIMIZER_STEP):
            took[e.rank].append(e.end_s - e.start_s)
    base = {F: 1.0, B: 2.0}
    messages = {0: [0, 1, 2, 0, 2, 1, 0], 1: [1, 0, 2, 0, 2, 0, 1]}
    kinds = {0: [F, F, B, F, B, B], 1: [F, B, F, B, F, B]}
    for r in (0, 1):
        expected = [base[k] + h + q * n for k, n in zip(kinds[r], messages[r], strict=False)] + [q * messages[r][-1]]
        assert took[r] == pytest.approx(expected)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize(("stages", "microbatches"), [(2, 2), (3, 5), (4, 8)])
def test_ranks_on_one_core_take_as_long_as_all_their_work(kind: str, stages: int, microbatches: int) -> None:
    """`ClusterSpec.cores_per_node` = 1 under S ranks: the core is shared and never idle while any rank has work
    (free links: some rank of a pipeline always can go on), so the iteration is all the work, S M (F + B), whatever
    the schedule overlaps; with a core per rank (or more) it is the unshared plan's to the last bit."""
    f, b = 1.0, 2.0
    module = schedule_module(kind, stages, microbatches, fwd_s=f, bwd_s=b)
    one = simulate(module, cluster=_cores_cluster(stages, 1))
    assert one.iteration_s == pytest.approx(stages * microbatches * (f + b))
    unshared = simulate(module, cluster=_cores_cluster(stages, 0))
    for cores in (stages, stages + 1):
        enough = simulate(module, cluster=_cores_cluster(stages, cores))
        assert (enough.starts, enough.ends) == (unshared.starts, unshared.ends)
    # In between: never faster than unshared, nor than the work over the cores; never slower than on one core.
    for cores in range(2, stages):
        some = simulate(module, cluster=_cores_cluster(stages, cores))
        floor = max(unshared.iteration_s, stages * microbatches * (f + b) / cores)
        assert floor - 1e-9 <= some.iteration_s <= one.iteration_s + 1e-9


def test_ranks_sharing_a_core_run_at_half_speed_while_both_compute() -> None:
    """GPipe, 2 stages, 2 microbatches, F = 1, B = 2, one core for both ranks, by hand: rank 0's first forward
    runs alone (0-1); its second and rank 1's first share the core (1-3, each at half speed); rank 1's second
    forward (3-4) and its first backward (4-6) run alone; rank 1's second backward and rank 0's first share the
    core (6-10); rank 0's last backward runs alone (10-12)."""
    module = schedule_module("gpipe", 2, 2, fwd_s=1.0, bwd_s=2.0)
    result = simulate(module, cluster=_cores_cluster(2, 1))
    spans = {
        r: [(e.start_s, e.end_s) for e in result.events() if e.rank == r and e.instr.kind in (F, B)] for r in (0, 1)
    }
    assert spans[0] == [(0.0, 1.0), (1.0, 3.0), (6.0, 10.0), (10.0, 12.0)]
    assert spans[1] == [(1.0, 3.0), (3.0, 4.0), (4.0, 6.0), (6.0, 10.0)]
    assert result.busy_s == pytest.approx([9.0, 9.0])  # the spans as stretched: 6 s of work, 3 s at half speed


def test_ranks_share_only_the_cores_of_their_own_node() -> None:
    """Two nodes of 2 ranks and 1 core each, 1F1B on 4 stages: each node's core does its two stages' work, 2 M
    (F + B) at least, and the plan takes longer than unshared; yet no longer than one core doing all 4 stages."""
    module = schedule_module("1f1b", 4, 8, fwd_s=1.0, bwd_s=2.0)
    per_node = simulate(module, cluster=_cores_cluster(2, 1, nodes=2))
    unshared = simulate(module, cluster=_cores_cluster(2, 0, nodes=2))
    assert per_node.iteration_s >= 2 * 8 * 3.0 - 1e-9
    assert unshared.iteration_s < per_node.iteration_s < simulate(module, cluster=_cores_cluster(4, 1)).iteration_s


def _cores_cluster(per_node: int, cores: int, nodes: int = 1) -> ClusterSpec:
    """Free links and memory, `cores` for each node's `per_node` ranks (0: a core each)."""
    free = Link(math.inf, 0.0)
    kind = DeviceKind("core", math.inf, {"f32": math.inf}, math.inf)
    return ClusterSpec((kind,) * nodes, per_node, free, free, cores_per_node=cores)


def test_microbatch_size_scales_compute_time() -> None:
    """Op times describe cost_batch samples: a microbatch of half as many takes half the time."""
    module = schedule_module("1f1b", 2, 4, fwd_s=1.0, bwd_s=2.0, batch=8, microbatch_size=4)
    assert simulate(module).iteration_s == pytest.approx((4 + 2 - 1) * 1.5)


# -------------------------------------------------------------------------------- memory


@pytest.mark.parametrize(("kind", "stages", "microbatches"), [("1f1b", 4, 8), ("gpipe", 3, 5), ("zb-h1", 4, 8)])
def test_peak_activations_match_schedule_bound(kind: str, stages: int, microbatches: int) -> None:
    """1f1b holds min(S - s, M) microbatches' activations on stage s; gpipe all M; zb-h1 no more than 1f1b's max."""
    act = 1000.0
    result = simulate(schedule_module(kind, stages, microbatches, act_bytes=act))
    for s, peak in enumerate(result.peak_bytes):
        if kind == "1f1b":
            assert peak == act * min(stages - s, microbatches)
        elif kind == "gpipe":
            assert peak == act * microbatches
        else:
            assert peak <= act * min(stages, microbatches)


# ------------------------------------------------------------------ hand-computed with links


def small_cluster(devices: int = 2) -> ClusterSpec:
    """One node of `devices` devices, 100 MB/s links with 1 ms latency, 12 kB/s memory bandwidth."""
    kind = DeviceKind("test", 1e12, {"f32": 1e12}, 12_000.0)
    link = Link(100e6, 1e-3)
    return ClusterSpec((kind,), devices, link, Link(10e6, 1e-2), name="test")


@pytest.fixture
def no_post_headroom(monkeypatch: pytest.MonkeyPatch) -> None:
    """Receives posted early only where they keep the rank's peak (no `post_headroom`): the examples that use it
    were worked out for receives posted at their recv, the rendezvous at its latest."""
    monkeypatch.setattr(peak_memory, "post_headroom", lambda program, sizes: 0.0)


def test_two_stages_two_microbatches_by_hand(no_post_headroom: None) -> None:
    """2 stages, 2 microbatches (1f1b), a 100 MB/s link with 1 ms latency; worked out on paper.

    b = 4 of batch 8: F = 2.0 * 4/8 = 1 s, B = 4.0 * 4/8 = 2 s; h0 moves 40e6 * 4/8 = 20e6 bytes in
    1 ms + 0.2 s = 0.201 s. Rank 0's step: sgd streams 3 * 4000 B of parameters at 12 kB/s = 1 s.
    Rendezvous: bytes move once the receive is posted, a latency after the post at the earliest. Neither
    rank can post its second receive early (two 20e6 B buffers would pass its peak, and there is no headroom), so
    it posts at its recv.
      rank 0: F0 0-1 (h0 at 1.201), F1 1-2 (h0 sent at 2, posted at 4.201, at 4.202 + 0.201 = 4.403),
              B0 4.402-6.402, B1 7.604-9.604 (grad posted at 6.402, sent at 7.403), step -10.604
      rank 1: F0 1.201-2.201, B0 -4.201 (grad at 4.402), F1 4.403-5.403, B1 -7.403 (grad at 7.604), step 0 s
    Memory: act 800 B at batch 8 -> 400 B per microbatch; received tensors 20e6 B; static 2 * 4000 B.
    """
    order = [one_f_one_b_order(s, 2, 2) for s in range(2)]
    module = pipeline_module(
        2, 2, order, fwd_s=2.0, bwd_s=4.0, act_bytes=800.0, out_bytes=40e6, microbatch_size=4, param_elems=1000
    )
    module.stages[1].ops[0].attrs.params = None  # only stage 0 holds a parameter
    module.params = module.params[:1]
    result = simulate(module, cluster=small_cluster())
    assert result.iteration_s == pytest.approx(10.604)
    assert result.busy_s == pytest.approx([1 + 1 + 2 + 2 + 1, 1 + 2 + 1 + 2])
    computes = {(e.rank, e.instr.kind, e.instr.mb): (e.start_s, e.end_s) for e in result.events()}
    assert computes[(0, B, 0)] == pytest.approx((4.402, 6.402))
    assert computes[(1, F, 1)] == pytest.approx((4.403, 5.403))
    assert computes[(0, InstrKind.OPTIMIZER_STEP, None)] == pytest.approx((9.604, 10.604))
    sends = {(e.rank, e.instr.mb): (e.start_s, e.end_s) for e in result.events() if e.instr.kind is InstrKind.SEND}
    assert sends[(0, 1)] == pytest.approx((2.0, 4.403))  # issued at 2, held until rank 1 posts at 4.201
    assert sends[(1, 0)] == pytest.approx((4.201, 4.402))  # posted before it was sent: the closed form
    assert result.peak_bytes == pytest.approx([8000 + 2 * 400 + 20e6, 20e6 + 400])
    path = [(r, module.programs[r].instrs[i]) for r, i in result.critical_path]
    chain = [(r, i.kind, i.mb) for r, i in path if i.kind in (F, B, InstrKind.OPTIMIZER_STEP)]
    assert chain == [
        (0, F, 0),
        (1, F, 0),
        (1, B, 0),
        (1, F, 1),
        (1, B, 1),
        (0, B, 1),
        (0, InstrKind.OPTIMIZER_STEP, None),
    ]


def test_two_stages_two_microbatches_by_hand_with_early_posts() -> None:
    """The example above with one compute's receives of headroom (`post_headroom`, 20e6 B): every receive is
    posted one compute ahead, so no transfer waits for a post.
      rank 0: F0 0-1, F1 1-2 (grad 0 posted at 1, grad 1 at 2), B0 4.402-6.402 (grad 0 sent at 4.201, 0.201 s),
              B1 7.402-9.402 (grad 1 sent at 7.201), step -10.402
      rank 1: F0 1.201-2.201 (h0 of mb 1 posted at 2.201: sent at 2, it moves from 2.202 to 2.403), B0 -4.201,
              F1 4.201-5.201, B1 -7.201
    Memory: rank 0 holds both posted gradients beside its two microbatches' activations, rank 1 both inputs
    beside one microbatch's activations: one 20e6 B buffer more than with every receive at its recv.
    """
    order = [one_f_one_b_order(s, 2, 2) for s in range(2)]
    module = pipeline_module(
        2, 2, order, fwd_s=2.0, bwd_s=4.0, act_bytes=800.0, out_bytes=40e6, microbatch_size=4, param_elems=1000
    )
    module.stages[1].ops[0].attrs.params = None
    module.params = module.params[:1]
    result = simulate(module, cluster=small_cluster())
    computes = {(e.rank, e.instr.kind, e.instr.mb): (e.start_s, e.end_s) for e in result.events()}
    assert computes[(1, B, 0)] == pytest.approx((2.201, 4.201))
    assert computes[(1, F, 1)] == pytest.approx((4.201, 5.201))
    assert computes[(0, B, 0)] == pytest.approx((4.402, 6.402))
    assert computes[(0, B, 1)] == pytest.approx((7.402, 9.402))
    sends = {(e.rank, e.instr.mb): (e.start_s, e.end_s) for e in result.events() if e.instr.kind is InstrKind.SEND}
    assert sends[(0, 1)] == pytest.approx((2.0, 2.403))
    assert sends[(1, 1)] == pytest.approx((7.201, 7.402))
    assert result.iteration_s == pytest.approx(10.402)
    assert result.peak_bytes == pytest.approx([8000 + 2 * 400 + 2 * 20e6, 2 * 20e6 + 400])


def test_a_receive_posted_within_a_latency_of_its_send_holds_the_bytes_until_its_notice_is_back() -> None:
    """Rendezvous: the bytes leave at the later of the send and the post plus the latency (gloo's ready notice).

    1 microbatch over 2 stages, F = 1 s, a 2 s link latency, 100 MB/s, 20e6 B: rank 1 posts h0 at 0, rank 0
    sends it at 1; the notice is back at 2, so h0 arrives at 2 + 0.2 + 2 = 4.2 (eager: 1 + 2.2 = 3.2).
    """
    module = schedule_module("gpipe", 2, 1, fwd_s=2.0, bwd_s=4.0, out_bytes=40e6, microbatch_size=4)
    kind = DeviceKind("test", 1e12, {"f32": 1e12}, math.inf)
    result = simulate(module, cluster=ClusterSpec((kind,), 2, Link(100e6, 2.0), Link(10e6, 1.0), name="slow"))
    sends = {(e.rank, e.instr.grad): (e.start_s, e.end_s) for e in result.events() if e.instr.kind is InstrKind.SEND}
    assert sends[(0, False)] == pytest.approx((1.0, 4.2))
    # Rank 1: F 4.2-5.2, B -7.2; rank 0 posted the gradient at 1, so it leaves at 7.2 and lands at 9.4.
    assert sends[(1, True)] == pytest.approx((7.2, 9.4))
    assert result.iteration_s == pytest.approx(9.4 + 2.0)
    kinds = [(r, module.programs[r].instrs[i].kind) for r, i in result.critical_path]
    assert [k for k in kinds if k[1] in (F, B)] == [(0, F), (1, F), (1, B), (0, B)]


def test_a_rank_that_blocked_goes_on_a_wake_later_and_one_whose_data_was_there_at_once() -> None:
    """`wake_overhead` w: a rank that blocked on a receive runs again w after the data landed (a CPU rank waiting
    for a core); a receive whose data came first costs nothing.

    The example above with w = 0.5: rank 1 blocks for h0 (lands 4.2), so F 4.7-5.7, B -7.7; the gradient leaves at
    7.7 and lands at 9.9, rank 0 (blocked since its F) goes on at 10.4 and its B ends at 12.4 = 11.4 + 2w.
    Two microbatches, rank 0's first free replayed at 30 s: h0 and h1 both land at 4.4 (they share rank 0's port);
    rank 1 blocked for h0 (F0 4.9-5.9) but h1 is there (F1 5.9-6.9, no wake); B0 -8.9, B1 -10.9, g0 lands at 11.1
    and rank 0, blocked since 2.0, runs B0 11.6-13.6; g1 (13.1) is there after the free (13.6-43.6): B1 43.6-45.6.
    """
    kind = DeviceKind("test", 1e12, {"f32": 1e12}, math.inf, wake_overhead=0.5)
    cluster = ClusterSpec((kind,), 2, Link(100e6, 2.0), Link(10e6, 1.0), name="slow")
    module = schedule_module("gpipe", 2, 1, fwd_s=2.0, bwd_s=4.0, out_bytes=40e6, microbatch_size=4)
    result = simulate(module, cluster=cluster)
    computes = {(e.rank, e.instr.kind): (e.start_s, e.end_s) for e in result.events() if e.instr.kind in (F, B)}
    assert computes[(1, F)] == pytest.approx((4.7, 5.7))
    assert computes[(0, B)] == pytest.approx((10.4, 12.4))
    assert result.iteration_s == pytest.approx(11.4 + 2 * 0.5)
    module = schedule_module("gpipe", 2, 2, fwd_s=2.0, bwd_s=4.0, out_bytes=40e6, microbatch_size=4)
    free = next(i for i, ins in enumerate(module.programs[0].instrs) if ins.kind is InstrKind.FREE)
    result = simulate(module, cluster=cluster, durations={(0, free): 30.0})
    computes = {(e.rank, e.instr.kind, e.instr.mb): (e.start_s, e.end_s) for e in result.events()}
    assert computes[(1, F, 0)] == pytest.approx((4.9, 5.9))
    assert computes[(1, F, 1)] == pytest.approx((5.9, 6.9))
    assert computes[(0, B, 0)] == pytest.approx((11.6, 13.6))
    assert computes[(0, B, 1)] == pytest.approx((43.6, 45.6))
    assert result.iteration_s == pytest.approx(45.6)


def test_a_replayed_transfer_takes_its_measured_time_from_the_later_of_send_and_post(no_post_headroom: None) -> None:
    """A send in `durations` is a measured transfer: it lands that long after the later of its send and its
    receive's post, on no link and with no ready notice of its own (the measurement holds them).

    The example above with h0 measured at 0.5 s and the gradient at 0.25 s: h0 sent at 1 (posted at 0) lands at
    1.5; rank 1 runs F 1.5-2.5, B -4.5; the gradient (posted at 1) lands at 4.75; rank 0's B ends at 6.75.
    """
    module = schedule_module("gpipe", 2, 1, fwd_s=2.0, bwd_s=4.0, out_bytes=40e6, microbatch_size=4)
    kind = DeviceKind("test", 1e12, {"f32": 1e12}, math.inf)
    cluster = ClusterSpec((kind,), 2, Link(100e6, 2.0), Link(10e6, 1.0), name="slow")
    send = {
        ins.grad: (r, i)
        for r, p in enumerate(module.programs)
        for i, ins in enumerate(p.instrs)
        if ins.kind is InstrKind.SEND
    }
    result = simulate(module, cluster=cluster, durations={send[False]: 0.5, send[True]: 0.25})
    sends = {(e.rank, e.instr.grad): (e.start_s, e.end_s) for e in result.events() if e.instr.kind is InstrKind.SEND}
    assert sends[(0, False)] == pytest.approx((1.0, 1.5))
    assert sends[(1, True)] == pytest.approx((4.5, 4.75))
    assert result.iteration_s == pytest.approx(6.75)
    assert result.links == []  # a measured transfer takes no link
    # Posted after its send: the hand example's h1 (sent at 2, posted at 4.201), measured at 0.3 s, lands at 4.501.
    order = [one_f_one_b_order(s, 2, 2) for s in range(2)]
    module = pipeline_module(
        2, 2, order, fwd_s=2.0, bwd_s=4.0, act_bytes=800.0, out_bytes=40e6, microbatch_size=4, param_elems=1000
    )
    h1 = next(i for i, ins in enumerate(module.programs[0].instrs) if ins.kind is InstrKind.SEND and ins.mb == 1)
    result = simulate(module, cluster=small_cluster(), durations={(0, h1): 0.3})
    assert (result.starts[0][h1], result.ends[0][h1]) == pytest.approx((2.0, 4.501))


def test_a_transfer_into_a_busy_receiver_moves_slower_while_it_computes(no_post_headroom: None) -> None:
    """`busy_receive_slowdown`: a transfer moves that many times slower while its receiver computes.

    gpipe, 2 stages, 2 microbatches, F = 1 s, B = 2 s, 20e6 B per transfer over 100 MB/s with 0.1 s latency
    (0.3 s). Rank 1 posts h1 early; rank 0 sends it at 2, while rank 1 computes F0 (1.3-2.3). At slowdown 4 the
    0.3 s of F0 it overlaps move 0.075 s of it; the other 0.225 s come once rank 1 waits at its receive: h1
    lands at 2.525 (2.3 without the slowdown, 2.6 where nothing moves while rank 1 computes). Every later
    transfer meets a waiting receiver, so the whole iteration moves by the same 0.225 s (10.0 -> 10.225).
    """

    def run(slowdown: float) -> SimulationResult:
        module = schedule_module("gpipe", 2, 2, fwd_s=2.0, bwd_s=4.0, out_bytes=40e6, microbatch_size=4)
        kind = DeviceKind("test", 1e12, {"f32": 1e12}, math.inf, busy_receive_slowdown=slowdown)
        return simulate(module, cluster=ClusterSpec((kind,), 2, Link(100e6, 0.1), Link(10e6, 1.0), name="cpu"))

    def h1(result: SimulationResult) -> tuple[float, float]:
        return next(
            (e.start_s, e.end_s)
            for e in result.events()
            if e.instr.kind is InstrKind.SEND and not e.instr.grad and e.instr.mb == 1
        )

    plain, slowed, stopped = run(1.0), run(4.0), run(math.inf)
    assert h1(plain) == pytest.approx((2.0, 2.3))
    assert h1(slowed) == pytest.approx((2.0, 2.525))
    assert h1(stopped) == pytest.approx((2.0, 2.6))
    assert (plain.iteration_s, slowed.iteration_s, stopped.iteration_s) == pytest.approx((10.0, 10.225, 10.3))
    f1 = next(e for e in slowed.events() if e.rank == 1 and e.instr.kind is F and e.instr.mb == 1)
    assert (f1.start_s, f1.end_s) == pytest.approx((2.525, 3.525))
    assert slowed.busy_s == plain.busy_s  # only waiting grows


def test_a_send_issued_before_its_post_leaves_once_the_senders_own_work_is_done(no_post_headroom: None) -> None:
    """Where a busy rank's transfers slow down (`busy_receive_slowdown` above 1: the transport's thread shares the
    rank's core), a send whose receive was not posted yet is answered by the sender's transport thread only once
    the instruction of its own the sender runs when the ready notice comes is done.

    gpipe, 2 stages, 2 microbatches, F = 1 s, B = 2 s, a 0.1 s latency, 20e6 B per transfer at 100 MB/s (0.3 s);
    each rank's optimizer step streams 3 * 4000 B at 12 kB/s (1 s). At slowdown 4: rank 1 runs B1 5.525-7.525,
    sends g1 at 7.525 and starts its optimizer step (7.525-8.525); rank 0 posts g1 at its receive after B0, at
    7.825, and the notice reaches rank 1 at 7.925, in its step: the bytes leave at 8.525 and land at 8.825 (8.225
    without the wait); rank 0's B1 8.825-10.825, step -11.825. At slowdown 1 the transport needs no core of the
    rank's: g1 (posted at 7.6, notice at 7.7) lands at 8.0 during rank 1's step, and the iteration is 11.0."""

    def run(slowdown: float) -> SimulationResult:
        module = schedule_module(
            "gpipe", 2, 2, fwd_s=2.0, bwd_s=4.0, out_bytes=40e6, microbatch_size=4, param_elems=1000
        )
        kind = DeviceKind("test", 1e12, {"f32": 1e12}, 12_000.0, busy_receive_slowdown=slowdown)
        return simulate(module, cluster=ClusterSpec((kind,), 2, Link(100e6, 0.1), Link(10e6, 1.0), name="cpu"))

    def g1(result: SimulationResult) -> tuple[float, float]:
        return next(
            (e.start_s, e.end_s)
            for e in result.events()
            if e.instr.kind is InstrKind.SEND and e.instr.grad and e.instr.mb == 1
        )

    held, plain = run(4.0), run(1.0)
    assert g1(held) == pytest.approx((7.525, 8.825))
    assert held.iteration_s == pytest.approx(11.825)
    assert g1(plain) == pytest.approx((7.3, 8.0))
    assert plain.iteration_s == pytest.approx(11.0)


def test_a_replayed_free_slows_a_transfer_into_its_rank_as_a_computation_does() -> None:
    """A load or free that takes time (a replayed step's) is the rank's own work too: a transfer into the rank moves
    `busy_receive_slowdown` times slower during it.

    gpipe, 2 stages, 2 microbatches, F = 1 s, B = 2 s, 0.3 s per transfer, slowdown 4, receives posted early: rank 0
    posts g1 before B0 (5.825-7.825); rank 1 sends it at 7.525. 0.3 s of B0 moves 0.075 s of it; rank 0's first free
    after B0, replayed at 1 s (7.825-8.825), moves the other 0.225 s in 0.9 s: g1 lands at 8.725 (at 8.05 were the
    free not busy). Rank 0 reaches its receive at 8.825 either way: the iteration is 10.825."""
    module = schedule_module("gpipe", 2, 2, fwd_s=2.0, bwd_s=4.0, out_bytes=40e6, microbatch_size=4)
    kind = DeviceKind("test", 1e12, {"f32": 1e12}, math.inf, busy_receive_slowdown=4.0)
    cluster = ClusterSpec((kind,), 2, Link(100e6, 0.1), Link(10e6, 1.0), name="cpu")
    free = next(i for i, ins in enumerate(module.programs[0].instrs) if ins.kind is InstrKind.FREE)
    result = simulate(module, cluster=cluster, durations={(0, free): 1.0})
    g1 = next(e for e in result.events() if e.instr.kind is InstrKind.SEND and e.instr.grad and e.instr.mb == 1)
    assert (g1.start_s, g1.end_s) == pytest.approx((7.525, 8.725))
    assert (result.starts[0][free], result.ends[0][free]) == pytest.approx((7.825, 8.825))
    assert result.iteration_s == pytest.approx(10.825)


def test_the_steady_state_starts_each_rank_where_it_ended_the_step_before() -> None:
    """`steady=True`: steps back to back, as a run takes them. zb-h1, 2 stages, 1 microbatch, ideal links, F = 1 s,
    the backward split in halves (rank 0's stage hands no gradient back: its backward is all weight pass, 2 s), rank
    1's weight pass replayed at 5 s. The first step: rank 0 F 0-1, rank 1 F 1-2, BI 2-3, W 3-8, rank 0 W 3-5; it
    ends at 8 (bubbles 1 - 3/8 and 1 - 7/8). The next: rank 0 starts at 5 (F 5-6), rank 1 at 8 (F 8-9, BI 9-10,
    W 10-15), rank 0 W 10-12: ends 12 and 15, 7 s after the last rank's 8; the one after ends 19 and 22, 7 s
    again: the steady state. Its period is 7 s (bubbles 1 - 3/7 and 0), its times from rank 0's F at 12 (so rank 1
    F 3-4, W 5-10, rank 0 W 5-7). Steps that follow it (`simulate_each`) start where it ended: with the weight pass
    at 1 s, rank 1 runs F 22-23, BI 23-24, W 24-25 and rank 0 W 24-26, 4 s after the last rank's 22."""
    from dapple_ir.sim.simulator import simulate_each
    from dapple_ir.sim.spread import simulate_spread

    module = schedule_module("zb-h1", 2, 1, fwd_s=2.0, bwd_s=4.0, microbatch_size=4)
    weight = next(i for i, ins in enumerate(module.programs[1].instrs) if ins.kind is W)
    slow = {(1, weight): 5.0}
    first = simulate(module, durations=slow)
    assert first.iteration_s == pytest.approx(8.0)
    assert first.bubble_fraction == pytest.approx([1 - 3 / 8, 1 - 7 / 8])
    steady = simulate(module, durations=slow, steady=True)
    assert steady.iteration_s == pytest.approx(7.0)
    assert steady.busy_s == pytest.approx(first.busy_s)
    assert steady.bubble_fraction == pytest.approx([1 - 3 / 7, 0.0])
    computes = {(e.rank, e.instr.kind): (e.start_s, e.end_s) for e in steady.events() if e.instr.kind in (F, BI, W)}
    assert computes[(0, F)] == pytest.approx((0.0, 1.0))
    assert computes[(1, F)] == pytest.approx((3.0, 4.0))
    assert computes[(1, W)] == pytest.approx((5.0, 10.0))
    assert computes[(0, W)] == pytest.approx((5.0, 7.0))
    settled, after = simulate_each(module, [slow, {(1, weight): 1.0}], steady=True)
    assert settled.iteration_s == pytest.approx(7.0)
    assert after.iteration_s == pytest.approx(4.0)
    assert after.bubble_fraction == pytest.approx([1 - 3 / 4, 1 - 3 / 4])
    # The spread's draws as a run's steps: one sample each, so every draw is the steady step.
    spread = simulate_spread(module, samples={(1, weight): [5.0]}, draws=3, steady=True)
    assert spread.iteration_s == pytest.approx(7.0)


def test_allreduce_waits_for_the_whole_group() -> None:
    """Replica 0 runs microbatches 0 and 2, replica 1 only 1: the ring starts when replica 0 arrives.

    The two ranks sit on different nodes (10 MB/s, 10 ms): 2(n-1)/n * 4e6 B / 10e6 B/s + 2(n-1) * 10 ms.
    """
    x = Op("x", OpKind.INPUT, [], TensorType("f32", (2, 4)))
    h = Op("h", OpKind.CALL_MODULE, [x], x.type, "lin", OpAttrs(fwd_s=1.0, bwd_s=2.0, params=("w",)))
    loss = Op("loss", OpKind.OUTPUT, [h], h.type)
    stage = Stage("s0", [x, h, loss], StageAttrs(replicas=2, devices=(0, 2)))
    module = Module(
        "dp",
        [Param("w", TensorType("f32", (1_000_000,)))],
        [x, h, loss],
        stages=[stage],
        attrs=ModuleAttrs(microbatches=3, optimizer="sgd"),
    )
    for rank, mbs in enumerate(([0, 2], [1])):
        instrs = [Instr(kind, stage, mb=m) for m in mbs for kind in (F, B)]
        instrs.append(Instr(InstrKind.ALLREDUCE, stage, group=(0, 1)))
        module.programs.append(RankProgram(f"rank{rank}", instrs, ProgramAttrs(rank=rank, device=2 * rank)))
    verify_module(module)
    cluster = ClusterSpec((small_cluster().node_kinds[0],) * 2, 2, Link(100e6, 1e-3), Link(10e6, 1e-2))
    result = simulate(module, cluster=cluster)
    ring = 2 * 1 / 2 * 4e6 / 10e6 + 2 * 1 * 1e-2
    assert result.iteration_s == pytest.approx(6.0 + ring)
    reduce_events = [e for e in result.events() if e.instr.kind is InstrKind.ALLREDUCE]
    times = [t for e in reduce_events for t in (e.start_s, e.end_s)]
    assert times == pytest.approx([6.0, 6.0 + ring, 3.0, 6.0 + ring])
    assert result.bubble_fraction[1] == pytest.approx(1 - 3.0 / (6.0 + ring))
    # Every member blocks in the ring: with a wake of 0.25 s each goes on that much after it ends.
    woken = dataclasses.replace(small_cluster().node_kinds[0], wake_overhead=0.25)
    late = simulate(module, cluster=dataclasses.replace(cluster, node_kinds=(woken, woken)))
    ends = [e.end_s for e in late.events() if e.instr.kind is InstrKind.ALLREDUCE]
    assert ends == pytest.approx([6.0 + ring + 0.25] * 2)
    # A host that reduces at 1e-7 s a byte (`reduce_per_byte`): each of the 2 members reduces half the 4e6 B, so the
    # ring ends 0.2 s later; the cost model's ring (`pricing.collectives.allreduce_s`) says the same.
    reducing = dataclasses.replace(small_cluster().node_kinds[0], reduce_per_byte=1e-7)
    reduced = dataclasses.replace(cluster, node_kinds=(reducing, reducing))
    summed = simulate(module, cluster=reduced)
    ends = [e.end_s for e in summed.events() if e.instr.kind is InstrKind.ALLREDUCE]
    assert ends == pytest.approx([6.0 + ring + 0.2] * 2)
    assert allreduce_s(Network(reduced), 4e6, [0, 2]) == pytest.approx(ring + 0.2)
    assert allreduce_s(Network(cluster), 4e6, [0, 2]) == pytest.approx(ring)


def test_send_does_not_block_the_sender() -> None:
    """A slow link delays the receiver only: rank 0's next forward starts when the send issues.

    The two 1e9-byte transfers share rank 0's port (100 MB/s): the first runs alone from 1 s to 2 s
    (1e8 bytes), then both at 50 MB/s until the first is through at 2 + 9e8 / 5e7 = 20 s; the second,
    alone again, has 1e8 bytes left: 21 s. Each arrives 1 ms (the latency) later.
    """
    order = [gpipe_order(s, 2, 2) for s in range(2)]
    module = pipeline_module(2, 2, order, out_bytes=1e9)
    result = simulate(module, cluster=small_cluster())
    starts = {(e.rank, e.instr.kind, e.instr.mb): e.start_s for e in result.events()}
    assert starts[(0, F, 1)] == pytest.approx(1.0)
    assert starts[(1, F, 0)] == pytest.approx(20.001)
    assert starts[(1, F, 1)] == pytest.approx(21.001)


def test_deadlock_names_the_stuck_ranks() -> None:
    order = [[(F, 0, 0)], [(F, 1, 0)]]
    module = pipeline_module(2, 1, order)
    # Make rank 0 wait for something rank 1 never sends.
    module.programs[0].instrs.insert(0, Instr(InstrKind.RECV, value=module.ops[2], grad=True, mb=0, peer=1))
    with pytest.raises(DappleError, match=r"deadlock[\s\S]*rank 0 waits at instruction 0[\s\S]*rank 1 waits"):
        simulate(module)


def test_plan_without_programs_is_refused() -> None:
    with pytest.raises(DappleError, match="no rank programs"):
        simulate(Module("empty"))


def test_reads_ir_file_and_plan_directory(tmp_path) -> None:  # type: ignore[no-untyped-def]
    module = schedule_module("1f1b", 3, 4)
    (tmp_path / "plan.dapple").write_text(print_module(module))
    expected = (4 + 3 - 1) * 3.0
    assert simulate(tmp_path).iteration_s == pytest.approx(expected)
    assert simulate(str(tmp_path / "plan.dapple")).iteration_s == pytest.approx(expected)
    assert math.isclose(simulate(module, cluster="1x4xV100-16GB").iteration_s, expected, rel_tol=1e-6)


def test_summary_lists_every_rank() -> None:
    text = simulate(schedule_module("1f1b", 4, 8)).summary()
    lines = text.splitlines()
    assert len(lines) == 1 + 4 + 1
    assert "27.3" in lines[1]  # bubble (S-1)/(M+S-1) = 3/11


def test_simulator_imports_neither_torch_nor_matplotlib() -> None:
    import subprocess
    import sys

    code = (
        "import sys, dapple_ir.sim.simulator, dapple_ir.sim.trace, dapple_ir.sim.drawing, dapple_ir.commands.simulate; "
        "print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_replayed_durations_replace_the_modelled_ones(kind: str) -> None:
    """A measured step replayed: every compute twice its modelled time doubles the closed form; the first forward
    X longer on the first rank (on the critical path of both schedules) adds X; the rest is the model's."""
    stages, microbatches, f, b, x = 3, 4, 1.0, 2.0, 0.75
    module = schedule_module(kind, stages, microbatches, fwd_s=f, bwd_s=b)
    closed = (microbatches + stages - 1) * (f + b)
    compute = {InstrKind.FORWARD: f, InstrKind.BACKWARD: b}
    doubled = {
        (r, i): 2 * compute[ins.kind]
        for r, p in enumerate(module.programs)
        for i, ins in enumerate(p.instrs)
        if ins.kind in compute
    }
    assert simulate(module, durations=doubled).iteration_s == pytest.approx(2 * closed)
    first = next(i for i, ins in enumerate(module.programs[0].instrs) if ins.kind is InstrKind.FORWARD)
    assert simulate(module, durations={(0, first): f + x}).iteration_s == pytest.approx(closed + x)
    with pytest.raises(DappleError, match="rank 0 has no instruction 999"):
        simulate(module, durations={(0, 999): 1.0})


def test_a_replayed_free_is_host_work_that_overlaps_a_wait_before_it_delays() -> None:
    """1F1B, 2 stages, 2 microbatches, f = 1, b = 2: iteration (M + S - 1)(f + b) = 9. Rank 0 frees after its
    first backward (ends at 6) and then waits for the last gradient until 7: a replayed free of y <= 1 there hides in
    that wait, one of 1 + x delays the end by x. Rank 1's free after its first backward sits right before its
    second forward, on the critical path: it adds its whole time. Either way the rank is busy for it."""
    f, b = 1.0, 2.0
    module = schedule_module("1f1b", 2, 2, fwd_s=f, bwd_s=b)
    closed = 3 * (f + b)
    base = simulate(module)
    assert base.iteration_s == pytest.approx(closed)

    def first_free(rank: int) -> int:
        return next(i for i, ins in enumerate(module.programs[rank].instrs) if ins.kind is InstrKind.FREE)

    hidden = simulate(module, durations={(0, first_free(0)): 0.75})
    assert hidden.iteration_s == pytest.approx(closed)
    assert hidden.busy_s[0] == pytest.approx(base.busy_s[0] + 0.75)
    assert simulate(module, durations={(0, first_free(0)): 1.5}).iteration_s == pytest.approx(closed + 0.5)
    delayed = simulate(module, durations={(1, first_free(1)): 0.25})
    assert delayed.iteration_s == pytest.approx(closed + 0.25)
    assert delayed.busy_s[1] == pytest.approx(base.busy_s[1] + 0.25)
