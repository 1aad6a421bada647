"""Result types of a traced graph without running it: every node runs on meta tensors (shapes and
dtypes only), and a node without a meta kernel on fake tensors, which know more ops."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode
from torch.func import functional_call
from torch.utils._pytree import tree_map

from dapple_ir.errors import CaptureError
from dapple_ir.frontend.graph_checks import dynamic_shape_error
from dapple_ir.frontend.method_failure import MethodFailed, quiet
from dapple_ir.frontend.module_paths import op_path
from dapple_ir.frontend.source_locations import location

#: ATen ops whose result shape depends on tensor values (boolean masks index through nonzero).
_DATA_DEPENDENT_OPS = ("nonzero", "masked_select", "unique", "repeat_interleave", "bincount", "histc")


def _to_meta(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


class _Propagate(torch.fx.Interpreter):
    """Runs the graph on meta tensors, storing each node's result as `node.meta["val"]`."""

    def __init__(self, gm: Any) -> None:
        super().__init__(gm)
        self.extra_traceback = False  # our errors name the op themselves
        self.metas: dict[int, Any] = {}

    def as_meta(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.is_meta:
            return t
        if id(t) not in self.metas:
            self.metas[id(t)] = _to_meta(t)
        return self.metas[id(t)]

    def run_node(self, n: torch.fx.Node) -> Any:
        try:
            result = super().run_node(n)
        except CaptureError:
            raise
        except Exception as exc:
            culprit = next((op for op in _DATA_DEPENDENT_OPS if op in str(exc)), None)
            if culprit:
                raise dynamic_shape_error(n, f"torch.{culprit} has an output size that depends on values") from exc
            result = _run_node_fake(self, n, exc)
        n.meta["val"] = result
        return result

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self.as_meta(super().get_attr(target, args, kwargs))

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        sub = self.fetch_attr(target)
        # The module's own tensors are swapped for meta ones: its in-place buffer updates land there.
        state = {k: self.as_meta(v) for k, v in [*sub.named_parameters(), *sub.named_buffers()]}
        return functional_call(sub, state, tuple(args), kwargs)


def propagate(gm: Any, flat: tuple) -> None:
    """Run `gm` on meta tensors, storing each node's result as `node.meta["val"]`.

    Meta tensors carry shapes and dtypes only, so a model of any size propagates in little memory
    and time. A node without a meta kernel is retried on fake tensors, which know more ops.
    """
    interpreter = _Propagate(gm)
    with quiet():
        interpreter.run(*[interpreter.as_meta(v) for v in flat])


def _run_node_fake(interp: Any, n: Any, meta_failure: Exception) -> Any:
    """One node on fake tensors (the fallback for ops without a meta kernel); returns meta results."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def to_fake(t: Any) -> Any:
        return mode.from_tensor(t) if isinstance(t, torch.Tensor) else t

    saved = interp.env
    interp.env = {k: tree_map(to_fake, v) for k, v in saved.items()}
    try:
        with mode:
            result = torch.fx.Interpreter.run_node(interp, n)
    except DynamicOutputShapeException as exc:
        raise dynamic_shape_error(n, f"{exc} has an output size that depends on values") from exc
    except Exception as exc:
        loc = location(n)
        raise MethodFailed("fx", meta_failure, op_path(n), f"{loc} (op %{n.name})" if loc else f"op %{n.name}") from exc
    finally:
        interp.env = saved
    return tree_map(_to_meta, result)
