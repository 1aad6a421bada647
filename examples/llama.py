"""A Llama-style decoder from Hugging Face `transformers`, built from a config in code (random
weights, nothing downloaded): RMSNorm, rotary positions, SwiGLU MLPs and grouped-query attention
(fewer key/value heads than query heads). Called with `input_ids` and `labels`, the model returns a
dict whose `"loss"` is the shifted next-token cross-entropy, so the factories give no loss function.

`factory()` is tiny enough to train on two CPU ranks in seconds:

    dapple compile examples/llama.py:factory --cluster 2xcpu --global-batch 8 --stages 2 --microbatches 4 -o plans/llama
    dapple run plans/llama --steps 2 --check

`factory_7b()` is Llama-2-7B (32 layers, hidden 4096, seq 2048, example batch 4) and
`factory_70b()` Llama-2-70B (80 layers, hidden 8192, 8 key/value heads); both are for planning on
the meta device: `dapple compile examples/llama.py:factory_7b --cluster 4x8xH100 --global-batch 64 -o plans/llama-7b`.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build(config: LlamaConfig, *, seq: int, batch: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The model and its keyword example inputs; the labels are the inputs (the model shifts them)."""
    model = LlamaForCausalLM(config)
    input_ids = torch.randint(0, config.vocab_size, (batch, seq))
    return model, {"input_ids": input_ids, "labels": input_ids.clone()}


def tiny_config() -> LlamaConfig:
    """2 layers, hidden 64, 4 query heads sharing 2 key/value heads, vocabulary 128."""
    return LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def factory() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    return build(tiny_config(), seq=16, batch=4)


#: Llama-2-7B: 32 layers, hidden 4096, 32 heads (no grouping), MLP 11008, vocabulary 32000.
LLAMA_2_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32)

#: Llama-2-70B: 80 layers, hidden 8192, 64 query heads sharing 8 key/value heads, MLP 28672.
LLAMA_2_70B = dict(
    hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8
)


def factory_7b() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    return build(LlamaConfig(**LLAMA_2_7B), seq=2048, batch=4)


def factory_70b() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    return build(LlamaConfig(**LLAMA_2_70B), seq=2048, batch=4)
