"""Pipelined training equals single-device training: every schedule, with replicas and tied parameters.

Plans are built here by hand (contiguous op chunks as stages, then the real schedule/lower-comm/
insert-frees/verify passes), written as plan.dapple + plan.json + rank files, and run with the
in-process threads transport. The oracle is `train_reference`: the original nn.Module trained on one
device with the same seed, data, microbatching and optimizer.
"""

from __future__ import annotations

import json
import threading
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dapple_ir.backends.torch.codegen import emit_rank_programs
from dapple_ir.backends.torch.launch import ATOL, RTOL, _cpu_wait, run
from dapple_ir.backends.torch.reference import train_reference
from dapple_ir.backends.torch.runtime import METERED_STEPS, Runtime
from dapple_ir.backends.torch.transport import ThreadHub, ThreadTransport
from dapple_ir.backends.torch.worker import RunOptions, build_runtime, prepare_model, rank_train_step
from dapple_ir.frontend.model_spec import FactoryResult, capture_loaded, load_model_spec
from dapple_ir.ir import Stage, StageAttrs
from dapple_ir.ir.printer import print_module
from dapple_ir.ir.structure import structure_hash
from dapple_ir.pass_manager import PassManager, build_pipeline
from dapple_ir.plan_dir import Plan, load_plan, write_plan_json
from dapple_ir.sim.trace import read_trace

ROOT = Path(__file__).resolve().parent.parent
MLP = f"{ROOT}/examples/mlp.py:factory"
GPT = f"{ROOT}/examples/gpt.py:factory"
CNN = f"{ROOT}/examples/cnn.py:factory"


