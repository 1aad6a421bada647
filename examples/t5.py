"""An encoder-decoder from Hugging Face `transformers`: a tiny T5 built from a `T5Config` in code
(random weights, nothing downloaded). Called with `input_ids` and `labels`, T5 makes its decoder
inputs by shifting the labels right and returns a dict whose `"loss"` is the cross-entropy of the
labels, so the factory gives no loss function. The encoder's output feeds every decoder block (the
cross-attention), so a pipeline cut inside the decoder also sends the encoder's states.

    dapple compile examples/t5.py:factory --cluster 2xcpu --global-batch 8 --stages 2 --microbatches 4 -o plans/t5
    dapple run plans/t5 --steps 2 --check
"""

from __future__ import annotations

import torch
from transformers import T5Config, T5ForConditionalGeneration


def tiny_config() -> T5Config:
    """2 encoder and 2 decoder blocks, d_model 64, 4 heads of 16, vocabulary 128; the library's
    defaults otherwise (dropout 0.1, relative position buckets, tied input and output embeddings).
    The decoder starts from token 0, T5's padding token, as T5's own checkpoints say: transformers 5
    leaves `decoder_start_token_id` unset, and shifting the labels right needs it."""
    return T5Config(
        vocab_size=128,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
    )


def build(config: T5Config, *, source: int, target: int, batch: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The model and its keyword inputs: a source sequence and the target labels (ids from 1: 0 is
    T5's padding and decoder start token)."""
    model = T5ForConditionalGeneration(config)
    inputs = {
        "input_ids": torch.randint(1, config.vocab_size, (batch, source)),
        "labels": torch.randint(1, config.vocab_size, (batch, target)),
    }
    return model, inputs


def factory() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    return build(tiny_config(), source=16, target=8, batch=4)
