"""One physics for activation memory under autocast: the planner's per-layer activation bytes (`Problem.act_bytes`)
sum, over each stage of a plan, to what the IR's memory model counts for that stage (`memory.activation_bytes`, which
`peak_memory` reads), autocast's 16-bit weight copies and input casts included (issue 44)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapple_ir.analysis import memory
from dapple_ir.analysis.peak_memory import transfer_bytes
from dapple_ir.analysis.precision import is_matmul_class
from dapple_ir.analysis.stage_graph import crossings
from dapple_ir.api import compile as compile_plan
from dapple_ir.cluster.toml_file import resolve_cluster
from dapple_ir.ir import Module, TensorType
from dapple_ir.pricing.layers import Problem, problem_from_module
from tests.test_runtime import GPT, MLP


def _stage_layers(module: Module, problem: Problem) -> list[tuple[int, int]]:
    """Each stage's range [lo, hi) of the problem's layers (a tensor problem's are groups of the module's)."""
    bounds = problem.layer_map or tuple(range(len(module.layers) + 1))
    first = {module.layers[bounds[k]].ops[0]: k for k in range(problem.layers)}
    starts = [min(first[op] for op in stage.ops if op in first) for stage in module.stages]
    return list(zip(starts, [*starts[1:], problem.layers], strict=True))


@pytest.mark.parametrize(
    ("spec", "cluster", "tp"), [(GPT, "2xcpu", 1), (GPT, "4xcpu", 2), (MLP, "2xcpu", 1)], ids=["gpt", "gpt-t2", "mlp"]
)
def test_the_planners_stage_activations_are_the_irs(spec: str, cluster: str, tp: int, tmp_path: Path) -> None:
    module = compile_plan(
        spec, cluster=cluster, global_batch=8, stages=2, microbatches=4, precision="bf16", tensor_parallel=tp,
        out_dir=tmp_path / "plan",
    ).module  # fmt: skip
    problem = problem_from_module(module, resolve_cluster(cluster), 8, tp)
    b = module.attrs.microbatch_size
    assert b and [s.tp for s in module.stages] == [tp, tp]
    for stage, (lo, hi) in zip(module.stages, _stage_layers(module, problem), strict=True):
        planner = (problem.pa[hi] - problem.pa[lo]) * b / problem.cost_batch
        # What the per-layer sums leave to the stage's boundary (`memory.layer_activation_bytes`): the 16-bit cast of
        # each fp32 value the stage receives, for each matmul of it reading that value (where the planner cut).
        received = {c.value for c in crossings(module) if c.consumer is stage}
        casts = sum(
            transfer_bytes(module, v) / 2
            for op in stage.ops
            if is_matmul_class(op)
            for v in op.operands
            if v in received and isinstance(v.type, TensorType) and v.type.dtype == "f32"
        )
        assert planner + casts == pytest.approx(memory.activation_bytes(module, stage.ops, tp), rel=1e-12), stage.name
        # The weight copies and casts are a large part of it, and the planner counts them (it used to sum capture's).
        copies = memory.autocast_saved_bytes(module, stage.ops, tp)
        assert copies > 0.2 * planner


def test_at_another_microbatch_capture_scales_and_the_weight_copies_do_not(tmp_path: Path) -> None:
    # The problem prices its layers at its cost batch, the IR at any microbatch (`rows`): capture's bytes scale with
    # it, autocast's copy of each weight is one per microbatch in flight, whatever its size.
    module = compile_plan(
        GPT, cluster="2xcpu", global_batch=8, stages=2, microbatches=4, precision="bf16", out_dir=tmp_path / "plan"
    ).module
    stage = module.stages[0]
    b = module.attrs.microbatch_size
    assert b == module.attrs.cost_batch == 2
    captured = sum(op.attrs.act_bytes or 0.0 for op in stage.ops)
    # The first stage reads the token ids (integers) from outside: no input casts, a bf16 copy of each Linear's weight.
    linears = {n for op in stage.ops if op.attrs.op_class == "matmul" for n in op.attrs.params or ()}
    weights = sum(p.nbytes / 2 for p in module.params if p.name in linears and len(p.type.shape) == 2)
    copies = memory.autocast_saved_bytes(module, stage.ops)
    assert memory.activation_bytes(module, stage.ops, rows=2 * b) == 2 * captured + copies
    layers = memory.layer_activation_bytes(module, [layer.ops for layer in module.layers], rows=2 * b)
    problem = problem_from_module(module, resolve_cluster("2xcpu"), 8)
    (lo, hi), _ = _stage_layers(module, problem)
    assert sum(layers[lo:hi]) == memory.activation_bytes(module, stage.ops, rows=2 * b)
    assert copies == weights > 0
