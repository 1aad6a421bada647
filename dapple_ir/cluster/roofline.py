"""The roofline: seconds an op takes on a device kind, from the FLOPs it does and the bytes it moves.

`time = max(flops / peak_flops, bytes / mem_bandwidth) / efficiency + op_overhead`, forward and
backward, and at least the host's time to issue the call where the host runs ahead of the device
(`DeviceKind.host_forward`, `host_backward`: a GPU's). The backward moves about twice the forward's
bytes: it reads the saved inputs and the output gradient, and writes the input gradient. `annotate-cost`
prices ops with it and `dapple calibrate --fit` divides measured times by it.

An op the roofline prices (`OpRoofline`) is priced again at each batch: one memory-bound at a
small batch (its weights read whatever the batch) may be compute-bound at a larger one, and no
straight line through one of its times finds the other. A time from elsewhere (a profile) is
taken to be affine in its batch: `op_overhead` (the kernel launch and the floor a kernel too
small to fill the device cannot go below) does not shrink with the batch, the rest scales with it.
So an op's efficiency, its variable part over its whole time, falls with the batch, to one half at
the batch whose variable part equals `op_overhead`. `rescaled_s` moves a time measured or priced
at one batch to another by that rule: the planner, `plan` (which writes each op's time at the
chosen microbatch, so that the simulator sees the fixed part too) and `annotate-cost` all use it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dapple_ir.cluster.spec import DeviceKind

#: Backward bytes moved, relative to the forward's (see the module docstring).
BACKWARD_BYTES_FACTOR = 2.0


def roofline_times(
    flops: tuple[float, float],
    moved_bytes: float,
    kind: DeviceKind,
    dtype: str = "f32",
    efficiency: float = 1.0,
    half_flops: float = 0.0,
) -> tuple[float, float]:
    """Forward and backward seconds of an op doing `flops` (forward, backward) and moving `moved_bytes`. With
    `half_flops` > 0 (a GEMM on tensor cores, `pricing.matmul_efficiency`), its compute runs at `efficiency` x F /
    (F + half_flops) of the peak, F the forward's FLOPs (the backward's two GEMMs are each as big): a small GEMM
    cannot fill the device. Its memory term keeps `efficiency`."""
    peak, bandwidth = kind.flops(dtype), kind.mem_bandwidth
    size = flops[0] / (flops[0] + half_flops) if half_flops > 0 and flops[0] > 0 else 1.0
    fwd = max(flops[0] / (peak * size), moved_bytes / bandwidth) / efficiency
    bwd = max(flops[1] / (peak * size), BACKWARD_BYTES_FACTOR * moved_bytes / bandwidth) / efficiency
    # Ops that only touch metadata (views) run no kernel and pay no per-call overhead. A host that runs ahead of
    # its device (a GPU's) issues the call while earlier kernels run: the call takes the longer of the two.
    if fwd > 0:
        fwd = max(fwd + kind.op_overhead, kind.host_forward)
    if bwd > 0:
        bwd = max(bwd + kind.op_overhead, kind.host_backward)
    return fwd, bwd


@dataclass(frozen=True)
class OpRoofline:
    """What the roofline prices an op from, per sample where it grows with the batch: its forward and backward
    FLOPs, the bytes it moves (`act_bytes`) besides those it moves whatever the batch (`weight_bytes`, its
    parameters), its element type and its efficiency."""

    fwd_flops: float
    bwd_flops: float
    act_bytes: float
    weight_bytes: float
    dtype: str = "f32"
    efficiency: float = 1.0
    half_flops: float = 0.0
    """A GEMM's FLOPs at which its efficiency is half of `efficiency` (0: the efficiency is constant)."""

    @classmethod
    def at_batch(
        cls,
        batch: float,
        flops: tuple[float, float],
        mem_bytes: float,
        weight_bytes: float,
        dtype: str = "f32",
        efficiency: float = 1.0,
    ) -> OpRoofline:
        """From an op's (forward, backward) FLOPs and moved bytes at `batch` samples, of which `weight_bytes`
        (at most all) do not grow with the batch."""
        weights = min(weight_bytes, mem_bytes)
        return cls(flops[0] / batch, flops[1] / batch, (mem_bytes - weights) / batch, weights, dtype, efficiency)

    def times(self, batch: float, kind: DeviceKind) -> tuple[float, float]:
        """Forward and backward seconds at `batch` samples on `kind` (`roofline_times`)."""
        flops = (self.fwd_flops * batch, self.bwd_flops * batch)
        moved = self.weight_bytes + self.act_bytes * batch
        return roofline_times(flops, moved, kind, self.dtype, self.efficiency, self.half_flops)


def fixed_s(seconds: float, kind: DeviceKind) -> float:
    """The part of an op call's `seconds` that does not shrink with the batch: the kind's per-call
    cost, at most the whole (a call that costs nothing, a view, has none)."""
    return min(seconds, kind.op_overhead)


def rescaled_s(seconds: float, old_batch: float, new_batch: float, kind: DeviceKind) -> float:
    """An op call's time at `new_batch` samples from its time at `old_batch`: the fixed part
    (`fixed_s`) stays, the rest scales with the batch."""
    fixed = fixed_s(seconds, kind)
    return fixed + (seconds - fixed) * new_batch / old_batch


def line_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (batch, seconds) points at two or more
    batches: how `dapple calibrate` reads a fixed part per call off times measured at several sizes."""
    xs = {x for x, _y in points}
    if len(xs) < 2:
        raise ValueError(f"a line needs points at two or more batches, not {sorted(xs)}")
    mean_x = sum(x for x, _y in points) / len(points)
    mean_y = sum(y for _x, y in points) / len(points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _y in points)
    return mean_y - slope * mean_x, slope
