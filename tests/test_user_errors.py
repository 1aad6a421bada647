"""The most likely mistakes a new user makes, each answered by one clear paragraph and no traceback."""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

import pytest

from dapple_ir.cli import main
from dapple_ir.plan_dir import write_plan_json
from tests.paths import PROFILES, ROOT

BERT = PROFILES / "dapple-bert-48-pbs-2.txt"

UNCAPTURABLE = """
import torch
from torch import nn

class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # depends on the data: neither fx nor export can capture it
            return self.fc(x).sum()
        return x.sum()

def factory():
    return Branchy(), (torch.randn(2, 4),)

def only_model():
    return Branchy()
"""


def _error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run `dapple ARGV`, check it failed the way a user error should, return the message."""
    code = main(list(argv))
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 2, err
    assert "Traceback" not in err
    # Progress lines may come first; the error is the last thing printed, one paragraph.
    assert "error: " in err, err
    message = err[err.index("error: ") :]
    assert "\n\n" not in message, "the error must be one paragraph"
    return message


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "branchy.py"
    path.write_text(UNCAPTURABLE)
    return path


@pytest.fixture(scope="module")
def cpu_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("plans") / "mlp"
    code = main(["compile", "examples/mlp.py:factory", "--cluster", "1x2xcpu", "--global-batch", "8", "-o", str(out)])
    assert code == 0
    return out


def test_model_file_missing(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    message = _error(
        capsys, "compile", "nope.py:factory", "--cluster", "1x2xcpu", "--global-batch", "8", "-o", str(tmp_path / "p")
    )
    assert "file nope.py does not exist" in message
    assert not (tmp_path / "p").exists()


def test_factory_missing(capsys: pytest.CaptureFixture[str]) -> None:
    message = _error(capsys, "dump", "examples/mlp.py:nope")
    assert "has no attribute 'nope'" in message and "factory" in message


def test_factory_returns_the_wrong_thing(capsys: pytest.CaptureFixture[str], model_file: Path) -> None:
    message = _error(capsys, "dump", f"{model_file}:only_model")
    assert "only_model" in message


def test_model_that_cannot_be_captured(capsys: pytest.CaptureFixture[str], model_file: Path) -> None:
    message = _error(capsys, "dump", f"{model_file}:factory")
    assert "fx" in message and "export" in message


def test_unknown_device_kind(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    message = _error(
        capsys, "compile", f"profile:{BERT}", "--cluster", "2x8xV200", "--global-batch", "8", "-o", str(tmp_path / "p")
    )
    assert "unknown device kind 'V200'" in message and "V100-16GB" in message


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        pytest.param(
            ["--global-batch", "7", "--microbatches", "2"],
            "global batch 7 is not divisible into 2 microbatches",
            id="global-batch-not-divisible",
        ),
        pytest.param(
            ["--global-batch", "8", "--stages", "4"],
            "4 stages were requested but cluster 1x2xV100-16GB has only 2 devices",
            id="more-stages-than-devices",
        ),
    ],
)
def test_impossible_shape_on_two_devices(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str], expected: str
) -> None:
    message = _error(
        capsys, "compile", f"profile:{BERT}", "--cluster", "1x2xV100-16GB", *flags, "-o", str(tmp_path / "p")
    )
    assert expected in message


def test_plan_that_does_not_fit(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "p"
    message = _error(
        capsys, "compile", f"profile:{BERT}", "--cluster", "1x1xcpu", "--global-batch", "8", "-o", str(out)
    )
    assert "no plan fits in memory" in message and "--cluster 2x1xcpu" in message
    assert not out.exists(), "a failed compile leaves no plan directory"


def test_unknown_pass(capsys: pytest.CaptureFixture[str]) -> None:
    golden = str(ROOT / "tests" / "golden" / "ir" / "all_shapes.dapple")
    message = _error(capsys, "opt", golden, "-p", "dce,shedule")
    assert "unknown pass 'shedule'; registered passes are:" in message and "schedule" in message


def test_malformed_ir(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.dapple"
    bad.write_text("module @m {\n  %x = input f32[3]\n}\n")
    err = _error(capsys, "opt", str(bad))
    assert err.startswith(f"error: {bad}:2:")


def test_plan_directory_missing(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    message = _error(capsys, "run", str(tmp_path / "nowhere"), "--steps", "1")
    assert "does not exist; create one with `dapple compile" in message


def test_running_a_profile_plan(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "bert"
    assert (
        main(["compile", f"profile:{BERT}", "--cluster", "1x4xV100-16GB", "--global-batch", "8", "-o", str(out)]) == 0
    )
    capsys.readouterr()
    message = _error(capsys, "run", str(out), "--steps", "1")
    assert "can be planned and simulated" in message and "not run" in message


@pytest.fixture(scope="module")
def two_rank_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("plans") / "mlp2"
    argv = ["compile", "examples/mlp.py:factory", "--cluster", "1x2xcpu", "--global-batch", "8", "--stages", "2"]
    assert main([*argv, "-o", str(out)]) == 0
    return out


def test_missing_torchrun(capsys: pytest.CaptureFixture[str], cpu_plan: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed

    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    message = _error(capsys, "run", str(cpu_plan), "--steps", "1")
    assert "has no torch.distributed, so torchrun cannot start" in message and "--transport threads" in message


def test_port_in_use(capsys: pytest.CaptureFixture[str], cpu_plan: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        message = _error(capsys, "run", str(cpu_plan), "--steps", "1", "--rdzv-endpoint", f"127.0.0.1:{port}")
    assert f"port {port} of the rendezvous endpoint 127.0.0.1:{port} is already in use" in message


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        # Issue 47 item 9: a one-node run waited 128 s and blamed the rendezvous.
        (["--node-rank", "5"], "node rank 5 is not a node of this run: the node rank must be at least 0 and less"),
        (["--node-rank", "5"], "run on 1 node(s) (--nnodes 1), numbered 0 to 0"),
        (["--node-rank", "-1", "--nnodes", "2"], "node rank -1 is not a node of this run"),
        (["--nnodes", "2", "--node-rank", "1"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT, the same on every node"),
        (["--nnodes", "4"], "the plan's 2 ranks do not divide evenly over 4 nodes"),
        (
            ["--transport", "threads", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400"],
            "--transport threads runs every rank as a thread of this process, on this machine, so --nnodes 2, "
            "--rdzv-endpoint 127.0.0.1:29400 has no meaning there",
        ),
        (["--transport", "threads", "--listen-host", "127.0.0.1"], "so --listen-host 127.0.0.1 has no meaning"),
    ],
)
def test_launch_options_that_cannot_work_are_refused_before_anything_starts(
    capsys: pytest.CaptureFixture[str], two_rank_plan: Path, flags: list[str], needle: str
) -> None:
    start = time.monotonic()
    message = _error(capsys, "run", str(two_rank_plan), "--steps", "1", "--timeout", "5", *flags)
    assert needle in message
    assert time.monotonic() - start < 30  # no torchrun started, no watchdog waited


def test_cuda_under_torchrun_needs_a_gpu_per_rank(
    capsys: pytest.CaptureFixture[str], two_rank_plan: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    message = _error(capsys, "run", str(two_rank_plan), "--steps", "1", "--device", "cuda")
    assert "device cuda under torchrun gives each of this node's 2 ranks a GPU of its own, but torch sees 1" in message


EXITING = """
import sys
import torch
from torch import nn

