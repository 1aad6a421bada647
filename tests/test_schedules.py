"""Schedules: hand-derived orders, custom and CSV schedules, refused requests, and property tests."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dapple_ir import schedules
from dapple_ir.analysis.peak_memory import activation_peak_microbatches, peak_bytes_per_rank
from dapple_ir.errors import DappleError
from dapple_ir.ir import InstrKind, Module, Stage, StageAttrs
from dapple_ir.pass_manager import PassManager, build_pipeline
from dapple_ir.pricing.pipeline import raised_warmups, replica_in_flight
from dapple_ir.schedules import ScheduleRequest, Work
from tests.pipeline_fixtures import chain_module, reverse_gpipe_registered
from tests.planner_cases import captured

_SHORT = {
    InstrKind.FORWARD: "F",
    InstrKind.BACKWARD: "B",
    InstrKind.BACKWARD_INPUT: "b",
    InstrKind.BACKWARD_WEIGHT: "w",
}


def _text(order: list[Work], with_stage: bool = False) -> str:
    return " ".join(f"{_SHORT[w.kind]}{f'{w.stage}.' if with_stage else ''}{w.mb}" for w in order)


def _run(module: Module, pipeline: str) -> Module:
    PassManager(build_pipeline(pipeline)).run(module)
    return module


def _compute_text(module: Module, rank: int) -> str:
    instrs = [i for i in module.programs[rank].instrs if i.kind in _SHORT]
    return " ".join(f"{_SHORT[i.kind]}{i.mb}" for i in instrs)


# ------------------------------------------------------------------------- orders derived by hand


def test_gpipe_runs_all_forwards_then_all_backwards() -> None:
    orders = schedules.build_schedule("gpipe", ScheduleRequest((1, 1), 3))
    assert _text(orders[(0, 0)]) == "F0 F1 F2 B0 B1 B2"
    assert _text(orders[(1, 0)]) == "F0 F1 F2 B0 B1 B2"


def test_1f1b_warms_up_with_s_minus_stage_forwards() -> None:
    orders = schedules.build_schedule("1f1b", ScheduleRequest((1, 1, 1), 5))
    assert _text(orders[(0, 0)]) == "F0 F1 F2 B0 F3 B1 F4 B2 B3 B4"
    assert _text(orders[(1, 0)]) == "F0 F1 B0 F2 B1 F3 B2 F4 B3 B4"
    assert _text(orders[(2, 0)]) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4"


def test_1f1b_warmup_is_capped_by_the_microbatch_count() -> None:
    orders = schedules.build_schedule("1f1b", ScheduleRequest((1, 1, 1, 1), 2))
    assert _text(orders[(0, 0)]) == "F0 F1 B0 B1"


def test_zb_h1_defers_weight_passes_on_later_stages() -> None:
    # Stage s defers up to s W passes while holding at most min(S, M) = 3 microbatches.
    orders = schedules.build_schedule("zb-h1", ScheduleRequest((1, 1, 1), 4))
    assert _text(orders[(0, 0)]) == "F0 F1 F2 b0 w0 F3 b1 w1 b2 w2 b3 w3"
    assert _text(orders[(1, 0)]) == "F0 F1 b0 F2 b1 w0 F3 b2 w1 b3 w2 w3"
    assert _text(orders[(2, 0)]) == "F0 b0 F1 b1 F2 b2 w0 F3 b3 w1 w2 w3"


def test_zb_h1_weighs_deferred_weight_passes_in_bytes() -> None:
    # Each microbatch in flight keeps 2 bytes; on stages 1 and 2 an input pass keeps 1 more until its weight
    # pass, and stage 1's rank holds 2 static bytes. 1f1b's fullest rank is stage 0's: 3 * 2 = 6. Stage 2
    # defers one W (2 * 2 + 2 * 1 = 6; two would hold 9), stage 1 not even one and cannot split at all (2 +
    # 2 * 2 + 1 = 7): it runs 1f1b's backwards (2 + 2 * 2 = 6). Stage 0 hands back no gradient: nothing extra.
    light, heavy = schedules.StageMemory(activation=2.0), schedules.StageMemory(activation=2.0, weight_pass=1.0)
    memory = (light, schedules.StageMemory(static=2.0, activation=2.0, weight_pass=1.0), heavy)
    orders = schedules.build_schedule("zb-h1", ScheduleRequest((1, 1, 1), 4, memory=memory))
    assert _text(orders[(0, 0)]) == "F0 F1 F2 b0 w0 F3 b1 w1 b2 w2 b3 w3"
    assert _text(orders[(1, 0)]) == "F0 F1 B0 F2 B1 F3 B2 B3"
    assert _text(orders[(2, 0)]) == "F0 b0 F1 b1 w0 F2 b2 w1 F3 b3 w2 w3"


def test_zb_h1_leaves_replicas_without_microbatches_idle() -> None:
    # The planner compares the orders of candidates with more replicas than microbatches.
    orders = schedules.build_schedule("zb-h1", ScheduleRequest((3,), 2))
    assert [_text(orders[(0, j)]) for j in range(3)] == ["F0 b0 w0", "F1 b1 w1", ""]


def test_interleaved_follows_megatron_order() -> None:
    # P = 2 groups, V = 2: group 0 holds stages 0 and 2. Warm-up (P-g-1)*2 + (V-1)*P forwards.
    orders = schedules.build_schedule("interleaved", ScheduleRequest((1, 1, 1, 1), 4, virtual=2))
    assert _text(orders[(0, 0)], True) == (
        "F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3"
    )
    assert _text(orders[(1, 0)], True) == (
        "F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 B1.2 B1.3"
    )


def test_a_replica_runs_its_share_of_the_unreplicated_order() -> None:
    orders = schedules.build_schedule("1f1b", ScheduleRequest((1, 2), 4))
    assert _text(orders[(1, 0)]) == "F0 B0 F2 B2"
    assert _text(orders[(1, 1)]) == "F1 B1 F3 B3"
    assert _text(orders[(0, 0)]) == "F0 F1 B0 F2 B1 F3 B2 B3"


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1"])
@pytest.mark.parametrize(("stages", "replicas", "m"), [(2, 2, 8), (4, 2, 16), (3, 3, 9)])
def test_uniform_replicas_each_run_the_unreplicated_order_on_their_own_microbatches(
    kind: str, stages: int, replicas: int, m: int
) -> None:
    # R replicas in every stage are R independent pipelines: replica j's order is the order one
    # unreplicated pipeline runs over M / R microbatches, on the microbatches j, j + R, j + 2R, ...
    alone = schedules.build_schedule(kind, ScheduleRequest((1,) * stages, m // replicas))
    together = schedules.build_schedule(kind, ScheduleRequest((replicas,) * stages, m))
    for s in range(stages):
        for j in range(replicas):
            renumbered = [Work(w.kind, w.stage, w.mb * replicas + j) for w in alone[(s, 0)]]
            assert together[(s, j)] == renumbered, (kind, s, j)


def test_ranks_follow_device_ids_and_carry_their_placement() -> None:
    module = chain_module([1, 1], [1, 2])
    module.stages[0].attrs.devices = (5,)
    module.stages[1].attrs.devices = (9, 2)
    _run(module, "schedule{kind=gpipe,microbatches=2}")
    placed = [(p.attrs.rank, p.attrs.device, p.attrs.stages, p.attrs.replica) for p in module.programs]
    assert placed == [(0, 2, ("s1",), 1), (1, 5, ("s0",), 0), (2, 9, ("s1",), 0)]
    assert _compute_text(module, 0) == "F1 B1"


def test_schedule_sets_the_microbatch_size_from_the_global_batch() -> None:
    module = chain_module([1, 1])
    module.attrs.global_batch, module.attrs.microbatches = 32, 2
    _run(module, "schedule{kind=1f1b,microbatches=8}")
    assert (module.attrs.microbatches, module.attrs.microbatch_size, module.attrs.schedule) == (8, 4, "1f1b")


# ----------------------------------------------------------------------------- custom schedules


def test_a_registered_schedule_is_usable_by_name() -> None:
    with reverse_gpipe_registered("reverse-gpipe"):
        module = _run(chain_module([1, 1]), "schedule{kind=reverse-gpipe,microbatches=3},lower-comm,verify")
    assert _compute_text(module, 1) == "F0 F1 F2 B2 B1 B0"
    assert module.attrs.schedule == "reverse-gpipe"


def _csv(tmp_path: Path, rows: list[str]) -> Path:
    path = tmp_path / "order.csv"
    path.write_text("rank,kind,stage,mb\n" + "\n".join(rows) + "\n")
    return path


def test_csv_order_is_loaded_per_rank(tmp_path: Path) -> None:
    rows = ["0,forward,s0,0", "0,F,@s0,1", "0,B,0,1", "0,backward,s0,0", "1,F,s1,0", "1,B,s1,0", "1,F,s1,1", "1,B,s1,1"]
    module = _run(chain_module([1, 1]), f"schedule{{from={_csv(tmp_path, rows)},microbatches=2}},lower-comm,verify")
    assert _compute_text(module, 0) == "F0 F1 B1 B0"
    assert _compute_text(module, 1) == "F0 B0 F1 B1"


def test_csv_order_that_deadlocks_is_refused_with_the_cycle(tmp_path: Path) -> None:
    # Rank 0 waits for mb 0's gradient before sending mb 1; rank 1 needs mb 1 before that gradient.
    # Lowered, rank 0 is: load, forward, send, recv grad (3); rank 1: load, recv, forward, load, recv (4).
    rows = ["0,F,s0,0", "0,B,s0,0", "0,F,s0,1", "0,B,s0,1", "1,F,s1,0", "1,F,s1,1", "1,B,s1,0", "1,B,s1,1"]
    with pytest.raises(DappleError) as info:
        _run(chain_module([1, 1]), f"schedule{{from={_csv(tmp_path, rows)},microbatches=2}}")
    message = str(info.value)
    assert "deadlocks" in message and "cycle" in message
    assert "rank 0 instruction 3 `recv grad %h0 mb = 0 from rank 1` waits for rank 1" in message
    assert "rank 1 instruction 4 `recv %h0 mb = 1 from rank 0` waits for rank 0" in message


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        (["0,F,s0,0", "0,B,s0,0", "1,F,s1,0"], "every forward needs exactly one backward"),
        (["1,F,s0,0"], "belongs to replica 0, which is rank 0"),
        (["0,B,s0,0"], "backward needs forward first"),
        (["0,F,s7,0"], "unknown stage 's7'"),
        (["0,X,s0,0"], "unknown kind 'X'"),
        (["3,F,s0,0"], "names ranks [3]"),
    ],
)
def test_bad_csv_orders_are_refused(tmp_path: Path, rows: list[str], expected: str) -> None:
    with pytest.raises(DappleError) as info:
        _run(chain_module([1, 1]), f"schedule{{from={_csv(tmp_path, rows)},microbatches=1}}")
    assert expected in str(info.value)


# ------------------------------------------------------------------------------- refused requests


@pytest.mark.parametrize(
    ("stages", "replicas", "pipeline", "expected"),
    [
        (4, None, "schedule{kind=interleaved,virtual=2,microbatches=1}", "fewer than the 2 pipeline groups"),
        (4, None, "schedule{kind=interleaved,virtual=3,microbatches=4}", "virtual=3 does not divide the 4 stages"),
        (4, None, "schedule{kind=interleaved,virtual=2,microbatches=5}", "needs a multiple of 2, such as 4 or 6"),
        (2, None, "schedule{kind=1f1b,virtual=2,microbatches=4}", "needs kind=interleaved"),
        (2, [1, 2], "schedule{kind=1f1b,microbatches=1}", "only 1 microbatches"),
        (4, [1, 2, 1, 1], "schedule{kind=interleaved,virtual=2,microbatches=4}", "shares device group"),
        (2, None, "schedule{kind=nope,microbatches=2}", "unknown schedule kind 'nope'"),
        (2, None, "schedule{kind=1f1b}", "no microbatch count"),
        (2, None, "schedule{from=/no/such.csv,microbatches=2}", "does not exist"),
    ],
)
def test_bad_requests_are_refused_with_the_reason(
    stages: int, replicas: list[int] | None, pipeline: str, expected: str
) -> None:
    with pytest.raises(DappleError) as info:
        _run(chain_module([1] * stages, replicas), pipeline)
    assert expected in str(info.value)


def test_a_module_without_stages_is_refused() -> None:
    module = chain_module([1])
    module.stages = []
    with pytest.raises(DappleError, match="no stages"):
        _run(module, "schedule{microbatches=2}")


def test_devices_shared_outside_interleaving_are_refused() -> None:
    module = chain_module([1, 1], devices=True)
    module.stages[1].attrs.devices = (0,)
    with pytest.raises(DappleError, match="device 0 holds both @s0 and @s1"):
        _run(module, "schedule{kind=1f1b,microbatches=2}")


# --------------------------------------------------------------------------------- properties


@st.composite
def pipelines(draw: st.DrawFn) -> tuple[str, list[int], int, int, bool]:
    kind = draw(st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved"]))
    groups = draw(st.integers(1, 4))
    group_replicas = draw(st.lists(st.integers(1, 2), min_size=groups, max_size=groups))
    virtual = draw(st.integers(1, 2)) if kind == "interleaved" else 1
    replicas = [group_replicas[k % groups] for k in range(groups * virtual)]
    m = draw(st.integers(max(replicas), 8))
    if kind == "interleaved":
        # Megatron's order runs rounds of one microbatch per group: a multiple of the groups when V > 1.
        m = max(groups, m - m % groups if virtual > 1 else m)
    return kind, replicas, m, virtual, draw(st.booleans())


def _lowered(kind: str, replicas: list[int], m: int, virtual: int, branchy: bool) -> Module:
    module = chain_module([1] * len(replicas), replicas, skip=branchy, tied=branchy)
    pipeline = f"schedule{{kind={kind},microbatches={m},virtual={virtual}}},lower-comm,insert-frees,verify"
    return _run(module, pipeline)


@settings(max_examples=80, deadline=None)
@given(pipelines())
def test_every_schedule_lowers_to_verified_programs(case: tuple[str, list[int], int, int, bool]) -> None:
    kind, replicas, m, virtual, branchy = case
    module = _lowered(kind, replicas, m, virtual, branchy)  # verify: no deadlock, work complete, frees exact
    owner = {(p.attrs.stages[0] if p.attrs.stages else "", p.attrs.replica): p.rank for p in module.programs}
    frees = [i for p in module.programs for i in p.instrs if i.kind is InstrKind.FREE and i.stage is not None]
    assert sorted((i.stage.name, i.mb) for i in frees if i.stage) == sorted(
        (s.name, mb) for s in module.stages for mb in range(m)
    )
    for program in module.programs:
        recvs = [i for i in program.instrs if i.kind is InstrKind.RECV]
        released = [i for i in program.instrs if i.kind is InstrKind.FREE and i.value is not None]
        assert len({(i.value, i.grad, i.mb) for i in recvs}) == len(released)
        for recv in recvs:
            if recv.grad or recv.value is None or recv.mb is None:
                continue
            producer = next(s for s in module.stages if recv.value in s.ops)
            if virtual == 1:
                assert recv.peer == owner[(producer.name, recv.mb % producer.replicas)]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.lists(st.integers(1, 2), min_size=4, max_size=4), st.integers(2, 8))
def test_activation_memory_claims(stages: int, replicas: list[int], m: int) -> None:
    replicas = replicas[:stages]
    m = max(m, max(replicas))
    peaks = {}
    for kind in ("gpipe", "1f1b", "zb-h1"):
        module = _lowered(kind, replicas, m, 1, False)
        peaks[kind] = [activation_peak_microbatches(p) for p in module.programs]
        stage_of = [int((p.attrs.stages or ("s0",))[0][1:]) for p in module.programs]
        local = [
            len(range(p.attrs.replica or 0, m, replicas[s])) for p, s in zip(module.programs, stage_of, strict=True)
        ]
        if kind == "gpipe":
            assert peaks[kind] == local
        if kind == "1f1b":
            # DAPPLE's claim, S - s at most, wherever no stage warms up with more to feed a later one's replicas;
            # there, what `replica_in_flight` says.
            held = replica_in_flight(kind, replicas, [False] * stages, m)
            if not raised_warmups(kind, replicas, [False] * stages, m):
                assert held == [min(stages - s, len(range(0, m, replicas[s]))) for s in range(stages)]
            pairs = list(zip(peaks[kind], stage_of, strict=True))
            assert [max(peak for peak, k in pairs if k == s) for s in range(stages)] == held
            if all(r == 1 for r in replicas):
                assert peaks[kind] == [min(stages - s, m) for s in range(stages)]
    assert max(peaks["zb-h1"]) <= max(peaks["1f1b"])


def _plan_peak(module: Module, kind: str, m: int) -> float:
    """The static peak of the fullest rank once `module`'s stages run under `kind` with `m` microbatches."""
    lowered = _run(copy.deepcopy(module), f"schedule{{kind={kind},microbatches={m}}},lower-comm,insert-frees,verify")
    return max(peak_bytes_per_rank(lowered).values())


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 3), st.sampled_from([128.0, 512.0, 4096.0])), min_size=2, max_size=5),
    st.integers(1, 3),
    st.integers(1, 16),
    st.booleans(),
    st.booleans(),
)
def test_zb_h1_peaks_no_higher_than_1f1b(
    cut: list[tuple[int, float]], replicas: int, m: int, branchy: bool, tied: bool
) -> None:
    """ZB-H1's promise in bytes: on the same stages its fullest rank holds no more than 1f1b's, though a deferred
    weight pass keeps more than a microbatch in flight and the stages' activations differ (docs/runtime.md)."""
    layers, acts = [n for n, _ in cut], [a for _, a in cut]
    module = chain_module(layers, [replicas] * len(cut), skip=branchy, tied=tied, act=acts)
    m = max(m, replicas)
    assert _plan_peak(module, "zb-h1", m) <= _plan_peak(module, "1f1b", m)


