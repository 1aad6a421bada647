"""The per-layer prices of a coarsened module on a resolved cluster: what every planner and the cost model read.

A `Problem` is built once per plan (`problem_from_module`) from the module's captured costs and the
cluster. It owns the compute time of a layer range at any number of rows (the roofline ops priced
again, every other op's fixed part kept and the rest scaled: `times_at`), the host's own work per
instruction and message (`host_s`), a split backward's extra (`split_s`), the optimizer step
(`optimizer_s`), the static bytes of a layer range with each parameter counted once (`static_of`,
`grads_of`: a tied embedding read by two layers of one stage is one parameter), and the ring
allreduce of a device group (`ring`, `dapple_ir.pricing.collectives`). The IR's costs stay as captured.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Any

from dapple_ir.analysis.activation_checkpoints import layer_block_starts
from dapple_ir.analysis.memory import (
    layer_activation_bytes,
    optimizer_state_factor,
    sharded_state_saving,
    static_bytes,
)
from dapple_ir.analysis.peak_memory import gradient_reads, param_ops
from dapple_ir.analysis.precision import (
    half_fraction,
    is_matmul_class,
    matmul_dtype,
    precision_of,
    sixteen_bit_values,
)
from dapple_ir.analysis.stage_graph import batch_dependent, batch_statistics, batched, values_needing_grad
from dapple_ir.analysis.tensor_shards import backward_reduces, forward_reduces, summed_bytes
from dapple_ir.cluster.roofline import OpRoofline, fixed_s
from dapple_ir.cluster.spec import ClusterSpec
from dapple_ir.cluster.topology import Network
from dapple_ir.errors import PlanError
from dapple_ir.ir import Module, Op, OpKind, TensorType
from dapple_ir.pricing.collectives import RingAllreduce, ring_allreduce
from dapple_ir.pricing.host import host_work_s, optimizer_step_s
from dapple_ir.pricing.matmul_efficiency import calibration_for
from dapple_ir.pricing.tensor import grouped_cluster, shard_roofline


@dataclass
class Problem:
    """Per-layer costs of a coarsened module, for one cluster and global batch."""

    fwd_s: list[float]
    """Forward time per layer at `cost_batch`."""
    bwd_s: list[float]
    """Backward time per layer at `cost_batch`."""
    act_bytes: list[float]
    """Activation bytes kept for backward per layer for a microbatch of `cost_batch` samples: the IR's rule
    (`memory.layer_activation_bytes`, autocast's 16-bit copies included), scaled linearly to other microbatch sizes.
    What that linear view leaves out, the plan it returns being priced by `memory.activation_bytes`: a stage's
    boundary terms (`layer_activation_bytes`), and that autocast's weight copies are per microbatch whatever its size
    (counted at `cost_batch`'s share)."""
    static_bytes: list[float]
    """Parameters + gradients + optimizer state + buffers per layer (batch independent)."""
    grad_bytes: list[float]
    """Gradient bytes per layer: what the stage allreduce moves."""
    cut_bytes: list[float]
    """Bytes crossing the cut after each layer at `batch` (0 after the last)."""
    cluster: ClusterSpec
    global_batch: int
    cost_batch: int
    batch: int
    names: list[str] = field(default_factory=list)
    """Layer names, for reports."""
    fwd_fixed_s: list[float] = field(default_factory=list)
    """The part of each layer's forward time that does not shrink with the microbatch (its op
    calls' fixed cost, `roofline.fixed_s`); empty: none."""
    bwd_fixed_s: list[float] = field(default_factory=list)
    """The same for the backward."""
    roofline: list[tuple[OpRoofline, ...]] = field(default_factory=list)
    """Per layer, its ops whose times are the roofline's (`roofline_ops`): priced again at each microbatch
    size, where the rest of the layer's time (and the fixed parts above: theirs only) moves affinely. Empty:
    no such op anywhere."""
    unsplittable: frozenset[int] = frozenset()
    """Layers whose ops normalise over the batch (batch norm): a stage holding one cannot split its
    microbatches (each replica would normalise its rows alone)."""
    unsliceable: frozenset[int] = frozenset()
    """Cuts (after layer k) that carry a value depending on the data without the batch in dimension 0
    (a flattened [b * s, d]): a stage on either side of one cannot split (`lower-comm` could not slice it)."""
    weight_ops: list[int] = field(default_factory=list)
    """Per layer, its ops that read trainable parameters (`peak_memory.param_ops`): under zb-h1 each costs a
    stage that hands gradients back one more autograd pass (`DeviceKind.split_s`). Empty: none."""
    weight_op_bytes: list[float] = field(default_factory=list)
    """Per layer, the parameter bytes those ops read (the split's per-byte part). Empty: none."""
    weight_pass_bytes: list[float] = field(default_factory=list)
    """Per layer, at `batch`, the gradients a split backward keeps from its input pass to its weight pass (the
    results of those ops, `peak_memory.weight_pass_bytes`). Empty: none."""
    grad_sources: list[int] = field(default_factory=list)
    """Per layer, the first layer whose result it reads needs a gradient (`peak_memory.hands_back`; itself where it
    reads none from before it): a stage of layers [lo, hi) hands a gradient back when one of them reads such a
    result from before lo. Empty: every stage but the first does."""
    tied: list[tuple[float, tuple[int, ...]]] = field(default_factory=list)
    """Trainable parameters several layers read (a tied embedding and LM head): (bytes, the layers
    reading it). Each layer counts it in its `grad_bytes`; where the readers fall in different stages,
    `lower-comm` leaves it out of their stage allreduces and sums it once over every device holding it."""
    state_factor: float = 2.0
    """Optimizer state bytes per parameter byte (`analysis.memory.optimizer_state_factor`; Adam: 2)."""
    tp: int = 1
    """Tensor-parallel degree of every stage (`pricing.tensor`): the costs above are one member's, and `cluster` is
    the grouped view of `base_cluster` (a device per tensor group of `tp`, `tensor.grouped_cluster`)."""
    base_cluster: ClusterSpec | None = None
    """The real cluster where `tp` > 1 (None: `cluster` is it)."""
    layer_map: tuple[int, ...] = ()
    """Where the problem's layers are groups of the module's (tensor parallelism: no cut inside a pattern, whose
    split values cannot cross a stage boundary): the module layer each begins at, and the module's layer count
    last. Empty: layer k is the module's layer k."""
    block_starts: frozenset[int] = frozenset()
    """Layers where a recomputing stage's checkpoint segments begin (a new block of the model,
    `analysis.activation_checkpoints.layer_block_starts`); empty: a recomputing stage reruns whole (a profile)."""
    network: Network = field(init=False, repr=False, compare=False)
    """The cluster's links (built from `cluster`)."""

    def __post_init__(self) -> None:
        self.network = Network(self.cluster)
        self.pf = [0.0, *accumulate(self.fwd_s)]
        self.pb = [0.0, *accumulate(self.bwd_s)]
        self.pff = [0.0, *accumulate(self.fwd_fixed_s or [0.0] * len(self.fwd_s))]
        self.pbf = [0.0, *accumulate(self.bwd_fixed_s or [0.0] * len(self.bwd_s))]
        self._times: dict[int, tuple[list[float], list[float]]] = {}
        # The roofline ops as distinct models (a transformer's blocks repeat theirs) and, per layer, (model, count).
        models: dict[OpRoofline, int] = {}
        self._terms = [
            sorted(Counter(models.setdefault(op, len(models)) for op in ops).items()) for ops in self.roofline
        ]
        self._models = list(models)
        self.pw = [0, *accumulate(self.weight_ops or [0] * len(self.fwd_s))]
        self.pwb = [0.0, *accumulate(self.weight_op_bytes or [0.0] * len(self.fwd_s))]
        self.pwp = [0.0, *accumulate(self.weight_pass_bytes or [0.0] * len(self.fwd_s))]
        self.pa = [0.0, *accumulate(self.act_bytes)]
        self.ps = [0.0, *accumulate(self.static_bytes)]
        self.pg = [0.0, *accumulate(self.grad_bytes)]
        self._starts = sorted(self.block_starts)
        self._pc = [0.0, *accumulate(self.cut_bytes[k - 1] for k in self._starts)]
        self._segment_acts = [self.pa[b] - self.pa[a] for a, b in itertools.pairwise(self._starts)]

    @property
    def layers(self) -> int:
        return len(self.fwd_s)

    def microbatch_size(self, microbatches: int) -> int:
        return self.global_batch // microbatches

    def time_scale(self, microbatches: int) -> float:
        """Factor from costs at `cost_batch` to one microbatch (of the variable part of a time)."""
        return self.microbatch_size(microbatches) / self.cost_batch

    def prefix_times(self, microbatches: int) -> tuple[list[float], list[float]]:
        """Prefix sums of the layers' forward and backward times for one microbatch of M: the fixed
        parts as they are, the rest scaled from `cost_batch` (`roofline.rescaled_s`, per layer)."""
        return self.times_at(self.microbatch_size(microbatches))

    def times_at(self, rows: int) -> tuple[list[float], list[float]]:
        """`prefix_times` for a microbatch of `rows` samples (a split replica's rows, `stage_rows`)."""
        found = self._times.get(rows)
        if found is None:
            k = rows / self.cost_batch
            found = (
                [fixed + (t - fixed) * k for t, fixed in zip(self.pf, self.pff, strict=True)],
                [fixed + (t - fixed) * k for t, fixed in zip(self.pb, self.pbf, strict=True)],
            )
            if self.roofline:
                found = self._repriced(found, rows)
            self._times[rows] = found
        return found

    def _repriced(self, affine: tuple[list[float], list[float]], rows: int) -> tuple[list[float], list[float]]:
        """`affine`'s prefix sums with each roofline op's affine move from `cost_batch` replaced by its roofline
        price at `rows`. Ops alike (a transformer's blocks repeat theirs) are priced once per size: a large plan
        asks for many sizes (a split stage's rows for each replica count)."""
        kind = self.cluster.device(0)
        k = rows / self.cost_batch
        # Per model: what pricing it at `rows` adds to the affine move of its time at `cost_batch` (which the
        # affine sums scaled whole: its fixed part is not in pff/pbf).
        delta = []
        for model in self._models:
            at_cost, at_rows = model.times(self.cost_batch, kind), model.times(rows, kind)
            delta.append((at_rows[0] - at_cost[0] * k, at_rows[1] - at_cost[1] * k))
        fwd, bwd = [0.0], [0.0]
        extra_f = extra_b = 0.0
        for layer, terms in enumerate(self._terms):
            for index, count in terms:
                extra_f += count * delta[index][0]
                extra_b += count * delta[index][1]
            fwd.append(affine[0][layer + 1] + extra_f)
            bwd.append(affine[1][layer + 1] + extra_b)
        return fwd, bwd

    def static_of(self, lo: int, hi: int, shards: int = 1) -> float:
        """Static bytes of layers [lo, hi) with each parameter once: a parameter several of them read (a tied
        embedding and LM head) is summed per layer in `static_bytes`, so its extra copies come off here. With
        `shards` > 1 (ZeRO-1) a replica holds 1/shards of the state of the parameters the stage shards."""
        whole = self.ps[hi] - self.ps[lo] - self._shared_extra(lo, hi) * (2.0 + self.state_factor)
        return whole - sharded_state_saving(self.shardable_of(lo, hi), self.state_factor, shards)

    def shardable_of(self, lo: int, hi: int) -> float:
        """Parameter bytes a stage of layers [lo, hi) shards (ZeRO-1) and reduces itself: all but a tied parameter
        that layers outside the range also read (that one is allreduced and stepped whole)."""
        outside = sum(nbytes for nbytes, layers in self.tied if any(lo <= k < hi for k in layers))
        outside -= sum(nbytes for nbytes, layers in self.tied if all(lo <= k < hi for k in layers))
        return max(0.0, self.grads_of(lo, hi) - outside)

    def grads_of(self, lo: int, hi: int) -> float:
        """Trainable parameter (and gradient) bytes of layers [lo, hi), each parameter once."""
        return self.pg[hi] - self.pg[lo] - self._shared_extra(lo, hi)

    def _shared_extra(self, lo: int, hi: int) -> float:
        if not self.tied:
            return 0.0
        extra = 0.0
        for nbytes, layers in self.tied:
            inside = sum(1 for k in layers if lo <= k < hi)
            if inside > 1:
                extra += (inside - 1) * nbytes
        return extra

    def host_s(self, devices: Sequence[int], instructions: int, messages: int) -> float:
        """The host's own seconds for `instructions` compute instructions and `messages` sends and receives on
        the slowest of `devices` (`pricing.host.host_work_s`)."""
        return max(host_work_s(self.cluster.device(d), instructions, messages) for d in devices)

    def hands_back(self, lo: int, hi: int) -> bool:
        """Does a stage of layers [lo, hi) send a gradient back (`grad_sources`, `peak_memory.hands_back`)? One that
        does not runs its whole backward as its weight pass: it keeps nothing for it and pays no split."""
        if not self.grad_sources:
            return lo > 0
        return min(self.grad_sources[lo:hi], default=lo) < lo

    def split_work(self, lo: int, hi: int) -> tuple[int, float]:
        """(weight ops, their parameter bytes) that splitting the backward of layers [lo, hi) into an input and a
        weight pass (zb-h1) gives a pass of their own: none where the stage hands no gradient back."""
        if not self.hands_back(lo, hi):
            return 0, 0.0
        return self.pw[hi] - self.pw[lo], self.pwb[hi] - self.pwb[lo]

    def split_s(self, lo: int, hi: int, devices: Sequence[int]) -> float:
        """What splitting the backward of layers [lo, hi) adds (`split_work`), at the slowest device's `split_s`."""
        ops, nbytes = self.split_work(lo, hi)
        return max(self.cluster.device(d).split_s(ops, nbytes) for d in devices)

    def weight_pass_of(self, lo: int, hi: int, rows: int) -> float:
        """Bytes a split backward of layers [lo, hi) keeps from its input pass to its weight pass, for a microbatch
        of `rows` samples (none where the stage hands no gradient back)."""
        return (self.pwp[hi] - self.pwp[lo]) * rows / self.batch if self.hands_back(lo, hi) else 0.0

    def optimizer_s(self, lo: int, hi: int, devices: Sequence[int], sharded: bool = False) -> float:
        """The optimizer step over layers [lo, hi)'s parameters on the slowest of `devices`; `sharded` (ZeRO-1):
        each replica steps 1/R of the parameters the stage shards, and the tied ones whole."""
        nbytes = self.grads_of(lo, hi)
        if sharded and len(devices) > 1:
            nbytes -= self.shardable_of(lo, hi) * (1.0 - 1.0 / len(devices))
        return max(optimizer_step_s(self.cluster.device(d), nbytes, self.state_factor) for d in devices)

    def gradient_tail_s(self, lo: int, hi: int, devices: Sequence[int], grads: float, sharded: bool) -> float:
        """A stage's work after its last backward, `grads` being the bytes its own collective reduces: the ring
        allreduce and the optimizer step, or (ZeRO-1) the reduce-scatter, the shard's step and the all-gather."""
        ring = self.ring(devices)
        step = self.optimizer_s(lo, hi, devices, sharded)
        if sharded and len(devices) > 1:
            return ring.reduce_scatter_s(grads) + step + ring.all_gather_s(grads)
        return ring.seconds(grads) + step

    def ring(self, devices: Sequence[int]) -> RingAllreduce:
        """The ring allreduce over `devices` (`pricing.collectives`)."""
        return ring_allreduce(self.network, devices)

    def allreduce_s(self, nbytes: float, devices: Sequence[int]) -> float:
        """A ring allreduce of `nbytes` over `devices`, alone on the network."""
        return self.ring(devices).seconds(nbytes)

    def checkpoint_bytes(self, lo: int, hi: int, rows: int) -> float:
        """What a recomputing stage of layers [lo, hi) keeps per microbatch of `rows` samples besides its received
        input: the bytes crossing each cut where one of its checkpoint segments begins (`block_starts`)."""
        first, last = bisect.bisect_right(self._starts, lo), bisect.bisect_left(self._starts, hi)
        return (self._pc[last] - self._pc[first]) * rows / self.batch if last > first else 0.0

    def rerun_bytes(self, lo: int, hi: int, rows: int) -> float:
        """The activations a recomputing stage of layers [lo, hi) holds at once while its backward reruns its
        forward segment by segment: the largest segment's, for a microbatch of `rows` samples."""
        first, last = bisect.bisect_right(self._starts, lo), bisect.bisect_left(self._starts, hi)
        pa = self.pa
        if last == first:
            largest = pa[hi] - pa[lo]
        else:
            ends = max(pa[self._starts[first]] - pa[lo], pa[hi] - pa[self._starts[last - 1]])
            largest = max(ends, *self._segment_acts[first : last - 1]) if last - first > 1 else ends
        return largest * rows / self.cost_batch

    def capacity(self, device: int) -> float:
        return self.cluster.device(device).memory_bytes

    def can_split(self, lo: int, hi: int) -> bool:
        """Can a stage of layers [lo, hi) split its microbatches over its replicas?"""
        if self.unsliceable and ((lo - 1) in self.unsliceable or (hi - 1) in self.unsliceable):
            return False
        return not any(lo <= k < hi for k in self.unsplittable)


def gemm_law(cluster: ClusterSpec, op_class: str | None) -> tuple[float, float] | None:
    """(ceiling, half_flops) of the GEMM size law (`pricing.matmul_efficiency`) for matmul ops on `cluster`'s device,
    where its kind has published GEMM figures and the cluster sets no matmul efficiency of its own (one `dapple
    calibrate` fitted, or a cluster file's, wins); None: the op class's constant efficiency."""
    if (op_class or "matmul") != "matmul" or "matmul" in cluster.efficiency:
        return None
    cal = calibration_for(cluster.device(0).name)
    return (cal.ceiling, cal.half_flops) if cal is not None else None


def op_roofline(
    module: Module,
    op: Op,
    efficiency: float,
    recorded_at: int,
    half: AbstractSet[Op] = frozenset(),
    law: tuple[float, float] | None = None,
) -> OpRoofline:
    """What the roofline prices `op` from: the FLOPs and bytes capture recorded for `recorded_at` samples (the
    module's `batch`), its parameters as the bytes read whatever the batch, its result's element type (which
    picks the peak: f16 tensor cores are far faster than f32) and `efficiency`. Under the module's 16-bit
    precision (`analysis.precision`) a matmul-class op runs at the 16-bit peak, and an op in `half` (the values
    autocast makes 16-bit: `sixteen_bit_values`) moves its result at 2 bytes an element. With `law` (`gemm_law`), a
    16-bit GEMM's efficiency follows its size instead of `efficiency` (a tensor-parallel shard, 1/T of the FLOPs,
    runs less efficiently)."""
    a = op.attrs
    model = OpRoofline.at_batch(
        recorded_at,
        (a.fwd_flops or 0.0, a.bwd_flops or 0.0),
        a.mem_bytes or 0.0,
        module.param_bytes_of([op]),
        op.type.dtype if isinstance(op.type, TensorType) else "f32",
        efficiency,
    )
    if is_matmul_class(op):
        model = replace(model, dtype=matmul_dtype(precision_of(module), model.dtype))
    if op in half:
        model = replace(model, act_bytes=model.act_bytes * half_fraction(op))
    if law is not None and model.dtype in ("bf16", "f16"):
        model = replace(model, efficiency=law[0], half_flops=law[1])
    return model


def roofline_ops(module: Module, cluster: ClusterSpec) -> dict[Op, OpRoofline]:
    """The ops whose times are the roofline's on `cluster`'s device (its first kind) at the module's `cost_batch`
    (`annotate-cost`'s analytic source with the cluster's efficiencies), each with what prices it at any batch.
    An op measured (a profile) or priced with other efficiencies is not among them: its time moves with the
    batch affinely (`rescaled_s`)."""
    batch = module.attrs.batch
    cost_batch = module.attrs.cost_batch or batch
    if not batch or not cost_batch:
        return {}
    kind = cluster.device(0)
    found: dict[Op, OpRoofline] = {}
    half = sixteen_bit_values(module, precision_of(module))
    for op in module.ops:
        a = op.attrs
        if a.fwd_s is None or a.bwd_s is None or (a.fwd_flops is None and a.mem_bytes is None):
            continue
        model = op_roofline(module, op, cluster.efficiency_of(a.op_class), batch, half, gemm_law(cluster, a.op_class))
        fwd, bwd = model.times(cost_batch, kind)
        if math.isclose(fwd, a.fwd_s, rel_tol=1e-9, abs_tol=1e-15) and math.isclose(
            bwd, a.bwd_s, rel_tol=1e-9, abs_tol=1e-15
        ):
            found[op] = model
    return found


def problem_from_module(module: Module, cluster: ClusterSpec, global_batch: int, tp: int = 1) -> Problem:
    """The planner's view of a coarsened module (`module.layers` must be set); with `tp` > 1, of one member of each
    stage's tensor groups of `tp` devices on the grouped cluster (`pricing.tensor`)."""
    if not module.layers:
        raise PlanError(f"module @{module.name} has no layers; run 'coarsen' before 'plan'")
    if tp > 1:
        return _tensor_problem(module, cluster, global_batch, tp)
    state = optimizer_state_factor(module.attrs.optimizer)
    static = [static_bytes(module, layer.ops) for layer in module.layers]
    grads = [module.param_bytes_of(layer.ops) for layer in module.layers]
    batch = module.attrs.batch or module.attrs.cost_batch or 1
    cost_batch = module.attrs.cost_batch or batch
    kind = cluster.device(0)
    priced = roofline_ops(module, cluster)
    weighted = [param_ops(module, layer.ops) for layer in module.layers]
    return Problem(
        fwd_s=[layer.attrs.fwd_s or 0.0 for layer in module.layers],
        bwd_s=[layer.attrs.bwd_s or 0.0 for layer in module.layers],
        act_bytes=layer_activation_bytes(module, [layer.ops for layer in module.layers], rows=cost_batch),
        static_bytes=static,
        grad_bytes=grads,
        cut_bytes=[layer.attrs.cut_bytes or 0.0 for layer in module.layers],
        cluster=cluster,
        global_batch=global_batch,
        cost_batch=cost_batch,
        batch=batch,
        names=[layer.name for layer in module.layers],
        fwd_fixed_s=[
            sum(fixed_s(op.attrs.fwd_s or 0.0, kind) for op in layer.ops if op not in priced) for layer in module.layers
        ],
        bwd_fixed_s=[
            sum(fixed_s(op.attrs.bwd_s or 0.0, kind) for op in layer.ops if op not in priced) for layer in module.layers
        ],
        roofline=[tuple(priced[op] for op in layer.ops if op in priced) for layer in module.layers] if priced else [],
        weight_ops=[len(ops) for ops in weighted],
        weight_op_bytes=[module.param_bytes_of(ops) for ops in weighted],
        weight_pass_bytes=[sum(op.out_bytes for op in ops) for ops in weighted],
        grad_sources=_grad_sources(module),
        tied=_tied_layers(module),
        state_factor=state,
        unsplittable=frozenset(k for k, layer in enumerate(module.layers) if batch_statistics(layer.ops)),
        unsliceable=_unsliceable_cuts(module),
        block_starts=layer_block_starts(module),
    )


def _tensor_problem(module: Module, cluster: ClusterSpec, global_batch: int, t: int) -> Problem:
    """`problem_from_module` for tensor groups of `t`: each layer's ops priced per member (a split op's FLOPs and
    bytes over `t`, its fixed part whole; `tensor.shard_roofline`), plus the group's sums of row-parallel results
    (forward) and column-parallel inputs' gradients (backward) on the node's fabric, their latency in the fixed part;
    a member's share of the parameters and activations; on the grouped view of `cluster`."""
    whole = problem_from_module(module, cluster, global_batch)
    kind = cluster.device(0)
    priced = roofline_ops(module, cluster)
    ring = ring_allreduce(whole.network, range(t))
    scale = whole.cost_batch / whole.batch
    fwd: list[float] = []
    bwd: list[float] = []
    fwd_fixed: list[float] = []
    bwd_fixed: list[float] = []
    static: list[float] = []
    grads: list[float] = []
    models: list[tuple[OpRoofline, ...]] = []
    for layer in module.layers:
        f = b = ff = bf = 0.0
        shards: list[OpRoofline] = []
        for op in layer.ops:
            split = op.tensor_split
            if op in priced:
                model = shard_roofline(priced[op], t) if split else priced[op]
                shards.append(model)
                of, ob = model.times(whole.cost_batch, kind)
            else:
                of, ob = op.attrs.fwd_s or 0.0, op.attrs.bwd_s or 0.0
                xf, xb = fixed_s(of, kind), fixed_s(ob, kind)
                of, ob = (xf + (of - xf) / t, xb + (ob - xb) / t) if split else (of, ob)
                ff, bf = ff + xf, bf + xb
            f, b = f + of, b + ob
        for values, into_fwd in ((forward_reduces(layer.ops), True), (backward_reduces(layer.ops), False)):
            nbytes = sum(summed_bytes(v, t) for v in values) * scale
            if nbytes <= 0:
                continue
            extra, fixed = ring.seconds(nbytes), ring.fixed_s * len(values)
            f, ff = (f + extra, ff + fixed) if into_fwd else (f, ff)
            b, bf = (b, bf) if into_fwd else (b + extra, bf + fixed)
        for table, value in ((fwd, f), (bwd, b), (fwd_fixed, ff), (bwd_fixed, bf)):
            table.append(value)
        grads.append(module.param_bytes_of(layer.ops, t))
        static.append(static_bytes(module, layer.ops, t))
        models.append(tuple(shards))
    return _merged(
        whole,
        _pattern_groups(module),
        fwd_s=fwd,
        bwd_s=bwd,
        fwd_fixed_s=fwd_fixed,
        bwd_fixed_s=bwd_fixed,
        act_bytes=layer_activation_bytes(module, [layer.ops for layer in module.layers], t, whole.cost_batch),
        static_bytes=static,
        grad_bytes=grads,
        roofline=models if priced else [],
        weight_op_bytes=[module.param_bytes_of(param_ops(module, layer.ops), t) for layer in module.layers],
        cluster=grouped_cluster(cluster, t),
        tp=t,
        base_cluster=cluster,
    )


def _pattern_groups(module: Module) -> list[int]:
    """Bounds [0, ..., L] of the groups of the module's layers that no split value (`OpAttrs.tp_dim`) crosses."""
    layer_of = {op: k for k, layer in enumerate(module.layers) for op in layer.ops}
    inside: set[int] = set()
    for op in module.ops:
        for v in op.operands:
            made, used = layer_of.get(v), layer_of.get(op)
            if v.attrs.tp_dim is not None and made is not None and used is not None and used > made:
                inside.update(range(made + 1, used + 1))
    return [k for k in range(len(module.layers) + 1) if k not in inside]


def _merged(whole: Problem, bounds: list[int], **per_layer: Any) -> Problem:
    """`whole` with the per-layer lists in `per_layer` (and the rest of `whole`'s fields: `tp`, `cluster`, ...) and
    its layers grouped by `bounds` (module layers [bounds[g], bounds[g + 1]) become layer g): sums of times, bytes
    and op lists, the cut after a group's last layer, each tied parameter counted once in a group holding two of its
    readers; `layer_map` records `bounds`."""
    groups = list(itertools.pairwise(bounds))
    group_of = {k: g for g, (lo, hi) in enumerate(groups) for k in range(lo, hi)}
    fields_ = {f: per_layer.get(f, getattr(whole, f)) for f in _SUMMED if per_layer.get(f, getattr(whole, f))}

    def summed(values: Sequence[Any], lo: int, hi: int) -> Any:
        return sum(values[lo:hi], start=()) if isinstance(values[lo], tuple) else sum(values[lo:hi])

    merged: dict[str, Any] = {f: [summed(v, lo, hi) for lo, hi in groups] for f, v in fields_.items()}
    tied = []
    for nbytes, layers in whole.tied:
        readers = Counter(group_of[k] for k in layers)
        for g, count in readers.items():
            merged["grad_bytes"][g] -= (count - 1) * nbytes
            merged["static_bytes"][g] -= (count - 1) * nbytes * (2.0 + whole.state_factor)
        if len(readers) > 1:
            tied.append((nbytes, tuple(sorted(readers))))
    cuts = per_layer.get("cut_bytes", whole.cut_bytes)
    rest: dict[str, Any] = {k: v for k, v in per_layer.items() if k not in merged}
    return replace(
        whole,
        **rest,
        **merged,
        cut_bytes=[cuts[hi - 1] for _lo, hi in groups],
        names=[f"{whole.names[lo]}..{whole.names[hi - 1]}" if hi - lo > 1 else whole.names[lo] for lo, hi in groups],
        tied=tied,
        unsplittable=frozenset(group_of[k] for k in whole.unsplittable),
        unsliceable=frozenset(
            group_of[k] for k in whole.unsliceable if k + 1 in group_of and group_of[k + 1] != group_of[k]
        ),
        layer_map=tuple(bounds),
        grad_sources=[
            min((group_of[k] for k in whole.grad_sources[lo:hi]), default=g) for g, (lo, hi) in enumerate(groups)
        ]
        if whole.grad_sources
        else [],
        block_starts=frozenset(g for g, (lo, _hi) in enumerate(groups) if lo in whole.block_starts),
    )


#: The per-layer lists a merge of layers sums (op lists concatenated).
_SUMMED = (
    "fwd_s",
    "bwd_s",
    "act_bytes",
    "static_bytes",
    "grad_bytes",
    "fwd_fixed_s",
    "bwd_fixed_s",
    "roofline",
    "weight_ops",
    "weight_op_bytes",
    "weight_pass_bytes",
)


def _unsliceable_cuts(module: Module) -> frozenset[int]:
    """Cuts after layer k that a value crosses which depends on the data but has no batch dimension 0."""
    layer_of = {op: k for k, layer in enumerate(module.layers) for op in layer.ops}
    dependent = batch_dependent(module)
    found: set[int] = set()
    for op in module.ops:
        for v in op.operands:
            if v.kind in (OpKind.INPUT, OpKind.GET_ATTR) or v not in dependent or batched(module, v):
                continue
            made, used = layer_of.get(v), layer_of.get(op)
            if made is not None and used is not None and used > made:
                found.update(range(made, used))
    return frozenset(found)


def _grad_sources(module: Module) -> list[int]:
    """`Problem.grad_sources`: per layer, the first layer whose result it reads needs a gradient
    (`peak_memory.gradient_reads`)."""
    layer_of = {op: k for k, layer in enumerate(module.layers) for op in layer.ops}
    needing = values_needing_grad(module)
    return [
        min((layer_of.get(v, k) for v in gradient_reads(layer.ops, needing)), default=k)
        for k, layer in enumerate(module.layers)
    ]


def _tied_layers(module: Module) -> list[tuple[float, tuple[int, ...]]]:
    """(bytes, reading layers) of each trainable parameter that more than one layer reads."""
    readers: dict[str, set[int]] = {}
    for k, layer in enumerate(module.layers):
        for op in layer.ops:
            names = set(op.attrs.params or ()) | ({op.target} if op.kind is OpKind.GET_ATTR and op.target else set())
            for name in names:
                readers.setdefault(name, set()).add(k)
    table = {p.name: p for p in module.params if not p.attrs.buffer}
    return [(float(table[n].nbytes), tuple(sorted(ks))) for n, ks in readers.items() if len(ks) > 1 and n in table]
