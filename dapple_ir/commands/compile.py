"""`dapple compile MODEL_SPEC --cluster C --global-batch N -o PLAN_DIR`: plan, lower and write a plan."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from dapple_ir import schedules
from dapple_ir.analysis.precision import PRECISIONS
from dapple_ir.commands.opt import add_pass_manager_flags, pass_manager_options
from dapple_ir.errors import DappleError
from dapple_ir.frontend.hf_spec import DEFAULT_BATCH, DEFAULT_SEQ, is_hf_spec, with_shape
from dapple_ir.planner.cost_model import POLICIES, REPLICATION
from dapple_ir.planner.request import ZERO
from dapple_ir.planner.search import METHODS, RECOMPUTE

_EPILOG = """examples:
  dapple compile examples/gpt.py:factory --cluster 2x8xV100-16GB --global-batch 64 -o plans/gpt --explain
  dapple compile profile:graph.txt --cluster 16x1xV100-16GB --global-batch 1024 -o plans/vgg --profile-batch 64
  dapple compile examples/mlp.py:factory --cluster 4xcpu --global-batch 32 --stages 2 --microbatches 8 -o plans/mlp
  dapple compile examples/gpt.py:factory --cluster 4xcpu --global-batch 16 --split-at blocks.1 -o plans/gpt-pinned
  dapple compile hf:llama-70b/config.json --seq 2048 --example-batch 4 --cluster 4x8xH100 --global-batch 64 -o plans/70b
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "compile",
        help="plan a model for a cluster and write a plan directory",
        description="Capture (or import) a model, choose stages, replicas, placement, microbatches and schedule, "
        "lower to per-rank programs and write PLAN_DIR (plan.dapple, plan.json, report.txt, rank_<r>.py).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_pass_manager_flags(p)
    p.add_argument(
        "model_spec",
        metavar="MODEL_SPEC",
        help="file.py:factory, package.module:factory, hf:config.json (a Hugging Face config) or profile:graph.txt",
    )
    p.add_argument("--seq", type=int, metavar="N", help=f"hf: specs: the example's sequence length ({DEFAULT_SEQ})")
    p.add_argument("--example-batch", type=int, metavar="B", help=f"hf: specs: the example's samples ({DEFAULT_BATCH})")
    p.add_argument("--global-batch", type=int, required=True, metavar="N", help="samples per optimizer step")
    p.add_argument("-o", "--output", required=True, metavar="PLAN_DIR", help="plan directory to write (atomically)")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace PLAN_DIR even when it holds files dapple-ir did not write (they are deleted)",
    )
    p.add_argument("--planner", choices=METHODS, default="auto", help="search method (default auto)")
    p.add_argument("--stages", type=int, metavar="N", help="force the number of pipeline stages")
    p.add_argument("--microbatches", type=int, metavar="M", help="force the number of microbatches")
    # Not `choices=`: a --pass-plugin file may register more schedules, and it loads after parsing.
    p.add_argument(
        "--schedule",
        metavar="NAME",
        help=f"force the schedule: {', '.join(schedules.SCHEDULES)} or one a --pass-plugin registers",
    )
    p.add_argument("--policy", choices=POLICIES, help="force the device placement policy")
    p.add_argument(
        "--virtual",
        type=int,
        metavar="V",
        help="virtual stages per device group (interleaved schedule); default: the planner chooses",
    )
    p.add_argument(
        "--recompute",
        choices=RECOMPUTE,
        default="auto",
        help="activation recomputation: auto (the planner picks the stages that need it), none or all",
    )
    p.add_argument(
        "--zero",
        choices=ZERO,
        default="none",
        help="shard the optimizer state of replicated stages over their replicas (ZeRO-1): auto (where it makes "
        "the plan faster or fit), none (the default) or all",
    )
    p.add_argument(
        "--tensor-parallel",
        type=int,
        metavar="T",
        help="tensor-parallel degree of every stage (Megatron-LM's, inside a node: 1, 2, 4 or 8); default: the "
        "planner searches it where the model has the patterns (docs/passes.md, tensor-parallel)",
    )
    p.add_argument(
        "--data-parallel",
        type=int,
        metavar="D",
        help="replicas of every stage (one data-parallel degree, as Megatron-LM's); default: chosen per stage",
    )
    p.add_argument(
        "--replication",
        choices=REPLICATION,
        default="auto",
        help="replicated stages: split each microbatch over the replicas (DAPPLE), take whole ones "
        "round-robin, or auto (the planner weighs both)",
    )
    p.add_argument(
        "--split-at",
        metavar="FQN[,FQN...]",
        help="fix the cuts: a new stage begins at each named module (as torch.distributed.pipelining's "
        "SplitPoint.BEGINNING, e.g. layers.4,layers.8); replication, placement, microbatches and schedule are planned",
    )
    p.add_argument("--pipeline", metavar="SPEC", help="replace the whole pass pipeline")
    p.add_argument("--max-layers", type=int, metavar="N", help="coarsen to at most N layers")
    p.add_argument("--explain", action="store_true", help="print every candidate considered and why it lost")
    p.add_argument("--optimizer", choices=("adam", "adamw", "sgd", "sgd-momentum"), default="adam")
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="autocast dtype of the matmul-class ops (fp32 master weights, grads and optimizer state); "
        "default: bf16 on devices with bf16 tensor cores (A100, H100, H200), else fp32",
    )
    p.add_argument("--profile-batch", type=int, metavar="N", help="batch the times of a profile: spec describe")
    p.add_argument(
        "--quiet", action="store_true", help="no progress on stderr (the phases and their times); errors still show"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dapple_ir.api import compile as compile_plan

    started = time.perf_counter()
    if not args.cluster:
        raise DappleError("dapple compile needs --cluster, e.g. --cluster 2x8xV100-16GB")
    manager = pass_manager_options(args)
    if args.schedule is not None and args.schedule not in schedules.SCHEDULES:
        raise DappleError(
            f"--schedule must be one of the registered schedules ({', '.join(schedules.SCHEDULES)}), "
            f"not '{args.schedule}'"
        )
    log = None if args.quiet else _progress_printer(started)
    try:
        return _compile(args, log, manager, compile_plan)
    finally:
        if log is not None:
            log.close()


def _compile(
    args: argparse.Namespace, log: Progress | None, manager: dict[str, Any], compile_plan: Callable[..., Any]
) -> int:
    result = compile_plan(
        _model_spec(args),
        cluster=args.cluster,
        global_batch=args.global_batch,
        planner=args.planner,
        stages=args.stages,
        microbatches=args.microbatches,
        schedule=args.schedule,
        policy=args.policy,
        pipeline=args.pipeline,
        out_dir=args.output,
        force=args.force,
        explain=args.explain,
        optimizer=args.optimizer,
        profile_batch=args.profile_batch,
        max_layers=args.max_layers,
        virtual=args.virtual,
        recompute=args.recompute,
        replication=args.replication,
        zero=args.zero,
        tensor_parallel=args.tensor_parallel,
        data_parallel=args.data_parallel,
        precision=args.precision,
        split_at=tuple(name.strip() for name in (args.split_at or "").split(",") if name.strip()),
        log=log,
        manager=manager,
    )
    sys.stdout.write(result.report)
    print(f"wrote {args.output}/ (plan.dapple, plan.json, report.txt)")
    return 0


#: Seconds a phase may run without a line before the progress says it is still working (a 70B capture takes 30 s).
QUIET_S = 4.0


class Progress:
    """Prints progress messages on stderr after the seconds since `start` (`[  3.2 s] capture: 2802 ops ...`), and,
    from a watcher thread, `still working` whenever `QUIET_S` seconds pass without one: a long capture or search
    shows something every few seconds."""

    def __init__(self, start: float, quiet_s: float = QUIET_S) -> None:
        self.start, self.quiet_s = start, quiet_s
        self.last = start
        # The terminal's stream, held: capture silences torch by swapping `sys.stderr` while it traces.
        self.stream = sys.stderr
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.watcher = threading.Thread(target=self._watch, name="dapple-progress", daemon=True)
        self.watcher.start()

    def __call__(self, message: str) -> None:
        with self.lock:
            now = time.perf_counter()
            self.last = now
            print(f"[{now - self.start:6.1f} s] {message}", file=self.stream, flush=True)

    def _watch(self) -> None:
        while not self.done.wait(min(1.0, self.quiet_s / 2)):
            since = time.perf_counter() - self.last
            if since >= self.quiet_s:
                self(f"... still working ({since:.0f} s since the last line)")

    def close(self) -> None:
        self.done.set()
        self.watcher.join(timeout=5.0)


def _progress_printer(start: float) -> Progress:
    """The compile command's progress on stderr (`Progress`)."""
    return Progress(start)


def _model_spec(args: argparse.Namespace) -> str:
    """The spec as the plan records it: an `hf:` spec with its config's absolute path and example shape."""
    if is_hf_spec(args.model_spec):
        return with_shape(args.model_spec, args.seq, args.example_batch)
    if args.seq is not None or args.example_batch is not None:
        raise DappleError(
            f"--seq and --example-batch shape the example of an hf:config.json spec; {args.model_spec} builds its "
            "own example inputs (give them the shape in its factory)"
        )
    return str(args.model_spec)
