"""One pipeline stage as a runnable `torch.fx.GraphModule`, cut out of the captured model graph.

The captured graph takes the IR inputs positionally and returns the scalar loss; its node names are
the IR op names. A stage keeps the nodes the plan gives it, takes every value it reads from outside
as a placeholder (model inputs it loads itself, other values it receives), and returns the values
other stages read, then the loss if it holds it. Parameter reads (`get_attr`) are copied into every
stage that uses them, so a tied parameter has one copy per stage and never crosses a boundary.
Only the submodules and parameters the stage's nodes reference are kept (fx copies exactly those),
and they are the very tensors of the model built from the factory and seed, so their initial values
equal a single-device run's.

A stage's dtypes are its plan's precision's, not the capture's: `torch.export` asserts the dtype of each value
it met as an `x.to(dtype)` that was a no-op at capture (`aten._assert_tensor_metadata`, Llama's norms and loss),
and under autocast that value is 16-bit where the capture saw fp32 (the `to` after it still converts). A stage
keeps those asserts' other checks and drops their dtype (`_without_dtype_assert`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.fx

from dapple_ir.errors import DappleError

if TYPE_CHECKING:
    from dapple_ir.backends.torch.tensor_parallel import TensorGroup


@dataclass
class StageModule:
    """A stage's forward function and what flows in and out of it."""

    name: str
    """Stage name (`s1`)."""
    graph_module: torch.fx.GraphModule
    """Takes `inputs` positionally; returns a tuple of `outputs` values, then the loss if `has_loss`."""
    inputs: list[str]
    """IR names of the values the stage reads from outside, in placeholder order."""
    data_inputs: set[str]
    """Those of `inputs` that are model inputs or targets (loaded from the batch, never received)."""
    outputs: list[str]
    """IR names of the values the stage computes and other stages read."""
    has_loss: bool
    """True for the stage that computes the loss."""
    params: dict[str, torch.nn.Parameter] = field(default_factory=dict)
    """Trainable parameters the stage holds, by their model name (the IR param name)."""
    tensor_group: TensorGroup | None = None
    """This rank's tensor group of the stage (`StageAttrs.tp` > 1, `tensor_parallel`); None: the stage runs whole."""


def split_stage(
    graph_module: torch.fx.GraphModule,
    stage: str,
    nodes: list[str],
    param_names: dict[int, str],
) -> StageModule:
    """The stage named `stage` holding the graph nodes `nodes` (IR op names).

    `param_names` maps `id(parameter)` to its model name for every trainable parameter, so tied
    parameters reached through different module paths get the one name the IR uses.
    """
    graph = graph_module.graph
    by_name = {n.name: n for n in graph.nodes}
    missing = [name for name in nodes if name not in by_name]
    if missing:
        raise DappleError(
            f"stage @{stage} of the plan names op(s) {', '.join('%' + m for m in missing[:5])} that the captured "
            "model does not have: the model changed since the plan was compiled; recompile it"
        )
    output_node = next(n for n in graph.nodes if n.op == "output")
    loss_node = output_node.args[0]
    members = {by_name[name] for name in nodes if by_name[name].op != "output"}
    has_loss = "output" in nodes or output_node.name in nodes or loss_node in members

    order = {n: i for i, n in enumerate(graph.nodes)}
    externals: set[torch.fx.Node] = {n for n in members if n.op == "placeholder"}
    copied_attrs: set[torch.fx.Node] = set()
    for node in members:
        for arg in node.all_input_nodes:
            if arg in members:
                continue
            if arg.op == "get_attr":
                copied_attrs.add(arg)
            else:
                externals.add(arg)
    inputs = sorted(externals, key=order.__getitem__)
    outputs = [
        n
        for n in sorted(members, key=order.__getitem__)
        if n.op not in ("placeholder", "get_attr") and any(u not in members and u.op != "output" for u in n.users)
    ]

    new = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in inputs:
        env[node] = new.placeholder(node.name)
    for node in graph.nodes:
        if node in env or node.op == "output" or (node not in members and node not in copied_attrs):
            continue
        env[node] = new.node_copy(node, env.__getitem__)
        _without_dtype_assert(env[node])
    results = [env[n] for n in outputs]
    if has_loss:
        if not isinstance(loss_node, torch.fx.Node) or loss_node not in env:
            raise DappleError(f"stage @{stage} holds the output op but not the loss value it returns")
        results.append(env[loss_node])
    new.output(tuple(results))
    new.lint()
    sub = torch.fx.GraphModule(graph_module, new, class_name=f"Stage_{stage}")

    params: dict[str, torch.nn.Parameter] = {}
    for _, p in sub.named_parameters():
        if p.requires_grad:
            params[param_names.get(id(p), f"<unnamed {id(p)}>")] = p
    return StageModule(
        name=stage,
        graph_module=sub,
        inputs=[n.name for n in inputs],
        data_inputs={n.name for n in inputs if n.op == "placeholder"},
        outputs=[n.name for n in outputs],
        has_loss=has_loss,
        params=params,
    )


def _without_dtype_assert(node: torch.fx.Node) -> None:
    """Drop the dtype an `aten._assert_tensor_metadata` node checks (see the module docstring); other nodes stay."""
    if node.target is not torch.ops.aten._assert_tensor_metadata.default:
        return
    node.args = node.args[:3]  # (a, size, stride, dtype): the dtype may come positionally
    node.kwargs = {k: v for k, v in node.kwargs.items() if k != "dtype"}


def model_param_names(model: torch.nn.Module) -> dict[int, str]:
    """`id(parameter) -> name` using the first name of each tensor, as `named_parameters` reports it."""
    return {id(p): name for name, p in model.named_parameters()}
