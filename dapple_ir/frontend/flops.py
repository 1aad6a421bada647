"""Per-op FLOPs, bytes moved and activation bytes of a captured model, from torch itself.

`annotate_flops(captured)` replays the captured `torch.fx` graph one node at a time on meta tensors
(no real memory, so it works for models far larger than this machine) and records on each IR op:

- `fwd_flops`: FLOPs of the node's forward, counted by `torch.utils.flop_counter.FlopCounterMode`;
- `bwd_flops`: FLOPs of the node's backward: the node is rerun with its floating inputs and
  parameters requiring grad and `torch.autograd.grad` is counted (input and weight gradients);
- `mem_bytes`: bytes the forward reads and writes: tensor inputs + outputs + parameters read, and 0
  for ops that only touch metadata (views, `x.shape`): no ATen op other than a view ran;
- `act_bytes`: bytes kept for backward, from the tensors autograd saves while the node runs
  (`saved_tensors_hooks`). Parameters are not activations and are left out. A saved tensor that is
  the node's own output or one of its inputs is charged once, to the op that produced it, so a
  value saved by both its producer and its consumer (ReLU then Linear) is counted once;
- `op_class`: which efficiency factor of the cluster applies (`matmul`, `conv`, `attention`,
  `elementwise`), from the callee's name and the ATen ops the counter saw.

Nodes with the same callee, input shapes and constants (the blocks of a transformer) are measured
once and the result reused, which keeps capture of a GPT-2 XL sized model to about a second here.

All values are at the captured batch (`module.attrs.batch`); `module.attrs.cost_batch` is set to it
when unset, since `act_bytes` describes that batch. A node that cannot be replayed on meta tensors
keeps no cost attributes (and is named in the returned list) rather than failing the capture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten
from torch.utils.flop_counter import FlopCounterMode

from dapple_ir.frontend.dtypes import TORCH_DTYPE_OF
from dapple_ir.frontend.grouped_matmul import grouped_matmul_formulas
from dapple_ir.ir import Module, Op, TensorType

#: ATen op name fragments that decide an op's efficiency class, most specific first.
_CLASS_OF_ATEN = (
    ("attention", "attention"),
    ("convolution", "conv"),
    ("conv", "conv"),
    ("mm", "matmul"),
    ("matmul", "matmul"),
    ("linear", "matmul"),
)


def annotate_flops(captured: Any) -> list[str]:
    """Set fwd/bwd FLOPs, bytes moved, activation bytes and op class on `captured.module`'s ops.

    Returns the names of the nodes that could not be replayed (left without costs).
    """
    module: Module = captured.module
    replay = _Replay(captured.graph_module, module)
    replay.run()
    if module.attrs.cost_batch is None:
        module.attrs.cost_batch = module.attrs.batch
    return replay.skipped


# ------------------------------------------------------------------------------ values on meta


def _meta_tensor(t: TensorType) -> torch.Tensor:
    return torch.empty(t.shape, dtype=TORCH_DTYPE_OF[t.dtype], device="meta")


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


def _placeholder_value(node: Any, position: int, inputs: list[Op]) -> Any:
    val = node.meta.get("val")
    if val is not None:
        return tree_map(_to_meta, val)
    t = inputs[position].type if position < len(inputs) else None
    if isinstance(t, TensorType):
        return _meta_tensor(t)
    raise ValueError(f"no example value for placeholder {node.name}")


def _fallback_value(node: Any) -> Any:
    val = node.meta.get("val")
    if val is None and "tensor_meta" in node.meta:
        tm = node.meta["tensor_meta"]
        return torch.empty(tm.shape, dtype=tm.dtype, device="meta") if hasattr(tm, "shape") else None
    return tree_map(_to_meta, val)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _nbytes(tensors: list[torch.Tensor]) -> float:
    return float(sum(t.numel() * t.element_size() for t in tensors))


def _is_node(value: Any) -> bool:
    return isinstance(value, torch.fx.Node)


def _storage_id(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


def _fetch_attr(gm: Any, target: str) -> Any:
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _op_class(target: str, counts: dict[str, dict[Any, int]], flops: float) -> str:
    if flops <= 0:
        return "elementwise"
    # The callee's name first: fused attention decomposes into plain bmm on meta tensors.
    names = [target.lower()] + [str(aten) for aten, n in counts.get("Global", {}).items() if n > 0]
    for fragment, op_class in _CLASS_OF_ATEN:
        if any(fragment in name for name in names):
            return op_class
    return "matmul"


# ------------------------------------------------------------------------------- the replay


@dataclass
class _Measured:
    """What one node costs, independent of where it sits (reused for identical nodes)."""

    fwd_flops: float
    bwd_flops: float
    mem_bytes: float
    op_class: str
    internal: float
    """Saved bytes that are neither an input nor the output."""
    out_saved: bool
    """The backward needs the node's own output."""
    saved_inputs: frozenset[int]
    """Positions (among the tensor inputs, in argument order) of the inputs the backward needs."""
    out_leaves: list[Any]
    """The output's leaves: (shape, stride, dtype) for tensors, the value otherwise."""
    out_spec: Any
    """The output's pytree structure."""


