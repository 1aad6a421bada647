"""The partition/replication problem as a CP-SAT model (OR-Tools), for append-first placement.

One model per (stage count S, microbatch count M): integer cut points e_0 = 0 < e_1 < ... < e_S = L,
a one-hot replica choice per stage, device offsets d_s = R_0 + ... + R_{s-1}, and the recursion of
`pipeline_cost` written as lower bounds (G_s >= busy_s, G_s >= a_s + G_{s+1}, H_s >= AR_s,
H_s >= H_{s+1} - B_s - c_s, T >= G_0, T >= G_0 + H_0) that the minimisation makes tight. Times are
integers in units of `unit` seconds; whether a cut or a replica group stays on one node comes from
the node of each stage's first and last device. Where each stage lies is also one-hot, y[s][o, r]
(stage s on devices [o, o + r)), which prices its allreduce (the ring's steps share the links they
cross) and adds its traffic to each network card: the card floor T >= sum over stages of the ring's
and the cut's bytes on the card / its bandwidth, written as lower bounds per placement (left out of
models that would grow past `FLOOR_TERMS` such constraints). Exact for the cost model (up to the
time unit) when the solver reports OPTIMAL with the floor in; otherwise the gap to its bound is
reported.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dapple_ir.cluster.topology import Network
from dapple_ir.planner.cost_model import Candidate, Estimate, Problem, candidate, evaluate, message_terms, stagger_s
from dapple_ir.planner.dp import replica_choices
from dapple_ir.pricing.collectives import ring_step_ratio
from dapple_ir.pricing.host import host_work_s, optimizer_step_s
from dapple_ir.pricing.pipeline import BACK_SHARE, PATH_SHARE, in_flight, raises_warmup
from dapple_ir.pricing.traffic import cut_crossings, cut_s

if TYPE_CHECKING:
    from ortools.sat.python import cp_model

    from dapple_ir.cluster.spec import DeviceKind

_MEMORY_UNIT = 1024.0
#: The bound of the model's time variables, in its time unit.
_BIG = 10**12

#: Card-floor constraints (cut placement x card link, over the stage boundaries) the model takes at
#: most; DAPPLE's 2x8 V100 cluster stays under it, a cluster of sixteen single-device nodes does not.
FLOOR_TERMS = 40_000


def _ints(values: list[float], unit: float) -> list[int]:
    return [round(v / unit) for v in values]


@dataclass(frozen=True)
class IlpSolution:
    """What CP-SAT found within its time limit: its best plan (the incumbent) and what it proved."""

    cand: Candidate
    estimate: Estimate
    """The cost model's verdict on `cand` (its `iteration_s` is the incumbent's time)."""
    optimal: bool
    """True when CP-SAT proved no append-first plan of this shape is faster (up to the time unit)."""
    bound_s: float
    """CP-SAT's proven lower bound on the iteration time of every plan of this shape."""
    gap: float
    """(incumbent - bound) / incumbent in the solver's units; 0 when optimal."""
    floor: bool = True
    """Whether the model held the card floor (large models leave it out, `FLOOR_TERMS`): without it,
    `optimal` is never claimed and the bound is the pipeline's alone (still a lower bound)."""

    @property
    def note(self) -> str:
        if self.optimal:
            return "optimal"
        if not self.floor and self.gap == 0.0:
            return "optimal without the card floor"
        return f"gap {100 * self.gap:.1f}% at the time limit"


def solve_ilp(
    problem: Problem,
    stages: int,
    microbatches: int,
    schedule: str = "1f1b",
    time_limit_s: float = 10.0,
    hint: Candidate | None = None,
) -> IlpSolution | None:
    """The best append-first candidate with exactly `stages` stages, or None when none is feasible.
    `hint` (a plan of the same shape, e.g. the DP's) starts the search from a known solution. The
    proven lower bound is kept apart from the incumbent, for reports that compare plans with the ILP
    when CP-SAT did not close the gap."""
    from ortools.sat.python import cp_model

    if stages > problem.layers or stages > problem.cluster.num_devices:
        return None
    model = _Model(problem, stages, _prices(problem, microbatches, schedule), schedule)
    if hint is not None and len(hint.stages) == stages:
        model.hint(hint)
    started = time.monotonic()
    solver, status, presolved = _solve(model.md, time_limit_s)
    if status == cp_model.OPTIMAL:
        left = time_limit_s - (time.monotonic() - started)
        solver, status = _confirm(model, solver, not presolved, left)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return model.solution(solver, status == cp_model.OPTIMAL)


