"""`hf:path/to/config.json`: a Hugging Face config file as a model spec, its text only (no torch).

The spec a plan records must rebuild the same model in every process that loads it, so the example
input's sequence length and batch are part of it: `hf:/abs/config.json?seq=2048&batch=4`.
`dapple compile hf:config.json --seq 2048 --example-batch 4` writes that form (`with_shape`);
`hf_config` builds the model from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlencode

from dapple_ir.errors import CaptureError

__all__ = ["DEFAULT_BATCH", "DEFAULT_SEQ", "PREFIX", "HFSpec", "is_hf_spec", "parse_hf_spec", "with_shape"]

PREFIX = "hf:"

#: The example input's sequence length and batch when the spec names none.
DEFAULT_SEQ, DEFAULT_BATCH = 128, 4


@dataclass(frozen=True)
class HFSpec:
    """What an `hf:` spec says."""

    config: Path
    """The config.json."""
    seq: int
    """Sequence length of the example input (image models ignore it: their config fixes the image size)."""
    batch: int
    """Samples in the example input."""


def is_hf_spec(spec: str) -> bool:
    return spec.startswith(PREFIX)


def _positive(spec: str, key: str, text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise CaptureError(f"model spec {spec}: {key}={text!r} must be a positive whole number")
    return int(text)


def parse_hf_spec(spec: str) -> HFSpec:
    """The config path, sequence length and batch of `hf:PATH[?seq=N&batch=B]`."""
    path, _, query = spec.removeprefix(PREFIX).partition("?")
    if not path:
        raise CaptureError(f"model spec {spec!r}: name a config file, as in hf:path/to/config.json")
    options = dict(parse_qsl(query, keep_blank_values=True))
    unknown = sorted(set(options) - {"seq", "batch"})
    if unknown:
        raise CaptureError(f"model spec {spec}: unknown option(s) {', '.join(unknown)}; hf: takes seq and batch")
    seq = _positive(spec, "seq", options["seq"]) if "seq" in options else DEFAULT_SEQ
    batch = _positive(spec, "batch", options["batch"]) if "batch" in options else DEFAULT_BATCH
    return HFSpec(Path(path), seq, batch)


def with_shape(spec: str, seq: int | None, batch: int | None) -> str:
    """`spec` with an absolute config path and the example shape written out (flags over the spec's own)."""
    parsed = parse_hf_spec(spec)
    shape = {"seq": seq or parsed.seq, "batch": batch or parsed.batch}
    for key, value in shape.items():
        _positive(spec, key, str(value))
    return f"{PREFIX}{parsed.config.resolve()}?{urlencode(shape)}"
