"""Cluster specs: nodes of devices, their speed and memory, and the links between them.

A spec comes from a shorthand (`2x8xV100-16GB`: 2 nodes of 8 V100s, `parse_shorthand`) or a TOML file
(`dapple_ir.cluster.toml_file`, whose `resolve_cluster` takes either). Device ids are global and
node-major: device d sits on node d // devices_per_node (for homogeneous clusters).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dapple_ir.errors import ClusterError
from dapple_ir.units import GB


@dataclass(frozen=True, slots=True)
class DeviceKind:
    """One kind of accelerator (or CPU)."""

    name: str
    """Preset name (`V100-16GB`)."""
    memory_bytes: float
    """Memory usable for training state."""
    peak_flops: dict[str, float]
    """Peak FLOP/s by dtype short name (`f32`, `f16`, `bf16`)."""
    mem_bandwidth: float
    """Memory bandwidth in bytes/s."""
    op_overhead: float = 0.0
    """Fixed seconds each op call costs on top of its roofline (dispatch, kernel launch); it
    dominates small ops on a CPU. `dapple calibrate` measures it."""

    def flops(self, dtype: str = "f32") -> float:
        return self.peak_flops.get(dtype, self.peak_flops["f32"])


@dataclass(frozen=True, slots=True)
class Link:
    """A point-to-point link: bandwidth in bytes/s and latency in seconds."""

    bandwidth: float
    latency: float

    def transfer_s(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth if nbytes > 0 else 0.0


#: Device presets. V100 figures follow DAPPLE's planner (16 GB, 25 GB/s NVLink inside a server).
PRESETS: dict[str, DeviceKind] = {
    "V100-16GB": DeviceKind("V100-16GB", 16 * GB, {"f32": 15.7e12, "f16": 125e12}, 900e9),
    "V100-32GB": DeviceKind("V100-32GB", 32 * GB, {"f32": 15.7e12, "f16": 125e12}, 900e9),
    "A100-40GB": DeviceKind(
        "A100-40GB", 40 * GB, {"f32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "f16": 312e12}, 1555e9
    ),
    "A100-80GB": DeviceKind(
        "A100-80GB", 80 * GB, {"f32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "f16": 312e12}, 2039e9
    ),
    "H100": DeviceKind("H100", 80 * GB, {"f32": 67e12, "tf32": 495e12, "bf16": 989e12, "f16": 989e12}, 3350e9),
    "H200": DeviceKind("H200", 141 * GB, {"f32": 67e12, "tf32": 495e12, "bf16": 989e12, "f16": 989e12}, 4800e9),
    # One CPU rank with one core: `dapple calibrate --devices 2` measured 50 GFLOP/s f32 matmul,
    # 10.5-11.4 GB/s copy bandwidth and ~10 us per op call (forward and backward each: PyTorch's
    # dispatch and autograd) on the 2-core dev VM when idle. Calibrate your machine for its own.
    "cpu": DeviceKind("cpu", 8 * GB, {"f32": 50e9}, 10e9, op_overhead=10e-6),
}

#: Default links by device kind: (intra-node, inter-node). DAPPLE: 25 GB/s in a server, ~1 GB/s P2P
#: between servers (3 GB/s for allreduce, which its ring spreads over several flows).
DEFAULT_LINKS: dict[str, tuple[Link, Link]] = {
    "V100-16GB": (Link(25 * GB, 5e-6), Link(1 * GB, 20e-6)),
    "V100-32GB": (Link(25 * GB, 5e-6), Link(1 * GB, 20e-6)),
    "A100-40GB": (Link(300 * GB, 5e-6), Link(25 * GB, 10e-6)),
    "A100-80GB": (Link(300 * GB, 5e-6), Link(25 * GB, 10e-6)),
    "H100": (Link(450 * GB, 5e-6), Link(50 * GB, 10e-6)),
    "H200": (Link(450 * GB, 5e-6), Link(50 * GB, 10e-6)),
    "cpu": (Link(5 * GB, 50e-6), Link(1 * GB, 100e-6)),
}


#: Fraction of peak an op class reaches when a cluster spec does not say (`dapple calibrate` fits them).
#: Matmul-like kernels reach well under peak FLOP/s; elementwise ops are bandwidth-bound, and the
#: bandwidth term of the roofline already describes them.
DEFAULT_EFFICIENCY: dict[str, float] = {"matmul": 0.6, "conv": 0.5, "attention": 0.5, "elementwise": 0.8}


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """Nodes × devices, each node with one device kind, and intra-/inter-node links."""

    node_kinds: tuple[DeviceKind, ...]
    """Device kind of each node, in node order."""
    devices_per_node: int
    """Devices on every node."""
    intra: Link
    """Link between two devices of one node."""
    inter: Link
    """Link between devices of different nodes."""
    name: str = ""
    """The shorthand or file it came from, for reports."""
    efficiency: dict[str, float] = field(default_factory=dict)
    """Fraction of peak reached per op class (`matmul`, `conv`, `elementwise`, ...), fitted by calibrate."""

    def efficiency_of(self, op_class: str | None) -> float:
        """Fraction of peak (FLOP/s and bandwidth) that ops of `op_class` reach on this cluster."""
        name = op_class or "matmul"
        return self.efficiency.get(name, DEFAULT_EFFICIENCY.get(name, DEFAULT_EFFICIENCY["matmul"]))

    @property
    def nodes(self) -> int:
        return len(self.node_kinds)

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, device: int) -> int:
        return device // self.devices_per_node

    def device(self, device: int) -> DeviceKind:
        if not 0 <= device < self.num_devices:
            raise ClusterError(f"device {device} is not in cluster {self.name} (0..{self.num_devices - 1})")
        return self.node_kinds[self.node_of(device)]

    def link(self, a: int, b: int) -> Link:
        """The link between two devices (intra-node when they share a node)."""
        return self.intra if self.node_of(a) == self.node_of(b) else self.inter

    def slowest_link(self, devices: tuple[int, ...] | list[int]) -> Link:
        """The slowest link a ring over `devices` uses."""
        nodes = {self.node_of(d) for d in devices}
        return self.inter if len(nodes) > 1 else self.intra

    def allreduce_s(self, nbytes: float, devices: tuple[int, ...] | list[int]) -> float:
        """Ring allreduce: 2(n-1)/n · bytes / bandwidth of the slowest link, plus latency per step."""
        n = len(devices)
        if n <= 1 or nbytes <= 0:
            return 0.0
        link = self.slowest_link(devices)
        return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency


def parse_shorthand(text: str) -> ClusterSpec:
    """`NODESxDEVICESxKIND` (`2x8xV100-16GB`), or `DEVICESxKIND` for one node."""
    parts = text.split("x", 2)
    try:
        if len(parts) == 3:
            nodes, per_node, kind = int(parts[0]), int(parts[1]), parts[2]
        elif len(parts) == 2:
            nodes, per_node, kind = 1, int(parts[0]), parts[1]
        else:
            raise ValueError
    except ValueError:
        raise ClusterError(
            f"cluster '{text}' is neither a TOML file nor a shorthand NODESxDEVICESxKIND such as 2x8xV100-16GB"
        ) from None
    if kind not in PRESETS:
        raise ClusterError(f"cluster '{text}': unknown device kind '{kind}'; presets are: {', '.join(PRESETS)}")
    if nodes < 1 or per_node < 1:
        raise ClusterError(f"cluster '{text}': nodes and devices per node must be at least 1")
    intra, inter = DEFAULT_LINKS[kind]
    return ClusterSpec((PRESETS[kind],) * nodes, per_node, intra, inter, name=text)
