"""A recomputing stage's forward in checkpoint segments: `torch.utils.checkpoint` around each block.

The IR cuts a recomputing stage into segments where the model's blocks begin
(`dapple_ir.analysis.activation_checkpoints`, which the memory model prices). Here the stage's graph runs segment by
segment, each under `torch.utils.checkpoint.checkpoint` (non-reentrant): autograd keeps only each segment's inputs,
and the backward reruns one segment at a time, last first, right before that segment's backward, as Megatron-LM's
full uniform recomputation does. Graph nodes the IR does not name (a tensor group's sums, copied parameter reads)
join the segment of their latest input, or of their first user where they read none.

Random draws are named live: each segment runs node by node (`torch.fx.Interpreter.run_node`), and a draw gets the
site (node, k-th draw of that node) from the node running it (`random_draws.SeededDraws`), in the forward and in
the backward's rerun alike. So the rerun draws the same masks, and the sites the first forward records are the
stage's, in the order the unsegmented stage draws them (`StageDraws.sites`, which `--check` hands the reference).
Autocast is what torch's checkpoint restores for the rerun. Batch statistics are never rerun this way: a module
with batch norm reruns whole stages (`activation_checkpoints.layer_block_starts`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.utils.checkpoint import checkpoint

from dapple_ir.backends.torch.random_draws import Rows, SeededDraws, Site
from dapple_ir.errors import DappleError


class CheckpointedStage:
    """A stage graph cut into checkpoint segments (IR op names per segment, in order)."""

    def __init__(self, graph_module: torch.fx.GraphModule, segments: list[set[str]], what: str) -> None:
        self.graph_module = graph_module
        self.what = what
        nodes = list(graph_module.graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.output = next(n for n in nodes if n.op == "output")
        part = _assign(nodes, segments)
        self.parts: list[list[torch.fx.Node]] = [[n for n in nodes if part.get(n) == k] for k in range(len(segments))]
        self.inputs: list[list[torch.fx.Node]] = []
        self.outputs: list[list[torch.fx.Node]] = []
        for k, members in enumerate(self.parts):
            inside = set(members)
            reads = {a for n in members for a in n.all_input_nodes if a not in inside}
            late = [a for a in reads if a.op != "placeholder" and part[a] > k]
            if late:
                raise DappleError(
                    f"{what}: checkpoint segment {k} reads %{late[0].name}, which a later segment makes; the stage's "
                    "segments do not follow its graph order"
                )
            self.inputs.append(sorted(reads, key=order.__getitem__))
            self.outputs.append([n for n in members if any(u not in inside for u in n.users)])
        self.sites: list[Site] | None = None
        """The draws of the first forward, in order (None before it)."""

    def run(
        self,
        args: list[Any],
        draw: tuple[int, int, int, Rows | None],
        saved: dict[int, int],
        on_rerun: Callable[[dict[int, int]], None] | None = None,
    ) -> Any:
        """The stage's results on `args`, drawing as (seed, step, microbatch, rows) `draw` says; the storages of
        what the segments keep (their inputs, parameters aside) are added to `saved` (address -> bytes).
        `on_rerun` (a memory meter) is handed what each rerun segment saved for its backward, once it has run."""
        env: dict[torch.fx.Node, Any] = dict(zip(self.placeholders, args, strict=True))
        record: list[Site] | None = [] if self.sites is None else None
        for k, members in enumerate(self.parts):
            ins = [env[n] for n in self.inputs[k]]
            for t in ins:
                if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
                    storage = t.untyped_storage()
                    saved[storage.data_ptr()] = storage.nbytes()
            fn = self._segment(k, members, draw, record, on_rerun)
            outs = checkpoint(fn, *ins, use_reentrant=False, preserve_rng_state=False)
            env.update(zip(self.outputs[k], outs, strict=True))
        if record is not None:
            self.sites = record
        return torch.fx.node.map_arg(self.output.args[0], env.__getitem__)

    def _segment(
        self,
        k: int,
        members: list[torch.fx.Node],
        draw: tuple[int, int, int, Rows | None],
        record: list[Site] | None,
        on_rerun: Callable[[dict[int, int]], None] | None,
    ) -> Callable[..., tuple[Any, ...]]:
        """Segment k as a function of its inputs; it records its draws in `record` on its first call only (the
        forward), and meters what it saves (`on_rerun`) on the next (the backward's rerun)."""
        first = [True]
        inputs, outputs = self.inputs[k], self.outputs[k]

        def run(*ins: Any) -> tuple[Any, ...]:
            rerun = not first[0]
            runner = _NodeRunner(self.graph_module, None if rerun else record)
            first[0] = False
            runner.env = dict(zip(inputs, ins, strict=True))
            seed, step, mb, rows = draw
            meter = _RerunMeter() if rerun and on_rerun is not None else None
            try:
                with SeededDraws(seed, step, mb, runner.next_site, rows), meter or contextlib.nullcontext():
                    for node in members:
                        runner.current = node.name
                        runner.env[node] = runner.run_node(node)
            finally:
                # torch stops a rerun by an exception once it has what the backward needs.
                if meter is not None and on_rerun is not None:
                    on_rerun(meter.saved)
            return tuple(runner.env[n] for n in outputs)

        return run


class _RerunMeter:
    """Counts the storages autograd saves while a segment reruns, passing each save on to the hooks of
    `torch.utils.checkpoint`'s rerun, which are in force (a pair of hooks of our own on top would hide the saves
    from them). Where torch has no such hooks in force, it counts nothing."""

    def __init__(self) -> None:
        self.saved: dict[int, int] = {}
        self._hooks = contextlib.ExitStack()

    def __enter__(self) -> None:
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if outer is None:
            return
        pack_outer, unpack_outer = outer

        def pack(t: torch.Tensor) -> Any:
            storage = t.untyped_storage()
            self.saved[storage.data_ptr()] = storage.nbytes()
            return pack_outer(t)

        self._hooks.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack_outer))

    def __exit__(self, *exc: object) -> None:
        self._hooks.close()


class _NodeRunner(torch.fx.Interpreter):
    """Runs chosen nodes of a graph; names each draw by the node running it."""

    def __init__(self, graph_module: torch.fx.GraphModule, record: list[Site] | None) -> None:
        super().__init__(graph_module, garbage_collect_values=False)
        self.record = record
        self.current = ""
        self.count: dict[str, int] = {}

    def next_site(self) -> Site:
        index = self.count.get(self.current, 0)
        self.count[self.current] = index + 1
        site = (self.current, index)
        if self.record is not None:
            self.record.append(site)
        return site


def _assign(nodes: list[torch.fx.Node], segments: list[set[str]]) -> dict[torch.fx.Node, int]:
    """The segment of every node but the placeholders and the output: the IR's, else that of its latest input,
    else of its first user (parameter reads), else the first."""
    named = {name: k for k, names in enumerate(segments) for name in names}
    part: dict[torch.fx.Node, int] = {}
    pending = []
    for n in nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n.name in named:
            part[n] = named[n.name]
            continue
        made = [part[a] for a in n.all_input_nodes if a in part]
        if made:
            part[n] = max(made)
        else:
            pending.append(n)
    for n in reversed(pending):
        users = [part[u] for u in n.users if u in part]
        part[n] = min(users) if users else 0
    return part
