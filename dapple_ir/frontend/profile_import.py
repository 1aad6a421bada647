"""Import the per-layer profiles published by PipeDream and DAPPLE (`profile:path/graph.txt`).

The format (one node a line, edges as indented lines):

    node12 -- Conv2d(128, 256, ...) -- forward_compute_time=10.814, backward_compute_time=18.335,
        activation_size=411041792.000, parameter_size=1180672.000      (all on one line)
    \tnode11 -- node12

The published files vary in their whitespace, and every variant reads: edges indented by a tab,
spaces, or a space then a tab; Windows line ends (CRLF); blank lines; trailing spaces. A line is an
edge when it holds exactly two names joined by ` -- `, whatever its indent; any other non-blank line
is a node.

Times are milliseconds for one minibatch of the profile batch; sizes are bytes, and
`activation_size` may be a list `[a; b]` (a node with several outputs), which is summed. Each node
becomes one `layer` op whose costs describe the profile batch; edges become operands, so branches
(residual adds, GNMT's parallel LSTM states) stay in the graph. Such a module can be planned and
simulated, not run.

The times stay as measured, at the profile batch (`cost_batch`). Whatever moves them to another
batch (the planner for each microbatch count, `plan` for the one it chose,
`annotate-cost{microbatch=N}`) keeps each node's fixed part, the device's per-call `op_overhead`
(`dapple_ir.cluster.roofline.rescaled_s`), and scales only the rest: a node measured at 64
samples is not 64 times faster at one.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass, field
from pathlib import Path

from dapple_ir.errors import CaptureError
from dapple_ir.ir import Module, ModuleAttrs, Op, OpaqueType, OpAttrs, OpKind

#: How a model spec names a profile instead of a model: `profile:path/graph.txt`.
PROFILE_PREFIX = "profile:"
#: Profile batch of files whose name does not say it (`...-pbs-32.txt` does): PipeDream's profiles.
DEFAULT_PROFILE_BATCH = 64

_METRICS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")
_PBS = re.compile(r"pbs-(\d+)")
_NODE_NUMBER = re.compile(r"node(\d+)\Z")
_EDGE = re.compile(r"\s*(\S+)\s+--\s+(\S+)\s*\Z")
#: (bound, unit) of a metric, by whether it is a time: 1e9 ms is 11.6 days for one layer's minibatch, 1e15 bytes a
#: petabyte; the planner's integer models stay within 64 bits well beyond both.
_BOUNDS = {True: (1e9, "milliseconds"), False: (1e15, "bytes")}


@dataclass
class _Node:
    name: str
    label: str
    metrics: dict[str, float]
    line: int
    preds: list[str] = field(default_factory=list)


def default_profile_batch(path: str | Path) -> int:
    """The batch a profile's times describe, from its file name (`pbs-N`), else PipeDream's 64."""
    match = _PBS.search(Path(path).name)
    return int(match.group(1)) if match else DEFAULT_PROFILE_BATCH


def is_profile_spec(spec: str) -> bool:
    """Whether a model spec names an imported profile (`profile:path`) rather than a factory."""
    return spec.startswith(PROFILE_PREFIX)


def import_profile_spec(spec: str, batch: int | None = None) -> Module:
    """The module a `profile:path` spec names (`import_profile` of the path)."""
    return import_profile(spec.removeprefix(PROFILE_PREFIX), batch)


def import_profile(path: str, batch: int | None = None) -> Module:
    """Read a PipeDream/DAPPLE `graph.txt` into a module of `layer` ops in topological order.

    `batch` is the minibatch the times were measured at (`--profile-batch N`); by default it comes
    from the file name (`pbs-N`) or is PipeDream's 64.
    """
    file = Path(path)
    if not file.is_file():
        raise CaptureError(f"profile {path} does not exist (model spec 'profile:{path}')")
    if batch is not None and batch < 1:
        raise CaptureError(f"profile {path}: --profile-batch must be at least 1, not {batch}")
    nodes = _parse(file)
    order = _topological_order(file, nodes)
    ops: dict[str, Op] = {}
    for name in order:
        node = nodes[name]
        m = node.metrics
        attrs = OpAttrs(
            label=node.label,
            fwd_s=_seconds(m["forward_compute_time"]),
            bwd_s=_seconds(m["backward_compute_time"]),
            act_bytes=m["activation_size"],
            out_bytes=m["activation_size"],
            param_bytes=m["parameter_size"],
        )
        operands = [ops[p] for p in node.preds]
        ops[name] = Op(name, OpKind.LAYER, operands, OpaqueType(), target=name, attrs=attrs)
    profile_batch = batch if batch is not None else default_profile_batch(file)
    module_attrs = ModuleAttrs(
        batch=profile_batch, cost_batch=profile_batch, source=f"profile:{path}", capture_method="profile"
    )
    return Module(_module_name(file), ops=[ops[n] for n in order], attrs=module_attrs)


def _module_name(file: Path) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", file.stem) or "profile"


def _parse(file: Path) -> dict[str, _Node]:
    nodes: dict[str, _Node] = {}
    edges: list[tuple[str, str, int, int]] = []
    # utf-8-sig drops a byte-order mark; splitlines takes \n, \r\n and \r alike.
    for number, raw in enumerate(_text(file).splitlines(), start=1):
        if not raw.strip():
            continue
        edge = _EDGE.match(raw)
        if edge:
            edges.append((edge.group(1), edge.group(2), number, _column(raw)))
            continue
        node = _parse_node(file, number, raw)
        if node.name in nodes:
            raise CaptureError(
                f"{file}:{number}:{_column(raw)}: node {node.name} is defined twice "
                f"(first on line {nodes[node.name].line})"
            )
        nodes[node.name] = node
    for src, dst, number, column in edges:
        for end in (src, dst):
            if end not in nodes:
                raise CaptureError(f"{file}:{number}:{column}: edge {src} -- {dst} names {end}, which has no node line")
        if src not in nodes[dst].preds:
            nodes[dst].preds.append(src)
    if not nodes:
        raise CaptureError(f"profile {file} holds no nodes")
    return nodes


def _text(file: Path) -> str:
    data = file.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise CaptureError(
            f"{file}:{line}: profile is not text (byte {exc.start}, {data[exc.start]:#04x}, is not UTF-8); a profile "
            "is PipeDream's or DAPPLE's graph.txt"
        ) from None


def _column(raw: str, start: int = 0) -> int:
    """1-based column of the first non-blank character of `raw` at or after `start`."""
    rest = raw[start:]
    return start + len(rest) - len(rest.lstrip()) + 1


def _parse_node(file: Path, number: int, raw: str) -> _Node:
    # The description may hold commas and parentheses, so split on the first and last separator.
    first, last = raw.find(" -- "), raw.rfind(" -- ")
    if first < 0 or first == last:
        raise CaptureError(
            f"{file}:{number}:{_column(raw)}: a node line must read 'nodeN -- description -- metrics' and an "
            f"edge line 'nodeA -- nodeB', not {raw.strip()!r}"
        )
    name, label = raw[:first].strip(), raw[first + 4 : last].strip()
    metrics: dict[str, float] = {}
    offset = last + 4
    for item in re.split(r"(,\s*)(?![^\[]*\])", raw[offset:]):
        if not item.strip() or item.strip() == ",":
            offset += len(item)
            continue
        key, sep, value = item.partition("=")
        column = _column(raw, offset)
        if not sep:
            raise CaptureError(f"{file}:{number}:{column}: metric {item.strip()!r} of node {name} is not key=value")
        metrics[key.strip()] = _number(f"{file}:{number}:{column}", key.strip(), value.strip())
        offset += len(item)
    missing = [k for k in _METRICS if k not in metrics]
    if missing:
        raise CaptureError(f"{file}:{number}:{_column(raw)}: node {name} lacks {', '.join(missing)}")
    return _Node(name, label, metrics, number)


def _number(where: str, key: str, text: str) -> float:
    # A node with several outputs lists one size per output: `[a; b]`.
    parts = text[1:-1].split(";") if text.startswith("[") and text.endswith("]") else [text]
    try:
        values = [float(p) for p in parts if p.strip()]
    except ValueError:
        raise CaptureError(f"{where}: {key}={text} is not a number or a list [a; b] of numbers") from None
    if any(v < 0 for v in values):
        raise CaptureError(f"{where}: {key}={text} is negative")
    total, bound, unit = sum(values), *_BOUNDS[key.endswith("_time")]
    if not total <= bound:  # nan compares false
        raise CaptureError(
            f"{where}: {key}={text} is not a finite number of {unit} up to {bound:g}, beyond any layer a profile "
            "measures; was the file damaged?"
        )
    return total


def _order_key(name: str, line: int) -> tuple[int, int]:
    # Prefer the node numbering (PipeDream lists nodes out of order), then the file order.
    match = _NODE_NUMBER.match(name)
    return (int(match.group(1)) if match else line, line)


def _topological_order(file: Path, nodes: dict[str, _Node]) -> list[str]:
    indegree = {name: len(node.preds) for name, node in nodes.items()}
    succs: dict[str, list[str]] = {name: [] for name in nodes}
    for name, node in nodes.items():
        for pred in node.preds:
            succs[pred].append(name)
    ready = [(_order_key(n, nodes[n].line), n) for n, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        _, name = heapq.heappop(ready)
        order.append(name)
        for succ in succs[name]:
            indegree[succ] -= 1
            if indegree[succ] == 0:
                heapq.heappush(ready, (_order_key(succ, nodes[succ].line), succ))
    if len(order) < len(nodes):
        stuck = sorted(n for n, d in indegree.items() if d > 0)
        raise CaptureError(f"profile {file}: the edges form a cycle through {', '.join(stuck[:6])}")
    return order


def _seconds(ms: float) -> float:
    # Rounded so that 10.814 ms prints as 0.010814, not 0.010814000000000001.
    return round(ms / 1e3, 12)
