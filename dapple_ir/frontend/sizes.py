"""Sizes read where they are used, so that no size value ever has to cross a pipeline cut.

`torch.export` keeps the batch dimension symbolic: one `aten.sym_size.int(input_ids, 0)` at the top
of the graph feeds the views of every block, and fx graphs do the same when a model reads
`x.size(0)` of an input once. Such a value is a Python int, not a tensor a stage could send, so a
cut anywhere it is live would be impossible and the whole model would coarsen into one layer.

A size read from a model input, and arithmetic on such sizes (`operator.mul`, `torch.sym_max`,
...), depend only on the input's shape. So every op that uses one gets its own copy of the short
chain that computes it, placed right before it. A stage then reads the size from the input it
loads itself (a stage loads every input it reads: inputs never cross), at whatever microbatch
size it runs. The copies are part of the captured graph, so the IR and the graph the runtime cuts
into stages hold the same ops by construction.
"""

from __future__ import annotations

import builtins
import math
import operator
from typing import Any

import torch
import torch.fx

#: ATen ops that read a tensor's metadata only.
_ATEN_SIZE_READS = frozenset(
    {
        torch.ops.aten.sym_size.int,
        torch.ops.aten.sym_numel.default,
        torch.ops.aten.sym_stride.int,
        torch.ops.aten.sym_storage_offset.default,
    }
)
#: Tensor methods that read metadata only (fx graphs).
_METHOD_SIZE_READS = frozenset({"size", "dim", "numel", "stride"})
#: Attributes that are metadata (`getattr(x, "shape")` in fx graphs).
_ATTR_SIZE_READS = frozenset({"shape", "ndim"})
#: Modules whose functions compute on plain or symbolic numbers.
_SCALAR_MODULES = (operator, math)


def localise_sizes(graph: torch.fx.Graph) -> int:
    """Give each user of a size value computed from model inputs its own copy of that computation.

    Returns the number of users given copies; the originals are left for dead-code elimination.
    """
    recomputable: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if _reads_input_size(node) or (_is_scalar_math(node) and _only_from(node, recomputable)):
            recomputable.add(node)
    rewired = 0
    for user in list(graph.nodes):
        if user in recomputable or user.op == "output":
            continue
        sources = [v for v in user.all_input_nodes if v in recomputable]
        if not sources:
            continue
        copies: dict[torch.fx.Node, torch.fx.Node] = {}
        with graph.inserting_before(user):
            for value in sources:
                user.replace_input_with(value, _copy_chain(graph, value, user, recomputable, copies))
        rewired += 1
    return rewired


def _reads_input_size(node: torch.fx.Node) -> bool:
    if not node.args or not isinstance(node.args[0], torch.fx.Node) or node.args[0].op != "placeholder":
        return False
    if any(isinstance(a, torch.fx.Node) for a in (*node.args[1:], *node.kwargs.values())):
        return False
    if node.op == "call_method":
        return node.target in _METHOD_SIZE_READS
    if node.op != "call_function":
        return False
    if node.target is builtins.getattr:
        return len(node.args) == 2 and node.args[1] in _ATTR_SIZE_READS
    return node.target in _ATEN_SIZE_READS


def _is_scalar_math(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or not callable(node.target):
        return False
    module = getattr(node.target, "__module__", None)
    name = getattr(node.target, "__name__", "")
    if any(module == m.__name__ or node.target is getattr(m, name, None) for m in _SCALAR_MODULES):
        return True
    # torch.sym_max, torch.sym_int, ... compute on symbolic numbers.
    return name.startswith("sym_") and getattr(torch, name, None) is node.target


def _only_from(node: torch.fx.Node, recomputable: set[torch.fx.Node]) -> bool:
    inputs = node.all_input_nodes
    return bool(inputs) and all(v in recomputable for v in inputs)


def _copy_chain(
    graph: torch.fx.Graph,
    value: torch.fx.Node,
    user: torch.fx.Node,
    recomputable: set[torch.fx.Node],
    copies: dict[torch.fx.Node, torch.fx.Node],
) -> torch.fx.Node:
    """A copy of `value` and the sizes it is computed from, inserted at the graph's insert point."""
    if value not in recomputable:
        return value  # the model input whose shape is read
    if value in copies:
        return copies[value]

    def arg(v: torch.fx.Node) -> torch.fx.Node:
        return _copy_chain(graph, v, user, recomputable, copies)

    copy = graph.node_copy(value, arg)
    copy.meta = {**value.meta, **_placed_like(user)}
    copies[value] = copy
    return copy


def _placed_like(user: torch.fx.Node) -> dict[str, Any]:
    """The copy belongs to its user's module call (for the IR's module paths) and source line."""
    return {k: user.meta[k] for k in ("nn_module_stack", "stack_trace", "loc") if k in user.meta}
