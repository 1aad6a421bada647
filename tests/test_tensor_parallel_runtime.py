"""Tensor parallelism at run time (issue 45): a stage split over a tensor group computes what it computes whole.

The mechanics (`backends/torch/tensor_parallel.py`, `tensor_graph.py`, `tensor_draws.py`) on the captured graphs
of the GPT example (torch.fx: `split(d)`, `view(b, t, n_head, d // n_head)`, `reshape(b, t, d)`), a tiny
transformers Llama (torch.export ATen ops: GQA's `expand`/`reshape`, rotary embedding) and Megatron's GPT with
dropout (in attention and after the MLP's activation... on split values), marked by the `tensor-parallel` pass, run
on two threads against the whole stage: the same loss and gradients, within the rounding of the reordered sums
(each row-parallel matmul's sum over its input features is cut in two partial sums).
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from dapple_ir.backends.torch.random_draws import StageDraws
from dapple_ir.backends.torch.stage_module import StageModule, model_param_names, split_stage
from dapple_ir.backends.torch.tensor_graph import shard_stage
from dapple_ir.backends.torch.tensor_parallel import TensorGroup, gather_shards, shard_of, whole_of
from dapple_ir.backends.torch.transport import ThreadHub, ThreadTransport
from dapple_ir.errors import DappleError
from dapple_ir.frontend.model_spec import FactoryResult, capture_loaded, load_model_spec
from dapple_ir.frontend.runnable import bind_model
from dapple_ir.ir import Module, Stage, StageAttrs
from dapple_ir.pass_manager import PassManager, build_pipeline

ROOT = Path(__file__).resolve().parent.parent
GPT = f"{ROOT}/examples/gpt.py:factory"
LLAMA = f"{ROOT}/examples/llama.py:factory"

# ------------------------------------------------------------------------------ running a stage


@dataclass
class Captured:
    module: Module
    model: torch.nn.Module
    graph_module: torch.fx.GraphModule
    inputs: tuple[Any, ...]


def _capture(spec: str) -> Captured:
    loaded = load_model_spec(spec, device="cpu", seed=0)
    assert isinstance(loaded, FactoryResult)
    captured = capture_loaded(loaded)
    module = captured.module
    graph_module = bind_model(captured, loaded.model, loaded.loss_fn)
    inputs = (*loaded.example_inputs, *(loaded.example_kwargs or {}).values(), *loaded.example_targets)
    return Captured(module, loaded.model, graph_module, inputs)


def _whole_stage(c: Captured) -> StageModule:
    model, graph_module = copy.deepcopy((c.model, c.graph_module))
    names = [op.name for op in c.module.ops]
    return split_stage(graph_module, "s0", names, model_param_names(model))


def _train(sm: StageModule, inputs: tuple[Any, ...]) -> tuple[float, dict[str, torch.Tensor]]:
    (loss,) = StageDraws("s0").run(sm.graph_module, list(inputs), seed=0, step=0, mb=0)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in sm.params.items() if p.grad is not None}


def _train_split(c: Captured, tp: int) -> tuple[list[float], dict[int, dict[str, torch.Tensor]]]:
    """The whole model as one stage with `tp` members, each a thread; every member's loss and gradients."""
    c.module.stages = [Stage("s0", list(c.module.ops), StageAttrs(tp=tp, devices=tuple(range(tp))))]
    hub = ThreadHub(tp)
    stages = []
    for k in range(tp):
        sm = _whole_stage(c)
        shard_stage(sm, c.module, TensorGroup("s0", tuple(range(tp)), k, ThreadTransport(hub, k), 30.0))
        stages.append(sm)
    results: dict[int, tuple[float, dict[str, torch.Tensor]]] = {}
    errors: list[BaseException] = []

    def member(k: int) -> None:
        try:
            results[k] = _train(stages[k], c.inputs)
        except BaseException as exc:
            errors.append(exc)
            hub.fail(k, str(exc))

    threads = [threading.Thread(target=member, args=(k,)) for k in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return [results[k][0] for k in range(tp)], {k: {f"s0/{n}": g for n, g in results[k][1].items()} for k in range(tp)}


def _megatron_with_dropout(tmp_path: Path) -> str:
    """Megatron's GPT, tiny, with its dropout (0.1): in attention, after each block's matmuls, on the embeddings."""
    spec = tmp_path / "megatron_dropout.py"
    spec.write_text(
        "import importlib.util\nimport sys\n"
        f"found = importlib.util.spec_from_file_location('tp_megatron', {str(ROOT / 'examples/megatron_gpt.py')!r})\n"
        "m = sys.modules['tp_megatron'] = importlib.util.module_from_spec(found)\n"
        "found.loader.exec_module(m)\n\n\n"
        "def factory():\n"
        "    return m.build(m.GPTShape(96, 16, 32, 2, 4, dropout=0.1), batch=4)\n"
    )
    return f"{spec}:factory"


@pytest.mark.parametrize("spec", [GPT, LLAMA, "megatron"], ids=["gpt-fx", "llama-export", "megatron-dropout"])
def test_a_stage_split_over_two_members_computes_the_whole_stage(spec: str, tmp_path: Path) -> None:
    c = _capture(_megatron_with_dropout(tmp_path) if spec == "megatron" else spec)
    want_loss, want = _train(_whole_stage(c), c.inputs)
    PassManager(build_pipeline("tensor-parallel")).run(c.module)
    assert {op.attrs.tp_role for op in c.module.ops} == {None, "col", "row"}
    losses, grads = _train_split(c, 2)
    assert losses[0] == losses[1]  # every member holds the same bits of the whole loss
    assert abs(losses[0] - want_loss) <= 1e-6 * abs(want_loss)
    whole = gather_shards(c.module, grads, {("s0", 0): (0, 1)})
    split = {p.name for p in c.module.params if p.attrs.tp_dim is not None}
    assert split and set(whole[0]) == {f"s0/{n}" for n in want}
    scale = max(float(g.abs().max()) for g in want.values())
    for key, got in whole[0].items():
        name = key.split("/", 1)[1]
        assert got.shape == want[name].shape, name
        torch.testing.assert_close(got, want[name], rtol=1e-5, atol=1e-5 * scale, msg=name)
        if name not in split:  # whole parameters: the very same gradient on both members
            assert torch.equal(got, whole[1][key]), name


def test_a_member_holds_its_heads_of_each_part_of_a_fused_qkv() -> None:
    w = torch.arange(12.0).reshape(12, 1)  # q rows 0-3, k rows 4-7, v rows 8-11
    assert shard_of(w, 0, 3, 1, 2, "w").flatten().tolist() == [2, 3, 6, 7, 10, 11]
    slices = [shard_of(w, 0, 3, k, 2, "w") for k in range(2)]
    assert torch.equal(whole_of(slices, 0, 3), w)
    with pytest.raises(DappleError, match="does not divide"):
        shard_of(w, 0, 3, 0, 3, "parameter @w")