@dataclass(frozen=True)
class _Prices:
    """The model's numbers for one microbatch count: per layer prefix (index k: layers 0..k-1) in whole time units
    (`unit` seconds) or `_MEMORY_UNIT` bytes, and the shares the schedule gives them."""

    microbatches: int
    rows: int
    """A microbatch's rows."""
    unit: float
    kind: DeviceKind
    """The device kind whose host work, split backward and optimizer step the model prices (`_prices`)."""
    zb: bool
    """zb-h1: its backward split into input and weight passes."""
    share_num: int
    """`PATH_SHARE` of the schedule, in quarters."""
    back_num: int
    """`BACK_SHARE` of the schedule, in quarters."""
    prefix: dict[str, list[int]]
    """Per quantity, its prefix sums: f forward and b backward time, a activation and s static bytes, g gradient
    bytes, p the split backward's price, o the optimizer step."""
    cap: int
    """A device's memory in `_MEMORY_UNIT`s."""
    choices: list[int]
    """The replica counts a stage may take."""


def _prices(problem: Problem, microbatches: int, schedule: str) -> _Prices:
    cluster, m = problem.cluster, microbatches
    b = problem.microbatch_size(m)
    times_f, times_b = problem.prefix_times(m)
    total = (times_f[-1] + times_b[-1]) * m + 1e-9
    unit = total / 1e8
    zb = schedule == "zb-h1"
    # What the model leaves out, priced again exactly in the plan's estimate: a parameter several layers read
    # counts once per layer (prefix sums), the tied parameters' own allreduces and the core floor are not in
    # it, and the host's work, a split backward and the optimizer step are priced on the cluster's slowest
    # kind (exact on clusters of one device kind). Under zb-h1 every stage but the first splits its backward and
    # hands a gradient back (`Problem.split_work`: not a stage whose inputs need none; `split_backwards`: not one
    # whose split would hold more than 1f1b's fullest rank).
    kind = max(cluster.node_kinds, key=lambda k: (k.instruction_overhead, k.message_overhead, -k.mem_bandwidth))
    splits = zip(problem.pw, problem.pwb, strict=True)
    prefix = {
        "f": _ints(times_f, unit),
        "b": _ints(times_b, unit),
        "a": _ints([v * b / problem.cost_batch for v in problem.pa], _MEMORY_UNIT),
        "s": _ints(problem.ps, _MEMORY_UNIT),
        "g": [round(v) for v in problem.pg],
        # zb-h1's split backward and the optimizer step (both linear in what they read).
        "p": _ints([kind.split_s(ops, nbytes) if zb else 0.0 for ops, nbytes in splits], unit),
        "o": _ints([optimizer_step_s(kind, v, problem.state_factor) for v in problem.pg], unit),
    }
    return _Prices(
        microbatches=m,
        rows=b,
        unit=unit,
        kind=kind,
        zb=zb,
        share_num=round(PATH_SHARE.get(schedule, 1.0) * 4),
        back_num=round(BACK_SHARE.get(schedule, 1.0) * 4),
        prefix=prefix,
        cap=int(problem.capacity(0) // _MEMORY_UNIT),
        choices=[r for r in replica_choices(cluster) if r <= m],
    )


@dataclass(frozen=True)
class _Cards:
    """What the card floor needs: each cut's transfers and times per placement, and the card links it watches."""

    cut_cards: dict[tuple, list]  # type: ignore[type-arg]
    """(o, r, r2) -> [(card link, transfers)] (`_cut_cards`)."""
    cut_times: dict[tuple, tuple]  # type: ignore[type-arg]
    """(o, r, r2) -> (latency, seconds per byte x 2**16, the same of a message from a late post) (`_cut_times`)."""
    floored: bool
    """Whether the model holds the card floor (`FLOOR_TERMS`)."""
    most: int
    """The most transfers one cut puts on one card."""
    cards: list[int]
    """The card links the floor counts (none where it is left out)."""
    coarse: int
    """The floor's time unit, in the model's units."""
    per_coarse: dict[int, int]
    """Per card link: the bytes it moves in one coarse unit."""
    cut_x: list[int]
    """Bytes of one microbatch's cut after each layer prefix (0 for none)."""


def _cards(problem: Problem, prices: _Prices, stages: int) -> _Cards:
    network, n_dev, b, unit = problem.network, problem.cluster.num_devices, prices.rows, prices.unit
    # The cut after a stage on devices [o, o + r) into r2 replicas: its transfers on each card.
    cut_cards = _cut_cards(network, prices.choices, prices.microbatches, n_dev) if stages > 1 else {}
    cut_times = _cut_times(problem, prices.choices, b, unit) if stages > 1 else {}
    # Past a size the card floor is left out (the model would not solve in time); the cost model
    # still counts it when it evaluates the plan found.
    floored = (stages - 1) * sum(len(on) for on in cut_cards.values()) <= FLOOR_TERMS
    most = max((k for on in cut_cards.values() for _link, k in on), default=0)
    cards = network.card_links if floored else []
    # Per card link and stage: the bytes its ring and its cut put on the card. They are compared with
    # the card's bandwidth in a coarser time unit, `coarse` units, chosen so that a card moves at
    # least 2**12 bytes in it: bytes stay exact and the numbers small (CP-SAT's presolve loses
    # solutions of this model when they grow past ~2**40).
    slowest_card = min((network.links[link].bandwidth for link in cards), default=1.0)
    coarse = 2 ** max(0, math.ceil(math.log2(2**12 / (slowest_card * unit))))
    per_coarse = {link: round(network.links[link].bandwidth * unit * coarse) for link in cards}
    cut_x = [0, *(round(problem.cut_bytes[j] * b / problem.batch) for j in range(problem.layers))]
    return _Cards(cut_cards, cut_times, floored, most, cards, coarse, per_coarse, cut_x)


class _Model:
    """The CP-SAT model of one (stage count, microbatch count): its variables, then per stage from the last to the
    first its work, ring, cut and place in the recursion, then the objective."""

    def __init__(self, problem: Problem, stages: int, prices: _Prices, schedule: str) -> None:
        from ortools.sat.python import cp_model

        self.problem, self.stages, self.prices, self.schedule = problem, stages, prices, schedule
        self.md = md = cp_model.CpModel()
        layers = problem.layers
        e = [md.new_constant(0)] + [md.new_int_var(s, layers - (stages - s), f"e{s}") for s in range(1, stages)]
        e.append(md.new_constant(layers))
        for s in range(stages):
            md.add(e[s + 1] >= e[s] + 1)
        self.e = e
        #: Per cut point, each prefix quantity of `_Prices.prefix` there.
        self.at = [{k: self.element(e[s], t, f"{k}{s}") for k, t in prices.prefix.items()} for s in range(stages + 1)]
        self.onehot = [[md.new_bool_var(f"r{s}_{r}") for r in prices.choices] for s in range(stages)]
        self.reps = []
        for s in range(stages):
            md.add_exactly_one(self.onehot[s])
            self.reps.append(sum(r * x for r, x in zip(prices.choices, self.onehot[s], strict=True)))
        md.add(sum(self.reps) <= problem.cluster.num_devices)
        self.nodes()
        self.cards = _cards(problem, prices, stages)
        self.y = self.placements()
        self.card_load: dict[int, list[cp_model.LinearExprT]] = {link: [] for link in self.cards.cards}
        after: tuple[cp_model.IntVar, ...] | None = None
        for s in range(stages - 1, -1, -1):
            after = self.stage(s, after)
        assert after is not None
        self.objective(after[0], after[1])

    def element(self, index: cp_model.IntVar, table: list[int], name: str) -> cp_model.IntVar:
        var = self.md.new_int_var(min(table), max(table), name)
        self.md.add_element(index, table, var)
        return var

    def nodes(self) -> None:
        """The node of each stage's first and last device (its devices start where the stages before it end)."""
        md, cluster = self.md, self.problem.cluster
        n_dev = cluster.num_devices
        for s in range(self.stages):
            offset = sum(self.reps[:s]) if s else 0
            start = md.new_int_var(0, n_dev - 1, f"d{s}")
            md.add(start == offset)
            end = md.new_int_var(0, n_dev - 1, f"z{s}")
            md.add(end == offset + self.reps[s] - 1)
            nf, nl = md.new_int_var(0, cluster.nodes, f"nf{s}"), md.new_int_var(0, cluster.nodes, f"nl{s}")
            md.add_division_equality(nf, start, cluster.devices_per_node)
            md.add_division_equality(nl, end, cluster.devices_per_node)

    def placements(self) -> list[dict[tuple[int, int], cp_model.IntVar]]:
        """y[s][(o, r)]: stage s on devices [o, o + r), one-hot and consistent with its replica count and offset."""
        md, choices, n_dev = self.md, self.prices.choices, self.problem.cluster.num_devices
        places = [(o, r) for r in choices for o in range(n_dev - r + 1)]
        y = [{(o, r): md.new_bool_var(f"y{s}_{o}_{r}") for o, r in places} for s in range(self.stages)]
        for s in range(self.stages):
            for r, x in zip(choices, self.onehot[s], strict=True):
                md.add(sum(v for (o, rr), v in y[s].items() if rr == r) == x)
            md.add(sum(o * v for (o, _r), v in y[s].items()) == (sum(self.reps[:s]) if s else 0))
        return y

    def stage(self, s: int, after: tuple[cp_model.IntVar, ...] | None) -> tuple[cp_model.IntVar, ...]:
        """Stage s's part of the recursion, given the next stage's (G, H, R, busy, B[, or gpipe's Qf, Qb, Pf, Pb]) in
        `after` (None for the last): its own."""
        f, bw, busy, ar = self.work(s)
        c, late, exposed = self.cut(s, f)
        md, prices = self.md, self.prices
        g, h = md.new_int_var(0, _BIG, f"G{s}"), md.new_int_var(-_BIG, _BIG, f"H{s}")
        trip = md.new_int_var(0, 4 * _BIG, f"R{s}")
        md.add(g >= busy)
        md.add(h >= ar)
        if after is not None:
            md.add(4 * g >= prices.share_num * (f + bw) + 8 * c + 4 * late + 4 * after[0])
            md.add(h >= after[1] - bw - c)
        if self.schedule == "gpipe":
            return g, h, trip, *self.phases(s, (f, bw, c, late), g, trip, after)
        own = self.waits(s, (f, busy, exposed), g, after, prices.share_num * (f + bw) + 8 * c + 4 * late)
        if after is None:
            md.add(4 * trip >= 4 * f + prices.back_num * bw)
            return g, h, trip, own, bw
        back = md.new_int_var(0, 4 * _BIG, f"trip{s}")
        md.add(back == 2 * c + after[2])
        counts = (prices.microbatches, self.stages - s)
        _stall(md, self.schedule, (f, bw, own, g, trip), back, (prices.choices, self.onehot[s]), counts)
        return g, h, trip, own, bw

    def steady(self, s: int, r: int) -> int:
        """Stage s's microbatches per replica past its warm-up at r replicas (`pricing.pipeline.stage_step`)."""
        per = -(-self.prices.microbatches // r)
        return max(0, per - in_flight(self.schedule, self.stages - s, per))

    def waits(
        self,
        s: int,
        work: tuple[cp_model.IntVar, ...],
        g: cp_model.IntVar,
        after: tuple[cp_model.IntVar, ...] | None,
        path: cp_model.LinearExpr,
    ) -> cp_model.IntVar:
        """Stage s's busy time with its waits for gradients (`pricing.pipeline.stage_step`), from its (F, busy, the
        cut's rendezvous) in `work`; with the next stage's (busy, B) in `after`, G no less than the way to that stage
        (`path`, in quarters) and its busy time with its waits for inputs over this cut."""
        md = self.md
        f, busy, exposed = work
        own = md.new_int_var(0, 4 * _BIG, f"own{s}")
        md.add(own >= busy)
        for r, chosen in zip(self.prices.choices, self.onehot[s], strict=True):
            md.add(own >= busy + self.steady(s, r) * (exposed - f)).only_enforce_if(chosen)
        if after is not None:
            own_next, bw_next = after[3], after[4]
            for r, chosen in zip(self.prices.choices, self.onehot[s + 1], strict=True):
                feed = 4 * own_next + 4 * self.steady(s + 1, r) * (exposed - bw_next)
                md.add(4 * g >= path + feed).only_enforce_if(chosen)
        return own

    def phases(
        self,
        s: int,
        times: tuple[cp_model.IntVar, ...],
        g: cp_model.IntVar,
        trip: cp_model.IntVar,
        after: tuple[cp_model.IntVar, ...] | None,
    ) -> tuple[cp_model.IntVar, ...]:
        """gpipe's phases of stage s (`pricing.pipeline.stage_step`) as lower bounds, G >= Qf + Qb and R >= Pf + Pb:
        its (Qf, Qb, Pf, Pb), from its (F, B, c, late) in `times` and the next stage's in `after`."""
        md = self.md
        f, bw, c, late = times
        qf, qb, pf, pb = (md.new_int_var(0, 4 * _BIG, f"{name}{s}") for name in ("Qf", "Qb", "Pf", "Pb"))
        md.add(g >= qf + qb)
        md.add(trip >= pf + pb)
        if after is None:
            md.add(pf >= f)
            md.add(pb >= bw)
            ahead: cp_model.LinearExpr = md.new_constant(0)
            behind: cp_model.LinearExpr = md.new_constant(0)
        else:
            qf_next, qb_next, pf_next, pb_next = after[3:]
            md.add(pf >= f + c + pf_next)
            md.add(pb >= bw + c + pb_next)
            md.add(qf >= f + c + late + qf_next)
            md.add(qb >= qb_next + c + bw)
            ahead, behind = c + pf_next, c + pb_next
        for r, chosen in zip(self.prices.choices, self.onehot[s], strict=True):
            per = -(-self.prices.microbatches // r)
            md.add(qf >= per * f + ahead).only_enforce_if(chosen)
            md.add(qb >= per * bw + behind).only_enforce_if(chosen)
        return qf, qb, pf, pb

    def work(self, s: int) -> tuple[cp_model.IntVar, cp_model.IntVar, cp_model.IntVar, cp_model.IntVar]:
        """Stage s's forward F and backward B per microbatch, its busy time and its allreduce AR (the ring's part
        where its placement has one, `ring`), with its memory at each replica count under the device's."""
        md, prices, at, stages = self.md, self.prices, self.at, self.stages
        # The host's work per instruction and message, as `cost_model.stage_price` adds it.
        messages = (s > 0) + (s < stages - 1)
        host_f = round(host_work_s(prices.kind, 1, messages) / prices.unit)
        host_b = round(host_work_s(prices.kind, 1 + prices.zb, messages) / prices.unit)
        f = md.new_int_var(0, _BIG, f"F{s}")
        md.add(f == at[s + 1]["f"] - at[s]["f"] + host_f)
        bw = md.new_int_var(0, _BIG, f"B{s}")
        split_b = at[s + 1]["p"] - at[s]["p"] if prices.zb and s > 0 else 0
        md.add(bw == at[s + 1]["b"] - at[s]["b"] + host_b + split_b)
        step = at[s + 1]["o"] - at[s]["o"]
        grads = md.new_int_var(0, max(prices.prefix["g"]), f"W{s}")
        md.add(grads == at[s + 1]["g"] - at[s]["g"])
        static = at[s + 1]["s"] - at[s]["s"]
        act = at[s + 1]["a"] - at[s]["a"]
        busy, ar = md.new_int_var(0, _BIG, f"busy{s}"), md.new_int_var(0, _BIG, f"ar{s}")
        md.add(ar >= step)
        for r, x in zip(prices.choices, self.onehot[s], strict=True):
            per = -(-prices.microbatches // r)
            md.add(busy >= per * (f + bw)).only_enforce_if(x)
            md.add(static + in_flight(self.schedule, stages - s, per) * act <= prices.cap).only_enforce_if(x)
        self.ring(s, ar, grads, step)
        return f, bw, busy, ar

    def ring(self, s: int, ar: cp_model.IntVar, grads: cp_model.IntVar, step: cp_model.LinearExpr) -> None:
        """Stage s's allreduce at each placement with replicas (after its optimizer `step`), and the bytes its ring
        puts on each card link there."""
        md, unit, most_grads = self.md, self.prices.unit, max(self.prices.prefix["g"])
        rings: dict[int, cp_model.IntVar] = {}
        for (o, r), place in self.y[s].items():
            if r == 1:
                continue
            ring = self.problem.ring(range(o, o + r))
            coef = round(ring.per_byte_s / unit * 2**16)
            lat = round(ring.fixed_s / unit)
            md.add(ar * 2**16 >= coef * grads + (lat + step) * 2**16).only_enforce_if(place)
            for link, k in ring.crossings.items():
                if link in self.card_load:
                    if link not in rings:
                        rings[link] = md.new_int_var(0, 2 * k * most_grads, f"ring{s}_{link}")
                        self.card_load[link].append(rings[link])
                    # k steps of the ring's share of the gradients each (`ring_step_ratio`), in whole bytes.
                    numerator, denominator = ring_step_ratio(r)
                    md.add(denominator * rings[link] >= numerator * k * grads).only_enforce_if(place)

    def cut(self, s: int, f: cp_model.IntVar) -> tuple[cp_model.IntVar, cp_model.IntVar, cp_model.IntVar]:
        """c: the cut's transfer after stage s at its placement and the next stage's replica count (which starts
        where this one ends), sharing links as `cost_model.cut_transfer` says; `late`: how much later the next
        stage's last round-robin replica starts (`cost_model.stagger_s`); a message's time from a late receive's
        post (`pricing.pipeline.rendezvous_s`). All 0 after the last stage."""
        md, cards, choices = self.md, self.cards, self.prices.choices
        x_s = self.element(self.e[s + 1], cards.cut_x, f"x{s}") if s < self.stages - 1 else None
        nexts = dict(zip(choices, self.onehot[s + 1], strict=True)) if x_s is not None else {}
        if cards.cards and x_s is not None:
            cut = (x_s, cards.most * max(cards.cut_x))
            _cut_loads(md, self.card_load, cards.cut_cards, self.y[s], nexts, cut, s)
        c = md.new_int_var(0, _BIG, f"c{s}")
        late = md.new_int_var(0, _BIG, f"late{s}")
        exposed = md.new_int_var(0, 2 * _BIG, f"rendezvous{s}")
        if x_s is None:
            md.add(c == 0)
            md.add(late == 0)
            md.add(exposed == 0)
            return c, late, exposed
        # A cut that carries no bytes costs nothing, not even a latency (as the cost model has it). c is
        # pinned (rounded up), not just bounded: a longer c would shorten the unhidden allreduce H.
        carries = md.new_bool_var(f"carries{s}")
        md.add(x_s >= 1).only_enforce_if(carries)
        md.add(x_s == 0).only_enforce_if(carries.negated())
        md.add(c == 0).only_enforce_if(carries.negated())
        md.add(exposed == 0).only_enforce_if(carries.negated())
        for (o, r), place in self.y[s].items():
            for r2, nxt in nexts.items():
                lat, coef, lat_alone, coef_alone = cards.cut_times.get((o, r, r2), (0, 0, 0, 0))
                if coef == 0:
                    md.add(c == 0).only_enforce_if([place, nxt])
                    md.add(exposed == 0).only_enforce_if([place, nxt])
                    continue
                alone = lat_alone * 2**16 + coef_alone * x_s
                md.add(exposed * 2**16 >= alone).only_enforce_if([place, nxt, carries])
                md.add(exposed * 2**16 <= alone + 2**16 - 1).only_enforce_if([place, nxt, carries])
                exact = lat * 2**16 + coef * x_s
                md.add(c * 2**16 >= exact).only_enforce_if([place, nxt, carries])
                md.add(c * 2**16 <= exact + 2**16 - 1).only_enforce_if([place, nxt, carries])
        m, after = self.prices.microbatches, self.stages - s - 1
        for r, here in zip(choices, self.onehot[s], strict=True):
            for r2, nxt in nexts.items():
                stagger = round(stagger_s(1.0, r, False, r2, False, m))
                md.add(late == stagger * f).only_enforce_if([here, nxt])
                if raises_warmup(self.schedule, r, r2, after, m):
                    md.add_bool_or([here.negated(), nxt.negated()])  # the DP's space: no raised warm-up
        return c, late, exposed

    def objective(self, g0: cp_model.IntVar, h0: cp_model.IntVar) -> None:
        """Minimise T: the first stage's G, plus its unhidden allreduce H, and no less than the card floor."""
        md, coarse = self.md, self.cards.coarse
        t = md.new_int_var(0, 4 * _BIG, "T")
        md.add(t >= g0)
        md.add(t >= g0 + h0)
        if any(self.card_load.values()):
            floor = md.new_int_var(0, 4 * _BIG // coarse + 1, "floor")
            md.add(t >= coarse * floor)
            for link, terms in self.card_load.items():
                if terms:
                    md.add(floor * self.cards.per_coarse[link] >= sum(terms))
        md.minimize(t)
        self.t = t

    def hint(self, hint: Candidate) -> None:
        """Start the search from `hint`'s cuts and replica counts."""
        for s in range(1, self.stages):
            self.md.add_hint(self.e[s], hint.stages[s].lo)
        for s, st in enumerate(hint.stages):
            for r, x in zip(self.prices.choices, self.onehot[s], strict=True):
                self.md.add_hint(x, r == st.replicas)

    def solution(self, solver: cp_model.CpSolver, solved: bool) -> IlpSolution | None:
        """The plan `solver` found (`solved`: proven optimal), priced again by the cost model."""
        problem, prices = self.problem, self.prices
        bounds = [solver.value(x) for x in self.e]
        replicas = [prices.choices[[solver.value(x) for x in row].index(1)] for row in self.onehot]
        cand = candidate(problem, bounds, replicas, prices.microbatches, self.schedule, "append-first", "ilp")
        if cand is None:
            return None
        value, bound = solver.objective_value, solver.best_objective_bound
        gap = 0.0 if solved or value <= 0 else (value - bound) / value
        estimate = evaluate(problem, cand)
        optimal = solved and self.cards.floored
        bound_s = estimate.iteration_s if optimal else max(0.0, bound * prices.unit)
        return IlpSolution(cand, estimate, optimal, bound_s, gap, self.cards.floored)


def _solve(md: cp_model.CpModel, time_limit_s: float) -> tuple[cp_model.CpSolver, cp_model.CpSolverStatus, bool]:
    """Solve `md` with CP-SAT's search alone, and again with its presolve where the search alone calls it
    infeasible; the last flag says whether the answer came with the presolve. Both are wrong somewhere on this model
    (ortools 9.15): the presolve loses the optimum once the placement one-hots are in (it proved a VGG-19 plan on
    4x8xH100 optimal that the DP beat by 18 %), and the search alone calls small feasible models infeasible (2 stages
    of 2 or 3 layers on 3 devices: found by `tests/test_pricing.py` against exhaustive search), or proves a plan optimal
    that is not (zb-h1 on 3 layers, 3 devices: 132.5 ms where 110.9 ms exists); `_confirm` asks the other mode."""
    from ortools.sat.python import cp_model

    solver, status, presolve = cp_model.CpSolver(), cp_model.UNKNOWN, False
    for presolve in (False, True):
        solver = _run(md, time_limit_s, presolve)
        status = solver.solve(md)
        if status != cp_model.INFEASIBLE:
            break
    return solver, status, presolve


def _run(md: cp_model.CpModel, time_limit_s: float, presolve: bool) -> cp_model.CpSolver:
    """A solver for `md` with its time limit, two workers, and CP-SAT's presolve on or off."""
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.1, time_limit_s)
    solver.parameters.num_workers = 2
    solver.parameters.cp_model_presolve = presolve
    return solver


def _confirm(
    model: _Model, solver: cp_model.CpSolver, presolve: bool, time_limit_s: float
) -> tuple[cp_model.CpSolver, cp_model.CpSolverStatus]:
    """An optimum `solver` proved, asked again of the mode that did not prove it (`presolve`, `_solve`): is any plan
    strictly faster? None (infeasible): the optimum stands. One: the new search's answer replaces it, proven where that
    search finished. No answer in what is left of the time limit: the plan stands, unproven."""
    from ortools.sat.python import cp_model

    model.md.add(model.t <= round(solver.objective_value) - 1)
    again = _run(model.md, time_limit_s, presolve)
    status = again.solve(model.md)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return again, status
    return solver, cp_model.OPTIMAL if status == cp_model.INFEASIBLE else cp_model.FEASIBLE


def _stall(
    md: cp_model.CpModel,
    schedule: str,
    stage: tuple[cp_model.IntVar, cp_model.IntVar, cp_model.IntVar, cp_model.IntVar, cp_model.IntVar],
    trip: cp_model.IntVar,
    replicas: tuple[list[int], list[cp_model.IntVar]],
    counts: tuple[int, int],
) -> None:
    """`pricing.pipeline.stage_step` as lower bounds on a stage's G and round trip R (the minimisation makes them
    tight): `stage` is its (F, B, busy, G, R), `trip` the next stage's round trip with the cut both ways, and
    `replicas` the one-hot choice of its replica count (its microbatches in flight depend on it)."""
    f, bw, busy, g, r_trip = stage
    back_num = round(BACK_SHARE.get(schedule, 1.0) * 4)
    m, stages_after = counts
    x = md.new_int_var(0, 4 * 10**12, f"X{stages_after}")
    md.add(x >= f + trip)
    md.add(4 * r_trip >= 4 * x + back_num * bw)
    for r, chosen in zip(*replicas, strict=True):
        per = -(-m // r)
        warm = in_flight(schedule, stages_after, per)
        md.add(x >= warm * f).only_enforce_if(chosen)
        md.add(warm * g >= per * (f + trip + bw)).only_enforce_if(chosen)
        if schedule == "zb-h1" or per <= warm:
            md.add(g >= busy + x - warm * f).only_enforce_if(chosen)
            continue
        cool = md.new_int_var(0, 4 * 10**12, f"cool{stages_after}_{r}")
        md.add(4 * cool >= 4 * trip - (warm - 1) * back_num * bw)
        md.add(g >= busy + x - warm * f + cool).only_enforce_if(chosen)


def _cut_cards(network: Network, choices: list[int], microbatches: int, n_dev: int) -> dict[tuple, list]:  # type: ignore[type-arg]
    """(o, r, r2) -> [(card link, transfers)]: the cut from devices [o, o + r) to the r2 after them."""
    table = {}
    cards = set(network.card_links)
    for r in choices:
        for o in range(n_dev - r + 1):
            for r2 in choices:
                if o + r + r2 <= n_dev:
                    crossings = cut_crossings(network, range(o, o + r), range(o + r, o + r + r2), microbatches)
                    table[(o, r, r2)] = [(link, round(k)) for link, k in crossings.items() if link in cards]
    return table


def _cut_times(problem: Problem, choices: list[int], rows: int, unit: float) -> dict[tuple, tuple]:  # type: ignore[type-arg]
    """(o, r, r2) -> (latency, seconds per byte x 2**16, a message's latency and seconds per byte x 2**16 from a late
    post) in `unit`s: one microbatch's cut from devices [o, o + r) to the r2 after them, the transfers that cross at
    once sharing links (`traffic.cut_s`), and one message alone (`cost_model.message_s`)."""
    table = {}
    n_dev = problem.cluster.num_devices
    for r in choices:
        for o in range(n_dev - r + 1):
            for r2 in choices:
                if o + r + r2 <= n_dev:
                    a, b = range(o, o + r), range(o + r, o + r + r2)
                    per_byte, latency = cut_s(problem.network, a, b, (False, False), rows)
                    fixed, alone = message_terms(problem.cluster, a, b, (False, False))
                    table[(o, r, r2)] = (
                        round(latency / unit),
                        round(per_byte / unit * 2**16),
                        round(fixed / unit),
                        round(alone / unit * 2**16),
                    )
    return table


def _cut_loads(
    md: cp_model.CpModel,
    card_load: dict[int, list[cp_model.LinearExprT]],
    cut_cards: dict[tuple, list],  # type: ignore[type-arg]
    here: dict[tuple[int, int], cp_model.IntVar],
    next_replicas: dict[int, cp_model.IntVar],
    cut: tuple[cp_model.IntVar, int],
    s: int,
) -> None:
    """The bytes of the cut after stage s on each card: for each placement of s and replica count of
    s + 1 (which starts where s ends), its transfers on the card times the bytes of one (`cut`: that
    variable, and the most bytes a card can get from the cut), as lower bounds."""
    x_s, most = cut
    terms: dict[int, cp_model.IntVar] = {}
    for (o, r), place in here.items():
        for r2, nxt in next_replicas.items():
            for link, k in cut_cards.get((o, r, r2), ()):
                if link not in terms:
                    terms[link] = md.new_int_var(0, most, f"cut{s}_{link}")
                    card_load[link].append(terms[link])
                md.add(terms[link] >= k * x_s).only_enforce_if([place, nxt])


def plan_ilp(
    problem: Problem,
    *,
    microbatches: list[int],
    schedule: str = "1f1b",
    stages: int | None = None,
    time_limit_s: float = 10.0,
    max_stages: int = 16,
    hints: list[Candidate] | None = None,
) -> list[tuple[Candidate, Estimate, str]]:
    """Solve for stage and microbatch counts within `time_limit_s`: around the hints' shapes when
    given (each hint seeds the model of its own shape), else every count up to `max_stages`."""
    most = min(problem.layers, problem.cluster.num_devices, max_stages)
    by_shape = {(len(h.stages), h.microbatches): h for h in reversed(hints or []) if h.policy == "append-first"}
    if stages:
        jobs = [(stages, m) for m in microbatches]
    elif by_shape:
        jobs = list(by_shape)
        jobs += [(s + d, m) for s, m in by_shape for d in (-1, 1) if 1 <= s + d <= most and (s + d, m) not in by_shape]
    else:
        jobs = [(s, m) for m in microbatches for s in range(1, most + 1)]
    deadline = time.monotonic() + time_limit_s
    results = []
    for k, (s, m) in enumerate(jobs):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        found = solve_ilp(problem, s, m, schedule, left / (len(jobs) - k), hint=by_shape.get((s, m)))
        if found is not None:
            results.append((found.cand, found.estimate, found.note))
    results.sort(key=lambda r: (not r[1].fits, r[1].iteration_s))
    return results
