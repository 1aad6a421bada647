"""`dapple run PLAN_DIR --steps N`: train a compiled plan on one process per rank (or threads)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dapple_ir.analysis.mfu import model_flops, utilization
from dapple_ir.analysis.precision import precision_of
from dapple_ir.backends.torch.tolerances import ATOL, GRAD_ATOL, NOISE_FLOOR, RTOL, TOLERANCES, adam_reach
from dapple_ir.ir import Module
from dapple_ir.units import format_bytes

if TYPE_CHECKING:
    from dapple_ir.backends.torch.results import CheckResult

_EPILOG = """examples:
  dapple run plans/gpt --steps 5 --check
  dapple run plans/gpt --steps 5 --transport threads --optimizer adam --lr 1e-3
  dapple run plans/gpt --steps 2 --save ckpt && dapple run plans/gpt --steps 2 --resume ckpt
  dapple run plans/gpt --steps 1000 --save ckpt --save-every 100   # after a fault: --resume ckpt --steps ...
  dapple run plans/gpt --steps 5 --nnodes 2 --node-rank 0 --rdzv-endpoint host0:29400   # on each node

Data: synthetic and seeded from the model's example inputs, unless the model file defines
dapple_data(step, global_batch, seed) -> (inputs, targets). The measured timeline of the last step
is written to PLAN_DIR/timeline_measured.json (Chrome trace, the simulator's format).

Checkpoints: --save DIR writes DIR/step_<k>/rank_<r>.pt and then DIR/manifest.json (plan digest,
step, world size, each file's SHA-256 and size); the manifest's atomic replacement commits a save,
so a crash or a full disk mid-save keeps the previous checkpoint whole. A DIR holding another
plan's checkpoint is refused (naming it) unless --force. --resume DIR checks all of
it before any rank trains, then runs --steps more steps from the saved step; losses, parameters and
the optimizer state continue bit for bit as if the run had never stopped.

Random ops (dropout) draw from a generator seeded by (seed, step, microbatch, op), so the masks do
not depend on the split and --check holds with dropout too.

--check trains the model (the nn.Module, not the captured graph) on one CPU device with the same
seed, data, microbatches and optimizer, using the ranks' intra-op thread count, and compares:
  losses      every step, within atol {atol:g} + rtol {rtol:g}
  gradients   of step 0 (same parameters on both sides), every parameter copy, within rtol {rtol:g} of
              the element + {grad_atol:g} of the largest gradient (the optimizer is the same code)
  parameters  after the last step, within atol + rtol; under adam/adamw plus the drift the gradients'
              rounding gives Adam's steps (2 rtol lr a step), and an element whose gradient was below
              {floor:g} of the step's largest in some step (rounding noise: an attention key bias, whose sign
              is not determined; Adam turns it into a full learning-rate step of either sign) within the
              farthest two runs of Adam can step it apart ({reach:g} lr after one step, {reach5:.3g} after five)
  buffers     of unreplicated stages like parameters; a replicated stage averages its buffers (batch-norm
              running statistics) over its replicas after each step, and they must agree there
The figures are fp32's. A bf16 or fp16 plan trains the reference under the same autocast (and fp16's
loss scale) and compares from the format's unit roundoff u: rtol, the gradients' share of the largest
and the noise floor are 2u ({bf16:g} for bf16, {fp16:g} for fp16), atol as above.
It exits with status 1 on a mismatch and lists what differs.
"""


def _epilog() -> str:
    return _EPILOG.format(
        atol=ATOL,
        rtol=RTOL,
        grad_atol=GRAD_ATOL,
        floor=NOISE_FLOOR,
        reach=adam_reach(1.0, 1),
        reach5=adam_reach(1.0, 5),
        bf16=TOLERANCES["bf16"].rtol,
        fp16=TOLERANCES["fp16"].rtol,
    )


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "run",
        help="train a plan: one process per rank through torchrun (or threads)",
        description="Train the plan in PLAN_DIR for N steps; print the loss per step, samples/s and the "
        "measured peak memory per rank; with --check compare against single-device training.",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("plan_dir", metavar="PLAN_DIR", help="directory written by `dapple compile`")
    p.add_argument("--steps", type=int, default=1, help="optimizer steps to run (default 1)")
    p.add_argument("--check", action="store_true", help="also train on one device and compare (see below)")
    p.add_argument("--transport", choices=("torchrun", "threads"), default="torchrun", help="default torchrun")
    p.add_argument("--nnodes", type=int, default=1, help="nodes taking part (multi-node runs)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index (multi-node runs)")
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous (default: 127.0.0.1 and a free port)")
    p.add_argument(
        "--listen-host",
        metavar="ADDR",
        help="address the rendezvous store and the ranks listen on (default: 127.0.0.1; with --rdzv-endpoint, "
        "the address this machine reaches the endpoint from)",
    )
    p.add_argument("--save", metavar="DIR", help="checkpoint every rank into DIR after the last step (checked first)")
    p.add_argument(
        "--save-every",
        type=int,
        metavar="N",
        help="with --save: also checkpoint after every N-th step, so a fault loses at most N steps",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="with --save: replace a checkpoint of another plan in DIR (refused without it)",
    )
    p.add_argument("--resume", metavar="DIR", help="continue from the checkpoint in DIR (checked first)")
    p.add_argument(
        "--optimizer", choices=("sgd", "sgd-momentum", "adam", "adamw"), help="default: the plan's, else sgd"
    )
    p.add_argument("--lr", type=float, help="default: plan.json's lr, else 1e-3 (adam, adamw) or 0.01 (sgd)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any wait may last (default 120)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda when present")
    p.add_argument(
        "--no-pin",
        action="store_true",
        help="CPU ranks: leave each wherever the OS puts it (default: cores of its own where there are enough)",
    )
    p.set_defaults(func=run)


#: The share of the step time a rank waited for a CPU above which `dapple run` says so.
CPU_WAIT_NOTE = 0.05


def _cores(cores: list[int] | None) -> str:
    """A rank's cores as `2-5` or `0,2`; `unpinned` for None."""
    if cores is None:
        return "unpinned"
    if len(cores) > 2 and cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(str(c) for c in cores)


