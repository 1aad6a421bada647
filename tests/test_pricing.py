"""One physics: on small random problems the DP's own objective is `evaluate`'s price of the plan it returns, the
ILP's optimum is exhaustive search's, and the cost model stays within 15 % of the simulator on every candidate the
planner lists (issue 43). The clusters include calibrated CPU ones, whose hosts charge per instruction, per message,
per reduced byte and per split backward."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dapple_ir.cluster.spec import ClusterSpec, DeviceKind, Link
from dapple_ir.cluster.toml_file import load_cluster_toml
from dapple_ir.ir import InstrKind, Module
from dapple_ir.planner.cost_model import Problem, candidate, evaluate, split_stages
from dapple_ir.planner.dp import solve_priced
from dapple_ir.planner.ilp import solve_ilp
from dapple_ir.pricing.collectives import allreduce_s
from dapple_ir.pricing.pipeline import in_flight, replica_in_flight, split_backwards
from dapple_ir.schedules import ScheduleRequest, StageMemory, build_schedule, warmups
from tests.test_planner_exact import _exhaustive

GB = 1e9


def _cluster(rng: random.Random, devices: int, calibrated: bool) -> ClusterSpec:
    """A one-node cluster of `devices`: a V100-like GPU, or a CPU with the host costs `dapple calibrate` measures."""
    if not calibrated:
        kind = DeviceKind("gpu", 16 * GB, {"f32": 14e12}, 900e9)
        return ClusterSpec((kind,), devices, Link(rng.uniform(5e9, 50e9), 5e-6), Link(10e9, 1e-5), name="gpu")
    kind = DeviceKind(
        "cpu",
        16 * GB,
        {"f32": 50e9},
        rng.uniform(5e9, 10e9),
        split_backward_overhead=rng.uniform(0.0, 2e-4),
        split_backward_per_byte=rng.uniform(0.0, 2e-10),
        instruction_overhead=rng.uniform(0.0, 5e-3),
        message_overhead=rng.uniform(0.0, 1e-3),
        reduce_per_byte=rng.uniform(0.0, 1e-9),
    )
    return ClusterSpec((kind,), devices, Link(rng.uniform(1e9, 4e9), 4e-5), Link(1e9, 1e-4), name="calibrated")


def _random_problem(seed: int, layers: int, devices: int, calibrated: bool, tied: bool) -> Problem:
    rng = random.Random(seed)
    cluster = _cluster(rng, devices, calibrated)
    per_layer = cluster.device(0).memory_bytes / 8
    grads = [rng.uniform(0.001, 0.05) * GB for _ in range(layers)]
    static = [g * 4 for g in grads]
    return Problem(
        fwd_s=[rng.uniform(0.002, 0.05) for _ in range(layers)],
        bwd_s=[rng.uniform(0.004, 0.10) for _ in range(layers)],
        act_bytes=[rng.uniform(0.01, 0.2) * per_layer for _ in range(layers)],
        static_bytes=static,
        grad_bytes=grads,
        cut_bytes=[*(rng.uniform(0.001, 0.05) * GB for _ in range(layers - 1)), 0.0],
        cluster=cluster,
        global_batch=8,
        cost_batch=8,
        batch=8,
        weight_ops=[rng.randint(0, 4) for _ in range(layers)],
        weight_op_bytes=grads,
        # A parameter the first and second layer both read (a tied embedding): counted once where they share a stage.
        tied=[(min(grads[0], grads[1]), (0, 1))] if tied else [],
    )


SCHEDULES = ("1f1b", "gpipe", "zb-h1")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    layers=st.integers(2, 5),
    devices=st.integers(1, 4),
    calibrated=st.booleans(),
    schedule=st.sampled_from(SCHEDULES),
    microbatches=st.sampled_from([1, 2, 4, 8]),
)
def test_the_dp_objective_is_the_cost_models_price_and_the_optimum(
    seed: int, layers: int, devices: int, calibrated: bool, schedule: str, microbatches: int
) -> None:
    problem = _random_problem(seed, layers, devices, calibrated, tied=False)
    found = solve_priced(problem, microbatches, schedule, "append-first", front=None)
    best = _exhaustive(problem, microbatches, schedule)
    if found is None:
        assert best == math.inf
        return
    cand, objective = found
    assert objective == pytest.approx(evaluate(problem, cand).iteration_s, rel=1e-9)
    assert objective == pytest.approx(best, rel=1e-9)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    layers=st.integers(2, 4),
    devices=st.integers(2, 3),
    calibrated=st.booleans(),
    schedule=st.sampled_from(SCHEDULES),
    microbatches=st.sampled_from([2, 4]),
)
def test_the_ilp_optimum_is_exhaustive_search(
    seed: int, layers: int, devices: int, calibrated: bool, schedule: str, microbatches: int
) -> None:
    problem = _random_problem(seed, layers, devices, calibrated, tied=False)
    stages = 2
    solution = solve_ilp(problem, stages, microbatches, schedule, time_limit_s=20.0)
    best = _exhaustive(problem, microbatches, schedule, stages=stages)
    if solution is None:
        assert best == math.inf
        return
    assert solution.optimal
    # Times are integers of 1e-8 of the whole work in the model: equal up to that unit.
    assert solution.estimate.iteration_s == pytest.approx(best, rel=1e-5)


def test_a_tied_parameter_in_one_stage_is_counted_once() -> None:
    problem = _random_problem(3, 3, 1, calibrated=False, tied=True)
    nbytes = problem.tied[0][0]
    assert problem.grads_of(0, 3) == pytest.approx(sum(problem.grad_bytes) - nbytes)
    assert problem.static_of(0, 3) == pytest.approx(sum(problem.static_bytes) - 4 * nbytes)
    # Split between two stages, each counts its copy: the tied allreduce sums them across.
    assert problem.grads_of(0, 1) + problem.grads_of(1, 3) == pytest.approx(sum(problem.grad_bytes))


def test_one_ring_price_for_every_reader() -> None:
    """The host's reduction is in the ring the solvers read (it was missing from the DP and the ILP)."""
    problem = _random_problem(5, 2, 4, calibrated=True, tied=False)
    ring = problem.ring([0, 1, 2, 3])
    nbytes = 8 * 2**20
    kind = problem.cluster.device(0)
    link = 2 * 3 / 4 * nbytes / problem.cluster.intra.bandwidth + 2 * 3 * problem.cluster.intra.latency
    assert ring.seconds(nbytes) == pytest.approx(link + 3 / 4 * nbytes * kind.reduce_per_byte)
    assert ring.fixed_s + ring.per_byte_s * nbytes == pytest.approx(ring.seconds(nbytes))
    assert allreduce_s(problem.network, nbytes, [0, 1, 2, 3]) == ring.seconds(nbytes)


