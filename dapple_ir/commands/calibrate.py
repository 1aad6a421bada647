"""`dapple calibrate -o cluster.toml`: measure this machine and write a cluster spec for `--cluster`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import sys
from pathlib import Path
from typing import Any

from dapple_ir.cluster.roofline import roofline_times
from dapple_ir.cluster.spec import DEFAULT_LINKS, ClusterSpec, DeviceKind
from dapple_ir.cluster.toml_file import cluster_to_toml
from dapple_ir.errors import DappleError

#: Efficiencies are clamped to this range: a class measured far below its roofline (tiny CPU ops
#: dominated by Python overhead) still gets a usable figure.
_EFFICIENCY_RANGE = (0.01, 1.0)


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
    p.add_argument("--fit", metavar="PROFILE_JSON", help="fit per-op-class efficiency from a `dapple profile` JSON")
    p.add_argument("-o", "--output", required=True, help="cluster TOML to write")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # The measuring needs torch, which a command loads only when it runs.
    from dapple_ir.frontend.measure import measure_node

    if args.nodes < 1:
        raise DappleError(f"calibrate: --nodes must be at least 1, not {args.nodes}")
    measured = measure_node(args.device, args.devices)
    # The profile a fit reads was measured alone, so the fit uses `solo`.
    kind, solo, devices = measured.kind, measured.solo, measured.devices
    intra, inter = DEFAULT_LINKS["cpu"] if kind.name == "cpu" else DEFAULT_LINKS["H100"]
    intra = measured.intra_link or intra
    if inter.bandwidth > intra.bandwidth:
        # A busy machine can measure its own link below the default between nodes; a link to another
        # node is never faster than one inside this node, so the cluster file stays consistent.
        inter = dataclasses.replace(inter, bandwidth=intra.bandwidth, latency=max(inter.latency, intra.latency))
    spec = ClusterSpec((kind,) * args.nodes, devices, intra, inter, name=f"calibrated {socket.gethostname()}")
    if args.fit:
        spec = ClusterSpec(
            spec.node_kinds, devices, intra, inter, name=spec.name, efficiency=fit_efficiency(args.fit, solo)
        )
    Path(args.output).write_text(cluster_to_toml(spec))
    fitted = ", ".join(f"{k} {v:.2f}" for k, v in spec.efficiency.items()) or "defaults"
    alone = "" if kind is solo else f" ({solo.flops('f32') / 1e9:.1f} alone)"
    print(
        f"calibrate: {kind.name}: f32 {kind.flops('f32') / 1e9:.1f} GFLOP/s per rank{alone}, "
        f"memory {kind.mem_bandwidth / 1e9:.1f} GB/s, {kind.op_overhead * 1e6:.1f} us per op call, "
        f"{kind.memory_bytes / 1e9:.1f} GB per device; link {intra.bandwidth / 1e9:.2f} GB/s, "
        f"{intra.latency * 1e6:.0f} us; "
        f"efficiency: {fitted} -> {args.output}",
        file=sys.stderr,
    )
    return 0


def fit_efficiency(path: str, kind: DeviceKind) -> dict[str, float]:
    """Per op class: roofline seconds at full peak over measured seconds, summed over the class's ops.

    The device's per-call overhead is taken off the measured times first: efficiency describes the
    work an op does, the overhead its call. A profile that also timed the whole step (`step_s`) has
    its op times scaled to it first: an op timed alone carries call and synchronisation costs that
    the ops of a running step share, so the fitted model adds up to the step, not to the sum of parts.
    """
    compute_only = dataclasses.replace(kind, op_overhead=0.0)

    try:
        profile: dict[str, Any] = json.loads(Path(path).read_text())
        ops: dict[str, dict[str, Any]] = profile["ops"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DappleError(f"calibrate: {path} is not a profile written by `dapple profile` ({exc})") from None
    summed = sum(float(e.get("fwd_s", 0.0)) + float(e.get("bwd_s", 0.0)) for e in ops.values())
    scale = float(profile["step_s"]) / summed if profile.get("step_s") and summed > 0 else 1.0
    ideal: dict[str, float] = {}
    measured: dict[str, float] = {}
    for entry in ops.values():
        if "op_class" not in entry or "mem_bytes" not in entry:
            continue
        flops = (float(entry.get("fwd_flops", 0.0)), float(entry.get("bwd_flops", 0.0)))
        fwd, bwd = roofline_times(flops, float(entry["mem_bytes"]), compute_only)
        if fwd + bwd <= 0:
            continue  # views: no work to be efficient at
        calls = (fwd > 0) + (bwd > 0)
        spent = (float(entry["fwd_s"]) + float(entry["bwd_s"])) * scale - calls * kind.op_overhead
        op_class = str(entry["op_class"])
        ideal[op_class] = ideal.get(op_class, 0.0) + fwd + bwd
        measured[op_class] = measured.get(op_class, 0.0) + max(spent, 1e-9)
    if not measured:
        raise DappleError(f"calibrate: {path} has no ops with FLOP counts to fit efficiencies from")
    lo, hi = _EFFICIENCY_RANGE
    return {c: round(min(hi, max(lo, ideal[c] / measured[c])), 4) for c in sorted(measured) if measured[c] > 0}
