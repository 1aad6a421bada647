"""Failures end a run quickly with the failing rank's own error; bad plans and inputs get clear errors."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from dapple_ir.backends.torch.launch import run
from dapple_ir.backends.torch.transport import ThreadHub, ThreadTransport, TransportError
from dapple_ir.errors import DappleError, RuntimeFailure
from dapple_ir.plan_dir import write_plan_json
from tests.test_runtime import MLP, make_plan


def reseal(plan: Path) -> None:
    """Seal the plan's files as they are now (what a careful tamperer would do)."""
    write_plan_json(plan, json.loads((plan / "plan.json").read_text()))


#: A model whose third layer calls `explode`, which fx records as one op: on real tensors it raises
#: (or kills its process) when DAPPLE_TEST_EXPLODE says so. Its data comes from `dapple_data`, which
#: puts a NaN into the batch of step DAPPLE_TEST_NAN_STEP.
EXPLODING = """
import os
import signal
import time

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn


def explode(x):
    mode = os.environ.get("DAPPLE_TEST_EXPLODE", "")
    real = type(x) is torch.Tensor or type(x) is nn.Parameter
    if mode and real and x.device.type != "meta":
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "hang":
            time.sleep(3)
            return x
        raise ValueError("boom: the exploding layer was reached")
    return x


torch.fx.wrap("explode")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.l2 = nn.Linear(16, 16)
        self.l3 = nn.Linear(16, 16)
        self.l4 = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.l1(x))
        h = torch.relu(self.l2(h))
        h = explode(self.l3(h))
        return self.l4(h)


def factory():
    return Net(), (torch.randn(4, 8),), F.mse_loss, (torch.randn(4, 4),)


def dapple_data(step, global_batch, seed):
    g = torch.Generator().manual_seed(seed + 17 * step)
    x = torch.randn(global_batch, 8, generator=g)
    if str(step) == os.environ.get("DAPPLE_TEST_NAN_STEP"):
        x[0, 0] = float("nan")
    return (x,), (torch.randn(global_batch, 4, generator=g),)
"""


@pytest.fixture
def exploding(tmp_path: Path) -> str:
    path = tmp_path / "exploding.py"
    path.write_text(EXPLODING)
    return f"{path}:factory"


def test_user_data_function_is_used_by_both_sides(tmp_path: Path, exploding: str) -> None:
    plan = make_plan(tmp_path / "plan", exploding, stages=2, kind="1f1b")
    result = run(plan, steps=2, check=True, transport="threads", timeout=20)
    assert result.check is not None and result.check.ok