def _random_profile(rng: random.Random, layers: int, path: Path) -> None:
    """A PipeDream-format profile of a chain of `layers` nodes with random costs (milliseconds, bytes)."""
    lines = []
    for k in range(layers):
        fwd, bwd = rng.uniform(0.5, 8.0), rng.uniform(1.0, 16.0)
        act, params = rng.uniform(1e5, 4e6), rng.choice([0.0, rng.uniform(1e4, 4e6)])
        lines.append(
            f"node{k} -- Linear{k} -- forward_compute_time={fwd:.3f}, backward_compute_time={bwd:.3f}, "
            f"activation_size={act:.1f}, parameter_size={params:.1f}"
        )
    lines += [f"\tnode{k} -- node{k + 1}" for k in range(layers - 1)]
    path.write_text("\n".join(lines) + "\n")


_CPU_TOML = """name = "calibrated"
devices_per_node = {devices}
node_devices = ["cpu"]

[device_kinds."cpu"]
memory_bytes = 12e9
peak_flops = {{ "f32" = 5e10 }}
mem_bandwidth = 7.5e9
instruction_overhead = {instruction}
message_overhead = {message}
reduce_per_byte = {reduce}
split_backward_overhead = 6e-6
split_backward_per_byte = 1.4e-10

[fabric]
kind = "switch"
bandwidth = 2.1e9
latency = 3.6e-5

[network]
cards = 0
bandwidth = 1e9
latency = 1e-4
"""


