"""Receives posted ahead of their use: where lowering allows them, what the memory model and the simulator
count for them, and that the runtime posts them exactly there (its post log) and still trains exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dapple_ir.analysis.lowering import early_post_points
from dapple_ir.analysis.peak_memory import Sizes, memory_changes, program_peak, recv_posts, transfer_bytes
from dapple_ir.backends.torch.transport import DistTransport
from dapple_ir.backends.torch.worker import RunOptions
from dapple_ir.ir import COMPUTE_KINDS, InstrKind, Module
from dapple_ir.plan_dir import load_plan
from dapple_ir.sim.simulator import ideal_cluster, simulate
from tests.pipeline_fixtures import chain_module
from tests.test_lowering import _run
from tests.test_runtime import MLP, make_plan, train_as_threads
from tests.test_transport_dist import run_two_ranks

TIMEOUT = 30.0


def _lowered(kind: str, microbatches: int = 3, stages: int = 2) -> Module:
    return _run(
        chain_module([1] * stages), f"schedule{{kind={kind},microbatches={microbatches}}},lower-comm,insert-frees"
    )


def _kinds(module: Module, rank: int) -> list[tuple[str, int | None]]:
    return [(i.kind.value, i.mb) for i in module.programs[rank].instrs]


# ------------------------------------------------------------------------------ where a receive may go


def test_gpipe_receives_are_posted_one_forward_ahead() -> None:
    """GPipe, last stage: load, recv, F per microbatch. The second receive may go before the first forward
    (nothing computes before it: the step's start), the third right after the first forward."""
    module = _lowered("gpipe")
    program = module.programs[1]
    assert _kinds(module, 1)[:9] == [
        ("load_microbatch", 0), ("recv", 0), ("forward", 0),
        ("load_microbatch", 1), ("recv", 1), ("forward", 1),
        ("load_microbatch", 2), ("recv", 2), ("forward", 2),
    ]  # fmt: skip
    assert early_post_points(program.instrs) == {1: 0, 4: 0, 7: 3}
    # Every receive of a microbatch fits beside the forwards GPipe holds anyway: all are posted early.
    assert recv_posts(module, program) == {1: 0, 4: 0, 7: 3}


def test_posts_keep_program_order_and_skip_the_sends_and_frees_after_a_compute() -> None:
    """Every post lies after the compute two before its recv and after that compute's sends and frees. 1F1B over
    3 stages, first stage: warm-up F0 F1 F2, then the gradient of microbatch 0 — posted right after F1's send,
    so it is in flight during F2."""
    module = _lowered("1f1b", microbatches=4, stages=3)
    for program in module.programs:
        instrs = program.instrs
        points = early_post_points(instrs)
        assert list(points) == sorted(points) and list(points.values()) == sorted(points.values())
        for recv, post in points.items():
            computes = [k for k in range(recv) if instrs[k].kind in COMPUTE_KINDS]
            assert len(computes) >= 2 or post == 0
            if len(computes) >= 2:
                between = instrs[computes[-2] + 1 : post]
                assert all(i.kind in (InstrKind.SEND, InstrKind.FREE) for i in between)
                assert instrs[post].kind not in (InstrKind.SEND, InstrKind.FREE)
    first = module.programs[0].instrs
    grad0 = next(k for k, i in enumerate(first) if i.kind is InstrKind.RECV and i.grad and i.mb == 0)
    forward1 = next(k for k, i in enumerate(first) if i.kind is InstrKind.FORWARD and i.mb == 1)
    assert [(i.kind, i.mb) for i in first[forward1 : forward1 + 3]] == [
        (InstrKind.FORWARD, 1), (InstrKind.SEND, 1), (InstrKind.LOAD_MICROBATCH, 2)
    ]  # fmt: skip
    assert early_post_points(first)[grad0] == forward1 + 2


def test_memory_model_lets_a_post_hold_one_computes_receives_above_the_peak() -> None:
    """1F1B, last stage: F0 B0 F1 B1 ... Posting microbatch 1's input before B0 holds two inputs beside F0's
    activations, one input above the peak with every receive at its recv (one input + one stage's activations):
    that is the headroom, one compute's receives, so it is posted there and the peak counts it."""
    module = _lowered("1f1b")
    program = module.programs[1]
    assert _kinds(module, 1)[7:10] == [("load_microbatch", 1), ("recv", 1), ("forward", 1)]
    assert early_post_points(program.instrs)[8] == 3  # before B0: allowed by the order and by the memory
    assert recv_posts(module, program) == early_post_points(program.instrs)
    t = transfer_bytes(module, program.instrs[8].value)  # type: ignore[arg-type]
    act = Sizes(module).activation(module.stages[1])
    assert program_peak(module, program).live_bytes == 2 * t + act
    for m in (_lowered("1f1b", 8, 4), _lowered("gpipe", 8, 4), _lowered("zb-h1", 8, 4), _lowered("1f1b", 8, 2)):
        for p in m.programs:
            without = max(_running(list(memory_changes(m, p, Sizes(m), {}))), default=0.0)
            # By hand: the most bytes any one compute receives since the compute before it.
            inputs, waiting = [0.0], 0.0
            for instr in p.instrs:
                if instr.kind is InstrKind.RECV:
                    waiting += transfer_bytes(m, instr.value)  # type: ignore[arg-type]
                elif instr.kind in COMPUTE_KINDS:
                    inputs.append(waiting)
                    waiting = 0.0
            assert without <= program_peak(m, p).live_bytes <= without + max(inputs)


def test_memory_model_refuses_a_post_beyond_the_headroom() -> None:
    """With no headroom (the rule before `post_headroom`) the same post stays at its recv, and every post kept
    leaves the peak the one with every receive at its recv."""
    module = _lowered("1f1b")
    program = module.programs[1]
    tight = recv_posts(module, program, headroom=0.0)
    assert 8 not in tight and tight  # the first input, posted at the step's start, still fits
    without = max(_running(list(memory_changes(module, program, Sizes(module), {}))))
    assert max(_running(list(memory_changes(module, program, Sizes(module), tight)))) == without


def _running(changes: list[tuple[int, float]]) -> list[float]:
    total, levels = 0.0, []
    for _, change in changes:
        total += change
        levels.append(total)
    return levels


def test_memory_and_simulator_count_the_buffer_from_its_post() -> None:
    """GPipe, last stage, ideal links, F = 1 s: the inputs of microbatches 0 and 1 are posted at the step's start
    (index 0), microbatch 2's before load 1 (index 3, t = 2 s when F0 ends) instead of at its recv (t = 3 s)."""
    module = _lowered("gpipe")
    program = module.programs[1]
    t = transfer_bytes(module, program.instrs[1].value)  # type: ignore[arg-type]
    act = Sizes(module).activation(module.stages[1])
    changes = list(memory_changes(module, program))
    assert changes[:4] == [(0, t), (0, t), (2, act), (3, t)]  # the recvs themselves allocate nothing more
    assert not [c for c in changes if c[0] in (1, 4, 7)]
    for stage in module.stages:  # F = 1 s, B = 2 s per stage and microbatch
        for op in stage.ops:
            op.attrs.fwd_s, op.attrs.bwd_s = 1.0 / len(stage.ops), 2.0 / len(stage.ops)
    result = simulate(module, cluster=ideal_cluster(2))
    assert [result.starts[1][k] for k in (0, 2, 3, 7)] == pytest.approx([0.0, 1.0, 2.0, 3.0])
    curve = result.memory[1]
    static = curve[0][1]
    # Exact: binary fractions of whole seconds and bytes.
    assert [(time, level - static) for time, level in curve[1:5]] == [
        (0.0, t), (0.0, 2 * t), (1.0, 2 * t + act), (2.0, 3 * t + act)
    ]  # fmt: skip
    assert result.peak_bytes[1] == pytest.approx(static + program_peak(module, program).live_bytes)


# ------------------------------------------------------------------------------ the runtime posts there


def test_runtime_posts_each_receive_at_its_marked_point(tmp_path: Path) -> None:
    """Two ranks as threads: every `rt.post_recv` call comes right before the instruction `recv_posts` marks
    (the runtime's post log records the index of the next instruction), and every posted receive is received."""
    plan_dir = make_plan(tmp_path, MLP, stages=2, kind="1f1b", microbatches=4)
    plan = load_plan(plan_dir)
    options = RunOptions(steps=1, optimizer="sgd", lr=0.05, timeout=TIMEOUT, run_dir=str(tmp_path), device="cpu")
    runtimes = train_as_threads(plan, options)
    posted_somewhere = False
    for rank, rt in enumerate(runtimes):
        program = plan.module.programs[rank]
        marked = sorted(
            (post, program.instrs[recv].value.name, program.instrs[recv].mb, program.instrs[recv].grad)  # type: ignore[union-attr]
            for recv, post in recv_posts(plan.module, program).items()
        )
        assert sorted(rt.post_log) == marked
        assert not rt.posted  # all received
        posted_somewhere |= bool(marked)
    assert posted_somewhere


# ------------------------------------------------------------------------------ gloo: posted before the send


def _early_posts(rank: int, transport: DistTransport, lines: list[str]) -> None:
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        mine, theirs = torch.randn(3, 5, generator=g), torch.randn(2, 2, generator=g)
        if rank == 1:
            # Posted before the peer sends (it waits on our message first), received after.
            early = transport.irecv(0, 7)
            sent, _ = transport.exchange([(theirs, 0, 8)], [])
            got = early.wait(TIMEOUT)
            lines.append(f"{step} {torch.equal(got, mine)}")
            sent[0].wait(TIMEOUT)
        else:
            # A send and a receive with the same peer handed over together.
            sent, posted = transport.exchange([(mine, 1, 7)], [(1, 8)])
            lines.append(f"{step} {torch.equal(posted[0].wait(TIMEOUT), theirs)}")
            sent[0].wait(TIMEOUT)


def test_gloo_receive_posted_before_its_send_and_exchanged_pairs(tmp_path: Path) -> None:
    for lines in run_two_ranks(_early_posts, tmp_path):
        assert lines == [f"{s} True" for s in range(3)]
