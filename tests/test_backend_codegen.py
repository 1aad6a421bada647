"""Rank files say exactly what the rank programs say (and read as the golden one does); stage modules compose
to the whole model; the CLI."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from dapple_ir.analysis.peak_memory import recv_posts
from dapple_ir.backends.torch.codegen import rank_sources
from dapple_ir.backends.torch.stage_module import model_param_names, split_stage
from dapple_ir.backends.torch.transport import from_jsonable, to_jsonable
from dapple_ir.cli import main
from dapple_ir.frontend.model_spec import FactoryResult, capture_loaded, load_model_spec
from dapple_ir.ir import InstrKind
from dapple_ir.ir.parser import parse_module
from dapple_ir.pass_manager import PassManager, build_pipeline
from dapple_ir.plan_dir import load_plan
from tests.test_runtime import GPT, MLP, make_plan

GOLDEN = Path(__file__).parent / "golden"


class Recorder:
    """Stands in for the runtime: records each call as the instruction tuple it should come from."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __getattr__(self, method: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> None:
            self.calls.append((method, args, tuple(sorted(kwargs.items()))))

        return record


def expected_call(instr: Any) -> tuple[Any, ...]:
    """The runtime call an instruction must become, derived from the IR alone."""
    k = instr.kind
    stage = instr.stage.name if instr.stage is not None else None
    value = instr.value.name if instr.value is not None else None
    grad = (("grad", True),) if instr.grad else ()
    if k is InstrKind.LOAD_MICROBATCH:
        return ("load_microbatch", (), (("mb", instr.mb),))
    if k in (InstrKind.FORWARD, InstrKind.BACKWARD, InstrKind.BACKWARD_INPUT, InstrKind.BACKWARD_WEIGHT):
        return (k.value, (stage,), (("mb", instr.mb),))
    if k in (InstrKind.SEND, InstrKind.RECV):
        return (k.value, (value,), tuple(sorted((("mb", instr.mb), ("peer", instr.peer), *grad))))
    if k is InstrKind.FREE:
        if stage is not None:
            return ("free_stage", (stage,), (("mb", instr.mb),))
        return ("free", (value,), tuple(sorted((("mb", instr.mb), *grad))))
    if k is InstrKind.ALLREDUCE:
        target = ("allreduce_param", (instr.param,)) if instr.param else ("allreduce", (stage,))
        return (*target, (("group", tuple(instr.group)),))
    assert k is InstrKind.OPTIMIZER_STEP
    return ("optimizer_step", (), ())


@pytest.mark.parametrize(("spec", "kind"), [(GPT, "zb-h1"), (MLP, "gpipe"), (MLP, "1f1b")])
def test_rank_files_call_the_runtime_in_program_order(tmp_path: Path, spec: str, kind: str) -> None:
    plan_dir = make_plan(tmp_path, spec, stages=2, replicas=[1, 2], kind=kind)
    plan = load_plan(plan_dir)
    digest = hashlib.sha256((plan_dir / "plan.dapple").read_bytes()).hexdigest()
    kinds_seen: set[str] = set()
    for rank, program in enumerate(plan.module.programs):
        source = (plan_dir / f"rank_{rank}.py").read_text()
        assert f'PLAN_SHA256 = "{digest}"' in source
        namespace: dict[str, Any] = {}
        exec(compile(source, f"rank_{rank}.py", "exec"), namespace)
        recorder = Recorder()
        namespace["train_step"](recorder)
        posted: dict[int, list[tuple[Any, ...]]] = {}
        for recv, post in sorted(recv_posts(plan.module, program).items()):
            posted.setdefault(post, []).append(("post_recv", *expected_call(program.instrs[recv])[1:]))
        expected = [
            call for index, i in enumerate(program.instrs) for call in [*posted.get(index, []), expected_call(i)]
        ]
        assert recorder.calls == expected
        kinds_seen |= {c[0] for c in recorder.calls}
        phases = [line.strip() for line in source.splitlines() if line.startswith("    # --- ")]
        assert phases[0].startswith("# --- warm-up") and phases[-1] == "# --- gradients and optimizer step ---"
        assert any("steady state" in p for p in phases) == (kind != "gpipe")  # GPipe: all forwards, then all backwards
    assert {"send", "recv", "allreduce", "free_stage", "optimizer_step"} <= kinds_seen
    assert ("allreduce_param" in kinds_seen) == (spec == GPT)  # the tied embedding


