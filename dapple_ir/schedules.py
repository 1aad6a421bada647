"""Pipeline schedules as data: functions from a pipeline shape to per-rank orders of compute work.

A schedule sees the pipeline as slots: slot (g, j) is replica j of device group g. Without virtual
stages each stage is its own group; with V virtual stages, stage k sits on group k % P (P = stages / V).
Replica j of a stage with R replicas runs the microbatches m with m % R == j, whole. A schedule returns,
per slot, the order of `Work` items (forward, backward, or backward_input / backward_weight for split
backward); `lower-comm` adds the communication around them. Add one with `@register_schedule("name")`.
`load_order_csv` reads a hand-written order instead (columns `rank,kind,stage,mb`).
"""

from __future__ import annotations

import csv
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dapple_ir.errors import ScheduleError
from dapple_ir.ir import InstrKind

F, B = InstrKind.FORWARD, InstrKind.BACKWARD
BI, BW = InstrKind.BACKWARD_INPUT, InstrKind.BACKWARD_WEIGHT

Slot = tuple[int, int]
"""(device group, replica)."""


@dataclass(frozen=True, slots=True)
class Work:
    """One unit of compute: `kind` of stage number `stage` (pipeline order) on microbatch `mb`."""

    kind: InstrKind
    stage: int
    mb: int


@dataclass(frozen=True, slots=True)
class StageMemory:
    """Bytes one microbatch of a stage holds on its rank, and when, as the static peak counts them.

    The defaults weigh a microbatch in flight (forward done, not yet released) as one, and nothing else.
    """

    static: float = 0.0
    """Parameters, gradients and optimizer state of the rank's stages: held whatever the order."""
    activation: float = 1.0
    """Kept from the forward to the release (backward, or backward_weight when split): the stage's activations
    (a recomputing stage's inputs)."""
    received: float = 0.0
    """The inputs it receives for a forward, from one compute before it (receives are posted that far ahead)
    to the release."""
    gradient: float = 0.0
    """The gradients of its outputs it receives for a backward (or backward_input), from one compute before it
    to the release."""
    weight_pass: float = 0.0
    """From backward_input to backward_weight: the gradients the weight passes restart from."""
    rerun: float = 0.0
    """A recomputing stage's rerun activations: while its backward runs, until backward_weight when split."""

    def incoming(self, kind: InstrKind) -> float:
        """Bytes received for work of `kind`."""
        return self.received if kind is F else self.gradient if kind in (B, BI) else 0.0

    def kept(self, kind: InstrKind) -> float:
        """Bytes work of `kind` keeps once done (negative: releases), its receives aside."""
        every = self.activation + self.received + self.gradient
        split = self.weight_pass + self.rerun
        return {F: self.activation, B: -every, BI: split, BW: -(every + split)}[kind]


@dataclass(frozen=True)
class ScheduleRequest:
    """The pipeline a schedule orders work for."""

    replicas: tuple[int, ...]
    """Replica count of each stage, in pipeline order."""
    microbatches: int
    """Microbatches per step (M), over all replicas."""
    virtual: int = 1
    """Virtual stages per device group (interleaved schedules)."""
    memory: tuple[StageMemory, ...] = ()
    """What a microbatch of each stage holds on its rank, in pipeline order (`peak_memory.stage_memory`), for
    schedules that weigh orders by bytes (zb-h1); empty: every microbatch in flight weighs one."""

    @property
    def stages(self) -> int:
        return len(self.replicas)

    @property
    def groups(self) -> int:
        """Device groups P: stage k runs on group k % P."""
        return self.stages // self.virtual

    def local_microbatches(self, stage: int, replica: int) -> list[int]:
        """The microbatches replica `replica` of `stage` runs, in order."""
        r = self.replicas[stage]
        return list(range(replica, self.microbatches, r))

    def slots(self) -> list[Slot]:
        """(group, replica) for every replica of every group, in group then replica order."""
        return [(g, j) for g in range(self.groups) for j in range(self.replicas[g])]

    def group_stages(self, group: int) -> list[int]:
        return list(range(group, self.stages, self.groups))

    def stage_memory(self, stage: int) -> StageMemory:
        return self.memory[stage] if self.memory else StageMemory()


