"""A GPT-2 XL sized model (1.56B parameters) captured on the meta device: shapes and parameter count
against the closed form from its configuration. Time and memory are measured by
bench/capture_large.py, not asserted here."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapple_ir.frontend.model_spec import FactoryResult, capture_loaded, load_model_spec
from dapple_ir.ir import OpKind, TensorType
from dapple_ir.ir.verifier import verify_module

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpt_1_5b_on_meta() -> None:
    loaded = load_model_spec(str(ROOT / "examples" / "gpt.py") + ":factory_large", device="meta")
    assert isinstance(loaded, FactoryResult)
    captured = capture_loaded(loaded, method="fx", annotate_costs=False)
    module = captured.module
    verify_module(module)
    vocab, seq, d, layers, batch = 50257, 1024, 1600, 48, 8
    # Per block: two layer norms (2d each), qkv (3d*d + 3d), projection (d*d + d), MLP (4d*d + 4d, 4d*d + d).
    per_block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    expected = vocab * d + seq * d + layers * per_block + 2 * d  # token and position tables, final norm
    assert expected == 1_557_611_200
    assert sum(p.type.numel for p in module.params if not p.attrs.buffer) == expected
    assert module.attrs.batch == batch
    by_target = {op.target: op for op in module.ops if op.kind is OpKind.CALL_MODULE}
    assert by_target["tok"].type == TensorType("f32", (batch, seq, d))
    assert by_target["blocks.47.attn.qkv"].type == TensorType("f32", (batch, seq, 3 * d))
    assert by_target["blocks.47.mlp.0"].type == TensorType("f32", (batch, seq, 4 * d))
    logits = next(op for op in module.ops if op.target == "torch._C._nn.linear")
    assert logits.type == TensorType("f32", (batch, seq, vocab))
    assert module.ops[-1].type == TensorType("f32", ())
    assert module.param("tok.weight").attrs.shared
    assert all(p.is_meta for p in captured.graph_module.parameters())


# Closed forms: 16 Linear(8192, 8192); an embedding of 250k x 4096, Linear(4096, 4096), LayerNorm(4096),
# Linear(4096, 1000). None is computed from the model code.
LARGE_PARAMS = {
    "mlp": 16 * (8192 * 8192 + 8192),
    "kwargs_dict": 250_000 * 4096 + (4096 * 4096 + 4096) + 2 * 4096 + (4096 * 1000 + 1000),
    "cnn": None,
    "control_flow": None,
}


@pytest.mark.parametrize(
    "example", [pytest.param(e, marks=pytest.mark.slow) if e == "control_flow" else e for e in LARGE_PARAMS]
)
def test_other_large_examples_capture_on_meta(example: str) -> None:
    loaded = load_model_spec(str(ROOT / "examples" / f"{example}.py") + ":factory_large", device="meta")
    assert isinstance(loaded, FactoryResult)
    captured = capture_loaded(loaded, annotate_costs=False)
    verify_module(captured.module)
    assert captured.method == ("export" if example == "control_flow" else "fx")
    assert captured.module.ops[-1].type == TensorType("f32", ())
    params = sum(p.type.numel for p in captured.module.params if not p.attrs.buffer)
    expected = LARGE_PARAMS[example]
    assert params == (expected if expected is not None else sum(p.numel() for p in loaded.model.parameters()))
    assert all(p.is_meta for p in captured.graph_module.parameters())
