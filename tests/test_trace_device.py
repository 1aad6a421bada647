"""Capture shows the model the device its plan trains on, and compile refuses a graph that device cannot
run (`dapple_ir.frontend.trace_device`, `dapple_ir.frontend.device_support`), with models whose code
picks `histc`'s dtype by device as transformers' mixture of experts does (`tests/device_models.py`);
and the grouped multiplies of a mixture of experts are priced (`dapple_ir.frontend.grouped_matmul`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dapple_ir.api import compile as compile_plan
from dapple_ir.backends.torch.launch import run
from dapple_ir.errors import CaptureError
from dapple_ir.frontend.grouped_matmul import grouped_matmul_formulas
from dapple_ir.frontend.model_spec import FactoryResult, capture_loaded, load_model_spec
from dapple_ir.frontend.trace_device import trace_device_for
from tests.paths import ROOT

PICKS_BY_DEVICE = f"{ROOT}/tests/device_models.py:picks_by_device"
ALWAYS_INT = f"{ROOT}/tests/device_models.py:always_int"


def _histc_dtypes(spec: str, trace_device: str | None) -> list[torch.dtype]:
    loaded = load_model_spec(spec, device="meta")
    assert isinstance(loaded, FactoryResult)
    captured = capture_loaded(loaded, annotate_costs=False, trace_device=trace_device)
    nodes = [n for n in captured.graph_module.graph.nodes if "histc" in str(n.target)]
    return [n.args[0].meta["val"].dtype for n in nodes]


def test_the_trace_device_is_the_cpu_for_cpu_clusters_only() -> None:
    assert trace_device_for("2xcpu") == "cpu"
    assert trace_device_for("4x8xH100") is None
    assert trace_device_for("no-such-cluster.toml") is None


def test_code_that_picks_by_device_picks_the_plans_device() -> None:
    # On meta the model takes its off-CPU branch (int ids); shown the CPU, the CPU's (float ids).
    assert _histc_dtypes(PICKS_BY_DEVICE, None) == [torch.int32]
    assert _histc_dtypes(PICKS_BY_DEVICE, "cpu") == [torch.float32]


def test_device_literals_stay_meta_in_the_graph() -> None:
    loaded = load_model_spec(PICKS_BY_DEVICE, device="meta")
    assert isinstance(loaded, FactoryResult)
    captured = capture_loaded(loaded, annotate_costs=False, trace_device="cpu", method="export")
    devices = {a for n in captured.graph_module.graph.nodes for a in [*n.args, *n.kwargs.values()]}
    assert torch.device("cpu") not in devices


def test_compile_refuses_an_op_the_cpu_cannot_run(tmp_path: Path) -> None:
    with pytest.raises(CaptureError) as info:
        compile_plan(ALWAYS_INT, cluster="2xcpu", global_batch=8, out_dir=tmp_path / "plan")
    message = str(info.value)
    assert "%histc" in message and "int32[8]" in message and "not implemented for 'Int'" in message
    assert "CPU this plan trains on" in message and "\n" not in message
    assert not (tmp_path / "plan").exists()


def test_a_gpu_plan_is_not_checked_on_a_machine_without_one(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the plan's ops are tried on it")
    compile_plan(ALWAYS_INT, cluster="2xH100", global_batch=8, stages=2)


@pytest.mark.slow
def test_a_model_that_picks_by_device_trains_exactly_on_two_cpu_ranks(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    compile_plan(PICKS_BY_DEVICE, cluster="2xcpu", global_batch=8, stages=2, microbatches=2, out_dir=out)
    result = run(out, steps=2, check=True, transport="threads", timeout=60, device="cpu")
    assert result.check is not None and result.check.ok, result.check


def test_grouped_multiplies_cost_their_routed_rows() -> None:
    # 6 routed rows of width 4, sorted into 3 experts of 4x8 weights: each row meets one expert's matrix.
    rows, weights = torch.randn(6, 4, requires_grad=True), torch.randn(3, 4, 8, requires_grad=True)
    offsets = torch.tensor([2, 4, 6], dtype=torch.int32)
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no grouped multiply")
    with FlopCounterMode(display=False, custom_mapping=grouped_matmul_formulas()) as forward:
        out = torch._grouped_mm(rows, weights, offs=offsets)
    assert forward.get_total_flops() == 2 * 6 * 4 * 8
    with FlopCounterMode(display=False, custom_mapping=grouped_matmul_formulas()) as backward:
        out.backward(torch.ones_like(out))
    assert backward.get_total_flops() == 2 * 2 * 6 * 4 * 8