ScheduleFn = Callable[[ScheduleRequest], dict[int, list[Work]]]
"""Orders each device group's work over all microbatches, as if no stage were replicated."""
SCHEDULES: dict[str, ScheduleFn] = {}
"""The schedule registry: every name `schedule{kind=...}`, `plan{schedule=...}` and
`dapple compile --schedule` accept, in registration order (the built-ins first)."""


def register_schedule(name: str) -> Callable[[ScheduleFn], ScheduleFn]:
    """Decorator that makes a schedule function available as `schedule{kind=name}` and `plan{schedule=name}`."""

    def wrap(fn: ScheduleFn) -> ScheduleFn:
        SCHEDULES[name] = fn
        return fn

    return wrap


def is_builtin(kind: str) -> bool:
    """Whether `kind` is one of the schedules defined here, deadlock-free by construction (a schedule a
    plugin registers is checked where it is used)."""
    return kind in SCHEDULES and SCHEDULES[kind].__module__ == __name__


def build_schedule(kind: str, request: ScheduleRequest) -> dict[Slot, list[Work]]:
    """Each slot's order: its group's order restricted to the microbatches the replica runs.

    Every replica's order is a subsequence of one deadlock-free single-pipeline order, so the execution
    that order describes is still valid: replication never introduces a deadlock.
    """
    if kind not in SCHEDULES:
        raise ScheduleError(f"unknown schedule kind '{kind}'; registered kinds: {', '.join(sorted(SCHEDULES))}")
    if request.microbatches < 1:
        raise ScheduleError(f"schedule '{kind}' needs at least one microbatch, not {request.microbatches}")
    if kind != "interleaved" and request.virtual != 1:
        raise ScheduleError(
            f"schedule '{kind}' has no virtual stages; virtual={request.virtual} needs kind=interleaved"
        )
    return restrict(SCHEDULES[kind](request), request)


def restrict(by_group: dict[int, list[Work]], request: ScheduleRequest) -> dict[Slot, list[Work]]:
    slots: dict[Slot, list[Work]] = {slot: [] for slot in request.slots()}
    for g, order in by_group.items():
        if not 0 <= g < request.groups:
            continue  # no device group of this request: nothing runs it
        r = request.replicas[g]
        for w in order:
            slots[(g, w.mb % r)].append(w)
    return slots


@register_schedule("gpipe")
def gpipe(request: ScheduleRequest) -> dict[int, list[Work]]:
    """All forwards, then all backwards: every microbatch's activations live at once."""
    mbs = range(request.microbatches)
    return {s: [Work(F, s, m) for m in mbs] + [Work(B, s, m) for m in mbs] for s in range(request.stages)}


def warmups(request: ScheduleRequest) -> list[int]:
    """Group-wide warm-up forwards of each stage under DAPPLE's early backward: each of a stage's R replicas
    keeps S - s of its own microbatches in flight, so the stage warms up with (S - s) R of them, at most M, and
    at least what the stage after it warms up with. Fewer would deadlock (the later stage would wait for a forward
    this one runs only after a backward that waits for the later stage), and capping the later stage instead starves
    it: with stages of 1, 2 and 1 replicas, each of the middle stage's replicas would then hold one microbatch before
    its first backward, and every round trip would wait for the one before (twice the time, simulated)."""
    found: list[int] = []
    for s in range(request.stages - 1, -1, -1):
        want = min((request.stages - s) * request.replicas[s], request.microbatches)
        found.append(max(want, found[-1]) if found else want)
    return found[::-1]


def _early_backward(stage: int, warmup: int, m: int, backward: Callable[[int], list[Work]]) -> list[Work]:
    """`warmup` forwards (`warmups`), then one backward (`backward(mb)`) and one forward, then the drain."""
    order = [Work(F, stage, mb) for mb in range(warmup)]
    for mb in range(warmup, m):
        order += [*backward(mb - warmup), Work(F, stage, mb)]
    for mb in range(m - warmup, m):
        order += backward(mb)
    return order


