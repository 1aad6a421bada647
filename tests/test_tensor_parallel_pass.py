"""The `tensor-parallel` pass on real captures (GPT by fx and by export, a transformers Llama with grouped-query
attention, an MLP, a CNN) and what `analysis.tensor_shards` and the verifier read from its marks."""

from __future__ import annotations

import re
import time
from collections import Counter
from functools import cache
from pathlib import Path

import pytest

from dapple_ir.analysis.tensor_shards import (
    backward_reduces,
    crosses_split,
    degrees,
    forward_reduces,
    sharded_ops,
    split_params,
    tp_ok,
)
from dapple_ir.errors import VerifyError
from dapple_ir.ir import Module, Op, OpKind, Param, Stage, StageAttrs, TensorType
from dapple_ir.ir.parser import parse_module
from dapple_ir.ir.printer import print_module
from dapple_ir.ir.verifier import verify_module
from dapple_ir.passes.tensor_parallel import TensorParallel
from dapple_ir.registry import PassContext
from tests.paths import ROOT


@cache
def _captured(spec: str, method: str) -> str:
    from dapple_ir.frontend.model_spec import FactoryResult, capture_loaded, load_model_spec

    loaded = load_model_spec(str(ROOT / spec), device="meta")
    assert isinstance(loaded, FactoryResult)
    module = capture_loaded(loaded, method=method, annotate_costs=False).module
    return print_module(module)


def _marked(spec: str, method: str = "auto") -> Module:
    """A fresh copy of the capture, with the pass applied."""
    module = parse_module(_captured(spec, method))
    TensorParallel().apply(PassContext(), module)
    return module


def _roles(module: Module) -> dict[str, tuple[str, int | None]]:
    """Role and result parts of every marked linear, by the module path it was traced in."""
    return {str(op.attrs.module_path): (op.attrs.tp_role, op.attrs.tp_parts) for op in module.ops if op.attrs.tp_role}


def _per_block(ops: list[Op]) -> Counter[str]:
    """How many of `ops` each block holds (`blocks.3`, `model.layers.1`)."""
    return Counter(re.sub(r"(\.\d+)\..*", r"\1", str(op.attrs.module_path)) for op in ops)


GPT = "examples/gpt.py:factory"
LLAMA = "examples/llama.py:factory"


@pytest.mark.parametrize("method", ["fx", "export"])
def test_gpt_has_a_fused_qkv_column_in_three_parts_and_row_projections(method: str) -> None:
    module = _marked(GPT, method)
    roles = _roles(module)
    for i in range(4):
        assert roles[f"blocks.{i}.attn.qkv"] == ("col", 3)
        assert roles[f"blocks.{i}.attn.proj"] == ("row", None)
        assert roles[f"blocks.{i}.mlp.0"] == ("col", None)
        assert roles[f"blocks.{i}.mlp.2"] == ("row", None)
    # The vocabulary too: the token embedding, the LM head tied to it (traced outside any module) and the loss.
    assert roles["tok"] == ("vocab", None) and roles["loss_fn"] == ("loss", None)
    assert roles["None"] == ("col", None)
    assert len(roles) == 19
    params = {p.name: (p.attrs.tp_dim, p.attrs.tp_parts) for p in module.params}
    assert params["blocks.0.attn.qkv.weight"] == params["blocks.0.attn.qkv.bias"] == (0, 3)
    assert params["blocks.0.attn.proj.weight"] == (1, None)
    assert params["blocks.0.attn.proj.bias"] == params["pos.weight"] == (None, None)
    assert params["tok.weight"] == (0, None), "the tied weight splits on its rows, for both its readers"
    assert params["blocks.0.mlp.0.bias"] == (0, None) and params["blocks.0.mlp.2.weight"] == (1, None)
    attention = [op for op in module.ops if "scaled_dot_product_attention" in str(op.target)]
    assert [op.attrs.tp_dim for op in attention] == [1] * 4, "attention splits its heads"
    if method == "export":
        reads = [op for op in module.ops if op.kind is OpKind.GET_ATTR and op.target == "blocks.0.attn.qkv.weight"]
        assert [(op.attrs.tp_dim, op.attrs.tp_parts) for op in reads] == [(0, 3)]


