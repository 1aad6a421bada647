"""Input files a hostile or unlucky user hands us (issue 47, items 6-9): each gets one located paragraph
that names the file and the field (or line), never an internal error, never a hang."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dapple_ir.cli import CLOSED_PIPE_STATUS, main
from dapple_ir.cluster.spec import parse_shorthand
from dapple_ir.cluster.toml_file import load_cluster_toml
from dapple_ir.errors import CaptureError, ClusterError, ParseError
from dapple_ir.frontend.profile_import import import_profile
from dapple_ir.sim.link_sharing import LinkSharing
from tests.paths import PROFILES

VGG19 = PROFILES / "dapple-vgg-19-pbs-32.txt"
_KIND = 'nodes = 1\ndevices_per_node = 4\ndevice = "k"\n[device_kinds.k]\nbase = "V100-16GB"\n'


def _cluster(tmp_path: Path, text: str | bytes) -> str:
    path = tmp_path / "cluster.toml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return str(path)


# ------------------------------------------------------------------------------ cluster files (items 6, 7, 9)


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("wake_overhead = nan", "device_kinds.k.wake_overhead"),
        ("op_overhead = nan", "device_kinds.k.op_overhead"),
        ("memory_bytes = nan", "device_kinds.k.memory_bytes"),
        ("peak_flops = { f32 = nan }", "device_kinds.k.peak_flops.f32"),
        ("mem_bandwidth = nan", "device_kinds.k.mem_bandwidth"),
        ("reduce_per_byte = -nan", "device_kinds.k.reduce_per_byte"),
        ("busy_receive_slowdown = nan", "device_kinds.k.busy_receive_slowdown"),
        ("[fabric]\nbandwidth = nan", "fabric.bandwidth"),
        ("[fabric]\nlatency = nan", "fabric.latency"),
        ("[network]\nlatency = nan", "network.latency"),
        ("[efficiency]\nmatmul = nan", "efficiency.matmul"),
    ],
)
def test_a_nan_in_a_cluster_file_names_its_field(tmp_path: Path, line: str, field: str) -> None:
    with pytest.raises(ClusterError) as info:
        load_cluster_toml(_cluster(tmp_path, _KIND + line + "\n"))
    message = str(info.value)
    assert f"field '{field}'" in message and "cluster.toml" in message and "nan" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        (
            "memory_bytes = 1e29",
            "'device_kinds.k.memory_bytes' is 1e+29, beyond any real cluster (1e+06 to 1e+18 bytes)",
        ),
        ("[fabric]\nlatency = 1e6", "'fabric.latency' is 1e+06, beyond any real cluster (0 to 1 s or 0)"),
        ("[fabric]\nbandwidth = 1e-20", "'fabric.bandwidth' is 1e-20, beyond any real cluster (1000 to 1e+16 B/s)"),
        ("peak_flops = { bf16 = 1e30 }", "'device_kinds.k.peak_flops.bf16' is 1e+30, beyond any real cluster"),
        ("reduce_per_byte = 5.0", "'device_kinds.k.reduce_per_byte' is 5, beyond any real cluster (0 to 0.001 s per"),
    ],
)
def test_a_cluster_figure_out_of_range_names_its_field(tmp_path: Path, line: str, needle: str) -> None:
    """Before: memory 1e29, latency 1e6 or a bandwidth of 1e-20 passed, and the ILP planner crashed (TypeError)."""
    with pytest.raises(ClusterError) as info:
        load_cluster_toml(_cluster(tmp_path, _KIND + line + "\n"))
    assert needle in str(info.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("field", ["wake_overhead", "op_overhead"])
def test_compile_with_a_nan_cluster_field_blames_the_field_not_the_ir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str
) -> None:
    """Before: `wake_overhead = nan` hung the simulator; `op_overhead = nan` was blamed on the IR (`fwd_s = nan`)."""
    cluster = _cluster(tmp_path, _KIND + f"{field} = nan\n")
    code = main(
        ["compile", f"profile:{VGG19}", "--cluster", cluster, "--global-batch", "64", "-o", str(tmp_path / "p")]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert f"field 'device_kinds.k.{field}'" in err and "fwd_s" not in err


def test_a_nan_figure_is_refused_however_the_spec_is_built() -> None:
    spec = parse_shorthand("2x4xcpu")
    kind = spec.node_kinds[0]
    with pytest.raises(ClusterError, match=r"device_kinds\.cpu\.peak_flops\.f32 is nan"):
        broken = dataclasses.replace(kind, peak_flops={"f32": math.nan})
        dataclasses.replace(spec, node_kinds=(broken, broken))


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (bytes(range(256)) * 8, "is not text: byte 128 (0x80) is not UTF-8"),
        ("a = " + "[" * 100_000 + "]" * 100_000 + "\n", "nests arrays or tables too deeply"),
        ("a = " + "{b = " * 100_000 + "}" * 100_000 + "\n", "nests arrays or tables too deeply"),
    ],
    ids=["binary", "deep-array", "deep-table"],
)
def test_a_binary_or_deeply_nested_cluster_file_is_located(tmp_path: Path, text: str | bytes, needle: str) -> None:
    with pytest.raises(ClusterError, match=r"cluster file .*cluster\.toml") as info:
        load_cluster_toml(_cluster(tmp_path, text))
    assert needle in str(info.value)


# ------------------------------------------------------------------------------ the simulator never loops (item 6)


@pytest.mark.timeout(10)
def test_link_sharing_refuses_a_flow_it_cannot_end() -> None:
    """Before: the flow's end event was rescheduled forever (the loop of `_reschedule` the issue found)."""
    sharing = LinkSharing([1e9])
    _, moved = sharing.start(0.0, (0,), math.nan)
    ((bundle, end, version),) = moved
    assert sharing.is_current(bundle, version)
    with pytest.raises(RuntimeError, match="internal error: link sharing cannot advance bundle 0"):
        sharing.finish(end, bundle)


