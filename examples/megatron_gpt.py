"""GPT as Megatron-LM trains it, with the ten models of its weak-scaling table.

The model is plain PyTorch: learned token and position embeddings, pre-LN blocks of causal self-attention (one
fused QKV projection, split into heads with view/transpose, the s x s scores materialised and soft-maxed by
Megatron's fused scale-mask-softmax kernel, as Megatron-LM's 2021 `CoreAttention` does: no flash-attention
kernel existed then, and the table's runs paid for the scores) and a 4h GELU MLP, a final layer norm, an LM
head tied to the token embedding, and cross-entropy. Vocabulary 51,200 and sequence 2,048, as in the paper;
dropout 0.1 after the embeddings, on the attention probabilities and after each block's two residual branches,
as Megatron-LM's defaults (which the paper's runs kept) have it.

`ROWS` is Table 1 of Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" (SC'21): each model's shape, the tensor- and pipeline-parallel sizes, GPUs, global
batch and the measured TFLOP/s per GPU. `eq3_flops` is the paper's Eq. 3, the FLOPs it counts per
iteration (with activation recomputation), and `tflops_per_gpu` turns an iteration time into its figure.

One factory per row, for the meta device (the big rows have hundreds of billions of parameters):

    dapple dump examples/megatron_gpt.py:factory_1_7b
    dapple compile examples/megatron_gpt.py:factory_39_1b --cluster 64x8xA100-80GB --global-batch 1536 \\
        --precision fp16 --recompute all --stages 2 -o plans/39b

`factory(name)` picks a row by its name ("1.7B", ..., "1008B"); `factory_tiny()` is a 2-layer model
small enough to train on a CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 51_200
SEQ = 2_048
#: Megatron-LM's default hidden and attention dropout, which the SC'21 runs did not change.
MEGATRON_DROPOUT = 0.1


@dataclass(frozen=True)
class MegatronRow:
    """One row of the paper's Table 1: a model, Megatron's configuration for it, and its measurement."""

    name: str
    """Parameters as the paper names them ("1.7B", ..., "1008B")."""
    heads: int
    hidden: int
    layers: int
    tensor: int
    """Tensor-parallel size."""
    pipeline: int
    """Pipeline-parallel size (stages)."""
    gpus: int
    batch: int
    """Global batch (sequences per iteration)."""
    tflops: float
    """Measured TFLOP/s per GPU (Eq. 3's FLOPs over iteration time and GPUs)."""

    @property
    def data(self) -> int:
        """Data-parallel size: the GPUs over one model replica's."""
        return self.gpus // (self.tensor * self.pipeline)

    @property
    def cluster(self) -> str:
        """The DGX A100 80 GB cluster shorthand: nodes of 8 GPUs."""
        return f"{self.gpus // 8}x8xA100-80GB"

    @property
    def factory_name(self) -> str:
        """`factory_1_7b`, ..., `factory_1008b`."""
        return "factory_" + self.name.lower().replace(".", "_")


#: Narayanan et al., SC'21, Table 1 (weak scaling on DGX A100 80 GB nodes).
ROWS: tuple[MegatronRow, ...] = (
    MegatronRow("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    MegatronRow("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    MegatronRow("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    MegatronRow("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    MegatronRow("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    MegatronRow("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    MegatronRow("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    MegatronRow("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    MegatronRow("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    MegatronRow("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def row(name: str) -> MegatronRow:
    """The row named `name` ("1.7B", "1008B"; case-insensitive)."""
    for r in ROWS:
        if r.name.lower() == name.lower():
            return r
    raise KeyError(f"no Megatron row named {name!r}; the rows are {', '.join(r.name for r in ROWS)}")


def eq3_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """The paper's Eq. 3: FLOPs of one iteration with full activation recomputation,
    F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h))."""
    return 96.0 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def tflops_per_gpu(r: MegatronRow, iteration_s: float, gpus: int | None = None) -> float:
    """TFLOP/s per GPU as the paper reports it: Eq. 3's FLOPs over the iteration time and the GPUs."""
    flops = eq3_flops(r.batch, SEQ, r.layers, r.hidden, VOCAB)
    return flops / (iteration_s * (gpus or r.gpus)) / 1e12


def param_count(r: MegatronRow, vocab: int = VOCAB, seq: int = SEQ) -> int:
    """Trainable parameters of this module in closed form (biases and layer norms included, head tied)."""
    h = r.hidden
    per_block = 12 * h * h + 13 * h  # ln1, qkv, proj, ln2, fc (4h), fc_out
    return vocab * h + seq * h + r.layers * per_block + 2 * h


@dataclass(frozen=True)
class GPTShape:
    """What the module is built from."""

    vocab: int
    seq: int
    hidden: int
    layers: int
    heads: int
    dropout: float = 0.0
    """Megatron's `--hidden-dropout` and `--attention-dropout` (0.1 by default, which Table 1's runs keep)."""


def _define_scale_mask_softmax() -> None:
    """`torch.ops.megatron_gpt.scale_mask_softmax(scores, mask, dim)`: softmax along `dim` of the scores with the
    `mask`ed ones left out, computed in fp32 and returned in the scores' dtype: what Megatron-LM's fused CUDA
    kernel (`FusedScaleMaskSoftmax`, the scaling folded into the query here) computes, as one op, so that it is
    priced as that one kernel (its input read and its output written once) and autocast leaves its dtype alone,
    as it does Megatron's. Its reference implementation runs on any device; its backward is softmax's, from the
    probabilities it saves. Defined once per process (a second import of this file reuses it)."""
    if hasattr(torch.ops.megatron_gpt, "scale_mask_softmax"):
        return

    @torch.library.custom_op("megatron_gpt::scale_mask_softmax", mutates_args=())
    def scale_mask_softmax(scores: torch.Tensor, mask: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.softmax(scores.float().masked_fill(mask, float("-inf")), dim=dim).to(scores.dtype)

    @scale_mask_softmax.register_fake
    def _(scores: torch.Tensor, mask: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.empty_like(scores)

    def setup(ctx: object, inputs: tuple[torch.Tensor, torch.Tensor, int], output: torch.Tensor) -> None:
        ctx.save_for_backward(output)  # type: ignore[attr-defined]
        ctx.dim = inputs[2]  # type: ignore[attr-defined]

    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (probs,) = ctx.saved_tensors  # type: ignore[attr-defined]
        p, g = probs.float(), grad.float()
        return (p * (g - (g * p).sum(ctx.dim, keepdim=True))).to(grad.dtype), None, None  # type: ignore[attr-defined]

    scale_mask_softmax.register_autograd(backward, setup_context=setup)


_define_scale_mask_softmax()


class CausalSelfAttention(nn.Module):
    def __init__(self, s: GPTShape) -> None:
        super().__init__()
        self.heads = s.heads
        self.scale = 1.0 / math.sqrt(s.hidden // s.heads)
        self.qkv = nn.Linear(s.hidden, 3 * s.hidden)
        self.proj = nn.Linear(s.hidden, s.hidden)
        self.attn_drop = nn.Dropout(s.dropout)
        self.drop = nn.Dropout(s.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        d = h // self.heads
        q, k, v = self.qkv(x).split(h, dim=2)
        # (b, t, h) -> (b, heads, t, h / heads): the split a tensor-parallel shard cuts by heads.
        q = q.view(b, t, self.heads, d).transpose(1, 2)
        k = k.view(b, t, self.heads, d).transpose(1, 2)
        v = v.view(b, t, self.heads, d).transpose(1, 2)
        # Attention as Megatron-LM ran it in 2021 (its `CoreAttention`, no flash kernel): the scores materialised,
        # masked and soft-maxed by one fused kernel (`scale_mask_softmax`), dropout on the probabilities, then
        # their product with the values.
        scores = (q * self.scale) @ k.transpose(-2, -1)
        causal = torch.ones((t, t), dtype=torch.bool, device=x.device).triu(1)
        y = self.attn_drop(torch.ops.megatron_gpt.scale_mask_softmax(scores, causal, -1)) @ v
        return self.drop(self.proj(y.transpose(1, 2).reshape(b, t, h)))


class Block(nn.Module):
    def __init__(self, s: GPTShape) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(s.hidden)
        self.attn = CausalSelfAttention(s)
        self.ln2 = nn.LayerNorm(s.hidden)
        self.mlp = nn.Sequential(
            nn.Linear(s.hidden, 4 * s.hidden), nn.GELU(), nn.Linear(4 * s.hidden, s.hidden), nn.Dropout(s.dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class MegatronGPT(nn.Module):
    def __init__(self, s: GPTShape) -> None:
        super().__init__()
        self.tok = nn.Embedding(s.vocab, s.hidden)
        self.pos = nn.Embedding(s.seq, s.hidden)
        self.drop = nn.Dropout(s.dropout)
        self.blocks = nn.ModuleList([Block(s) for _ in range(s.layers)])
        self.ln_f = nn.LayerNorm(s.hidden)
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        h = self.drop(self.tok(idx) + self.pos(positions))
        for block in self.blocks:
            h = block(h)
        # Megatron ties the output layer to the word embedding: one parameter read in two places.
        return F.linear(self.ln_f(h), self.tok.weight)


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


Factory = tuple[nn.Module, tuple[torch.Tensor], object, tuple[torch.Tensor]]


def build(s: GPTShape, batch: int = 1) -> Factory:
    """The model, an example batch of `batch` sequences, the loss and its targets."""
    idx = torch.randint(0, s.vocab, (batch, s.seq))
    targets = torch.randint(0, s.vocab, (batch, s.seq))
    return MegatronGPT(s), (idx,), gpt_loss, (targets,)


def factory(name: str = "1.7B", batch: int = 1) -> Factory:
    """The model of the row named `name`, vocabulary 51,200 and sequence 2,048, on an example of `batch`."""
    r = row(name)
    return build(GPTShape(VOCAB, SEQ, r.hidden, r.layers, r.heads, MEGATRON_DROPOUT), batch)


def factory_tiny() -> Factory:
    """Two layers, hidden 64, 4 heads, vocabulary 256, sequence 32, no dropout: trains on a CPU, exactly."""
    return build(GPTShape(256, 32, 64, 2, 4), batch=4)


def factory_1_7b() -> Factory:
    return factory("1.7B")


def factory_3_6b() -> Factory:
    return factory("3.6B")


def factory_7_5b() -> Factory:
    return factory("7.5B")


def factory_18_4b() -> Factory:
    return factory("18.4B")


def factory_39_1b() -> Factory:
    return factory("39.1B")


def factory_76_1b() -> Factory:
    return factory("76.1B")


def factory_145_6b() -> Factory:
    return factory("145.6B")


def factory_310_1b() -> Factory:
    return factory("310.1B")


def factory_529_6b() -> Factory:
    return factory("529.6B")


def factory_1008b() -> Factory:
    return factory("1008B")
