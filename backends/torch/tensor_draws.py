"""Random draws on split values of a tensor-parallel stage: each member draws what one device draws.

A draw is seeded by its op and microbatch (`random_draws`), and fills its tensor in order: a member drawing
over its slice alone would take the first 1/T of the whole draw, not its own part of it. So an op that draws
(dropout, attention with dropout, `bernoulli`, ...) and whose result is split runs on whole-shaped tensors:
each split argument is widened to its whole shape, this member's slices in place and zeros elsewhere
(`widened`); the op draws the whole tensor, the same numbers as one device; and the member keeps its slice of
the result (`narrowed`). Exact for ops that treat each slice of the split dimension on its own (elementwise
dropout, attention over heads); the price is T times that op's work. Both are differentiable (concatenation
and slicing), so the backward sees the member's slice of the op's gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from dapple_ir.ir import Op

#: Callees that draw random numbers whatever their arguments.
_RANDOM = frozenset({"bernoulli", "bernoulli_", "rand_like", "randn_like", "normal", "normal_", "uniform_"})


def widened(part: torch.Tensor, dim: int, parts: int, member: int, size: int) -> torch.Tensor:
    """The whole-shaped tensor holding `part` (member `member` of `size`'s slice) in place, zeros elsewhere."""
    pieces = []
    for piece in part.chunk(parts, dim):
        zeros = piece.new_zeros(piece.shape)
        pieces += [piece if k == member else zeros for k in range(size)]
    return torch.cat(pieces, dim)


def narrowed(whole: Any, dim: int, parts: int, member: int, size: int) -> Any:
    """Member `member` of `size`'s slice of `whole` (of each tensor of a tuple result)."""
    if isinstance(whole, tuple | list):
        return type(whole)(narrowed(w, dim, parts, member, size) for w in whole)
    if not isinstance(whole, torch.Tensor):
        return whole
    return torch.cat([part.chunk(size, dim)[member] for part in whole.chunk(parts, dim)], dim)


def draws(graph_module: torch.fx.GraphModule, node: torch.fx.Node, callee: str) -> bool:
    """Whether the node may draw random numbers (dropout of any kind, attention with dropout, random fills)."""
    if node.op == "call_module":
        return isinstance(graph_module.get_submodule(str(node.target)), torch.nn.modules.dropout._DropoutNd)
    if "dropout" in callee or callee in _RANDOM:
        return True
    if callee == "scaled_dot_product_attention":
        p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
        return not isinstance(p, int | float) or p > 0
    return False


def draw_whole(node: torch.fx.Node, ops: dict[str, Op], member: int, size: int) -> None:
    """Run the drawing op `node` on whole-shaped tensors: its split arguments widened, its result narrowed."""
    graph = node.graph

    def widen(arg: Any) -> Any:
        op = ops.get(arg.name) if isinstance(arg, torch.fx.Node) else None
        if op is None or op.attrs.tp_dim is None or op.attrs.tp_role == "row":
            return arg  # whole: a row-parallel op's result is summed, a value not of this pattern is not split
        with graph.inserting_before(node):
            return graph.call_function(widened, (arg, op.attrs.tp_dim, op.attrs.tp_parts or 1, member, size))

    node.args = tuple(widen(a) for a in node.args)
    node.kwargs = {k: widen(v) for k, v in node.kwargs.items()}
    op = ops[node.name]
    with graph.inserting_after(node):
        kept = graph.call_function(narrowed, (node, op.attrs.tp_dim, op.attrs.tp_parts or 1, member, size))
    node.replace_all_uses_with(kept, delete_user_cb=lambda user: user is not kept)
