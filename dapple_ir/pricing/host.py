"""The host's own work and the optimizer step: what a device kind charges beyond its kernels and links.

Every compute instruction (a forward, a backward, an input or weight pass) costs the device kind's
`instruction_overhead` on the host, and every send or receive its `message_overhead` (`dapple
calibrate` measures both on CPU; 0 on the GPU presets). The optimizer step streams parameters,
gradients and optimizer state through device memory once: (3 + 2 x state factor) x parameter bytes
over the memory bandwidth (SGD reads p and g and writes p; Adam also reads and writes its two moments).
The cost model prices these per stage and the simulator per instruction, from these two functions.
"""

from __future__ import annotations

import math

from dapple_ir.cluster.spec import DeviceKind


def host_work_s(kind: DeviceKind, instructions: int, messages: int) -> float:
    """The host's seconds for `instructions` compute instructions and `messages` sends and receives."""
    return kind.instruction_overhead * instructions + kind.message_overhead * messages


def optimizer_step_s(kind: DeviceKind, param_bytes: float, state_factor: float) -> float:
    """One optimizer step over `param_bytes` of parameters with `state_factor` bytes of state per parameter byte;
    0 on a device of unbounded memory bandwidth (the simulator's ideal cluster)."""
    if param_bytes <= 0 or math.isinf(kind.mem_bandwidth):
        return 0.0
    return (3.0 + 2.0 * state_factor) * param_bytes / kind.mem_bandwidth
