"""`--split-at`: cuts named by module, as torch.distributed.pipelining names its split points. The plan's
stages begin exactly at those modules (checked against the ops' own module paths), everything else is
planned, and a name that is no boundary is refused naming the nearest ones."""

from __future__ import annotations

import copy
import functools

import pytest

from dapple_ir.api import compile as compile_plan
from dapple_ir.cluster.toml_file import resolve_cluster
from dapple_ir.errors import DappleError, PlanError
from dapple_ir.ir import Module, OpKind
from dapple_ir.pass_manager import PassManager, build_pipeline
from dapple_ir.passes.plan import lower_and_simulate
from dapple_ir.planner.cost_model import problem_from_module
from dapple_ir.planner.search import Request, search
from tests.paths import ROOT
from tests.planner_cases import VGG19, captured

GPT = f"{ROOT / 'examples' / 'gpt.py'}:factory"
FLOATING = (OpKind.INPUT, OpKind.GET_ATTR, OpKind.OUTPUT)


def _gpt() -> Module:
    return copy.deepcopy(captured(GPT))


def _stage_of_block(module: Module) -> dict[str, set[int]]:
    """blocks.i -> the stages its ops landed in, read from each op's module path (not from the planner)."""
    found: dict[str, set[int]] = {}
    for k, stage in enumerate(module.stages):
        for op in stage.ops:
            path = op.attrs.module_path or ""
            if op.kind in FLOATING or not path.startswith("blocks."):
                continue
            found.setdefault(".".join(path.split(".")[:2]), set()).add(k)
    return found


@pytest.mark.parametrize("split_at", [("blocks.1", "blocks.3"), ("blocks.2",), ("blocks.1", "blocks.2", "blocks.3")])
def test_gpt_stages_begin_at_the_named_blocks(split_at: tuple[str, ...]) -> None:
    result = compile_plan(_gpt(), cluster="4xcpu", global_batch=16, split_at=split_at)
    module = result.module
    assert len(module.stages) == len(split_at) + 1
    where = _stage_of_block(module)
    # Every block lies wholly in one stage, and stage k holds the blocks from the k-th name on.
    expected = {f"blocks.{i}": sum(1 for name in split_at if int(name.split(".")[1]) <= i) for i in range(4)}
    assert where == {block: {stage} for block, stage in expected.items()}
    # The embeddings run before the first block and the final norm after the last: first and last stage.
    tok = next(op for op in module.ops if op.attrs.module_path == "tok" and op.kind not in FLOATING)
    ln_f = next(op for op in module.ops if op.attrs.module_path == "ln_f" and op.kind not in FLOATING)
    assert tok in module.stages[0].ops and ln_f in module.stages[-1].ops


def test_pinned_cuts_leave_the_rest_to_the_planner() -> None:
    # Two stages on four devices: the planner replicates, and both stages keep their cut.
    result = compile_plan(_gpt(), cluster="4xcpu", global_batch=16, split_at=("blocks.2",))
    stages = result.module.stages
    assert sum(len(s.attrs.devices) for s in stages) > 2
    assert _stage_of_block(result.module) == {"blocks.0": {0}, "blocks.1": {0}, "blocks.2": {1}, "blocks.3": {1}}


def test_a_cut_coarsen_would_merge_away_is_kept() -> None:
    # Two layers in all: without `keep`, blocks.1 would begin inside one of them.
    result = compile_plan(_gpt(), cluster="4xcpu", global_batch=16, split_at=("blocks.1",), max_layers=2)
    assert _stage_of_block(result.module) == {"blocks.0": {0}, "blocks.1": {1}, "blocks.2": {1}, "blocks.3": {1}}


def test_unknown_module_is_refused_with_close_names() -> None:
    with pytest.raises(DappleError, match=r"split-at blocks\.9: no module of that name.*did you mean blocks\.\d"):
        compile_plan(_gpt(), cluster="4xcpu", global_batch=16, split_at=("blocks.9",))


def test_module_inside_a_layer_is_refused_naming_the_nearest_boundaries() -> None:
    pipeline = "annotate-cost,coarsen{max-layers=3},plan{split-at=blocks.1.attn.qkv},schedule,lower-comm,insert-frees"
    with pytest.raises(
        DappleError, match=r"begins inside layer L\d.*nearest boundaries are \S+ \((before|after)\)"
    ) as caught:
        compile_plan(_gpt(), cluster="4xcpu", global_batch=16, pipeline=pipeline)
    assert "blocks.1.attn.qkv" in str(caught.value)


def test_the_first_module_is_no_cut() -> None:
    mlp = copy.deepcopy(captured(f"{ROOT / 'examples' / 'mlp.py'}:factory"))
    with pytest.raises(DappleError, match=r"split-at 0: that module begins the model"):
        compile_plan(mlp, cluster="4xcpu", global_batch=16, split_at=("0",))


@functools.cache
def _vgg() -> tuple[Module, object]:
    from dapple_ir.frontend.profile_import import import_profile

    module = import_profile(str(VGG19))
    module.attrs.optimizer = "adam"
    PassManager(build_pipeline("coarsen{max-layers=12}")).run(module)
    return module, problem_from_module(module, resolve_cluster("1x8xV100-16GB"), 128)


def test_pinning_a_plans_own_cuts_finds_that_plan_again() -> None:
    module, problem = _vgg()
    score = functools.partial(lower_and_simulate, module)
    free = search(problem, Request(stages=3), score).chosen  # type: ignore[arg-type]
    cuts = tuple(st.lo for st in free.cand.stages[1:])
    pinned = search(problem, Request(cuts=cuts), score)  # type: ignore[arg-type]
    assert all(tuple(st.lo for st in s.cand.stages[1:]) == cuts for s in pinned.considered)
    assert pinned.chosen.time_s <= free.time_s * (1 + 1e-9)
    assert (pinned.chosen.cand.stages, pinned.chosen.cand.microbatches) == (free.cand.stages, free.cand.microbatches)


def test_cuts_that_disagree_with_the_stage_count_are_refused() -> None:
    _module, problem = _vgg()
    with pytest.raises(PlanError, match="split-at makes 3 stages"):
        search(problem, Request(cuts=(3, 6), stages=2))  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="interleaved"):
        search(problem, Request(cuts=(3, 6), schedule="interleaved"))  # type: ignore[arg-type]
