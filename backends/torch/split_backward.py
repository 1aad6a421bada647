"""The zero-bubble split of a stage's backward: an input pass now, the weight passes later.

`input_pass` runs the autograd nodes that lead back to the stage's inputs and returns their gradients
with the `WeightPass`es that `weight_passes` runs later (zb-h1's `backward_input` and `backward_weight`).
The two together compute exactly what one `torch.autograd.backward` computes, but not for the same
price: the weight work is one autograd pass per op whose parameters branch off the path to the inputs
(each pass restarts from the gradient captured at that op), and the input pass first walks the graph to
find those ops, and the weight passes touch the parameter gradients again once the caches have moved on.
`measure_split_overhead` times that price per such op on chains of several widths; `dapple calibrate` fits
`DeviceKind.split_backward_overhead` (per op) and `split_backward_per_byte` to it, and the simulator and the
planner charge them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from statistics import median
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

from dapple_ir.frontend.measure import rank_threads


@dataclass
class WeightPass:
    """One autograd pass of `backward_weight`: from `roots` (tensors or gradient edges) with `grads` to `params`."""

    roots: list[Any]
    grads: list[torch.Tensor | None]
    params: list[torch.Tensor]


def input_pass(
    outs: list[torch.Tensor], grads: list[torch.Tensor | None], leaves: list[torch.Tensor], params: list[torch.Tensor]
) -> tuple[list[torch.Tensor | None], list[WeightPass]]:
    """The gradients of `leaves` (None where the outputs do not depend on one) from `outs` given `grads`, and
    the passes that later produce the gradients of `params` without redoing this work (`weight_split`).

    With no leaves (a first stage: nothing to hand back) the single weight pass is the whole backward; where a
    parameter is reached along two branches, one pass from the outputs (it recomputes the input-gradient chain,
    but counts every parameter once)."""
    if not outs or not leaves:
        return [None] * len(leaves), [WeightPass(list(outs), list(grads), params)] if outs and params else []
    split = weight_split(outs, grads, leaves, params)
    captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    hooks = [node.register_prehook(capture(captured, node)) for node, _ in split[1]] if split else []
    try:
        found = torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True)
    finally:
        for hook in hooks:
            hook.remove()
    if split is None:
        return list(found), [WeightPass(list(outs), list(grads), params)]
    detached, groups = split
    deferred = [detached]
    for node, node_params in groups:
        at = captured.get(node, ())
        edges = [(GradientEdge(node, i), g) for i, g in enumerate(at) if g is not None]
        if edges:
            deferred.append(WeightPass([e for e, _ in edges], [g for _, g in edges], node_params))
    return list(found), deferred


def weight_passes(deferred: list[WeightPass]) -> None:
    """Accumulate the parameter gradients of `input_pass`'s deferred passes into the parameters' `.grad`."""
    passes = [wp for wp in deferred if wp.roots and wp.params]
    for k, wp in enumerate(passes):
        # Only the parameters accumulate: the input gradients were taken by the input pass. The last pass
        # lets autograd free the graph's saved tensors at once, not when Python drops it.
        torch.autograd.backward(wp.roots, wp.grads, retain_graph=k < len(passes) - 1, inputs=wp.params)


#: The chains `measure_split_overhead` times, by device type: rows and Linear + GELU layers, and the widths whose
#: weights span the sizes a layer's parameters have in the models run there.
SPLIT_CHAIN: dict[str, tuple[int, int, tuple[int, ...]]] = {
    "cpu": (32, 8, (256, 512, 1024)),
    "cuda": (64, 8, (1024, 2048, 4096)),
}


def measure_split_overhead(device: str | torch.device, ranks: int = 1, rounds: int = 24) -> list[tuple[float, float]]:
    """What a split backward costs on `device` beyond one whole backward, per op whose parameters the weight work
    reaches on its own pass: per width of `SPLIT_CHAIN`, (the bytes of one layer's weight and bias, the extra
    seconds per layer) on a chain of Linear + GELU layers that wide. Each figure is the median over `rounds` of
    (input pass + weight passes - whole backward), the two timed back to back, over the chain's layers.
    `dapple calibrate` reads a price per op and per byte off the line through them.

    The per-op part is host work (one more autograd pass, the input pass's walk of the graph); the per-byte part
    is what the weight pass pays for touching its parameter gradients again after the caches moved on (the dev
    VM: about 120 us at 256 wide, 230 at 512, 340 at 1024). Both backwards produce the chain input's gradient
    and accumulate into existing parameter gradients, as a stage does from its second microbatch on. On a CPU it
    runs with one of `ranks` ranks' share of the cores, alone: the other ranks share the memory, not those cores."""
    device = torch.device(device)
    rows, depth, widths = SPLIT_CHAIN["cuda" if device.type == "cuda" else "cpu"]
    with rank_threads(device.type, ranks):
        return [(4.0 * (w * w + w), _split_overhead(device, w, rows, depth, rounds)) for w in widths]


def _split_overhead(device: torch.device, width: int, rows: int, depth: int, rounds: int) -> float:
    """The median extra seconds per layer of a split backward over a whole one, on a chain `width` wide."""
    chain = torch.nn.Sequential(*[m for _ in range(depth) for m in (torch.nn.Linear(width, width), torch.nn.GELU())])
    chain = chain.to(device)
    params: list[torch.Tensor] = list(chain.parameters())
    x, g = torch.randn(rows, width, device=device), torch.randn(rows, width, device=device)

    def timed(backward: Callable[[torch.Tensor, torch.Tensor], object]) -> float:
        leaf = x.detach().requires_grad_(True)
        out = chain(leaf)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        backward(leaf, out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    def whole(_leaf: torch.Tensor, out: torch.Tensor) -> None:
        torch.autograd.backward([out], [g])

    def split(leaf: torch.Tensor, out: torch.Tensor) -> None:
        grads: list[torch.Tensor | None] = [g]
        weight_passes(input_pass([out], grads, [leaf], params)[1])

    timed(whole), timed(split)  # warm-up, and the gradients every later round accumulates into
    extra = [timed(split) - timed(whole) for _ in range(rounds)]
    return median(extra) / depth


def weight_split(
    outs: list[torch.Tensor], grads: list[torch.Tensor | None], leaves: list[torch.Tensor], params: list[torch.Tensor]
) -> tuple[WeightPass, list[tuple[Node, list[torch.Tensor]]]] | None:
    """How `backward_weight` reaches the parameters without redoing `backward_input`'s work.

    The input pass runs the autograd nodes that lead to a stage input (`leaves`). Each of them whose
    other branches lead to parameters becomes a group: the gradient flowing into the node is captured
    during the input pass, and the weight pass restarts from that node's gradient edges towards those
    parameters only, so it runs the parameter branches and nothing else. Outputs that do not depend
    on any input form one more pass of their own. None when a parameter is reached from two places
    (a weight used twice, say): separate passes would then miss or double its gradient.
    """
    by_id = {id(p): p for p in params}
    leaf_ids = {id(t) for t in leaves}
    reaches_leaf: dict[Node, bool] = {}
    below: dict[Node, frozenset[int]] = {}  # ids of the parameters in `by_id` a node's gradient reaches
    stack: list[tuple[Node, bool]] = [(o.grad_fn, False) for o in outs if o.grad_fn is not None]
    while stack:  # iterative post-order: stage graphs can be deeper than Python's recursion limit
        node, expanded = stack.pop()
        if node in below:
            continue
        children = [c for c, _ in node.next_functions if c is not None]
        if not expanded:
            stack.append((node, True))
            stack.extend((c, False) for c in children if c not in below)
            continue
        variable = getattr(node, "variable", None)
        own = id(variable) if variable is not None else None
        reaches_leaf[node] = own in leaf_ids or any(reaches_leaf[c] for c in children)
        below[node] = frozenset({own} if own in by_id else ()).union(*(below[c] for c in children))
    groups: list[tuple[Node, frozenset[int]]] = []
    for node, on_input_path in reaches_leaf.items():
        off_path = [c for c, _ in node.next_functions if c is not None and not reaches_leaf[c]]
        off = frozenset().union(*(below[c] for c in off_path))
        if on_input_path and off:
            groups.append((node, off))
    # Outputs whose gradient never reaches a stage input: their whole backward is weight work.
    detached = [(o, g) for o, g in zip(outs, grads, strict=True) if o.grad_fn and not reaches_leaf[o.grad_fn]]
    detached_params = frozenset().union(*(below[o.grad_fn] for o, _ in detached if o.grad_fn))
    counted = [detached_params, *(ps for _, ps in groups)]
    if sum(len(ps) for ps in counted) != len(frozenset().union(*counted)):
        return None
    whole = WeightPass([o for o, _ in detached], [g for _, g in detached], [by_id[i] for i in detached_params])
    return whole, [(node, [by_id[i] for i in ps]) for node, ps in groups]


def capture(into: dict[Node, tuple[torch.Tensor | None, ...]], node: Node) -> Callable[..., None]:
    """A pre-hook that keeps the gradient flowing into `node` (the input pass's by-product the weight pass needs)."""

    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        into[node] = grad_outputs

    return hook
