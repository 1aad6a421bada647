"""The model zoo: tiny Hugging Face `transformers` models (GPT-2, Llama, Qwen2 with tied embeddings,
BERT masked LM, T5, ViT, the mixtures of experts Mixtral and Qwen2-MoE, BART, Whisper), each with its
library defaults, dropout included. Each is captured, planned as two stages on `2xcpu` whose stages each
hold a fair share of the blocks, and trained for two steps on two CPU ranks with `--check` against
single-device training: Llama (the README's `dapple run` example) and T5 as torchrun processes over gloo,
the others as the threads of one process (see `TORCHRUN`).

A fair share: every stage runs at least a quarter of the model's forward time. Each tiny model has
two blocks (T5, BART, Whisper: two in the encoder, two in the decoder; the mixtures of experts four)
holding 70-90% of its forward time, the rest being embeddings and heads; a cut between blocks gives
each stage about half. A cut that keeps every block on one stage, as when a symbolic batch size stops
coarsen from cutting between blocks, leaves the other stage only an embedding or a head, under 15% of
the time here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from dapple_ir.analysis.experts import expert_layers
from dapple_ir.api import CompileResult
from dapple_ir.api import compile as compile_plan
from dapple_ir.backends.torch.launch import run
from dapple_ir.frontend.model_spec import FactoryResult, load_model_spec
from dapple_ir.ir import TensorType
from tests.paths import ROOT

MODELS = {
    "gpt2": f"{ROOT}/tests/hf_zoo.py:gpt2",
    "llama": f"{ROOT}/examples/llama.py:factory",
    "qwen2": f"{ROOT}/tests/hf_zoo.py:qwen2",
    "bert": f"{ROOT}/tests/hf_zoo.py:bert",
    "t5": f"{ROOT}/examples/t5.py:factory",
    "vit": f"{ROOT}/tests/hf_zoo.py:vit",
    "mixtral": f"{ROOT}/tests/hf_zoo.py:mixtral",
    "qwen2_moe": f"{ROOT}/tests/hf_zoo.py:qwen2_moe",
    "bart": f"{ROOT}/tests/hf_zoo.py:bart",
    "whisper": f"{ROOT}/tests/hf_zoo.py:whisper",
}

#: The mixture-of-experts models: 4 layers, each of 4 experts taking every token's top 2 (`hf_zoo`).
MOE = {"mixtral", "qwen2_moe"}

#: The least share of the forward time each of the two stages must run (see the module docstring).
FAIR_SHARE = 0.25

#: The models that train as torchrun processes over gloo: between them every kind of value the zoo
#: sends between stages crosses the wire (float activations, boolean attention masks, T5's position
#: bias, which has no batch dimension to split). GPT-2, BERT and ViT send float activations only and
#: Qwen2 what Llama sends; they train as threads of this process (the same runtime and `--check`),
#: without the torchrun start of two workers that import transformers (20-25 s of CPU each).
TORCHRUN = {"llama", "t5"}


@dataclass
class Planned:
    name: str
    spec: str
    plan_dir: Path
    result: CompileResult


@pytest.fixture(scope="module", params=list(MODELS))
def planned(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Planned:
    """The model captured on meta and compiled like `dapple compile SPEC --cluster 2xcpu --global-batch 8
    --stages 2 --microbatches 4 -o PLAN`: one compile per model, shared by its tests. Four microbatches, so that
    the split decides the step time: left to itself the planner runs these tiny models as one microbatch (nothing
    overlaps, so it cuts where the least crosses, after the token ids: no block boundary to check, no activation
    on the wire)."""
    name = request.param
    out = tmp_path_factory.mktemp(name) / "plan"
    result = compile_plan(MODELS[name], cluster="2xcpu", global_batch=8, stages=2, microbatches=4, out_dir=out)
    return Planned(name, MODELS[name], out, result)


@pytest.mark.slow
def test_capture_holds_every_parameter_once(planned: Planned) -> None:
    loaded = load_model_spec(planned.spec, device="meta", seed=0)
    assert isinstance(loaded, FactoryResult)
    # named_parameters lists a tied parameter (embedding and LM head) once, by its first name. A frozen one
    # (Whisper's sinusoidal encoder positions) trains nowhere: the graph holds it as a buffer.
    named = dict(loaded.model.named_parameters())
    expected = {name: tuple(p.shape) for name, p in named.items() if p.requires_grad}
    captured = {p.name: p.type.shape for p in planned.result.module.params if not p.attrs.buffer}
    assert captured == expected
    frozen = {name for name, p in named.items() if not p.requires_grad}
    assert frozen <= {p.name for p in planned.result.module.params if p.attrs.buffer}


@pytest.mark.slow
def test_two_stages_each_run_a_fair_share(planned: Planned) -> None:
    module = planned.result.module
    assert len(module.stages) == 2
    total = sum(op.attrs.fwd_s or 0.0 for op in module.ops)
    shares = [sum(op.attrs.fwd_s or 0.0 for op in stage.ops) / total for stage in module.stages]
    assert min(shares) >= FAIR_SHARE, (
        f"{planned.name}: stages run {', '.join(f'{s:.0%}' for s in shares)} of the forward time "
        f"({len(module.layers)} layers after coarsen)"
    )


@pytest.mark.slow
def test_experts_are_priced_at_the_pairs_routed_to_them(planned: Planned) -> None:
    layers = expert_layers(planned.result.module)
    if planned.name not in MOE:
        assert not layers
        return
    tokens = 4 * 16  # the example: 4 sequences of 16 tokens
    assert [(x.experts, x.pairs, x.tokens, x.top_k) for x in layers] == [(4, tokens * 2, tokens, 2)] * 4
    grouped = [op for op in planned.result.module.ops if "grouped_mm" in str(op.target)]
    for op in grouped:
        rows, weight = op.operands[0].type, op.operands[1].type
        assert isinstance(rows, TensorType) and isinstance(weight, TensorType)
        assert op.attrs.fwd_flops == 2 * rows.shape[0] * rows.shape[1] * weight.shape[-1]
    # Per microbatch of 2 sequences: 32 tokens x top-2 over 4 experts.
    assert any("16 tokens per expert" in line for line in planned.result.explain)


@pytest.mark.slow
def test_run_check_on_two_cpu_ranks(planned: Planned) -> None:
    transport = "torchrun" if planned.name in TORCHRUN else "threads"
    result = run(planned.plan_dir, steps=2, check=True, transport=transport, timeout=120, device="cpu")
    assert result.check is not None and result.check.ok, f"{planned.name}: {result.check}"
    assert len(result.losses) == 2
