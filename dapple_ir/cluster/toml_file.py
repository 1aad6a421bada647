"""Cluster specs from TOML files (`--cluster cluster.toml`), and `resolve_cluster`, which reads a
`--cluster` value: a TOML file path or a shorthand.

All quantities are in base units (bytes, FLOP/s, bytes/s, seconds); TOML reads `16e9` as a float.

    name = "two V100 servers"       # optional, for reports
    nodes = 2
    devices_per_node = 8
    device = "V100-16GB"            # every node's device kind: a preset or a [device_kinds.X] table
    # node_devices = ["A100-80GB", "my-gpu"]   # or one kind per node (heterogeneous); sets nodes

    [device_kinds.my-gpu]           # optional custom kinds; `base` starts from a preset
    base = "V100-16GB"
    memory_bytes = 16e9
    peak_flops = { f32 = 15.7e12, f16 = 125e12 }
    mem_bandwidth = 900e9
    op_overhead = 5e-6              # seconds per op call (launch), added to each roofline time

    [links.intra_node]              # default: the first node's preset (or its kind's base)
    bandwidth = 25e9
    latency = 5e-6
    [links.inter_node]
    bandwidth = 1e9
    latency = 20e-6

    [efficiency]                    # fraction of peak reached per op class (`dapple calibrate` fits it)
    matmul = 0.6

Unknown keys are errors (a typo must not silently fall back to a default); every error names the
file and the field.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from dapple_ir.cluster.spec import DEFAULT_LINKS, PRESETS, ClusterSpec, DeviceKind, Link, parse_shorthand
from dapple_ir.errors import ClusterError

_TOP_KEYS = {"name", "nodes", "devices_per_node", "device", "node_devices", "device_kinds", "links", "efficiency"}
_KIND_KEYS = {"base", "memory_bytes", "peak_flops", "mem_bandwidth", "op_overhead"}
_LINK_KEYS = {"bandwidth", "latency"}


class _Reader:
    """Reads fields of one file, raising errors that name the file and the field."""

    def __init__(self, path: str) -> None:
        self.path = path

    def error(self, field: str, message: str) -> ClusterError:
        return ClusterError(f"cluster file {self.path}: field '{field}' {message}")

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
        if value < 0 or (value == 0 and not allow_zero):
            raise self.error(field, f"must be {kind}, not {value!r}")
        return float(value)

    def table(self, value: object, field: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.error(field, f"must be a table, not {value!r}")
        return value


def resolve_cluster(text: str) -> ClusterSpec:
    """A cluster from a shorthand (`2x8xV100-16GB`) or a TOML file path (ending in `.toml`)."""
    if text.endswith(".toml"):
        return load_cluster_toml(text)
    return parse_shorthand(text)


def load_cluster_toml(path: str) -> ClusterSpec:
    """Read and check a cluster TOML file."""
    file = Path(path)
    if not file.is_file():
        raise ClusterError(f"cluster file {path} does not exist")
    try:
        data = tomllib.loads(file.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ClusterError(f"cluster file {path} is not valid TOML: {exc}") from None
    return cluster_from_dict(data, str(path))


def cluster_from_dict(data: dict[str, Any], path: str = "<cluster>") -> ClusterSpec:
    """A cluster spec from the parsed TOML table (see the module docstring for the fields)."""
    r = _Reader(path)
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
    node_kinds = tuple(kinds.get(n) or PRESETS[n] for n in node_names)
    per_node = int(r.positive(data.get("devices_per_node"), "devices_per_node", integer=True))
    links = r.table(data.get("links", {}), "links")
    r.check_keys(links, {"intra_node", "inter_node"}, "links")
    default_kind = _preset_of(data, node_names[0])
    intra = _link(r, links, "intra_node", default_kind, 0)
    inter = _link(r, links, "inter_node", default_kind, 1)
    if inter.bandwidth > intra.bandwidth:
        raise r.error(
            "links.inter_node.bandwidth",
            f"({inter.bandwidth:g} B/s) exceeds links.intra_node.bandwidth ({intra.bandwidth:g} B/s); "
            "devices of one node are never farther apart than devices of two",
        )
    efficiency = _efficiency(r, r.table(data.get("efficiency", {}), "efficiency"))
    name = data.get("name", path)
    if not isinstance(name, str):
        raise r.error("name", f"must be a string, not {name!r}")
    return ClusterSpec(node_kinds, per_node, intra, inter, name=name, efficiency=efficiency)


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
    nodes = int(r.positive(data.get("nodes", 1), "nodes", integer=True))
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
        kinds[name] = DeviceKind(name, memory, flops, bandwidth, op_overhead=overhead)
    return kinds


def _preset_of(data: dict[str, Any], kind_name: str) -> str | None:
    """The preset whose default links apply: the kind itself, or the base of a custom kind."""
    if kind_name in PRESETS and kind_name not in data.get("device_kinds", {}):
        return kind_name
    base = data.get("device_kinds", {}).get(kind_name, {}).get("base")
    return base if isinstance(base, str) else None


def _link(r: _Reader, links: dict[str, Any], key: str, preset: str | None, which: int) -> Link:
    where = f"links.{key}"
    table = r.table(links.get(key, {}), where)
    r.check_keys(table, _LINK_KEYS, where)
    default = DEFAULT_LINKS[preset][which] if preset in DEFAULT_LINKS else None
    for field in ("bandwidth", "latency"):
        if default is None and field not in table:
            raise r.error(f"{where}.{field}", "is missing (no preset device kind supplies a default)")
    bandwidth = r.positive(table.get("bandwidth", default.bandwidth if default else 0), f"{where}.bandwidth")
    latency = r.positive(table.get("latency", default.latency if default else 0), f"{where}.latency", allow_zero=True)
    return Link(bandwidth, latency)


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
    for kind in {k.name: k for k in spec.node_kinds}.values():
        lines += ["", f"[device_kinds.{_toml_str(kind.name)}]", f"memory_bytes = {kind.memory_bytes!r}"]
        flops = ", ".join(f"{_toml_str(d)} = {v!r}" for d, v in kind.peak_flops.items())
        lines += [f"peak_flops = {{ {flops} }}", f"mem_bandwidth = {kind.mem_bandwidth!r}"]
        if kind.op_overhead:
            lines.append(f"op_overhead = {kind.op_overhead!r}")
    for key, link in (("intra_node", spec.intra), ("inter_node", spec.inter)):
        lines += ["", f"[links.{key}]", f"bandwidth = {link.bandwidth!r}", f"latency = {link.latency!r}"]
    if spec.efficiency:
        lines += ["", "[efficiency]"] + [f"{_toml_str(k)} = {v!r}" for k, v in spec.efficiency.items()]
    return "\n".join(lines) + "\n"


def _toml_str(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'
