"""Dynamic programming over layers × devices: cuts, replica counts and placement, exact for the
cost model of `cost_model.evaluate` when the Pareto fronts are not capped.

The recursion runs from the last stage to the first (see `cost_model`): the suffix of layers
[i, L) placed from device-order offset d has a Pareto front of (G, H, n, loads) — pipeline time
seen from its first stage, unhidden allreduce, stage count, and the bytes its cuts and allreduces
push through each network card — and whether its first stage sits alone on the node the previous
stage would end on (which decides the link of the cut before it). G, H and every card's load grow
monotonically with the suffix's, so the front is all a predecessor needs; the card floor is the
busiest card's load over its bandwidth. The cut before the suffix adds to the cards of the suffix's
first stage, so with uncapped fronts entries are kept apart by where that stage lies.

Clusters with more than `EXACT_CARDS` card links carry only the floor of each stage's own allreduce,
a lower bound that stays cheap on a thousand devices: the cost model, which counts every cut, then
ranks what the DP finds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from functools import cache
from operator import itemgetter

from dapple_ir.cluster.spec import ClusterSpec
from dapple_ir.errors import PlanError
from dapple_ir.planner.cost_model import (
    _PATH_SHARE,
    Candidate,
    Estimate,
    Problem,
    StageChoice,
    device_order,
    evaluate,
    stage_rows,
    stage_start,
    stagger_s,
)
from dapple_ir.planner.traffic import cut_crossings, cut_s, ring_crossings, ring_step_bytes

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


# A suffix plan: (g, h, n, alone, start, replicas, end, child, objective, loads, floor). g: pipeline
# time seen from its first stage; h: allreduce not hidden; n: stages; alone: its first stage lies on
# one node only, the node of the device before `start`; the first stage holds layers up to `end` on
# devices from `start`; loads: bytes per card link (a tuple), or with many cards the floor of the
# stages' own traffic (a float); floor: the card floor in seconds; objective:
# max(g + max(0, h), floor), the iteration time if the plan started here.
_Entry = tuple  # plain tuples: the DP creates millions of them
_G, _H, _N, _ALONE, _START, _REPLICAS, _END, _CHILD, _OBJECTIVE, _LOADS, _FLOOR = range(11)
# Keys as C callables: the DP sorts millions of entries.
_objective = itemgetter(_OBJECTIVE)
_order_key = itemgetter(_G, _H, _N)
_stages_of = itemgetter(_N)


def solve(
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
) -> Candidate | None:
    """The best candidate for one (M, schedule, policy), or None when nothing fits in memory or
    beats `bound` (a stage busier than the bound cannot be part of a better plan: pruned). With
    `recompute`, every stage recomputes (`cost_model.stage_memory`): it keeps its input per microbatch
    in flight and one microbatch's activations, and its backward reruns the forward. With `split`,
    every replicated stage splits each microbatch over its replicas, at most b of them (`cost_model`:
    times and activations at `stage_rows`, M microbatches per replica, its cuts in pieces)."""
    cluster = problem.cluster
    total = cluster.num_devices
    layers = problem.layers
    order = device_order(cluster, policy)
    node = [cluster.node_of(d) for d in order]
    b = problem.microbatch_size(microbatches)
    share = _PATH_SHARE.get(schedule, 1.0)
    cut_scale = b / problem.batch
    replicas = choices or replica_choices(cluster)
    split_counts = {r for r in replicas if split and 1 < r <= b}
    limit = stages or max_stages or layers
    pa, ps, pg = problem.pa, problem.ps, problem.pg
    capacity = [problem.capacity(x) for x in range(total)]

    gpipe, interleaved = schedule == "gpipe", schedule == "interleaved"
    cut_bytes = problem.cut_bytes
    intra, inter = cluster.intra, cluster.inter
    exact_n = stages is not None
    network = problem.network
    card_index = {link: k for k, link in enumerate(network.card_links)}
    inverse = [1.0 / network.links[link].bandwidth for link in network.card_links]
    vector = len(card_index) <= EXACT_CARDS
    none: tuple[tuple[int, float], ...] = ()
    empty_loads: tuple[float, ...] | float = (0.0,) * len(card_index) if vector else 0.0
    by_placement = front is None and vector and bool(card_index)

    def on_cards(crossings: Mapping[int, float]) -> tuple[tuple[int, float], ...]:
        return tuple((card_index[link], float(count)) for link, count in crossings.items() if link in card_index)

    @cache
    def group(start: int, r: int) -> tuple[bool, float, float, float, tuple[tuple[int, float], ...], float]:
        """A replica group's facts: on one node?, memory, allreduce seconds per byte and latency, the
        ring's steps on each card, and the busiest card's seconds per byte of a step."""
        devices = order[start : start + r]
        single = len({node[k] for k in range(start, start + r)}) == 1
        if r == 1:
            return single, min(capacity[x] for x in devices), 0.0, 0.0, none, 0.0
        slowest = max(c / network.links[k].bandwidth for k, c in network.ring_load(devices).items())
        ar_bw = ring_step_bytes(1.0, r) * slowest
        ring = on_cards(ring_crossings(network, devices))
        peak = max((count * inverse[k] for k, count in ring), default=0.0)
        return single, min(capacity[x] for x in devices), ar_bw, 2 * (r - 1) * network.ring_latency(devices), ring, peak

    @cache
    def cut_cards(start: int, r: int, child_start: int, child_r: int) -> tuple[tuple[int, float], ...]:
        """The cut's transfers (activations and gradients) on each card, per byte of one microbatch."""
        a, b = order[start : start + r], order[child_start : child_start + child_r]
        spanned = {node[k] for k in (*range(start, start + r), *range(child_start, child_start + child_r))}
        if not vector or len(spanned) == 1:
            return none
        both = (r in split_counts, child_r in split_counts)
        return on_cards(cut_crossings(network, a, b, microbatches, both, problem.microbatch_size(microbatches)))

    @cache
    def split_cut(start: int, r: int, child_start: int, child_r: int) -> tuple[float, float]:
        """A cut's seconds per byte of one microbatch and latency, sharing links with what crosses at
        once (`cut_s`); on clusters of many cards only cuts with a split side (the others: one link)."""
        a, b = order[start : start + r], order[child_start : child_start + child_r]
        both = (r in split_counts, child_r in split_counts)
        return cut_s(network, a, b, both, problem.microbatch_size(microbatches))

    def add(
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
        if not vector:
            mine = step * peak
            return (mine if mine > loads else loads), (mine if mine > floor else floor)  # type: ignore[operator]
        # Loads only grow: the floor moves only on the cards this stage adds to.
        new = list(loads)  # type: ignore[arg-type]
        for k, count in ring:
            new[k] += count * step
            if new[k] * inverse[k] > floor:
                floor = new[k] * inverse[k]
        for k, count in cut:
            new[k] += count * x
            if new[k] * inverse[k] > floor:
                floor = new[k] * inverse[k]
        return tuple(new), floor

    def crossing(
        start: int, r: int, split_here: bool, one_node: bool, fwd: float, j: int, child: _Entry
    ) -> tuple[float, float]:
        """(c, l) of the cut after layer j - 1 from devices [start, start + r) into `child`: its transfer,
        over the links it shares with what crosses at once (split sides, or every cut where the DP carries
        each card), else over the one link the placement uses (`one_node`: intra-node); and how late the
        child's last round-robin replica starts (`stagger_s`)."""
        nxt, nxt_split = child[_REPLICAS], child[_REPLICAS] in split_counts
        if vector or split_here or nxt_split:
            per_byte, lat = split_cut(start, r, child[_START], nxt)
            x = cut_bytes[j - 1] * cut_scale
            c = lat + x * per_byte if x > 0.0 and per_byte > 0.0 else 0.0
        else:
            c = c_intra_at[j - 1] if one_node else c_inter_at[j - 1]
        return c, stagger_s(fwd, r, split_here, nxt, nxt_split, microbatches)

    # Per cut: its transfer over an intra- and an inter-node link, for this microbatch size.
    c_intra_at = [intra.transfer_s(x * cut_scale) for x in cut_bytes]
    c_inter_at = [inter.transfer_s(x * cut_scale) for x in cut_bytes]

    @cache
    def spans_from(i: int, rows: int) -> list[tuple[float, float, float, float, float]]:
        """(F, B, static, activations, gradients) of layers [i, j) for each j, times at `rows` samples."""
        rerun = 1.0 if recompute else 0.0
        pf, pb = problem.times_at(rows)  # fixed parts included
        return [
            (pf[j] - pf[i], pb[j] - pb[i] + rerun * (pf[j] - pf[i]), ps[j] - ps[i], pa[j] - pa[i], pg[j] - pg[i])
            for j in range(i + 1, layers + 1)
        ]

    @cache
    def suffix(i: int, d: int) -> tuple[_Entry, ...]:
        found: list[_Entry] = []
        append = found.append
        for r in replicas:
            start = stage_start(cluster, policy, d, r)
            split_here = r in split_counts
            # A round-robin replica needs a microbatch, a split one a sample of each.
            if start + r > total or r > (b if split else microbatches):
                continue
            rows = stage_rows(b, r, split_here)
            spans = spans_from(i, rows)
            act_scale = rows / problem.cost_batch
            # Bytes held per microbatch in flight: the activations, or with recompute the stage's input.
            kept_input = cut_bytes[i - 1] * rows / problem.batch if recompute and i > 0 else 0.0
            single, cap, ar_bw, ar_lat, ring, peak = group(start, r)
            alone = single and d > 0 and node[d - 1] == node[start]
            per = microbatches if split_here else -(-microbatches // r)
            ring_factor = ring_step_bytes(1.0, r)
            for j, (f_sum, b_sum, static, a_sum, grads) in enumerate(spans, start=i + 1):
                fwd, bwd = f_sum, b_sum
                busy = per * (fwd + bwd)
                if static > cap or busy > bound:
                    break
                ar = grads * ar_bw + ar_lat if r > 1 and grads > 0 else 0.0
                step = grads * ring_factor
                act = a_sum * act_scale
                # One microbatch's activations live at once (recompute), the rest keep `act` each.
                if recompute:
                    static, act = static + act, kept_input
                if j == layers:
                    if static + (per if gpipe else min(per, 2 if interleaved else 1)) * act <= cap:
                        loads, floor = add(empty_loads, 0.0, ring, peak, step, none, 0.0)
                        h_pos = busy + ar if ar > 0.0 else busy
                        objective = floor if floor > h_pos else h_pos
                        append((busy, ar, 1, alone, start, r, j, None, objective, loads, floor))
                    continue
                x = cut_bytes[j - 1] * cut_scale
                path = share * (fwd + bwd)
                children = suffix(j, start + r)
                # Without per-card loads the floor is the stage's own ring's, or the suffix's.
                mine = step * peak
                if not vector and act >= 0.0 and static + per * act <= cap and limit > layers - j:
                    # No child can break the memory or stage limit: at most `per` microbatches are held
                    # (act >= 0 keeps the products ordered), and the suffix has at most layers - j stages.
                    for child in children:
                        c, late = crossing(start, r, split_here, single and child[_ALONE], fwd, j, child)
                        g = path + 2 * c + late + child[_G]
                        if busy > g:
                            g = busy
                        if g > bound:
                            continue
                        h = child[_H] - (bwd + c)
                        if ar > h:
                            h = ar
                        floor = child[_FLOOR]
                        if mine > floor:
                            floor = mine
                        objective = g + h if h > 0.0 else g
                        if floor > objective:
                            objective = floor
                        append((g, h, child[_N] + 1, alone, start, r, j, child, objective, floor, floor))
                    continue
                for child in children:
                    n = child[_N] + 1
                    held = (2 * n if interleaved else n) if not gpipe else per
                    if held > per:
                        held = per
                    if n > limit or static + held * act > cap:
                        continue
                    c, late = crossing(start, r, split_here, single and child[_ALONE], fwd, j, child)
                    g = path + 2 * c + late + child[_G]
                    if busy > g:
                        g = busy
                    if g > bound:
                        continue
                    h = child[_H] - (bwd + c)
                    if ar > h:
                        h = ar
                    if vector:
                        cut = cut_cards(start, r, child[_START], child[_REPLICAS])
                        loads, floor = add(child[_LOADS], child[_FLOOR], ring, peak, step, cut, x)
                    else:
                        floor = child[_FLOOR]
                        if mine > floor:
                            floor = mine
                        loads = floor
                    objective = g + h if h > 0.0 else g
                    if floor > objective:
                        objective = floor
                    append((g, h, n, alone, start, r, j, child, objective, loads, floor))
        return _prune(found, exact_n=exact_n, front=front, by_placement=by_placement)

    entries = [e for e in suffix(0, 0) if stages is None or e[_N] == stages]
    suffix.cache_clear()
    group.cache_clear()
    cut_cards.cache_clear()
    split_cut.cache_clear()
    spans_from.cache_clear()
    if not entries:
        return None
    best: _Entry | None = min(entries, key=_objective)
    result: list[StageChoice] = []
    lo = 0
    while best is not None:
        result.append(StageChoice(lo, best[_END], tuple(order[best[_START] : best[_START] + best[_REPLICAS]])))
        lo, best = best[_END], best[_CHILD]
    found = Candidate(tuple(result), microbatches, schedule, policy, "dp")
    if not split:
        return found
    # A stage that cannot split (batch norm, an unsliceable cut beside it) takes its microbatches round
    # robin, which needs one per replica.
    flags = tuple(st.replicas in split_counts and problem.can_split(st.lo, st.hi) for st in result)
    if any(st.replicas > microbatches and not f for st, f in zip(result, flags, strict=True)):
        return None
    return dataclasses.replace(found, split=flags)


def _prune(entries: list[_Entry], *, exact_n: bool, front: int | None, by_placement: bool) -> tuple[_Entry, ...]:
    """The Pareto front in (g, h, n, loads) per (alone[, n]) class, and per placement of the first
    stage when `by_placement` (the cut before it adds to its cards). With `front`, only the best
    4 x front entries by objective are considered and `front` of them kept, plus the one with fewest
    stages (the lightest on memory for the stages before it)."""
    groups: dict[tuple[bool, int, int, int], list[_Entry]] = {}
    for e in entries:
        placed = (e[_START], e[_REPLICAS]) if by_placement else (0, 0)
        key = (e[_ALONE], e[_N] if exact_n else 0, *placed)
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
            h, n, loads = e[_H], e[_N], e[_LOADS]
            for k in kept:
                if k[_H] <= h and k[_N] <= n and _lighter(k[_LOADS], loads):
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
