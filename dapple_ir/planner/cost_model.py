"""The analytic cost model every planner (DP, ILP, baselines, exhaustive search) shares.

A `Problem` is the coarsened model: per layer forward/backward time and activation bytes at
`cost_batch`, static bytes (parameters, gradients, optimizer state), gradient bytes, and the bytes
crossing the cut after it at `batch`. A `Candidate` is a plan: contiguous layer ranges, the devices
of each stage's replicas, the microbatch count M and the schedule.

Iteration time (DAPPLE's latency: warm-up, steady phase of the slowest stage, drain), evaluated
over the stages from last to first so that dynamic programming can use the same recursion:

    busy_s = ceil(M / R_s) * (F_s + B_s)            work of one replica of stage s
    a_s    = F_s + B_s + 2 c_s                      first microbatch's path through s and its cut
    G_s    = max(busy_s, a_s + G_{s+1})             pipeline time seen from stage s
    H_s    = max(AR_s, H_{s+1} - (B_s + c_s))       allreduce time not hidden by the drain
    T      = max(G_0 + max(0, H_0), floor)

F, B scale with the microbatch b = global_batch / M; c_s is the transfer of the cut after s over
the link the placement uses (intra-node only when both stages sit on one node); AR_s is the ring
allreduce of stage s's gradients over its replica group, alone on the network
(`Network.allreduce_s`: the ring's steps share the links they cross). `floor` is the card floor
(`dapple_ir.planner.traffic`): the bytes every cut (activations and gradients, M microbatches) and
every allreduce push through each network card per iteration, over the card's bandwidth, at the
busiest card; the activations and allreduces that share a card add up there. With equal stages and
free links this is (M + S - 1)(F + B), the closed form of GPipe and 1F1B.

Memory of a device hosting a replica of stage s: static bytes plus activations of the microbatches
in flight: gpipe keeps all ceil(M/R_s) of its microbatches, 1f1b (and zb-h1) min(S - s, ceil(M/R_s)).

The formulas know the built-in schedules; any other registered schedule (`dapple_ir.schedules`, one a
plugin adds) is estimated like 1f1b, and the simulator, which lowers the real schedule, ranks it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import accumulate

from dapple_ir.analysis.memory import optimizer_state_factor
from dapple_ir.cluster.spec import ClusterSpec, Link
from dapple_ir.cluster.topology import Network
from dapple_ir.errors import PlanError
from dapple_ir.ir import Module
from dapple_ir.planner.traffic import busiest, cut_crossings, ring_crossings, ring_step_bytes

#: The device placement policies (see `place`).
POLICIES = ("append-first", "fresh-first", "scatter-first")

#: Share of a stage's compute on the first microbatch's path: zb-h1 defers the weight gradient
#: (about half the backward) into bubbles, interleaving halves each virtual stage.
_PATH_SHARE = {"gpipe": 1.0, "1f1b": 1.0, "zb-h1": 0.75, "interleaved": 0.5}


@dataclass
class Problem:
    """Per-layer costs of a coarsened module, for one cluster and global batch."""

    fwd_s: list[float]
    """Forward time per layer at `cost_batch`."""
    bwd_s: list[float]
    """Backward time per layer at `cost_batch`."""
    act_bytes: list[float]
    """Activation bytes kept for backward per layer at `cost_batch`."""
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
    network: Network = field(init=False, repr=False, compare=False)
    """The cluster's links (built from `cluster`)."""

    def __post_init__(self) -> None:
        self.network = Network(self.cluster)
        self.pf = [0.0, *accumulate(self.fwd_s)]
        self.pb = [0.0, *accumulate(self.bwd_s)]
        self.pa = [0.0, *accumulate(self.act_bytes)]
        self.ps = [0.0, *accumulate(self.static_bytes)]
        self.pg = [0.0, *accumulate(self.grad_bytes)]

    @property
    def layers(self) -> int:
        return len(self.fwd_s)

    def microbatch_size(self, microbatches: int) -> int:
        return self.global_batch // microbatches

    def time_scale(self, microbatches: int) -> float:
        """Factor from costs at `cost_batch` to one microbatch."""
        return self.microbatch_size(microbatches) / self.cost_batch

    def capacity(self, device: int) -> float:
        return self.cluster.device(device).memory_bytes


