"""Writing a chosen candidate into the IR: its stages and the plan's module attributes."""

from __future__ import annotations

from dapple_ir.ir import Module, Stage, StageAttrs
from dapple_ir.planner.cost_model import Candidate, Problem


def write_stages(module: Module, problem: Problem, cand: Candidate) -> None:
    """Stages of `cand` into `module` (ops of their layers, in module order) and the plan's attributes."""
    position = {op: i for i, op in enumerate(module.ops)}
    module.stages = []
    for k, st in enumerate(cand.stages):
        ops = sorted((op for layer in module.layers[st.lo : st.hi] for op in layer.ops), key=position.__getitem__)
        recompute = True if cand.recomputes(k) else None
        split = True if cand.splits(k) else None
        zero = 1 if cand.shards(k) else None
        placed = StageAttrs(replicas=st.replicas, devices=st.devices, split=split, recompute=recompute, zero=zero)
        module.stages.append(Stage(f"s{k}", ops, placed))
    module.programs = []
    attrs = module.attrs
    attrs.global_batch = problem.global_batch
    attrs.microbatches = cand.microbatches
    attrs.microbatch_size = problem.microbatch_size(cand.microbatches)
    attrs.schedule = cand.schedule
    attrs.cluster = problem.cluster.name or attrs.cluster
