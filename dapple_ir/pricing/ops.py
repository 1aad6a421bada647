"""Each op's time at any number of rows, from the costs capture (or a profile) recorded: what the simulator prices a
plan's instructions from, as `layers.Problem.times_at` prices a layer range for the planners.

An op whose recorded time is the roofline's on the cluster's device (`layers.roofline_ops`) is priced again by the
roofline at the rows asked for; any other keeps each call's fixed part and scales the rest from the module's
`cost_batch` (`roofline.rescaled_s`). The IR's costs stay as recorded: asking for another microbatch size, or a split
replica's rows, reads them and writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dapple_ir.cluster.roofline import OpRoofline, rescaled_s
from dapple_ir.cluster.spec import ClusterSpec, DeviceKind
from dapple_ir.ir import Module, Op
from dapple_ir.pricing.layers import roofline_ops


@dataclass
class OpPrices:
    """The ops of `module` priced on `cluster`."""

    module: Module
    cluster: ClusterSpec
    cost_batch: float = field(init=False)
    """The samples the recorded costs describe."""
    roofline: dict[Op, OpRoofline] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        a = self.module.attrs
        # Costs with no batch of their own describe one microbatch (`analysis.memory.batch_scale`).
        self.cost_batch = float(a.cost_batch or a.batch or a.microbatch_size or 1)
        self.roofline = roofline_ops(self.module, self.cluster)

    def times(self, op: Op, rows: float, kind: DeviceKind) -> tuple[float, float]:
        """(forward, backward) seconds of `op` on `rows` samples on a device of `kind`."""
        model = self.roofline.get(op)
        if model is not None:
            return model.times(rows, kind)
        a = op.attrs
        return (
            rescaled_s(a.fwd_s or 0.0, self.cost_batch, rows, kind),
            rescaled_s(a.bwd_s or 0.0, self.cost_batch, rows, kind),
        )

    def stage_times(self, ops: list[Op], rows: float, kind: DeviceKind) -> tuple[float, float]:
        """(forward, backward) seconds of `ops` together on `rows` samples (0: a module without a microbatch size,
        whose costs are taken as recorded)."""
        rows = rows or self.cost_batch
        fwd = bwd = 0.0
        for op in ops:
            f, b = self.times(op, rows, kind)
            fwd += f
            bwd += b
        return fwd, bwd
