"""Cluster specs: nodes of devices, their speed and memory, and the network that joins them.

A spec comes from a shorthand (`2x8xV100-16GB`: 2 nodes of 8 V100s, `parse_shorthand`) or a TOML file
(`dapple_ir.cluster.toml_file`, whose `resolve_cluster` takes either). Device ids are global and
node-major: device d sits on node d // devices_per_node (for homogeneous clusters).

The network has the parts that decide which transfers slow each other down (docs/cluster.md):
inside a node a *fabric*, either a switch that gives every device its own port (NVLink through
NVSwitch) or a bus that every transfer of the node shares (PCIe through the host, a CPU's memory);
between nodes the node's *network cards*, each serving the devices behind it. `intra` is what one
transfer alone gets inside a node (a port's or the bus's bandwidth, each way), `inter` what it gets
between nodes (one card's bandwidth, each way). `dapple_ir.cluster.topology` turns a spec into the
links each transfer crosses.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, fields

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
    """Fixed seconds each op call costs on top of its roofline, whatever its batch. On a CPU: its dispatch and
    launch, which the rank's one thread does between kernels. On a GPU: the device's own cost per kernel (the
    gap between back-to-back kernels of a stream, a kernel's ramp and tail), the host's dispatch being
    `host_forward`/`host_backward`. It makes an op's time affine in its batch
    (`dapple_ir.cluster.roofline.rescaled_s`), so tiny microbatches pay for it once per op and microbatch.
    `dapple calibrate` measures it (`--fit` with profiles at two or more microbatch sizes fits it from them)."""
    host_forward: float = 0.0
    """Host seconds eager PyTorch spends issuing one op call's forward (Python, the dispatcher, autograd's
    recording, the launch) while the device runs the kernels issued before it: the host runs ahead of a GPU, so
    a call takes the longer of its kernel (`op_overhead` included) and this (`roofline.roofline_times`). 0 where
    dispatch is not overlapped (a CPU rank: `op_overhead` holds it)."""
    host_backward: float = 0.0
    """`host_forward` for the op's backward, issued by autograd's engine in C++ (no Python, no recording)."""
    busy_receive_slowdown: float = 1.0
    """How many times as long the bytes of a transfer into this device take while it computes as while it
    waits for them. 1 where the transport has hardware of its own (a GPU's copy engines and NCCL's kernels).
    Above 1 on a CPU host whose cores all compute: the transport's socket thread waits for a core to take
    the bytes in. The simulator slows a transfer only during its receiver's compute instructions
    (`dapple_ir.sim.simulator`)."""

    split_backward_overhead: float = 0.0
    """Fixed seconds a split backward (zb-h1's `backward_input` then `backward_weight`) costs on top of the whole
    backward, per op whose parameters branch off the path to the stage's inputs: the weight work runs one autograd
    pass for each such op (restarting from the gradient the input pass captured there), and the input pass walks
    the graph to find them. A stage that hands no gradient back runs its whole backward as one weight pass and pays
    none of it. `dapple calibrate` measures it with the runtime's own split (`split_backward.measure_split_overhead`);
    0 on the GPU presets, whose host issues those passes ahead of the device's kernels."""
    split_backward_per_byte: float = 0.0
    """Seconds the same split costs per byte of those ops' parameters: the weight pass touches their gradients again
    after the caches have moved on. Measured with `split_backward_overhead` (a line through three layer widths)."""

    instruction_overhead: float = 0.0
    """Host seconds the runtime spends per compute instruction (forward, backward, input or weight pass) outside
    the ops it runs: issuing it, its frees and loads, its own bookkeeping. The simulator and the planner add it to
    every such instruction. `dapple calibrate` measures it on the runtime itself (`calibrate.measure_host_time`);
    0 on the GPU presets, whose host runs ahead of the device's kernels."""
    message_overhead: float = 0.0
    """Host seconds a point-to-point message costs the rank at each end beyond the transfer: handing a send to the
    transport, finishing a receive whose data is there (on a CPU, the transport's thread shares the rank's core).
    Charged to the rank's next compute instruction, which the runtime runs once the sends before it are handed
    over. Measured with `instruction_overhead`."""
    wake_overhead: float = 0.0
    """Seconds a rank that blocked (on a receive whose data had not come, or in an allreduce) takes to run again
    once it may: on a CPU host whose ranks outnumber its cores, the woken rank waits in the run queue while the
    others compute (Linux's run-queue delay, which the runtime reads around every instruction: `Span.queued_s`).
    The simulator adds it to every such wait. `dapple calibrate` measures it with `instruction_overhead`, as the mean
    run-queue delay of the receives that blocked (`calibrate.fit_wake`); the runtime benchmark fits it the same way
    to each of its runs. About 0 where each rank has a core or a GPU of its own; 0 on the presets."""
    reduce_per_byte: float = 0.0
    """Seconds an allreduce member spends per byte it reduces beyond moving the bytes over the links: on a CPU,
    gloo sums what it receives and copies the tensor into and out of its own buffers on the host, and a ring of n
    members reduces (n-1)/n of the bytes on each. The simulator and the cost model add it to every ring
    (`Network.allreduce_s`). `dapple calibrate` measures it with the link, from an allreduce of 16 MiB between
    two processes against its ring time on the measured link (a 2-core VM: about 1 ns a byte, so 8 MiB of
    gradients take 7 ms where the link alone says 2.8). 0 on the presets: NCCL reduces on the GPU as it moves."""

    @property
    def prices_host(self) -> bool:
        """Whether the host's own work per instruction or message costs time here."""
        return bool(self.instruction_overhead or self.message_overhead)

    @property
    def prices_split(self) -> bool:
        """Whether a split backward costs more than the whole one here (`split_s` is not always 0)."""
        return bool(self.split_backward_overhead or self.split_backward_per_byte)

    def split_s(self, ops: int, param_bytes: float) -> float:
        """What splitting a backward costs beyond the whole one for `ops` weight ops reading `param_bytes`."""
        return ops * self.split_backward_overhead + param_bytes * self.split_backward_per_byte

    def flops(self, dtype: str = "f32") -> float:
        return self.peak_flops.get(dtype, self.peak_flops["f32"])


#: The largest `DeviceKind.busy_receive_slowdown` that `dapple calibrate` and the runtime bench report: a transfer
#: that all but stops while its receiver computes (any larger figure predicts the same waiting).
MAX_BUSY_RECEIVE_SLOWDOWN = 1000.0


@dataclass(frozen=True, slots=True)
class Link:
    """A point-to-point link: bandwidth in bytes/s and latency in seconds."""

    bandwidth: float
    latency: float

    def transfer_s(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth if nbytes > 0 else 0.0


#: What an op call costs besides its roofline on a GPU, by generation (estimates from public figures, not fitted to
#: any benchmark row; `dapple calibrate` on the machine replaces them; docs/cluster.md cites them):
#: - on the device, per kernel: the gap between back-to-back kernels of a stream plus a kernel's ramp and tail,
#:   about 3 us on A100/H100 (`cudaLaunchKernel` is 1-3 us with CUDA 12 drivers). A GEMM too small to fill the
#:   device is priced by the GEMM size law (`pricing.matmul_efficiency`), not here;
#: - on the host, per op call: 5-25 us of eager PyTorch (Python, pybind11, autograd's recording, the dispatcher,
#:   the launch); the middle, 15 us, for a forward, and 10 us for a backward, which autograd's engine issues from C++.
#:   The host runs ahead of the device, so a call costs the longer of the two (`DeviceKind.host_forward`).
#: V100 presets keep DAPPLE's era figure, 30 us added to every call (their published profiles are rescaled with it).
_V100_OVERHEAD = 30e-6
_GPU_KERNEL_S, _HOST_FORWARD_S, _HOST_BACKWARD_S = 3e-6, 15e-6, 10e-6
_AMPERE_FLOPS = {"f32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "f16": 312e12}
_HOPPER_FLOPS = {"f32": 67e12, "tf32": 495e12, "bf16": 989e12, "f16": 989e12}


def _gpu(name: str, memory: float, flops: dict[str, float], bandwidth: float) -> DeviceKind:
    """A GPU preset whose host dispatches ahead of it (the figures above)."""
    return DeviceKind(
        name, memory, flops, bandwidth, _GPU_KERNEL_S, host_forward=_HOST_FORWARD_S, host_backward=_HOST_BACKWARD_S
    )


#: Device presets. V100 figures follow DAPPLE's planner (16 GB, 25 GB/s NVLink inside a server).
PRESETS: dict[str, DeviceKind] = {
    "V100-16GB": DeviceKind("V100-16GB", 16 * GB, {"f32": 15.7e12, "f16": 125e12}, 900e9, _V100_OVERHEAD),
    "V100-32GB": DeviceKind("V100-32GB", 32 * GB, {"f32": 15.7e12, "f16": 125e12}, 900e9, _V100_OVERHEAD),
    "A100-40GB": _gpu("A100-40GB", 40 * GB, _AMPERE_FLOPS, 1555e9),
    "A100-80GB": _gpu("A100-80GB", 80 * GB, _AMPERE_FLOPS, 2039e9),
    "H100": _gpu("H100", 80 * GB, _HOPPER_FLOPS, 3350e9),
    "H200": _gpu("H200", 141 * GB, _HOPPER_FLOPS, 4800e9),
    # One CPU rank with one core: `dapple calibrate --devices 2` measured 50 GFLOP/s f32 matmul,
    # 10.5-11.4 GB/s copy bandwidth and ~10 us per op call (forward and backward each: PyTorch's
    # dispatch and autograd) on the 2-core dev VM when idle, and for a split backward 120-212 us per
    # weight op plus 59-100 us per MB of its weights (four readings), and for the runtime's own host work 283-308 us
    # per compute instruction plus 114-160 us per send or receive (five readings, 2 ranks training a 256-wide MLP;
    # with it the planner gives HF GPT-2 tiny on 2 stages 1 microbatch, measured 11-16 ms a step, where without it
    # it chose zb-h1 with 2, 27-28 ms). Calibrate your machine for its own.
    "cpu": DeviceKind(
        "cpu",
        8 * GB,
        {"f32": 50e9},
        10e9,
        op_overhead=10e-6,
        split_backward_overhead=150e-6,
        split_backward_per_byte=70e-12,
        instruction_overhead=290e-6,
        message_overhead=120e-6,
    ),
}

#: The fabrics a node may have (see the module docstring).
FABRICS = ("switch", "bus")


@dataclass(frozen=True, slots=True)
class Machine:
    """A real server: the network every node of a preset device kind has."""

    name: str
    fabric: str
    """`switch` (a port per device) or `bus` (one link the node's transfers share)."""
    intra: Link
    """One port of the switch (or the whole bus): bandwidth each way, and latency."""
    cards: int
    """Network cards per node; the devices are split evenly between them, in order."""
    inter: Link
    """One network card: bandwidth each way, and latency."""
    source: str
    """Where the figures come from."""


_DAPPLE_V100 = Machine(
    "DAPPLE V100 server",
    "switch",
    Link(25 * GB, 5e-6),
    1,
    Link(25e9 / 8, 20e-6),
    "DAPPLE (PPoPP'21) Config-A: 8 V100 with NVLink, 25 GB/s between two GPUs in its planner (one NVLink2 "
    "link), servers joined by one 25 Gbit/s Ethernet card each",
)
_DGX_A100 = Machine(
    "DGX A100",
    "switch",
    Link(300 * GB, 5e-6),
    8,
    Link(200e9 / 8, 10e-6),
    "NVIDIA DGX A100: 6 NVSwitches, 600 GB/s NVLink per GPU (300 GB/s each way); 8 single-port ConnectX-6 "
    "HDR InfiniBand cards of 200 Gbit/s, one per GPU",
)
_DGX_H100 = Machine(
    "DGX H100/H200",
    "switch",
    Link(450 * GB, 5e-6),
    8,
    Link(400e9 / 8, 10e-6),
    "NVIDIA DGX H100/H200: 4 NVSwitches, 900 GB/s NVLink per GPU (450 GB/s each way); 8 single-port "
    "ConnectX-7 cards of 400 Gbit/s, one per GPU (DGX BasePOD reference architecture)",
)
_CPU_SERVER = Machine(
    "CPU server",
    "bus",
    Link(5 * GB, 50e-6),
    1,
    Link(1 * GB, 100e-6),
    "ranks of one machine copy through its memory (a bus all transfers share; gloo over loopback reaches "
    "~5 GB/s on the dev VM); one ~10 Gbit/s Ethernet card per machine. Calibrate your own",
)

#: The machine each device preset comes in, which the shorthand (`2x8xV100-16GB`) builds.
MACHINES: dict[str, Machine] = {
    "V100-16GB": _DAPPLE_V100,
    "V100-32GB": _DAPPLE_V100,
    "A100-40GB": _DGX_A100,
    "A100-80GB": _DGX_A100,
    "H100": _DGX_H100,
    "H200": _DGX_H100,
    "cpu": _CPU_SERVER,
}

#: Default links by device kind: (intra-node, inter-node), those of its machine.
DEFAULT_LINKS: dict[str, tuple[Link, Link]] = {kind: (m.intra, m.inter) for kind, m in MACHINES.items()}


#: Fraction of peak an op class reaches when a cluster spec does not say (`dapple calibrate` fits them).
#: Matmul-like kernels reach well under peak FLOP/s; elementwise ops are bandwidth-bound, and the
#: bandwidth term of the roofline already describes them.
DEFAULT_EFFICIENCY: dict[str, float] = {"matmul": 0.6, "conv": 0.5, "attention": 0.5, "elementwise": 0.8}


#: The numbers of a device kind besides its peak FLOP/s (`ClusterSpec.figures`).
_KIND_FIGURES = tuple(f.name for f in fields(DeviceKind) if f.name not in ("name", "peak_flops"))


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """Nodes × devices, each node with one device kind, and the network that joins them.

    Every node has the same fabric and cards. Without `fabric`, `cards` and `card_devices` the node
    is a switch with one network card per device: no two devices share a wire.
    """

    node_kinds: tuple[DeviceKind, ...]
    """Device kind of each node, in node order."""
    devices_per_node: int
    """Devices on every node."""
    intra: Link
    """Inside a node: one device's switch port (or the whole bus), bandwidth each way, and latency."""
    inter: Link
    """Between nodes: one network card, bandwidth each way, and latency."""
    name: str = ""
    """The shorthand or file it came from, for reports."""
    efficiency: dict[str, float] = field(default_factory=dict)
    """Fraction of peak reached per op class (`matmul`, `conv`, `elementwise`, ...), fitted by calibrate."""
    fabric: str = "switch"
    """`switch`: each device has its own port; `bus`: one link that every transfer in the node shares."""
    cards: int = 0
    """Network cards per node; 0: one per device."""
    card_devices: tuple[tuple[int, ...], ...] = ()
    """Per card, the local device slots (0 .. devices_per_node - 1) behind it; empty: an even split in order."""
    machine: str = ""
    """The machine preset the network came from (`DGX H100/H200`), for reports."""
    cores_per_node: int = 0
    """Cores a node's ranks compute on, where there are fewer than its devices (CPU ranks of one thread on a
    machine with fewer cores than ranks): the ranks then take turns, each running at cores / ranks computing of a
    core's speed while more of them compute than there are cores (`dapple_ir.sim.simulator`). 0: a core (or a
    GPU) of its own for every device, nothing shared. `dapple calibrate` writes the node's cores where the ranks
    outnumber them."""

    def __post_init__(self) -> None:
        per = self.devices_per_node
        where = f"cluster {self.name or '(unnamed)'}"
        if self.cores_per_node < 0:
            raise ClusterError(f"{where}: cores_per_node is {self.cores_per_node}; 0 (a core per device) or more")
        if self.fabric not in FABRICS:
            raise ClusterError(f"{where}: fabric '{self.fabric}' is not one of {', '.join(FABRICS)}")
        for figure, value in self.figures():
            # inf is a figure of the ideal cluster (free links, unbounded memory); nan prices nothing.
            if math.isnan(value) or value < 0:
                raise ClusterError(
                    f"{where}: {figure} is {value!r}; every figure of a cluster is a number, not negative"
                )
        if not 0 <= self.cards <= per:
            raise ClusterError(f"{where}: {self.cards} network cards for {per} devices per node (0 to {per})")
        if self.card_devices:
            slots = sorted(slot for group in self.card_devices for slot in group)
            if len(self.card_devices) != self.card_count or slots != list(range(per)):
                raise ClusterError(
                    f"{where}: card_devices {[list(g) for g in self.card_devices]} must split the device slots "
                    f"0..{per - 1} between the {self.card_count} cards, each slot behind exactly one card"
                )
            if not all(self.card_devices):
                raise ClusterError(f"{where}: every network card needs at least one device behind it")

    def figures(self) -> Iterator[tuple[str, float]]:
        """Every number of the spec that prices something, named as a cluster file names its field."""
        for kind in {k.name: k for k in self.node_kinds}.values():
            for name in _KIND_FIGURES:
                yield f"device_kinds.{kind.name}.{name}", getattr(kind, name)
            for dtype, flops in kind.peak_flops.items():
                yield f"device_kinds.{kind.name}.peak_flops.{dtype}", flops
        for table, link in (("fabric", self.intra), ("network", self.inter)):
            yield f"{table}.bandwidth", link.bandwidth
            yield f"{table}.latency", link.latency
        for op_class, fraction in self.efficiency.items():
            yield f"efficiency.{op_class}", fraction

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

    @property
    def card_count(self) -> int:
        """Network cards per node (one per device when `cards` is 0)."""
        return self.cards or self.devices_per_node

    def node_of(self, device: int) -> int:
        return device // self.devices_per_node

    def card_of(self, device: int) -> int:
        """The card (0 .. card_count - 1) of its node that `device` sends and receives through."""
        slot = device % self.devices_per_node
        if self.card_devices:
            return next(c for c, group in enumerate(self.card_devices) if slot in group)
        return slot * self.card_count // self.devices_per_node

    def device(self, device: int) -> DeviceKind:
        if not 0 <= device < self.num_devices:
            raise ClusterError(f"device {device} is not in cluster {self.name} (0..{self.num_devices - 1})")
        return self.node_kinds[self.node_of(device)]

    @property
    def shares_cores(self) -> bool:
        """Whether a node's ranks outnumber its cores, so that ranks computing at once slow each other."""
        return 0 < self.cores_per_node < self.devices_per_node

    def link(self, a: int, b: int) -> Link:
        """What one transfer from `a` to `b` gets when nothing else is on the wire."""
        return self.intra if self.node_of(a) == self.node_of(b) else self.inter


#: The most devices a cluster may have (nodes x devices per node): far beyond any cluster a plan is made for,
#: small enough that the planner's work and every per-device table stay bounded.
MAX_DEVICES = 2**16


def check_device_count(nodes: int, per_node: int, where: str) -> None:
    """Refuse a cluster of more than `MAX_DEVICES` devices (or of none) before anything is built for it."""
    if nodes < 1 or per_node < 1:
        raise ClusterError(f"{where}: nodes and devices per node must be at least 1")
    if nodes * per_node > MAX_DEVICES:
        raise ClusterError(
            f"{where}: {nodes:,} node(s) x {per_node:,} device(s) is more than the {MAX_DEVICES:,} devices a "
            "cluster may have"
        )


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
    check_device_count(nodes, per_node, f"cluster '{text}'")
    machine = MACHINES[kind]
    return ClusterSpec(
        (PRESETS[kind],) * nodes,
        per_node,
        machine.intra,
        machine.inter,
        name=text,
        fabric=machine.fabric,
        cards=min(machine.cards, per_node),
        machine=machine.name,
    )
