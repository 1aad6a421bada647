"""Each op's time at any number of rows, from the costs capture (or a profile) recorded: what the simulator prices a
plan's instructions from, as `layers.Problem.times_at` prices a layer range for the planners.

An op whose recorded time is the roofline's on the cluster's device (`layers.roofline_ops`) is priced again by the
roofline at the rows asked for; any other keeps each call's fixed part and scales the rest from the module's
`cost_batch` (`roofline.rescaled_s`). The IR's costs stay as recorded: asking for another microbatch size, or a split
replica's rows, reads them and writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dapple_ir.cluster.roofline import OpRoofline, fixed_s, rescaled_s
from dapple_ir.cluster.spec import ClusterSpec, DeviceKind
from dapple_ir.ir import Module, Op
from dapple_ir.pricing.layers import roofline_ops
from dapple_ir.pricing.tensor import shard_roofline


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

    def times(self, op: Op, rows: float, kind: DeviceKind, tp: int = 1) -> tuple[float, float]:
        """(forward, backward) seconds of `op` on `rows` samples on a device of `kind`; with `tp` > 1 on one member of
        a tensor group of `tp` (an op the group splits: 1/tp of its FLOPs and bytes, each call's fixed part whole)."""
        split = tp > 1 and op.tensor_split
        model = self.roofline.get(op)
        if model is not None:
            return (shard_roofline(model, tp) if split else model).times(rows, kind)
        a = op.attrs
        f = rescaled_s(a.fwd_s or 0.0, self.cost_batch, rows, kind)
        b = rescaled_s(a.bwd_s or 0.0, self.cost_batch, rows, kind)
        if split:
            xf, xb = fixed_s(f, kind), fixed_s(b, kind)
            f, b = xf + (f - xf) / tp, xb + (b - xb) / tp
        return f, b

    def stage_times(self, ops: list[Op], rows: float, kind: DeviceKind, tp: int = 1) -> tuple[float, float]:
        """(forward, backward) seconds of `ops` together on `rows` samples (0: a module without a microbatch size,
        whose costs are taken as recorded), on one member of a tensor group of `tp`."""
        rows = rows or self.cost_batch
        fwd = bwd = 0.0
        for op in ops:
            f, b = self.times(op, rows, kind, tp)
            fwd += f
            bwd += b
        return fwd, bwd