def test_rank_file_matches_golden() -> None:
    """The text a person reads: 1F1B over three stages, the middle one on two ranks (rank 1 is one of them).

    `DAPPLE_UPDATE_GOLDEN=rank_file pytest tests/test_backend_codegen.py` rewrites the expected file; read it
    before keeping it.
    """
    module = parse_module((GOLDEN / "lower_comm" / "replicated.dapple").read_text())
    module.attrs.global_batch = 8  # a runnable plan records it: 4 microbatches of 2 samples
    PassManager(build_pipeline("schedule{kind=1f1b,microbatches=4},lower-comm,insert-frees,verify")).run(module)
    got = rank_sources(module, digest="0" * 64)[1]  # a fixed digest keeps the golden independent of the printer
    expected = GOLDEN / "rank_file" / "replicated_1f1b_rank1.py.expected"
    if {"rank_file", "all"} & set(os.environ.get("DAPPLE_UPDATE_GOLDEN", "").split(",")):
        expected.parent.mkdir(exist_ok=True)
        expected.write_text(got)
    assert got == expected.read_text(), f"{expected}: the generated rank file differs"


def test_stage_modules_compose_to_the_whole_graph() -> None:
    loaded = load_model_spec(GPT, device="cpu", seed=0)
    assert isinstance(loaded, FactoryResult)
    captured = capture_loaded(loaded)
    gm = captured.graph_module
    names = [n.name for n in gm.graph.nodes]
    cuts = [0, len(names) // 3, 2 * len(names) // 3, len(names)]
    param_names = model_param_names(loaded.model)
    stages = [split_stage(gm, f"s{i}", names[cuts[i] : cuts[i + 1]], param_names) for i in range(3)]
    flat = (*loaded.example_inputs, *loaded.example_targets)
    env = {n.name: v for n, v in zip((n for n in gm.graph.nodes if n.op == "placeholder"), flat, strict=True)}
    loss = None
    for sm in stages:
        results = sm.graph_module(*[env[name] for name in sm.inputs])
        env.update(zip(sm.outputs, results, strict=False))
        if sm.has_loss:
            loss = results[-1]
    assert loss is not None and torch.equal(loss, gm(*flat))
    # Each parameter is held by the stages that read it; the tied embedding by the first and the last.
    holders = {name: [sm.name for sm in stages if name in sm.params] for name in param_names.values()}
    assert holders["tok.weight"] == ["s0", "s2"]
    assert sum(len(v) for v in holders.values()) == len(param_names) + 1


def test_non_tensor_payloads_travel_as_json() -> None:
    for value in [3, 2.5, None, True, "x", (2, 3), torch.Size([4, 5]), [1, (2, None)]]:
        back = from_jsonable(to_jsonable(value))
        assert back == (tuple(value) if isinstance(value, torch.Size) else value)
        assert type(back) is (tuple if isinstance(value, torch.Size) else type(value))


def test_cli_run_prints_losses_and_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = make_plan(tmp_path, MLP, stages=2, kind="1f1b")
    code = main(["run", str(plan), "--steps", "2", "--transport", "threads", "--check", "--optimizer", "adam"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "step  loss" in out and "samples/s" in out and "rank 1:" in out
    assert "OK at rtol 1e-05, atol 4e-05" in out
    assert (plan / "timeline_measured.json").is_file()


def test_cli_run_fails_on_mismatch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = make_plan(tmp_path, MLP, stages=2, kind="1f1b")
    import dapple_ir.backends.torch.reference as reference

    real = reference.train_reference

    def wrong_reference(spec: str, **kwargs: Any) -> Any:
        kwargs["lr"] *= 2  # a reference that trains differently must be caught
        return real(spec, **kwargs)

    monkeypatch.setattr(reference, "train_reference", wrong_reference)
    code = main(["run", str(plan), "--steps", "1", "--transport", "threads", "--check"])
    assert code == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_cli_reports_bad_plan_dir_without_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", str(tmp_path / "nowhere"), "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "does not exist" in err and "Traceback" not in err