class _Replay:
    """Runs the graph node by node on meta tensors, measuring each node on its own.

    Nodes with the same callee and the same input shapes (the blocks of a transformer) are measured
    once: that keeps capture of a 48-block model in seconds.
    """

    def __init__(self, gm: Any, module: Module) -> None:
        self.gm = gm
        self.ops = {op.name: op for op in module.ops}
        self.inputs = module.inputs()
        self.env: dict[Any, Any] = {}
        self.skipped: list[str] = []
        self.internal: dict[str, float] = {}  # node -> saved bytes that are neither inputs nor outputs
        self.kept: set[str] = set()  # nodes whose output some node saves for backward
        self.out_bytes: dict[str, float] = {}
        self.memo: dict[Any, _Measured] = {}
        # Ops torch's counter does not price (a mixture of experts' grouped multiplies).
        self.formulas = grouped_matmul_formulas()

    def run(self) -> None:
        placeholders = 0
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                self.env[node] = _placeholder_value(node, placeholders, self.inputs)
                placeholders += 1
                # An input saved by its consumer (the first Linear) is kept alive for backward too.
                self.out_bytes[node.name] = _nbytes(_tensors(self.env[node]))
                self.internal[node.name] = 0.0
                continue
            if node.op == "output":
                continue
            try:
                self.env[node] = self.measure(node)
            except Exception:
                self.env[node] = _fallback_value(node)
                self.skipped.append(node.name)
        for name, op in self.ops.items():
            if name in self.internal:
                kept = self.out_bytes.get(name, 0.0) if name in self.kept else 0.0
                op.attrs.act_bytes = self.internal[name] + kept

    def measure(self, node: Any) -> Any:
        if node.op == "get_attr":
            # Reading a parameter moves nothing by itself; its consumers count the bytes.
            self.record(node, _Measured(0.0, 0.0, 0.0, "elementwise", 0.0, False, frozenset(), [], None))
            return _to_meta(_fetch_attr(self.gm, node.target))
        key = self.signature(node)
        measured: _Measured | None = self.memo.get(key) if key is not None else None
        if measured is None:
            measured = self.measure_fresh(node)
            if key is not None:
                self.memo[key] = measured
        self.record(node, measured)
        return _rebuild(measured)

    def record(self, node: Any, m: _Measured) -> None:
        self.internal[node.name] = m.internal
        self.out_bytes[node.name] = _nbytes_of_leaves(m.out_leaves)
        if m.out_saved:
            self.kept.add(node.name)
        sources = self.input_sources(node)
        for i in m.saved_inputs:
            source = sources[i] if i < len(sources) else None
            if source is not None:
                self.kept.add(source)
        op = self.ops.get(node.name)
        if op is None:
            return
        op.attrs.fwd_flops, op.attrs.bwd_flops = m.fwd_flops, m.bwd_flops
        op.attrs.mem_bytes, op.attrs.op_class = m.mem_bytes, m.op_class

    def input_sources(self, node: Any) -> list[str | None]:
        """The node producing each tensor input, in argument order (None for parameters)."""
        sources: list[str | None] = []
        for leaf in _flat((node.args, node.kwargs)):
            if _is_node(leaf):
                name = None if leaf.op == "get_attr" else leaf.name
                sources += [name] * len(_tensors(self.env[leaf]))
        return sources

    def signature(self, node: Any) -> Any:
        """A hashable key that equal nodes share: callee, input shapes and constants (None: do not reuse)."""
        parts: list[Any] = [node.op]
        if node.op == "call_module":
            sub = self.gm.get_submodule(node.target)
            tensors = [*sub.named_parameters(), *sub.named_buffers()]
            parts.append((type(sub), repr(sub), sub.training, tuple((n, _tensor_sig(t)) for n, t in tensors)))
        else:
            parts.append(node.target)
        leaves, spec = tree_flatten((node.args, node.kwargs))
        order: dict[Any, int] = {}
        for leaf in leaves:
            if not _is_node(leaf):
                parts.append(("const", repr(leaf)))
                continue
            values, value_spec = tree_flatten(self.env[leaf])
            # Which argument repeats which (x * x) matters for what the backward saves.
            first = order.setdefault(leaf, len(order))
            parts.append((first, leaf.op == "get_attr", str(value_spec), tuple(_value_sig(v) for v in values)))
        parts.append(str(spec))
        key = tuple(parts)
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def node_params(self, node: Any) -> dict[str, torch.Tensor]:
        """Meta copies of the parameters and buffers a module node reads, by their name inside it."""
        if node.op != "call_module":
            return {}
        sub = self.gm.get_submodule(node.target)
        named = list(sub.named_parameters(recurse=True)) + list(sub.named_buffers(recurse=True))
        return {name: _to_meta(t) for name, t in named}

    def call(self, node: Any, args: Any, kwargs: Any, params: dict[str, torch.Tensor]) -> Any:
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        if node.op == "call_module":
            return functional_call(self.gm.get_submodule(node.target), params, tuple(args), kwargs)
        raise ValueError(f"node kind {node.op} is not replayed")

    def measure_fresh(self, node: Any) -> _Measured:
        """Forward (counted, saved tensors recorded) then backward (counted) of one node."""
        leaves: list[torch.Tensor] = []
        positions: dict[int, int] = {}  # storage of a cloned input -> its position among the tensor inputs
        weights: set[int] = set()  # storages of parameters and buffers: never activations

        def prepare(t: Any, position: int | None) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            if t.is_floating_point():
                t = t.detach().requires_grad_(True)
                leaves.append(t)
            if position is None:
                weights.add(_storage_id(t))
                return t
            # Cloned so that in-place ops (ReLU(inplace)) do not write into a leaf.
            clone = t.clone()
            positions[_storage_id(clone)] = position
            return clone

        sources = self.input_sources(node)
        counter = iter(range(len(sources)))

        def from_node(n: Any) -> Any:
            if not _is_node(n):
                return n

            def one(t: Any) -> Any:
                if not isinstance(t, torch.Tensor):
                    return t
                position = next(counter)
                # A parameter read through get_attr (export graphs) is a weight, never an activation.
                return prepare(t, None if sources[position] is None else position)

            return tree_map(one, self.env[n])

        args, kwargs = tree_map(from_node, (node.args, node.kwargs))
        params = {k: prepare(v, None) for k, v in self.node_params(node).items()}
        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t)
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        data = _DataMovement()
        with (
            torch.enable_grad(),
            hooks,
            FlopCounterMode(display=False, custom_mapping=self.formulas) as forward_counter,
            data,
        ):
            out = self.call(node, args, kwargs, params)
        fwd_flops = float(forward_counter.get_total_flops())
        outs = [t for t in _tensors(out) if t.requires_grad]
        internal, out_saved, saved_inputs = _charge_saved(saved, weights, outs, positions)
        bwd_flops = 0.0
        if outs and leaves:
            with FlopCounterMode(display=False, custom_mapping=self.formulas) as backward_counter:
                torch.autograd.grad(outs, leaves, [torch.empty_like(t) for t in outs], allow_unused=True)
            bwd_flops = float(backward_counter.get_total_flops())
        out_tensors = _tensors(out)
        in_bytes = _nbytes(_tensors((args, kwargs))) + _nbytes(list(params.values()))
        out_leaves, out_spec = _template(out)
        return _Measured(
            fwd_flops=fwd_flops,
            bwd_flops=bwd_flops,
            # Views, reshapes of contiguous tensors and `x.shape` only touch metadata.
            mem_bytes=in_bytes + _nbytes(out_tensors) if data.moves_data else 0.0,
            op_class=_op_class(str(node.target), forward_counter.get_flop_counts(), fwd_flops),
            internal=internal,
            out_saved=out_saved,
            saved_inputs=frozenset(saved_inputs),
            out_leaves=out_leaves,
            out_spec=out_spec,
        )


