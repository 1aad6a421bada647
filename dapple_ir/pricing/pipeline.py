"""One stage of the pipeline recursion, and the activations a schedule keeps in flight: the formulas the cost
model evaluates and the DP and ILP optimise (the ILP writes `stage_step` as linear lower bounds).

The recursion runs from the last stage to the first. For stage s, with the stage after it already priced
as (G', R'):

    busy  = per-replica microbatches x (F + B)             its work (host work, recompute, split included)
    warm  = microbatches in flight (`in_flight`)            forwards it runs before its first backward
    X     = max(warm F, F + 2c + R')                        when its first backward can start, from its first input
    stall = X - warm F                                      waiting in the warm-up for the first gradient
          + max(0, 2c + R' - (warm - 1) back B)             waiting before its last backward (1f1b, M > warm)
    loop  = per-replica microbatches / warm x (F + 2c + R' + B)   at most `warm` round trips at once
    G     = max(busy + stall, loop, share (F + B) + 2c + l + G')  the pipeline seen from stage s
    R     = X + back B                                      its first microbatch's round trip (back: the
                                                            share of B on the way back; zb-h1 defers weights)

The last stage has G = busy and R = F + back B. The stagger l (how much later the next stage's last replica gets its
first microbatch) delays that replica's work, G', and no round trip: the first microbatch goes to the first replica,
and each later one to a replica that has started. A round trip of the loop takes the whole backward: zb-h1 hands the
input gradient back after its input pass, but a stage runs that microbatch's weight pass before its next forward.
Priced with l in every round trip and the loop at the input pass, 1f1b and zb-h1 with one replica feeding two were up
to 18 % over and 22 % under the simulation.

A message whose receive is posted after its send takes W from the post: a latency for the ready notice to go back,
then the message's own transfer, alone on the slowest link it crosses (`rendezvous_s`, `cost_model.message_s`: a
receiver has about one message in flight, so not the cut's c, which prices R replicas' microbatches side by side).
The runtime posts a receive one compute ahead of the one that needs it. Past its
warm-up a stage posts each gradient's receive before the forward ahead of that backward, and each input's before the
backward ahead of that forward; a stage that is behind waits W - F, or W - B, for each (steady = per-replica
microbatches - warm of them). So the stage's busy time becomes busy + steady max(0, W - F) with the cut after it, and
the stage before, which knows the cut between them, adds G >= share (F + B) + 2c + l + busy' + steady' max(0, W - B')
for the next stage's waits for inputs (the state carries steady' and busy' - steady' B', which that price grows with,
so the DP's fronts stay exact). With W under every compute (a GPU, or a
quiet CPU calibration's tens of microseconds) nothing changes; with the 4 ms a loaded VM's calibration measured, the
GPT example's estimate went from 18-28 % under the simulation to within 7 % on every cut. gpipe leaves it out.
A stage's state is (G, R, steady, busy - steady B); gpipe's carries its two phases instead.

GPipe runs every forward, then every backward: two flow shops of identical jobs, one per direction. The forward phase
ends with the last stage's last forward, Qf after the first forward starts, and the backward phase takes Qb from
there to the first stage's last backward; G = Qf + Qb. Over the stages from s on, with Pf and Pb one microbatch's
path forward and back (cuts included) and per the stage's microbatches per replica:

    Qf = max(per F + c + Pf', F + c + l + Qf')    the slowest stage's forwards, the path before and after them
    Qb = max(Pb' + c + per B, Qb' + c + B)
    Pf = F + c + Pf',  Pb = B + c + Pb',  R = Pf + Pb

which is Σ(F + B) + (M - 1)(max F + max B) on one replica a stage with free links: where the slowest forward and the
slowest backward sit on different stages, more than any one stage's recursion sees (seed 287600, two stages of two
replicas at M = 32: 72.3 ms for the simulator's 86.5 before).

With equal stages and free links the recursion gives the closed forms (M + S - 1)(F + B) of GPipe and 1F1B; with
uneven ones it sees the bottleneck stage wait for a slower round trip behind it, which DAPPLE's bound
max(busy, path + G') misses (a GPT cut on two CPU ranks: the bound chose a cut whose simulation ran 16 % longer than it
predicted), and a stage whose few microbatches in flight cannot cover the round trip through replicated stages behind
it (four equal layers on 4 V100s cut 1, 1, 2 x 2: the bound said 138 ms, the simulator 197 ms).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dapple_ir.ir import InstrKind
from dapple_ir.schedules import ScheduleRequest, StageMemory, build_schedule, warmups, zb_splits

#: Share of a stage's compute on the first microbatch's path through the pipeline: zb-h1 defers the weight
#: gradient (about half the backward) into bubbles, interleaving halves each virtual stage.
PATH_SHARE = {"gpipe": 1.0, "1f1b": 1.0, "zb-h1": 0.75, "interleaved": 0.5}

#: Share of a stage's backward on the way back of a microbatch's round trip: zb-h1 hands the input gradient
#: back after the input pass (half the backward, `sim.simulator.BACKWARD_INPUT_FRACTION`).
BACK_SHARE = {"zb-h1": 0.5}


def in_flight(schedule: str, stages_after: int, per_replica: int) -> int:
    """Microbatches whose activations a replica holds at once, and the forwards it runs before its first
    backward; `stages_after` counts itself. GPipe runs them all; 1F1B (and zb-h1) DAPPLE's early backward,
    min(S - s, M). Interleaved: twice 1F1B's, a count per stage for where one is priced alone (memory advice, a
    one-chunk interleaved candidate); the estimate of a V-chunk plan walks the order instead (`interleaved_held`).
    The two disagree: with one chunk per group the order holds min(M, 2 (S - s) - 1), one fewer than this rule, and
    all M where M = P R (Megatron's all-forward warm-up), more than this rule on the later stages. Checked against
    the orders the schedules build (`tests/test_pricing.py`): exact for gpipe, and for 1f1b wherever each replica
    keeps S - s in flight (`schedules.warmups`); where a later stage's replicas need more, which more replicas after
    fewer cause, the stage warms up with what they need and a replica holds more (`replica_in_flight`); zb-h1 stays
    within 1f1b's fullest rank."""
    if schedule == "gpipe":
        return per_replica
    if schedule == "interleaved":
        return min(per_replica, 2 * stages_after)
    return min(per_replica, stages_after)


def interleaved_held(
    replicas: Sequence[int], microbatches: int, virtual: int, groups: int, act: Sequence[float]
) -> list[float]:
    """Per device group, the most activation bytes a replica holds at once under the interleaved order: forwards
    done whose backward has not run yet, each stage's at its own size (`act`, one microbatch), walked on the order
    the schedule builds. The busiest replica of a group (replica 0) runs the order restricted to its share. With
    equal chunks it is never below 1f1b's `in_flight` on the same groups (`tests/test_pricing.py`)."""
    orders = build_schedule("interleaved", ScheduleRequest(tuple(replicas), microbatches, virtual))
    held = []
    for g in range(groups):
        live, peak = 0.0, 0.0
        for work in orders[(g, 0)]:
            live += act[work.stage] if work.kind is InstrKind.FORWARD else -act[work.stage]
            peak = max(peak, live)
        held.append(peak)
    return held


def replica_in_flight(schedule: str, replicas: Sequence[int], split: Sequence[bool], microbatches: int) -> list[int]:
    """Per stage, the microbatches a replica holds at once in the order the schedule builds: `in_flight`, except
    where a later stage's replicas need more than this stage's own S - s (1f1b and zb-h1, `schedules.warmups`: more
    replicas after fewer): the stage then warms up with the W they need, and its busiest replica holds ceil(W / R)."""
    stages = len(replicas)
    per = [microbatches if sp else -(-microbatches // r) for r, sp in zip(replicas, split, strict=True)]
    rule = [in_flight(schedule, stages - s, per[s]) for s in range(stages)]
    if schedule not in ("1f1b", "zb-h1"):
        return rule
    runs = tuple(1 if sp else r for r, sp in zip(replicas, split, strict=True))
    group = warmups(ScheduleRequest(runs, microbatches))
    return [min(per[s], -(-group[s] // runs[s])) for s in range(stages)]


def split_backwards(replicas: Sequence[int], microbatches: int, memory: Sequence[StageMemory]) -> list[bool]:
    """Per stage, does zb-h1's order (`schedules.zb_splits`, its stages weighed by `memory`, replicas as the schedule
    sees them: 1 for a split stage) split its backward into an input and a weight pass? A stage whose split would
    hold more than 1f1b's fullest rank runs whole backwards, as 1f1b does. Where no stage keeps anything from its
    input pass to its weight pass, splitting with no weight pass deferred holds what 1f1b does: every stage splits.
    Checked against the orders the schedule builds (`tests/test_pricing.py`)."""
    if all(m.weight_pass <= 0 and m.rerun <= 0 for m in memory):
        return [True] * len(replicas)
    # Past the warm-ups each replica's order repeats every `period` microbatches, and so does what it holds: fewer
    # periods (as many microbatches modulo it) peak alike, and order in a fraction of the time.
    period = math.lcm(*replicas)
    enough = len(replicas) * max(replicas) + 2 * period
    if microbatches > enough:
        microbatches -= (microbatches - enough) // period * period
    return zb_splits(ScheduleRequest(tuple(replicas), microbatches, 1, tuple(memory)))


def raises_warmup(schedule: str, before: int, after: int, stages_after: int, microbatches: int) -> bool:
    """Would a stage running `before` replicas' worth of microbatches (1 where split) ahead of one running `after`,
    with `stages_after` stages from that one on, warm up with more than its own S - s to feed the later one
    (`schedules.warmups`)?"""
    if schedule not in ("1f1b", "zb-h1"):
        return False
    return min((stages_after + 1) * before, microbatches) < min(stages_after * after, microbatches)


def raised_warmups(schedule: str, replicas: Sequence[int], split: Sequence[bool], microbatches: int) -> bool:
    """Does some stage warm up with more than its own S - s to feed the next one's replicas (`raises_warmup`)? The DP
    and the ILP search only plans where none does; `replica_in_flight` prices the others."""
    runs = [1 if sp else r for r, sp in zip(replicas, split, strict=True)]
    stages = len(runs)
    return any(raises_warmup(schedule, runs[k], runs[k + 1], stages - k - 1, microbatches) for k in range(stages - 1))


def stage_step(
    schedule: str,
    busy: float,
    fwd: float,
    bwd: float,
    cut: float,
    late: float,
    warm: int,
    per_replica: int,
    after: tuple[float, ...] | None,
    exposed: float = 0.0,
) -> tuple[float, ...]:
    """The state of a stage (see the module docstring): (G, R, steady, busy - steady B) (its microbatches past the
    warm-up, and its work with its waits for gradients less their backwards: for the stage before to add its waits for
    inputs), gpipe's (G, R, Qf, Qb, Pf, Pb); `busy` its replica's work, `fwd`/`bwd` one microbatch's forward and
    backward, `cut` the transfer over the cut after it, `late` how much later the next stage's last replica starts
    (`stagger_s`), `warm` its microbatches in flight, `after` the next stage's state (None: the last stage), `exposed`
    a message's time over the cut after it from its receive's post (`rendezvous_s`). A state is no worse than another
    where it is nowhere larger (`no_later`)."""
    if schedule == "gpipe":
        return _gpipe_step(fwd, bwd, cut, late, per_replica, after)
    back = bwd * BACK_SHARE.get(schedule, 1.0)
    # Past the warm-up each gradient's receive is posted before the forward ahead of its backward: that forward hides
    # it, or the backward waits (the warm-up's first and the drain's are the stall's below).
    steady = max(0, per_replica - warm)
    own = busy if exposed <= fwd else busy + steady * (exposed - fwd)
    if after is None:
        return own, fwd + back, steady, own - steady * bwd
    g_next, r_next, steady_next, unhidden_next = after
    trip = 2 * cut + r_next
    x = max(warm * fwd, fwd + trip)
    stall = x - warm * fwd
    if schedule != "zb-h1" and per_replica > warm:
        # zb-h1 fills this wait with the weight passes it deferred.
        stall += max(0.0, trip - (warm - 1) * back)
    # With `warm` microbatches in flight, each takes its forward, its round trip behind and its whole backward (zb-h1's
    # weight pass too) before the next may start: no faster than `warm` of them per F + trip + B.
    loop = per_replica / warm * (fwd + trip + bwd)
    path = PATH_SHARE.get(schedule, 1.0) * (fwd + bwd) + 2 * cut + late
    g = max(own + stall, loop, path + g_next)
    if steady_next and exposed > 0.0:
        # Past its warm-up the next stage posts each input's receive before the backward ahead of its forward, which
        # waits for it where W > B': busy' + steady' (W - B'), written with unhidden' = busy' - steady' B' so that the
        # state grows with the price (below busy' + path <= G where W <= B').
        g = max(g, path + unhidden_next + steady_next * exposed)
    return g, x + back, steady, own - steady * bwd


def rendezvous_s(cut: float, latency: float) -> float:
    """A message's time over a cut from its receive's post, where its send came first: the ready notice's way to the
    sender (a latency), then the message's transfer (`cut`, its own latency in it); 0 for a message of no bytes. Both
    transports rendezvous (`sim.simulator`), and the runtime posts a receive one compute ahead of the one that needs
    it (`lowering.early_post_points`), so a stage that is behind waits max(0, this - that compute) for each."""
    return cut + latency if cut > 0.0 else 0.0


def _gpipe_step(
    fwd: float, bwd: float, cut: float, late: float, per: int, after: tuple[float, ...] | None
) -> tuple[float, float, float, float, float, float]:
    """gpipe's (G, R, Qf, Qb, Pf, Pb) of a stage (the module docstring)."""
    if after is None:
        qf, qb, pf, pb = per * fwd, per * bwd, fwd, bwd
        return qf + qb, pf + pb, qf, qb, pf, pb
    _g, _r, qf_next, qb_next, pf_next, pb_next = after
    qf = max(per * fwd + cut + pf_next, fwd + cut + late + qf_next)
    qb = max(pb_next + cut + per * bwd, qb_next + cut + bwd)
    pf, pb = fwd + cut + pf_next, bwd + cut + pb_next
    return qf + qb, pf + pb, qf, qb, pf, pb


def no_later(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """Is stage state `a` nowhere above `b` (`stage_step`)? Every stage before one prices no later from `a`."""
    return all(x <= y for x, y in zip(a, b, strict=True))