@pytest.mark.timeout(10)
def test_link_sharing_refuses_a_time_that_is_not_one() -> None:
    sharing = LinkSharing([1e9])
    with pytest.raises(RuntimeError, match=r"its next end, nan s, is not a time"):
        sharing.start(math.nan, (0,), 1e6)


# ------------------------------------------------------------------------------ profiles (item 7)


def _node_line(forward: str = "1.0", activation: str = "1000.0") -> str:
    return (
        f"node1 -- L1 -- forward_compute_time={forward}, backward_compute_time=2.0, activation_size={activation}, "
        "parameter_size=10.0\n"
    )


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (_node_line(forward="1e308"), "graph.txt:1:16: forward_compute_time=1e308 is not a finite number of ms"),
        (_node_line(forward="nan"), "graph.txt:1:16: forward_compute_time=nan is not a finite number"),
        (_node_line(forward="inf"), "forward_compute_time=inf is not a finite number"),
        (_node_line(activation="[1e308; 1e308]"), "activation_size=[1e308; 1e308] is not a finite number of bytes"),
        (_node_line(activation="2e15"), "activation_size=2e15 is not a finite number of bytes up to 1e+15"),
    ],
)
def test_a_profile_figure_beyond_any_layer_is_located(tmp_path: Path, text: str, needle: str) -> None:
    """Before: 1e308 reached OR-Tools (TypeError in the planner); nan and inf reached the verifier as IR errors."""
    path = tmp_path / "graph.txt"
    path.write_text(text)
    with pytest.raises(CaptureError) as info:
        import_profile(str(path))
    assert needle.replace(" of ms", " of milliseconds") in str(info.value)