def test_raising_rank_stops_every_rank_with_its_error(
    tmp_path: Path, exploding: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = make_plan(tmp_path / "plan", exploding, stages=4, kind="1f1b")
    monkeypatch.setenv("DAPPLE_TEST_EXPLODE", "raise")
    start = time.monotonic()
    with pytest.raises(RuntimeFailure) as info:
        run(plan, steps=2, transport="threads", timeout=20)
    message = str(info.value)
    # The op sits in one stage: that rank's error is shown, not the peers' timeouts.
    assert "boom: the exploding layer was reached" in message
    assert message.startswith("rank ")
    assert "forward @s" in message
    assert "Traceback" not in message
    assert time.monotonic() - start < 20  # the others stopped at once, not after the timeout


@pytest.mark.slow
def test_silent_peer_makes_the_waiting_rank_time_out(
    tmp_path: Path, exploding: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One microbatch: rank 1 stalls once (3 s), not once per microbatch, before it sees the failure and ends.
    plan = make_plan(tmp_path / "plan", exploding, stages=2, kind="gpipe", microbatches=1)
    monkeypatch.setenv("DAPPLE_TEST_EXPLODE", "hang")  # rank 1 stalls 3 s in its first forward
    start = time.monotonic()
    with pytest.raises(RuntimeFailure, match=r"^rank 0: timed out after 1 s on rank 0 receiving .* from rank 1"):
        run(plan, steps=1, transport="threads", timeout=1)
    assert time.monotonic() - start < 30  # capture included; without the timeout it would wait forever


def test_the_first_rank_failing_on_its_own_is_reported() -> None:
    from dapple_ir.backends.torch.launch import _first_failure

    echo = {"rank": 0, "time": 1.0, "secondary": True, "message": "rank 0: timed out"}
    cause = {"rank": 2, "time": 2.0, "secondary": False, "message": "rank 2: boom"}
    later = {"rank": 3, "time": 3.0, "secondary": False, "message": "rank 3: bang"}
    reset = {"rank": 1, "time": 1.5, "secondary": True, "message": "rank 1: recv failed: Connection reset by peer"}
    first = _first_failure({0: echo, 1: reset, 2: cause, 3: later}, {4})
    assert first == (
        "rank 2: boom. Echoes, not causes: rank 0: timed out waiting after rank 2 failed; rank 1: lost its peer "
        "after rank 2 failed; rank 3: failed too, later: bang; rank(s) 4: stopped without a report"
    )
    killed = _first_failure({0: echo}, {1}, (1, -9))
    assert killed.startswith("rank 1 was killed by signal 9")
    assert killed.endswith("Echoes, not causes: rank 0: timed out waiting after rank 1 failed")
    frozen = _first_failure({0: echo}, {1}, (1, -9), {1: "rank 1 (pid 7) was stopped (SIGSTOP or a debugger)"})
    assert frozen.startswith("rank 1 (pid 7) was stopped")  # the watchdog saw it stopped: that beats torchrun's guess
    assert _first_failure({0: echo}, {1}, (0, 1)).startswith("rank 0: timed out. Echoes, not causes: rank(s) 1")
    assert _first_failure({}, {1, 2}).startswith("rank(s) 1, 2 exited without reporting")


def test_an_error_is_an_echo_when_a_peer_went_away() -> None:
    from dapple_ir.backends.torch.worker import error_report, mark_failure

    assert error_report(1, TransportError("timed out after 1 s"))["secondary"]
    assert error_report(1, RuntimeError("[pair.cc:553] Connection reset by peer [127.0.0.1]:1234"))["secondary"]
    own = ValueError("boom\nmore detail")
    mark_failure(own)
    failed_at = error_report(1, own)["time"]
    time.sleep(0.01)
    report = error_report(1, own)
    assert not report["secondary"]
    assert report["message"] == "rank 1: ValueError: boom"
    assert report["time"] == failed_at  # when it was raised, not when the report was written


def test_nan_loss_is_a_clear_error_naming_the_rank(
    tmp_path: Path, exploding: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = make_plan(tmp_path / "plan", exploding, stages=2, kind="gpipe")
    monkeypatch.setenv("DAPPLE_TEST_NAN_STEP", "1")
    with pytest.raises(
        RuntimeFailure, match=r"rank 1, step 1, forward @s1 mb = 0.*loss of microbatch 0 at step 1 is nan"
    ):
        run(plan, steps=3, transport="threads", timeout=20)


def test_missing_plan_file(tmp_path: Path) -> None:
    plan = make_plan(tmp_path / "plan", MLP, stages=2)
    (plan / "plan.json").unlink()
    with pytest.raises(DappleError, match=r"plan\.json is missing"):
        run(plan, steps=1, transport="threads")


def test_edited_ir_is_refused(tmp_path: Path) -> None:
    plan = make_plan(tmp_path / "plan", MLP, stages=2)
    ir = plan / "plan.dapple"
    ir.write_text(
        ir.read_text()
        .replace("forward @s1 mb = 3", "forward @s1 mb = 2", 1)
        .replace("backward @s1 mb = 3", "backward @s1 mb = 2", 1)
    )
    reseal(plan)  # past the digest, so that the rank-file check is what refuses it
    with pytest.raises(DappleError, match=r"rank 0: .*rank_0\.py differs from what plan\.dapple generates"):
        run(plan, steps=1, transport="threads", timeout=10)


def test_edited_rank_file_is_refused(tmp_path: Path) -> None:
    plan = make_plan(tmp_path / "plan", MLP, stages=2)
    source = plan / "rank_0.py"
    source.write_text(source.read_text() + "\nimport os  # sneaky\n")
    reseal(plan)  # past the digest, so that the rank-file check is what refuses it
    with pytest.raises(DappleError, match=r"rank 0: .*rank_0\.py differs"):
        run(plan, steps=1, transport="threads", timeout=10)


def test_edited_stage_list_in_json_is_refused(tmp_path: Path) -> None:
    plan = make_plan(tmp_path / "plan", MLP, stages=2)
    meta = json.loads((plan / "plan.json").read_text())
    meta["stages"][0]["nodes"].pop()
    write_plan_json(plan, meta)  # past the digest, so that the cross-check is what refuses it
    with pytest.raises(DappleError, match=r"stages\[0\]\.nodes disagrees with stage @s0"):
        run(plan, steps=1, transport="threads")


def test_changed_model_is_refused(tmp_path: Path) -> None:
    plan = make_plan(tmp_path / "plan", MLP, stages=2)
    meta = json.loads((plan / "plan.json").read_text())
    meta["model_hash"] = "0" * 64
    write_plan_json(plan, meta)  # past the digest, so that the model check is what refuses it
    with pytest.raises(DappleError, match=r"no longer matches the plan"):
        run(plan, steps=1, transport="threads")


def test_plan_for_more_ranks_than_launched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dapple_ir.backends.torch.worker import RunOptions, _run_torchrun_rank

    plan = make_plan(tmp_path / "plan", MLP, stages=2)
    monkeypatch.setenv("WORLD_SIZE", "1")
    options = RunOptions(steps=1, optimizer="sgd", lr=0.1, timeout=5, run_dir=str(tmp_path / "run"))
    with pytest.raises(DappleError, match=r"has 2 ranks but 1 processes were launched"):
        _run_torchrun_rank(str(plan), 0, options)


def test_resume_from_another_plan_is_refused(tmp_path: Path) -> None:
    first = make_plan(tmp_path / "a", MLP, stages=2, kind="gpipe")
    second = make_plan(tmp_path / "b", MLP, stages=2, kind="1f1b")
    run(first, steps=1, transport="threads", save=tmp_path / "ckpt", timeout=10)
    with pytest.raises(DappleError, match=r"saved by a different plan"):
        run(second, steps=1, transport="threads", resume=tmp_path / "ckpt", timeout=10)


def test_thread_transport_waits_are_bounded() -> None:
    hub = ThreadHub(2)
    a = ThreadTransport(hub, 0)
    start = time.monotonic()
    with pytest.raises(TransportError, match=r"timed out after 0.2 s on rank 0 receiving tag 7 from rank 1"):
        a.recv(1, 7, timeout=0.2)
    with pytest.raises(TransportError, match=r"timed out"):
        a.allreduce(torch.ones(3), (0, 1), timeout=0.2)
    hub.fail(1, "rank 1: boom")
    with pytest.raises(TransportError, match=r"rank 1 failed"):
        a.recv(1, 8, timeout=30)
    assert time.monotonic() - start < 5


def test_environment_is_left_alone() -> None:
    # The exploding fixture is driven by variables monkeypatch removes again; make sure none leaked.
    assert "DAPPLE_TEST_EXPLODE" not in os.environ
