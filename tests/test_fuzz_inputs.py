"""Input files we did not write (issue 47): cluster TOML, profiles and checkpoint manifests drawn by hypothesis,
numbers among them nan, inf, huge and tiny, and plain random bytes and deep nesting. Each is read into something
whose every figure is finite, or refused with a one-paragraph `DappleError` naming the file; never an internal
error, never a hang. A cluster that reads is also simulated, so no figure it lets through can stall the
simulator."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dapple_ir.backends.torch import checkpoint
from dapple_ir.cluster.toml_file import load_cluster_toml
from dapple_ir.errors import CaptureError, ClusterError, DappleError
from dapple_ir.frontend.profile_import import import_profile
from dapple_ir.ir import Module
from tests.paths import PROFILES

_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

#: Numbers as a user (or a corrupted file) writes them: the extremes, the ordinary, and what is not a number.
numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-320, 1e-20, 1e308, 1e30, 1e18, 1e9, 1.0, 25e9, 16e9, 15.7e12, 5e-6]),
    st.integers(-(2**70), 2**70),
)
scalars = st.one_of(numbers, st.text(max_size=8), st.booleans())


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f'"{k}" = {_toml_value(v)}' for k, v in value.items()) + " }"
    return json.dumps(value)  # a TOML basic string


_KIND_KEYS = [
    "memory_bytes",
    "mem_bandwidth",
    "op_overhead",
    "busy_receive_slowdown",
    "split_backward_overhead",
    "split_backward_per_byte",
    "instruction_overhead",
    "message_overhead",
    "wake_overhead",
    "reduce_per_byte",
]


#: Where a figure is plausible (a value drawn from anywhere in it is one a real cluster could have).
_PLAUSIBLE = {
    "memory_bytes": (1e9, 1e12),
    "mem_bandwidth": (1e9, 1e13),
    "peak_flops": (1e9, 1e16),
    "bandwidth": (1e6, 1e12),
    "busy_receive_slowdown": (1.0, 10.0),
    "matmul": (0.1, 1.0),
    "conv": (0.1, 1.0),
}


def _value(draw: st.DrawFn, key: str) -> object:
    """Mostly a plausible figure, which lets the file read and the simulator run; else anything."""
    low, high = _PLAUSIBLE.get(key, (0.0, 1e-3))
    return draw(st.floats(low, high) if draw(st.integers(0, 19)) else scalars)


@st.composite
def cluster_files(draw: st.DrawFn) -> str:
    """A cluster TOML of the schema's fields, some of them dropped, each value mostly plausible, else anything."""
    lines = [f"devices_per_node = {_toml_value(draw(st.integers(2, 4) if draw(st.integers(0, 19)) else scalars))}"]
    lines.append(f"nodes = {_toml_value(draw(st.integers(1, 2) if draw(st.integers(0, 19)) else scalars))}")
    lines.append('device = "k"')
    lines += ["", "[device_kinds.k]", f'base = "{draw(st.sampled_from(["V100-16GB", "cpu", "H100"]))}"']
    for key in draw(st.lists(st.sampled_from(_KIND_KEYS), unique=True, max_size=5)):
        lines.append(f"{key} = {_toml_value(_value(draw, key))}")
    if draw(st.booleans()):
        dtypes = draw(st.lists(st.sampled_from(["f32", "bf16"]), min_size=1, max_size=2, unique=True))
        lines.append(f"peak_flops = {_toml_value({d: _value(draw, 'peak_flops') for d in dtypes})}")
    for table in draw(st.lists(st.sampled_from(["fabric", "network", "efficiency"]), unique=True)):
        keys = {"efficiency": ["matmul", "conv"]}.get(table, ["bandwidth", "latency"])
        lines += ["", f"[{table}]"] + [f"{k} = {_toml_value(_value(draw, k))}" for k in draw(st.permutations(keys))]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def four_rank_plan(tmp_path_factory: pytest.TempPathFactory) -> Module:
    from dapple_ir.api import compile as compile_plan

    vgg = PROFILES / "dapple-vgg-19-pbs-32.txt"
    return compile_plan(f"profile:{vgg}", cluster="2x2xV100-16GB", global_batch=32).module


def _refused_or_read(error: DappleError, name: str) -> None:
    message = str(error)
    assert name in message and "\n" not in message, message
    assert "internal error" not in message


