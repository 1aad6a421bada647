"""Tensor parallelism planned, lowered, priced and simulated: the GPT example compiled with `--tensor-parallel`, each
rank's program against the rules `lower-comm` states, the simulator's prices of a tensor-parallel stage against the
closed form written out here, and the planner's choice of T on its own."""

from __future__ import annotations

from collections import Counter
from functools import cache

import pytest

from dapple_ir import api
from dapple_ir.analysis.peak_memory import transfer_bytes
from dapple_ir.analysis.tensor_shards import backward_reduces, forward_reduces, summed_bytes
from dapple_ir.cluster.spec import parse_shorthand
from dapple_ir.cluster.topology import Network
from dapple_ir.errors import DappleError
from dapple_ir.ir import InstrKind, Module
from dapple_ir.planner.cost_model import evaluate, problem_from_module
from dapple_ir.planner.dp import solve_priced
from dapple_ir.pricing.collectives import ring_allreduce
from dapple_ir.pricing.ops import OpPrices
from dapple_ir.pricing.tensor import expand_devices, grouped_cluster
from dapple_ir.sim.simulator import simulate
from tests.paths import ROOT

GPT = str(ROOT / "examples" / "gpt.py") + ":factory"


@cache
def _gpt_t2(cluster: str = "4xcpu") -> Module:
    result = api.compile(GPT, cluster=cluster, global_batch=8, stages=2, microbatches=4, tensor_parallel=2)
    return result.module


def test_each_replica_runs_on_a_tensor_group_of_ranks() -> None:
    module = _gpt_t2()
    assert [s.tp for s in module.stages] == [2, 2]
    assert [s.attrs.devices for s in module.stages] == [(0, 1), (2, 3)]
    assert [p.attrs.tensor_rank or 0 for p in module.programs] == [0, 1, 0, 1]
    # Members of a group run the same compute in the same order.
    for a, b in ((0, 1), (2, 3)):
        compute = [
            [
                (i.kind, i.stage.name, i.mb)
                for i in module.programs[r].instrs
                if i.stage is not None and i.mb is not None
            ]
            for r in (a, b)
        ]
        assert compute[0] == compute[1]


def test_transfers_pair_tensor_ranks_member_for_member() -> None:
    module = _gpt_t2()
    for rank, program in enumerate(module.programs):
        peers = {i.peer for i in program.instrs if i.kind in (InstrKind.SEND, InstrKind.RECV)}
        # Member k of stage 0's group (ranks 0, 1) talks only to member k of stage 1's (ranks 2, 3).
        assert peers == {rank + 2 if rank < 2 else rank - 2}


def test_tensor_allreduces_follow_the_compute_that_runs_them() -> None:
    module = _gpt_t2()
    for program in module.programs:
        stage = module.stage(program.attrs.stages[0])
        forward, backward = len(forward_reduces(stage.ops)), len(backward_reduces(stage.ops))
        counts: Counter[tuple[bool, int]] = Counter()
        last = None
        for instr in program.instrs:
            if instr.kind in (InstrKind.FORWARD, InstrKind.BACKWARD):
                last = instr
            if instr.kind is InstrKind.TENSOR_ALLREDUCE:
                assert last is not None and last.mb == instr.mb
                assert (last.kind is InstrKind.BACKWARD) == instr.grad
                assert instr.group == tuple(r for r, p in enumerate(module.programs) if stage.name in p.attrs.stages)
                counts[(instr.grad, instr.mb)] += 1
        # Two blocks per stage: two row-parallel results and two column-parallel inputs per block; the first stage
        # also sums its embedding's rows, the last its loss and the gradient of its LM head's input.
        first = stage is module.stages[0]
        assert (forward, backward) == ((5, 4) if first else (5, 5))
        for mb in range(4):
            assert counts[(False, mb)] == forward and counts[(True, mb)] == backward


