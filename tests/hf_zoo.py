"""Tiny Hugging Face `transformers` models for the model-zoo tests (`test_hf_models.py`), built
from configs in code with the library's defaults (dropout included) and a loss from their labels:
each factory returns (model, keyword inputs) and the model's `"loss"` is what trains. The Llama
and T5 models are the ones in `examples/`.
"""

from __future__ import annotations

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    ViTConfig,
    ViTForImageClassification,
)

VOCAB, SEQ, BATCH = 128, 16, 4


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ))


def gpt2() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """GPT-2: learned positions, GELU MLPs, LM head tied to the token embedding."""
    # Its begin/end-of-text token is the last of the vocabulary, as in GPT-2's own.
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1
    )
    ids = _tokens()
    return GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids.clone()}


def qwen2() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Qwen2 with tied input and output embeddings (as Qwen2-0.5B): GQA with q/k/v biases."""
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    ids = _tokens()
    return Qwen2ForCausalLM(config), {"input_ids": ids, "labels": ids.clone()}


def bert() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """BERT with its masked-LM head, a label at every position (the training data is synthetic: a
    label of -100, "not masked", would not survive its uniform redraw of the example's range)."""
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
    )
    return BertForMaskedLM(config), {"input_ids": _tokens(), "labels": _tokens()}


def vit() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """ViT on 16x16 images in 4x4 patches, classifying into 10 labels."""
    config = ViTConfig(
        image_size=16,
        patch_size=4,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        num_labels=10,
    )
    inputs = {"pixel_values": torch.randn(BATCH, 3, 16, 16), "labels": torch.randint(0, 10, (BATCH,))}
    return ViTForImageClassification(config), inputs


def mixtral() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Mixtral: a sparse mixture of 4 SwiGLU experts per layer, each token routed to its top 2 (the
    library's default routing and experts implementation), over 4 layers."""
    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    ids = _tokens()
    return MixtralForCausalLM(config), {"input_ids": ids, "labels": ids.clone()}


def qwen2_moe() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Qwen2-MoE: 4 routed experts (top 2) beside a gated shared expert in every layer, over 4 layers."""
    config = Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    ids = _tokens()
    return Qwen2MoeForCausalLM(config), {"input_ids": ids, "labels": ids.clone()}
