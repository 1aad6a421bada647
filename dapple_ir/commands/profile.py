"""`dapple profile MODEL_SPEC -o profile.json`: measure each op forward and backward on a device."""

from __future__ import annotations

import argparse
import sys

from dapple_ir.errors import DappleError


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "profile",
        help="measure each op's forward and backward time on a device",
        description=(
            "Build the model with real weights, capture it at the microbatch size and time every op forward and "
            "backward on real tensors (warm-up, then the fastest of --repeats), and the whole step (the median of "
            "3 x --repeats: a training step runs at the machine's typical speed, and calibrate --fit scales the "
            "op times to this level). The JSON it writes is what "
            "annotate-cost{source=profile.json} reads. Results are cached under $DAPPLE_IR_CACHE "
            "(default ~/.cache/dapple-ir), keyed by the model's structure, the device, the microbatch and the "
            "torch version, so a second run is instant."
        ),
        epilog=(
            "example:\n  dapple profile examples/mlp.py:factory --device cpu --microbatch 8 -o profile.json\n"
            "  dapple opt model.dapple -p 'annotate-cost{source=profile.json}'"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL_SPEC", help="path/to/file.py:factory or package.module:factory")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    p.add_argument("-o", "--output", required=True, help="profile JSON to write")
    p.add_argument("--microbatch", type=int, help="samples per measured call (default: the example inputs' batch)")
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="measurements per op; the fastest counts (default: 5; the whole step gets 3x as many, their median)",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed calls before measuring (default: 2)")
    p.add_argument("--threads", type=int, help="torch CPU threads (1 times most steadily on a busy machine)")
    p.add_argument("--method", default="auto", choices=("auto", "fx", "export"), help="capture method")
    p.add_argument("--no-cache", action="store_true", help="measure again even when a cached profile exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dapple_ir.frontend.profiler import cache_dir, profile_spec, write_profile

    if args.threads is not None and args.threads < 1:
        raise DappleError(f"--threads must be at least 1, not {args.threads}")
    result = profile_spec(
        args.model,
        device=args.device,
        microbatch=args.microbatch,
        repeats=args.repeats,
        warmup=args.warmup,
        use_cache=not args.no_cache,
        progress=None if args.quiet else sys.stderr,
        method=args.method,
        threads=args.threads,
    )
    write_profile(result, args.output)
    how = f"from the cache in {cache_dir()}" if result.get("cached") else "measured"
    print(
        f"profile: {len(result['ops'])} ops on {result['device']} at microbatch {result['microbatch']} ({how}): "
        f"forward {result['total_fwd_s'] * 1e3:.3f} ms, backward {result['total_bwd_s'] * 1e3:.3f} ms -> {args.output}",
        file=sys.stderr,
    )
    return 0