@register_schedule("1f1b")
def one_f_one_b(request: ScheduleRequest) -> dict[int, list[Work]]:
    """DAPPLE's early backward: min(S-s, M) warm-up forwards per replica (`warmups`), then one backward, one
    forward, then drain."""
    orders: dict[int, list[Work]] = {}
    warm = warmups(request)
    for s in range(request.stages):

        def backward(mb: int, s: int = s) -> list[Work]:
            return [Work(B, s, mb)]

        orders[s] = _early_backward(s, warm[s], request.microbatches, backward)
    return orders


def _uniform_replicas(request: ScheduleRequest) -> int:
    """The replica count all stages share, else 1 (interleaved rounds of uneven replication hold P microbatches)."""
    counts = set(request.replicas)
    return counts.pop() if len(counts) == 1 else 1


def _zb_order(stage: int, request: ScheduleRequest, defer: int) -> list[Work]:
    pending: deque[int] = deque()

    def backward(mb: int) -> list[Work]:
        out = [Work(BI, stage, mb)]
        pending.append(mb)
        while len(pending) > defer:
            out.append(Work(BW, stage, pending.popleft()))
        return out

    order = _early_backward(stage, warmups(request)[stage], request.microbatches, backward)
    return order + [Work(BW, stage, mb) for mb in pending]


def _replica_peak(order: list[Work], request: ScheduleRequest, stage: int) -> float:
    """Most bytes (`StageMemory`; by default microbatches in flight) the rank of any replica of `stage` holds."""
    r, cost = request.replicas[stage], request.stage_memory(stage)
    peak = 0.0
    for j in range(r):
        mine = [w.kind for w in order if w.mb % r == j]
        if not mine:
            continue  # a replica with no microbatch (the planner asks about R > M too)
        live = cost.incoming(mine[0])
        for kind, ahead in zip(mine, [*mine[1:], BW], strict=True):
            live += cost.incoming(ahead)  # the next compute's receives, posted before this one runs
            transient = cost.rerun if kind is B else 0.0
            peak = max(peak, live + max(cost.kept(kind), 0.0) + transient)
            live += cost.kept(kind)
    return cost.static + peak


@register_schedule("zb-h1")
def zero_bubble_h1(request: ScheduleRequest) -> dict[int, list[Work]]:
    """Zero Bubble H1: 1f1b's forwards and input-gradient passes; stage s defers up to s weight passes.

    Deferred W passes fill the bubbles that waiting for gradients leaves. Activations live from F to W,
    so deferring raises a stage's hold; each stage defers the most it can while its rank holds no more than
    the fullest 1f1b rank does (the ZB paper's bound: min(S, M) microbatches when stages weigh alike). Weighed
    in bytes (`request.memory`), a deferred W holds more than a microbatch in flight: the input pass keeps the
    whole activation and adds the gradients the weight pass restarts from (docs/runtime.md, "How far zb-h1
    defers"). A stage that cannot even split its backward within the bound runs 1f1b's whole backwards.
    With R replicas in every stage, the R pipelines over the microbatches m % R == j are independent:
    the group-wide order warms up with (S - s) R microbatches and defers up to s R weight passes, so
    each replica sees ZB-H1's order over its own microbatches.
    """
    ref = one_f_one_b(request)
    cap = max(_replica_peak(ref[s], request, s) for s in range(request.stages))
    orders: dict[int, list[Work]] = {}
    for s in range(request.stages):
        r = request.replicas[s]
        fits = (_zb_order(s, request, d) for d in range(s * r, -1, -1))
        orders[s] = next((o for o in fits if _replica_peak(o, request, s) <= cap), ref[s])
    return orders


def zb_splits(request: ScheduleRequest) -> list[bool]:
    """Per stage, does `zero_bubble_h1` split its backward? Only where splitting it with no weight pass deferred
    holds no more than the fullest 1f1b rank: deferring one only holds its bytes longer, so where that does not fit,
    no deferral does (`tests/test_schedules.py` checks this against the orders built)."""
    ref = one_f_one_b(request)
    cap = max(_replica_peak(ref[s], request, s) for s in range(request.stages))
    return [_replica_peak(_zb_order(s, request, 0), request, s) <= cap for s in range(request.stages)]


