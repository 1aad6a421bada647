"""Give every op a forward time, backward time and activation bytes for a microbatch size.

Two sources:

- `analytic` (default): a roofline on the cluster's device from the FLOPs and bytes that capture
  recorded (`fwd_flops`, `bwd_flops`, `mem_bytes`, `op_class`):
  `time = max(flops / peak_flops, bytes / mem_bandwidth) / efficiency(op_class) + op_overhead`
  (`dapple_ir.cluster.roofline`). Ops whose times came from elsewhere (an imported profile) keep them.
- `PATH.json`: times measured by `dapple profile` for each op, at the profile's microbatch.

Activation bytes scale linearly with the samples they describe; times are affine in them: a fixed
part per op call (the device kind's `op_overhead`: launch, and the floor of a kernel too small to
fill the device) and a part that scales (`dapple_ir.cluster.roofline.rescaled_s`). The analytic
roofline prices the target size directly; times from elsewhere (a profile, a JSON measured at
another microbatch) are moved to it keeping their fixed part, where the pass knows the cluster
(else linearly). The pass records the size it annotated for as `cost_batch`. Torch is not needed here.

`precision=bf16|fp16` prices the plan as torch.autocast trains it (`dapple_ir.analysis.precision`): matmul-class
ops at the device's 16-bit peak, the rest at their captured dtype's rate, and the values autocast makes 16-bit
(their activation bytes, what crosses a cut) at 2 bytes an element. It records the choice as the module's
`precision`; the narrowing of bytes happens once, so a 16-bit module is not re-priced at another precision.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dapple_ir.analysis.memory import optimizer_state_factor
from dapple_ir.analysis.precision import (
    check_precision,
    half_fraction,
    is_half,
    precision_of,
    sixteen_bit_values,
)
from dapple_ir.cluster.roofline import rescaled_s
from dapple_ir.cluster.spec import ClusterSpec, DeviceKind
from dapple_ir.errors import ClusterError, DappleError
from dapple_ir.ir import Module, Op, OpKind
from dapple_ir.planner.cost_model import op_roofline
from dapple_ir.pricing.layers import gemm_law
from dapple_ir.registry import Pass, PassContext, option, register_pass

_FREE = (OpKind.INPUT, OpKind.OUTPUT)


@register_pass
@dataclass(frozen=True)
class AnnotateCost(Pass):
    """Annotate forward/backward time and activation bytes per op (roofline or measured profile)."""

    name = "annotate-cost"

    source: str = option(
        "analytic", "analytic (roofline on the cluster's device) or PATH.json written by `dapple profile`"
    )
    microbatch: int = option(0, "samples the costs describe (0: the module's cost batch, else its batch)")
    efficiency: str = option("", "fraction of peak: one number for every op class, or 'matmul:0.5;conv:0.4'")
    device: int = option(0, "device id whose kind the analytic roofline uses")
    optimizer: str = option("", "optimizer the memory model assumes (sgd, adam, ...)")
    precision: str = option("", "fp32, bf16 or fp16: the autocast dtype the plan trains in (empty: the module's)")

    def apply(self, ctx: PassContext, module: Module) -> None:
        if self.optimizer:
            optimizer_state_factor(self.optimizer)  # rejects unknown names with the list of known ones
            module.attrs.optimizer = self.optimizer
        if self.microbatch < 0:
            raise DappleError(f"annotate-cost: microbatch must be positive, not {self.microbatch}")
        self.adopt_precision(module)
        if self.source == "analytic":
            self.analytic(ctx, module)
        else:
            self.measured(ctx, module)

    # ------------------------------------------------------------------------------ analytic

    def analytic(self, ctx: PassContext, module: Module) -> None:
        old = module.attrs.cost_batch or module.attrs.batch
        target = self.microbatch or old
        if target is None:
            raise DappleError("annotate-cost: the module has no batch attribute; give microbatch=N")
        counted = [op for op in module.ops if op.attrs.fwd_flops is not None or op.attrs.mem_bytes is not None]
        chosen = set(counted)
        known = self.known_kind(ctx, module)
        for op in module.ops:
            if op not in chosen:
                _rescale(op, old, target, known)  # costs from elsewhere (an imported profile) keep their times
        module.attrs.cost_batch = target
        if not counted:
            ctx.log(f"annotate-cost: no FLOP counts to turn into times; costs rescaled to {target} sample(s)")
            return
        spec = self.cluster(ctx, module)
        kind = spec.device(self.device)
        overrides = self.efficiency_overrides()
        precision = precision_of(module)
        half = sixteen_bit_values(module, precision)
        for op in counted:
            given = overrides.get(op.attrs.op_class or "matmul")
            eff = given or spec.efficiency_of(op.attrs.op_class)
            law = None if given else gemm_law(spec, op.attrs.op_class)
            # Weights are read once whatever the batch; only the activations' share scales.
            priced = op_roofline(module, op, eff, module.attrs.batch or target, half, law)
            op.attrs.fwd_s, op.attrs.bwd_s = priced.times(target, kind)
            if op.attrs.act_bytes is not None and old:
                op.attrs.act_bytes = op.attrs.act_bytes * target / old
        ctx.log(f"annotate-cost: roofline on {kind.name} at {precision} for {len(counted)} op(s) at {target} sample(s)")

    def adopt_precision(self, module: Module) -> None:
        """Record the precision asked for, narrowing the bytes of the values autocast makes 16-bit (once)."""
        current = precision_of(module)
        wanted = check_precision(self.precision or current)
        if wanted == current:
            return
        if is_half(current):
            raise DappleError(
                f"annotate-cost: module @{module.name} is already priced at {current} (its 16-bit values' bytes "
                f"were narrowed); capture the model again to price it at {wanted}"
            )
        for op in sixteen_bit_values(module, wanted):
            fraction = half_fraction(op)
            op.attrs.out_bytes = op.out_bytes * fraction
            if op.attrs.act_bytes is not None:
                op.attrs.act_bytes *= fraction
        module.attrs.precision = wanted

    def cluster(self, ctx: PassContext, module: Module) -> ClusterSpec:
        name = module.attrs.cluster or ctx.cluster
        if not name:
            raise ClusterError(
                "annotate-cost{source=analytic} needs a cluster to know the device's peak FLOP/s and bandwidth: "
                "give --cluster (e.g. --cluster 1x8xV100-16GB or a TOML file), or measure with `dapple profile` "
                "and use annotate-cost{source=profile.json}"
            )
        return ctx.cluster_spec(name)

    def known_kind(self, ctx: PassContext, module: Module) -> DeviceKind | None:
        """The device kind whose per-call cost stays fixed when times move to another batch, where
        the module or the context names a cluster; None rescales linearly."""
        if not (module.attrs.cluster or ctx.cluster):
            return None
        return self.cluster(ctx, module).device(self.device)

    def efficiency_overrides(self) -> dict[str, float]:
        text = self.efficiency.strip()
        if not text:
            return {}
        result: dict[str, float] = {}
        try:
            if ":" not in text:
                return {c: _fraction(float(text)) for c in ("matmul", "conv", "attention", "elementwise")}
            for item in text.split(";"):
                op_class, _, value = item.partition(":")
                result[op_class.strip()] = _fraction(float(value))
        except ValueError:
            raise DappleError(
                f"annotate-cost: efficiency '{self.efficiency}' must be a fraction in (0, 1] or 'class:fraction;...' "
                "such as 'matmul:0.5;conv:0.4'"
            ) from None
        return result

    # ------------------------------------------------------------------------------ measured

    def measured(self, ctx: PassContext, module: Module) -> None:
        path = Path(self.source)
        if not path.is_file():
            raise DappleError(
                f"annotate-cost: source '{self.source}' is neither 'analytic' nor an existing profile JSON file "
                "(write one with `dapple profile MODEL_SPEC -o profile.json`)"
            )
        try:
            data = json.loads(path.read_text())
            measured_batch = int(data["microbatch"])
            entries: dict[str, dict[str, float]] = data["ops"]
        except (ValueError, KeyError, TypeError) as exc:
            raise DappleError(f"annotate-cost: {path} is not a profile written by `dapple profile` ({exc})") from None
        target = self.microbatch or measured_batch
        scale = target / measured_batch
        kind = self.known_kind(ctx, module)
        for op in module.ops:
            entry = entries.get(op.name)
            if entry is None:
                if op.kind in _FREE:
                    continue
                raise DappleError(
                    f"annotate-cost: {path} has no measurement for op %{op.name}; profile this model again "
                    f"(it was profiled from {data.get('model', 'another model')})"
                )
            op.attrs.fwd_s = _moved(float(entry["fwd_s"]), measured_batch, target, kind)
            op.attrs.bwd_s = _moved(float(entry["bwd_s"]), measured_batch, target, kind)
            if entry.get("act_bytes") is not None:
                op.attrs.act_bytes = float(entry["act_bytes"]) * scale
        module.attrs.cost_batch = target
        ctx.log(f"annotate-cost: measured times from {path} ({data.get('device', '?')}) at {target} sample(s)")


def _rescale(op: Op, old: int | None, new: int, kind: DeviceKind | None) -> None:
    if not old or old == new:
        return
    if op.attrs.fwd_s is not None:
        op.attrs.fwd_s = _moved(op.attrs.fwd_s, old, new, kind)
    if op.attrs.bwd_s is not None:
        op.attrs.bwd_s = _moved(op.attrs.bwd_s, old, new, kind)
    if op.attrs.act_bytes is not None:
        op.attrs.act_bytes = op.attrs.act_bytes * new / old


def _moved(seconds: float, old: int, new: int, kind: DeviceKind | None) -> float:
    """An op call's time at `new` samples from `old`: its fixed part kept where the device is known."""
    return seconds * new / old if kind is None else rescaled_s(seconds, old, new, kind)


def _fraction(value: float) -> float:
    if not 0 < value <= 1:
        raise ValueError(value)
    return value
