"""Lowering, frees, peak memory and the plan checks (deadlock, frees, memory fit), on hand-made programs."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapple_ir.analysis.peak_memory import (
    activation_peak_microbatches,
    memory_changes,
    peak_bytes_per_rank,
    recv_posts,
    transfer_bytes,
    weight_pass_bytes,
)
from dapple_ir.analysis.plan_checks import find_deadlock, run_plan_checks
from dapple_ir.cli import main
from dapple_ir.errors import DappleError, VerifyError
from dapple_ir.ir import InstrKind, Module
from dapple_ir.ir.parser import parse_module
from dapple_ir.ir.printer import print_module
from dapple_ir.pass_manager import PassManager, build_pipeline
from dapple_ir.registry import PassContext
from tests.pipeline_fixtures import chain_module, write_chain_profile

_FULL = "lower-comm,insert-frees,verify"

_TWO_RANKS = """module @m attributes {batch = 8, microbatches = 1} {
  param @w0 : f32[16,16]
  param @w1 : f32[16,16]
  %x = input : f32[8,16]
  %h0 = call_module @l0(%x) : f32[8,16] {params = [@w0], act_bytes = 512.0}
  %h1 = call_module @l1(%h0) : f32[8,16] {params = [@w1], act_bytes = 512.0}
  %out = output(%h1) : f32[8,16]

  stage @s0 [%x, %h0] {devices = [0]}
  stage @s1 [%h1, %out] {devices = [1]}

  program @rank0 {rank = 0, device = 0, replica = 0, stages = [@s0]} {
RANK0
  }
  program @rank1 {rank = 1, device = 1, replica = 0, stages = [@s1]} {
RANK1
  }
}
"""


def _programs(rank0: list[str], rank1: list[str]) -> Module:
    text = _TWO_RANKS.replace("RANK0", "\n".join(rank0)).replace("RANK1", "\n".join(rank1))
    return parse_module(text)


def _run(module: Module, pipeline: str, cluster: str | None = None) -> Module:
    PassManager(build_pipeline(pipeline)).run(module, PassContext(cluster=cluster))
    return module


# ------------------------------------------------------------------------------- deadlock checker


def test_deadlock_checker_reports_the_cycle() -> None:
    # Both ranks receive before they send: each waits for the other.
    module = _programs(
        ["recv grad %h0 mb = 0 from rank 1", "forward @s0 mb = 0", "send %h0 mb = 0 to rank 1", "backward @s0 mb = 0"],
        ["recv %h0 mb = 0 from rank 0", "forward @s1 mb = 0", "backward @s1 mb = 0", "send grad %h0 mb = 0 to rank 0"],
    )
    problem = find_deadlock(module.programs, module)
    assert problem == (
        "cycle: rank 0 instruction 0 `recv grad %h0 mb = 0 from rank 1` waits for rank 1; "
        "rank 1 instruction 0 `recv %h0 mb = 0 from rank 0` waits for rank 0"
    )
    with pytest.raises(DappleError, match="the programs deadlock: cycle: rank 0 instruction 0"):
        _run(module, "verify")


def test_deadlock_checker_accepts_matched_programs() -> None:
    module = _programs(
        ["forward @s0 mb = 0", "send %h0 mb = 0 to rank 1", "recv grad %h0 mb = 0 from rank 1", "backward @s0 mb = 0"],
        ["recv %h0 mb = 0 from rank 0", "forward @s1 mb = 0", "backward @s1 mb = 0", "send grad %h0 mb = 0 to rank 0"],
    )
    assert find_deadlock(module.programs, module) is None


def test_deadlock_checker_names_a_peer_that_never_sends() -> None:
    module = _programs(
        ["forward @s0 mb = 0", "backward @s0 mb = 0"],
        ["recv %h0 mb = 0 from rank 0", "forward @s1 mb = 0", "backward @s1 mb = 0"],
    )
    problem = find_deadlock(module.programs, module)
    assert problem is not None
    assert "rank 1 instruction 0 `recv %h0 mb = 0 from rank 0` waits for rank 0" in problem
    assert "rank 0 has finished its program" in problem


def test_deadlock_checker_names_a_send_nobody_receives() -> None:
    module = _programs(["forward @s0 mb = 0", "send %h0 mb = 0 to rank 1", "backward @s0 mb = 0"], [])
    assert find_deadlock(module.programs, module) == "rank 0 sends %h0 mb=0 to rank 1, which never receives it"


def test_allreduce_groups_that_disagree_deadlock() -> None:
    module = _programs(["allreduce param @w0 group = [0, 1]"], ["allreduce param @w1 group = [0, 1]"])
    problem = find_deadlock(module.programs, module)
    assert problem is not None and problem.startswith("cycle: rank 0 instruction 0 `allreduce param @w0")


# ---------------------------------------------------------------------------------------- frees


@pytest.mark.parametrize(
    ("rank0", "expected"),
    [
        (["forward @s0 mb = 0", "backward @s0 mb = 0"], "rank 0 never frees @s0 mb=0"),
        (
            ["forward @s0 mb = 0", "backward @s0 mb = 0", "free @s0 mb = 0", "free @s0 mb = 0"],
            "rank 0 instruction 3 `free @s0 mb = 0` frees what is not live",
        ),
        (
            ["forward @s0 mb = 0", "free @s0 mb = 0", "backward @s0 mb = 0"],
            "rank 0 instruction 2 `backward @s0 mb = 0` uses what rank 0 instruction 1 `free @s0 mb = 0` already freed",
        ),
    ],
)
def test_free_mistakes_are_reported(rank0: list[str], expected: str) -> None:
    module = _programs(rank0, ["forward @s1 mb = 0", "backward @s1 mb = 0", "free @s1 mb = 0"])
    with pytest.raises(VerifyError) as info:
        run_plan_checks(module)
    assert expected in str(info.value)


def test_forward_without_backward_is_reported() -> None:
    module = _programs(["forward @s0 mb = 0"], ["forward @s1 mb = 0", "backward @s1 mb = 0"])
    with pytest.raises(VerifyError, match="@s0 mb=0 runs forward; every forward needs exactly one backward"):
        run_plan_checks(module)


# ------------------------------------------------------------------------------------ lowering


def test_values_skip_stages_and_only_differentiable_values_send_gradients() -> None:
    module = _run(chain_module([1, 1, 1], skip=True), f"schedule{{kind=gpipe,microbatches=1}},{_FULL}")
    rank0 = [i for i in module.programs[0].instrs if i.kind in (InstrKind.SEND, InstrKind.RECV)]
    # %h0 feeds s1 and, through the residual, s2: sent to both, gradients received from both.
    assert [(i.kind.value, i.value.name if i.value else "", i.grad, i.peer) for i in rank0] == [
        ("send", "h0", False, 1),
        ("send", "h0", False, 2),
        ("recv", "h0", True, 1),
        ("recv", "h0", True, 2),
    ]
    frees = [i for i in module.programs[0].instrs if i.kind is InstrKind.FREE and i.grad]
    assert len(frees) == 1  # both gradients accumulate in one buffer, released once


def test_replicas_allreduce_after_their_last_backward_and_tied_parameters_across_stages() -> None:
    # s0 has 2 replicas (ranks 0, 1) and shares @w0 with s2 (rank 3); s1 is rank 2.
    module = _run(chain_module([1, 1, 1], [2, 1, 1], tied=True), f"schedule{{kind=1f1b,microbatches=4}},{_FULL}")
    rank0 = [i for i in module.programs[0].instrs if i.kind is not InstrKind.FREE]
    last_backward = max(k for k, i in enumerate(rank0) if i.kind is InstrKind.BACKWARD)
    assert rank0[last_backward + 1].kind is InstrKind.ALLREDUCE and rank0[last_backward + 1].group == (0, 1)
    assert (rank0[-2].param, rank0[-2].group) == ("w0", (0, 1, 3))
    assert rank0[-1].kind is InstrKind.OPTIMIZER_STEP
    rank2 = module.programs[2].instrs
    assert not any(i.kind is InstrKind.ALLREDUCE for i in rank2)
    rank3 = module.programs[3].instrs
    assert [(i.param, i.group) for i in rank3 if i.kind is InstrKind.ALLREDUCE] == [("w0", (0, 1, 3))]


def test_lowering_refuses_stages_against_the_data_flow() -> None:
    module = chain_module([1, 1])
    module.stages[0].ops, module.stages[1].ops = module.stages[1].ops, module.stages[0].ops
    with pytest.raises(DappleError, match=r"reads %[a-z0-9]+ from the later stage"):
        _run(module, "schedule{kind=gpipe,microbatches=1},lower-comm")


@pytest.mark.parametrize("name", ["lower-comm", "insert-frees"])
def test_passes_after_schedule_need_programs(name: str) -> None:
    with pytest.raises(DappleError, match="run `schedule` first"):
        _run(chain_module([1, 1]), name)


@pytest.mark.parametrize(
    "schedule",
    ["gpipe", "1f1b", "zb-h1", "interleaved,virtual=2"],
)
def test_lowered_programs_round_trip_through_text(schedule: str) -> None:
    module = _run(chain_module([1, 1, 1, 1], [1, 2, 1, 2]), f"schedule{{kind={schedule},microbatches=4}},{_FULL}")
    text = print_module(module)
    assert print_module(parse_module(text)) == text
    run_plan_checks(parse_module(text))


# ------------------------------------------------------------------------------- peak memory


def test_peak_bytes_match_hand_computation() -> None:
    # 3 stages of one 512-byte-activation layer each (the loss on s2 keeps another 512), adam: static =
    # 1024 * 4 per rank. 1f1b with 4 microbatches; each rank posts its next receive (512 B) one compute ahead,
    # so one more buffer is live at its peak (`post_headroom`). Rank 0 peaks in B1 with 3 forwards, the gradient
    # of microbatch 1 and that of microbatch 2, posted after F3: 4096 + 5 * 512. Rank 1 holds 2 forwards and their
    # 2 received inputs, a received gradient and the next one posted: 4096 + 6 * 512. Rank 2 holds 1 forward
    # (2 * 512), its received input and the next one, posted during its backward: 4096 + 4 * 512.
    module = _run(chain_module([1, 1, 1]), f"schedule{{kind=1f1b,microbatches=4}},{_FULL}")
    assert peak_bytes_per_rank(module) == {0: 6656.0, 1: 7168.0, 2: 6144.0}
    assert [p.attrs.peak_bytes for p in module.programs] == [6656.0, 7168.0, 6144.0]


def test_zero_bubble_keeps_the_weight_pass_gradients_until_the_free() -> None:
    # 2 stages x 2 layers, f32[8,16] outputs (512 B). Stage s0 reads only data: its weight pass is its whole
    # backward and keeps nothing. Stage s1 receives h1: backward_input keeps the gradient into each of its
    # two weight-reading layers (2 * 512) until `free @s1`; the loss reads no weight. Its layers keep 128 B of
    # activations each: with 512, holding those gradients would lift rank 1 above rank 0's 1f1b peak, and zb-h1
    # would run whole backwards there.
    module = chain_module([2, 2])
    s0, s1 = module.stages
    assert (weight_pass_bytes(module, s0), weight_pass_bytes(module, s1)) == (0.0, 1024.0)
    zb = _run(chain_module([2, 2], act=[512.0, 128.0]), f"schedule{{kind=zb-h1,microbatches=4}},{_FULL}")
    changes = _own_changes(zb, 1)
    instrs = zb.programs[1].instrs
    inputs = [i for i, instr in enumerate(instrs) if instr.kind is InstrKind.BACKWARD_INPUT]
    assert [changes[i] for i in inputs] == [1024.0] * 4
    # Every byte allocated is given back by the end of the step.
    assert sum(change for _, change in memory_changes(zb, zb.programs[1])) == 0.0
    first = _own_changes(zb, 0)
    assert not [
        i for i, instr in enumerate(zb.programs[0].instrs) if instr.kind is InstrKind.BACKWARD_INPUT and first.get(i)
    ]


def _own_changes(module: Module, rank: int) -> dict[int, float]:
    """Bytes each instruction allocates or releases itself: a receive posted early before it (`recv_posts`) is
    the receive's, not the instruction's."""
    program = module.programs[rank]
    totals: dict[int, float] = {}
    for index, change in memory_changes(module, program):
        totals[index] = totals.get(index, 0.0) + change
    for recv, post in recv_posts(module, program).items():
        totals[post] -= transfer_bytes(module, program.instrs[recv].value)  # type: ignore[arg-type]
    return totals


def test_activation_peak_microbatches_of_1f1b_and_gpipe() -> None:
    one_f_one_b = _run(chain_module([1] * 4), "schedule{kind=1f1b,microbatches=8}")
    assert [activation_peak_microbatches(p) for p in one_f_one_b.programs] == [4, 3, 2, 1]
    gpipe = _run(chain_module([1] * 4), "schedule{kind=gpipe,microbatches=8}")
    assert [activation_peak_microbatches(p) for p in gpipe.programs] == [8, 8, 8, 8]


def test_memory_check_names_rank_instruction_and_overflow() -> None:
    # The cpu preset has 8e9 bytes. Stage s1 keeps 3e9 (its layer) + 512 (the loss) per microbatch and
    # receives a 512-byte input per microbatch; its static state is @w1 with adam: 1024 * 4 = 4096.
    # GPipe with 3 microbatches peaks at the third forward (instruction 8 after load, recv, forward x 3):
    # 4096 + 3 * (3e9 + 512) + 3 * 512 = 9000007168, which overflows by 1000007168.
    module = chain_module([1, 1], act=[512.0, 3e9])
    with pytest.raises(DappleError) as info:
        _run(module, f"schedule{{kind=gpipe,microbatches=3}},{_FULL}", cluster="1x2xcpu")
    message = str(info.value)
    assert "rank 1 instruction 8 `forward @s1 mb = 2`: rank 1 on device 1 needs 9000007168 bytes" in message
    assert "1000007168 bytes more than the device's 8000000000" in message
    # 1f1b holds one microbatch on the last stage, beside its input and the next one (posted during the
    # backward: `post_headroom`): 4096 + (3e9 + 512) + 2 * 512 fits.
    fits = _run(chain_module([1, 1], act=[512.0, 3e9]), f"schedule{{kind=1f1b,microbatches=3}},{_FULL}", "1x2xcpu")
    assert fits.programs[1].attrs.peak_bytes == 4096 + 3e9 + 512 + 2 * 512


def test_memory_check_uses_the_module_cluster() -> None:
    module = chain_module([1, 1], act=[512.0, 3e9])
    module.attrs.cluster = "1x2xcpu"
    with pytest.raises(DappleError, match="more than the device's 8000000000"):
        _run(module, f"schedule{{kind=gpipe,microbatches=3}},{_FULL}")


# ------------------------------------------------------------------------------------------- CLI


def test_dapple_opt_shows_the_rank_programs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "mlp.dapple"
    path.write_text(print_module(chain_module([2, 1, 1])))
    pipeline = "schedule{kind=1f1b,microbatches=8},lower-comm,insert-frees,verify"
    assert main(["opt", str(path), "-p", pipeline]) == 0
    out = capsys.readouterr().out
    for rank in range(3):
        assert f"program @rank{rank} {{rank = {rank}, device = {rank}, replica = 0, stages = [@s{rank}]" in out
    assert "    send %h1 mb = 0 to rank 1\n" in out
    assert "    free @s2 mb = 7\n" in out


def _uniform_profile(tmp_path: Path, act_bytes: float, param_bytes: float) -> Module:
    """Four equal layers (F = 2 ms, B = 4 ms at the profile batch 8) of one chain, as a profile."""
    from dapple_ir.frontend.profile_import import import_profile

    path = write_chain_profile(tmp_path / "uniform-pbs-8.txt", [(2.0, act_bytes, param_bytes)] * 4)
    return import_profile(str(path))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("act_bytes", "param_bytes"), [(0.0, 0.0), (0.0, 4e6), (1e6, 0.0)])
def test_stages_stay_ordered_whatever_their_bytes(
    tmp_path: Path, schedule: str, act_bytes: float, param_bytes: float
) -> None:
    """(M + S - 1)(F + B) = 11 x 6 ms on the uniform 4-stage profile, M = 8: a gradient of zero bytes
    (or of a layer without parameters) still makes a stage's backward wait for the next stage's.
    With bytes, links and memory are ideal (they would add time): only the order counts."""
    from dapple_ir.sim.simulator import ideal_cluster, simulate

    module = _uniform_profile(tmp_path, act_bytes, param_bytes)
    plan = f"plan{{stages=4,microbatches=8,schedule={schedule},policy=append-first,global-batch=64}}"
    pipeline = f"coarsen,{plan},schedule{{kind={schedule}}},lower-comm,insert-frees,verify"
    PassManager(build_pipeline(pipeline)).run(module, PassContext(cluster="1x4xV100-16GB"))
    grads = [i for p in module.programs for i in p.instrs if i.kind is InstrKind.SEND and i.grad]
    assert len(grads) == 3 * 8  # each microbatch's gradient crosses each of the three cuts
    result = simulate(module, cluster=ideal_cluster(4) if act_bytes or param_bytes else "1x4xV100-16GB")
    assert result.iteration_s == pytest.approx((8 + 4 - 1) * (2e-3 + 4e-3))