def run(args: argparse.Namespace) -> int:
    from dapple_ir.backends.torch.checkpoint import check_save_owner
    from dapple_ir.backends.torch.launch import Interrupted
    from dapple_ir.backends.torch.launch import run as run_plan
    from dapple_ir.plan_dir import load_plan

    if args.save:
        check_save_owner(Path(args.save), load_plan(args.plan_dir).digest, force=args.force)
    try:
        result = run_plan(
            args.plan_dir,
            steps=args.steps,
            check=args.check,
            transport=args.transport,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            rdzv_endpoint=args.rdzv_endpoint,
            save=args.save,
            save_every=args.save_every,
            resume=args.resume,
            optimizer=args.optimizer,
            lr=args.lr,
            timeout=args.timeout,
            listen_host=args.listen_host,
            device=args.device,
            pin=not args.no_pin,
        )
    except Interrupted as stop:
        print(f"dapple run: {stop}", file=sys.stderr)
        return stop.status  # 130 for SIGINT, 143 for SIGTERM: what a shell reports for a process they ended
    print("step  loss")
    for i, loss in enumerate(result.losses):
        print(f"{result.first_step + i:>4}  {loss:.6f}")
    print(f"samples/s: {result.samples_per_s:.1f}")
    module = _planned_module(args.plan_dir)
    for line in _measured_mfu(module, result.samples_per_s):
        print(line)
    print("measured peak memory per rank:")
    for rank, (peak, device) in enumerate(zip(result.peak_bytes, result.devices, strict=True)):
        how = "CUDA allocator peak" if device.startswith("cuda") else "bytes the runtime holds"
        print(f"  rank {rank}: {format_bytes(peak, 1)} ({device}, {how})")
    waits = [w for w in result.cpu_waits if w is not None]
    if waits and max(waits) >= CPU_WAIT_NOTE:
        shares = ", ".join(f"rank {r} {100 * w:.0f}%" for r, w in enumerate(result.cpu_waits) if w is not None)
        print(
            f"waited for a CPU (runnable, no core free): {shares} of the step time. More busy threads than "
            "cores stretch the measured steps and timeline; the simulator shares a node's cores only where the "
            "cluster says how many it has (cores_per_node, which `dapple calibrate --devices N` writes)"
        )
    if any(cores is not None for cores in result.cores):
        pinned = ", ".join(f"rank {r} {_cores(c)}" for r, c in enumerate(result.cores))
        print(f"CPU cores (each rank pinned to its own; --no-pin leaves them to the OS): {pinned}")
    if result.timeline is not None:
        print(f"measured timeline: {result.timeline}")
    if args.save:
        print(f"checkpoint: {args.save}")
    if result.check is None:
        return 0
    return _print_check(result.check, module)


def _print_check(c: CheckResult, module: Module | None) -> int:
    """What `--check` found, and the exit status it gives the run."""
    verdict = "OK" if c.ok else "MISMATCH"
    precision = precision_of(module) if module is not None else "fp32"
    tol = TOLERANCES[precision]
    print(
        f"check against single-device training ({precision}): {verdict} at rtol {tol.rtol:g}, atol {tol.atol:g} "
        f"(gradients of step 0: rtol {tol.rtol:g} + {tol.grad_atol:g} of the largest)"
    )
    print(f"  max |loss diff|  {c.max_loss_diff:.3g}")
    print(
        f"  max |grad diff|  {c.max_grad_diff:.3g} of the step's largest gradient ({c.worst_grad or 'none recorded'})"
    )
    print(f"  max |param diff| {c.max_param_diff:.3g} ({c.worst_param})")
    if c.worst_buffer:
        print(f"  max |buffer diff| {c.max_buffer_diff:.3g} ({c.worst_buffer})")
    if c.noise_elements:
        print(
            f"  {c.noise_elements} parameter element(s) with noise-level gradients compared within Adam's reach "
            "(the farthest two runs of Adam can step them apart)"
        )
    if c.averaged_buffers:
        print(f"  {c.averaged_buffers} buffer(s) of replicated stages averaged over their replicas, which agree")
    for line in c.failures:
        print(f"  differs: {line}")
    for line in c.notes:
        print(f"  note: {line}")
    return 0 if c.ok else 1


def _planned_module(plan: str) -> Module | None:
    """The IR of the plan that just ran, for the lines printed after it (None where it cannot be read back)."""
    from dapple_ir.errors import DappleError
    from dapple_ir.plan_dir import read_module

    try:
        return read_module(plan)
    except DappleError:
        return None


def _measured_mfu(module: Module | None, samples_per_s: float) -> list[str]:
    """Model FLOPs, measured MFU and the floor, from the measured samples per second (where the plan names a
    cluster and its ops carry FLOPs)."""
    if (
        module is None
        or not module.attrs.cluster
        or not model_flops(module)
        or samples_per_s <= 0
        or not module.attrs.global_batch
    ):
        return []
    from dapple_ir.cluster.toml_file import resolve_cluster

    iteration_s = module.attrs.global_batch / samples_per_s
    return utilization(module, resolve_cluster(module.attrs.cluster)).lines(iteration_s, "measured")
