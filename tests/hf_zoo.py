"""Tiny Hugging Face `transformers` models for the model-zoo tests (`test_hf_models.py`), built
from configs in code with the library's defaults (dropout included) and a loss from their labels:
each factory returns (model, keyword inputs) and the model's `"loss"` is what trains. The Llama
and T5 models are the ones in `examples/`.
"""

from __future__ import annotations

import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
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
    WhisperConfig,
    WhisperForConditionalGeneration,
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


def bart() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """BART: an encoder-decoder with learned positions; the decoder's inputs come from the labels shifted
    right from its start token. Token ids stay clear of the special ids 0-2 the shrunken vocabulary keeps."""
    config = BartConfig(
        vocab_size=VOCAB,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
    )
    ids = torch.randint(3, VOCAB, (BATCH, SEQ))
    return BartForConditionalGeneration(config), {"input_ids": ids, "labels": torch.randint(3, VOCAB, (BATCH, SEQ))}


def whisper() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Whisper: a speech encoder (two convolutions over 16 mel bins of 32 frames, then attention) and a text
    decoder trained on 8 label tokens."""
    config = WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=16,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=16,
        max_target_positions=32,
        decoder_start_token_id=0,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=1,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )
    features = torch.randn(BATCH, 16, 32)
    labels = torch.randint(2, VOCAB, (BATCH, 8))
    return WhisperForConditionalGeneration(config), {"input_features": features, "labels": labels}
