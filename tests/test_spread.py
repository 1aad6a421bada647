"""The simulator under sampled costs (`dapple_ir.sim.spread`) against closed forms."""

from __future__ import annotations

import pytest

from dapple_ir.errors import DappleError
from dapple_ir.ir import InstrKind, Module
from dapple_ir.sim.simulator import simulate
from dapple_ir.sim.spread import simulate_spread
from tests.test_simulator import schedule_module


def _indices(module: Module, rank: int, kind: InstrKind) -> list[int]:
    return [i for i, ins in enumerate(module.programs[rank].instrs) if ins.kind is kind]


def test_one_sampled_forward_gives_the_closed_form_at_its_median() -> None:
    """2 stages, 1 microbatch, free links: the iteration is F0 + F1 + B1 + B0, all on one chain. With F0 drawn
    from 1..5 s the median draw takes 3 s: iteration 3 + 1 + 2 + 2 = 8; rank 0 computes 3 + 2 of it, rank 1
    1 + 2, so they wait 3/8 and 5/8."""
    module = schedule_module("1f1b", 2, 1, fwd_s=1.0, bwd_s=2.0)
    assert simulate(module).iteration_s == pytest.approx(6.0)
    (forward,) = _indices(module, 0, InstrKind.FORWARD)
    spread = simulate_spread(module, samples={(0, forward): [1.0, 2.0, 3.0, 4.0, 5.0]}, draws=2001)
    assert spread.iteration_s == pytest.approx(8.0)
    assert spread.bubble_fraction == pytest.approx([3 / 8, 5 / 8])
    assert sorted(set(spread.iterations)) == pytest.approx([6.0, 7.0, 8.0, 9.0, 10.0])


def test_spread_costs_wait_more_than_the_median_costs() -> None:
    """Rank 1's forwards take their median 0.5 s two times in three and 3 s otherwise: every draw is at least the
    median-cost step, and the ones where a slow forward lands on the chain are longer, so rank 0, whose own
    work is fixed, waits more than the median-cost simulation says."""
    module = schedule_module("1f1b", 2, 8, fwd_s=0.5, bwd_s=1.0)
    forwards = _indices(module, 1, InstrKind.FORWARD)
    at_median = simulate(module, durations={(1, i): 0.5 for i in forwards})
    spread = simulate_spread(module, samples={(1, i): [0.5, 0.5, 3.0] for i in forwards}, draws=31, seed=3)
    assert min(spread.iterations) >= at_median.iteration_s - 1e-12
    assert spread.bubble_fraction[0] > at_median.bubble_fraction[0]
    again = simulate_spread(module, samples={(1, i): [0.5, 0.5, 3.0] for i in forwards}, draws=31, seed=3)
    assert again.iterations == spread.iterations


def test_bad_samples_name_the_instruction() -> None:
    module = schedule_module("1f1b", 2, 1)
    with pytest.raises(DappleError, match="rank 1, instruction 4 has no samples"):
        simulate_spread(module, samples={(1, 4): []})
    with pytest.raises(DappleError, match="draws must be at least 1"):
        simulate_spread(module, samples={}, draws=0)
    with pytest.raises(DappleError, match="rank 0 has no instruction 999"):
        simulate_spread(module, samples={(0, 999): [1.0]})