@pytest.mark.parametrize("spec", [GPT, LLAMA])
def test_each_block_needs_two_forward_and_two_backward_reduces(spec: str) -> None:
    module = _marked(spec)
    forward, backward = forward_reduces(module.ops), backward_reduces(module.ops)
    # Outside the blocks: the embedding's sum of rows and the loss's; the LM head's input gradient.
    vocab = [op for op in forward if op.attrs.tp_role in ("vocab", "loss")]
    assert sorted(str(op.attrs.tp_role) for op in vocab) == ["loss", "vocab"]
    forward = [op for op in forward if op not in vocab]
    blocks = set(_per_block(forward))
    assert len(blocks) >= 2
    assert _per_block(forward) == dict.fromkeys(blocks, 2)
    # A column-parallel op's whole input is a layer norm's output, traced in the block too.
    assert len(backward) == len(forward) + 1
    assert all(isinstance(op.type, TensorType) for op in backward)


def test_llama_splits_query_key_value_gate_and_up_by_columns() -> None:
    module = _marked(LLAMA)
    roles = _roles(module)
    for i in range(2):
        prefix = f"model.layers.{i}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert roles[f"{prefix}.{name}"] == ("col", None), name
        assert roles[f"{prefix}.self_attn.o_proj"] == roles[f"{prefix}.mlp.down_proj"] == ("row", None)
    assert len(roles) == 17, "and the untied embedding, LM head and loss split the vocabulary"
    # q, k and v read one whole value, as gate and up do: one backward reduce for each group.
    assert len(backward_reduces(module.ops)) == 5, "and the LM head's input"
    heads = sorted({_shape(op)[2] for op in module.ops if op.attrs.tp_dim == 2 and len(_shape(op)) == 4})
    assert heads == [2, 4], "the views split 4 query heads and 2 key/value heads"


def _shape(op: Op) -> tuple[int, ...]:
    return op.type.shape if isinstance(op.type, TensorType) else ()


def test_bert_splits_its_self_attention_feed_forward_and_vocabulary_and_keeps_the_mlm_transform_whole() -> None:
    roles = _roles(_marked("tests/hf_zoo.py:bert"))
    for i in range(2):
        prefix = f"bert.encoder.layer.{i}"
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense"):
            assert roles[f"{prefix}.{name}"] == ("col", None), name
        assert roles[f"{prefix}.attention.output.dense"] == roles[f"{prefix}.output.dense"] == ("row", None)
    # The MLM head's dense and layer norm stay whole; its decoder (tied to the word embeddings) splits the
    # vocabulary with them and the loss. Token types (2) and positions (computed indices) stay whole.
    assert roles["bert.embeddings.word_embeddings"] == ("vocab", None)
    assert roles["cls.predictions.decoder"] == ("col", None) and roles["None"] == ("loss", None)
    assert len(roles) == 15


def test_degrees_follow_the_heads_and_a_failure_names_the_op() -> None:
    llama = _marked(LLAMA)
    assert degrees(llama, llama.ops, (1, 2, 3, 4, 8)) == (1, 2), "2 key/value heads allow T = 2 at most"
    reason = tp_ok(llama, llama.ops, 4)
    assert reason is not None and "%view_1" in reason and "T = 4" in reason, reason
    gpt = _marked(GPT)
    reason = tp_ok(gpt, gpt.ops, 3)
    assert reason is not None and "%blocks_0_attn_qkv" in reason and "3 parts of 32" in reason, reason
    assert tp_ok(gpt, gpt.ops, 4) is None and tp_ok(gpt, gpt.ops, 8) is not None


def test_mlp_pairs_alternate_column_and_row() -> None:
    module = _marked("examples/mlp.py:factory")
    roles = [op.attrs.tp_role for op in module.ops if op.attrs.tp_role]
    assert roles == ["col", "row", "col", "row"]
    split = {p.name: p.attrs.tp_dim for p in split_params(module, module.ops)}
    assert split == {"0.weight": 0, "0.bias": 0, "2.weight": 1, "4.weight": 0, "4.bias": 0, "6.weight": 1}


def test_a_model_without_the_pattern_gets_no_marks() -> None:
    module = _marked("examples/cnn.py:factory")
    assert not sharded_ops(module.ops)
    assert all(p.attrs.tp_dim is None for p in module.params)
    assert tp_ok(module, module.ops, 8) is None


def test_the_marks_print_parse_and_print_alike_and_the_pass_is_idempotent() -> None:
    for spec in (GPT, LLAMA):
        module = _marked(spec)
        text = print_module(module)
        assert print_module(parse_module(text)) == text
        TensorParallel().apply(PassContext(), module)
        assert print_module(module) == text


