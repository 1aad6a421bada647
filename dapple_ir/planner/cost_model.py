"""The analytic cost model every planner (DP, ILP, baselines, exhaustive search) shares.

A `Problem` is the coarsened model: per layer forward/backward time and activation bytes at
`cost_batch`, static bytes (parameters, gradients, optimizer state), gradient bytes, and the bytes
crossing the cut after it at `batch`. A `Candidate` is a plan: contiguous layer ranges, the devices
of each stage's replicas, the microbatch count M and the schedule.

Iteration time (DAPPLE's latency: warm-up, steady phase of the slowest stage, drain), evaluated
over the stages from last to first so that dynamic programming can use the same recursion:

    busy_s = ceil(M / R_s) * (F_s + B_s)            work of one replica of stage s
    a_s    = F_s + B_s + 2 c_s + l_s                first microbatch's path through s and its cut
    G_s    = max(busy_s, a_s + G_{s+1})             pipeline time seen from stage s
    H_s    = max(AR_s, H_{s+1} - (B_s + c_s))       allreduce time not hidden by the drain
    T      = max(G_0 + max(0, H_0) + TIED, floor, cores)

F, B are the stage's times for a microbatch of b = global_batch / M samples: an op the roofline priced
(`roofline_ops`) priced again at b, any other's fixed part as it is and the rest scaled from
`cost_batch` (`Problem.prefix_times`, `roofline.rescaled_s`);
c_s is the transfer of one microbatch over the cut after s, sharing the links with what crosses at
once (`traffic.cut_s`: R round-robin replicas send R microbatches side by side); l_s is how much
later than the first the next stage's last round-robin replica gets its first microbatch
(`stagger_s`: one stage on one device feeding eight replicas hands them out one forward apart);
AR_s is the ring allreduce of stage s's gradients over its replica group,
alone on the network (`Network.allreduce_s`: the ring's steps share the links they cross), less the
tied parameters (an embedding and the LM head that reuses it) whose readers sit in other stages too:
each of those is summed after the stages' own, over every device holding it (TIED, `tied_allreduces`),
as `lower-comm` does. `floor` is the card floor
(`dapple_ir.planner.traffic`): the bytes every cut (activations and gradients, M microbatches) and
every allreduce push through each network card per iteration, over the card's bandwidth, at the
busiest card; the activations and allreduces that share a card add up there. With equal stages and
free links this is (M + S - 1)(F + B), the closed form of GPipe and 1F1B. `cores` is the core floor, where a
node's CPU ranks outnumber its cores (`ClusterSpec.cores_per_node`): the busy time of every replica on the node
over its cores, the least time those cores can do the node's work in (the simulator shares them as they do;
without sharing it is 0).

Memory of a device hosting a replica of stage s: static bytes plus activations of the microbatches
in flight: gpipe keeps all ceil(M/R_s) of its microbatches, 1f1b (and zb-h1) min(S - s, ceil(M/R_s)).

Split replication (`Candidate.split`, per stage; DAPPLE's data parallelism inside a stage): replica
j of R runs rows [j b // R, (j + 1) b // R) of every microbatch, so the busiest runs ceil(b / R) rows
(`stage_rows`) of all M: F_s, B_s are the stage's times at those rows (fixed parts as they are),
busy_s = M (F_s + B_s), its activations scale to those rows and 1f1b holds min(S - s, M) microbatches
in flight. A cut where either side splits moves, per microbatch, the rows each producer replica and
consumer replica share (`traffic.cut_pieces`), all at once: c_s is the busiest link's share of the
cut's bytes over its bandwidth (`traffic.cut_s`), and every piece counts toward the card floor.
With R equal everywhere and uniform stages (no fixed part) the closed form is (M + S - 1)(F + B) / R.

Recomputation (`Candidate.recompute`, per stage; 1f1b and gpipe): a recomputing stage keeps only its
input (the bytes crossing the cut before it) and its checkpoints (the bytes crossing each cut inside it where
a block begins, `analysis.activation_checkpoints`) per microbatch in flight, plus one segment's activations while the
rerun forward and the backward run segment by segment; its backward costs B_s + F_s. With uniform
stages recomputing everywhere the closed form becomes (M + S - 1)(2F + B).

Sharded optimizer state (`Candidate.zero`, per replicated stage; ZeRO-1): AR_s plus the optimizer step becomes
the ring's reduce-scatter half, the step over 1/R_s of the stage's own parameters and the all-gather half
(`Problem.gradient_tail_s`: the same bytes on the links as the allreduce, a shorter step), and the static bytes
hold 1/R_s of those parameters' optimizer state (`Problem.static_of`).

Zero Bubble H1 (zb-h1): a stage whose backward the schedule splits (`split_stages`: not where keeping the gradients
its weight pass restarts from would hold more than 1f1b's fullest rank, `schedules.zb_splits`) runs it as two
instructions, hands its input gradient back after the input pass (`pricing.pipeline.BACK_SHARE`) and, where it hands
one back, pays the split's extra autograd passes (`Problem.split_s`); any other stage is priced as 1f1b's.

With V virtual stages per device group (interleaved, `Candidate.virtual`), the S = P V stages sit on
P groups (stage k on group k % P) and the recursion runs over the groups (`_evaluate_interleaved`):
the first microbatch crosses each group in chunks of 1/V of its work, so the bubble shrinks by V,
while the S - 1 cuts (V times as many transfers) load the links.

The formulas know the built-in schedules; any other registered schedule (`dapple_ir.schedules`, one a
plugin adds) is estimated like 1f1b, and the simulator, which lowers the real schedule, ranks it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from dapple_ir.cluster.spec import ClusterSpec, Link
from dapple_ir.errors import PlanError
from dapple_ir.pricing.layers import Problem, op_roofline, problem_from_module, roofline_ops
from dapple_ir.pricing.pipeline import (
    in_flight,
    interleaved_held,
    rendezvous_s,
    replica_in_flight,
    split_backwards,
    stage_step,
)
from dapple_ir.pricing.traffic import busiest, cut_crossings, cut_s
from dapple_ir.schedules import StageMemory

# The pricing layer's names the planner's callers know from here.
__all__ = ["Problem", "in_flight", "op_roofline", "problem_from_module", "roofline_ops"]

#: The device placement policies (see `place`).
POLICIES = ("append-first", "fresh-first", "scatter-first")


def tied_allreduces(problem: Problem, cand: Candidate) -> tuple[list[float], list[tuple[float, tuple[int, ...]]]]:
    """Per stage, the tied-parameter bytes its own allreduce leaves out; and (bytes, devices) of each
    tied parameter's allreduce over every device of the stages reading it (the parameters whose readers
    share one stage stay in its allreduce)."""
    stage_of = [k for k, st in enumerate(cand.stages) for _ in range(st.lo, st.hi)]
    left_out = [0.0] * len(cand.stages)
    rings: list[tuple[float, tuple[int, ...]]] = []
    for nbytes, layers in problem.tied:
        stages = sorted({stage_of[layer] for layer in layers})
        if len(stages) < 2:
            continue
        for k in stages:
            left_out[k] += nbytes  # the stage counts the parameter once (`Problem.grads_of`)
        devices = tuple(sorted({d for k in stages for d in cand.stages[k].devices}))
        rings.append((nbytes, devices))
    return left_out, rings


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
    virtual: int = 1
    """Virtual stages per device group (interleaved): stage k sits on the devices of stage k % P,
    P = len(stages) / virtual (Megatron's interleaved placement)."""
    recompute: tuple[bool, ...] = ()
    """Per stage: does it recompute its forward before the backward (empty: no stage does)."""
    split: tuple[bool, ...] = ()
    """Per stage: do its replicas split every microbatch (DAPPLE: replica j of R takes rows
    [j b // R, (j + 1) b // R) of each), rather than take whole ones round robin (empty: none)."""

    zero: tuple[bool, ...] = ()
    """Per stage: do its replicas shard the optimizer state (ZeRO-1; a stage of one replica never does)?"""

    def recomputes(self, k: int) -> bool:
        return k < len(self.recompute) and self.recompute[k]

    def shards(self, k: int) -> bool:
        """Does stage k shard its optimizer state over its replicas (`zero`)?"""
        return k < len(self.zero) and self.zero[k] and self.stages[k].replicas > 1

    def sharding(self) -> str:
        """The sharded stages, as `--explain` lists them ("s1,s2"), or "-"."""
        names = [f"s{k}" for k in range(len(self.stages)) if self.shards(k)]
        return ",".join(names) if names else "-"

    def recomputing(self) -> str:
        """The recomputing stages, as `--explain` lists them ("s0,s2"), or "-"."""
        names = [f"s{k}" for k in range(len(self.stages)) if self.recomputes(k)]
        return ",".join(names) if names else "-"

    def splits(self, k: int) -> bool:
        """Does stage k split its microbatches over its replicas (a stage of one replica never does)?"""
        return k < len(self.split) and self.split[k] and self.stages[k].replicas > 1

    @property
    def replicas(self) -> tuple[int, ...]:
        return tuple(s.replicas for s in self.stages)

    @property
    def groups(self) -> int:
        """Device groups P: the stages that do not share devices."""
        return len(self.stages) // self.virtual

    @property
    def pipelines(self) -> int:
        """Whole-pipeline copies: the common factor of the stage replica counts."""
        return math.gcd(*self.replicas)

    def describe(self) -> str:
        cuts = "|".join(f"{s.lo}-{s.hi - 1}x{s.replicas}" for s in self.stages)
        virtual = f" V={self.virtual}" if self.virtual > 1 else ""
        rc = f" rc {self.recomputing()}" if any(self.recompute) else ""
        split = f" R={self.replication()}" if any(self.split) else ""
        zero = f" zero {self.sharding()}" if any(self.zero) else ""
        head = f"S={len(self.stages)}{virtual} M={self.microbatches} {self.schedule} {self.policy}"
        return f"{head}{rc}{split}{zero} layers[{cuts}]"

    def replication(self) -> str:
        """Replica counts with an `s` on the split stages and a `z` on those sharding their optimizer state (ZeRO-1),
        as `--explain` shows them: "15s,1,2z"."""
        return ",".join(
            f"{st.replicas}{'s' if self.splits(k) else ''}{'z' if self.shards(k) else ''}"
            for k, st in enumerate(self.stages)
        )


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
    cores_s: float = 0.0
    """The core floor: where ranks share a node's cores, the node's busy seconds over its cores (else 0)."""

    @property
    def fits(self) -> bool:
        return all(p <= c for p, c in zip(self.stage_peak_bytes, self.stage_capacity, strict=True))

    @property
    def peak_bytes(self) -> float:
        return max(self.stage_peak_bytes, default=0.0)


def stage_rows(b: int, replicas: int, split: bool) -> int:
    """Samples of each microbatch the busiest replica of a stage computes: ceil(b / R) split, else b."""
    return -(-b // replicas) if split else b


#: How a replicated stage shares its microbatches: `split` each over the replicas (DAPPLE), whole
#: ones `round-robin`, or `auto`: split where a microbatch has a sample for every replica.
REPLICATION = ("auto", "split", "round-robin")


def with_replication(problem: Problem, cand: Candidate, mode: str) -> Candidate | None:
    """`cand` with its replicated stages split or round robin as `mode` (one of `REPLICATION`) says;
    None where that cannot run: a split stage needs a sample of each microbatch per replica, a
    round-robin one a microbatch per replica."""
    b, m = problem.microbatch_size(cand.microbatches), cand.microbatches
    can = [1 < st.replicas <= b and problem.can_split(st.lo, st.hi) for st in cand.stages]
    split = tuple(can) if mode != "round-robin" else ()
    if mode == "split" and any(st.replicas > 1 and not ok for st, ok in zip(cand.stages, can, strict=True)):
        return None
    if any(r > m and not (k < len(split) and split[k]) for k, r in enumerate(cand.replicas)):
        return None
    return dataclasses.replace(cand, split=split if any(split) else ())


def stagger_s(fwd: float, replicas: int, split: bool, next_replicas: int, next_split: bool, microbatches: int) -> float:
    """How much later than the first the last replica of the next stage gets its first microbatch.

    Round-robin replicas of the next stage take microbatches 0, 1, ... in turn, and this stage hands
    them out as it finishes them: R of them every forward when its R replicas take whole microbatches,
    one every forward when it splits each. So the next stage's last replica k = min(R', M) - 1 starts
    floor(k / R) forwards after the first (a split next stage gets every microbatch on all replicas at once).
    """
    if next_split or next_replicas <= 1:
        return 0.0
    last = min(next_replicas, microbatches) - 1
    return (last // (1 if split else replicas)) * fwd


def cut_transfer_s(
    problem: Problem, a: tuple[int, ...], b: tuple[int, ...], split: tuple[bool, bool], nbytes: float, rows: int
) -> float:
    """c: one microbatch's transfer over a cut of `nbytes`, sharing the links with the pieces and
    microbatches that cross at once (`traffic.cut_s`): a split stage's pieces of one microbatch, a
    round-robin stage's R replicas' microbatches side by side (eight replicas on one server behind one
    card send eight microbatches through it together)."""
    return cut_transfer(problem, a, b, split, nbytes, rows)[0]


def cut_transfer(
    problem: Problem, a: tuple[int, ...], b: tuple[int, ...], split: tuple[bool, bool], nbytes: float, rows: int
) -> tuple[float, float]:
    """(c, a message's time from a late receive's post): `cut_transfer_s` and `rendezvous_s` of one message alone
    on the slowest link it crosses (`message_s`)."""
    per_byte, latency = cut_s(problem.network, a, b, split, rows)
    c = latency + nbytes * per_byte if nbytes > 0 and per_byte > 0 else 0.0
    return c, message_s(problem.cluster, a, b, split, nbytes) if c > 0.0 else 0.0


def message_s(
    cluster: ClusterSpec, a: Sequence[int], b: Sequence[int], split: tuple[bool, bool], nbytes: float
) -> float:
    """A message's time over the cut from devices `a` to `b` from its receive's post (`pricing.pipeline.rendezvous_s`):
    one microbatch, or a split side's piece of it, alone on the slowest link a microbatch crosses (`cut_link`). A
    receiver posts one compute ahead, so it has about one message in flight; `c` prices the replicas' microbatches
    side by side, which a stage feeding one replica from fifteen never sends (VGG-19 on 2x8xV100 at 15, 1 replicas:
    W shared 3x the simulation)."""
    fixed, per_byte = message_terms(cluster, a, b, split)
    return fixed + nbytes * per_byte if nbytes > 0 else 0.0


def message_terms(
    cluster: ClusterSpec, a: Sequence[int], b: Sequence[int], split: tuple[bool, bool]
) -> tuple[float, float]:
    """`message_s` as (seconds, seconds per byte of the microbatch), for the solvers: `rendezvous_s` of the slowest
    link a microbatch crosses (`cut_link`), a split side's piece of the bytes on it."""
    link = cut_link(cluster, tuple(a), tuple(b))
    pieces = max(len(a) if split[0] else 1, len(b) if split[1] else 1)
    return rendezvous_s(link.latency, link.latency), 1.0 / (link.bandwidth * pieces)


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
    problem: Problem,
    lo: int,
    hi: int,
    schedule: str,
    stages_after: int,
    per_replica: int,
    b: int,
    recompute: bool = False,
    shards: int = 1,
    held: int | None = None,
) -> float:
    """Static bytes of layers [lo, hi) plus the activations of the microbatches in flight (`held`, by default
    `in_flight`'s); with `recompute`, each microbatch in flight keeps only the stage's input (`received_bytes`) and
    its checkpoints (`Problem.checkpoint_bytes`), and one checkpoint segment's activations live at a time while the
    backward reruns the forward (`Problem.rerun_bytes`)."""
    held = in_flight(schedule, stages_after, per_replica) if held is None else held
    static = problem.static_of(lo, hi, shards)
    rerun = problem.rerun_bytes(lo, hi, b) if recompute else 0.0
    return static + held * _held_per_microbatch(problem, lo, hi, b, recompute) + rerun


def split_stages(problem: Problem, cand: Candidate) -> list[bool]:
    """Per stage of `cand`, does it run its backward as an input and a weight pass: under zb-h1, where the schedule
    splits it (`pricing.pipeline.split_backwards`, its orders weighed in the problem's bytes)."""
    if cand.schedule != "zb-h1":
        return [False] * len(cand.stages)
    return split_backwards(_runs(cand), cand.microbatches, _stage_bytes(problem, cand))


def _runs(cand: Candidate) -> tuple[int, ...]:
    """Each stage's replicas as the schedule orders them: a split stage's run every microbatch, as one."""
    return tuple(1 if cand.splits(k) else st.replicas for k, st in enumerate(cand.stages))


def _stage_bytes(problem: Problem, cand: Candidate) -> list[StageMemory]:
    """What one microbatch of each stage of `cand` holds on its rank, in the problem's bytes, as
    `peak_memory.stage_memory` counts a module's for the schedule to weigh its orders by."""
    n, b = len(cand.stages), problem.microbatch_size(cand.microbatches)
    found = []
    for k, st in enumerate(cand.stages):
        rows = stage_rows(b, st.replicas, cand.splits(k))
        recompute = cand.recomputes(k)
        later = cand.stages[k + 1] if k < n - 1 else None
        sends_back = later is not None and problem.hands_back(later.lo, later.hi)
        found.append(
            StageMemory(
                static=problem.static_of(st.lo, st.hi, st.replicas if cand.shards(k) else 1),
                activation=_held_per_microbatch(problem, st.lo, st.hi, rows, recompute),
                received=received_bytes(problem, st.lo, rows),
                gradient=problem.cut_bytes[st.hi - 1] * rows / problem.batch if sends_back else 0.0,
                weight_pass=problem.weight_pass_of(st.lo, st.hi, rows),
                rerun=problem.rerun_bytes(st.lo, st.hi, rows) if recompute else 0.0,
            )
        )
    return found


def received_bytes(problem: Problem, lo: int, b: int) -> float:
    """Bytes a stage starting at layer `lo` receives per microbatch of b samples (0 for the first)."""
    return problem.cut_bytes[lo - 1] * b / problem.batch if lo > 0 else 0.0


def evaluate(problem: Problem, cand: Candidate) -> Estimate:
    """The cost model's iteration time and per-stage peak memory of `cand`."""
    m = cand.microbatches
    if m < 1 or problem.global_batch % m:
        raise PlanError(f"global batch {problem.global_batch} is not divisible into {m} microbatches")
    if cand.virtual > 1:
        if any(cand.split):
            raise PlanError("split replication is not modelled with virtual stages (interleaved); plan without it")
        return _evaluate_interleaved(problem, cand)
    _check_splits(problem, cand)
    n = len(cand.stages)
    after: tuple[float, ...] | None = None
    h = -math.inf
    peaks, caps, busies = [0.0] * n, [0.0] * n, [0.0] * n
    loads: dict[int, float] = {}
    left_out, tied_rings = tied_allreduces(problem, cand)
    split = [cand.splits(k) for k in range(n)]
    held = replica_in_flight(cand.schedule, cand.replicas, split, cand.microbatches)
    halves = split_stages(problem, cand)
    for s in range(n - 1, -1, -1):
        price = stage_price(problem, cand, s, after, left_out[s], loads, held[s], halves[s])
        after = price.state
        h = max(price.tail, h - (price.bwd + price.cut))
        busies[s], peaks[s] = price.busy, price.peak
        caps[s] = min(problem.capacity(d) for d in cand.stages[s].devices)
    assert after is not None
    return _estimate(problem, cand, after[0], h, tied_rings, loads, busies, peaks, caps)


def _check_splits(problem: Problem, cand: Candidate) -> None:
    b = problem.microbatch_size(cand.microbatches)
    for k, st in enumerate(cand.stages):
        if cand.splits(k) and st.replicas > b:
            raise PlanError(
                f"stage {k} splits microbatches of {b} samples over {st.replicas} replicas: "
                "a split stage needs at least one sample per replica"
            )
        if cand.splits(k) and not problem.can_split(st.lo, st.hi):
            raise PlanError(
                f"stage {k} (layers {st.lo}-{st.hi - 1}) cannot split its microbatches: it normalises over the "
                "batch, or a cut beside it carries a value without the batch in dimension 0"
            )


@dataclass(frozen=True, slots=True)
class StagePrice:
    """What `stage_price` works out for one stage of a candidate."""

    state: tuple[float, ...]
    """(G, R, ...): `pricing.pipeline.stage_step`."""
    busy: float
    fwd: float
    bwd: float
    cut: float
    tail: float
    """Its allreduce and optimizer step after its last backward."""
    peak: float


def stage_price(
    problem: Problem,
    cand: Candidate,
    s: int,
    after: tuple[float, ...] | None,
    left_out: float,
    loads: dict[int, float],
    warm: int,
    halves: bool = False,
) -> StagePrice:
    """Stage s of `cand` priced with the stage after it (`after`: its state, `pricing.pipeline.stage_step`),
    its cut's and ring's bytes added to `loads`; a replica holds `warm` microbatches at once
    (`pricing.pipeline.replica_in_flight`); `halves`: zb-h1 splits its backward (`pricing.pipeline.split_backwards`;
    a zb-h1 stage that does not runs and is priced as 1f1b's)."""
    st, n, m = cand.stages[s], len(cand.stages), cand.microbatches
    b = problem.microbatch_size(m)
    # A split stage's replicas each run every microbatch on their rows, the busiest ceil(b / R).
    rows = stage_rows(b, st.replicas, cand.splits(s))
    pf, pb = problem.times_at(rows)
    fwd = pf[st.hi] - pf[st.lo]
    bwd = pb[st.hi] - pb[st.lo]
    if cand.recomputes(s):
        bwd += fwd  # the forward reruns before the backward
    schedule = "1f1b" if cand.schedule == "zb-h1" and not halves else cand.schedule
    if halves:
        bwd += problem.split_s(st.lo, st.hi, st.devices)
    # The host's own work per microbatch: each compute instruction (a split backward runs as two, the first
    # stage's too: an empty input pass), and a message each way per neighbouring stage.
    neighbours = (s > 0) + (s < n - 1)
    fwd += problem.host_s(st.devices, 1, neighbours)
    bwd += problem.host_s(st.devices, 1 + halves, neighbours)
    per_replica = m if cand.splits(s) else -(-m // st.replicas)
    busy = per_replica * (fwd + bwd)
    c = late = exposed = 0.0
    if s < n - 1:
        nbytes = problem.cut_bytes[st.hi - 1] * b / problem.batch
        nxt = cand.stages[s + 1]
        split = (cand.splits(s), cand.splits(s + 1))
        c, exposed = cut_transfer(problem, st.devices, nxt.devices, split, nbytes, b)
        _add(loads, cut_crossings(problem.network, st.devices, nxt.devices, m, split, b), nbytes)
        late = stagger_s(fwd, st.replicas, cand.splits(s), nxt.replicas, cand.splits(s + 1), m)
    grads = max(0.0, problem.grads_of(st.lo, st.hi) - left_out)
    ring = problem.ring(st.devices)
    _add(loads, ring.crossings, ring.step_bytes(grads))
    tail = problem.gradient_tail_s(st.lo, st.hi, st.devices, grads, cand.shards(s))
    state = stage_step(schedule, busy, fwd, bwd, c, late, warm, per_replica, after, exposed)
    shards = st.replicas if cand.shards(s) else 1
    peak = stage_memory(
        problem, st.lo, st.hi, cand.schedule, n - s, per_replica, rows, cand.recomputes(s), shards, warm
    )
    return StagePrice(state, busy, fwd, bwd, c, tail, peak)


def _estimate(
    problem: Problem,
    cand: Candidate,
    g: float,
    h: float,
    tied_rings: list[tuple[float, tuple[int, ...]]],
    loads: dict[int, float],
    busies: list[float],
    peaks: list[float],
    caps: list[float],
) -> Estimate:
    """The estimate from the pipeline time G_0 and unhidden tail H_0: the tied parameters' allreduces follow every
    stage's own, on every device holding a copy; then the card and core floors."""
    tail = max(0.0, h)
    for nbytes, devices in tied_rings:
        ring = problem.ring(devices)
        _add(loads, ring.crossings, ring.step_bytes(nbytes))
        tail += ring.seconds(nbytes)
    network = problem.network
    _card, floor = busiest(network, loads, network.card_links)
    link, seconds = busiest(network, loads)
    name = network.links[link].name if link >= 0 else ""
    cores = core_floor(problem.cluster, [(st.devices, busy) for st, busy in zip(cand.stages, busies, strict=True)])
    return Estimate(
        max(g + tail, floor, cores), g, tail, tuple(peaks), tuple(caps), busies.index(max(busies)), floor, name,
        seconds, cores,
    )  # fmt: skip


def core_floor(cluster: ClusterSpec, busy: Iterable[tuple[tuple[int, ...], float]]) -> float:
    """The least time a node's cores take for its ranks' work: for (devices, busy seconds of each) pairs, the most
    any node has to do over its cores, where the cluster's nodes have fewer cores than devices
    (`ClusterSpec.shares_cores`); 0 elsewhere. A node whose plan uses no more ranks than it has cores gets a bound
    below its busiest rank's work, so only an oversubscribed node ever sets it."""
    if not cluster.shares_cores:
        return 0.0
    per_node: dict[int, float] = {}
    for devices, seconds in busy:
        for d in devices:
            per_node[cluster.node_of(d)] = per_node.get(cluster.node_of(d), 0.0) + seconds
    return max(per_node.values(), default=0.0) / cluster.cores_per_node


def _evaluate_interleaved(problem: Problem, cand: Candidate) -> Estimate:
    """`evaluate` for V > 1 virtual stages per device group (Megatron's interleaved 1F1B).

    The recursion runs over the P device groups: group g does w_g = the forward and backward of its V
    stages per microbatch, and a microbatch's path crosses it in chunks of w_g / V, so with equal
    groups G_0 = M w + (P - 1) w / V (the bubble shrinks by V). c_g is the mean transfer of the V cuts
    from group g to g + 1; every one of the S - 1 cuts (V - 1 of them wrap from the last group back to
    the first) loads the links and counts toward the card floor. A device holds its V stages'
    parameters and, at the interleaved order's peak, the activations of the chunks in flight
    (`interleaved_held`). A recomputing chunk holds its input and checkpoints instead, reruns its forward in its
    backward, and adds one checkpoint segment's activations to its group's peak (the largest of its chunks')."""
    m, p, n = cand.microbatches, cand.groups, len(cand.stages)
    b = problem.microbatch_size(m)
    pf, pb = problem.prefix_times(m)
    network = problem.network
    loads: dict[int, float] = {}
    work, bwd, static, cut_s = [0.0] * p, [0.0] * p, [0.0] * p, [0.0] * p
    act = [_held_per_microbatch(problem, st.lo, st.hi, b, cand.recomputes(k)) for k, st in enumerate(cand.stages)]
    rerun = [problem.rerun_bytes(st.lo, st.hi, b) if cand.recomputes(k) else 0.0 for k, st in enumerate(cand.stages)]
    again = [pf[st.hi] - pf[st.lo] if cand.recomputes(k) else 0.0 for k, st in enumerate(cand.stages)]
    # Each chunk's own work per microbatch: its ops, its forward and backward instructions and a message each way
    # per neighbouring stage.
    host = [problem.host_s(st.devices, 2, 2 * ((k > 0) + (k < n - 1))) for k, st in enumerate(cand.stages)]
    chunk = [pf[st.hi] - pf[st.lo] + pb[st.hi] - pb[st.lo] + again[k] + host[k] for k, st in enumerate(cand.stages)]
    for k, st in enumerate(cand.stages):
        g = k % p
        work[g] += chunk[k]
        bwd[g] += pb[st.hi] - pb[st.lo] + again[k] + host[k] / 2
        static[g] += problem.static_of(st.lo, st.hi, st.replicas if cand.shards(k) else 1)
        ring = problem.ring(st.devices)
        _add(loads, ring.crossings, ring.step_bytes(problem.grads_of(st.lo, st.hi)))
        if k == n - 1:
            continue
        nbytes = problem.cut_bytes[st.hi - 1] * b / problem.batch
        after = cand.stages[k + 1].devices
        _add(loads, cut_crossings(network, st.devices, after, m), nbytes)
        cut_s[g] += cut_transfer_s(problem, st.devices, after, (False, False), nbytes, b) / (
            cand.virtual - (g == p - 1)
        )
    # Between rounds a group waits for its first microbatch to come round the whole ring of groups.
    ring_s = (cand.virtual - 1) * 2 * sum(cut_s)
    cut_s[p - 1] = 0.0
    held = interleaved_held(cand.replicas, cand.microbatches, cand.virtual, cand.groups, act)
    g_time, h = -math.inf, -math.inf
    busies = [0.0] * p
    # The order moves in rounds: every group runs chunk c of P microbatches before chunk c + 1. With
    # uneven chunks a round waits for its slowest chunk (the lockstep bound, `rounds`), though the 1F1B
    # phase lets a group run ahead by a round or so: the pace lies between the busiest group's sum and
    # that bound, and the simulated profiles sit near the middle.
    rounds = (max(work) + sum(max(chunk[c * p : (c + 1) * p]) for c in range(cand.virtual))) / 2
    for g in range(p - 1, -1, -1):
        devices = cand.stages[g].devices
        busies[g] = -(-m // len(devices)) * max(work[g], rounds)
        g_time = max(busies[g], work[g] / cand.virtual + 2 * cut_s[g] + g_time)
        ar = sum(
            problem.gradient_tail_s(s.lo, s.hi, s.devices, problem.grads_of(s.lo, s.hi), cand.shards(k))
            for k, s in ((k, cand.stages[k]) for k in range(g, n, p))
        )
        h = max(ar, h - (bwd[g] / cand.virtual + cut_s[g]))
    reruns = [max(rerun[g::p]) for g in range(p)]
    peaks = tuple(static[k % p] + held[k % p] + reruns[k % p] for k in range(n))
    caps = tuple(min(problem.capacity(d) for d in st.devices) for st in cand.stages)
    tail = max(0.0, h)
    _card, floor = busiest(network, loads, network.card_links)
    link, seconds = busiest(network, loads)
    name = network.links[link].name if link >= 0 else ""
    g_time += ring_s
    # Each device does its group's V chunks for its share of the microbatches.
    own = [(cand.stages[g].devices, -(-m // len(cand.stages[g].devices)) * work[g]) for g in range(p)]
    cores = core_floor(problem.cluster, own)
    return Estimate(
        max(g_time + tail, floor, cores), g_time, tail, peaks, caps, busies.index(max(busies)), floor, name, seconds,
        cores,
    )  # fmt: skip


def _held_per_microbatch(problem: Problem, lo: int, hi: int, b: int, recompute: bool) -> float:
    """What a stage of layers [lo, hi) holds per microbatch in flight: its activations, or recomputing, its input
    and checkpoints."""
    if recompute:
        return received_bytes(problem, lo, b) + problem.checkpoint_bytes(lo, hi, b)
    return (problem.pa[hi] - problem.pa[lo]) * b / problem.cost_batch


def _add(loads: dict[int, float], crossings: Mapping[int, float], nbytes: float) -> None:
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
    problem: Problem,
    bounds: list[int],
    replicas: list[int],
    microbatches: int,
    schedule: str,
    policy: str,
    source: str,
    split: bool = False,
) -> Candidate | None:
    """A candidate from cut points (`bounds` = [0, ..., L]) and replica counts, placed by `policy`,
    its replicated stages split when `split` (`with_replication`; None when the devices run out or
    a replica would get no microbatch, or no rows of one)."""
    devices = place(problem.cluster, replicas, policy)
    if devices is None:
        return None
    stages = tuple(StageChoice(bounds[i], bounds[i + 1], devices[i]) for i in range(len(replicas)))
    return with_replication(
        problem, Candidate(stages, microbatches, schedule, policy, source), "split" if split else "round-robin"
    )


def microbatch_choices(global_batch: int, devices: int, limit: int = 4) -> list[int]:
    """A few microbatch counts worth searching: the largest power-of-two divisors up to 8 per device
    (at most 1024, and at least 16 per device where memory needs small microbatches). A global batch past
    1024 (a job of thousands of devices) may go to 16 per device, up to microbatches of one sample: what
    Megatron-LM's table runs (310.1B: 2,160 microbatches, 9 per tensor group), and at 1T the only size that fits."""
    cap = min(global_batch, 16 * devices) if global_batch > 1024 else min(global_batch, max(8 * devices, 16), 1024)
    divisors = [m for m in range(cap, 0, -1) if global_batch % m == 0]
    # The largest divisor, then roughly halving: 96 -> 96, 48, 24, 12; 100 -> 100, 50, 25, 10.
    chosen = [divisors[0]]
    for m in divisors:
        if len(chosen) == limit:
            break
        if m <= chosen[-1] // 2:
            chosen.append(m)
    return sorted(chosen)
