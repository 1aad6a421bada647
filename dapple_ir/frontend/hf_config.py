"""The model an `hf:` spec names: a Hugging Face config file built with `AutoModelFor...from_config`.

The task head is the config's first `architectures` entry (`LlamaForCausalLM`): the `AutoModelFor...`
whose mapping gives that class for the config builds it, with random weights (nothing downloaded). A
config without `architectures` (`LlamaConfig().to_json_file(...)` writes none) gets the first head of
the table below that its model type has.
The example inputs follow the head, each with the labels that make the model return its loss:

| head | inputs |
| --- | --- |
| causal LM, masked LM | `input_ids` (batch, seq) and `labels` (the causal model shifts them) |
| sequence-to-sequence LM | `input_ids` (batch, seq) and `labels` (batch, seq): the decoder's inputs come from them |
| sequence or token classification | `input_ids` and a class per sample (per token) |
| image classification | `pixel_values` (batch, channels, image size, image size) and a class per sample |

Any other head needs a factory (README, "Bringing a Hugging Face model").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from dapple_ir.errors import CaptureError
from dapple_ir.frontend.hf_spec import HFSpec

__all__ = ["build_from_config"]

Inputs = dict[str, torch.Tensor]


def _ids(config: Any, spec: HFSpec) -> torch.Tensor:
    return torch.randint(0, int(config.vocab_size), (spec.batch, spec.seq))


def _language_model(config: Any, spec: HFSpec) -> Inputs:
    ids = _ids(config, spec)
    return {"input_ids": ids, "labels": ids.clone()}


def _seq2seq(config: Any, spec: HFSpec) -> Inputs:
    return {"input_ids": _ids(config, spec), "labels": _ids(config, spec)}


def _sequence_classes(config: Any, spec: HFSpec) -> Inputs:
    return {"input_ids": _ids(config, spec), "labels": torch.randint(0, int(config.num_labels), (spec.batch,))}


def _token_classes(config: Any, spec: HFSpec) -> Inputs:
    labels = torch.randint(0, int(config.num_labels), (spec.batch, spec.seq))
    return {"input_ids": _ids(config, spec), "labels": labels}


def _image_classes(config: Any, spec: HFSpec) -> Inputs:
    size = int(config.image_size)
    pixels = torch.randn(spec.batch, int(getattr(config, "num_channels", 3)), size, size)
    return {"pixel_values": pixels, "labels": torch.randint(0, int(config.num_labels), (spec.batch,))}


#: The Auto classes `hf:` builds, most common first, with the example inputs of their head.
_HEADS: tuple[tuple[str, Callable[[Any, HFSpec], Inputs]], ...] = (
    ("AutoModelForCausalLM", _language_model),
    ("AutoModelForSeq2SeqLM", _seq2seq),
    ("AutoModelForMaskedLM", _language_model),
    ("AutoModelForSequenceClassification", _sequence_classes),
    ("AutoModelForTokenClassification", _token_classes),
    ("AutoModelForImageClassification", _image_classes),
)


def _config(spec: HFSpec, text: str) -> Any:
    from transformers import CONFIG_MAPPING

    if not spec.config.is_file():
        raise CaptureError(f"model spec {text}: config file {spec.config} does not exist")
    try:
        data = json.loads(spec.config.read_text())
    except (OSError, ValueError) as exc:
        raise CaptureError(f"model spec {text}: {spec.config} is not a JSON config ({exc})") from exc
    model_type = str(data.get("model_type")) if isinstance(data, dict) else ""
    if model_type not in CONFIG_MAPPING:
        raise CaptureError(
            f"model spec {text}: {spec.config} has model_type {model_type!r}, which this transformers does not know; "
            "a config.json written by a transformers config's to_json_file names it"
        )
    return CONFIG_MAPPING[model_type].from_json_file(str(spec.config))


def _mapped(auto: Any, config: Any) -> set[str]:
    """Names of the model classes `auto` builds for `config`'s type (none when it builds none)."""
    try:
        built = auto._model_mapping[type(config)]
    except KeyError:
        return set()
    return {c.__name__ for c in (built if isinstance(built, tuple | list) else (built,))}


def _head(config: Any, text: str) -> tuple[Any, Callable[[Any, HFSpec], Inputs]]:
    """The Auto class that builds the config's first architecture (without one: the first head of `_HEADS` that
    builds the config's type), and its example inputs."""
    import transformers

    architectures = list(getattr(config, "architectures", None) or [])
    for auto_name, inputs in _HEADS:
        auto = getattr(transformers, auto_name)
        names = _mapped(auto, config)
        if names and (not architectures or architectures[0] in names):
            return auto, inputs
    heads = ", ".join(name.removeprefix("AutoModelFor") for name, _ in _HEADS)
    wanted = f"architecture {architectures[0]}" if architectures else f"model type {config.model_type}"
    raise CaptureError(
        f"model spec {text}: {wanted} has none of the heads hf: builds ({heads}); write a factory that "
        "builds it and returns its inputs with labels (README, 'Bringing a Hugging Face model')"
    )


def build_from_config(spec: HFSpec, text: str) -> tuple[torch.nn.Module, Inputs]:
    """(model, keyword example inputs with labels) of `spec`, on the current default device."""
    config = _config(spec, text)
    auto, inputs = _head(config, text)
    return auto.from_config(config), inputs(config, spec)