def problem_from_module(module: Module, cluster: ClusterSpec, global_batch: int) -> Problem:
    """The planner's view of a coarsened module (`module.layers` must be set)."""
    if not module.layers:
        raise PlanError(f"module @{module.name} has no layers; run 'coarsen' before 'plan'")
    factor = 2.0 + optimizer_state_factor(module.attrs.optimizer)
    static, grads = [], []
    for layer in module.layers:
        params = module.param_bytes_of(layer.ops)
        buffers = sum(
            p.nbytes
            for p in module.params
            if p.attrs.buffer and any(p.name in (op.attrs.params or ()) for op in layer.ops)
        )
        static.append(params * factor + buffers)
        grads.append(params)
    batch = module.attrs.batch or module.attrs.cost_batch or 1
    return Problem(
        fwd_s=[layer.attrs.fwd_s or 0.0 for layer in module.layers],
        bwd_s=[layer.attrs.bwd_s or 0.0 for layer in module.layers],
        act_bytes=[layer.attrs.act_bytes or 0.0 for layer in module.layers],
        static_bytes=static,
        grad_bytes=grads,
        cut_bytes=[layer.attrs.cut_bytes or 0.0 for layer in module.layers],
        cluster=cluster,
        global_batch=global_batch,
        cost_batch=module.attrs.cost_batch or batch,
        batch=batch,
        names=[layer.name for layer in module.layers],
    )


@dataclass(frozen=True)
class StageChoice:
    """Layers [lo, hi) on one device per replica."""

    lo: int
    hi: int
    devices: tuple[int, ...]

    @property
    def replicas(self) -> int:
        return len(self.devices)


@dataclass(frozen=True)
class Candidate:
    """A complete plan in the planner's terms."""

    stages: tuple[StageChoice, ...]
    microbatches: int
    schedule: str = "1f1b"
    policy: str = "append-first"
    source: str = ""
    """Who proposed it (`dp`, `ilp`, `baseline:uniform`, ...), for reports."""

    @property
    def replicas(self) -> tuple[int, ...]:
        return tuple(s.replicas for s in self.stages)

    @property
    def pipelines(self) -> int:
        """Whole-pipeline copies: the common factor of the stage replica counts."""
        return math.gcd(*self.replicas)

    def describe(self) -> str:
        cuts = "|".join(f"{s.lo}-{s.hi - 1}x{s.replicas}" for s in self.stages)
        return f"S={len(self.stages)} M={self.microbatches} {self.schedule} {self.policy} layers[{cuts}]"


@dataclass(frozen=True)
class Estimate:
    """What the cost model predicts for a candidate."""

    iteration_s: float
    pipeline_s: float
    """G_0: warm-up + steady + drain, without the unhidden allreduce."""
    allreduce_tail_s: float
    """max(0, H_0): allreduce time the drain does not hide."""
    stage_peak_bytes: tuple[float, ...]
    """Peak memory of a device of each stage."""
    stage_capacity: tuple[float, ...]
    bottleneck: int
    """Stage with the largest busy time."""
    floor_s: float = 0.0
    """The card floor: the busiest network card's bytes per iteration over its bandwidth."""
    busiest_link: str = ""
    """The link with the most seconds of traffic per iteration (cards, ports or buses), or ''."""
    busiest_s: float = 0.0
    """Its bytes per iteration over its bandwidth."""

    @property
    def fits(self) -> bool:
        return all(p <= c for p, c in zip(self.stage_peak_bytes, self.stage_capacity, strict=True))

    @property
    def peak_bytes(self) -> float:
        return max(self.stage_peak_bytes, default=0.0)


def in_flight(schedule: str, stages_after: int, per_replica: int) -> int:
    """Microbatches whose activations a replica holds at once; `stages_after` counts itself."""
    if schedule == "gpipe":
        return per_replica
    if schedule == "interleaved":
        return min(per_replica, 2 * stages_after)
    return min(per_replica, stages_after)


def cut_link(cluster: ClusterSpec, a: tuple[int, ...], b: tuple[int, ...]) -> Link:
    """The slowest link a microbatch crosses: microbatch m goes from replica m % |a| to m % |b|.

    For contiguous placements this is intra-node exactly when both stages sit on one node (the rule
    the DP and ILP use); replicated whole pipelines keep each copy's cut inside its node."""
    pairs = min(math.lcm(len(a), len(b)), 4096)
    node = cluster.node_of
    if all(node(a[m % len(a)]) == node(b[m % len(b)]) for m in range(pairs)):
        return cluster.intra
    return cluster.inter


def stage_memory(
    problem: Problem, lo: int, hi: int, schedule: str, stages_after: int, per_replica: int, b: int
) -> float:
    act = (problem.pa[hi] - problem.pa[lo]) * b / problem.cost_batch
    return problem.ps[hi] - problem.ps[lo] + in_flight(schedule, stages_after, per_replica) * act


