"""Kernel efficiency by shape: the fraction of a GPU's 16-bit tensor-core peak a GEMM of shape (m, n, k) reaches.

The law, for a GEMM of F = 2 m n k FLOPs (times its batch count, for a batched GEMM):

    efficiency(F) = ceiling * F / (F + half_flops)

- `ceiling`: the best fraction of the datasheet peak cuBLAS reaches on the device, on the largest, best-aligned
  shapes (the Maximum Achievable Matmul FLOPS, MAMF, measured by Stas Bekman's `mamf-finder.py`: A100 SXM
  267.9 of 312 TFLOP/s, 85.9 %; H100 SXM 792.1 of 989, 80.1 %);
- `half_flops`: the size at which a GEMM reaches half of that ceiling. Fitted to the efficiency-by-size table
  Calculon (Isaev et al., SC'23; its A100 80 GB and H100 system files, validated against Megatron-LM runs)
  uses for fp16 matrix work, taken relative to its own asymptote: 1 GFLOP at 0.6 / 0.95 and 16 GFLOP at
  0.9 / 0.95 of its ceiling. Each point alone gives half_flops = F (ceiling / e - 1): 0.58 and 0.89 GFLOP;
  the law takes their geometric mean, 0.72 GFLOP, and so misses the first point by 8 % and the second by 1 %.

The law is monotone in the problem size and below 1 by construction. A tensor-parallel shard of a GEMM
(n or k cut by T) does T times fewer FLOPs and so runs at a lower efficiency: the law's answer to "matmul
efficiency falls as the shard gets thinner". Wave quantisation (`wave_efficiency`: the last wave of output
tiles leaves SMs idle) is offered separately because it is not monotone in size; cuBLAS's heuristics pick
among several tile shapes to soften it, so a plan priced with it would be priced too harshly where m n is
just past a whole wave.

Pure functions of numbers: no torch, no IR. `dapple_ir.pricing` (the lead's wiring) multiplies a matmul op's
roofline time by 1 / efficiency; sources and numbers are in docs/cluster.md, "A100 calibration".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Calculon's fp16 matrix efficiency table (GFLOP of one op -> fraction of peak) in its A100 80 GB and H100
#: system files, the points the size constant is fitted to; its asymptote (0.95 at >= 128 GFLOP).
CALCULON_POINTS: tuple[tuple[float, float], ...] = ((1e9, 0.6), (16e9, 0.9))
CALCULON_CEILING = 0.95


def half_flops_from(points: tuple[tuple[float, float], ...], ceiling: float) -> float:
    """The size constant of the law that best fits `points` (FLOPs, efficiency) whose asymptote is `ceiling`:
    the geometric mean of each point's own F (ceiling / e - 1), i.e. least squares in log(half_flops)."""
    logs = [math.log(flops * (ceiling / eff - 1.0)) for flops, eff in points]
    return math.exp(sum(logs) / len(logs))


@dataclass(frozen=True)
class GemmCalibration:
    """What the law knows of one device kind."""

    kind: str
    """The device kind (`cluster.spec.PRESETS` key)."""
    ceiling: float
    """Best fraction of the 16-bit dense tensor-core peak cuBLAS reaches (MAMF / datasheet)."""
    half_flops: float
    """FLOPs of a GEMM that reaches half of `ceiling`."""
    sms: int
    """Streaming multiprocessors: output tiles run one wave per `sms` tiles."""
    tile: tuple[int, int] = (256, 128)
    """The output tile (rows, columns) of cuBLAS's largest 16-bit kernels on Ampere and Hopper."""


_HALF_FLOPS = half_flops_from(CALCULON_POINTS, CALCULON_CEILING)

#: Per device kind. A100: MAMF 267.9 / 312 (CUDA 12.1, best shape 6912 x 16384 x 2048), 108 SMs (A100
#: datasheet). H100 and H200 (the same compute die): MAMF of the H100 SXM 792.1 / 989 (CUDA 12.1, best shape
#: 6144 x 17920 x 2816), 132 SMs. Calculon uses one size table for both generations, and so does this law.
CALIBRATIONS: dict[str, GemmCalibration] = {
    "A100-40GB": GemmCalibration("A100-40GB", 267.9 / 312, _HALF_FLOPS, 108),
    "A100-80GB": GemmCalibration("A100-80GB", 267.9 / 312, _HALF_FLOPS, 108),
    "H100": GemmCalibration("H100", 792.1 / 989, _HALF_FLOPS, 132),
    "H200": GemmCalibration("H200", 792.1 / 989, _HALF_FLOPS, 132),
}


def calibration_for(kind: str) -> GemmCalibration | None:
    """The calibration of a device kind, or None for one the law has no figures for (the CPU, the V100)."""
    return CALIBRATIONS.get(kind)


def gemm_flops(m: int, n: int, k: int, batch: int = 1) -> float:
    """FLOPs of `batch` GEMMs of (m x k) by (k x n): a multiply and an add per term."""
    return 2.0 * batch * m * n * k


def size_efficiency(flops: float, cal: GemmCalibration) -> float:
    """The law: the fraction of the 16-bit peak a GEMM of `flops` FLOPs reaches (0 for no work)."""
    if flops <= 0:
        return 0.0
    return cal.ceiling * flops / (flops + cal.half_flops)


def wave_efficiency(m: int, n: int, cal: GemmCalibration, batch: int = 1) -> float:
    """The share of the SM-time of its waves that a GEMM's output tiles fill: tiles / (waves x SMs)."""
    rows, cols = cal.tile
    tiles = batch * math.ceil(m / rows) * math.ceil(n / cols)
    if tiles <= 0:
        return 0.0
    return tiles / (math.ceil(tiles / cal.sms) * cal.sms)


def gemm_efficiency(m: int, n: int, k: int, cal: GemmCalibration, *, batch: int = 1, waves: bool = False) -> float:
    """The fraction of the 16-bit peak `batch` GEMMs of shape (m, n, k) reach: the size law, times the
    wave quantisation where `waves` (not monotone in size; see the module docstring)."""
    eff = size_efficiency(gemm_flops(m, n, k, batch), cal)
    return eff * wave_efficiency(m, n, cal, batch) if waves else eff
