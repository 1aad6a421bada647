"""Group ops into an ordered list of layers, cut where few bytes cross."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from dapple_ir.analysis.activation_checkpoints import block_boundaries
from dapple_ir.analysis.module_cuts import FLOATING, module_starts
from dapple_ir.errors import PassError
from dapple_ir.ir import Layer, LayerAttrs, Module, Op, OpaqueType, OpKind
from dapple_ir.registry import Pass, PassContext, option, register_pass

# Inputs and parameter reads never cross a cut: every stage that reads an input loads it, and a stage that
# reads a parameter holds it (`analysis.stage_graph`). An input whose shape later blocks read (for
# their sizes) would otherwise count as bytes sent across every cut.
_LOADED = (OpKind.INPUT, OpKind.GET_ATTR)


@register_pass
@dataclass(frozen=True)
class Coarsen(Pass):
    """Group ops into at most max-layers layers at cuts where few bytes cross; sum their costs. Where the model's
    blocks begin stays a boundary while there are fewer blocks than max-layers (`block_boundaries`): a recomputing
    stage checkpoints there, and the planner prices those checkpoints per layer."""

    name = "coarsen"
    max_layers: int = option(128, "most layers to keep (the planner's granularity)")
    keep: tuple[str, ...] = option((), "modules whose beginning stays a layer boundary (plan's split-at)")

    def apply(self, ctx: PassContext, module: Module) -> None:
        if self.max_layers < 1:
            raise PassError(f"coarsen: max-layers must be at least 1, not {self.max_layers}")
        chain, position = _anchor(module)
        if not chain:
            raise PassError(f"coarsen: module @{module.name} has no ops to group")
        crossing = _crossing(module, position, len(chain))
        starts = module_starts(module)
        kept = {position[starts[name]] for name in self.keep if name in starts}
        kept |= block_boundaries(chain, self.max_layers)
        bounds = _choose_cuts(module, chain, crossing, self.max_layers, kept)
        module.layers = _build_layers(module, chain, position, bounds, crossing)
        ctx.log(f"coarsen: {len(module.ops)} ops into {len(module.layers)} layers")


def _anchor(module: Module) -> tuple[list[Op], dict[Op, int]]:
    """The chain of anchored ops, and each op's position in it (floating ops: their first user's)."""
    # Inputs and parameter reads (`FLOATING`) have no place of their own in the chain: they join their
    # first user, so a loss target read only by the last op never crosses a cut. The output joins the loss.
    chain = [op for op in module.ops if op.kind not in FLOATING]
    position = {op: i for i, op in enumerate(chain)}
    users = module.users()
    for op in module.ops:
        if op.kind is OpKind.OUTPUT:
            position[op] = max((position.get(v, 0) for v in op.operands), default=len(chain) - 1)
    for op in module.ops:
        if op in position:
            continue
        placed = [position[u] for u in users[op] if u in position]
        position[op] = min(placed) if placed else 0
    return chain, position


def _is_opaque(op: Op) -> bool:
    return isinstance(op.type, OpaqueType) and op.attrs.out_bytes is None


def _crossing(module: Module, position: dict[Op, int], n: int) -> list[tuple[float, int, int]]:
    """Per boundary k (before chain op k): bytes crossing, values crossing, opaque values crossing."""
    nbytes, count, opaque = [0.0] * (n + 1), [0] * (n + 1), [0] * (n + 1)
    users = module.users()
    for op in module.ops:
        last = max((position[u] for u in users[op]), default=position[op])
        if last <= position[op] or op.kind in _LOADED:
            continue
        # The value crosses boundaries position+1 .. last (difference arrays, summed below).
        lo, hi = position[op] + 1, last + 1
        nbytes[lo] += op.out_bytes
        nbytes[hi] -= op.out_bytes
        count[lo] += 1
        count[hi] -= 1
        if _is_opaque(op):
            opaque[lo] += 1
            opaque[hi] -= 1
    result, b, c, o = [], 0.0, 0, 0
    for k in range(n + 1):
        b, c, o = b + nbytes[k], c + count[k], o + opaque[k]
        result.append((max(b, 0.0), c, o))
    return result


def _choose_cuts(
    module: Module, chain: list[Op], crossing: list[tuple[float, int, int]], max_layers: int, kept: set[int]
) -> list[int]:
    """Boundaries [0, ..., n]: every legal cut, then merges of the cheapest neighbours until few enough;
    the `kept` cuts are never merged away (a kept position that is no legal cut is no boundary: `plan`
    names the nearest ones)."""
    n = len(chain)
    legal = [k for k in range(1, n) if crossing[k][2] == 0]
    cuts = [0, *legal, n]
    cost = [(op.attrs.fwd_s or 0.0) + (op.attrs.bwd_s or 0.0) for op in chain]
    total = sum(cost) or 1.0
    mean_cut = sum(crossing[k][0] for k in legal) / max(1, len(legal)) or 1.0
    target = total / max_layers
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    # Doubly linked list over the cuts; a heap of removal scores with lazy invalidation.
    prev = {k: cuts[i - 1] for i, k in enumerate(cuts) if i > 0}
    nxt = {k: cuts[i + 1] for i, k in enumerate(cuts) if i < len(cuts) - 1}
    alive = set(cuts)

    def score(k: int) -> float:
        # Cheap to remove: a cut that many bytes cross, between layers that together stay small.
        merged = (prefix[nxt[k]] - prefix[prev[k]]) / (target or 1.0)
        return merged - crossing[k][0] / mean_cut - 0.5 * (crossing[k][1] - 1)

    heap = [(score(k), k, prev[k], nxt[k]) for k in legal if k not in kept]
    heapq.heapify(heap)
    layers = len(cuts) - 1
    while layers > max_layers and heap:
        _, k, p, q = heapq.heappop(heap)
        if k not in alive or prev[k] != p or nxt[k] != q:
            continue
        alive.discard(k)
        nxt[p], prev[q] = q, p
        layers -= 1
        for j in (p, q):
            if j in alive and 0 < j < n and j not in kept:
                heapq.heappush(heap, (score(j), j, prev[j], nxt[j]))
    return sorted(alive)


def _build_layers(
    module: Module, chain: list[Op], position: dict[Op, int], bounds: list[int], crossing: list[tuple[float, int, int]]
) -> list[Layer]:
    index = [0] * (len(chain) + 1)
    for i in range(len(bounds) - 1):
        for k in range(bounds[i], bounds[i + 1]):
            index[k] = i
    members: list[list[Op]] = [[] for _ in range(len(bounds) - 1)]
    for op in module.ops:
        members[index[position[op]]].append(op)
    layers = []
    for i, ops in enumerate(members):
        end = bounds[i + 1]
        attrs = LayerAttrs(
            fwd_s=sum(op.attrs.fwd_s or 0.0 for op in ops),
            bwd_s=sum(op.attrs.bwd_s or 0.0 for op in ops),
            param_bytes=module.param_bytes_of(ops),
            act_bytes=sum(op.attrs.act_bytes or 0.0 for op in ops),
            cut_bytes=crossing[end][0] if end < len(chain) else 0.0,
        )
        layers.append(Layer(f"L{i}", ops, attrs))
    return layers
