"""Cluster specs from TOML files (`--cluster cluster.toml`), and `resolve_cluster`, which reads a
`--cluster` value: a TOML file path or a shorthand. docs/cluster.md documents the schema.

All quantities are in base units (bytes, FLOP/s, bytes/s, seconds); TOML reads `16e9` as a float.

    name = "two V100 servers"       # optional, for reports
    nodes = 2
    devices_per_node = 8
    device = "V100-16GB"            # every node's device kind: a preset or a [device_kinds.X] table
    # node_devices = ["A100-80GB", "my-gpu"]   # or one kind per node (heterogeneous); sets nodes
    # cores_per_node = 2            # CPU ranks: the cores a node's ranks share, where fewer than its devices

    [device_kinds.my-gpu]           # optional custom kinds; `base` starts from a preset
    base = "V100-16GB"
    memory_bytes = 16e9
    peak_flops = { f32 = 15.7e12, f16 = 125e12 }
    mem_bandwidth = 900e9
    op_overhead = 3e-6              # device seconds per kernel call (launch gap, ramp), added to its roofline time
    host_forward = 15e-6            # host seconds eager PyTorch issues an op in: a call takes at least this
    host_backward = 10e-6           # the same for its backward (the autograd engine; no Python)
    busy_receive_slowdown = 1.0     # a transfer into the device moves this much slower while it computes
                                    # (1: own hardware for it; above 1 on a CPU host whose cores all compute)
    split_backward_overhead = 0.0   # seconds a split (zb-h1) backward adds per op with parameters
    split_backward_per_byte = 0.0   # and per byte of those ops' parameters
    instruction_overhead = 0.0      # host seconds per compute instruction, outside its ops
    message_overhead = 0.0          # host seconds per send or receive, at each end
    wake_overhead = 0.0             # seconds a blocked rank waits for a core once its data is there
    reduce_per_byte = 0.0           # host seconds per byte an allreduce member reduces, beyond the links

    [fabric]                        # inside a node; default: the first node's machine preset
    kind = "switch"                 # "switch": a port per device; "bus": one link all transfers share
    bandwidth = 25e9                # bytes/s each way: one port's, or the bus's
    latency = 5e-6

    [network]                       # between nodes; default: the machine preset's
    cards = 1                       # network cards per node; 0: one per device
    bandwidth = 3.125e9             # bytes/s each way, per card (25 Gbit/s)
    latency = 20e-6
    card_devices = [[0, 1, 2, 3, 4, 5, 6, 7]]   # optional: the device slots behind each card

    [efficiency]                    # fraction of peak reached per op class (`dapple calibrate` fits it)
    matmul = 0.6

The older `[links.intra_node]` and `[links.inter_node]` tables (bandwidth, latency) are still read, as
the fabric's and the network's bandwidth and latency. Unknown keys are errors (a typo must not
silently fall back to a default); every error names the file, the line and the field.
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any

from dapple_ir.cluster.spec import (
    FABRICS,
    MACHINES,
    MAX_BUSY_RECEIVE_SLOWDOWN,
    MAX_DEVICES,
    PRESETS,
    ClusterSpec,
    DeviceKind,
    Link,
    Machine,
    check_device_count,
    parse_shorthand,
)
from dapple_ir.errors import ClusterError

_TOP_KEYS = {
    "name",
    "nodes",
    "devices_per_node",
    "device",
    "node_devices",
    "device_kinds",
    "links",
    "fabric",
    "network",
    "efficiency",
    "cores_per_node",
}
#: A device kind's figures that may be 0 and default to 0 (or the base preset's): what the host's own work and a
#: split backward cost.
_PRICE_KEYS = (
    "host_forward",
    "host_backward",
    "split_backward_overhead",
    "split_backward_per_byte",
    "instruction_overhead",
    "message_overhead",
    "wake_overhead",
    "reduce_per_byte",
)
_KIND_KEYS = {
    "base",
    "memory_bytes",
    "peak_flops",
    "mem_bandwidth",
    "op_overhead",
    "busy_receive_slowdown",
    *_PRICE_KEYS,
}
_LINK_KEYS = {"bandwidth", "latency"}
_FABRIC_KEYS = {"kind", "bandwidth", "latency"}
_NETWORK_KEYS = {"cards", "bandwidth", "latency", "card_devices"}


class _Reader:
    """Reads fields of one file, raising errors that name the file, the field and its line."""

    def __init__(self, path: str, text: str = "") -> None:
        self.path = path
        self.lines = text.splitlines()

    def error(self, field: str, message: str) -> ClusterError:
        line = self.line_of(field)
        where = f"{self.path}:{line}" if line else self.path
        return ClusterError(f"cluster file {where}: field '{field}' {message}")

    def line_of(self, field: str) -> int | None:
        """The line that sets `field` (`network.cards`, `node_devices[1]`), or its table's header."""
        parts = field.split("[")[0].split(".")
        table, key = ".".join(parts[:-1]), parts[-1]
        current, header = "", None
        for number, raw in enumerate(self.lines, start=1):
            text = raw.split("#")[0].strip()
            if text.startswith("[") and text.endswith("]"):
                current = text.strip("[]").strip()
                if current == field:
                    header = header or number
                continue
            name = text.split("=")[0].strip().strip('"')
            if "=" in text and ((current == table and name == key) or (not current and name == field)):
                return number
        return header

    def check_keys(self, table: dict[str, Any], allowed: set[str], where: str) -> None:
        for key in table:
            if key not in allowed:
                field = f"{where}.{key}" if where else key
                raise self.error(field, f"is not known; expected one of: {', '.join(sorted(allowed))}")

    def positive(self, value: object, field: str, *, integer: bool = False, allow_zero: bool = False) -> float:
        kind = "a positive integer" if integer else "a positive number"
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(field, f"must be {kind}, not {value!r}")
        if integer and not isinstance(value, int):
            raise self.error(field, f"must be {kind}, not {value!r}")
        if not math.isfinite(value):
            raise self.error(field, f"must be {kind}, not {value!r}: every figure of a cluster is finite")
        if value < 0 or (value == 0 and not allow_zero):
            raise self.error(field, f"must be {kind}, not {value!r}")
        low, high, unit = _range_of(field)
        if value > high or (value < low and value != 0):
            raise self.error(
                field, f"is {value:.3g}, beyond any real cluster ({low:g} to {high:g}{unit}{' or 0' * allow_zero})"
            )
        return float(value)

    def table(self, value: object, field: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.error(field, f"must be a table, not {value!r}")
        return value


#: The largest number a field without a range of its own takes (counts: nodes, devices, cores).
_MAX_NUMBER = 1e30
#: (least, most, unit) of a figure, by its key (a peak FLOP/s by its table): far beyond any real device or link on
#: either side, and within what the planner's integer models hold (a memory of 1e29 bytes, a latency of 1e6 s or
#: a bandwidth of 1e-20 B/s overflowed them).
_RANGES: dict[str, tuple[float, float, str]] = {
    "memory_bytes": (1e6, 1e18, "bytes"),
    "mem_bandwidth": (1e6, 1e16, "B/s"),
    "peak_flops": (1e6, 1e21, "FLOP/s"),
    "bandwidth": (1e3, 1e16, "B/s"),
    "latency": (0.0, 1.0, "s"),
    "op_overhead": (0.0, 1.0, "s"),
    "host_forward": (0.0, 1.0, "s"),
    "host_backward": (0.0, 1.0, "s"),
    "instruction_overhead": (0.0, 1.0, "s"),
    "message_overhead": (0.0, 1.0, "s"),
    "wake_overhead": (0.0, 1.0, "s"),
    "split_backward_overhead": (0.0, 1.0, "s"),
    "split_backward_per_byte": (0.0, 1e-3, "s per byte"),
    "reduce_per_byte": (0.0, 1e-3, "s per byte"),
    "busy_receive_slowdown": (1.0, MAX_BUSY_RECEIVE_SLOWDOWN, "times"),
}


def _range_of(field: str) -> tuple[float, float, str]:
    """The range of a field (`device_kinds.x.peak_flops.f32` by `peak_flops`), else (0, _MAX_NUMBER)."""
    parts = field.split(".")
    key = parts[-2] if len(parts) > 1 and parts[-2] == "peak_flops" else parts[-1]
    low, high, unit = _RANGES.get(key, (0.0, _MAX_NUMBER, ""))
    return low, high, f" {unit}" if unit else ""


def resolve_cluster(text: str) -> ClusterSpec:
    """A cluster from a shorthand (`2x8xV100-16GB`) or a TOML file path (ending in `.toml`); either way at
    most `MAX_DEVICES` (65,536) devices, so the planner's work stays bounded."""
    if text.endswith(".toml"):
        return load_cluster_toml(text)
    return parse_shorthand(text)


def load_cluster_toml(path: str) -> ClusterSpec:
    """Read and check a cluster TOML file."""
    file = Path(path)
    if not file.is_file():
        raise ClusterError(f"cluster file {path} does not exist")
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ClusterError(
            f"cluster file {path} is not text: byte {exc.start} ({exc.object[exc.start]:#04x}) is not UTF-8, which "
            "TOML requires; is it the file you meant?"
        ) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ClusterError(f"cluster file {path} is not valid TOML: {exc}") from None
    except RecursionError:
        raise ClusterError(
            f"cluster file {path} nests arrays or tables too deeply to read; a cluster file needs at most three "
            "levels ([device_kinds.NAME] with peak_flops, network.card_devices)"
        ) from None
    return cluster_from_dict(data, str(path), text)


def cluster_from_dict(data: dict[str, Any], path: str = "<cluster>", text: str = "") -> ClusterSpec:
    """A cluster spec from the parsed TOML table (see the module docstring for the fields); `text`, the
    file's text, lets errors name the line."""
    r = _Reader(path, text)
    r.check_keys(data, _TOP_KEYS, "")
    kinds = _device_kinds(r, r.table(data.get("device_kinds", {}), "device_kinds"))
    node_names = _node_kind_names(r, data)
    for i, name in enumerate(node_names):
        if name not in kinds and name not in PRESETS:
            field = f"node_devices[{i}]" if "node_devices" in data else "device"
            known = ", ".join([*PRESETS, *kinds])
            raise r.error(
                field,
                f"names device kind '{name}', which is neither a preset nor a [device_kinds] table; known: {known}",
            )
    per_node = int(r.positive(data.get("devices_per_node"), "devices_per_node", integer=True))
    check_device_count(len(node_names), per_node, f"cluster file {path}")
    node_kinds = tuple(kinds.get(n) or PRESETS[n] for n in node_names)
    machine = _machine_of(data, node_names[0])
    links = r.table(data.get("links", {}), "links")
    r.check_keys(links, {"intra_node", "inter_node"}, "links")
    fabric = r.table(data.get("fabric", {}), "fabric")
    r.check_keys(fabric, _FABRIC_KEYS, "fabric")
    network = r.table(data.get("network", {}), "network")
    r.check_keys(network, _NETWORK_KEYS, "network")
    intra, intra_at = _link(r, links, "intra_node", fabric, "fabric", machine.intra if machine else None)
    inter, inter_at = _link(r, links, "inter_node", network, "network", machine.inter if machine else None)
    if inter.bandwidth > intra.bandwidth:
        raise r.error(
            f"{inter_at}.bandwidth",
            f"({inter.bandwidth:g} B/s) exceeds {intra_at}.bandwidth ({intra.bandwidth:g} B/s); "
            "devices of one node are never farther apart than devices of two",
        )
    kind = fabric.get("kind", machine.fabric if machine else "switch")
    if kind not in FABRICS:
        raise r.error("fabric.kind", f"must be one of {', '.join(repr(f) for f in FABRICS)}, not {kind!r}")
    cards, card_devices = _cards(r, network, per_node, machine)
    efficiency = _efficiency(r, r.table(data.get("efficiency", {}), "efficiency"))
    name = data.get("name", path)
    if not isinstance(name, str):
        raise r.error("name", f"must be a string, not {name!r}")
    cores = int(r.positive(data.get("cores_per_node", 0), "cores_per_node", integer=True, allow_zero=True))
    return ClusterSpec(
        node_kinds,
        per_node,
        intra,
        inter,
        name=name,
        efficiency=efficiency,
        fabric=kind,
        cards=cards,
        card_devices=card_devices,
        machine=machine.name if machine and not (links or fabric or network) else "",
        cores_per_node=cores,
    )


def _node_kind_names(r: _Reader, data: dict[str, Any]) -> list[str]:
    if "node_devices" in data:
        names = data["node_devices"]
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise r.error("node_devices", f"must be a non-empty list of device kind names, not {names!r}")
        if "nodes" in data and data["nodes"] != len(names):
            raise r.error("nodes", f"is {data['nodes']!r} but node_devices lists {len(names)} nodes")
        if "device" in data:
            raise r.error("device", "and node_devices both set the device kinds; give one of them")
        return list(names)
    if "device" not in data:
        raise r.error("device", "is missing: name the device kind (a preset such as V100-16GB) or give node_devices")
    device = data["device"]
    if not isinstance(device, str):
        raise r.error("device", f"must be a device kind name, not {device!r}")
    nodes = data.get("nodes", 1)
    r.positive(nodes, "nodes", integer=True)
    if nodes > MAX_DEVICES:
        raise r.error("nodes", f"is {nodes:,}, more than the {MAX_DEVICES:,} devices a cluster may have")
    return [device] * nodes


def _device_kinds(r: _Reader, tables: dict[str, Any]) -> dict[str, DeviceKind]:
    kinds: dict[str, DeviceKind] = {}
    for name, raw in tables.items():
        where = f"device_kinds.{name}"
        table = r.table(raw, where)
        r.check_keys(table, _KIND_KEYS, where)
        base = table.get("base")
        if base is not None and base not in PRESETS:
            raise r.error(f"{where}.base", f"names '{base}', which is not a preset; presets: {', '.join(PRESETS)}")
        preset = PRESETS[base] if base else None
        for key in ("memory_bytes", "peak_flops", "mem_bandwidth"):
            if preset is None and key not in table:
                raise r.error(f"{where}.{key}", 'is missing (or give `base = "<preset>"` to start from a preset)')
        memory = r.positive(table.get("memory_bytes", preset.memory_bytes if preset else 0), f"{where}.memory_bytes")
        bandwidth = r.positive(
            table.get("mem_bandwidth", preset.mem_bandwidth if preset else 0), f"{where}.mem_bandwidth"
        )
        flops = dict(preset.peak_flops) if preset else {}
        for dtype, value in r.table(table.get("peak_flops", {}), f"{where}.peak_flops").items():
            flops[dtype] = r.positive(value, f"{where}.peak_flops.{dtype}")
        if "f32" not in flops:
            raise r.error(f"{where}.peak_flops.f32", "is missing; every device needs its f32 peak")
        overhead = r.positive(
            table.get("op_overhead", preset.op_overhead if preset else 0.0), f"{where}.op_overhead", allow_zero=True
        )
        slowdown = r.positive(
            table.get("busy_receive_slowdown", preset.busy_receive_slowdown if preset else 1.0),
            f"{where}.busy_receive_slowdown",
        )
        if slowdown < 1.0:
            raise r.error(
                f"{where}.busy_receive_slowdown",
                f"is {slowdown:g}; a transfer into a busy device is at most as fast as into a waiting one (>= 1)",
            )
        # Host and split prices: seconds, 0 allowed, a preset's figure where the table leaves them out.
        priced = {
            key: r.positive(table.get(key, getattr(preset, key) if preset else 0.0), f"{where}.{key}", allow_zero=True)
            for key in _PRICE_KEYS
        }
        kinds[name] = DeviceKind(
            name, memory, flops, bandwidth, op_overhead=overhead, busy_receive_slowdown=slowdown, **priced
        )
    return kinds


def _machine_of(data: dict[str, Any], kind_name: str) -> Machine | None:
    """The machine preset whose network applies: the kind's own, or the base's of a custom kind."""
    if kind_name in PRESETS and kind_name not in data.get("device_kinds", {}):
        return MACHINES.get(kind_name)
    base = data.get("device_kinds", {}).get(kind_name, {}).get("base")
    return MACHINES.get(base) if isinstance(base, str) else None


def _link(
    r: _Reader, links: dict[str, Any], old_key: str, table: dict[str, Any], key: str, default: Link | None
) -> tuple[Link, str]:
    """A link from `[fabric]`/`[network]` or the older `[links.*]` table, and the name of where it came
    from (for errors)."""
    old = r.table(links.get(old_key, {}), f"links.{old_key}")
    r.check_keys(old, _LINK_KEYS, f"links.{old_key}")
    given = {k: table[k] for k in _LINK_KEYS if k in table}
    if old and given:
        raise r.error(f"links.{old_key}", f"and [{key}] both set the link; give its bandwidth and latency in [{key}]")
    where = f"links.{old_key}" if old else key
    values = old or given
    for name in ("bandwidth", "latency"):
        if default is None and name not in values:
            raise r.error(f"{where}.{name}", "is missing (no preset device kind supplies a default)")
    bandwidth = r.positive(values.get("bandwidth", default.bandwidth if default else 0), f"{where}.bandwidth")
    latency = r.positive(values.get("latency", default.latency if default else 0), f"{where}.latency", allow_zero=True)
    return Link(bandwidth, latency), where


def _cards(
    r: _Reader, network: dict[str, Any], per_node: int, machine: Machine | None
) -> tuple[int, tuple[tuple[int, ...], ...]]:
    default = min(machine.cards, per_node) if machine else 0
    cards = int(r.positive(network.get("cards", default), "network.cards", integer=True, allow_zero=True))
    if cards > per_node:
        raise r.error("network.cards", f"is {cards}, more than the {per_node} devices of a node (0: one per device)")
    raw = network.get("card_devices")
    if raw is None:
        return cards, ()
    count = cards or per_node
    if not isinstance(raw, list) or not all(isinstance(g, list) and all(type(x) is int for x in g) for g in raw):
        raise r.error("network.card_devices", f"must be a list of lists of device slots, not {raw!r}")
    slots = sorted(x for group in raw for x in group)
    if len(raw) != count or slots != list(range(per_node)) or not all(raw):
        raise r.error(
            "network.card_devices",
            f"must give each of the {count} cards its device slots, every slot 0..{per_node - 1} behind exactly "
            f"one card, not {raw!r}",
        )
    return cards, tuple(tuple(group) for group in raw)


def _efficiency(r: _Reader, table: dict[str, Any]) -> dict[str, float]:
    result: dict[str, float] = {}
    for op_class, value in table.items():
        field = f"efficiency.{op_class}"
        fraction = r.positive(value, field)
        if fraction > 1:
            raise r.error(field, f"is a fraction of peak, at most 1, not {value!r}")
        result[op_class] = fraction
    return result


def cluster_to_toml(spec: ClusterSpec) -> str:
    """TOML text that `load_cluster_toml` reads back into an equal spec (used by `dapple calibrate`)."""
    lines = [f"name = {_toml_str(spec.name)}", f"devices_per_node = {spec.devices_per_node}"]
    names = [k.name for k in spec.node_kinds]
    lines.append("node_devices = [" + ", ".join(_toml_str(n) for n in names) + "]")
    if spec.cores_per_node:
        lines.append(f"cores_per_node = {spec.cores_per_node}")
    for kind in {k.name: k for k in spec.node_kinds}.values():
        lines += ["", f"[device_kinds.{_toml_str(kind.name)}]", f"memory_bytes = {kind.memory_bytes!r}"]
        flops = ", ".join(f"{_toml_str(d)} = {v!r}" for d, v in kind.peak_flops.items())
        lines += [f"peak_flops = {{ {flops} }}", f"mem_bandwidth = {kind.mem_bandwidth!r}"]
        if kind.op_overhead:
            lines.append(f"op_overhead = {kind.op_overhead!r}")
        if kind.busy_receive_slowdown != 1.0:
            lines.append(f"busy_receive_slowdown = {kind.busy_receive_slowdown!r}")
        for key in _PRICE_KEYS:
            if getattr(kind, key):
                lines.append(f"{key} = {getattr(kind, key)!r}")
    lines += ["", "[fabric]", f"kind = {_toml_str(spec.fabric)}"]
    lines += [f"bandwidth = {spec.intra.bandwidth!r}", f"latency = {spec.intra.latency!r}"]
    lines += ["", "[network]", f"cards = {spec.cards}"]
    lines += [f"bandwidth = {spec.inter.bandwidth!r}", f"latency = {spec.inter.latency!r}"]
    if spec.card_devices:
        lines.append("card_devices = [" + ", ".join(str(list(g)) for g in spec.card_devices) + "]")
    if spec.efficiency:
        lines += ["", "[efficiency]"] + [f"{_toml_str(k)} = {v!r}" for k, v in spec.efficiency.items()]
    return "\n".join(lines) + "\n"


def _toml_str(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'
