"""The zero-bubble split of a stage's backward: `backward_input` then `backward_weight`.

Reference: one ordinary `torch.autograd.backward` of the same graph. The split must give the very same
input and parameter gradients, and the weight pass must not rerun the input-gradient chain (the
nodes between the output and the stage input that are not a weight branch's entry).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node

from dapple_ir.analysis.peak_memory import weight_ops
from dapple_ir.backends.torch.launch import run
from dapple_ir.backends.torch.runtime import Runtime
from dapple_ir.backends.torch.split_backward import capture, weight_split
from dapple_ir.plan_dir import load_plan
from tests.test_runtime import GPT, MLP, make_plan

torch.manual_seed(0)


class Residual(nn.Module):
    """Conv + batch norm + ReLU with a skip connection, then a linear head: several weight branches."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.head = nn.Linear(3 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv(x))) + x
        return self.head(y.flatten(1))


class Shared(nn.Module):
    """One weight used by two layers: the split must give up rather than count it twice."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 6))


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp": (_mlp, (4, 6)),
    "residual-cnn": (Residual, (2, 3, 4, 4)),
    "shared-weight": (Shared, (4, 6)),
}


def _reference(model: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaf = x.clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    torch.autograd.backward(model(leaf), g)
    return leaf.grad.clone(), [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


@pytest.mark.parametrize("name", list(MODELS))
def test_split_backward_equals_one_backward(name: str) -> None:
    build, shape = MODELS[name]
    model = build()
    x = torch.randn(*shape)
    out_shape = model(x).shape
    g = torch.randn(out_shape)
    ref_input, ref_params = _reference(model, x, g)

    model.zero_grad(set_to_none=True)
    leaf = x.clone().requires_grad_(True)
    out = model(leaf)
    params = list(model.parameters())
    split = weight_split([out], [g], [leaf], params)
    if name == "shared-weight":
        assert split is None  # the runtime then falls back to one pass from the outputs
        return
    assert split is not None
    detached, groups = split
    assert not detached.roots and len(groups) >= 3
    # Every parameter belongs to exactly one group.
    assert sorted(id(p) for _, ps in groups for p in ps) == sorted(id(p) for p in params)
    captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    hooks = [node.register_prehook(capture(captured, node)) for node, _ in groups]
    (input_grad,) = torch.autograd.grad([out], [leaf], [g], retain_graph=True)
    for h in hooks:
        h.remove()
    assert all(p.grad is None for p in params)  # the input pass left the weights alone

    # Count which nodes the weight passes run: only the group entries and their weight branches.
    ran: list[Node] = []
    group_nodes = {node for node, _ in groups}
    on_path = _input_path(out, leaf)
    watch = [n.register_prehook(lambda _g, n=n: ran.append(n)) for n in on_path]
    for node, node_params in groups:
        edges = [(GradientEdge(node, i), t) for i, t in enumerate(captured[node]) if t is not None]
        torch.autograd.backward([e for e, _ in edges], [t for _, t in edges], retain_graph=True, inputs=node_params)
    for w in watch:
        w.remove()
    assert set(ran) <= group_nodes, [type(n).__name__ for n in ran if n not in group_nodes]
    assert len(ran) == len(groups)

    torch.testing.assert_close(input_grad, ref_input, rtol=1e-6, atol=1e-7)
    for p, ref in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p.grad, ref, rtol=1e-6, atol=1e-7)


def _input_path(out: torch.Tensor, leaf: torch.Tensor) -> set[Node]:
    """Nodes of `out`'s graph from which the stage input's gradient accumulator can be reached."""
    reach: dict[Node, bool] = {}

    def visit(node: Node) -> bool:
        if node not in reach:
            children = [c for c, _ in node.next_functions if c is not None]
            hit = getattr(node, "variable", None) is leaf
            reach[node] = any([visit(c) for c in children]) or hit
        return reach[node]

    assert out.grad_fn is not None
    visit(out.grad_fn)
    return {n for n, hit in reach.items() if hit and getattr(n, "variable", None) is None}


def _graph_tensors() -> int:
    """Live tensors that still belong to an autograd graph."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.grad_fn is not None)


@pytest.mark.parametrize("kind", ["zb-h1", "1f1b"])
def test_a_run_leaves_no_graph_behind(tmp_path: Path, kind: str) -> None:
    # zb-h1's input pass retains the graph for the weight pass, which releases only the weight branches' nodes:
    # a node that saved its own output (ReLU does) must not keep that output, and with it its own graph, alive.
    # The first run also fills the caches a plan's loading keeps (its captured graph's example values).
    plan = make_plan(tmp_path / "plan", MLP, stages=2, kind=kind)
    run(plan, steps=1, transport="threads", timeout=30)
    after_one = _graph_tensors()
    run(plan, steps=3, transport="threads", timeout=30)
    assert _graph_tensors() == after_one


@pytest.mark.parametrize(("spec", "stages"), [(MLP, 3), (GPT, 4)])
def test_the_weight_passes_are_the_ones_the_cost_model_charges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: str, stages: int
) -> None:
    """The simulator and the planner charge a split backward one autograd pass per `peak_memory.weight_ops` op
    (`DeviceKind.split_backward_overhead`), and none on a stage that hands no gradient back. Reference: the passes
    the runtime's `backward_weight` really runs, counted on a zb-h1 run of the MLP and of the GPT (embeddings,
    layer norms, attention, a tied head): the first stage's one pass is its whole backward (no extra pass), every
    other stage that splits runs exactly one pass per weight op (zb-h1 runs whole backwards on a stage whose split
    would lift its rank above 1f1b's peak: the MLP's second stage, the GPT's second)."""
    plan_dir = make_plan(tmp_path, spec, stages=stages, kind="zb-h1")
    module = load_plan(plan_dir).module
    ran: dict[str, set[int]] = {}
    original = Runtime.backward_weight

    def counting(self: Runtime, stage: str, mb: int) -> None:
        deferred = self._record(stage, mb).deferred or []
        ran.setdefault(stage, set()).add(sum(1 for wp in deferred if wp.roots and wp.params))
        original(self, stage, mb)

    monkeypatch.setattr(Runtime, "backward_weight", counting)
    run(plan_dir, steps=1, transport="threads", timeout=60)
    charged = {s.name: len(weight_ops(module, s)) for s in module.stages}
    first = module.stages[0].name
    assert charged[first] == 0 and ran[first] == {1}
    split = set(ran) - {first}
    assert split, "no stage but the first split its backward"
    assert {name: ran[name] for name in split} == {name: {charged[name]} for name in split}