def test_a_binary_profile_is_located(tmp_path: Path) -> None:
    path = tmp_path / "graph.txt"
    path.write_bytes(b"node1 -- L1\n\xff\xfe\x00garbage")
    with pytest.raises(CaptureError, match=r"graph\.txt:2: profile is not text \(byte 12, 0xff, is not UTF-8\)"):
        import_profile(str(path))


# ------------------------------------------------------------------------------ IR text: linear and bounded (item 8)

_OPT_UNDER_A_MEMORY_LIMIT = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1536 * 2**20, 1536 * 2**20))
from dapple_ir.cli import main
sys.exit(main(["opt", sys.argv[1], "-o", sys.argv[2]]))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("body", ["x" * 20_000_000, '\\\\\\"' * 5_000_000], ids=["plain", "escapes"])
def test_a_20_mb_string_parses_in_bounded_memory(tmp_path: Path, body: str) -> None:
    """Before: 7.4 GB and 11 s for the plain 20 MB string (a frame per character); now 190 MB and 2 s."""
    source, out = tmp_path / "long.dapple", tmp_path / "out.dapple"
    source.write_text('module @m attributes {source = "' + body + '"} {\n}\n')
    done = subprocess.run(
        [sys.executable, "-c", _OPT_UNDER_A_MEMORY_LIMIT, str(source), str(out)], capture_output=True, timeout=100
    )
    assert done.returncode == 0, done.stderr.decode()[-1000:]
    assert out.read_text() == source.read_text()


def test_ir_text_beyond_the_bound_is_refused_before_it_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dapple_ir.ir import parser

    source = tmp_path / "big.dapple"
    source.write_text("module @m {\n}\n" + " " * 1000)
    monkeypatch.setattr(parser, "MAX_IR_SIZE", 100)
    with pytest.raises(ParseError, match=r"big\.dapple: 1,014 bytes of IR text, more than the 100 the parser reads"):
        parser.read_ir_file(source)
    with pytest.raises(ParseError, match=r"<stdin>: 1,014 characters of IR text"):
        parser.parse_module(source.read_text(), "<stdin>")


# ------------------------------------------------------------------------------ misleading ends (item 9)

_EXITING_MODEL = """
import os
import torch
from torch import nn

{on_import}

def factory():
    os._exit(0)
    return nn.Linear(4, 4), (torch.randn(2, 4),)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("on_import", "line"), [("", 9), ("os._exit(0)", 6)], ids=["factory", "import"])
def test_a_model_calling_os_exit_is_an_error_naming_the_line(tmp_path: Path, on_import: str, line: int) -> None:
    """Before: `os._exit(0)` in the model file ended `dapple compile` with status 0, no plan and no word. Run as a
    process of its own: on the old code it would end the test run."""
    model = tmp_path / "m.py"
    model.write_text(_EXITING_MODEL.format(on_import=on_import))
    argv = ["compile", f"{model}:factory", "--cluster", "2xcpu", "--global-batch", "8", "-o", str(tmp_path / "p")]
    done = subprocess.run([sys.executable, "-m", "dapple_ir.cli", *argv], capture_output=True, text=True, timeout=170)
    assert done.returncode == 2, done.stderr
    assert f"model spec {model}:factory: {model}:{line} called os._exit(0), which would end the process" in done.stderr
    assert not (tmp_path / "p").exists()


def test_a_closed_pipe_ends_the_command_quietly(tmp_path: Path) -> None:
    """`dapple simulate PLAN | head -3`. Before: "internal error: BrokenPipeError ... This is a bug", status 1."""
    plan = tmp_path / "plan"
    assert (
        main(["compile", f"profile:{VGG19}", "--cluster", "2x2xV100-16GB", "--global-batch", "32", "-o", str(plan)])
        == 0
    )
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line: every write fails
    try:
        argv = [sys.executable, "-m", "dapple_ir.cli", "simulate", str(plan), "--no-picture"]
        done = subprocess.run(argv, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (CLOSED_PIPE_STATUS, "")