def evaluate(problem: Problem, cand: Candidate) -> Estimate:
    """The cost model's iteration time and per-stage peak memory of `cand`."""
    m = cand.microbatches
    if m < 1 or problem.global_batch % m:
        raise PlanError(f"global batch {problem.global_batch} is not divisible into {m} microbatches")
    b = problem.microbatch_size(m)
    scale = problem.time_scale(m)
    share = _PATH_SHARE.get(cand.schedule, 1.0)
    n = len(cand.stages)
    g, h = -math.inf, -math.inf
    peaks, caps, busies = [0.0] * n, [0.0] * n, [0.0] * n
    network = problem.network
    loads: dict[int, float] = {}
    for s in range(n - 1, -1, -1):
        st = cand.stages[s]
        fwd = (problem.pf[st.hi] - problem.pf[st.lo]) * scale
        bwd = (problem.pb[st.hi] - problem.pb[st.lo]) * scale
        per_replica = -(-m // st.replicas)
        busy = per_replica * (fwd + bwd)
        c = 0.0
        if s < n - 1:
            nbytes = problem.cut_bytes[st.hi - 1] * b / problem.batch
            after = cand.stages[s + 1].devices
            c = cut_link(problem.cluster, st.devices, after).transfer_s(nbytes)
            _add(loads, cut_crossings(network, st.devices, after, m), nbytes)
        grads = problem.pg[st.hi] - problem.pg[st.lo]
        _add(loads, ring_crossings(network, st.devices), ring_step_bytes(grads, st.replicas))
        ar = network.allreduce_s(grads, st.devices)
        g = max(busy, share * (fwd + bwd) + 2 * c + g)
        h = max(ar, h - (bwd + c))
        busies[s] = busy
        peaks[s] = stage_memory(problem, st.lo, st.hi, cand.schedule, n - s, per_replica, b)
        caps[s] = min(problem.capacity(d) for d in st.devices)
    tail = max(0.0, h)
    _card, floor = busiest(network, loads, network.card_links)
    link, seconds = busiest(network, loads)
    name = network.links[link].name if link >= 0 else ""
    return Estimate(
        max(g + tail, floor), g, tail, tuple(peaks), tuple(caps), busies.index(max(busies)), floor, name, seconds
    )


def _add(loads: dict[int, float], crossings: dict[int, int], nbytes: float) -> None:
    if nbytes <= 0:
        return
    for link, count in crossings.items():
        loads[link] = loads.get(link, 0.0) + count * nbytes


# ------------------------------------------------------------------------------------ placement


def device_order(cluster: ClusterSpec, policy: str) -> list[int]:
    """The order in which a policy hands out devices; scatter-first goes round robin over nodes."""
    if policy != "scatter-first":
        return list(range(cluster.num_devices))
    per = cluster.devices_per_node
    return [node * per + slot for slot in range(per) for node in range(cluster.nodes)]


def stage_start(cluster: ClusterSpec, policy: str, offset: int, replicas: int) -> int:
    """Where in the device order a stage of `replicas` starts when `offset` devices are taken.

    fresh-first moves to the next untouched node when the current one is partly used and the stage
    still fits there (the skipped devices stay idle); the others continue where the last stage ended.
    """
    per = cluster.devices_per_node
    if policy != "fresh-first" or offset % per == 0:
        return offset
    fresh = (offset // per + 1) * per
    return fresh if fresh + replicas <= cluster.num_devices else offset


def place(cluster: ClusterSpec, replicas: list[int], policy: str) -> list[tuple[int, ...]] | None:
    """Device ids of each stage's replicas under `policy`, or None when they do not fit."""
    order = device_order(cluster, policy)
    offset, result = 0, []
    for r in replicas:
        start = stage_start(cluster, policy, offset, r)
        if start + r > len(order):
            return None
        result.append(tuple(order[start : start + r]))
        offset = start + r
    return result


def candidate(
    problem: Problem, bounds: list[int], replicas: list[int], microbatches: int, schedule: str, policy: str, source: str
) -> Candidate | None:
    """A candidate from cut points (`bounds` = [0, ..., L]) and replica counts, placed by `policy`
    (None when the devices run out or a replica would get no microbatch)."""
    if max(replicas) > microbatches:
        return None
    devices = place(problem.cluster, replicas, policy)
    if devices is None:
        return None
    stages = tuple(StageChoice(bounds[i], bounds[i + 1], devices[i]) for i in range(len(replicas)))
    return Candidate(stages, microbatches, schedule, policy, source)


def microbatch_choices(global_batch: int, devices: int, limit: int = 4) -> list[int]:
    """A few microbatch counts worth searching: the largest power-of-two divisors up to 8 per device
    (at most 1024, and at least 16 per device where memory needs small microbatches)."""
    cap = min(global_batch, max(8 * devices, 16), 1024)
    divisors = [m for m in range(cap, 0, -1) if global_batch % m == 0]
    # The largest divisor, then roughly halving: 96 -> 96, 48, 24, 12; 100 -> 100, 50, 25, 10.
    chosen = [divisors[0]]
    for m in divisors:
        if len(chosen) == limit:
            break
        if m <= chosen[-1] // 2:
            chosen.append(m)
    return sorted(chosen)