def test_tensor_allreduce_instructions_round_trip() -> None:
    text = (ROOT / "tests" / "golden" / "tensor_parallel" / "mlp.out.dapple").read_text()
    program = """
  program @rank{r} {{rank = {r}, device = {r}, tensor_rank = {r}, stages = [@s0]}} {{
    forward @s0 mb = 0
    tensor_allreduce %h2 mb = 0 group = [0, 1]
    backward @s0 mb = 0
    tensor_allreduce grad %x mb = 0 group = [0, 1]
  }}
"""
    names = ", ".join(re.findall(r"^  (%\w+) =", text, flags=re.M))
    stage = f"\n  stage @s0 [{names}] {{replicas = 1, devices = [0, 1], tp = 2}}\n"
    planned = text.removesuffix("}\n") + stage + program.format(r=0) + program.format(r=1).lstrip("\n") + "}\n"
    module = parse_module(planned)
    assert print_module(module) == planned
    verify_module(module)


def _staged(cut_after: str, tp: int) -> Module:
    """The golden MLP, marked, in two stages cut after `cut_after`, the first on a tensor group of `tp`."""
    module = parse_module((ROOT / "tests" / "golden" / "tensor_parallel" / "mlp.out.dapple").read_text())
    at = next(i for i, op in enumerate(module.ops) if op.name == cut_after) + 1
    module.stages = [
        Stage("s0", module.ops[:at], StageAttrs(devices=tuple(range(tp)), tp=tp)),
        Stage("s1", module.ops[at:], StageAttrs(devices=(tp,))),
    ]
    return module


def test_the_verifier_checks_degrees_and_cuts_of_tensor_parallel_stages() -> None:
    verify_module(_staged("h3", 2))
    with pytest.raises(VerifyError, match=r"stage @s0 .*tp = 2.*split %h0 is read by %h1 in another stage"):
        verify_module(_staged("h0", 2))
    with pytest.raises(VerifyError, match=r"op %h0 splits dimension 1 of \[8, 64\].*T = 3"):
        verify_module(_staged("h3", 3))
    crossing = _staged("h1", 1)
    assert crosses_split([crossing.ops[3]]) is crossing.ops[3]  # %h1 crosses the cut
    crossing.stages[1].attrs.tp, crossing.stages[1].attrs.devices = 2, (1, 2)
    with pytest.raises(VerifyError, match=r"row-parallel op %h2 reads split %h1 from another stage"):
        verify_module(crossing)


def test_seventy_billion_sized_graphs_are_marked_in_well_under_two_seconds() -> None:
    module = _tower(blocks=2500, width=64)  # 10,000 linears and activations
    started = time.perf_counter()
    TensorParallel().apply(PassContext(), module)
    assert time.perf_counter() - started < 2.0
    assert len(forward_reduces(module.ops)) == 2500


def _tower(blocks: int, width: int) -> Module:
    """An MLP of `blocks` Linear-GELU-Linear-add blocks, built directly in the IR."""
    module = Module("tower")
    x = Op("x", OpKind.INPUT, [], TensorType("f32", (4, width)))
    module.ops.append(x)
    h = x
    for b in range(blocks):
        for name, shape in ((f"b{b}.up", (4 * width, width)), (f"b{b}.down", (width, 4 * width))):
            module.params.append(Param(f"{name}.weight", TensorType("f32", shape)))
        up = _call(f"b{b}.up", [h], 4 * width, module)
        act = Op(f"act{b}", OpKind.CALL_FUNCTION, [up], up.type, "torch.nn.functional.gelu")
        module.ops.append(act)
        down = _call(f"b{b}.down", [act], width, module)
        h = Op(f"res{b}", OpKind.CALL_FUNCTION, [h, down], h.type, "operator.add")
        module.ops.append(h)
    loss = Op("loss", OpKind.CALL_METHOD, [h], TensorType("f32", ()), "sum")
    module.ops += [loss, Op("output", OpKind.OUTPUT, [loss], loss.type)]
    return module


def _call(path: str, operands: list[Op], width: int, module: Module) -> Op:
    op = Op(path.replace(".", "_"), OpKind.CALL_MODULE, operands, TensorType("f32", (4, width)), path)
    op.attrs.params = (f"{path}.weight",)
    module.ops.append(op)
    return op


