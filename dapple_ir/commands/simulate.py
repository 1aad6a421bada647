"""`dapple simulate PLAN`: predict one iteration of a plan, print a summary, write the timeline."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dapple_ir import plan_dir
from dapple_ir.errors import DappleError
from dapple_ir.ir import Module

if TYPE_CHECKING:
    from dapple_ir.cluster.spec import ClusterSpec


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "simulate",
        help="predict a plan's timeline and memory; write timeline.json and timeline.png",
        description=(
            "Simulate one training iteration of a lowered plan: every instruction of every rank, with\n"
            "compute from the op costs and transfers from the cluster's links. Prints iteration time,\n"
            "busy and bubble share and peak memory per rank; writes timeline.json (Chrome trace: open it\n"
            "in https://ui.perfetto.dev or chrome://tracing) and timeline.png (Gantt chart, memory beneath)."
        ),
        epilog=(
            "examples:\n"
            "  dapple simulate plans/gpt            # a directory written by dapple compile\n"
            "  dapple simulate lowered.dapple -o out --cluster 2x8xV100-16GB\n"
            "  dapple simulate plans/gpt --compare plans/gpt/timeline_measured.json   # after dapple run\n"
            "  dapple simulate plans/gpt --steady   # a long run's steps: the period between them"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("plan", help="plan directory (holding plan.dapple) or IR file with rank programs")
    p.add_argument("-o", "--output", metavar="DIR", help="write the timeline here (default: the plan's directory)")
    p.add_argument("--cluster", help="cluster shorthand (2x8xV100-16GB) or TOML file; default: the plan's own")
    p.add_argument(
        "--backward-input-fraction",
        type=float,
        default=None,
        metavar="F",
        help="share of a stage's backward time its backward_input takes in zero-bubble plans (default 0.5)",
    )
    p.add_argument(
        "--steady",
        action="store_true",
        help="the steady state of back-to-back steps, each rank starting where it ended the step before (a long "
        "run's later steps): the iteration is the period between steps, which overlap where ranks end apart; "
        "default: the first step, every rank starting at once",
    )
    p.add_argument("--no-picture", action="store_true", help="write timeline.json only, skip the PNG")
    p.add_argument(
        "--compare",
        metavar="TRACE",
        help="a measured trace (from dapple run) to draw under the prediction, rank by rank: timeline-compare.png",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dapple_ir.cluster.toml_file import resolve_cluster
    from dapple_ir.sim.drawing import draw_timeline
    from dapple_ir.sim.simulator import BACKWARD_INPUT_FRACTION, simulate
    from dapple_ir.sim.trace import from_simulation, overlay, read_trace, write_trace

    plan = Path(args.plan)
    if not plan.exists():
        raise DappleError(f"plan {plan} does not exist; give a plan directory from `dapple compile` or an IR file")
    fraction = args.backward_input_fraction
    module = plan_dir.read_module(plan)
    named = args.cluster or module.attrs.cluster
    cluster = resolve_cluster(named) if named else None  # read once: the simulation and the MFU lines take this one
    result = simulate(
        module,
        cluster=cluster,
        backward_input_fraction=BACKWARD_INPUT_FRACTION if fraction is None else fraction,
        steady=args.steady,
    )
    out = Path(args.output) if args.output else (plan if plan.is_dir() else plan.parent)
    out.mkdir(parents=True, exist_ok=True)
    print(result.summary())
    for line in _mfu_lines(result.module, cluster, result.iteration_s):
        print(line)
    if args.steady:
        print("steady state: the iteration is the period from one step's end to the next's on the last rank")
    if result.cluster_name == "ideal":
        print("note: no cluster given or named by the plan; communication is free (give --cluster)", file=sys.stderr)
    timeline = from_simulation(result)
    write_trace(timeline, out / plan_dir.TIMELINE)
    print(f"wrote {out / plan_dir.TIMELINE} (open in https://ui.perfetto.dev)")
    if not args.no_picture:
        draw_timeline(timeline, out / plan_dir.TIMELINE_PICTURE)
        print(f"wrote {out / plan_dir.TIMELINE_PICTURE}")
    if args.compare:
        measured = read_trace(args.compare)
        ratio = measured.iteration_s / result.iteration_s if result.iteration_s else float("nan")
        print(
            f"predicted iteration {result.iteration_s:.6g} s, measured {measured.iteration_s:.6g} s "
            f"(measured / predicted = {ratio:.3f})"
        )
        draw_timeline(overlay(timeline, measured), out / plan_dir.TIMELINE_COMPARE)
        print(f"wrote {out / plan_dir.TIMELINE_COMPARE}")
    return 0


def _mfu_lines(module: Module, cluster: ClusterSpec | None, iteration_s: float) -> list[str]:
    """Model FLOPs, predicted MFU and the hardware floor, where the cluster is known and the ops carry FLOPs."""
    from dapple_ir.analysis.mfu import model_flops, utilization

    if cluster is None or not model_flops(module):
        return []
    return utilization(module, cluster).lines(iteration_s)
