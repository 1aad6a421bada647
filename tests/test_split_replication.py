"""Split replication (DAPPLE's data parallelism inside a stage): every replica of a split stage runs every
microbatch on its rows, and a boundary between stages sliced differently re-slices the batch.

The oracles: the rows arithmetic (each consumer replica receives exactly its rows, once), the closed form
of the pipeline on free links (a split stage of R replicas is one stage on b / R rows), the memory
model of the unsplit stage scaled by the rows, print -> parse -> print for the IR text, and single-device
training for the runtime (losses and parameters, dropout included in tests/test_exactness.py).
"""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest
import torch

from dapple_ir.analysis.peak_memory import program_peak
from dapple_ir.backends.torch.launch import run
from dapple_ir.backends.torch.reference import train_reference
from dapple_ir.backends.torch.tolerances import ATOL, RTOL
from dapple_ir.cluster.spec import ClusterSpec, DeviceKind, Link
from dapple_ir.errors import PassError
from dapple_ir.ir import InstrKind, Module
from dapple_ir.ir.parser import parse_module
from dapple_ir.ir.printer import print_module
from dapple_ir.pass_manager import PassManager, build_pipeline
from dapple_ir.sim.simulator import simulate
from tests.pipeline_fixtures import chain_module
from tests.test_runtime import CNN, GPT, MLP, make_plan

F_S, B_S = 1e-3, 2e-3  # per op, at the module's batch


def _lowered(replicas: list[int], layers: list[int], m: int, b: int, kind: str = "1f1b", split: bool = True) -> Module:
    module = chain_module(layers, replicas, devices=True)
    for stage in module.stages:
        stage.attrs.split = split or None
        for op in stage.ops:
            if op.kind.value == "call_module":
                op.attrs.fwd_s, op.attrs.bwd_s = F_S, B_S
    module.attrs.global_batch = m * b
    PassManager(build_pipeline(f"schedule{{kind={kind},microbatches={m}}},lower-comm,insert-frees,verify")).run(module)
    return module


def _free_links(devices: int, overhead: float = 0.0) -> ClusterSpec:
    free = Link(float("inf"), 0.0)
    kind = DeviceKind("flat", float("inf"), {"f32": float("inf")}, float("inf"), op_overhead=overhead)
    return ClusterSpec((kind,), devices, free, free, name="free")


# ------------------------------------------------------------------------------------------ lowering


@pytest.mark.parametrize(("producer", "consumer", "b"), [(2, 3, 6), (3, 2, 6), (1, 4, 8), (4, 1, 8), (2, 3, 5)])
def test_each_consumer_replica_receives_exactly_its_rows(producer: int, consumer: int, b: int) -> None:
    module = _lowered([producer, consumer], [1, 1], m=2, b=b)
    s0, s1 = module.stages
    rank_of: dict[str, list[int]] = {(p.attrs.stages or ("",))[0]: [] for p in module.programs}
    for index, p in enumerate(module.programs):
        rank_of[(p.attrs.stages or ("",))[0]].append(index)
    for mb in range(2):
        for k, rank in enumerate(rank_of["s1"]):
            recvs = [i for i in module.programs[rank].instrs if i.kind is InstrKind.RECV and i.mb == mb and not i.grad]
            got = sorted(i.rows for i in recvs if i.rows is not None)
            lo, hi = s1.rows(k, b)
            # The pieces tile the replica's rows with no gap and no overlap, each from the replica holding it.
            assert got[0][0] == lo and got[-1][1] == hi
            assert all(a[1] == c[0] for a, c in itertools.pairwise(got))
            for instr in recvs:
                assert instr.rows is not None and instr.peer is not None
                j = rank_of["s0"].index(instr.peer)
                plo, phi = s0.rows(j, b)
                assert plo <= instr.rows[0] < instr.rows[1] <= phi
            # Every received piece was sent, and its gradient goes back the same way.
            for instr in recvs:
                sender = module.programs[instr.peer or 0].instrs
                assert any(
                    i.kind is InstrKind.SEND and i.peer == rank and i.rows == instr.rows and i.mb == mb and not i.grad
                    for i in sender
                )
                assert any(
                    i.kind is InstrKind.SEND and i.grad and i.peer == instr.peer and i.rows == instr.rows
                    for i in module.programs[rank].instrs
                    if i.mb == mb
                )


def test_a_lowered_split_plan_prints_and_parses_back() -> None:
    text = print_module(_lowered([2, 3], [2, 1], m=4, b=6))
    assert "split = true" in text and "rows = 2:3" in text
    assert print_module(parse_module(text)) == text