@register_schedule("interleaved")
def interleaved(request: ScheduleRequest) -> dict[int, list[Work]]:
    """Megatron-style interleaved 1f1b: each group runs V virtual stages, P microbatches per round.

    With R replicas in every stage (and M a multiple of P R), a round holds P R microbatches, so that
    each replica, which runs every R-th of them, sees Megatron's order over its own M / R: rounds of P
    and a warm-up R times shorter than the group-wide one. Otherwise rounds hold P microbatches.
    """
    p, v, m = request.groups, request.virtual, request.microbatches
    if m < p:
        raise ScheduleError(
            f"interleaved schedule: {m} microbatches are fewer than the {p} pipeline groups; "
            f"use at least {p} microbatches"
        )
    if m % p and v > 1:
        raise ScheduleError(
            f"interleaved schedule: {m} microbatches do not split into rounds of {p} (one per pipeline group); "
            f"Megatron's order needs a multiple of {p}, such as {m - m % p or p} or {m - m % p + p}"
        )
    r = interleaved_round_replicas(request)
    per = p * r
    rounds = [range(i, min(i + per, m)) for i in range(0, m, per)]
    orders: dict[int, list[Work]] = {}
    for g in range(p):
        fwd = [(c * p + g, mb) for rnd in rounds for c in range(v) for mb in rnd]
        bwd = [(c * p + g, mb) for rnd in rounds for c in reversed(range(v)) for mb in rnd]
        total = len(fwd)
        warmup = total if m == per else min(((p - g - 1) * 2 + (v - 1) * p) * r, total)
        order = [Work(F, k, mb) for k, mb in fwd[:warmup]]
        for i in range(total - warmup):
            order += [Work(F, *fwd[warmup + i]), Work(B, *bwd[i])]
        order += [Work(B, k, mb) for k, mb in bwd[total - warmup :]]
        orders[g] = order
    return orders


def interleaved_round_replicas(request: ScheduleRequest) -> int:
    """R when every stage has R replicas and M splits into rounds of P R microbatches, else 1."""
    r = _uniform_replicas(request)
    return r if request.microbatches % (request.groups * r) == 0 else 1


# ----------------------------------------------------------------------------- hand-written order

_KIND_WORDS = {
    "f": F,
    "forward": F,
    "b": B,
    "backward": B,
    "bi": BI,
    "backward_input": BI,
    "w": BW,
    "bw": BW,
    "backward_weight": BW,
}


def load_order_csv(path: str | Path, stage_names: list[str]) -> dict[int, list[Work]]:
    """Per-rank orders from a CSV file with header `rank,kind,stage,mb`; rows in execution order.

    `kind` is forward/backward/backward_input/backward_weight (or F/B/BI/W); `stage` a stage name
    (`s0`, with or without `@`) or its number in pipeline order. Lines starting with `#` are skipped.
    """
    path = Path(path)
    if not path.is_file():
        raise ScheduleError(f"schedule order file {path} does not exist")
    lines = [line for line in path.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    reader = csv.DictReader(lines)
    missing = {"rank", "kind", "stage", "mb"} - set(reader.fieldnames or ())
    if missing:
        raise ScheduleError(f"{path}: the header must name columns rank,kind,stage,mb; missing {sorted(missing)}")
    orders: dict[int, list[Work]] = {}
    for number, row in enumerate(reader, start=2):
        where = f"{path}, row {number}"
        kind = _KIND_WORDS.get(row["kind"].strip().lower())
        if kind is None:
            raise ScheduleError(f"{where}: unknown kind '{row['kind']}'; use one of {', '.join(_KIND_WORDS)}")
        stage = _stage_number(row["stage"].strip().lstrip("@"), stage_names, where)
        try:
            rank, mb = int(row["rank"]), int(row["mb"])
        except ValueError:
            raise ScheduleError(f"{where}: rank and mb must be integers, not '{row['rank']}', '{row['mb']}'") from None
        orders.setdefault(rank, []).append(Work(kind, stage, mb))
    return orders


def _stage_number(text: str, stage_names: list[str], where: str) -> int:
    if text in stage_names:
        return stage_names.index(text)
    if text.isdigit() and int(text) < len(stage_names):
        return int(text)
    raise ScheduleError(f"{where}: unknown stage '{text}'; stages are {', '.join(stage_names)}")
