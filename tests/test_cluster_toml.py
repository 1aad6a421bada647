"""Cluster specs from TOML: presets, custom and heterogeneous kinds, and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapple_ir.cluster.spec import DEFAULT_EFFICIENCY, PRESETS
from dapple_ir.cluster.toml_file import cluster_to_toml, load_cluster_toml, resolve_cluster
from dapple_ir.errors import ClusterError


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
    # DAPPLE's cluster: 25 GB/s inside a server, 1 GB/s between servers.
    assert spec.link(0, 7).bandwidth == 25e9 and spec.link(7, 8).bandwidth == 1e9


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
    assert again.node_kinds == spec.node_kinds  # the cpu preset's per-op overhead included
    assert (again.intra, again.inter, again.devices_per_node) == (spec.intra, spec.inter, spec.devices_per_node)


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
        ('devices_per_node = 8\ndevice = "H100"\n[links.intra_node]\nbw = 1\n', "links.intra_node.bw"),
    ],
)
def test_bad_specs_name_the_field_and_file(tmp_path: Path, text: str, field: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ClusterError) as info:
        load_cluster_toml(path)
    assert f"'{field}'" in str(info.value)
    assert "cluster.toml" in str(info.value)


def test_invalid_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match="not valid TOML"):
        load_cluster_toml(_write(tmp_path, "nodes = = 2\n"))
    with pytest.raises(ClusterError, match="does not exist"):
        resolve_cluster(str(tmp_path / "none.toml"))
