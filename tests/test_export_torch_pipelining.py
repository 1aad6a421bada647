"""`dapple export --to torch-pipelining`: the MLP's plan trains under torch's own schedule runtime
(`_PipelineScheduleRuntime`, our CSV loaded by its own loader) on 2 gloo ranks exactly as single-device
training does; plans torch cannot express are refused naming the dimension; a `--split-at` plan exports
the names it was pinned at, and pinning the exported cuts compiles the same plan again."""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dapple_ir.api import compile as compile_plan
from dapple_ir.backends.torch.torch_pipelining import translate, write
from dapple_ir.errors import DappleError
from tests.paths import ROOT
from tests.planner_cases import captured

MLP = f"{ROOT / 'examples' / 'mlp.py'}:factory"
GPT = f"{ROOT / 'examples' / 'gpt.py'}:factory"
STEPS, BATCH, LR = 2, 16, 0.05
#: A fixed plan (the simulator ranks nothing here): two stages of one rank, 4 microbatches, 1F1B.
PIPELINE = (
    "annotate-cost,coarsen,plan{stages=2,microbatches=4,schedule=1f1b,simulate=false},"
    "schedule,lower-comm,insert-frees,verify"
)

_WORKER = textwrap.dedent(
    """
    import datetime, json, sys
    import torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    rank, port, out, examples, steps, batch, lr = sys.argv[1:8]
    rank, steps, batch, lr = int(rank), int(steps), int(batch), float(lr)
    sys.path.insert(0, examples)
    import mlp

    dist.init_process_group(
        "gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}", timeout=datetime.timedelta(seconds=60)
    )
    manifest = json.load(open(f"{out}/torch_pipelining.json"))
    torch.manual_seed(0)
    model = mlp.build(batch=batch)[0]
    index = manifest["stage_to_rank"].index(rank)
    fqns = manifest["module_fqns_per_model_part"][index]
    part = nn.Sequential(*[model.get_submodule(name) for name in fqns])
    stage = PipelineStage(part, index, len(manifest["stage_to_rank"]), torch.device("cpu"), group=dist.group.WORLD)
    loss = lambda output, target: torch.nn.functional.mse_loss(output, target)
    schedule = _PipelineScheduleRuntime([stage], n_microbatches=manifest["n_microbatches"], loss_fn=loss)
    schedule._load_csv(f"{out}/schedule.csv", format="compute_comms")
    optimizer = torch.optim.SGD(part.parameters(), lr=lr)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(batch, 16, generator=g), torch.randn(batch, 8, generator=g)
        optimizer.zero_grad()
        if index == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        optimizer.step()
    torch.save({f"{name}.{k}": v for name in fqns for k, v in model.get_submodule(name).state_dict().items()},
               f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    """
)


def _reference() -> dict[str, torch.Tensor]:
    """Single-device training of the same model on the same batches."""
    sys.path.insert(0, str(ROOT / "examples"))
    import mlp  # type: ignore[import-not-found]

    torch.manual_seed(0)
    model = mlp.build(batch=BATCH)[0]
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 8, generator=g)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_mlp_trains_under_torchs_schedule_runtime_like_one_device(tmp_path: Path) -> None:
    result = compile_plan(copy.deepcopy(captured(MLP)), cluster="2xcpu", global_batch=BATCH, pipeline=PIPELINE)
    exported = translate(result.module)
    assert (exported.pp_degree, exported.dp_degree, exported.n_microbatches) == (2, 1, 4)
    write(exported, tmp_path)
    # torch's own loader reads both files.
    from torch.distributed.pipelining.schedules import _Action

    for name in ("schedule.csv", "schedule_compute_only.csv"):
        rows = [line.split(",") for line in (tmp_path / name).read_text().splitlines()]
        assert all(_Action.from_str(a) is not None for row in rows for a in row)
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    port, env = _free_port(), {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [str(port), str(tmp_path), str(ROOT / "examples"), str(STEPS), str(BATCH), str(LR)]
    workers = [subprocess.Popen([sys.executable, str(script), str(r), *args], env=env) for r in range(2)]
    try:
        codes = [w.wait(timeout=180) for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    assert codes == [0, 0]
    trained = {**torch.load(tmp_path / "rank0.pt"), **torch.load(tmp_path / "rank1.pt")}
    reference = _reference()
    assert set(trained) == set(reference)
    for name, value in reference.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_uneven_replication_is_refused_naming_it() -> None:
    pipeline = PIPELINE.replace("stages=2,", "stages=2,replication=round-robin,")
    result = compile_plan(copy.deepcopy(captured(MLP)), cluster="3xcpu", global_batch=BATCH, pipeline=pipeline)
    replicas = [s.attrs.replicas for s in result.module.stages]
    assert len(set(replicas)) > 1
    with pytest.raises(DappleError, match="uneven replication"):
        translate(result.module)


def test_split_rows_are_refused_naming_them() -> None:
    pipeline = PIPELINE.replace("stages=2,", "stages=2,replication=split,")
    result = compile_plan(copy.deepcopy(captured(MLP)), cluster="4xcpu", global_batch=BATCH, pipeline=pipeline)
    assert any(s.attrs.split for s in result.module.stages)
    with pytest.raises(DappleError, match=r"uneven replication|split rows"):
        translate(result.module)


def test_a_split_at_plan_exports_its_names_and_pinning_them_compiles_the_same_plan() -> None:
    first = compile_plan(
        copy.deepcopy(captured(GPT)), cluster="4xcpu", global_batch=16, split_at=("blocks.1", "blocks.3")
    )
    names = translate(first.module).module_fqns_per_model_part
    assert [part[0] for part in names[1:]] == ["blocks.1", "blocks.3"]
    assert names[0][:2] == ["tok", "pos"] and names[-1][-1] == "ln_f"
    again = compile_plan(
        copy.deepcopy(captured(GPT)), cluster="4xcpu", global_batch=16, split_at=tuple(p[0] for p in names[1:])
    )
    assert first.module.stages and len(again.module.stages) == len(first.module.stages)
    for a, b in zip(first.module.stages, again.module.stages, strict=True):
        assert [op.name for op in a.ops] == [op.name for op in b.ops] and a.attrs == b.attrs
    assert (first.module.attrs.microbatches, first.module.attrs.schedule) == (
        again.module.attrs.microbatches,
        again.module.attrs.schedule,
    )
