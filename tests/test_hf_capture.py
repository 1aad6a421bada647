"""Hugging Face transformers models, built from small configs with the library's defaults (dropout
included): captured on the meta device, cut between every pair of blocks, and trained from the very
graph that was planned.

The factories below are model specs too (`tests/test_hf_capture.py:gpt2`), so the runtime's
`prepare_model` rebuilds them the way `dapple run` does. Blocks are told apart by the module paths
capture records (`transformer.h.2.attn.c_attn` belongs to block 2), which coarsen never reads.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from dapple_ir.backends.torch.worker import prepare_model
from dapple_ir.frontend.capture import Captured
from dapple_ir.frontend.model_spec import FactoryResult, capture_loaded, load_model_spec
from dapple_ir.frontend.runnable import retarget_devices
from dapple_ir.ir import Module, OpaqueType
from dapple_ir.ir.structure import structure_hash
from dapple_ir.ir.verifier import verify_module
from dapple_ir.pass_manager import PassManager, build_pipeline
from dapple_ir.plan_dir import Plan
from dapple_ir.registry import PassContext

HERE = Path(__file__).resolve()
BATCH, SEQ, VOCAB, BLOCKS = 4, 16, 128, 4
_TINY: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": BLOCKS,
    "num_attention_heads": 4,
}


def _text(model: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return model, {"input_ids": ids, "labels": ids.clone()}


def gpt2() -> tuple[Any, dict[str, torch.Tensor]]:
    config = transformers.GPT2Config(n_layer=BLOCKS, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64)
    return _text(transformers.GPT2LMHeadModel(config))


def llama() -> tuple[Any, dict[str, torch.Tensor]]:
    config = transformers.LlamaConfig(**_TINY, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    return _text(transformers.LlamaForCausalLM(config))


def qwen2() -> tuple[Any, dict[str, torch.Tensor]]:
    config = transformers.Qwen2Config(
        **_TINY, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=True
    )
    return _text(transformers.Qwen2ForCausalLM(config))


def bert() -> tuple[Any, dict[str, torch.Tensor]]:
    config = transformers.BertConfig(**_TINY, vocab_size=VOCAB, max_position_embeddings=64)
    return _text(transformers.BertForMaskedLM(config))


def t5() -> tuple[Any, dict[str, torch.Tensor]]:
    # Published T5 configs carry decoder_start_token_id (labels are shifted right with it); the class default does not.
    # Half the layers each in the encoder and the decoder: BLOCKS blocks in all.
    start: dict[str, Any] = {"decoder_start_token_id": 0}
    config = transformers.T5Config(
        d_model=32, d_ff=64, d_kv=8, num_layers=BLOCKS // 2, num_heads=4, vocab_size=VOCAB, **start
    )
    return _text(transformers.T5ForConditionalGeneration(config))


def vit() -> tuple[Any, dict[str, torch.Tensor]]:
    labels: dict[str, Any] = {"num_labels": 10}
    config = transformers.ViTConfig(**_TINY, image_size=32, patch_size=8, **labels)
    images = torch.randn(BATCH, 3, 32, 32)
    return transformers.ViTForImageClassification(config), {
        "pixel_values": images,
        "labels": torch.randint(0, 10, (BATCH,)),
    }


#: Model -> the pattern whose match on an op's module path names the op's block.
BLOCK_OF = {
    "gpt2": r"transformer\.h\.\d+",
    "llama": r"model\.layers\.\d+",
    "qwen2": r"model\.layers\.\d+",
    "bert": r"bert\.encoder\.layer\.\d+",
    "t5": r"(?:encoder|decoder)\.block\.\d+",
    "vit": r"vit\.(?:encoder\.)?layers?\.\d+",  # transformers 5 names them vit.layers.N
}
_CAPTURED: dict[str, Captured] = {}


def _spec(name: str) -> str:
    return f"{HERE}:{name}"


def _meta_capture(name: str) -> Captured:
    """The capture `dapple compile` makes: the factory on the meta device, every cost annotated."""
    if name not in _CAPTURED:
        loaded = load_model_spec(_spec(name), device="meta")
        assert isinstance(loaded, FactoryResult)
        _CAPTURED[name] = capture_loaded(loaded)
    return _CAPTURED[name]


def _coarsened(name: str, pipeline: str) -> Module:
    module = _meta_capture(name).module
    PassManager(build_pipeline(pipeline)).run(module, PassContext(cluster="1xcpu"))
    verify_module(module)
    return module


def _block(module_path: str | None, pattern: str) -> str | None:
    found = re.match(pattern + r"(?:\.|$)", module_path or "")
    return found.group(0).rstrip(".") if found else None


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BLOCK_OF))
def test_every_pair_of_blocks_can_be_cut_apart(name: str) -> None:
    module = _coarsened(name, "annotate-cost,coarsen{max-layers=100000}")  # every legal cut kept
    blocks = {_block(op.attrs.module_path, BLOCK_OF[name]) for op in module.ops} - {None}
    assert len(blocks) == BLOCKS
    for layer in module.layers:
        held = {_block(op.attrs.module_path, BLOCK_OF[name]) for op in layer.ops} - {None}
        assert len(held) <= 1, f"layer {layer.name} spans blocks {sorted(map(str, held))}"
    # Sizes are read where they are used: no size value reaches from one block into another.
    block_of = {op: _block(op.attrs.module_path, BLOCK_OF[name]) for op in module.ops}
    for op in module.ops:
        for v in op.operands:
            if isinstance(v.type, OpaqueType) and block_of[v] is not None:
                assert block_of[v] == block_of[op], f"%{op.name} reads the size %{v.name} of another block"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BLOCK_OF))
def test_no_coarsened_layer_holds_more_than_a_fair_share(name: str) -> None:
    module = _coarsened(name, "annotate-cost,coarsen")
    times = [(layer.attrs.fwd_s or 0.0) + (layer.attrs.bwd_s or 0.0) for layer in module.layers]
    assert len(module.layers) >= BLOCKS
    # Before sizes were read locally, the first layer held 73-94% of these models.
    assert max(times) <= 2 / BLOCKS * sum(times), f"largest layer {max(times) / sum(times):.0%} of the compute"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BLOCK_OF))
def test_the_runtime_trains_the_planned_graph(name: str) -> None:
    captured = _meta_capture(name)
    meta = {"model_spec": _spec(name), "model_hash": structure_hash(captured.module), "seed": 3}
    prepared = prepare_model(Plan(HERE.parent, captured.module, meta, ir_sha256=""))
    assert prepared.structure_hash == meta["model_hash"]  # the hash check inside passed, too
    planned = [(n.name, n.op) for n in captured.graph_module.graph.nodes]
    assert [(n.name, n.op) for n in prepared.graph_module.graph.nodes] == planned
    # The graph with the real weights computes what the model computes, dropout draws included.
    loaded = load_model_spec(_spec(name), device="cpu", seed=3)
    assert isinstance(loaded, FactoryResult) and loaded.example_kwargs is not None
    graph = copy.deepcopy(prepared.graph_module)  # the prepared one stays as the runtime caches it
    retarget_devices(graph, torch.device("cpu"))
    assert not any(p.is_meta for p in graph.parameters())
    torch.manual_seed(11)
    expected = loaded.model(**loaded.example_kwargs)["loss"]
    torch.manual_seed(11)
    got = graph(*prepared.example_inputs)
    torch.testing.assert_close(got, expected)
