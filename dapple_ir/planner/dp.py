"""Dynamic programming over layers × devices: cuts, replica counts and placement, exact for the
cost model of `cost_model.evaluate` when the Pareto fronts are not capped.

The recursion runs from the last stage to the first, one `pricing.pipeline.stage_step` per stage:
the suffix of layers [i, L) placed from device-order offset d has a Pareto front of (G, H, state, n,
loads) — pipeline time seen from its first stage, unhidden allreduce and optimizer step, the stage state
`stage_step` hands on (its first microbatch's round trip R, its microbatches past the warm-up and its busy time
with its waits for late receives less their backwards; gpipe's phases), stage count, and the bytes its cuts and
allreduces push through each network card. G, H, the state and every card's load grow monotonically with the
suffix's, so the front is all a predecessor needs; exact fronts keep stage counts apart (more stages after a stage
let it run more forwards before its first backward). The card floor is the busiest card's load over its bandwidth.
The cut before the suffix adds to the cards of the suffix's first stage, so with uncapped fronts entries are kept apart
by where that stage lies. Every price comes from `pricing` as
`evaluate` reads it: compute at the stage's rows, the host's work per instruction and message,
zb-h1's split backward, each parameter once, the ring allreduce with the hosts' reduction, the
optimizer step, each cut over the links it shares, and a late receive's message alone on its link
(`cost_model.message_s`).

What the DP leaves out, all re-priced by `evaluate` for the plan it returns: sharded optimizer state (ZeRO-1:
its plans shard nothing; `planner.zero` adds the sharded twins, as replication variants are added), the
allreduce of a tied parameter whose readers fall in different stages (summed over every device holding it), the core
floor of ranks sharing a node's cores, and, on clusters with more than `EXACT_CARDS` card links, every
card's load (it carries only the floor of each stage's own allreduce, a lower bound that stays cheap on a
thousand devices) and prices a cut between two unsplit stages over the one link the placement uses, not
the links it shares with what crosses at once. It does not propose a stage that must warm up with more
than its own S - s to feed the next one's replicas (`pricing.pipeline.raises_warmup`: more replicas after fewer; the
stage's microbatches in flight would depend on the stages after its child). Under zb-h1 it splits every
stage's backward, where the schedule runs whole backwards on a stage whose split would hold more than 1f1b's fullest
rank (`pricing.pipeline.split_backwards`: it needs the whole plan's bytes). Outside those, the
DP's objective for its plan is `evaluate`'s iteration time (`tests/test_pricing.py`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from functools import cache
from operator import itemgetter
from typing import Any

from dapple_ir.cluster.spec import ClusterSpec
from dapple_ir.errors import PlanError
from dapple_ir.planner.cost_model import (
    Candidate,
    Estimate,
    Problem,
    StageChoice,
    device_order,
    evaluate,
    message_terms,
    stage_rows,
    stage_start,
    stagger_s,
)
from dapple_ir.pricing.collectives import ring_step_bytes
from dapple_ir.pricing.host import host_work_s, optimizer_step_s
from dapple_ir.pricing.pipeline import in_flight, no_later, raises_warmup, stage_step
from dapple_ir.pricing.traffic import cut_crossings, cut_s

#: Card links (two per card) up to which the DP carries every card's load, exact for the card floor:
#: DAPPLE's 2x8 (4) and 16x1 (32) clusters; beyond, a tuple per entry would slow the DP down.
EXACT_CARDS = 32


def replica_choices(cluster: ClusterSpec) -> list[int]:
    """Replica counts a stage may take: all on small clusters, else powers of two and whole nodes,
    in units that keep the device dimension of the search near 32 positions."""
    n = cluster.num_devices
    if n <= 16:
        return list(range(1, n + 1))
    unit, positions = 1, 64 if n <= 256 else 32
    while n // unit > positions:
        unit *= 2
    choices = {r for r in (unit * 2**k for k in range(20)) if r <= n}
    if cluster.nodes <= 4 and cluster.devices_per_node > 1:
        per = cluster.devices_per_node
        choices |= {per * k for k in range(1, cluster.nodes + 1) if (per * k) % unit == 0}
    return sorted(choices)


def policies_for(cluster: ClusterSpec, policies: tuple[str, ...]) -> list[str]:
    """Policies that differ on this cluster (on one node, or one device a node, they all coincide)."""
    if cluster.nodes == 1 or cluster.devices_per_node == 1:
        return [policies[0]] if "append-first" not in policies else ["append-first"]
    if cluster.num_devices > 16:
        # Scattering a stage over nodes only pays on small clusters (the DP prices its cuts pessimistically).
        return [p for p in policies if p != "scatter-first"] or list(policies)
    return list(policies)


# A suffix plan: (g, h, n, alone, start, replicas, end, child, objective, loads, floor, state). g: pipeline
# time seen from its first stage; h: allreduce not hidden; n: stages; alone: its first stage lies on
# one node only, the node of the device before `start`; the first stage holds layers up to `end` on
# devices from `start`; loads: bytes per card link (a tuple), or with many cards the floor of the
# stages' own traffic (a float); floor: the card floor in seconds; objective:
# max(g + max(0, h), floor), the iteration time if the plan started here; state: its first stage's
# `stage_step` (g first).
_Entry = tuple  # plain tuples: the DP creates millions of them
_G, _H, _N, _ALONE, _START, _REPLICAS, _END, _CHILD, _OBJECTIVE, _LOADS, _FLOOR, _STATE = range(12)
# Keys as C callables: the DP sorts millions of entries.
_objective = itemgetter(_OBJECTIVE)
_order_key = itemgetter(_G, _H, _N)
_stages_of = itemgetter(_N)


def solve(problem: Problem, microbatches: int, schedule: str, policy: str, **options: Any) -> Candidate | None:
    """The best candidate for one (M, schedule, policy), or None (`solve_priced` without its objective)."""
    found = solve_priced(problem, microbatches, schedule, policy, **options)
    return found[0] if found is not None else None


def solve_priced(
    problem: Problem,
    microbatches: int,
    schedule: str,
    policy: str,
    *,
    stages: int | None = None,
    max_stages: int | None = None,
    front: int | None = 3,
    choices: list[int] | None = None,
    bound: float = math.inf,
    recompute: bool = False,
    split: bool = False,
) -> tuple[Candidate, float] | None:
    """The best candidate for one (M, schedule, policy) and the DP's own objective for it (what `evaluate` prices
    it at where the DP is exact: see the module docstring), or None when nothing fits in memory or beats `bound`
    (a stage busier than the bound cannot be part of a better plan: pruned). With `recompute`, every stage
    recomputes (`cost_model.stage_memory`): it keeps its input per microbatch in flight and one microbatch's
    activations, and its backward reruns the forward. With `split`, every replicated stage splits each microbatch
    over its replicas, at most b of them (`cost_model`: times and activations at `stage_rows`, M microbatches per
    replica, its cuts in pieces)."""
    dp = _Search(problem, microbatches, schedule, policy, stages, max_stages, front, choices, bound, recompute, split)
    entries = [e for e in dp.suffix(0, 0) if stages is None or e[_N] == stages]
    if not entries:
        return None
    best: _Entry | None = min(entries, key=_objective)
    assert best is not None
    objective = best[_OBJECTIVE]
    result: list[StageChoice] = []
    lo = 0
    while best is not None:
        result.append(StageChoice(lo, best[_END], tuple(dp.order[best[_START] : best[_START] + best[_REPLICAS]])))
        lo, best = best[_END], best[_CHILD]
    found = Candidate(tuple(result), microbatches, schedule, policy, "dp")
    if not split:
        return found, objective
    # A stage that cannot split (batch norm, an unsliceable cut beside it) takes its microbatches round
    # robin, which needs one per replica.
    flags = tuple(st.replicas in dp.split_counts and problem.can_split(st.lo, st.hi) for st in result)
    if any(st.replicas > microbatches and not f for st, f in zip(result, flags, strict=True)):
        return None
    return dataclasses.replace(found, split=flags), objective


class _Search:
    """One DP over layers x device offsets for one (M, schedule, policy): `suffix(i, d)` is the Pareto front of
    plans for layers [i, L) placed from device-order offset d. Its caches live as long as the search."""

    def __init__(
        self,
        problem: Problem,
        microbatches: int,
        schedule: str,
        policy: str,
        stages: int | None,
        max_stages: int | None,
        front: int | None,
        choices: list[int] | None,
        bound: float,
        recompute: bool,
        split: bool,
    ) -> None:
        self.problem, self.m, self.schedule, self.policy = problem, microbatches, schedule, policy
        self.front, self.bound, self.recompute, self.split = front, bound, recompute, split
        cluster = self.cluster = problem.cluster
        self.total, self.layers = cluster.num_devices, problem.layers
        self.order = device_order(cluster, policy)
        self.node = [cluster.node_of(d) for d in self.order]
        self.b = problem.microbatch_size(microbatches)
        self.cut_scale = self.b / problem.batch
        self.replicas = choices or replica_choices(cluster)
        self.split_counts = {r for r in self.replicas if split and 1 < r <= self.b}
        self.limit = stages or max_stages or self.layers
        self.capacity = [problem.capacity(x) for x in range(self.total)]
        self.zb = schedule == "zb-h1"
        self.exact_n = stages is not None
        network = problem.network
        self.card_index = {link: k for k, link in enumerate(network.card_links)}
        self.inverse = [1.0 / network.links[link].bandwidth for link in network.card_links]
        self.vector = len(self.card_index) <= EXACT_CARDS
        self.empty_loads: tuple[float, ...] | float = (0.0,) * len(self.card_index) if self.vector else 0.0
        self.by_placement = front is None and self.vector and bool(self.card_index)
        self.group = cache(self._group)
        self.kinds = cache(self._kinds)
        self.kind_by_name = {kind.name: kind for kind in cluster.node_kinds}
        self.overheads = cache(self._overheads)
        self.cut_cards = cache(self._cut_cards)
        self.split_cut = cache(self._split_cut)
        self.message_terms = cache(self._message_terms)
        self.spans_from = cache(self._spans_from)
        self.suffix = cache(self._suffix)

    def on_cards(self, crossings: Mapping[int, float]) -> tuple[tuple[int, float], ...]:
        index = self.card_index
        return tuple((index[link], float(count)) for link, count in crossings.items() if link in index)

    def _group(self, start: int, r: int) -> tuple[bool, float, float, float, tuple[tuple[int, float], ...], float]:
        """A replica group's facts: on one node?, memory, allreduce seconds per byte (links and hosts) and
        latency (`pricing.collectives`), the ring's steps on each card, and the busiest card's seconds per
        byte of a step."""
        devices = self.order[start : start + r]
        single = len({self.node[k] for k in range(start, start + r)}) == 1
        memory = min(self.capacity[x] for x in devices)
        if r == 1:
            return single, memory, 0.0, 0.0, (), 0.0
        ring = self.problem.ring(devices)
        cards = self.on_cards(ring.crossings)
        peak = max((count * self.inverse[k] for k, count in cards), default=0.0)
        return single, memory, ring.per_byte_s, ring.fixed_s, cards, peak

    def _kinds(self, start: int, r: int) -> tuple[str, ...]:
        """The names of the distinct device kinds of a replica group (a stage's time is its slowest kind's)."""
        return tuple(sorted({self.cluster.device(d).name for d in self.order[start : start + r]}))

    def _overheads(self, kinds: tuple[str, ...], i: int, j: int) -> tuple[float, float, float]:
        """(forward, backward extra, optimizer step) of a stage of layers [i, j) on a group of `kinds` beyond its
        ops: the host's work per instruction and message, zb-h1's split backward, and the step, at the slowest kind
        (as `Problem.host_s`, `split_s` and `optimizer_s` price them). Cached by kinds, not placement: a cluster of
        one kind asks for each layer range once."""
        problem = self.problem
        group_kinds = [self.kind_by_name[name] for name in kinds]
        messages = (i > 0) + (j < self.layers)
        fwd = max(host_work_s(k, 1, messages) for k in group_kinds)
        bwd = max(host_work_s(k, 1 + self.zb, messages) for k in group_kinds)
        if self.zb:
            ops, nbytes = problem.split_work(i, j)
            bwd += max(k.split_s(ops, nbytes) for k in group_kinds)
        grads = problem.grads_of(i, j)
        step = max(optimizer_step_s(k, grads, problem.state_factor) for k in group_kinds)
        return fwd, bwd, step

    def _cut_cards(self, start: int, r: int, child_start: int, child_r: int) -> tuple[tuple[int, float], ...]:
        """The cut's transfers (activations and gradients) on each card, per byte of one microbatch."""
        a, b = self.order[start : start + r], self.order[child_start : child_start + child_r]
        spanned = {self.node[k] for k in (*range(start, start + r), *range(child_start, child_start + child_r))}
        if not self.vector or len(spanned) == 1:
            return ()
        both = (r in self.split_counts, child_r in self.split_counts)
        return self.on_cards(cut_crossings(self.problem.network, a, b, self.m, both, self.b))

    def _split_cut(self, start: int, r: int, child_start: int, child_r: int) -> tuple[float, float]:
        """A cut's seconds per byte of one microbatch and latency, sharing links with what crosses at
        once (`cut_s`, as the cost model prices it)."""
        a, b = self.order[start : start + r], self.order[child_start : child_start + child_r]
        both = (r in self.split_counts, child_r in self.split_counts)
        return cut_s(self.problem.network, a, b, both, self.b)

    def add(
        self,
        loads: tuple[float, ...] | float,
        floor: float,
        ring: tuple[tuple[int, float], ...],
        peak: float,
        step: float,
        cut: tuple[tuple[int, float], ...],
        x: float,
    ) -> tuple[tuple[float, ...] | float, float]:
        """A suffix's loads and floor with a stage's ring (`step` bytes a step; `peak`: its busiest
        card's seconds per byte) and the cut after it (`x` bytes a transfer) added."""
        if (not ring or step <= 0.0) and (not cut or x <= 0.0):
            return loads, floor
        if not self.vector:
            mine = step * peak
            return (mine if mine > loads else loads), (mine if mine > floor else floor)  # type: ignore[operator]
        # Loads only grow: the floor moves only on the cards this stage adds to.
        new, inverse = list(loads), self.inverse  # type: ignore[arg-type]
        for k, count in ring:
            new[k] += count * step
            floor = max(floor, new[k] * inverse[k])
        for k, count in cut:
            new[k] += count * x
            floor = max(floor, new[k] * inverse[k])
        return tuple(new), floor

    def crossing(
        self, start: int, r: int, split_here: bool, fwd: float, j: int, child: _Entry
    ) -> tuple[float, float, float]:
        """(c, l, its rendezvous) of the cut after layer j - 1 from devices [start, start + r) into `child`: its
        transfer over the links it shares with what crosses at once (`cost_model.cut_transfer`), how late the child's
        last round-robin replica starts (`stagger_s`), and a message's time from a late receive's post
        (`cost_model.message_s`)."""
        nxt, nxt_split = child[_REPLICAS], child[_REPLICAS] in self.split_counts
        x = self.problem.cut_bytes[j - 1] * self.cut_scale
        if self.vector or split_here or nxt_split:
            per_byte, lat = self.split_cut(start, r, child[_START], nxt)
            c = lat + x * per_byte if x > 0.0 and per_byte > 0.0 else 0.0
        else:
            # Many cards, neither side split: the one link the placement uses (a leave-out, module docstring).
            one_node = self.node[start] == self.node[child[_START]] == self.node[child[_START] + nxt - 1]
            c = (self.cluster.intra if one_node else self.cluster.inter).transfer_s(x)
        exposed = self.message(start, r, child[_START], nxt, x) if c > 0.0 else 0.0
        return c, stagger_s(fwd, r, split_here, nxt, nxt_split, self.m), exposed

    def message(self, start: int, r: int, child_start: int, child_r: int, x: float) -> float:
        """`cost_model.message_s` of the cut from devices [start, start + r) to the child's, `x` bytes."""
        fixed, per_byte = self.message_terms(start, r, child_start, child_r)
        return fixed + x * per_byte if x > 0 else 0.0

    def _message_terms(self, start: int, r: int, child_start: int, child_r: int) -> tuple[float, float]:
        a, b = self.order[start : start + r], self.order[child_start : child_start + child_r]
        return message_terms(self.cluster, a, b, (r in self.split_counts, child_r in self.split_counts))

    def _spans_from(self, i: int, rows: int) -> list[tuple[float, float, float, float, float]]:
        """(F, B, static, activations, gradients) of layers [i, j) for each j, times at `rows` samples, each
        parameter counted once (`Problem.static_of`, `grads_of`)."""
        problem, pa = self.problem, self.problem.pa
        rerun = 1.0 if self.recompute else 0.0
        pf, pb = problem.times_at(rows)  # fixed parts included
        return [
            (
                pf[j] - pf[i],
                pb[j] - pb[i] + rerun * (pf[j] - pf[i]),
                problem.static_of(i, j),
                pa[j] - pa[i],
                problem.grads_of(i, j),
            )
            for j in range(i + 1, self.layers + 1)
        ]

    def _suffix(self, i: int, d: int) -> tuple[_Entry, ...]:
        found: list[_Entry] = []
        for r in self.replicas:
            start = stage_start(self.cluster, self.policy, d, r)
            # A round-robin replica needs a microbatch, a split one a sample of each.
            if start + r > self.total or r > (self.b if self.split else self.m):
                continue
            self.stage_entries(i, d, r, start, found)
        return _prune(found, exact_n=self.exact_n, front=self.front, by_placement=self.by_placement)

    def stage_entries(self, i: int, d: int, r: int, start: int, found: list[_Entry]) -> None:
        """Every entry whose first stage is layers [i, j) on r replicas from `start`, appended to `found`."""
        problem, m, schedule = self.problem, self.m, self.schedule
        split_here = r in self.split_counts
        rows = stage_rows(self.b, r, split_here)
        act_scale = rows / problem.cost_batch
        # Bytes held per microbatch in flight: the activations, or with recompute the stage's input.
        kept_input = problem.cut_bytes[i - 1] * rows / problem.batch if self.recompute and i > 0 else 0.0
        single, cap, ar_bw, ar_lat, ring, peak = self.group(start, r)
        alone = single and d > 0 and self.node[d - 1] == self.node[start]
        per = m if split_here else -(-m // r)
        ring_factor = ring_step_bytes(1.0, r)
        kinds, overheads = self.kinds(start, r), self.overheads
        for j, (fwd, bwd, static, a_sum, grads) in enumerate(self.spans_from(i, rows), start=i + 1):
            host_f, host_b, opt = overheads(kinds, i, j)
            fwd, bwd = fwd + host_f, bwd + host_b
            busy = per * (fwd + bwd)
            if static > cap or busy > self.bound:
                break
            ar = (grads * ar_bw + ar_lat if r > 1 and grads > 0 else 0.0) + opt
            step = grads * ring_factor
            act = a_sum * act_scale
            # One checkpoint segment's activations live at once (recompute), each microbatch in flight keeps its
            # input and checkpoints; otherwise each keeps `act`.
            if self.recompute:
                static += problem.rerun_bytes(i, j, rows)
                act = kept_input + problem.checkpoint_bytes(i, j, rows)
            if j == self.layers:
                if static + in_flight(schedule, 1, per) * act <= cap:
                    loads, floor = self.add(self.empty_loads, 0.0, ring, peak, step, (), 0.0)
                    state = stage_step(schedule, busy, fwd, bwd, 0.0, 0.0, in_flight(schedule, 1, per), per, None)
                    g = state[0]
                    objective = max(floor, g + ar if ar > 0.0 else g)
                    found.append((g, ar, 1, alone, start, r, j, None, objective, loads, floor, state))
                continue
            runs = 1 if split_here else r
            for child in self.suffix(j, start + r):
                n = child[_N] + 1
                warm = in_flight(schedule, n, per)
                if n > self.limit or static + warm * act > cap:
                    continue
                child_runs = 1 if child[_REPLICAS] in self.split_counts else child[_REPLICAS]
                if raises_warmup(schedule, runs, child_runs, child[_N], m):
                    continue  # this stage would warm up for the next one's replicas (a leave-out, module docstring)
                c, late, exposed = self.crossing(start, r, split_here, fwd, j, child)
                state = stage_step(schedule, busy, fwd, bwd, c, late, warm, per, child[_STATE], exposed)
                g = state[0]
                if g > self.bound:
                    continue
                h = max(ar, child[_H] - (bwd + c))
                if self.vector:
                    cut = self.cut_cards(start, r, child[_START], child[_REPLICAS])
                    x = problem.cut_bytes[j - 1] * self.cut_scale
                    loads, floor = self.add(child[_LOADS], child[_FLOOR], ring, peak, step, cut, x)
                else:
                    floor = max(child[_FLOOR], step * peak)
                    loads = floor
                objective = max(floor, g + h if h > 0.0 else g)
                found.append((g, h, n, alone, start, r, j, child, objective, loads, floor, state))


def _prune(entries: list[_Entry], *, exact_n: bool, front: int | None, by_placement: bool) -> tuple[_Entry, ...]:
    """The Pareto front in (g, h, n, loads) per (alone[, n]) class, and per placement of the first
    stage when `by_placement` (the cut before it adds to its cards). With `front`, only the best
    4 x front entries by objective are considered and `front` of them kept, plus the one with fewest
    stages (the lightest on memory for the stages before it)."""
    groups: dict[tuple[bool, int, int, int], list[_Entry]] = {}
    for e in entries:
        placed = (e[_START], e[_REPLICAS]) if by_placement else (0, 0)
        # Exact fronts keep stage counts apart: more stages after a stage let it run more forwards before its
        # first backward (`in_flight`), which can shorten its wait for the first gradient.
        key = (e[_ALONE], e[_N] if exact_n or front is None else 0, *placed)
        members = groups.get(key)
        if members is None:
            groups[key] = [e]
        else:
            members.append(e)
    result: list[_Entry] = []
    for members in groups.values():
        # Stable sorts throughout: among equal keys the earlier entry wins, as in heapq.nsmallest.
        pool = members if front is None else sorted(members, key=_objective)[: 4 * front]
        pool.sort(key=_order_key)
        kept: list[_Entry] = []
        for e in pool:
            h, n, loads, state = e[_H], e[_N], e[_LOADS], e[_STATE]
            for k in kept:
                if k[_H] <= h and k[_N] <= n and no_later(k[_STATE], state) and _lighter(k[_LOADS], loads):
                    break
            else:
                kept.append(e)
        if front is not None:
            kept = sorted(kept, key=_objective)[:front]
            least = min(map(_stages_of, members))
            if all(k[_N] > least for k in kept):
                kept.append(min((e for e in members if e[_N] == least), key=_objective))
        result.extend(kept)
    return tuple(result)


def _lighter(a: tuple[float, ...] | float, b: tuple[float, ...] | float) -> bool:
    """Whether loads `a` are nowhere above `b` (card by card, or as floors)."""
    if isinstance(a, tuple):
        return all(x <= y for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    return a <= b  # type: ignore[operator]


def plan_dp(
    problem: Problem,
    *,
    microbatches: list[int],
    schedules: list[str],
    policies: list[str],
    stages: int | None = None,
    front: int | None = 3,
    choices: list[int] | None = None,
    bound: float = math.inf,
    slack: float = 1.1,
    recompute: bool = False,
    split: bool = False,
) -> list[tuple[Candidate, Estimate]]:
    """The DP's best candidate for every (M, schedule, policy), evaluated and sorted, fitting ones first
    (`split`: replicated stages split each microbatch, see `solve`).

    `bound` (an iteration time some plan reaches, e.g. the best baseline's) prunes the search; each
    plan found tightens it to `slack` times its time, so near-best alternatives survive for ranking.
    """
    results: list[tuple[Candidate, Estimate]] = []
    # Every policy at the largest microbatch count, then only the best policy so far at the others.
    best_policy: str | None = None
    for m in sorted(microbatches, reverse=True):
        if problem.global_batch % m:
            raise PlanError(f"global batch {problem.global_batch} is not divisible into {m} microbatches")
        for schedule in schedules:
            for policy in policies if best_policy is None else [best_policy]:
                cand = solve(
                    problem,
                    m,
                    schedule,
                    policy,
                    stages=stages,
                    front=front,
                    choices=choices,
                    bound=bound,
                    recompute=recompute,
                    split=split,
                )
                if cand is None:
                    continue
                if recompute:
                    cand = dataclasses.replace(cand, recompute=(True,) * len(cand.stages))
                estimate = evaluate(problem, cand)
                results.append((cand, estimate))
                if estimate.fits and estimate.iteration_s * slack <= bound:
                    bound = estimate.iteration_s * slack
                    best_policy = policy
    results.sort(key=lambda ce: (not ce[1].fits, ce[1].iteration_s))
    return results


def replicated_pipelines(
    problem: Problem,
    *,
    microbatches: list[int],
    schedule: str,
    front: int | None = 3,
    bound: float = math.inf,
    recompute: bool = False,
) -> list[tuple[Candidate, Estimate]]:
    """For large clusters: plan one pipeline on N/P devices (whole nodes, at most 64 devices) with the
    DP, then copy it P times. Replica j of a stage belongs to copy j % P, so that microbatch m stays
    in copy m % P through every stage (round robin), and each copy keeps its own node-local cuts."""
    cluster = problem.cluster
    n, per = cluster.num_devices, cluster.devices_per_node
    results = []
    copies = 2
    while copies <= n // per:
        sub_devices = n // copies
        if n % copies or sub_devices % per or problem.global_batch % copies:
            copies *= 2
            continue
        if sub_devices <= 32:
            sub = dataclasses.replace(cluster, node_kinds=cluster.node_kinds[: sub_devices // per])
            trial = dataclasses.replace(problem, cluster=sub, global_batch=problem.global_batch // copies)
            ms = [m // copies for m in microbatches if m % copies == 0 and trial.global_batch % (m // copies) == 0]
            for cand, _est in plan_dp(
                trial,
                microbatches=ms or [1],
                schedules=[schedule],
                policies=["append-first"],
                front=front,
                bound=bound,
                recompute=recompute,
            ):
                merged = _copy(cand, copies, sub_devices)
                results.append((merged, evaluate(problem, merged)))
        copies *= 2
    results.sort(key=lambda ce: (not ce[1].fits, ce[1].iteration_s))
    return results


def _copy(cand: Candidate, copies: int, sub_devices: int) -> Candidate:
    stages = []
    for st in cand.stages:
        devices = tuple(st.devices[j // copies] + (j % copies) * sub_devices for j in range(st.replicas * copies))
        stages.append(StageChoice(st.lo, st.hi, devices))
    return Candidate(
        tuple(stages),
        cand.microbatches * copies,
        cand.schedule,
        cand.policy,
        f"dp x{copies} copies",
        recompute=cand.recompute,
    )


def lower_bound_devices(problem: Problem) -> int:
    """Fewest devices whose memory could hold the static state at all (for 'does not fit' hints)."""
    cap = problem.capacity(0)
    return max(1, math.ceil(problem.ps[-1] / cap))
