"""The simulator on programs made by the real passes: `schedule`, `lower-comm`, `insert-frees`.

Same closed forms as `test_simulator.py` (see the references there), and the simulated memory curve
must peak exactly where the static analysis (`peak_memory`, stored by `insert-frees`) says.
"""

from __future__ import annotations

import pytest

from dapple_ir.analysis.peak_memory import peak_bytes_per_rank
from dapple_ir.ir import InstrKind, Module
from dapple_ir.pass_manager import PassManager, build_pipeline
from dapple_ir.registry import PassContext
from dapple_ir.sim.simulator import simulate
from tests.pipeline_fixtures import chain_module
from tests.test_simulator import pipeline_module


def lowered(kind: str, devices: int, microbatches: int, virtual: int = 1, **kwargs: object) -> Module:
    # Parameters make every boundary value need a gradient, so backward passes depend on each other.
    kwargs.setdefault("param_elems", 16)
    module = pipeline_module(devices, microbatches, None, virtual=virtual, **kwargs)  # type: ignore[arg-type]
    spec = f"schedule{{kind={kind},microbatches={microbatches},virtual={virtual}}},lower-comm,insert-frees"
    PassManager(build_pipeline(spec)).run(module, PassContext())
    return module


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "microbatches"), [(2, 4), (4, 8), (4, 3)])
def test_gpipe_and_1f1b_closed_form(kind: str, stages: int, microbatches: int) -> None:
    f, b = 1.0, 2.0
    result = simulate(lowered(kind, stages, microbatches, fwd_s=f, bwd_s=b))
    assert result.iteration_s == pytest.approx((microbatches + stages - 1) * (f + b))
    assert result.bubble_fraction == pytest.approx([(stages - 1) / (microbatches + stages - 1)] * stages)


@pytest.mark.parametrize(("devices", "microbatches", "virtual"), [(2, 4, 2), (4, 8, 2)])
def test_interleaved_closed_form(devices: int, microbatches: int, virtual: int) -> None:
    f, b = 1.0, 2.0
    module = lowered("interleaved", devices, microbatches, virtual, fwd_s=f / virtual, bwd_s=b / virtual)
    result = simulate(module)
    assert result.iteration_s == pytest.approx(microbatches * (f + b) + (devices - 1) * (f + b) / virtual)


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 4), (4, 8)])
def test_zb_h1_closed_form(stages: int, microbatches: int) -> None:
    """ZB-H1 with T_F = T_B = T_W = 1: M * 3 + (p - 1)(T_F + T_B - T_W)."""
    result = simulate(lowered("zb-h1", stages, microbatches, fwd_s=1.0, bwd_s=2.0))
    assert result.iteration_s == pytest.approx(microbatches * 3.0 + (stages - 1) * 1.0)


@pytest.mark.parametrize(("kind", "virtual"), [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)])
def test_memory_curve_peaks_at_the_static_peak(kind: str, virtual: int) -> None:
    module = lowered(kind, 4, 8, virtual, act_bytes=3e6, out_bytes=1e6, param_elems=1000, microbatch_size=4)
    result = simulate(module, cluster="1x8xV100-16GB")
    static = peak_bytes_per_rank(module)
    assert result.peak_bytes == pytest.approx([static[r] for r in range(len(module.programs))])
    assert result.peak_bytes == pytest.approx([p.attrs.peak_bytes for p in module.programs])
    assert all(curve[-1][1] == pytest.approx(curve[0][1]) for curve in result.memory)  # everything freed


def test_replicated_stage_allreduces_after_both_replicas() -> None:
    module = pipeline_module(2, 4, None, fwd_s=1.0, bwd_s=2.0, param_elems=1_000_000)
    module.stages[0].attrs.replicas, module.stages[0].attrs.devices = 2, (0, 1)
    module.stages[1].attrs.devices = (2,)
    PassManager(build_pipeline("schedule{kind=1f1b},lower-comm,insert-frees")).run(module, PassContext())
    result = simulate(module, cluster="1x4xV100-16GB")
    reduces = [e for e in result.events() if e.instr.kind is InstrKind.ALLREDUCE]
    assert len(reduces) == 2
    last_backward = max(e.end_s for e in result.events() if e.instr.kind is InstrKind.BACKWARD and e.rank < 2)
    ring = 2 * 1 / 2 * 4e6 / 25e9 + 2 * 5e-6  # two V100s in one server: 25 GB/s, 5 us
    for e in reduces:
        assert e.end_s == pytest.approx(last_backward + ring)


def test_tied_parameter_is_reduced_once_by_its_own_allreduce() -> None:
    """w0 is read by s0 (2 replicas) and s1: the stage allreduce sums only w1, `allreduce param @w0` sums w0.

    Ring costs on one V100 server (25 GB/s, 5 us per step): 2(n-1)/n * bytes / bandwidth + 2(n-1) * latency.
    """
    module = chain_module([2, 1], replicas=[2, 1], tied=True, devices=True)
    PassManager(build_pipeline("schedule{kind=1f1b,microbatches=4},lower-comm,insert-frees")).run(module, PassContext())
    result = simulate(module, cluster="1x4xV100-16GB")
    by_target: dict[str, list[tuple[float, float]]] = {}
    for e in result.events():
        if e.instr.kind is InstrKind.ALLREDUCE:
            target = e.instr.param or e.instr.stage.name  # type: ignore[union-attr]
            by_target.setdefault(target, []).append((e.start_s, e.end_s))
    w_bytes = 16 * 16 * 4
    expected = {"s0": 2 * 1 / 2 * w_bytes / 25e9 + 2 * 5e-6, "w0": 2 * 2 / 3 * w_bytes / 25e9 + 4 * 5e-6}
    assert {k: len(v) for k, v in by_target.items()} == {"s0": 2, "w0": 3}
    for target, events in by_target.items():
        start = max(s for s, _ in events)
        assert all(end == pytest.approx(start + expected[target]) for _, end in events)
