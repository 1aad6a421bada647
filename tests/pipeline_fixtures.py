"""Hand-built pipelines for the schedule and lowering tests: a chain MLP cut into stages."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from dapple_ir import schedules
from dapple_ir.ir import (
    InstrKind,
    Module,
    ModuleAttrs,
    Op,
    OpAttrs,
    OpKind,
    Param,
    ParamAttrs,
    Stage,
    StageAttrs,
    TensorType,
)

WIDTH, BATCH = 16, 8
ACT = 512.0  # activation bytes per op at the module's batch


def chain_module(
    layers_per_stage: list[int],
    replicas: list[int] | None = None,
    skip: bool = False,
    tied: bool = False,
    act: list[float] | None = None,
    devices: bool = False,
) -> Module:
    """An MLP of sum(layers_per_stage) linear ops then a loss, cut into stages of the given sizes.

    `skip` adds a residual from the first layer's output into the last layer (it crosses every cut);
    `tied` makes the first and last layer read the same weight; `act` gives each stage's op act bytes.
    """
    replicas = replicas or [1] * len(layers_per_stage)
    t = TensorType("f32", (BATCH, WIDTH))
    module = Module("chain", attrs=ModuleAttrs(batch=BATCH))
    x = Op("x", OpKind.INPUT, [], t, attrs=OpAttrs(index=0))
    y = Op("y", OpKind.INPUT, [], t, attrs=OpAttrs(index=1))
    module.ops += [x, y]
    n = sum(layers_per_stage)
    stages_ops: list[list[Op]] = [[x, y]] + [[] for _ in layers_per_stage[1:]]
    prev, first = x, None
    layer = 0
    for s, count in enumerate(layers_per_stage):
        for _ in range(count):
            name = "w0" if tied and layer == n - 1 else f"w{layer}"
            if not any(p.name == name for p in module.params):
                module.params.append(Param(name, TensorType("f32", (WIDTH, WIDTH)), ParamAttrs(shared=tied or None)))
            operands = [prev, first] if skip and layer == n - 1 and first is not None and n > 1 else [prev]
            size = act[s] if act else ACT
            op = Op(f"h{layer}", OpKind.CALL_MODULE, operands, t, f"l{layer}", OpAttrs(act_bytes=size, params=(name,)))
            module.ops.append(op)
            stages_ops[s].append(op)
            first = first or op
            prev = op
            layer += 1
    loss = Op("loss", OpKind.CALL_FUNCTION, [prev, y], TensorType("f32", ()), "mse", OpAttrs(act_bytes=ACT))
    out = Op("out", OpKind.OUTPUT, [loss], TensorType("f32", ()))
    module.ops += [loss, out]
    stages_ops[-1] += [loss, out]
    next_device = 0
    for s, ops in enumerate(stages_ops):
        attrs = StageAttrs(replicas=replicas[s])
        if devices:
            attrs.devices = tuple(range(next_device, next_device + replicas[s]))
            next_device += replicas[s]
        module.stages.append(Stage(f"s{s}", ops, attrs))
    return module


@contextlib.contextmanager
def reverse_gpipe_registered(name: str) -> Iterator[None]:
    """A user schedule for the duration of a test: GPipe with the backwards in reverse microbatch order."""

    @schedules.register_schedule(name)
    def reverse_gpipe(request: schedules.ScheduleRequest) -> dict[int, list[schedules.Work]]:
        mbs = range(request.microbatches)
        return {
            s: [schedules.Work(InstrKind.FORWARD, s, m) for m in mbs]
            + [schedules.Work(InstrKind.BACKWARD, s, m) for m in reversed(mbs)]
            for s in range(request.stages)
        }

    try:
        yield
    finally:
        del schedules.SCHEDULES[name]


def write_chain_profile(path: Path, layers: Sequence[tuple[float, float, float]]) -> Path:
    """A profile in PipeDream's published format of a chain of layers, each given as (forward ms,
    activation bytes, parameter bytes); the backward takes twice the forward. A `-pbs-N` in the file
    name gives the profile's batch."""
    lines = [
        f"node{k} -- L{k} -- forward_compute_time={f}, backward_compute_time={2 * f}, activation_size={a}, "
        f"parameter_size={p}"
        for k, (f, a, p) in enumerate(layers)
    ]
    lines += [f"\tnode{k} -- node{k + 1}" for k in range(len(layers) - 1)]
    path.write_text("\n".join(lines) + "\n")
    return path
