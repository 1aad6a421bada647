"""Cluster specs from TOML: presets, custom and heterogeneous kinds, the network's fabric and cards, and
errors that name the field and its line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dapple_ir.cluster.spec import DEFAULT_EFFICIENCY, MACHINES, PRESETS, ClusterSpec, Link
from dapple_ir.cluster.toml_file import cluster_to_toml, load_cluster_toml, resolve_cluster
from dapple_ir.cluster.topology import Network
from dapple_ir.errors import ClusterError
from dapple_ir.pricing.collectives import allreduce_s


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return str(path)


def test_preset_cluster_matches_the_shorthand(tmp_path: Path) -> None:
    path = _write(tmp_path, 'nodes = 2\ndevices_per_node = 8\ndevice = "V100-16GB"\n')
    spec = resolve_cluster(path)
    short = resolve_cluster("2x8xV100-16GB")
    assert spec.num_devices == 16 and spec.nodes == 2
    assert spec.node_kinds == short.node_kinds
    assert (spec.intra, spec.inter) == (short.intra, short.inter)
    assert (spec.fabric, spec.cards, spec.machine) == (short.fabric, short.cards, short.machine)
    # DAPPLE's servers: 25 GB/s between two GPUs of a server, one 25 Gbit/s card per server.
    assert spec.link(0, 7).bandwidth == 25e9 and spec.link(7, 8).bandwidth == 25e9 / 8
    assert spec.fabric == "switch" and spec.card_count == 1


@pytest.mark.parametrize(
    ("shorthand", "fabric", "cards", "card_bits"),
    [
        ("2x8xV100-16GB", "switch", 1, 25e9),
        ("2x8xA100-80GB", "switch", 8, 200e9),
        ("2x8xH100", "switch", 8, 400e9),
        ("2x8xH200", "switch", 8, 400e9),
        ("2x4xcpu", "bus", 1, 8e9),
    ],
)
def test_shorthand_builds_the_machine_of_the_preset(shorthand: str, fabric: str, cards: int, card_bits: float) -> None:
    """The machines the presets name: DAPPLE's V100 servers (one Ethernet card), DGX A100 and DGX
    H100/H200 (one InfiniBand card per GPU), a CPU server (a bus, one card)."""
    spec = resolve_cluster(shorthand)
    assert (spec.fabric, spec.card_count) == (fabric, min(cards, spec.devices_per_node))
    assert spec.inter.bandwidth == pytest.approx(card_bits / 8)
    network = Network(spec)
    per = spec.devices_per_node
    # Two devices of one node: their own ports (switch) or the node's bus; of two nodes: their cards.
    assert len(network.path(0, 1)) == (2 if fabric == "switch" else 1)
    assert len(network.path(0, per)) == 2
    assert all(network.links[k].card for k in network.path(0, per))
    # Devices behind one card share its links; with a card per device they do not.
    shared = network.path(0, per)[0] == network.path(1, per + 1)[0]
    assert shared == (spec.card_count < per)
    assert MACHINES[spec.node_kinds[0].name].name == spec.machine


def test_fabric_and_network_tables(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
nodes = 2
devices_per_node = 4
device = "V100-16GB"
[fabric]
kind = "bus"
bandwidth = 16e9
latency = 1e-5
[network]
cards = 2
bandwidth = 12.5e9
latency = 3e-6
card_devices = [[0, 3], [1, 2]]
""",
    )
    spec = load_cluster_toml(path)
    assert spec.fabric == "bus" and spec.intra == Link(16e9, 1e-5)
    assert spec.cards == 2 and spec.inter == Link(12.5e9, 3e-6)
    assert [spec.card_of(d) for d in range(8)] == [0, 1, 1, 0, 0, 1, 1, 0]
    network = Network(spec)
    assert network.path(0, 1) == network.path(2, 3)  # one bus for the node
    assert network.path(0, 4)[0] == network.path(3, 5)[0] != network.path(1, 4)[0]
    again = load_cluster_toml(_write(tmp_path, cluster_to_toml(spec)))
    assert (again.fabric, again.cards, again.card_devices) == (spec.fabric, spec.cards, spec.card_devices)


def test_a_spec_without_a_network_gives_every_device_its_own_wire() -> None:
    kind = PRESETS["H100"]
    spec = ClusterSpec((kind, kind), 2, Link(100e9, 1e-6), Link(10e9, 1e-5))
    network = Network(spec)
    paths = [network.path(a, b) for a in range(4) for b in range(4) if a != b]
    assert all(len(p) == 2 for p in paths)
    assert network.path(0, 2)[0] != network.path(1, 3)[0]
    assert allreduce_s(network, 1e9, [0, 1, 2, 3]) == pytest.approx(2 * 3 / 4 * 1e9 / 10e9 + 2 * 3 * 1e-5)


