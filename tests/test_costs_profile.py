"""Measured profiles: the per-op sum against a direct timing of the whole model, the cache, the pass."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dapple_ir.cli import main
from dapple_ir.frontend.profiler import direct_step_s, profile_spec, write_profile
from dapple_ir.frontend.spec_loader import capture_spec
from dapple_ir.pass_manager import PassManager, build_pipeline
from dapple_ir.registry import PassContext

MLP = "examples/mlp.py:factory"
#: Per-op timing adds a call and an autograd graph per op, and CPU timings on a shared machine wander:
#: the sum of the parts is asserted only to lie within 5x of the whole (the ratio is reported).
TOLERANCE = 5.0


@pytest.fixture
def one_thread() -> object:
    before = torch.get_num_threads()
    yield None
    torch.set_num_threads(before)


def test_profile_sum_agrees_with_direct_timing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: object, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    monkeypatch.setenv("DAPPLE_IR_CACHE", str(tmp_path / "cache"))
    profile = profile_spec(MLP, microbatch=8, repeats=5, threads=1)
    direct = direct_step_s(MLP, microbatch=8, repeats=5, threads=1)
    summed = profile["total_fwd_s"] + profile["total_bwd_s"]
    ratio = summed / direct
    with capsys.disabled():
        print(f"\nMLP profile: sum of ops {summed * 1e3:.3f} ms, direct {direct * 1e3:.3f} ms, ratio {ratio:.2f}")
    assert 1 / TOLERANCE < ratio < TOLERANCE
    # The profile's own whole-step timing (captured graph, no op timed apart) agrees with the eager model's.
    assert 1 / TOLERANCE < profile["step_s"] / direct < TOLERANCE
    assert profile["cached"] is False and profile["microbatch"] == 8
    assert all(e["fwd_s"] > 0 for e in profile["ops"].values())

    # A second run is served from the cache, with the same figures.
    again = profile_spec(MLP, microbatch=8, repeats=5, threads=1)
    assert again["cached"] is True and again["ops"] == profile["ops"]
    assert len(list((tmp_path / "cache" / "profiles").glob("*.json"))) == 1
    out = tmp_path / "cli.json"
    assert main(["profile", MLP, "--microbatch", "8", "--threads", "1", "--quiet", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["ops"] == profile["ops"]  # the CLI found the same cache entry

    # annotate-cost{source=...} puts the measured times on the captured module, rescaled to 4 samples.
    path = tmp_path / "profile.json"
    write_profile(profile, str(path))
    assert "cached" not in json.loads(path.read_text())
    module = capture_spec(MLP, device="meta")
    PassManager(build_pipeline(f'annotate-cost{{source="{path}",microbatch=4}}')).run(module, PassContext())
    assert module.attrs.cost_batch == 4
    for op in module.ops:
        entry = profile["ops"].get(op.name)
        if entry is None:
            continue
        assert op.attrs.fwd_s == pytest.approx(entry["fwd_s"] / 2)
        assert op.attrs.bwd_s == pytest.approx(entry["bwd_s"] / 2)


def test_profile_rejects_devices_it_cannot_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "p.json")
    assert main(["profile", MLP, "--device", "tpu", "-o", out]) == 2
    assert "device must be cpu or cuda" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["profile", MLP, "--device", "cuda", "-o", out]) == 2
        assert "no CUDA device" in capsys.readouterr().err
    assert main(["profile", "profile:/nowhere/graph.txt", "-o", out]) == 2
    assert "imported profile" in capsys.readouterr().err


def test_the_whole_step_is_timed_at_its_median_and_an_op_at_its_fastest() -> None:
    """`Timer` with `typical` (the whole step, `step_s`) keeps the median of its measurements; without, the fastest.
    Five calls that sleep 10, 50, 20, 30 and 40 ms (each long enough to be one measurement) after a probe call:
    median 30 ms, fastest 10 ms. Sleeps overrun, never underrun: the bounds leave room above only."""
    from dapple_ir.frontend.profiler import Timer

    def sleeper() -> Callable[[], None]:
        lengths = iter([0.01, 0.01, 0.05, 0.02, 0.03, 0.04])  # the first is the probe that sizes a measurement

        def call() -> None:
            time.sleep(next(lengths))

        return call

    cpu = torch.device("cpu")
    typical = Timer(cpu, repeats=5, warmup=0, typical=True).time(sleeper())
    fastest = Timer(cpu, repeats=5, warmup=0).time(sleeper())
    assert 0.030 <= typical < 0.040
    assert 0.010 <= fastest < 0.020
