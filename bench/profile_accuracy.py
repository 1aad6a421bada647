"""How well do per-op costs add up to the whole model? Measured and analytic, against direct timing.

For each example model: the direct time of one forward + loss + backward, the sum of the per-op
times `dapple profile` measures, and the sum of the analytic roofline times `annotate-cost` gives
on the `cpu` preset, on a cluster calibrated on this machine, and on one whose per-op-class
efficiencies `dapple calibrate --fit` fitted to the model's own profile. Prints a table; asserts
nothing. CPU timings on a shared machine wander by tens of percent from run to run.

    .venv/bin/python bench/profile_accuracy.py [--microbatch 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("examples/mlp.py:factory", "examples/gpt.py:factory", "examples/cnn.py:factory")


def analytic_s(spec: str, microbatch: int, cluster: str) -> float:
    from dapple_ir.frontend.spec_loader import capture_spec
    from dapple_ir.pass_manager import PassManager, build_pipeline
    from dapple_ir.registry import PassContext

    module = capture_spec(spec, device="meta")
    PassManager(build_pipeline(f"annotate-cost{{microbatch={microbatch}}}")).run(module, PassContext(cluster=cluster))
    return sum((op.attrs.fwd_s or 0.0) + (op.attrs.bwd_s or 0.0) for op in module.ops)


def refit(calibrated: str, profile_path: str, out: str) -> None:
    """`calibrated` with its per-op-class efficiencies fitted to the profile at `profile_path`, written to `out`:
    what `dapple calibrate --fit` writes, without measuring the machine again (one calibration for every model;
    four took the benchmark past its budget). The fit reads the calibrated device: with one rank per core, as here,
    it is the device `calibrate --fit` reads (a rank alone on its core)."""
    from dapple_ir.cluster.toml_file import cluster_to_toml, load_cluster_toml
    from dapple_ir.frontend.calibration_fits import fit_efficiency

    spec = load_cluster_toml(calibrated)
    fitted = dataclasses.replace(spec, efficiency=fit_efficiency(profile_path, spec.node_kinds[0]))
    Path(out).write_text(cluster_to_toml(fitted))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--microbatch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.chdir(ROOT)
    from dapple_ir.cli import main as dapple
    from dapple_ir.frontend.profiler import direct_step_s, profile_spec, write_profile

    # One rank per `--threads` cores: no rank shares a core, so the calibrated device is the one a profile sees.
    devices = str(max(1, (os.cpu_count() or 1) // args.threads))
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["DAPPLE_IR_CACHE"] = tmp
        calibrated = str(Path(tmp) / "cluster.toml")
        dapple(["calibrate", "--devices", devices, "-o", calibrated])
        header = (
            f"{'model':<28} {'direct ms':>10} {'profile ms':>11} {'ratio':>6} {'roofline cpu':>13} "
            f"{'calibrated':>11} {'fitted':>8}"
        )
        print(header)
        print("-" * len(header))
        for spec in MODELS:
            kw = {"microbatch": args.microbatch, "repeats": args.repeats, "threads": args.threads}
            direct = direct_step_s(spec, **kw)
            profile = profile_spec(spec, use_cache=False, **kw)
            summed = profile["total_fwd_s"] + profile["total_bwd_s"]
            # Efficiencies fitted to this model's own profile: what `calibrate --fit` buys.
            profile_path, fitted_toml = str(Path(tmp) / "profile.json"), str(Path(tmp) / "fitted.toml")
            write_profile(profile, profile_path)
            refit(calibrated, profile_path, fitted_toml)
            preset = analytic_s(spec, args.microbatch, "1x1xcpu")
            plain = analytic_s(spec, args.microbatch, calibrated)
            fitted = analytic_s(spec, args.microbatch, fitted_toml)
            print(
                f"{spec:<28} {direct * 1e3:>10.3f} {summed * 1e3:>11.3f} {summed / direct:>6.2f} "
                f"{preset / direct:>12.3f}x {plain / direct:>10.3f}x {fitted / direct:>7.3f}x"
            )
    print(
        "\nratio = sum of measured per-op times / direct; the last three columns = analytic roofline sum / direct "
        "on the cpu preset, on this machine calibrated, and calibrated with efficiencies fitted to the model's profile"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
