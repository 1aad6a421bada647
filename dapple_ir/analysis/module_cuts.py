"""Module names as cut points: where each `nn.Module` of the captured graph begins, which boundaries
between coarsened layers such a beginning falls on, and the modules each stage holds.

torch.distributed.pipelining names a split point by the module a new stage begins at (`SplitPoint.
BEGINNING` at `layers.4`); `--split-at` takes the same names (`plan{split-at=...}`, which `coarsen{keep=...}`
keeps as layer boundaries), and `dapple export --to torch-pipelining` writes them back. A module begins at
its first anchored op in module order: inputs, parameter reads and the output float to their users
(`FLOATING`), so they never mark where a module begins.
"""

from __future__ import annotations

import difflib

from dapple_ir.errors import PlanError
from dapple_ir.ir import Module, Op, OpKind

#: Ops with no place of their own in the chain of layers: they join their first user's layer.
FLOATING = (OpKind.INPUT, OpKind.GET_ATTR, OpKind.OUTPUT)

#: The module path capture gives the loss function's ops (`frontend.module_paths.LOSS`).
LOSS_PATH = "loss_fn"


def _prefixes(path: str) -> list[str]:
    """`blocks.4.mlp.0` -> [`blocks`, `blocks.4`, `blocks.4.mlp`, `blocks.4.mlp.0`]."""
    parts = path.split(".")
    return [".".join(parts[: k + 1]) for k in range(len(parts))]


def _model_paths(op: Op) -> list[str]:
    """The model's modules `op` runs inside, outermost first (none for the loss and the model's own forward)."""
    path = op.attrs.module_path
    if not path or path == LOSS_PATH or path.startswith(LOSS_PATH + "."):
        return []
    return _prefixes(path)


def module_starts(module: Module) -> dict[str, Op]:
    """Every module of the model that runs an anchored op, and the first such op (module order)."""
    starts: dict[str, Op] = {}
    for op in module.ops:
        if op.kind in FLOATING:
            continue
        for name in _model_paths(op):
            starts.setdefault(name, op)
    return starts


def _first_anchored(ops: list[Op]) -> Op | None:
    return next((op for op in ops if op.kind not in FLOATING), None)


def boundary_names(module: Module) -> dict[int, str]:
    """Layer boundary k (stage cut before layer k, 0 < k < layers) -> the outermost module beginning there."""
    starts = module_starts(module)
    names: dict[int, str] = {}
    for k, layer in enumerate(module.layers[1:], start=1):
        first = _first_anchored(layer.ops)
        if first is None:
            continue
        name = next((p for p in _model_paths(first) if starts[p] is first), None)
        if name is not None:
            names[k] = name
    return names


def split_layers(module: Module, names: tuple[str, ...]) -> tuple[int, ...]:
    """The layer boundaries at which the modules `names` begin, sorted, each once; a PlanError naming the
    culprit and the nearest boundaries when a name is no module of the graph or begins inside a layer."""
    if not module.layers:
        raise PlanError("split-at: the module has no layers; run 'coarsen' before 'plan'")
    starts, named = module_starts(module), boundary_names(module)
    layer_of = {op: k for k, layer in enumerate(module.layers) for op in layer.ops}
    found = set()
    for name in names:
        if name not in starts:
            close = difflib.get_close_matches(name, list(starts), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; modules begin at: {_listing(named)}"
            raise PlanError(f"split-at {name}: no module of that name runs in the captured graph{hint}")
        k = layer_of[starts[name]]
        if starts[name] is _first_anchored(module.layers[0].ops):
            raise PlanError(
                f"split-at {name}: that module begins the model (layer L0), where the first stage begins anyway; "
                f"name where a later stage begins: {_listing(named)}"
            )
        if named.get(k) is None or starts[named[k]] is not starts[name]:
            raise PlanError(
                f"split-at {name}: the module begins inside layer L{k} of the coarsened graph, not at a boundary "
                f"between layers; the nearest boundaries are {_nearest(named, k)} (a cut inside a module is not "
                "legal there, or the pipeline's coarsen did not keep it: coarsen{keep=" + name + "})"
            )
        found.add(k)
    return tuple(sorted(found))


def _nearest(named: dict[int, str], k: int) -> str:
    before = [b for b in named if b <= k]
    after = [b for b in named if b > k]
    near = ([f"{named[max(before)]} (before)"] if before else []) + ([f"{named[min(after)]} (after)"] if after else [])
    return " and ".join(near) or "none: the model has a single layer"


def _listing(named: dict[int, str], most: int = 12) -> str:
    items = [named[k] for k in sorted(named)]
    return ", ".join(items[:most]) + (f", ... ({len(items)} in all)" if len(items) > most else "") or "nowhere"


def stage_modules(module: Module, lo: int, hi: int) -> list[str]:
    """The outermost modules whose every anchored op lies in layers [lo, hi), in order of their first op:
    torchtitan's `module_fqns_per_model_part` for that stage. The loss and the model's own forward are no
    module (torch's schedule runs the loss on the last stage)."""
    inside = {op for layer in module.layers[lo:hi] for op in layer.ops if op.kind not in FLOATING}
    outside: set[str] = set()
    for op in module.ops:
        if op.kind not in FLOATING and op not in inside:
            outside.update(_model_paths(op))
    found: list[str] = []
    for op in module.ops:
        if op not in inside:
            continue
        name = next((p for p in _model_paths(op) if p not in outside), None)
        if name is not None and name not in found:
            found.append(name)
    return found
