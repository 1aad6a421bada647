"""The kernel-efficiency-by-shape law (`dapple_ir.pricing.matmul_efficiency`): bounded, monotone, and it
reproduces the public figures it was fitted to (docs/cluster.md, "A100 calibration")."""

from __future__ import annotations

import itertools

import pytest

from dapple_ir.pricing.matmul_efficiency import (
    CALCULON_CEILING,
    CALCULON_POINTS,
    CALIBRATIONS,
    calibration_for,
    gemm_efficiency,
    gemm_flops,
    size_efficiency,
    wave_efficiency,
)

A100 = CALIBRATIONS["A100-80GB"]
H100 = CALIBRATIONS["H100"]
SIZES = (1, 8, 64, 128, 512, 1024, 2304, 4096, 8192, 25600, 65536)


@pytest.mark.parametrize("cal", list(CALIBRATIONS.values()), ids=list(CALIBRATIONS))
def test_bounded_by_one_and_by_its_ceiling(cal):
    for m, n, k in itertools.product(SIZES, repeat=3):
        eff = gemm_efficiency(m, n, k, cal)
        assert 0.0 < eff <= cal.ceiling < 1.0
        assert 0.0 < gemm_efficiency(m, n, k, cal, waves=True) <= eff


@pytest.mark.parametrize("cal", [A100, H100], ids=["A100", "H100"])
def test_monotone_in_every_dimension(cal):
    for fixed in itertools.product(SIZES, repeat=2):
        for axis in range(3):
            effs = []
            for size in SIZES:
                dims = list(fixed)
                dims.insert(axis, size)
                effs.append(gemm_efficiency(dims[0], dims[1], dims[2], cal))
            assert effs == sorted(effs), (axis, fixed)


def test_a_thinner_tensor_parallel_shard_is_less_efficient():
    # Megatron 1.7B's MLP up-projection at microbatch 16 (32768 tokens, h = 2304), whole and cut 2, 4, 8 ways.
    tokens, h = 16 * 2048, 2304
    effs = [gemm_efficiency(tokens, 4 * h // t, h, A100) for t in (1, 2, 4, 8)]
    assert effs == sorted(effs, reverse=True)
    assert effs[0] > effs[-1]


def test_reproduces_mamf_at_its_best_shape():
    # ml-engineering's MAMF table: A100 SXM 267.9 TFLOP/s at 6912 x 16384 x 2048, H100 SXM 792.1 at 6144 x 17920 x 2816.
    assert gemm_efficiency(6912, 16384, 2048, A100) * 312 == pytest.approx(267.9, rel=0.01)
    assert gemm_efficiency(6144, 17920, 2816, H100) * 989 == pytest.approx(792.1, rel=0.01)


def test_reproduces_calculons_size_table_relative_to_its_ceiling():
    # Within 10 % of each point (the fit's residuals are 8 % and 1 %, see the module docstring).
    for flops, eff in CALCULON_POINTS:
        assert size_efficiency(flops, A100) / A100.ceiling == pytest.approx(eff / CALCULON_CEILING, rel=0.10)
    # And its asymptote: at 128 GFLOP and beyond the law is within 1 % of its ceiling, as Calculon's table is.
    assert size_efficiency(128e9, A100) / A100.ceiling > 0.99


def test_wave_quantisation():
    # 108 SMs on an A100: 108 tiles of 256 x 128 fill one wave; one more tile costs a second, nearly empty wave.
    assert wave_efficiency(256 * 108, 128, A100) == 1.0
    assert wave_efficiency(256 * 109, 128, A100) == pytest.approx(109 / 216)
    assert wave_efficiency(256, 128, A100) == pytest.approx(1 / 108)


def test_flops_and_unknown_kinds():
    assert gemm_flops(2, 3, 4, batch=5) == 240.0
    assert size_efficiency(0.0, A100) == 0.0
    assert calibration_for("cpu") is None
    assert calibration_for("V100-16GB") is None
    assert calibration_for("A100-40GB") == CALIBRATIONS["A100-40GB"]
