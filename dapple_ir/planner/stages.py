"""Writing a chosen candidate into the IR: its stages and the plan's module attributes."""

from __future__ import annotations

from dapple_ir.ir import Module, Stage, StageAttrs
from dapple_ir.planner.cost_model import Candidate, Problem
from dapple_ir.pricing.tensor import expand_devices


def write_stages(module: Module, problem: Problem, cand: Candidate) -> None:
    """Stages of `cand` into `module` (ops of their layers, in module order) and the plan's attributes. With tensor
    parallelism (`Problem.tp`), each of the candidate's devices is a tensor group of the grouped cluster: the stage
    gets `tp` and each group's real devices."""
    position = {op: i for i, op in enumerate(module.ops)}
    module.stages = []
    for k, st in enumerate(cand.stages):
        lo, hi = (problem.layer_map[st.lo], problem.layer_map[st.hi]) if problem.layer_map else (st.lo, st.hi)
        ops = sorted((op for layer in module.layers[lo:hi] for op in layer.ops), key=position.__getitem__)
        recompute = True if cand.recomputes(k) else None
        split = True if cand.splits(k) else None
        zero = 1 if cand.shards(k) else None
        t = problem.tp
        devices = expand_devices(problem.base_cluster, t, st.devices) if problem.base_cluster else st.devices
        placed = StageAttrs(
            replicas=st.replicas,
            devices=devices,
            split=split,
            recompute=recompute,
            tp=t if t > 1 else None,
            zero=zero,
        )
        module.stages.append(Stage(f"s{k}", ops, placed))
    module.programs = []
    attrs = module.attrs
    attrs.global_batch = problem.global_batch
    attrs.microbatches = cand.microbatches
    attrs.microbatch_size = problem.microbatch_size(cand.microbatches)
    attrs.schedule = cand.schedule
    attrs.cluster = (problem.base_cluster or problem.cluster).name or attrs.cluster
