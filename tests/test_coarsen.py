"""coarsen on the shared profiles (checked against the files' text) and on small hand-made graphs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dapple_ir.frontend.profile_import import import_profile
from dapple_ir.ir import Module
from dapple_ir.ir.verifier import verify_module
from dapple_ir.pass_manager import PassManager, build_pipeline
from tests.paths import PROFILE_FILES

PROFILES = PROFILE_FILES


def _read_profile(path: Path) -> tuple[dict[str, tuple[float, float]], list[tuple[str, str]]]:
    """node -> (forward ms, activation bytes), and the edges, straight from the text."""
    nodes: dict[str, tuple[float, float]] = {}
    edges = []
    for line in path.read_text().splitlines():
        if line[:1].isspace() and line.strip():  # edges are indented (some files by " \t")
            src, dst = (x.strip() for x in line.strip().split(" -- "))
            edges.append((src, dst))
        elif line.strip():
            name = line.split(" -- ", 1)[0].strip()
            fwd = float(re.search(r"forward_compute_time=([0-9.eE+-]+)", line).group(1))  # type: ignore[union-attr]
            act_text = re.search(r"activation_size=(\[[^\]]*\]|[0-9.eE+-]+)", line).group(1)  # type: ignore[union-attr]
            act = sum(float(x) for x in act_text.strip("[]").split(";") if x.strip())
            nodes[name] = (fwd, act)
    return nodes, edges


def _coarsen(module: Module, max_layers: int) -> Module:
    PassManager(build_pipeline(f"coarsen{{max-layers={max_layers}}}")).run(module)
    return module


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.stem)
def test_profiles_coarsen_with_totals_and_cut_bytes_from_the_file(path: Path) -> None:
    nodes, edges = _read_profile(path)
    module = _coarsen(import_profile(str(path)), max_layers=16)
    verify_module(module)
    assert 1 <= len(module.layers) <= 16
    members = [op.target for layer in module.layers for op in layer.ops]
    assert sorted(members) == sorted(nodes)  # every node in exactly one layer
    total_fwd = sum(f for f, _ in nodes.values()) / 1000
    assert sum(layer.attrs.fwd_s or 0.0 for layer in module.layers) == pytest.approx(total_fwd)
    prefix: set[str] = set()
    for layer in module.layers:
        prefix |= {str(op.target) for op in layer.ops}
        crossing = {src for src, dst in edges if src in prefix and dst not in prefix}
        assert layer.attrs.cut_bytes == pytest.approx(sum(nodes[n][1] for n in crossing))


def test_resnet_residual_blocks_are_counted_or_kept_whole() -> None:
    path = next(p for p in PROFILES if "resnet18" in p.stem)
    _nodes, edges = _read_profile(path)
    module = _coarsen(import_profile(str(path)), max_layers=12)
    # With few layers, coarsen cuts only where a single tensor crosses (between residual blocks).
    prefix: set[str] = set()
    for layer in module.layers[:-1]:
        prefix |= {str(op.target) for op in layer.ops}
        crossing = {src for src, dst in edges if src in prefix and dst not in prefix}
        assert len(crossing) == 1, f"cut after {layer.name} carries {sorted(crossing)}"


def test_max_layers_one_gives_one_layer_and_layers_are_ordered() -> None:
    path = PROFILES[0]
    module = _coarsen(import_profile(str(path)), max_layers=1)
    assert len(module.layers) == 1
    assert module.layers[0].attrs.cut_bytes == 0.0
    module = _coarsen(import_profile(str(path)), max_layers=1000)
    position = {op: i for i, op in enumerate(module.ops)}
    for layer in module.layers:
        assert [position[op] for op in layer.ops] == sorted(position[op] for op in layer.ops)
