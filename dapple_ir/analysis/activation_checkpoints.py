"""Activation checkpoints of a recomputing stage: where its forward is cut into segments that rerun one at a time.

A recomputing stage (`StageAttrs.recompute`) keeps no activations from its forward. Its backward reruns the
forward segment by segment, last first, as Megatron-LM's full uniform recomputation with one layer per checkpoint
(`--recompute-granularity full --recompute-method uniform --recompute-num-layers 1`) and
`torch.utils.checkpoint` around each block do. A segment begins wherever a new *block* begins: the element of a
module list or sequence the model repeats (`blocks.3`, `model.layers.12`, `transformer.h.0`: the shortest
prefix of an op's module path that ends in an index), and where the ops outside any block (embedding, final norm,
head, loss) begin or end. An element that is a single op (the Linear and ReLU children of an `nn.Sequential`) is
no block: a checkpoint before each op would keep every output, as much as the stage holds without recomputing, so
such runs rerun as one segment (`blocks`). A model without such paths (an imported profile, a flat graph) has one
segment: the whole stage reruns at once.

What a recomputing stage holds per microbatch in flight, from its forward to its backward (`kept_values`): the
model inputs it reads and every value made in one segment and read in a later one (a block's input, the mask
every block reads: each once). While its backward runs, one segment's activations live at a time
(`rerun_bytes`: the largest segment's). Segments follow the coarsened layers, so that the planner can price them
per layer (`layer_block_starts`); the runtime checkpoints the same segments (`backends/torch/layer_checkpoints.py`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from dapple_ir.analysis.module_cuts import FLOATING, LOSS_PATH
from dapple_ir.analysis.stage_graph import batch_statistics
from dapple_ir.ir import Module, Op, Stage


def block_of(op: Op) -> str | None:
    """The block `op` runs in: the shortest prefix of its module path that ends in an index (`blocks.3` of
    `blocks.3.mlp.0`), or None (outside any repeated module, or in the loss)."""
    path = op.attrs.module_path
    if not path or path == LOSS_PATH or path.startswith(LOSS_PATH + "."):
        return None
    parts = path.split(".")
    for k, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: k + 1])
    return None


def blocks(ops: Iterable[Op]) -> dict[Op, str | None]:
    """Each op's block (`block_of`), where its block holds more than one anchored op of `ops`; else None. A block of
    one op is no block: checkpointing at its start keeps its input, so a run of them keeps every value (see the
    module docstring)."""
    found = {op: block_of(op) for op in ops}
    sizes = Counter(block for op, block in found.items() if op.kind not in FLOATING)
    return {op: block if sizes[block] > 1 else None for op, block in found.items()}


def _layer_block(ops: list[Op], block: dict[Op, str | None]) -> str | None:
    """The block a coarsened layer belongs to: that of its first anchored op (floating ops join their users)."""
    first = next((op for op in ops if op.kind not in FLOATING), None)
    return block[first] if first is not None else None


def block_boundaries(chain: list[Op], most: int) -> set[int]:
    """Positions k in a chain of ops where a new block begins (op k's block differs from op k-1's), for `coarsen` to
    keep as layer boundaries; none where there would be `most` or more (the layers could not stay that few)."""
    block = blocks(chain)
    found = {k for k in range(1, len(chain)) if block[chain[k]] != block[chain[k - 1]]}
    return found if len(found) < most else set()


def layer_block_starts(module: Module) -> frozenset[int]:
    """The layers k > 0 of the coarsened module where a segment begins: layer k's block differs from layer k-1's.
    None where the module normalises over the batch (batch norm): a rerun segment would update its running
    statistics a second time, so such a module's recomputing stages rerun whole (guarded around the rerun)."""
    if batch_statistics(module.ops):
        return frozenset()
    block = blocks(module.ops)
    starts = [_layer_block(layer.ops, block) for layer in module.layers]
    return frozenset(k for k in range(1, len(starts)) if starts[k] != starts[k - 1])


def segments(module: Module, stage: Stage, starts: frozenset[int] | None = None) -> list[list[Op]]:
    """The stage's ops in checkpoint segments, in order: one list when the module has no layers or no blocks.
    `starts`: the module's `layer_block_starts`, where the caller has them (they read every op)."""
    if not module.layers:
        return [list(stage.ops)]
    if starts is None:
        starts = layer_block_starts(module)
    if not starts or module.attrs.schedule == "zb-h1":
        # zb-h1 splits a backward into an input and a weight pass: the rerun stays whole, held between them.
        return [list(stage.ops)]
    inside = set(stage.ops)
    found: list[list[Op]] = []
    for k, layer in enumerate(module.layers):
        ops = [op for op in layer.ops if op in inside]
        if not ops:
            continue
        if not found or k in starts:
            found.append([])
        found[-1].extend(ops)
    return found or [[]]


def checkpoint_values(module: Module, stage: Stage, starts: frozenset[int] | None = None) -> list[Op]:
    """Values made in one segment of the stage and read in a later one: what its forward keeps for the rerun,
    besides the model inputs it reads (`peak_memory.loaded_bytes`) and what it receives (held as transfers)."""
    parts = segments(module, stage, starts)
    if len(parts) < 2:
        return []
    segment_of = {op: k for k, ops in enumerate(parts) for op in ops}
    found: dict[Op, None] = {}
    for op in stage.ops:
        for v in op.operands:
            made = segment_of.get(v)
            if made is not None and made < segment_of[op] and v.kind not in FLOATING:
                found[v] = None
    return list(found)
