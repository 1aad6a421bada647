"""The `--explain` table: every candidate ranked, with its model and simulated times, peak, busiest
link and why it lost."""

from __future__ import annotations

from dapple_ir.planner.cost_model import Problem
from dapple_ir.planner.scoring import Scored
from dapple_ir.units import GB


def explain_lines(problem: Problem, chosen: Scored, ranked: list[Scored], rejected: list[Scored]) -> list[str]:
    gb = GB
    lines = [
        f"plan: {problem.layers} layers, global batch {problem.global_batch}, cluster {problem.cluster.name} "
        f"({problem.cluster.num_devices} devices); {len(ranked)} fitting candidates, {len(rejected)} rejected",
        f"{'#':>3}  {'source':<34} {'S':>3} {'replicas':<18} {'P':>3} {'policy':<13} {'M':>4} {'schedule':<8} "
        f"{'model ms':>10} {'sim ms':>10} {'peak GB':>8} {'recompute':<12} {'busiest link':<16} {'%':>3}  verdict",
    ]
    cluster = problem.cluster
    if cluster.shares_cores:
        lines.insert(
            1,
            f"each node's {cluster.devices_per_node} ranks share {cluster.cores_per_node} core(s): they take turns "
            "(simulated), and no plan is faster than its busiest node's work over its cores (the model's core "
            f"floor; the chosen plan's: {chosen.estimate.cores_s * 1e3:.3f} ms)",
        )
    # The best dozen, and every baseline as proposed (a user compares against those first).
    baselines = [s for s in ranked[12:] if s.cand.source.startswith("baseline:") and "~" not in s.cand.source]
    for k, s in enumerate([*ranked[:12], *baselines, *rejected[:8]], start=1):
        c, e = s.cand, s.estimate
        reps = c.replication()
        reps = reps if len(reps) <= 18 else reps[:15] + "..."
        # The link the plan loads most (bytes per iteration over its bandwidth), and that time's share
        # of the model's iteration: 100 % means the link alone sets the pace.
        link = e.busiest_link or "-"
        share = (
            f"{min(999, round(100 * e.busiest_s / e.iteration_s)):>3}"
            if e.busiest_link and e.iteration_s > 0
            else "  -"
        )
        sim = f"{s.simulated_s * 1e3:10.3f}" if s.simulated_s is not None else f"{'-':>10}"
        rc = c.recomputing()
        rc = rc if len(rc) <= 12 else rc[:9] + "..."
        schedule = f"{c.schedule}/v{c.virtual}" if c.virtual > 1 else c.schedule
        source = c.source if len(c.source) <= 34 else c.source[:31] + "..."
        if s is chosen:
            verdict = "CHOSEN"
        elif s.note.startswith("simulated peak"):
            verdict = f"rejected: {s.note}"
        elif not e.fits:
            worst = max(range(len(e.stage_peak_bytes)), key=lambda i: e.stage_peak_bytes[i] - e.stage_capacity[i])
            verdict = (
                f"rejected: stage {worst} needs {e.stage_peak_bytes[worst] / gb:.1f} GB > "
                f"{e.stage_capacity[worst] / gb:.1f} GB"
            )
        elif s.simulated_s is None and chosen.simulated_s is not None:
            verdict = f"lost: not among the best by the model ({e.iteration_s / chosen.estimate.iteration_s:.2f}x)"
        else:
            verdict = f"lost: {s.time_s / chosen.time_s:.2f}x the chosen time"
            if s.note:
                verdict += f" ({s.note})"
        lines.append(
            f"{k:>3}  {source:<34} {len(c.stages):>3} {reps:<18} {c.pipelines:>3} {c.policy:<13} "
            f"{c.microbatches:>4} {schedule:<8} {e.iteration_s * 1e3:10.3f} {sim} {e.peak_bytes / gb:8.2f} "
            f"{rc:<12} {link:<16} {share}  {verdict}"
        )
    cuts = ", ".join(
        f"s{k}: layers {st.lo}-{st.hi - 1} on {list(st.devices)}{' split' if chosen.cand.splits(k) else ''}"
        f"{' recomputing' if chosen.cand.recomputes(k) else ''}{' zero-1' if chosen.cand.shards(k) else ''}"
        for k, st in enumerate(chosen.cand.stages)
    )
    lines.append(f"chosen: {cuts}")
    return lines
