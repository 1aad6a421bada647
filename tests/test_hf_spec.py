"""`hf:path/config.json` model specs: a Hugging Face config file built with its task head and example inputs
(`dapple_ir.frontend.hf_spec`, `dapple_ir.frontend.hf_config`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM, ViTConfig, ViTForImageClassification

from dapple_ir.api import compile as compile_plan
from dapple_ir.backends.torch.launch import run
from dapple_ir.cli import main
from dapple_ir.errors import CaptureError
from dapple_ir.frontend.hf_spec import parse_hf_spec, with_shape
from dapple_ir.frontend.model_spec import FactoryResult, load_model_spec

TINY_LLAMA = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


@pytest.fixture
def llama_json(tmp_path: Path) -> Path:
    """A tiny Llama's config.json as `to_json_file` writes it: no `architectures`."""
    path = tmp_path / "config.json"
    LlamaConfig(**TINY_LLAMA).to_json_file(str(path))
    return path


def test_the_recorded_spec_has_an_absolute_path_and_the_example_shape(llama_json: Path) -> None:
    spec = with_shape(f"hf:{llama_json}", 16, None)
    assert spec == f"hf:{llama_json.resolve()}?seq=16&batch=4"
    parsed = parse_hf_spec(spec)
    assert (parsed.config, parsed.seq, parsed.batch) == (llama_json.resolve(), 16, 4)


@pytest.mark.parametrize(
    ("spec", "culprit"),
    [("hf:", "name a config file"), ("hf:c.json?seq=0", "seq='0'"), ("hf:c.json?width=3", "unknown option(s) width")],
)
def test_malformed_specs_are_refused(spec: str, culprit: str) -> None:
    with pytest.raises(CaptureError, match=culprit.replace("(", r"\(").replace(")", r"\)")):
        parse_hf_spec(spec)


def test_a_config_without_architectures_gets_a_causal_lm(llama_json: Path) -> None:
    loaded = load_model_spec(f"hf:{llama_json}?seq=16&batch=2", device="meta")
    assert isinstance(loaded, FactoryResult) and isinstance(loaded.model, LlamaForCausalLM)
    assert loaded.example_kwargs is not None
    assert {k: tuple(v.shape) for k, v in loaded.example_kwargs.items()} == {"input_ids": (2, 16), "labels": (2, 16)}


def test_the_architecture_picks_the_head(tmp_path: Path) -> None:
    path = tmp_path / "vit.json"
    config = ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    config.architectures = ["ViTForImageClassification"]
    config.to_json_file(str(path))
    loaded = load_model_spec(f"hf:{path}?batch=3", device="meta")
    assert isinstance(loaded, FactoryResult) and isinstance(loaded.model, ViTForImageClassification)
    assert loaded.example_kwargs is not None
    assert tuple(loaded.example_kwargs["pixel_values"].shape) == (3, 3, 16, 16)


def test_a_head_it_cannot_feed_is_named(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    config = LlamaConfig(**TINY_LLAMA)
    config.architectures = ["LlamaForQuestionAnswering"]
    config.to_json_file(str(path))
    with pytest.raises(CaptureError, match="architecture LlamaForQuestionAnswering has none of the heads"):
        load_model_spec(f"hf:{path}", device="meta")


def test_seq_is_refused_for_a_factory_spec(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["compile", "examples/mlp.py:factory", "--cluster", "2xcpu", "--global-batch", "8", "-o", "x", "--seq", "4"]
    )
    assert code != 0
    assert "--seq and --example-batch shape the example of an hf:config.json spec" in capsys.readouterr().err


@pytest.mark.slow
def test_a_llama_config_plans_and_trains_exactly(llama_json: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan"
    spec = with_shape(f"hf:{llama_json}", 16, 4)
    compile_plan(spec, cluster="2xcpu", global_batch=8, stages=2, microbatches=4, out_dir=out)
    result = run(out, steps=2, check=True, transport="threads", timeout=120, device="cpu")
    assert result.check is not None and result.check.ok, result.check