class _DataMovement(TorchDispatchMode):
    """A dispatch mode whose `moves_data` says whether any ATen op other than a view ran under it."""

    def __init__(self) -> None:
        super().__init__()
        self.moves_data = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view and func is not torch.ops.aten._unsafe_view.default:
            self.moves_data = True
        return func(*args, **(kwargs or {}))


def _flat(value: Any) -> list[Any]:
    return list(tree_leaves(value))


def _charge_saved(
    saved: list[torch.Tensor], weights: set[int], outs: list[torch.Tensor], positions: dict[int, int]
) -> tuple[float, bool, set[int]]:
    """Sort saved tensors, each once: weights (ignored), the output, inputs (by position), the rest."""
    skip = set(weights)
    out_storages = {_storage_id(t) for t in outs}
    internal, out_saved, inputs = 0.0, False, set()
    for t in saved:
        sid = _storage_id(t)
        if sid in skip:
            continue
        skip.add(sid)
        if sid in out_storages:
            out_saved = True
        elif sid in positions:
            inputs.add(positions[sid])
        else:
            internal += _nbytes([t])
    return internal, out_saved, inputs


def _tensor_sig(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), tuple(t.stride()), t.dtype)


def _value_sig(value: Any) -> Any:
    return _tensor_sig(value) if isinstance(value, torch.Tensor) else ("value", repr(value))


def _template(out: Any) -> tuple[list[Any], Any]:
    leaves, spec = tree_flatten(out)
    return [_tensor_sig(v) if isinstance(v, torch.Tensor) else ("value", v) for v in leaves], spec


def _rebuild(m: _Measured) -> Any:
    """Fresh meta tensors shaped like the measured output (detached: later nodes start from leaves)."""
    values = [
        leaf[1] if leaf[0] == "value" else torch.empty_strided(leaf[0], leaf[1], dtype=leaf[2], device="meta")
        for leaf in m.out_leaves
    ]
    return tree_unflatten(values, m.out_spec)


def _nbytes_of_leaves(leaves: list[Any]) -> float:
    total = 0.0
    for leaf in leaves:
        if leaf[0] != "value":
            shape, _stride, dtype = leaf
            total += math.prod(shape) * dtype.itemsize
    return total
