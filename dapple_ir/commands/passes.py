"""`dapple passes`: list registered passes with their options and one-line docs."""

from __future__ import annotations

import argparse
import dataclasses

from dapple_ir.registry import all_passes, load_plugin, option_name


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "passes",
        help="list registered passes and their options",
        description="List every registered pass (built-in, plugin, entry point) with its options.",
        epilog="example:\n  dapple passes --pass-plugin examples/custom_pass.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--pass-plugin", action="append", default=[], metavar="FILE", help="load passes from FILE")
    p.set_defaults(func=run)


def describe_passes() -> str:
    """One block per pass: name, summary, then each option with its type and default."""
    lines: list[str] = []
    for name, cls in all_passes().items():
        lines.append(f"{name}  —  {cls.summary()}")
        for f in cls.options():
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            default = "" if f.default is dataclasses.MISSING else f" (default: {f.default})"
            doc = f"  {f.metadata['doc']}" if "doc" in f.metadata else ""
            lines.append(f"    {option_name(f.name)}: {kind}{default}{doc}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    for plugin in args.pass_plugin:
        load_plugin(plugin)
    print(describe_passes())
    return 0