def test_simulated_stage_time_is_the_members_closed_form() -> None:
    """A forward on a member: the ops the group splits at half their FLOPs and bytes (per-call fixed parts whole),
    the rest whole, plus one ring per row-parallel result over the group's two devices."""
    module = _gpt_t2()
    cluster = parse_shorthand("4xcpu")
    prices = OpPrices(module, cluster)
    kind = cluster.device(0)
    b = module.attrs.microbatch_size
    stage = module.stages[0]
    alone = prices.stage_times(stage.ops, b, kind)
    split = prices.stage_times(stage.ops, b, kind, tp=2)
    sharded = [op for op in stage.ops if op.tensor_split]
    assert sharded and split[0] < alone[0]
    whole = prices.stage_times([op for op in stage.ops if not op.tensor_split], b, kind)
    halves = prices.stage_times(sharded, b, kind, tp=2)
    assert split[0] == pytest.approx(whole[0] + halves[0], rel=1e-12)
    ring = ring_allreduce(Network(cluster), (0, 1))
    reduces = sum(
        ring.seconds(transfer_bytes(module, op, whole=summed_bytes(op, 2))) for op in forward_reduces(stage.ops)
    )
    result = simulate(module, cluster=cluster)
    events = [
        e for e in result.events() if e.rank == 0 and e.instr.kind is InstrKind.TENSOR_ALLREDUCE and not e.instr.grad
    ]
    assert sum(e.end_s - e.start_s for e in events) == pytest.approx(reduces * 4, rel=1e-9)


def test_the_dp_objective_equals_the_cost_model_on_a_grouped_cluster() -> None:
    module = _gpt_t2()
    cluster = parse_shorthand("2x4xH100")
    problem = problem_from_module(module, cluster, 16, tp=2)
    assert problem.tp == 2 and problem.cluster.num_devices == 4
    assert expand_devices(cluster, 2, (0, 1, 2, 3)) == (0, 1, 2, 3, 4, 5, 6, 7)
    assert expand_devices(cluster, 2, (2,)) == (4, 5)
    # No cut inside a pattern: each group of module layers the problem plans with closes its split values.
    assert problem.layer_map[0] == 0 and problem.layer_map[-1] == len(module.layers)
    for m in (2, 4, 8):
        found = solve_priced(problem, m, "1f1b", "append-first", front=None)
        assert found is not None
        cand, objective = found
        assert objective == pytest.approx(evaluate(problem, cand).iteration_s, rel=1e-9)


def test_grouped_cluster_keeps_nodes_and_refuses_groups_across_them() -> None:
    cluster = parse_shorthand("2x8xA100-80GB")
    grouped = grouped_cluster(cluster, 4)
    assert (grouped.nodes, grouped.devices_per_node) == (2, 2)
    with pytest.raises(ValueError, match="do not divide"):
        grouped_cluster(cluster, 3)


def test_a_degree_the_model_or_the_cluster_cannot_take_is_refused_by_name() -> None:
    with pytest.raises(DappleError, match="tensor-parallel 3"):
        api.compile(GPT, cluster="6xcpu", global_batch=8, stages=2, microbatches=4, tensor_parallel=3)


def test_the_planner_keeps_t1_where_tensor_parallelism_does_not_pay() -> None:
    """On CPU ranks the group's sums cost more than the halved matmuls save: the search keeps T = 1."""
    result = api.compile(GPT, cluster="4xcpu", global_batch=8, explain=True)
    assert all(s.tp == 1 for s in result.module.stages)
    assert any("tensor-parallel 2: best" in line for line in result.explain)


def test_a_model_without_a_pattern_may_be_forced_to_run_replicated_in_its_groups() -> None:
    cnn = str(ROOT / "examples" / "cnn.py") + ":factory"
    module = api.compile(cnn, cluster="4xcpu", global_batch=8, stages=2, microbatches=4, tensor_parallel=2).module
    assert [s.tp for s in module.stages] == [2, 2]
    assert not any(op.tensor_split for op in module.ops)
    assert not any(i.kind is InstrKind.TENSOR_ALLREDUCE for p in module.programs for i in p.instrs)


def test_megatrons_interleaved_configuration_counts_device_groups_not_virtual_stages() -> None:
    """Megatron's interleaved configuration forced (T = 2, D = 2, P = 2 device groups deep of V = 2 chunks each, every
    stage recomputing): 8 devices hold it, and the stages of one group share their devices; D = 4 needs 16."""
    megatron = str(ROOT / "examples" / "megatron_gpt.py") + ":factory_tiny"
    forced = dict(
        cluster="1x8xA100-80GB", global_batch=16, stages=4, virtual=2, schedule="interleaved", microbatches=8,
        tensor_parallel=2, recompute="all", replication="round-robin",
    )  # fmt: skip
    module = api.compile(megatron, data_parallel=2, **forced).module  # type: ignore[arg-type]
    assert [(s.replicas, s.tp, s.recompute) for s in module.stages] == [(2, 2, True)] * 4
    assert module.stages[0].attrs.devices == module.stages[2].attrs.devices
    assert len({d for s in module.stages for d in s.attrs.devices or ()}) == 8
    with pytest.raises(DappleError, match="data-parallel 4 x 2 device group"):
        api.compile(megatron, data_parallel=4, **forced)  # type: ignore[arg-type]
