"""Analytic FLOPs, bytes and activation bytes per op against closed forms."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from dapple_ir.frontend.flops import annotate_flops
from dapple_ir.ir import Module, ModuleAttrs, Op, OpaqueType, OpKind, TensorType

_KINDS = {
    "placeholder": OpKind.INPUT,
    "call_module": OpKind.CALL_MODULE,
    "call_function": OpKind.CALL_FUNCTION,
    "call_method": OpKind.CALL_METHOD,
    "get_attr": OpKind.GET_ATTR,
    "output": OpKind.OUTPUT,
}


@dataclass
class _Captured:
    module: Module
    graph_module: Any


def _trace(model: Any, *shapes: tuple[int, ...]) -> _Captured:
    """A bare IR mirror of an fx trace (op names = node names), independent of `dapple_ir.frontend.capture`."""
    gm = torch.fx.symbolic_trace(model)
    ops: dict[str, Op] = {}
    inputs = iter(shapes)
    for node in gm.graph.nodes:
        t = TensorType("f32", next(inputs)) if node.op == "placeholder" else OpaqueType()
        operands = [ops[n.name] for n in node.all_input_nodes]
        ops[node.name] = Op(node.name, _KINDS[node.op], operands, t, target=str(node.target))
    module = Module("m", ops=list(ops.values()), attrs=ModuleAttrs(batch=shapes[0][0]))
    return _Captured(module, gm)


class _MLP(torch.nn.Module):
    def __init__(self, d_in: int, hidden: int, d_out: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, hidden)
        self.act = torch.nn.ReLU()
        self.fc2 = torch.nn.Linear(hidden, d_out)

    def forward(self, x: Any) -> Any:
        return self.fc2(self.act(self.fc1(x))).sum()


def test_linear_matches_closed_form() -> None:
    b, d_in, hidden, d_out = 4, 16, 32, 8
    with torch.device("meta"):
        model = _MLP(d_in, hidden, d_out)
    captured = _trace(model, (b, d_in))
    assert annotate_flops(captured) == []
    ops = {op.name: op for op in captured.module.ops}
    for name, (i, o) in {"fc1": (d_in, hidden), "fc2": (hidden, d_out)}.items():
        attrs = ops[name].attrs
        assert attrs.fwd_flops == 2 * b * i * o
        # Backward: input gradient and weight gradient, one matmul each.
        assert attrs.bwd_flops == 2 * (2 * b * i * o)
        assert attrs.mem_bytes == 4 * (b * i + b * o + i * o + o)
        assert attrs.op_class == "matmul"
    assert ops["act"].attrs.fwd_flops == 0 and ops["act"].attrs.op_class == "elementwise"
    # Kept for backward: the input x (fc1 saves it) and ReLU's output (ReLU and fc2 both save it,
    # counted once); weights are not activations and fc1's output is not needed.
    assert ops["x"].attrs.act_bytes == 4 * b * d_in
    assert ops["act"].attrs.act_bytes == 4 * b * hidden
    assert ops["fc1"].attrs.act_bytes == 0 and ops["fc2"].attrs.act_bytes == 0
    assert captured.module.attrs.cost_batch == b


def test_attention_block_matches_closed_form() -> None:
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "gpt.py"
    spec = importlib.util.spec_from_file_location("_gpt_for_flops", path)
    assert spec is not None and spec.loader is not None
    gpt = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gpt  # dataclasses look their module up while the file runs
    spec.loader.exec_module(gpt)

    class Loss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = gpt.CausalSelfAttention(cfg)

        def forward(self, x: Any) -> Any:
            return self.attn(x).sum()

    cfg = gpt.GPTConfig(d_model=64, n_head=4, seq=16, batch=2)
    b, t, d, h = cfg.batch, cfg.seq, cfg.d_model, cfg.n_head
    with torch.device("meta"):
        model = Loss()
    captured = _trace(model, (b, t, d))
    annotate_flops(captured)
    ops = captured.module.ops
    projections = 2 * b * t * d * (3 * d) + 2 * b * t * d * d  # qkv and output projection
    scores = 2 * (2 * b * h * t * t * (d // h))  # Q K^T and P V (the counter does not halve causal)
    assert sum(op.attrs.fwd_flops or 0 for op in ops) == projections + scores
    assert sum(op.attrs.bwd_flops or 0 for op in ops) == 2 * (projections + scores)
    sdpa = next(op for op in ops if "scaled_dot_product" in (op.target or ""))
    assert sdpa.attrs.fwd_flops == scores and sdpa.attrs.op_class == "attention"
    # Views move no data; the reshape of the transposed heads copies b*t*d floats (read + write).
    assert all(op.attrs.mem_bytes == 0 for op in ops if op.target in ("view", "transpose", "split"))
    reshape = next(op for op in ops if op.target == "reshape")
    assert reshape.attrs.mem_bytes == 2 * 4 * b * t * d


@pytest.mark.parametrize("method", ["fx", "export"])
def test_capture_records_costs_for_the_example_mlp(method: str) -> None:
    from dapple_ir.frontend.model_spec import capture_loaded, load_model_spec

    loaded = load_model_spec("examples/mlp.py:factory", device="meta")
    assert not isinstance(loaded, Module)
    ops = capture_loaded(loaded, method=method).module.ops
    # examples/mlp.py: Linear(16,64), ReLU, 2x (Linear(64,64), ReLU), Linear(64,8), MSE loss, batch 8.
    b, dims = 8, [(16, 64), (64, 64), (64, 64), (64, 8)]
    assert sum(op.attrs.fwd_flops or 0 for op in ops) == sum(2 * b * i * o for i, o in dims)
    assert sum(op.attrs.bwd_flops or 0 for op in ops) == sum(4 * b * i * o for i, o in dims)
    # Kept for backward: the input, the three ReLU outputs, the prediction and the target (MSE saves both).
    assert sum(op.attrs.act_bytes or 0 for op in ops) == 4 * b * (16 + 3 * 64 + 8 + 8)