@pytest.mark.slow
@settings(
    max_examples=8,
    deadline=None,
    derandomize=True,  # the same 8 examples on every run: a random draw found the zb-h1 gap below in CI's stead
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(seed=st.integers(0, 10**6), devices=st.sampled_from([2, 4]), layers=st.integers(4, 10))
def test_the_estimate_is_within_15_percent_of_the_simulation_on_every_listed_candidate(
    tmp_path: Path, seed: int, devices: int, layers: int
) -> None:
    _estimate_within_15_percent(tmp_path, seed, devices, layers)


@pytest.mark.slow
def test_the_estimate_meets_zb_h1_at_many_microbatches(tmp_path: Path) -> None:
    """The example a random draw found (2 stages, M=32, zb-h1): the estimate said 240.0 ms and the simulation 201.8.
    The estimate charged the second stage a split backward (one more autograd pass per weight op, 1.3 ms a
    microbatch on this cluster); the simulator charged none and kept no bytes for the weight pass, since it looked
    for floating inputs where a profile's layers are opaque (yet `lower-comm` sends their gradients back). Counted
    (`peak_memory.hands_back`), those bytes would lift the stage past 1f1b's fullest rank, so the schedule runs its
    backward whole; the estimate now reads that choice (`pricing.pipeline.split_backwards`)."""
    _estimate_within_15_percent(tmp_path, 280487, 2, 7)


def test_gpipe_is_two_flow_shops() -> None:
    """On one replica a stage with free links gpipe takes sum(F + B) + (M - 1)(max F + max B): its forwards, then its
    backwards, each a flow shop of identical jobs. With the slowest forward and the slowest backward on different
    stages that is more than any one stage's M (F + B) plus the path around it, which the recursion priced before."""
    kind = DeviceKind("gpu", 16 * GB, {"f32": 14e12}, 900e9)
    cluster = ClusterSpec((kind,), 3, Link(1e15, 0.0), Link(1e15, 0.0), name="free")
    problem = Problem(
        fwd_s=[0.03, 0.01, 0.01],
        bwd_s=[0.01, 0.02, 0.05],
        act_bytes=[1e6] * 3,
        static_bytes=[1e6] * 3,
        grad_bytes=[0.0] * 3,
        cut_bytes=[0.0] * 3,
        cluster=cluster,
        global_batch=8,
        cost_batch=8,
        batch=8,
    )
    for m in (1, 2, 8):
        cand = candidate(problem, [0, 1, 2, 3], [1, 1, 1], m, "gpipe", "append-first", "test")
        assert cand is not None
        pf, pb = problem.times_at(problem.microbatch_size(m))
        fwd = [pf[k + 1] - pf[k] for k in range(3)]
        bwd = [pb[k + 1] - pb[k] for k in range(3)]
        want = sum(fwd) + sum(bwd) + (m - 1) * (max(fwd) + max(bwd))
        assert evaluate(problem, cand).pipeline_s == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_estimate_meets_the_simulation_on_random_candidates(tmp_path: Path, schedule: str) -> None:
    """Random cuts and replica counts of random profiles, priced by the cost model and simulated from the lowered
    programs: within 15 % on every one (1f1b: every one in the solvers' space, no stage warming up for a later one's
    replicas). Before, gpipe priced one stage at a time was up to 21 % under where the slowest forward and the slowest
    backward sit on different stages (seed 287600's two stages of two replicas at M = 32: 72.3 ms against the
    simulation's 86.5), and 1f1b with one replica feeding two up to 23 % over (seed 209: 160.6 ms against 130.9): the
    stagger of the second replica was charged to every round trip."""
    from dapple_ir.passes.plan import lowered_trial
    from dapple_ir.planner.cost_model import problem_from_module
    from dapple_ir.pricing.ops import OpPrices
    from dapple_ir.pricing.pipeline import raised_warmups
    from dapple_ir.sim.simulator import simulate

    cases = [
        (287600, 4, 7, [0, 4, 7], [2, 2], 32),
        (209, 3, 6, [0, 4, 6], [1, 2], 32),
        (257, 3, 4, [0, 2, 4], [1, 2], 32),
    ]
    rng = random.Random(43)
    for seed in range(40):
        devices, layers = rng.choice([2, 3, 4]), rng.randint(3, 9)
        stages = rng.randint(2, min(layers, devices))
        replicas = [1] * stages
        for k in rng.sample(range(stages), devices - stages):
            replicas[k] += 1
        cases.append((seed, devices, layers, [0, *sorted(rng.sample(range(1, layers), stages - 1)), layers], replicas,
                      rng.choice([4, 8, 16, 32])))  # fmt: skip
    checked = 0
    for seed, devices, layers, bounds, replicas, m in cases:
        if raised_warmups(schedule, replicas, [False] * len(replicas), m):
            continue
        module = _profile_module(tmp_path, seed, layers)
        cluster = tmp_path / f"c{seed}.toml"
        cluster.write_text(_CPU_TOML.format(devices=devices, instruction=2e-4, message=5e-5, reduce=5e-10))
        problem = problem_from_module(module, load_cluster_toml(str(cluster)), 32)
        cand = candidate(problem, bounds, replicas, m, schedule, "append-first", "test")
        assert cand is not None
        model = evaluate(problem, cand).iteration_s
        trial, _notes = lowered_trial(module, problem, cand)
        sim = simulate(trial, cluster=problem.cluster, prices=OpPrices(module, problem.cluster)).iteration_s
        assert abs(model - sim) <= 0.15 * sim, (seed, bounds, replicas, m, model, sim)
        checked += 1
    assert checked >= 30


def test_the_estimate_pays_the_rendezvous_on_a_slow_fabric(tmp_path: Path) -> None:
    """A message whose receive is posted after its send takes a latency more than its transfer (the ready notice on
    its way: both transports rendezvous), and the runtime posts a receive one compute ahead. On a fabric with 4 ms of
    latency (what `dapple calibrate` measured on this VM under load) a stage waits for every input and gradient its
    shorter compute cannot hide: priced with one latency per transfer, the estimate was up to 28 % under the
    simulation on the GPT example, and is here on 2-stage 1f1b plans of random profiles."""
    from dapple_ir.passes.plan import lowered_trial
    from dapple_ir.planner.cost_model import problem_from_module
    from dapple_ir.pricing.ops import OpPrices
    from dapple_ir.sim.simulator import simulate

    rng = random.Random(44)
    for seed in range(12):
        layers = rng.randint(3, 8)
        module = _profile_module(tmp_path, seed, layers)
        cluster = tmp_path / f"c{seed}.toml"
        text = _CPU_TOML.format(devices=2, instruction=5e-4, message=1e-4, reduce=5e-10)
        cluster.write_text(text.replace("latency = 3.6e-5", "latency = 4e-3"))
        problem = problem_from_module(module, load_cluster_toml(str(cluster)), 32)
        m = rng.choice([4, 8, 16])
        cand = candidate(problem, [0, rng.randint(1, layers - 1), layers], [1, 1], m, "1f1b", "append-first", "t")
        assert cand is not None
        model = evaluate(problem, cand).iteration_s
        trial, _notes = lowered_trial(module, problem, cand)
        sim = simulate(trial, cluster=problem.cluster, prices=OpPrices(module, problem.cluster)).iteration_s
        assert abs(model - sim) <= 0.15 * sim, (seed, cand.stages, m, model, sim)


def _profile_module(tmp_path: Path, seed: int, layers: int) -> Module:
    from dapple_ir.frontend.profile_import import import_profile
    from dapple_ir.pass_manager import PassManager, build_pipeline

    profile = tmp_path / f"p{seed}-pbs-8.txt"
    _random_profile(random.Random(seed), layers, profile)
    module = import_profile(str(profile))
    PassManager(build_pipeline("coarsen")).run(module)
    return module


def test_a_stage_hands_back_where_lower_comm_sends_a_gradient(tmp_path: Path) -> None:
    """`Problem.hands_back` of every layer range is `peak_memory.hands_back` of its ops, and where the lowered
    programs send a gradient back (an imported profile's opaque layers too)."""
    from dapple_ir.analysis.peak_memory import hands_back
    from dapple_ir.analysis.stage_graph import values_needing_grad
    from dapple_ir.cluster.spec import parse_shorthand
    from dapple_ir.passes.plan import lowered_trial
    from dapple_ir.planner.cost_model import candidate, problem_from_module

    module = _profile_module(tmp_path, 280487, 7)
    problem = problem_from_module(module, parse_shorthand("1x2xV100-16GB"), 32)
    needing = values_needing_grad(module)
    for lo in range(problem.layers):
        for hi in range(lo + 1, problem.layers + 1):
            ops = [op for layer in module.layers[lo:hi] for op in layer.ops]
            assert problem.hands_back(lo, hi) == hands_back(ops, needing) == (lo > 0)
    cand = candidate(problem, [0, 3, problem.layers], [1, 1], 4, "1f1b", "append-first", "test")
    assert cand is not None
    trial, _notes = lowered_trial(module, problem, cand)
    sent = {i.value for p in trial.programs for i in p.instrs if i.kind is InstrKind.SEND and i.grad}
    assert [any(v in sent for op in st.ops for v in op.operands) for st in trial.stages] == [False, True]


@settings(max_examples=80, deadline=None)
@given(
    stages=st.integers(1, 5),
    microbatches=st.integers(1, 48),
    data=st.data(),
)
def test_split_backwards_are_the_stages_whose_orders_split(stages: int, microbatches: int, data: st.DataObject) -> None:
    """`split_backwards` (no weight pass deferred fits under 1f1b's fullest rank, on fewer periods of the order)
    against the orders zb-h1 builds over all M: a stage splits where one of them runs an input pass."""
    replicas = tuple(data.draw(st.integers(1, 3)) for _ in range(stages))
    size = st.floats(0.0, 4.0)
    memory = tuple(
        StageMemory(
            static=data.draw(st.floats(0.0, 20.0)),
            activation=data.draw(st.floats(0.1, 4.0)),
            received=data.draw(size),
            gradient=data.draw(size),
            weight_pass=data.draw(size),
            rerun=data.draw(st.sampled_from([0.0, 1.0])),
        )
        for _ in range(stages)
    )
    orders = build_schedule("zb-h1", ScheduleRequest(replicas, microbatches, 1, memory))
    split = [any(w.kind is InstrKind.BACKWARD_INPUT for (g, _j), order in orders.items() if g == s for w in order)
             for s in range(stages)]  # fmt: skip
    assert split_backwards(replicas, microbatches, memory) == split


def test_the_estimate_splits_the_backwards_the_schedule_splits(tmp_path: Path) -> None:
    """zb-h1 runs a stage's backward whole where splitting it would hold more than 1f1b's fullest rank: the stages
    the estimate finds from the problem's bytes (`split_stages`) are those whose lowered programs run input passes."""
    from dapple_ir.passes.plan import lowered_trial
    from dapple_ir.planner.cost_model import candidate, problem_from_module

    module = _profile_module(tmp_path, 280487, 7)
    cluster = tmp_path / "c.toml"
    cluster.write_text(_CPU_TOML.format(devices=4, instruction=1e-4, message=1e-4, reduce=0.0))
    problem = problem_from_module(module, load_cluster_toml(str(cluster)), 32)
    seen = set()
    for bounds in ([0, 3, 7], [0, 5, 7], [0, 1, 2, 7], [0, 2, 4, 6, 7]):
        for m in (4, 32):
            n = len(bounds) - 1
            cand = candidate(problem, bounds, [1] * n, m, "zb-h1", "append-first", "test")
            assert cand is not None
            trial, _notes = lowered_trial(module, problem, cand)
            split = [any(i.kind is InstrKind.BACKWARD_INPUT for i in p.instrs) for p in trial.programs]
            assert split_stages(problem, cand) == split
            seen.add(tuple(split))
    assert len(seen) > 1  # some stage runs whole backwards, some split


def _estimate_within_15_percent(tmp_path: Path, seed: int, devices: int, layers: int) -> None:
    from dapple_ir.api import compile as compile_plan

    rng = random.Random(seed)
    profile = tmp_path / f"p{seed}-pbs-8.txt"
    _random_profile(rng, layers, profile)
    cluster = tmp_path / f"c{seed}.toml"
    cluster.write_text(
        _CPU_TOML.format(
            devices=devices,
            instruction=rng.uniform(0.0, 1e-3),
            message=rng.uniform(0.0, 2e-4),
            reduce=rng.uniform(0.0, 1e-9),
        )
    )
    result = compile_plan(f"profile:{profile}", cluster=str(cluster), global_batch=32, explain=True)
    rows = [line.split() for line in result.explain if line.strip()[:1].isdigit()]
    assert rows
    for row in rows:
        model_ms, sim_ms = _model_and_sim(row)
        if sim_ms is None:
            continue
        assert abs(model_ms - sim_ms) <= 0.15 * sim_ms, " ".join(row)


def _model_and_sim(row: list[str]) -> tuple[float, float | None]:
    """The model's and the simulator's milliseconds of an `--explain` row (the columns after the schedule)."""
    numbers = [w for w in row if _is_number(w)]
    # #, S, [P], M come first as integers; the first two decimals are model ms and sim ms ('-' when unsimulated).
    decimals = [float(w) for w in numbers if "." in w]
    sim = row[row.index(next(w for w in row if "." in w and _is_number(w))) + 1]
    return decimals[0], (float(sim) if _is_number(sim) else None)


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _held_by_order(schedule: str, replicas: tuple[int, ...], microbatches: int, stage: int) -> int:
    """The most microbatches replica 0 of `stage` holds at once in the schedule's own order: forwards run whose
    backward (or, split, whose weight pass) has not."""
    from dapple_ir.ir import InstrKind
    from dapple_ir.schedules import ScheduleRequest, build_schedule

    orders = build_schedule(schedule, ScheduleRequest(replicas, microbatches))
    ends = {InstrKind.BACKWARD, InstrKind.BACKWARD_WEIGHT}
    live = peak = 0
    for work in orders[(stage, 0)]:
        live += work.kind is InstrKind.FORWARD
        live -= work.kind in ends
        peak = max(peak, live)
    return peak


@settings(max_examples=60, deadline=None)
@given(
    stages=st.integers(1, 6),
    microbatches=st.integers(1, 16),
    schedule=st.sampled_from(["1f1b", "gpipe", "zb-h1"]),
    data=st.data(),
)
def test_in_flight_is_what_the_schedules_order_holds(
    stages: int, microbatches: int, schedule: str, data: st.DataObject
) -> None:
    """The one activations-in-flight rule (`pricing.pipeline.in_flight`) against the order each schedule builds:
    exact for gpipe, and for 1f1b wherever a stage's replicas each keep S - s in flight; where a later stage's replicas
    need more (`schedules.warmups`: more replicas after fewer), the stage warms up with what they need, and what its
    busiest replica holds is `replica_in_flight`'s count, exactly. zb-h1 defers weight passes only while its rank holds
    no more than 1f1b's fullest rank, so counted in microbatches (no byte sizes given) no stage holds more than 1f1b's
    fullest stage."""
    uniform = data.draw(st.booleans())
    first = data.draw(st.integers(1, 3))
    replicas = tuple(first if uniform else data.draw(st.integers(1, 3)) for _ in range(stages))
    for s in range(stages):
        per = len(range(0, microbatches, replicas[s]))
        if per == 0:
            continue
        held = _held_by_order(schedule, replicas, microbatches, s)
        rule = in_flight(schedule, stages - s, per)
        unsplit = [False] * stages
        if schedule == "zb-h1":
            assert held <= max(rule, *replica_in_flight("1f1b", replicas, unsplit, microbatches))
            continue
        assert held == replica_in_flight(schedule, replicas, unsplit, microbatches)[s]
        if schedule == "gpipe" or warmups(ScheduleRequest(replicas, microbatches))[s] == min(
            (stages - s) * replicas[s], microbatches
        ):
            assert held == rule


@settings(max_examples=60, deadline=None)
@given(groups=st.integers(1, 5), virtual=st.integers(2, 3), rounds=st.integers(1, 4), data=st.data())
def test_interleaved_held_walks_the_order_and_holds_at_least_1f1b_on_its_groups(
    groups: int, virtual: int, rounds: int, data: st.DataObject
) -> None:
    """The estimate's interleaved rule is its order, walked (`interleaved_held`, each chunk at its own size): exact
    against a walk of the built order written here, and with equal chunks never below 1f1b on the same device
    groups (Megatron's interleaving holds more than 1F1B)."""
    from dapple_ir.ir import InstrKind
    from dapple_ir.pricing.pipeline import interleaved_held
    from dapple_ir.schedules import build_schedule

    stages = groups * virtual
    microbatches = groups * rounds
    act = [data.draw(st.floats(0.5, 4.0)) for _ in range(stages)]
    held = interleaved_held((1,) * stages, microbatches, virtual, groups, act)
    equal = interleaved_held((1,) * stages, microbatches, virtual, groups, [1.0] * stages)
    orders = build_schedule("interleaved", ScheduleRequest((1,) * stages, microbatches, virtual))
    for g in range(groups):
        live: dict[int, int] = {}
        peak = 0.0
        for work in orders[(g, 0)]:
            live[work.stage] = live.get(work.stage, 0) + (1 if work.kind is InstrKind.FORWARD else -1)
            peak = max(peak, sum(count * act[k] for k, count in live.items()))
        assert held[g] == pytest.approx(peak)
        assert equal[g] >= virtual * in_flight("1f1b", groups - g, microbatches)


def test_zero_one_is_priced_alike_by_the_cost_model_and_the_simulator() -> None:
    """A ZeRO-1 stage's reduce-scatter, shard step and all-gather: the simulator runs the two halves of the ring and
    steps 1/R of the stage's parameters, as `Problem.gradient_tail_s` prices them; its replicas hold less."""
    import dataclasses

    from dapple_ir.cluster.spec import parse_shorthand
    from dapple_ir.frontend.profile_import import import_profile
    from dapple_ir.pass_manager import PassManager, build_pipeline
    from dapple_ir.passes.plan import lower_and_simulate
    from dapple_ir.planner.cost_model import candidate, problem_from_module
    from tests.paths import PROFILES

    module = import_profile(str(PROFILES / "dapple-vgg-19-pbs-32.txt"))
    module.attrs.optimizer = "adam"
    PassManager(build_pipeline("coarsen")).run(module)
    problem = problem_from_module(module, parse_shorthand("2x8xV100-16GB"), 512)
    layers = problem.layers
    for replicas, bounds in (([16], [0, layers]), ([15, 1], [0, layers - 3, layers])):
        plain = candidate(problem, bounds, replicas, 64, "1f1b", "append-first", "test")
        assert plain is not None
        sharded = dataclasses.replace(plain, zero=tuple(r > 1 for r in replicas))
        times = {}
        for cand in (plain, sharded):
            estimate = evaluate(problem, cand)
            simulated, peak = lower_and_simulate(module, problem, cand)
            assert estimate.iteration_s == pytest.approx(simulated, rel=1e-6)
            assert max(estimate.stage_peak_bytes) == pytest.approx(peak, rel=0.02)
            times[cand.zero] = (simulated, peak)
        (plain_s, plain_peak), (sharded_s, sharded_peak) = times[plain.zero], times[sharded.zero]
        assert sharded_s < plain_s and sharded_peak < plain_peak