def test_round_robin_stages_lower_as_before() -> None:
    module = _lowered([2, 1], [1, 1], m=4, b=6, split=False)
    assert all(i.rows is None for p in module.programs for i in p.instrs)
    assert sorted(i.mb or 0 for i in module.programs[0].instrs if i.kind is InstrKind.FORWARD) == [0, 2]


def test_a_microbatch_smaller_than_the_replicas_is_refused() -> None:
    with pytest.raises(PassError, match=r"splits each microbatch over 4 replicas, but a microbatch has 2 samples"):
        _lowered([4, 1], [1, 1], m=4, b=2)


# ------------------------------------------------------------------------------------ simulator, memory


@pytest.mark.parametrize(("replicas", "kind"), [([2, 2], "gpipe"), ([4, 4, 4], "1f1b"), ([2, 2, 2, 2], "1f1b")])
def test_uniform_split_pipeline_matches_the_closed_form_at_its_rows(replicas: list[int], kind: str) -> None:
    # Equal stages, R replicas each on b / R rows, free links: (M + S - 1)(F + B) at b / R rows, no overhead.
    m, b, layers = 4, 8, [2] * len(replicas)
    module = _lowered(replicas, layers, m=m, b=b, kind=kind)
    result = simulate(module, cluster=_free_links(sum(replicas)))
    rows = b // replicas[0]
    per_op = (F_S + B_S) * rows / chain_batch()
    expected = (m + len(replicas) - 1) * 2 * per_op
    assert result.iteration_s == pytest.approx(expected, rel=1e-9)


def test_split_rows_keep_each_op_calls_fixed_cost() -> None:
    # One stage of 2 ops on 4 replicas: each replica's forward is 2 ops at b / 4 rows, the fixed part whole.
    overhead = 4e-4
    module = _lowered([4], [2], m=1, b=8, kind="gpipe")
    result = simulate(module, cluster=_free_links(4, overhead))
    b, rows = 8, 2
    # Each op call: the overhead as it is, the rest of its time at b scaled to 2 of the 8 rows.
    fwd = 2 * (overhead + (F_S * b / chain_batch() - overhead) * rows / b)
    bwd = 2 * (overhead + (B_S * b / chain_batch() - overhead) * rows / b)
    assert result.iteration_s == pytest.approx(fwd + bwd, rel=1e-9)


def test_a_split_replica_holds_its_share_of_the_activations() -> None:
    whole = _lowered([1, 1], [2, 2], m=4, b=8)
    split = _lowered([4, 2], [2, 2], m=4, b=8)
    for stage_index, replicas in ((0, 4), (1, 2)):
        one = program_peak(whole, whole.programs[stage_index]).live_bytes
        first = next(p for p in split.programs if (p.attrs.stages or ())[0] == f"s{stage_index}")
        assert program_peak(split, first).live_bytes == pytest.approx(one / replicas)


def chain_batch() -> int:
    return chain_module([1]).attrs.batch or 1


# ------------------------------------------------------------------------------------------- runtime


@pytest.mark.parametrize(
    ("spec", "replicas", "kind", "virtual", "b"),
    [
        pytest.param(MLP, [1, 3, 2], "gpipe", 1, 6, id="mlp-gpipe-1-3-2"),
        pytest.param(MLP, [3, 1], "zb-h1", 1, 6, id="mlp-zbh1-3-1"),
        pytest.param(MLP, [2, 1], "1f1b", 1, 5, id="mlp-1f1b-uneven-rows"),
        pytest.param(MLP, [2, 2], "interleaved", 2, 4, id="mlp-interleaved-2x2"),
        pytest.param(GPT, [2, 1], "1f1b", 1, 4, id="gpt-tied-2-1"),
    ],
)
def test_split_plans_train_like_one_device(
    tmp_path: Path, spec: str, replicas: list[int], kind: str, virtual: int, b: int
) -> None:
    m = 4 if virtual > 1 else 2
    plan = make_plan(
        tmp_path / "plan", spec, stages=len(replicas), replicas=replicas, kind=kind, virtual=virtual,
        microbatches=m, microbatch_size=b, split=True,
    )  # fmt: skip
    assert "split = true" in (plan / "plan.dapple").read_text()
    result = run(plan, steps=2, check=True, transport="threads", optimizer="sgd", lr=0.05, timeout=30)
    ref = train_reference(spec, seed=0, steps=2, microbatches=m, microbatch_size=b, optimizer="sgd", lr=0.05)
    assert result.losses == pytest.approx(ref.losses, rel=RTOL, abs=ATOL)
    assert result.losses[0] != result.losses[1]
    for tensors in result.params.values():
        for key, value in tensors.items():
            torch.testing.assert_close(value, ref.params[key.split("/", 1)[1]], rtol=RTOL, atol=ATOL)
    assert result.check is not None and result.check.ok


