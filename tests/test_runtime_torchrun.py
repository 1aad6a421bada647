"""Real multi-process runs: torchrun, gloo on 127.0.0.1 with a free port, every wait bounded."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dapple_ir.backends.torch.launch import run
from dapple_ir.errors import RuntimeFailure
from tests.test_runtime import GPT, make_plan
from tests.test_runtime_failures import EXPLODING

pytestmark = pytest.mark.slow


def test_two_processes_train_gpt_like_one_device(tmp_path: Path) -> None:
    # Two stages on three processes: the tied embedding crosses processes, stage 1 is replicated.
    plan = make_plan(tmp_path / "plan", GPT, stages=2, replicas=[1, 2], kind="zb-h1")
    result = run(plan, steps=2, check=True, transport="torchrun", timeout=60, device="cpu")
    assert result.check is not None and result.check.ok, result.check
    assert result.devices == ["cpu", "cpu", "cpu"]
    assert len(result.peak_bytes) == 3 and all(peak > 0 for peak in result.peak_bytes)
    assert (plan / "timeline_measured.json").is_file()
    assert not list((plan / "run").glob("error_rank_*.json"))
    # Exact (the check above) with receive buffers reused: after the first microbatches, receives land in
    # buffers that earlier microbatches' backwards let go of: of two steps' receives, at most half need a new one.
    counts = [json.loads((plan / "run" / f"rank_{r}.json").read_text())["recv_buffers"] for r in range(3)]
    assert all(c["reused"] >= c["allocated"] > 0 for c in counts), counts


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("raise", r"^rank 1, step 0, forward @s1 mb = 0 raised ValueError: boom: the exploding layer was reached"),
        ("kill", r"^rank 1 was killed by signal 9 without reporting an error"),
    ],
)
def test_failing_process_ends_the_run_with_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, expected: str
) -> None:
    spec_file = tmp_path / "exploding.py"
    spec_file.write_text(EXPLODING)
    plan = make_plan(tmp_path / "plan", f"{spec_file}:factory", stages=2, kind="1f1b")
    monkeypatch.setenv("DAPPLE_TEST_EXPLODE", mode)
    start = time.monotonic()
    with pytest.raises(RuntimeFailure, match=expected) as info:
        run(plan, steps=2, transport="torchrun", timeout=30, device="cpu")
    assert time.monotonic() - start < 120  # rank 0 does not sit out its 30 s waits, torchrun stops it
    assert "Traceback" not in str(info.value)
    assert "worker output" in str(info.value)
