"""`dapple opt FILE -p PIPELINE`: read IR text, run passes, print the result."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dapple_ir.errors import DappleError
from dapple_ir.ir.parser import parse_module, read_ir_file
from dapple_ir.ir.printer import print_module
from dapple_ir.pass_manager import PassManager, build_pipeline
from dapple_ir.plugins import load_plugin
from dapple_ir.registry import PassContext


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "opt",
        help="run passes over an IR file and print the result",
        description="Read IR text (a file or - for stdin), run a pass pipeline, print the resulting IR.",
        epilog="example:\n  dapple opt model.dapple -p 'dce,verify' --print-ir-after=dce --time-passes",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_pass_manager_flags(p)
    p.add_argument("file", help="IR file (.dapple) or - for standard input")
    p.add_argument("-p", "--pipeline", default="", help="pass pipeline, e.g. 'dce,verify'")
    p.add_argument("-o", "--output", help="write the IR here instead of standard output")
    p.set_defaults(func=run)


def add_pass_manager_flags(p: argparse.ArgumentParser) -> None:
    """The flags every command that runs passes shares."""
    p.add_argument("--no-verify", action="store_true", help="do not verify the IR after every pass")
    p.add_argument("--print-ir-after", action="append", default=[], metavar="PASS", help="print IR after PASS")
    p.add_argument("--print-ir-after-all", action="store_true", help="print IR after every pass")
    p.add_argument("--dump-dir", metavar="DIR", help="write numbered IR files (003_plan.dapple) into DIR")
    p.add_argument("--time-passes", action="store_true", help="report the time each pass took")
    p.add_argument("--pass-plugin", action="append", default=[], metavar="FILE", help="load passes from FILE")
    p.add_argument("--cluster", help="cluster shorthand (2x8xV100-16GB) or TOML file, for passes that need one")


def pass_manager_options(args: argparse.Namespace) -> dict[str, Any]:
    """Load the `--pass-plugin` files; the `PassManager` keyword arguments the shared flags ask for."""
    for plugin in args.pass_plugin:
        load_plugin(plugin)
    return {
        "verify": not args.no_verify,
        "print_ir_after": set(args.print_ir_after),
        "print_ir_after_all": args.print_ir_after_all,
        "dump_dir": Path(args.dump_dir) if args.dump_dir else None,
        "time_passes": args.time_passes,
    }


def pass_manager_from_args(args: argparse.Namespace, pipeline: str) -> PassManager:
    options = pass_manager_options(args)
    return PassManager(build_pipeline(pipeline) if pipeline else [], **options)


def run(args: argparse.Namespace) -> int:
    if args.file == "-":
        text, name = sys.stdin.read(), "<stdin>"
    else:
        path = Path(args.file)
        if not path.is_file():
            raise DappleError(f"IR file {path} does not exist")
        text, name = read_ir_file(path), str(path)
    module = parse_module(text, name)
    manager = pass_manager_from_args(args, args.pipeline)
    manager.run(module, PassContext(cluster=args.cluster, log=lambda m: print(m, file=sys.stderr)))
    out = print_module(module)
    if args.output:
        Path(args.output).write_text(out)
    else:
        sys.stdout.write(out)
    return 0
