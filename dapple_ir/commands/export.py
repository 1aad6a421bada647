"""`dapple export PLAN --to torch-pipelining`: hand a plan to another engine."""

from __future__ import annotations

import argparse
from pathlib import Path

from dapple_ir import plan_dir
from dapple_ir.errors import DappleError

#: The engines a plan can be exported to.
TARGETS = ("torch-pipelining",)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "export",
        help="write a plan in another engine's terms (torch.distributed.pipelining)",
        description=(
            "Write PLAN for torch.distributed.pipelining: each stage's module FQNs (torchtitan's\n"
            "module_fqns_per_model_part), the schedule as torch's action CSV (_PipelineScheduleRuntime's\n"
            "compute and comms format, and a compute-only one), and the data-parallel degree, in\n"
            "torch_pipelining.json. A plan torch cannot express (uneven replication, split rows,\n"
            "recomputation, a value skipping a stage) is refused naming the dimension."
        ),
        epilog="examples:\n  dapple export plans/mlp --to torch-pipelining -o plans/mlp/torch\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("plan", metavar="PLAN", help="plan directory written by dapple compile")
    p.add_argument("--to", required=True, choices=TARGETS, help="the engine to export to")
    p.add_argument("-o", "--output", metavar="DIR", help="where to write (default: PLAN/torch_pipelining)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dapple_ir.backends.torch.torch_pipelining import translate, write

    plan = plan_dir.load_plan(args.plan)
    out = Path(args.output) if args.output else plan.dir / "torch_pipelining"
    if out.exists() and not out.is_dir():
        raise DappleError(f"export: {out} exists and is not a directory; give another -o DIR")
    exported = translate(plan.module)
    for path in write(exported, out):
        print(f"wrote {path}")
    for k, fqns in enumerate(exported.module_fqns_per_model_part):
        print(f"stage {k} (rank {exported.stage_to_rank[k]}): {', '.join(fqns) or '(no module: the loss only)'}")
    print(
        f"pp degree {exported.pp_degree}, dp degree {exported.dp_degree}, {exported.n_microbatches} microbatches of "
        f"{exported.microbatch_size} per replica"
    )
    return 0