def factory():
    sys.exit(3)
"""


def test_a_factory_that_exits_is_an_error_naming_it(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    model = tmp_path / "quits.py"
    model.write_text(EXITING)
    out = tmp_path / "p"
    message = _error(
        capsys, "compile", f"{model}:factory", "--cluster", "1x2xcpu", "--global-batch", "8", "-o", str(out)
    )
    assert f"model spec {model}:factory: the factory called sys.exit(3)" in message
    assert not out.exists()


def test_a_model_file_that_exits_on_import(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    model = tmp_path / "quits_early.py"
    model.write_text("import sys\nsys.exit('bye')\n")
    message = _error(capsys, "dump", f"{model}:factory")
    assert f"importing {model} called sys.exit('bye')" in message


@pytest.mark.parametrize(
    ("cluster", "needle"),
    [
        ("99999999999999999999xcpu", "99,999,999,999,999,999,999 device(s) is more than the 65,536 devices"),
        ("99999999999999999999x2xcpu", "99,999,999,999,999,999,999 node(s) x 2 device(s) is more than the 65,536"),
        ("300x300xcpu", "300 node(s) x 300 device(s) is more than the 65,536 devices"),
    ],
)
def test_a_cluster_beyond_the_bound(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, cluster: str, needle: str
) -> None:
    message = _error(
        capsys, "compile", f"profile:{BERT}", "--cluster", cluster, "--global-batch", "8", "-o", str(tmp_path / "p")
    )
    assert needle in message


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        (
            'device = "cpu"\ndevices_per_node = 2\nnodes = 99999999999999999\n',
            "field 'nodes' is 99,999,999,999,999,999, more than the 65,536",
        ),
        ('device = "cpu"\ndevices_per_node = 70000\n', "1 node(s) x 70,000 device(s) is more than the 65,536"),
        ('device = "cpu"\ndevices_per_node = 1e300\n', "devices_per_node"),
    ],
)
def test_a_cluster_file_beyond_the_bound(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, toml: str, needle: str
) -> None:
    path = tmp_path / "big.toml"
    path.write_text(toml)
    message = _error(
        capsys, "compile", f"profile:{BERT}", "--cluster", str(path), "--global-batch", "8", "-o", str(tmp_path / "p")
    )
    assert needle in message


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--lr", "nan"], "the learning rate must be a positive finite number, not nan"),
        (["--lr", "-1"], "the learning rate must be a positive finite number, not -1.0"),
        (["--save", "ckpt", "--save-every", "0"], "--save-every must be at least 1 step, not 0"),
        (["--save-every", "2"], "--save-every needs --save DIR"),
    ],
)
def test_bad_run_options(capsys: pytest.CaptureFixture[str], cpu_plan: Path, flags: list[str], needle: str) -> None:
    message = _error(capsys, "run", str(cpu_plan), "--steps", "1", "--transport", "threads", *flags)
    assert needle in message


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("lr", "fast", "field lr must be a positive finite number (or null: the optimizer's default), not 'fast'"),
        ("seed", "abc", "field seed must be a whole number from 0 to 2**63 - 1, not 'abc'"),
    ],
)
def test_bad_values_in_plan_json(
    capsys: pytest.CaptureFixture[str], cpu_plan: Path, tmp_path: Path, field: str, value: str, needle: str
) -> None:
    plan = tmp_path / "plan"
    shutil.copytree(cpu_plan, plan)
    meta = json.loads((plan / "plan.json").read_text())
    (plan / "plan.json").write_text(json.dumps(meta | {field: value}))
    message = _error(capsys, "run", str(plan), "--steps", "1", "--transport", "threads")
    assert "plan.json was edited after compilation" in message  # as edited by hand
    write_plan_json(plan, meta | {field: value})  # and as a tool that reseals it would leave it
    message = _error(capsys, "run", str(plan), "--steps", "1", "--transport", "threads")
    assert needle in message