def _cut(spec: str, stages: int, global_batch: int) -> Module:
    """The captured example in `stages` stages of contiguous ops, one device each."""
    module = copy.deepcopy(captured(spec))
    ops = list(module.ops)
    module.stages = [
        Stage(f"s{k}", ops[k * len(ops) // stages : (k + 1) * len(ops) // stages], StageAttrs(devices=(k,)))
        for k in range(stages)
    ]
    module.attrs.global_batch, module.attrs.optimizer = global_batch, "adam"
    return module


@pytest.mark.parametrize("spec", ["examples/gpt.py:factory", "examples/mlp.py:factory"])
@pytest.mark.parametrize(("stages", "m", "global_batch"), [(2, 4, 16), (3, 8, 8), (4, 8, 32), (4, 4, 64)])
def test_zb_h1_peaks_no_higher_than_1f1b_on_the_examples(spec: str, stages: int, m: int, global_batch: int) -> None:
    """The GPT example ties its LM head to the token embedding: 4 stages, 8 microbatches of 4 held 1388 KB on
    its second rank under zb-h1 (four microbatches and two input passes' gradients) against 958 KB on 1f1b's
    fullest rank, before the schedule weighed them in bytes."""
    module = _cut(spec, stages, global_batch)
    assert _plan_peak(module, "zb-h1", m) <= _plan_peak(module, "1f1b", m)