def make_plan(
    out: Path,
    spec: str,
    *,
    stages: int = 2,
    replicas: list[int] | None = None,
    kind: str = "1f1b",
    microbatches: int = 4,
    microbatch_size: int = 2,
    virtual: int = 1,
    optimizer: str = "sgd",
    lr: float = 0.05,
    recompute: tuple[int, ...] = (),
    split: bool = False,
    zero: tuple[int, ...] = (),
) -> Path:
    """A plan directory for `spec`: ops split into stages*virtual contiguous chunks, lowered by the passes
    (the stages numbered in `recompute` recompute their forward, those in `zero` shard their optimizer
    state; with `split`, replicated stages split each microbatch over their replicas)."""
    loaded = load_model_spec(spec, device="cpu", seed=0)
    assert isinstance(loaded, FactoryResult)
    module = capture_loaded(loaded).module
    digest = structure_hash(module)
    n = stages * virtual
    reps = replicas or [1] * stages
    ops = list(module.ops)
    chunks = [ops[i * len(ops) // n : (i + 1) * len(ops) // n] for i in range(n)]
    first = [sum(reps[:s]) for s in range(stages)]
    devices = [tuple(range(first[s], first[s] + reps[s])) for s in range(stages)]
    module.stages = [
        Stage(
            f"s{k}",
            chunks[k],
            StageAttrs(
                replicas=reps[k % stages],
                devices=devices[k % stages],
                split=split or None,
                recompute=(k in recompute) or None,
                zero=1 if k in zero else None,
            ),
        )
        for k in range(n)
    ]
    module.attrs.microbatches = microbatches
    module.attrs.microbatch_size = microbatch_size
    module.attrs.global_batch = microbatches * microbatch_size
    pipeline = f"schedule{{kind={kind},microbatches={microbatches},virtual={virtual}}},lower-comm,insert-frees,verify"
    PassManager(build_pipeline(pipeline)).run(module)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.dapple").write_text(print_module(module))
    meta = {
        "stages": [
            {"name": s.name, "nodes": [op.name for op in s.ops], "devices": list(s.attrs.devices or ())}
            for s in module.stages
        ],
        "microbatches": microbatches,
        "microbatch_size": microbatch_size,
        "global_batch": microbatches * microbatch_size,
        "schedule": kind,
        "model_spec": spec,
        "model_hash": digest,
        "optimizer": optimizer,
        "lr": lr,
        "ranks": len(module.programs),
    }
    emit_rank_programs(module, out)
    write_plan_json(out, meta)  # last: its digest covers the other files
    return out


CASES = [
    # (model, stages, replicas, schedule, virtual, optimizer): 2 and 4 ranks, each schedule, replicated or not
    pytest.param(MLP, 2, None, "gpipe", 1, "adam", id="mlp-gpipe-2r"),
    pytest.param(MLP, 2, None, "1f1b", 1, "sgd", id="mlp-1f1b-2r"),
    pytest.param(MLP, 2, None, "interleaved", 2, "adamw", id="mlp-interleaved-2r"),
    pytest.param(MLP, 2, None, "zb-h1", 1, "adam", id="mlp-zbh1-2r"),
    pytest.param(MLP, 2, [1, 2], "gpipe", 1, "sgd", id="mlp-gpipe-3r-replicated"),
    pytest.param(MLP, 4, None, "1f1b", 1, "adam", id="mlp-1f1b-4r"),
    pytest.param(MLP, 2, [2, 2], "interleaved", 2, "sgd", id="mlp-interleaved-4r-replicated"),
    pytest.param(MLP, 3, [1, 2, 1], "zb-h1", 1, "adam", id="mlp-zbh1-4r-replicated"),
    pytest.param(MLP, 4, None, "gpipe", 1, "sgd-momentum", id="mlp-gpipe-4r"),
    pytest.param(MLP, 2, [2, 2], "1f1b", 1, "sgd", id="mlp-1f1b-4r-replicated"),
]


@pytest.mark.parametrize(("spec", "stages", "replicas", "kind", "virtual", "optimizer"), CASES)
def test_threads_run_matches_single_device(
    tmp_path: Path, spec: str, stages: int, replicas: list[int] | None, kind: str, virtual: int, optimizer: str
) -> None:
    plan = make_plan(tmp_path, spec, stages=stages, replicas=replicas, kind=kind, virtual=virtual)
    lr = 0.05 if optimizer.startswith("sgd") else 1e-3
    result = run(plan, steps=2, check=True, transport="threads", optimizer=optimizer, lr=lr, timeout=30)
    ref = train_reference(spec, seed=0, steps=2, microbatches=4, microbatch_size=2, optimizer=optimizer, lr=lr)
    assert result.losses == pytest.approx(ref.losses, rel=RTOL, abs=ATOL)
    assert result.losses[0] != result.losses[1]  # it trained
    for tensors in result.params.values():
        for key, value in tensors.items():
            torch.testing.assert_close(value, ref.params[key.split("/", 1)[1]], rtol=RTOL, atol=ATOL)
    assert result.check is not None and result.check.ok
    held = {key.split("/", 1)[1] for tensors in result.params.values() for key in tensors}
    assert held == set(ref.params)  # every parameter lives on some rank


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stages", "replicas", "kind", "virtual"),
    [
        pytest.param(4, None, "1f1b", 1, id="gpt-1f1b-4r-tied"),
        pytest.param(2, [1, 2], "zb-h1", 1, id="gpt-zbh1-3r-tied-replicated"),
        pytest.param(2, None, "interleaved", 2, id="gpt-interleaved-2r-tied"),
    ],
)
def test_tied_embedding_across_stages(
    tmp_path: Path, stages: int, replicas: list[int] | None, kind: str, virtual: int
) -> None:
    plan = make_plan(tmp_path, GPT, stages=stages, replicas=replicas, kind=kind, virtual=virtual)
    text = (plan / "plan.dapple").read_text()
    assert "allreduce param @tok.weight" in text  # the embedding and the LM head sit on different ranks
    result = run(plan, steps=2, check=True, transport="threads", timeout=30)
    assert result.check is not None and result.check.ok, result.check
    copies = [t[k] for t in result.params.values() for k in t if k.endswith("/tok.weight")]
    assert len(copies) >= 2
    for copy in copies[1:]:
        assert torch.equal(copy, copies[0])  # tied copies stay bit-identical


@pytest.mark.slow
def test_cnn_with_batch_norm_buffers_and_replicas(tmp_path: Path) -> None:
    plan = make_plan(tmp_path, CNN, stages=2, replicas=[1, 2], kind="1f1b")
    result = run(plan, steps=2, check=True, transport="threads", timeout=30)
    assert result.check is not None and result.check.ok, result.check


def test_resume_continues_with_the_same_losses(tmp_path: Path) -> None:
    plan = make_plan(tmp_path / "plan", MLP, stages=2, replicas=[1, 2], kind="1f1b")
    options = {"transport": "threads", "optimizer": "adam", "lr": 1e-2, "timeout": 30.0}
    whole = run(plan, steps=4, **options)  # type: ignore[arg-type]
    run(plan, steps=2, save=tmp_path / "ckpt", **options)  # type: ignore[arg-type]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["manifest.json", "step_00000002"]
    assert sorted(p.name for p in (tmp_path / "ckpt" / "step_00000002").glob("*.pt")) == [
        "rank_0.pt",
        "rank_1.pt",
        "rank_2.pt",
    ]
    resumed = run(plan, steps=2, resume=tmp_path / "ckpt", check=True, **options)  # type: ignore[arg-type]
    assert resumed.first_step == 2
    assert resumed.losses == whole.losses[2:]
    assert resumed.check is not None and resumed.check.ok


def test_timeline_and_memory_are_measured(tmp_path: Path) -> None:
    plan = make_plan(tmp_path, MLP, stages=2, kind="gpipe")
    result = run(plan, steps=2, transport="threads", timeout=30)
    trace = json.loads((plan / "timeline_measured.json").read_text())
    assert trace["otherData"]["source"] == "measured"
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    forwards = [e for e in spans if e["args"]["kind"] == "forward"]
    assert len(forwards) == 2 * 4  # 2 ranks x 4 microbatches, last step only
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    timeline = read_trace(plan / "timeline_measured.json")  # the simulator's reader takes it back
    assert timeline.source == "measured" and timeline.ranks == 2
    assert {s.kind for s in timeline.spans} >= {"forward", "backward", "send", "recv", "optimizer_step"}
    assert max(s.end_s for s in timeline.spans) <= timeline.iteration_s + 1e-6
    assert max(m.bytes for m in timeline.memory) <= max(result.peak_bytes)
    # Linux says how long each span waited for a CPU: never negative, never more than the span lasted.
    queued = [(s.queued_s, s.end_s - s.start_s) for s in timeline.spans]
    assert all(q is not None and 0 <= q <= d + 1e-6 for q, d in queued), queued
    assert len(result.cpu_waits) == 2
    assert all(w is not None and 0 <= w <= 1 for w in result.cpu_waits), result.cpu_waits
    # gpipe keeps all 4 microbatches' activations: the peak exceeds parameters + grads + optimizer state.
    loaded = load_model_spec(MLP, device="cpu", seed=0)
    assert isinstance(loaded, FactoryResult)
    param_bytes = sum(p.numel() * 4 for p in loaded.model.parameters())
    assert sum(result.peak_bytes) > 2 * param_bytes
    assert result.samples_per_s > 0


def train_as_threads(plan: Plan, options: RunOptions) -> list[Runtime]:
    """Every rank of `plan` as a thread of this process, `options.steps` steps; their runtimes, for inspection."""
    prepared = prepare_model(plan)
    hub = ThreadHub(plan.ranks)
    cpu = torch.device("cpu")
    runtimes = [build_runtime(plan, r, prepared, ThreadTransport(hub, r), options, cpu) for r in range(plan.ranks)]
    errors: list[str] = []

    def body(rank: int) -> None:
        try:
            for _ in range(options.steps):
                runtimes[rank].run_step(rank_train_step(plan, rank))
        except Exception:
            errors.append(traceback.format_exc())
            hub.fail(rank, "failed")

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(plan.ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[0]
    assert not any(t.is_alive() for t in threads), "a rank thread did not finish"
    return runtimes


def test_the_meter_counts_two_steps_and_every_later_step_holds_the_same(tmp_path: Path) -> None:
    """The CPU meter walks every held tensor only in the first `METERED_STEPS` steps; later steps take the last
    counted step's figure per instruction. Against a run that counts every step (the reference): the same curve,
    step by step, and the same peak. zb-h1 (deferred weight passes), a recomputing stage and Adam (its state is
    made by step 0's optimizer step, so steps 0 and 1 hold different bytes) over 5 steps."""
    plan = load_plan(make_plan(tmp_path, MLP, stages=2, kind="zb-h1", optimizer="adam", lr=1e-3, recompute=(1,)))
    options = RunOptions(steps=5, optimizer="adam", lr=1e-3, timeout=30, run_dir=str(tmp_path), device="cpu")
    counted = train_as_threads(plan, replace(options, meter_every_step=True))
    metered = train_as_threads(plan, options)
    for rank, (every, first) in enumerate(zip(counted, metered, strict=True)):
        assert every.meter_steps is None and first.meter_steps == METERED_STEPS
        assert [held for _, held in first.memory] == [held for _, held in every.memory], rank
        assert first.peak_bytes == every.peak_bytes > 0
        per_step = len(every.memory) // 5
        steps = [[held for _, held in every.memory[k * per_step : (k + 1) * per_step]] for k in range(5)]
        assert steps[1] == steps[2] == steps[3] == steps[4], rank
        # What makes the second counted step necessary: step 0 holds less (no optimizer state before its end).
        assert steps[0] != steps[1], rank


def test_cpu_wait_is_the_queued_share_of_the_timed_steps() -> None:
    def span(start: float, end: float, queued: float | None) -> dict[str, object]:
        return {"kind": "forward", "start_s": start, "end_s": end, "queued_s": queued}

    # Two timed 2 s steps; 0.3 s + 0.1 s queued inside them; a span outside them does not count.
    report = {"spans": [span(0.0, 1.0, 0.3), span(2.0, 3.0, 0.1), span(5.0, 6.0, 0.9)]}
    assert _cpu_wait(report, [(0.0, 2.0), (2.0, 4.0)]) == pytest.approx(0.1)
    # A span the system gave no figure for: the share is unknown, not 0.
    assert _cpu_wait({"spans": [span(0.0, 1.0, None)]}, [(0.0, 2.0)]) is None


@pytest.mark.slow
def test_a_compiled_plan_runs_and_matches(tmp_path: Path) -> None:
    from dapple_ir.api import compile as compile_plan

    out = tmp_path / "plan"
    compile_plan(GPT, cluster="1x4xV100-16GB", global_batch=8, stages=2, microbatches=4, schedule="1f1b", out_dir=out)
    assert (out / "rank_0.py").is_file()  # compile emitted the rank files
    result = run(out, steps=2, check=True, transport="threads", timeout=30)  # the plan's optimizer (adam)
    assert result.check is not None and result.check.ok, result.check


def test_dapple_run_says_when_ranks_waited_for_a_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dapple_ir.backends.torch import launch
    from dapple_ir.cli import main

    def measured(waits: list[float | None]) -> launch.RunResult:
        return launch.RunResult([1.0], 0, 10.0, [1, 1], ["cpu", "cpu"], None, cpu_waits=waits)

    for waits, said in (([0.01, 0.2], True), ([0.01, 0.02], False), ([None, None], False)):
        monkeypatch.setattr(launch, "run", lambda *a, w=waits, **k: measured(w))
        assert main(["run", str(tmp_path), "--steps", "1"]) == 0
        out = capsys.readouterr().out
        assert ("waited for a CPU (runnable, no core free): rank 0 1%, rank 1 20%" in out) is said, out


def test_dapple_run_names_each_ranks_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dapple_ir.backends.torch import launch
    from dapple_ir.cli import main

    seen: dict[str, object] = {}

    def measured(cores: list[list[int] | None]) -> Callable[..., launch.RunResult]:
        def fake(*_a: object, **k: object) -> launch.RunResult:
            seen.update(k)
            return launch.RunResult([1.0], 0, 10.0, [1, 1], ["cpu", "cpu"], None, cores=cores)

        return fake

    for cores, said in (
        ([[0], [1]], "rank 0 0, rank 1 1"),
        ([[0, 1, 2, 3], [4, 6]], "rank 0 0-3, rank 1 4,6"),
        ([None, None], None),
    ):
        monkeypatch.setattr(launch, "run", measured(cores))
        assert main(["run", str(tmp_path), "--steps", "1"]) == 0
        out = capsys.readouterr().out
        assert seen["pin"] is True
        line = [ln for ln in out.splitlines() if ln.startswith("CPU cores")]
        assert line == (
            [f"CPU cores (each rank pinned to its own; --no-pin leaves them to the OS): {said}"] if said else []
        )
    assert main(["run", str(tmp_path), "--steps", "1", "--no-pin"]) == 0
    assert seen["pin"] is False
