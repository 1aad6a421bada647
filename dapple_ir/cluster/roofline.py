"""The roofline: seconds an op takes on a device kind, from the FLOPs it does and the bytes it moves.

`time = max(flops / peak_flops, bytes / mem_bandwidth) / efficiency + op_overhead`, forward and
backward. The backward moves about twice the forward's bytes: it reads the saved inputs and the
output gradient, and writes the input gradient. `annotate-cost` prices ops with it and
`dapple calibrate --fit` divides measured times by it.
"""

from __future__ import annotations

from dapple_ir.cluster.spec import DeviceKind

#: Backward bytes moved, relative to the forward's (see the module docstring).
BACKWARD_BYTES_FACTOR = 2.0


def roofline_times(
    flops: tuple[float, float], moved_bytes: float, kind: DeviceKind, dtype: str = "f32", efficiency: float = 1.0
) -> tuple[float, float]:
    """Forward and backward seconds of an op doing `flops` (forward, backward) and moving `moved_bytes`."""
    peak, bandwidth = kind.flops(dtype), kind.mem_bandwidth
    fwd = max(flops[0] / peak, moved_bytes / bandwidth) / efficiency
    bwd = max(flops[1] / peak, BACKWARD_BYTES_FACTOR * moved_bytes / bandwidth) / efficiency
    # Ops that only touch metadata (views) run no kernel and pay no per-call overhead.
    if fwd > 0:
        fwd += kind.op_overhead
    if bwd > 0:
        bwd += kind.op_overhead
    return fwd, bwd
