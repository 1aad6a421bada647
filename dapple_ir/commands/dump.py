"""`dapple dump MODEL_SPEC`: capture a model (or import a profile) and print its IR or a summary."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dapple_ir.frontend.spec_loader import capture_spec
from dapple_ir.ir import Module, Op, OpKind
from dapple_ir.ir.printer import print_module
from dapple_ir.units import format_bytes, format_count, format_seconds

_EPILOG = """examples:
  dapple dump examples/gpt.py:factory
  dapple dump examples/gpt.py:factory_large --summary
  dapple dump examples/control_flow.py:factory --method export -o control_flow.dapple
  dapple dump profile:examples/profiles/pipedream-vgg16.txt --profile-batch 64 --summary
"""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "dump",
        help="capture a model and print its IR (or a per-module summary)",
        description=(
            "Capture MODEL_SPEC (path/to/file.py:factory, package.module:factory or profile:path) into the IR "
            "and print its text form, or with --summary a table by top-level module: ops, parameters, "
            "activation bytes, and FLOPs and times where the IR has them."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model_spec", metavar="MODEL_SPEC", help="file.py:factory, package.module:factory or profile:path")
    p.add_argument("--method", choices=("auto", "fx", "export"), default="auto", help="capture method (default auto)")
    p.add_argument(
        "--device",
        choices=("meta", "cpu"),
        default="meta",
        help="where the factory builds the model: meta (no weights in memory, default) or cpu",
    )
    p.add_argument("--summary", action="store_true", help="print a table by top-level module instead of the IR")
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of standard output")
    p.add_argument("--profile-batch", type=int, metavar="N", help="batch the times of a profile: spec were measured at")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    notes: list[str] = []
    module = capture_spec(
        args.model_spec, method=args.method, device=args.device, profile_batch=args.profile_batch, notes=notes
    )
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    text = summary_table(module) if args.summary else print_module(module)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


# ------------------------------------------------------------------------------------- summary


@dataclass
class _Row:
    ops: int = 0
    params: int = 0
    param_bytes: float = 0.0
    act_bytes: float = 0.0
    out_bytes: float = 0.0
    sums: dict[str, float] = field(default_factory=dict)


#: Cost attributes summed per group when any op has them, with their column headings.
_COST_COLUMNS = (("fwd_flops", "fwd FLOPs"), ("bwd_flops", "bwd FLOPs"), ("fwd_s", "fwd time"), ("bwd_s", "bwd time"))


def group_of(op: Op) -> str:
    """Top-level module of an op; the items of a container (`blocks.3`) count as top-level."""
    if op.kind is OpKind.INPUT:
        return "(inputs)"
    if op.kind is OpKind.OUTPUT:
        return "(output)"
    path = op.attrs.module_path
    if path is None:
        return op.name if op.kind is OpKind.LAYER else "(top)"
    parts = path.split(".")
    if len(parts) > 1 and parts[1].isdigit():
        return ".".join(parts[:2])
    return parts[0]


def summary_table(module: Module) -> str:
    """A table by top-level module: ops, parameters, activation bytes, FLOPs and times where set."""
    params = {p.name: p for p in module.params}
    rows: dict[str, _Row] = {}
    counted: set[str] = set()
    for op in module.ops:
        row = rows.setdefault(group_of(op), _Row())
        row.ops += op.kind not in (OpKind.INPUT, OpKind.OUTPUT)
        row.act_bytes += op.attrs.act_bytes or 0.0
        if op.kind not in (OpKind.INPUT, OpKind.OUTPUT, OpKind.GET_ATTR):
            row.out_bytes += op.out_bytes
        row.param_bytes += op.attrs.param_bytes or 0.0
        for name in op.attrs.params or ():
            # A tied parameter counts once, with the first module that reads it.
            if name in counted or params[name].attrs.buffer:
                continue
            counted.add(name)
            row.params += params[name].type.numel
            row.param_bytes += params[name].nbytes
        for attr, _ in _COST_COLUMNS:
            value = getattr(op.attrs, attr)
            if value is not None:
                row.sums[attr] = row.sums.get(attr, 0.0) + value
    has_act = any(op.attrs.act_bytes is not None for op in module.ops)
    costs = [(attr, head) for attr, head in _COST_COLUMNS if any(attr in r.sums for r in rows.values())]
    header = ["module", "ops", "params", "param bytes", "act bytes" if has_act else "out bytes"]
    header += [head for _, head in costs]
    total = _Row()
    body: list[list[str]] = []
    for name, row in rows.items():
        body.append(_cells(name, row, has_act, costs))
        total.ops += row.ops
        total.params += row.params
        total.param_bytes += row.param_bytes
        total.act_bytes += row.act_bytes
        total.out_bytes += row.out_bytes
        for attr, value in row.sums.items():
            total.sums[attr] = total.sums.get(attr, 0.0) + value
    body.append(_cells("total", total, has_act, costs))
    batch = module.attrs.cost_batch or module.attrs.batch
    title = f"module @{module.name}: {len(module.params)} parameter tensors, batch {batch}"
    if module.attrs.capture_method:
        title += f", captured with {module.attrs.capture_method}"
    return title + "\n" + _render([header, *body])


def _cells(name: str, row: _Row, has_act: bool, costs: list[tuple[str, str]]) -> list[str]:
    cells = [name, str(row.ops), format_count(row.params), format_bytes(row.param_bytes, 1)]
    cells.append(format_bytes(row.act_bytes if has_act else row.out_bytes, 1))
    for attr, _ in costs:
        value = row.sums.get(attr)
        if value is None:
            cells.append("-")
        elif attr.endswith("_s"):
            cells.append(format_seconds(value, 2))
        else:
            cells.append(format_count(value))
    return cells


def _render(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
        if k == 0 or k == len(rows) - 2:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"
