"""`annotate-cost`: golden IR in / IR out, and the roofline against hand-computed values."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dapple_ir.cluster.spec import PRESETS
from dapple_ir.errors import PassError
from dapple_ir.ir.parser import parse_module
from dapple_ir.ir.printer import print_module
from dapple_ir.pass_manager import PassManager, build_pipeline
from dapple_ir.registry import PassContext

GOLDEN = Path(__file__).parent / "golden" / "annotate_cost"
CASES = sorted(GOLDEN.glob("*.in.dapple"))


def _run_case(path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    text = path.read_text()
    pipeline = next(line for line in text.splitlines() if line.startswith("// RUN:"))[len("// RUN:") :].strip()
    monkeypatch.chdir(GOLDEN)  # profile JSON paths in RUN lines are relative to the golden folder
    module = parse_module(text, str(path))
    PassManager(build_pipeline(pipeline)).run(module, PassContext())
    return print_module(module)


@pytest.mark.parametrize("path", CASES, ids=[p.name.split(".")[0] for p in CASES])
def test_golden(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = _run_case(path, monkeypatch)
    expected = path.with_name(path.name.replace(".in.", ".out."))
    if os.environ.get("DAPPLE_UPDATE_GOLDEN"):
        expected.write_text(out)
    assert out == expected.read_text()
    assert print_module(parse_module(out)) == out


def _ops(path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    module = parse_module(_run_case(path, monkeypatch))
    return {"module": module, **{op.name: op for op in module.ops}}


def test_roofline_matches_hand_computation(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = _ops(GOLDEN / "roofline.in.dapple", monkeypatch)
    peak, bandwidth = 15.7e12, 900e9  # V100 f32
    call = PRESETS["V100-16GB"].op_overhead  # fixed seconds per op call, forward and backward each
    # Linear(1024, 1024) at 4 samples: activations 4*1024*4 bytes in and out, weights read whole.
    moved = 2 * 4 * 1024 * 4 + (1024 * 1024 + 1024) * 4
    flops = 2 * 4 * 1024 * 1024
    fc = ops["fc"]
    assert fc.attrs.fwd_s == pytest.approx(max(flops / peak, moved / bandwidth) / 0.6 + call, rel=1e-12)  # type: ignore[attr-defined]
    assert fc.attrs.bwd_s == pytest.approx(max(2 * flops / peak, 2 * moved / bandwidth) / 0.6 + call, rel=1e-12)  # type: ignore[attr-defined]
    relu = ops["relu"]
    assert relu.attrs.fwd_s == pytest.approx(2 * 4 * 1024 * 4 / bandwidth / 0.8 + call, rel=1e-12)  # type: ignore[attr-defined]
    assert relu.attrs.act_bytes == 4 * 1024 * 4  # type: ignore[attr-defined]
    assert ops["module"].attrs.cost_batch == 4  # type: ignore[attr-defined]


def test_compute_bound_times_are_affine_in_the_microbatch() -> None:
    # Past H100's fixed seconds per call (launch, occupancy floor), the time scales with the samples.
    call = PRESETS["H100"].op_overhead
    assert call > 0
    costs = (
        'fwd_flops = 8.589934592e+12, bwd_flops = 1.7179869184e+13, mem_bytes = 4194304.0, op_class = "matmul", '
        "act_bytes = 2097152.0"
    )
    text = (
        'module @m attributes {batch = 64, cluster = "1x1xH100"} {\n  %x = input : f32[64,8192]\n'
        f"  %fc = call_function @torch.mm(%x) : f32[64,8192] {{{costs}}}\n}}\n"
    )
    times: dict[int, tuple[float, float, float]] = {}
    for b in (16, 32, 64):
        module = parse_module(text)
        PassManager(build_pipeline(f"annotate-cost{{microbatch={b},efficiency=0.5}}")).run(module, PassContext())
        attrs = module.ops[1].attrs
        assert attrs.fwd_s is not None and attrs.bwd_s is not None and attrs.act_bytes is not None
        times[b] = (attrs.fwd_s, attrs.bwd_s, attrs.act_bytes)
    assert times[64][0] == pytest.approx(8.589934592e12 / 67e12 / 0.5 + call)
    for b in (16, 32):
        assert times[b][0] - call == pytest.approx((times[64][0] - call) * b / 64)
        assert times[b][1] - call == pytest.approx((times[64][1] - call) * b / 64)
        assert times[b][2] == pytest.approx(2097152.0 * b / 64)


def test_analytic_without_a_cluster_says_how_to_give_one() -> None:
    module = parse_module("module @m attributes {batch = 2} {\n  %x = input : f32[2,4] {mem_bytes = 32.0}\n}\n")
    with pytest.raises(PassError, match="--cluster"):
        PassManager(build_pipeline("annotate-cost")).run(module, PassContext())
    PassManager(build_pipeline("annotate-cost")).run(module, PassContext(cluster="1x1xcpu"))
    cpu = PRESETS["cpu"]
    assert module.ops[0].attrs.fwd_s == pytest.approx(32.0 / cpu.mem_bandwidth / 0.6 + cpu.op_overhead)


def test_measured_profile_must_cover_every_op(tmp_path: Path) -> None:
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"microbatch": 2, "ops": {"fc": {"fwd_s": 1.0, "bwd_s": 2.0}}}))
    text = (
        "module @m {\n  %x = input : f32[2,4]\n  %fc = call_function @f(%x) : f32[2,4]\n"
        "  %g = call_function @g(%fc) : f32[2,4]\n}\n"
    )
    with pytest.raises(PassError, match="%g"):
        PassManager(build_pipeline(f'annotate-cost{{source="{profile}"}}')).run(parse_module(text), PassContext())
    with pytest.raises(PassError, match="neither 'analytic' nor"):
        PassManager(build_pipeline("annotate-cost{source=nothere.json}")).run(parse_module(text), PassContext())


def test_optimizer_option_sets_the_memory_model() -> None:
    from dapple_ir.analysis.memory import static_bytes

    text = (
        "module @m attributes {batch = 2} {\n  param @w : f32[10,10]\n  %x = input : f32[2,10]\n"
        "  %y = call_function @f(%x) : f32[2,10] {params = [@w]}\n}\n"
    )
    module = parse_module(text)
    PassManager(build_pipeline("annotate-cost{optimizer=sgd}")).run(module, PassContext())
    assert module.attrs.optimizer == "sgd"
    assert static_bytes(module, module.ops) == 400 * 2  # weights and gradients, no state
    PassManager(build_pipeline("annotate-cost{optimizer=3}")).run(module, PassContext())
    assert static_bytes(module, module.ops) == 400 * (2 + 3)  # a custom multiplier: master weights + Adam
    with pytest.raises(PassError, match="unknown optimizer"):
        PassManager(build_pipeline("annotate-cost{optimizer=lion}")).run(module, PassContext())