_BETWEEN = """module @m {{
  param @fc.weight : f32[16,8]
  param @out.weight : f32[8,16]

  %x = input : f32[4,8] {{index = 0}}
  %fc = call_module @fc(%x) : f32[4,16] {{params = [@fc.weight]}}
{between}
  %out = call_module @out(%back) : f32[4,8] {{params = [@out.weight]}}
  %loss = call_method @sum(%out) : f32[]
  %output = output(%loss) : f32[]
}}
"""


@pytest.mark.parametrize(
    ("between", "kept"),
    [
        # Features into (heads, head dim) and back: the heads carry the split.
        ("  %v = call_method @view(%fc) : f32[4,2,8]\n  %back = call_method @reshape(%v) : f32[4,16]", True),
        # A transpose whose shapes do not tell which dimensions it swapped.
        (
            "  %v = call_method @view(%fc) : f32[4,4,4]\n  %back0 = call_method @transpose(%v) : f32[4,4,4]\n"
            "  %back = call_method @reshape(%back0) : f32[4,16]",
            False,
        ),
        # Heads moved inward before the features are put back together: each member's piece is not contiguous.
        (
            "  %v = call_method @view(%fc) : f32[4,2,8]\n  %t = call_method @transpose(%v) : f32[4,8,2]\n"
            "  %back = call_method @reshape(%t) : f32[4,16]",
            False,
        ),
        # Halves of the split features concatenated back: slices and cat along the split dimension.
        (
            "  %a = call_function @aten.slice.Tensor(%fc) : f32[4,8]\n"
            "  %back = call_function @aten.cat.default(%a, %a) : f32[4,16]",
            False,
        ),
        # A whole value added across the split features.
        ("  %bias = input : f32[16] {index = 1}\n  %back = call_function @operator.add(%fc, %bias) : f32[4,16]", False),
        # A whole value broadcast along them (size 1 there).
        ("  %s = input : f32[4,1] {index = 1}\n  %back = call_function @operator.mul(%fc, %s) : f32[4,16]", True),
    ],
    ids=["heads", "ambiguous-transpose", "heads-inward", "cat-split-dim", "whole-across", "whole-broadcast"],
)
def test_the_rules_keep_a_split_only_where_the_shapes_prove_it_stays_contiguous(between: str, kept: bool) -> None:
    module = parse_module(_BETWEEN.format(between=between))
    TensorParallel().apply(PassContext(), module)
    roles = [op.attrs.tp_role for op in module.ops if op.attrs.tp_role]
    assert roles == (["col", "row"] if kept else [])


# ------------------------------------------------------------------------------ the vocabulary


def _gpt_spec(tmp_path: Path, vocab: int, loss: str = "gpt_loss") -> str:
    """The GPT example with another vocabulary (and loss), as a spec file of its own."""
    spec = tmp_path / f"gpt_vocab_{vocab}.py"
    spec.write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n"
        "import torch.nn.functional as F\n"
        "from examples.gpt import GPTConfig, GPT, gpt_loss\n"
        "import torch\n\n\n"
        "def scaled_loss(logits, targets):\n"
        "    # The split logits' width used as a number, not as a view's size: a member's would be wrong.\n"
        "    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)) * logits.shape[-1]\n\n\n"
        "def factory():\n"
        f"    cfg = GPTConfig(vocab={vocab})\n"
        "    idx = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))\n"
        f"    return GPT(cfg), (idx,), {loss}, (torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq)),)\n"
    )
    return str(spec) + ":factory"


def test_a_vocabulary_no_degree_divides_stays_whole_and_the_blocks_still_split(tmp_path: Path) -> None:
    module = _marked(_gpt_spec(tmp_path, 100), "fx")
    roles = _roles(module)
    assert not {"vocab", "loss"} & {role for role, _ in roles.values()} and "None" not in roles
    assert {p.name: p.attrs.tp_dim for p in module.params}["tok.weight"] is None
    example = _marked(GPT, "fx")
    assert degrees(module, list(module.ops)) == degrees(example, list(example.ops)) == (1, 2, 4)


def test_a_split_width_read_as_a_number_keeps_the_head_and_its_tied_embedding_whole(tmp_path: Path) -> None:
    module = _marked(_gpt_spec(tmp_path, 96, "scaled_loss"), "fx")
    roles = _roles(module)
    assert not {"vocab", "loss"} & {role for role, _ in roles.values()}
    assert {p.name: p.attrs.tp_dim for p in module.params}["tok.weight"] is None
    assert roles["blocks.0.attn.proj"] == ("row", None), "the blocks' patterns do not depend on the head's"