def test_custom_heterogeneous_cluster(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
name = "mixed"
devices_per_node = 4
node_devices = ["A100-80GB", "slow"]
[device_kinds.slow]
base = "V100-16GB"
memory_bytes = 8e9
peak_flops = { f16 = 50e12 }
[links.intra_node]
bandwidth = 100e9
latency = 2e-6
[links.inter_node]
bandwidth = 10e9
latency = 1e-5
[efficiency]
matmul = 0.7
""",
    )
    spec = load_cluster_toml(path)
    assert spec.name == "mixed" and spec.num_devices == 8
    assert spec.device(0).name == "A100-80GB" and spec.device(5).name == "slow"
    slow = spec.device(7)
    assert slow.memory_bytes == 8e9 and slow.flops("f16") == 50e12
    assert slow.flops("f32") == PRESETS["V100-16GB"].flops("f32")
    assert spec.link(4, 5).transfer_s(100e9) == pytest.approx(2e-6 + 1.0)
    assert spec.link(3, 4).transfer_s(10e9) == pytest.approx(1e-5 + 1.0)
    assert spec.efficiency_of("matmul") == 0.7
    assert spec.efficiency_of("conv") == DEFAULT_EFFICIENCY["conv"]


@pytest.mark.parametrize("shorthand", ["2x8xH100", "1x4xcpu"])
def test_written_toml_reads_back_equal(tmp_path: Path, shorthand: str) -> None:
    spec = resolve_cluster(shorthand)
    path = _write(tmp_path, cluster_to_toml(spec))
    again = load_cluster_toml(path)
    # The cpu preset's per-op, split-backward and host overheads included.
    assert again.node_kinds == spec.node_kinds
    hosted = dataclasses.replace(
        spec,
        node_kinds=tuple(
            dataclasses.replace(
                k, instruction_overhead=1.5e-4, message_overhead=2.5e-4, wake_overhead=4e-4, reduce_per_byte=1.2e-9
            )
            for k in spec.node_kinds
        ),
    )
    assert load_cluster_toml(_write(tmp_path, cluster_to_toml(hosted))).node_kinds == hosted.node_kinds
    # A calibrated CPU host's busy-receiver slowdown is written and read back too.
    busy = dataclasses.replace(
        spec, node_kinds=tuple(dataclasses.replace(k, busy_receive_slowdown=37.5) for k in spec.node_kinds)
    )
    assert load_cluster_toml(_write(tmp_path, cluster_to_toml(busy))).node_kinds == busy.node_kinds
    assert (again.intra, again.inter, again.devices_per_node) == (spec.intra, spec.inter, spec.devices_per_node)
    assert (again.fabric, again.cards, again.card_devices) == (spec.fabric, spec.cards, spec.card_devices)
    # A node whose ranks outnumber its cores: the cores are written and read back.
    shared = dataclasses.replace(spec, cores_per_node=2)
    assert load_cluster_toml(_write(tmp_path, cluster_to_toml(shared))).cores_per_node == 2
    assert again.cores_per_node == 0


_FOUR = 'devices_per_node = 4\ndevice = "H100"\n'


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('devices_per_node = 8\ndevice = "V100-16GB"\nnodse = 2\n', "nodse"),
        ('nodes = 2\ndevice = "V100-16GB"\n', "devices_per_node"),
        ('nodes = 0\ndevices_per_node = 8\ndevice = "V100-16GB"\n', "nodes"),
        ('nodes = 2\ndevices_per_node = 2.5\ndevice = "V100-16GB"\n', "devices_per_node"),
        ('nodes = 2\ndevices_per_node = 8\ndevice = "TPU"\n', "device"),
        ('nodes = 3\ndevices_per_node = 8\nnode_devices = ["H100", "H100"]\n', "nodes"),
        ('devices_per_node = 8\nnode_devices = ["H100"]\ndevice = "H100"\n', "device"),
        ('devices_per_node = 8\ndevice = "x"\n[device_kinds.x]\nmemory_bytes = 1e9\n', "device_kinds.x.peak_flops"),
        ('devices_per_node = 8\ndevice = "H100"\n[links.intra_node]\nbandwidth = -1\n', "links.intra_node.bandwidth"),
        ('devices_per_node = 8\ndevice = "H100"\n[links.inter_node]\nbandwidth = 1e15\n', "links.inter_node.bandwidth"),
        ('devices_per_node = 8\ndevice = "H100"\n[efficiency]\nmatmul = 1.5\n', "efficiency.matmul"),
        (
            'devices_per_node = 2\ndevice = "x"\n[device_kinds.x]\nbase = "cpu"\nbusy_receive_slowdown = 0.5\n',
            "device_kinds.x.busy_receive_slowdown",
        ),
        (
            'devices_per_node = 2\ndevice = "x"\n[device_kinds.x]\nbase = "cpu"\nsplit_backward_overhead = -1e-4\n',
            "device_kinds.x.split_backward_overhead",
        ),
        (
            'devices_per_node = 2\ndevice = "x"\n[device_kinds.x]\nbase = "cpu"\nsplit_backward_per_byte = -1\n',
            "device_kinds.x.split_backward_per_byte",
        ),
        (
            'devices_per_node = 2\ndevice = "x"\n[device_kinds.x]\nbase = "cpu"\ninstruction_overhead = -1e-4\n',
            "device_kinds.x.instruction_overhead",
        ),
        (
            'devices_per_node = 2\ndevice = "x"\n[device_kinds.x]\nbase = "cpu"\nmessage_overhead = "fast"\n',
            "device_kinds.x.message_overhead",
        ),
        ('devices_per_node = 8\ndevice = "H100"\n[links.intra_node]\nbw = 1\n', "links.intra_node.bw"),
        ('devices_per_node = 4\ndevice = "cpu"\ncores_per_node = 1.5\n', "cores_per_node"),
        ('devices_per_node = 4\ndevice = "cpu"\ncores_per_node = -2\n', "cores_per_node"),
        ('devices_per_node = 8\ndevice = "H100"\n[fabric]\nkind = "ring"\n', "fabric.kind"),
        ('devices_per_node = 8\ndevice = "H100"\n[network]\ncards = 9\n', "network.cards"),
        (_FOUR + "[network]\ncards = 2\ncard_devices = [[0, 1], [1, 2]]\n", "network.card_devices"),
        (_FOUR + "[network]\ncards = 2\ncard_devices = [[0, 1, 2, 3]]\n", "network.card_devices"),
        ('devices_per_node = 4\ndevice = "H100"\n[network]\nbandwidth = 1e15\n', "network.bandwidth"),
        ('devices_per_node = 4\ndevice = "H100"\n[network]\nlatency = -1\n', "network.latency"),
        ('devices_per_node = 4\ndevice = "H100"\n[network]\nspeed = 1\n', "network.speed"),
        (_FOUR + "[links.inter_node]\nlatency = 1\n[network]\nlatency = 1\n", "links.inter_node"),
    ],
)
def test_bad_specs_name_the_field_and_file(tmp_path: Path, text: str, field: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ClusterError) as info:
        load_cluster_toml(path)
    assert f"'{field}'" in str(info.value)
    assert "cluster.toml" in str(info.value)


def test_errors_name_the_line_of_the_field(tmp_path: Path) -> None:
    text = 'devices_per_node = 8\ndevice = "H100"\n\n[network]\ncards = 2\nbandwidth = -5\n'
    with pytest.raises(ClusterError, match=r"cluster\.toml:6: field 'network\.bandwidth'"):
        load_cluster_toml(_write(tmp_path, text))


def test_invalid_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match="not valid TOML"):
        load_cluster_toml(_write(tmp_path, "nodes = = 2\n"))
    with pytest.raises(ClusterError, match="does not exist"):
        resolve_cluster(str(tmp_path / "none.toml"))


def test_compile_and_simulate_read_a_cluster_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One physics reads one cluster: a compile resolves its cluster once (capture's device, the precision, the
    costs, the planner, the checks and the report all take that one), and so does `dapple simulate`."""
    from dapple_ir import api
    from dapple_ir.cli import main
    from dapple_ir.cluster import toml_file

    path = _write(tmp_path, cluster_to_toml(resolve_cluster("1x2xcpu")))
    reads: list[str] = []
    real = toml_file.load_cluster_toml

    def counted(file: str) -> ClusterSpec:
        reads.append(file)
        return real(file)

    monkeypatch.setattr(toml_file, "load_cluster_toml", counted)
    mlp = str(Path(__file__).resolve().parent.parent / "examples" / "mlp.py") + ":factory"
    result = api.compile(mlp, cluster=path, global_batch=8, explain=True, out_dir=tmp_path / "plan")
    assert reads == [path]
    assert "MFU" in result.report  # the report's MFU lines priced on the one resolved cluster
    reads.clear()
    assert main(["simulate", str(tmp_path / "plan"), "--no-picture"]) == 0
    assert reads == [path]
