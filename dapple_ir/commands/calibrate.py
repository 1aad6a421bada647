"""`dapple calibrate -o cluster.toml`: measure this machine and write a cluster spec for `--cluster`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import sys
from pathlib import Path

from dapple_ir.cluster.spec import DEFAULT_LINKS, PRESETS, ClusterSpec
from dapple_ir.cluster.toml_file import cluster_to_toml
from dapple_ir.errors import DappleError, RuntimeFailure
from dapple_ir.frontend.calibration_fits import (
    fit_efficiency,
    fit_fixed_s,
    fit_host_time,
    fit_split_price,
    fit_wake,
    has_flop_counts,
    read_profile,
)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "calibrate",
        help="measure this machine's FLOP/s and memory bandwidth; write a cluster TOML",
        description=(
            "Measure f32 matmul FLOP/s and memory bandwidth of this machine's device (and, with --fit, the "
            "fraction of the roofline each op class reaches in a `dapple profile` JSON), and write a cluster TOML "
            "for --cluster. On a CPU each device is a process with its share of the cores."
        ),
        epilog=(
            "example:\n  dapple profile examples/mlp.py:factory -o profile.json\n"
            "  dapple calibrate --device cpu --devices 2 --fit profile.json -o cluster.toml\n"
            "  dapple opt model.dapple -p annotate-cost --cluster cluster.toml"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--devices", type=int, help="devices (ranks) on this node (default: GPUs, or 1 on a CPU)")
    p.add_argument("--nodes", type=int, default=1, help="nodes like this one in the cluster (default: 1)")
    p.add_argument(
        "--fit",
        metavar="PROFILE_JSON",
        nargs="+",
        help="fit per-op-class efficiency from `dapple profile` JSONs; with profiles at two or more "
        "--microbatch sizes, also the fixed seconds per op call (op_overhead) from how times shrink",
    )
    p.add_argument("-o", "--output", required=True, help="cluster TOML to write")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # The measuring needs torch, which a command loads only when it runs.
    from dapple_ir.backends.torch.split_backward import measure_split_overhead
    from dapple_ir.frontend.measure import measure_node

    if args.nodes < 1:
        raise DappleError(f"calibrate: --nodes must be at least 1, not {args.nodes}")
    measured = measure_node(args.device, args.devices)
    # The profile a fit reads was measured alone, so the fit uses `solo`.
    kind, solo, devices, cores = measured.kind, measured.solo, measured.devices, measured.cores
    intra, inter = DEFAULT_LINKS["cpu"] if kind.name == "cpu" else DEFAULT_LINKS["H100"]
    intra = measured.intra_link or intra
    if inter.bandwidth > intra.bandwidth:
        # A busy machine can measure its own link below the default between nodes; a link to another
        # node is never faster than one inside this node, so the cluster file stays consistent.
        inter = dataclasses.replace(inter, bandwidth=intra.bandwidth, latency=max(inter.latency, intra.latency))
    # Timed with the runtime's own split of a backward.
    split, per_byte = fit_split_price(measure_split_overhead(args.device, devices))
    # Timed on the runtime itself, training a small MLP on all this device's ranks. Where they outnumber the cores
    # the simulator time-slices the compute, but a rank's host work between instructions also pays for the switches
    # between ranks (cold caches, the switch itself), which it does not price: timed on as many ranks as cores, the
    # host figure predicted 4-rank plans of examples/llama.py and examples/gpt.py 10-33 % fast on the 2-core dev VM,
    # timed on all four -12..+2 % and -10..-27 % (docs/cluster.md).
    # The same run gives the woken rank's wait for a core (`wake_overhead`): about nothing where each rank has a core.
    try:
        instruction, message, wake = measure_host_time(args.device, devices)
    except RuntimeFailure as exc:  # a machine whose ranks cannot run keeps the preset's figures
        preset = PRESETS.get(kind.name)  # `cpu`; a GPU's host runs ahead of its kernels: 0
        instruction, message, wake = (
            (preset.instruction_overhead, preset.message_overhead, preset.wake_overhead) if preset else (0.0, 0.0, 0.0)
        )
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"calibrate: the runtime's host time was not measured ({reason}); keeping the preset's", file=sys.stderr)
    kind, solo = (
        dataclasses.replace(
            k,
            split_backward_overhead=split,
            split_backward_per_byte=per_byte,
            instruction_overhead=instruction,
            message_overhead=message,
            wake_overhead=wake,
        )
        for k in (kind, solo)
    )
    if args.fit and len(args.fit) > 1:
        # Measured in the model's own ops rather than in a loop of tiny ones: it replaces the tiny-op figure.
        fixed = fit_fixed_s(args.fit)
        kind = dataclasses.replace(kind, op_overhead=fixed)
        solo = dataclasses.replace(solo, op_overhead=fixed)
    spec = ClusterSpec(
        (kind,) * args.nodes, devices, intra, inter, name=f"calibrated {socket.gethostname()}", cores_per_node=cores
    )
    # Efficiency from the largest microbatch (the least dominated by the fixed part); profiles
    # without FLOP counts (an imported model's) still fit the fixed part when there are several.
    largest = max(args.fit or [], key=lambda path: read_profile(path)[0], default=None)
    if largest is not None and (len(args.fit) == 1 or has_flop_counts(largest)):
        spec = dataclasses.replace(spec, efficiency=fit_efficiency(largest, solo))
    Path(args.output).write_text(cluster_to_toml(spec))
    fitted = ", ".join(f"{k} {v:.2f}" for k, v in spec.efficiency.items()) or "defaults"
    alone = "" if kind is solo else f" ({solo.flops('f32') / 1e9:.1f} alone)"
    print(
        f"calibrate: {kind.name}: f32 {kind.flops('f32') / 1e9:.1f} GFLOP/s per rank{alone}, "
        f"memory {kind.mem_bandwidth / 1e9:.1f} GB/s, {kind.op_overhead * 1e6:.1f} us per op call, "
        f"a split backward {kind.split_backward_overhead * 1e6:.0f} us per weight op "
        f"+ {kind.split_backward_per_byte * 1e12:.0f} us per MB of its weights, "
        f"the runtime's host {kind.instruction_overhead * 1e6:.0f} us per instruction "
        f"+ {kind.message_overhead * 1e6:.0f} us per message, "
        f"a woken rank's wait for a core {kind.wake_overhead * 1e6:.0f} us, "
        f"{kind.memory_bytes / 1e9:.1f} GB per device; link {intra.bandwidth / 1e9:.2f} GB/s, "
        f"{intra.latency * 1e6:.0f} us; transfers into a computing rank {kind.busy_receive_slowdown:.3g}x slower; "
        f"an allreduce member's host {kind.reduce_per_byte * 1e12:.0f} us per MB it reduces; "
        f"efficiency: {fitted}{_sharing(cores, devices)} -> {args.output}",
        file=sys.stderr,
    )
    return 0


def _sharing(cores: int, devices: int) -> str:
    return f"; the {devices} ranks share {cores} core(s)" if cores else ""


def measure_host_time(device: str, ranks: int) -> tuple[float, float, float]:
    """(`instruction_overhead`, `message_overhead`, `wake_overhead`) on `device` with `ranks` ranks, measured on the
    runtime: `host_time.TIMING_MLP` compiled to `ranks` 1F1B stages (one stage and no messages on one rank), trained
    for `TIMING_STEPS` steps with `dapple run` (torchrun: one process per rank, gloo on a CPU); the host time before
    each compute instruction of the steps after `TIMING_WARMUP` (`host_time.host_samples`) fitted
    (`fit_host_time`), and the run-queue delays of the receives that blocked (`host_time.wake_delays`) fitted
    (`fit_wake`). Raises `RuntimeFailure` where the ranks cannot run."""
    import tempfile

    import dapple_ir
    from dapple_ir.backends.torch import host_time

    _width, _depth, rows, microbatches = host_time.TIMING_MLP
    with tempfile.TemporaryDirectory(prefix="dapple-host-time-") as tmp:
        plan = Path(tmp) / "plan"
        dapple_ir.compile(
            f"{host_time.__name__}:timing_model", cluster=f"{ranks}x{'cpu' if device == 'cpu' else 'H100'}",
            global_batch=rows * microbatches, stages=ranks, microbatches=microbatches, schedule="1f1b",
            optimizer="sgd", out_dir=plan,
        )  # fmt: skip
        run_dir = Path(tmp) / "run"
        dapple_ir.run(plan, steps=host_time.TIMING_STEPS, device=device, run_dir=run_dir, timeout=60.0)
        reports = [json.loads(path.read_text()) for path in sorted(run_dir.glob("rank_*.json"))]
    warmup = host_time.TIMING_WARMUP
    instruction, message = fit_host_time([s for report in reports for s in host_time.host_samples(report, warmup)])
    return instruction, message, fit_wake([d for report in reports for d in host_time.wake_delays(report, warmup)])