@pytest.mark.timeout(300)
@_SETTINGS
@given(text=cluster_files())
def test_a_drawn_cluster_file_reads_finite_or_is_refused(tmp_path: Path, four_rank_plan: Module, text: str) -> None:
    from dapple_ir.sim.simulator import simulate

    path = tmp_path / "drawn.toml"
    path.write_text(text)
    try:
        spec = load_cluster_toml(str(path))
    except ClusterError as exc:
        _refused_or_read(exc, "drawn.toml")
        return
    assert all(math.isfinite(value) for _, value in spec.figures())
    if spec.num_devices >= 4:
        assert math.isfinite(simulate(four_rank_plan, cluster=spec).iteration_s)


@pytest.mark.timeout(120)
@_SETTINGS
@given(data=st.one_of(st.binary(max_size=400), st.integers(1, 5000).map(lambda n: b"a = " + b"[" * n + b"]" * n)))
def test_cluster_bytes_read_or_are_refused(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "bytes.toml"
    path.write_bytes(data)
    try:
        load_cluster_toml(str(path))
    except ClusterError as exc:
        _refused_or_read(exc, "bytes.toml")


# ------------------------------------------------------------------------------ profiles

metric_texts = st.one_of(
    numbers.map(str),
    st.lists(numbers.map(str), min_size=1, max_size=3).map(lambda xs: "[" + "; ".join(xs) + "]"),
    st.text(alphabet="0123456789.eE+-naif[];", max_size=10),
)


@st.composite
def profiles(draw: st.DrawFn) -> str:
    layers = draw(st.integers(1, 4))
    lines = []
    for k in range(layers):
        m = [draw(metric_texts) for _ in range(4)]
        lines.append(
            f"node{k} -- L{k} -- forward_compute_time={m[0]}, backward_compute_time={m[1]}, activation_size={m[2]}, "
            f"parameter_size={m[3]}"
        )
    lines += [f"\tnode{k} -- node{k + 1}" for k in range(layers - 1)]
    return "\n".join(lines) + "\n"


@pytest.mark.timeout(120)
@_SETTINGS
@given(content=st.one_of(profiles(), st.binary(max_size=300)))
def test_a_drawn_profile_imports_finite_or_is_refused(tmp_path: Path, content: str | bytes) -> None:
    path = tmp_path / "graph.txt"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    try:
        module = import_profile(str(path))
    except CaptureError as exc:
        _refused_or_read(exc, "graph.txt")
        return
    for op in module.ops:
        a = op.attrs
        assert all(math.isfinite(v) for v in (a.fwd_s, a.bwd_s, a.act_bytes, a.param_bytes))  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ checkpoint manifests

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=8,
)
_GOOD: dict[str, Any] = {
    "format": 1,
    "plan_digest": "d" * 64,
    "step": 2,
    "world_size": 1,
    "ranks": [{"rank": 0, "file": "step_00000002/rank_0.pt", "sha256": "0" * 64, "size": 10}],
}


@st.composite
def manifests(draw: st.DrawFn) -> bytes:
    """A good manifest with some fields (or a rank entry's) replaced by drawn JSON; or bytes; or deep nesting."""
    kind = draw(st.sampled_from(["fields", "bytes", "deep"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "deep":
        depth = draw(st.integers(1, 200_000))
        return (draw(st.sampled_from(["[", '{"a":'])) * depth).encode()
    data = json.loads(json.dumps(_GOOD))
    for key in draw(st.lists(st.sampled_from(["rank", "file", "sha256", "size"]), unique=True, max_size=2)):
        data["ranks"][0][key] = draw(json_values)
    for key in draw(st.lists(st.sampled_from(list(_GOOD)), unique=True, max_size=2)):
        data[key] = draw(json_values)
    text = json.dumps(data, allow_nan=True)
    return text.replace("Infinity", "1e999").encode()  # what a hand edit writes for an infinite step


@pytest.mark.timeout(120)
@_SETTINGS
@given(content=manifests())
def test_a_drawn_manifest_reads_or_is_refused(tmp_path: Path, content: bytes) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    (ckpt / checkpoint.MANIFEST).write_bytes(content)
    try:
        manifest = checkpoint.read_manifest(ckpt)
    except DappleError as exc:
        _refused_or_read(exc, "manifest.json")
        return
    assert all(type(v) is int for v in (manifest.step, manifest.world_size, *[f[2] for f in manifest.files.values()]))