@pytest.mark.slow
def test_split_plan_trains_like_one_device_under_torchrun(tmp_path: Path) -> None:
    plan = make_plan(tmp_path / "plan", MLP, stages=2, replicas=[2, 1], microbatches=2, microbatch_size=4, split=True)
    result = run(plan, steps=2, check=True, transport="torchrun", timeout=60, device="cpu")
    assert result.check is not None and result.check.ok, result.check


def test_batch_norm_on_a_split_stage_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PassError, match=r"stage @s0 splits each microbatch .* normalises over the batch"):
        make_plan(tmp_path / "plan", CNN, stages=2, replicas=[2, 1], microbatches=2, microbatch_size=4, split=True)
    shutil.rmtree(tmp_path / "plan", ignore_errors=True)


def test_a_gradient_from_each_consumer_rank_is_awaited_on_its_own() -> None:
    # %h0 of @s0 feeds @s1 and (a residual) @s2, each on its own rank: rank 0 receives two gradients of
    # it. Its backward must wait for both; the one from @s1 comes last (@s1's backward needs @s2's first),
    # so one microbatch runs strictly in sequence: 3 forwards, then 3 backwards.
    module = chain_module([1, 1, 1], skip=True, devices=True)
    for op in module.ops:
        if op.kind.value == "call_module":
            op.attrs.fwd_s, op.attrs.bwd_s = F_S, B_S
    module.attrs.global_batch = chain_batch()
    PassManager(build_pipeline("schedule{kind=gpipe,microbatches=1},lower-comm,insert-frees,verify")).run(module)
    grads_in = [i.peer or 0 for i in module.programs[0].instrs if i.kind is InstrKind.RECV and i.grad]
    assert sorted(grads_in) == [1, 2]
    assert simulate(module, cluster=_free_links(3)).iteration_s == pytest.approx(3 * (F_S + B_S), rel=1e-9)


@pytest.mark.slow
def test_a_hugging_face_gpt2_planned_with_split_replicas_trains_like_one_device(tmp_path: Path) -> None:
    # GPT-2 with its dropout, tied LM head and attention masks: the planner splits the first stage over
    # two devices (cutting where every crossing value has the batch in dimension 0) and it trains exactly.
    from dapple_ir.api import compile as compile_plan
    from tests.test_hf_models import MODELS

    out = tmp_path / "plan"
    compile_plan(
        MODELS["gpt2"], cluster="3xcpu", global_batch=8, stages=2, microbatches=2, replication="split", out_dir=out
    )
    module = parse_module((out / "plan.dapple").read_text())
    assert [s.split for s in module.stages] == [True, False]
    result = run(out, steps=2, check=True, transport="threads", timeout=120)
    assert result.check is not None and result.check.ok, result.check


def test_the_planner_never_splits_a_stage_lowering_cannot_slice() -> None:
    # The CNN normalises over the batch (batch norm): no candidate of the whole search splits a stage
    # holding such a layer, and every candidate the simulator saw lowered.
    import functools

    from dapple_ir.cluster.toml_file import resolve_cluster
    from dapple_ir.frontend.spec_loader import capture_spec
    from dapple_ir.passes.plan import lower_and_simulate
    from dapple_ir.planner.cost_model import problem_from_module
    from dapple_ir.planner.search import Request, search
    from dapple_ir.registry import PassContext

    module = capture_spec(CNN, device="meta")
    PassManager(build_pipeline("annotate-cost,coarsen")).run(module, PassContext(cluster="8xcpu"))
    problem = problem_from_module(module, resolve_cluster("8xcpu"), 64)
    assert problem.unsplittable and not problem.can_split(0, problem.layers)
    outcome = search(problem, Request(replication="split"), functools.partial(lower_and_simulate, module))
    for scored in outcome.considered:
        for k, st in enumerate(scored.cand.stages):
            assert not (scored.cand.splits(k) and any(st.lo <= x < st.hi for x in problem.unsplittable))
        assert not scored.note.startswith("not simulated"), scored.note
