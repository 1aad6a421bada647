"""Model FLOPs utilization (MFU): how much of the devices' peak a plan's iteration turns into model arithmetic.

- model FLOPs of one iteration: the captured ops' `fwd_flops + bwd_flops` (recorded at the module's `batch`)
  scaled to the global batch. Recomputation's second forward is not model arithmetic and is not counted;
- the peak: each device's matmul rate at the plan's precision (`DeviceKind.flops` of the 16-bit dtype under
  bf16/fp16, of f32 under fp32), summed over the devices the plan's ranks run on. The captured FLOPs are those
  of matmul-class ops (torch's FLOP counter counts nothing else), so the matmul rate is the right one;
- the hardware floor: model FLOPs over that summed peak, the iteration time at 100 % MFU. A prediction or
  a measurement below it is a bug in the cost model or the FLOP count;
- MFU: the floor over the iteration time.

`compile --explain`'s report, `dapple simulate` and `dapple run` print these lines. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from dapple_ir.analysis.precision import matmul_dtype, precision_of
from dapple_ir.cluster.spec import ClusterSpec
from dapple_ir.ir import Module
from dapple_ir.units import format_seconds


@dataclass(frozen=True)
class Utilization:
    """A plan's model FLOPs against its devices' peak, and an iteration time when there is one."""

    model_flops: float
    """Model FLOPs of one iteration (forward and backward over the global batch)."""
    devices: int
    """Devices the plan runs on."""
    peak_flops: float
    """Their matmul peak FLOP/s at the plan's precision, summed."""
    precision: str
    """The plan's precision (`fp32`, `bf16`, `fp16`)."""

    @property
    def floor_s(self) -> float:
        """The iteration at 100 % MFU: model FLOPs over the summed peak."""
        return self.model_flops / self.peak_flops if self.peak_flops else 0.0

    def mfu(self, iteration_s: float) -> float:
        """The fraction of the peak an iteration of `iteration_s` seconds achieves."""
        return self.floor_s / iteration_s if iteration_s > 0 else 0.0

    def lines(self, iteration_s: float | None, what: str = "predicted") -> list[str]:
        """The lines the report, `simulate` and `run` print."""
        per_device = self.peak_flops / self.devices if self.devices else 0.0
        lines = [
            f"model FLOPs {self.model_flops:.4g} per iteration; peak {per_device / 1e12:.4g} TFLOP/s per device at "
            f"{self.precision} on {self.devices} device(s): hardware floor {format_seconds(self.floor_s)}"
        ]
        if iteration_s is not None:
            lines.append(f"{what} MFU {100 * self.mfu(iteration_s):.3g} % at {self.precision}")
        return lines


def model_flops(module: Module) -> float:
    """Model FLOPs of one iteration: every op's forward and backward FLOPs, scaled from `batch` to `global_batch`."""
    total = sum((op.attrs.fwd_flops or 0.0) + (op.attrs.bwd_flops or 0.0) for op in module.ops)
    batch, global_batch = module.attrs.batch, module.attrs.global_batch
    if not batch or not global_batch:
        return total
    return total * global_batch / batch


def plan_devices(module: Module) -> list[int]:
    """The device ids the plan's ranks run on (every device of one stage per replica before lowering)."""
    found = {p.attrs.device for p in module.programs if p.attrs.device is not None}
    if not found:
        found = {d for s in module.stages for d in s.attrs.devices or ()}
    return sorted(found)


def utilization(module: Module, cluster: ClusterSpec) -> Utilization:
    """The plan's model FLOPs and its devices' matmul peak at its precision on `cluster`."""
    precision = precision_of(module)
    devices = plan_devices(module) or list(range(cluster.num_devices))
    peak = sum(cluster.device(d).flops(matmul_dtype(precision, "f32")) for d in devices)
    return Utilization(model_flops(module), len(devices), peak, precision)
