"""The routing of a mixture-of-experts model as the plan prices it, for `compile --explain`.

A mixture-of-experts layer multiplies its routed (token, expert) pairs, sorted by expert, by the
experts' stacked weights in one grouped multiply (`dapple_ir.frontend.grouped_matmul` prices it):
its left operand has a row per routed pair and its weight operand an expert per leading index. The
router picks each token's experts with `topk` in a sibling module (`mlp.gate` beside `mlp.experts`),
whose result is (tokens, top_k). Which expert a token goes to depends on the data, so the plan
prices the pairs as they come, and shows the tokens per expert of an even routing.
"""

from __future__ import annotations

from dataclasses import dataclass

from dapple_ir.ir import Module, Op, TensorType, TupleType

__all__ = ["ExpertLayer", "expert_layers", "expert_lines"]


@dataclass(frozen=True)
class ExpertLayer:
    """One mixture-of-experts layer, at the module's captured batch."""

    path: str
    """Module path of the experts (`model.layers.0.mlp.experts`)."""
    experts: int
    """Experts the layer holds."""
    pairs: int
    """Routed (token, expert) pairs: the rows of its grouped multiply."""
    tokens: int | None
    """Tokens routed (the router's `topk` rows), when the router was found."""
    top_k: int | None
    """Experts per token, when the router was found."""


def _is_grouped_matmul(op: Op) -> bool:
    return bool(op.target) and "grouped_mm" in str(op.target) and len(op.operands) >= 2


def _router_shape(module: Module, parent: str) -> tuple[int, int] | None:
    """(tokens, top_k) of the first `topk` under `parent` (the experts' sibling router)."""
    for op in module.ops:
        path = op.attrs.module_path or ""
        if "topk" not in str(op.target or "") or not path.startswith(parent + "."):
            continue
        values = op.type.elements[0] if isinstance(op.type, TupleType) else op.type
        if isinstance(values, TensorType) and len(values.shape) == 2:
            return values.shape[0], values.shape[1]
    return None


def expert_layers(module: Module) -> list[ExpertLayer]:
    """Each layer's first grouped multiply (its up projection), in module order."""
    layers: dict[str, ExpertLayer] = {}
    for op in module.ops:
        path = op.attrs.module_path or ""
        if not _is_grouped_matmul(op) or path in layers:
            continue
        rows, weight = op.operands[0].type, op.operands[1].type
        if not isinstance(rows, TensorType) or not isinstance(weight, TensorType) or len(weight.shape) != 3:
            continue
        router = _router_shape(module, path.rpartition(".")[0])
        tokens, top_k = router if router else (None, None)
        layers[path] = ExpertLayer(path, weight.shape[0], rows.shape[0], tokens, top_k)
    return list(layers.values())


def expert_lines(module: Module) -> list[str]:
    """What `--explain` says of the experts: per layer, the tokens per expert in one microbatch."""
    layers = expert_layers(module)
    batch, micro = module.attrs.batch, module.attrs.microbatch_size
    if not layers or not batch or not micro:
        return []
    scale = micro / batch
    lines = [
        f"mixture of experts: {len(layers)} layer(s); the experts are priced at the (token, expert) pairs the router "
        f"sends them, per microbatch of {micro} sample(s), and the tokens per expert assume an even routing"
    ]
    for layer in layers:
        pairs = layer.pairs * scale
        routed = ""
        if layer.tokens and layer.top_k:
            routed = (
                f" ({layer.tokens * scale:g} tokens x top-{layer.top_k}: {layer.top_k}/{layer.experts} of running "
                "every token through every expert)"
            )
        lines.append(
            f"  {layer.path}: {layer.experts} experts, {pairs:g} routed pairs{routed}, "
            f"{pairs / layer.experts:g} tokens per expert"
        )
    return lines
