"""Capture of the example models: IR that verifies and round-trips, and a graph that computes what
the model computes (checked against the model itself, run directly on CPU with the same weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dapple_ir.frontend.capture import Captured, capture
from dapple_ir.frontend.dtypes import IR_DTYPE_OF, TORCH_DTYPE_OF
from dapple_ir.frontend.model_spec import FactoryResult, capture_loaded, load_model_spec
from dapple_ir.ir import DTYPE_BYTES, FLOAT_DTYPES, OpKind, TensorType
from dapple_ir.ir.parser import parse_module
from dapple_ir.ir.printer import print_module
from dapple_ir.ir.structure import structure_hash
from dapple_ir.ir.verifier import verify_module

ROOT = Path(__file__).resolve().parent.parent
CASES = [
    ("mlp", "fx"),
    ("mlp", "export"),
    ("gpt", "fx"),
    ("gpt", "export"),
    ("cnn", "fx"),
    ("cnn", "export"),
    ("kwargs_dict", "fx"),
    ("kwargs_dict", "export"),
    ("control_flow", "export"),
]


def _load(example: str, seed: int = 0) -> FactoryResult:
    loaded = load_model_spec(str(ROOT / "examples" / f"{example}.py") + ":factory", device="cpu", seed=seed)
    assert isinstance(loaded, FactoryResult)
    return loaded


_CACHE: dict[tuple[str, str], Captured] = {}


def _captured(example: str, method: str) -> Captured:
    # Costs (dapple_ir.frontend.flops) are tested on their own; one example keeps them to see they print and parse.
    if (example, method) not in _CACHE:
        costs = (example, method) == ("gpt", "fx")
        _CACHE[example, method] = capture_loaded(_load(example), method=method, annotate_costs=costs)
    return _CACHE[example, method]


def _reference_loss(loaded: FactoryResult, rows: slice = slice(None)) -> torch.Tensor:
    """The loss computed the way a user would: the model called directly, then its loss function."""
    kwargs = {k: v[rows] for k, v in (loaded.example_kwargs or {}).items()}
    out = loaded.model(*(x[rows] for x in loaded.example_inputs), **kwargs)
    if loaded.loss_fn is None:
        return out["loss"] if isinstance(out, dict) else out
    return loaded.loss_fn(out, *(t[rows] for t in loaded.example_targets))


@pytest.mark.parametrize(("example", "method"), CASES)
def test_ir_verifies_and_round_trips(example: str, method: str) -> None:
    captured = _captured(example, method)
    module = captured.module
    verify_module(module)
    text = print_module(module)
    assert print_module(parse_module(text)) == text
    assert captured.method == method == module.attrs.capture_method
    out = module.ops[-1]
    assert out.kind is OpKind.OUTPUT and out.type == TensorType("f32", ())
    # The runtime splits the graph by op name: every graph node is an IR op of the same name, in order.
    assert [n.name for n in captured.graph_module.graph.nodes] == [op.name for op in module.ops]
    assert [op.name for op in module.inputs()] == list(captured.input_names)


@pytest.mark.parametrize(("example", "method"), CASES)
def test_graph_computes_the_models_loss_and_gradients(example: str, method: str) -> None:
    captured = _captured(example, method)
    reference = _load(example)  # a second, independent model built from the same seed
    loss = captured.graph_module(*captured.example_inputs)
    expected = _reference_loss(reference)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    loss.backward()
    expected.backward()
    got = dict(captured.graph_module.named_parameters())
    for name, param in reference.model.named_parameters():
        if name in got:
            torch.testing.assert_close(got[name].grad, param.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert set(got) <= {n for n, _ in reference.model.named_parameters()}


@pytest.mark.parametrize(("example", "method"), [("gpt", "fx"), ("gpt", "export"), ("cnn", "export")])
def test_graph_runs_at_a_smaller_microbatch(example: str, method: str) -> None:
    captured = _captured(example, method)
    assert captured.any_batch
    half = slice(0, captured.module.attrs.batch // 2)  # type: ignore[operator]
    with torch.no_grad():
        loss = captured.graph_module(*(x[half] for x in captured.example_inputs))
        expected = _reference_loss(_load(example), half)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_batch_norm_buffers_update_like_the_model(method: str) -> None:
    captured = capture_loaded(_load("cnn"), method=method, annotate_costs=False)
    reference = _load("cnn")
    captured.graph_module(*captured.example_inputs)
    _reference_loss(reference)
    ref_buffers = dict(reference.model.named_buffers())
    got = dict(captured.graph_module.named_buffers())
    assert set(got) == set(ref_buffers)
    for name, buf in got.items():
        torch.testing.assert_close(buf, ref_buffers[name], rtol=1e-5, atol=1e-6, msg=name)
    assert int(got["stem.1.num_batches_tracked"]) == 1
    assert not torch.equal(got["stem.1.running_mean"], torch.zeros_like(got["stem.1.running_mean"]))
    buffers = [p for p in captured.module.params if p.attrs.buffer]
    assert {p.name for p in buffers} >= {"stem.1.running_mean", "stem.1.running_var", "stem.1.num_batches_tracked"}
    assert captured.module.param("stem.1.num_batches_tracked").type == TensorType("i64", ())


@pytest.mark.parametrize("method", ["fx", "export"])
def test_tied_embedding_is_one_shared_parameter(method: str) -> None:
    module = _captured("gpt", method).module
    shared = [p for p in module.params if p.attrs.shared]
    assert [p.name for p in shared] == ["tok.weight"]
    readers = [op for op in module.ops if "tok.weight" in (op.attrs.params or ())]
    assert len(readers) == 2
    paths = {op.attrs.module_path for op in readers}
    assert "tok" in paths and len(paths) == 2  # the embedding and the LM head in the model's own forward
    assert len(module.params) == len({p.name for p in module.params})
    model = _load("gpt").model
    assert sum(p.type.numel for p in module.params if not p.attrs.buffer) == sum(p.numel() for p in model.parameters())


def test_fx_keeps_module_paths_params_and_locations() -> None:
    module = _captured("gpt", "fx").module
    op = next(op for op in module.ops if op.target == "blocks.3.mlp.0")
    assert op.kind is OpKind.CALL_MODULE
    assert op.attrs.module_path == "blocks.3.mlp.0"
    assert op.attrs.params == ("blocks.3.mlp.0.weight", "blocks.3.mlp.0.bias")
    assert op.type == TensorType("f32", (4, 16, 128))
    qkv = next(op for op in module.ops if op.target == "blocks.0.attn.qkv")
    assert qkv.attrs.loc is not None
    file, line = qkv.attrs.loc.rsplit(":", 1)
    assert file.endswith("gpt.py")
    assert "self.qkv(x)" in (ROOT / "examples" / "gpt.py").read_text().splitlines()[int(line) - 1]
    split = next(op for op in module.ops if op.target == "split")
    getitems = [op for op in module.ops if op.operands[:1] == [split]]
    assert [op.attrs.index for op in getitems] == [0, 1, 2]


def test_sequential_ops_are_located_in_the_users_file_never_in_dapple_ir() -> None:
    """An `nn.Sequential` runs no forward of the user's: its ops sit at the user's line that captured it,
    whether through `capture` or through a model spec (dapple_ir's own frames never count)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    direct = capture(
        model, (torch.randn(3, 4),), loss_fn=torch.nn.functional.mse_loss, example_targets=(torch.randn(3, 2),)
    ).module
    via_spec = capture_loaded(_load("mlp"), method="fx", annotate_costs=False).module
    for module in (direct, via_spec):
        located = [op.attrs.loc for op in module.ops if op.kind not in (OpKind.INPUT, OpKind.OUTPUT)]
        assert located and all(loc is not None for loc in located)
        files = {Path(loc.rsplit(":", 1)[0]).resolve() for loc in located if loc is not None}
        assert files == {Path(__file__).resolve()}, files
    assert [op.attrs.loc for op in _captured("gpt", "fx").module.ops if "dapple_ir" in (op.attrs.loc or "")] == []


def test_torch_dtypes_and_the_irs_agree_on_names_and_sizes() -> None:
    assert set(IR_DTYPE_OF.values()) == set(DTYPE_BYTES)
    assert {name: TORCH_DTYPE_OF[name].itemsize for name in DTYPE_BYTES} == DTYPE_BYTES
    assert {name for name in DTYPE_BYTES if TORCH_DTYPE_OF[name].is_floating_point} == FLOAT_DTYPES - {"c64"}


def test_export_records_module_paths_on_aten_ops() -> None:
    module = _captured("gpt", "export").module
    linears = [
        op for op in module.ops if op.target == "aten.linear.default" and op.attrs.module_path == "blocks.3.mlp.0"
    ]
    assert len(linears) == 1
    reads = [operand.target for operand in linears[0].operands if operand.kind is OpKind.GET_ATTR]
    assert reads == ["blocks.3.mlp.0.weight", "blocks.3.mlp.0.bias"]
    assert all(p.type.shape for p in module.params if not p.attrs.buffer)


def test_kwargs_model_inputs_are_named_after_the_keywords() -> None:
    for method in ("fx", "export"):
        captured = _captured("kwargs_dict", method)
        assert captured.input_names == ("input_ids", "attention_mask", "labels")
        assert captured.target_names == ()
        assert [op.attrs.index for op in captured.module.inputs()] == [0, 1, 2]
    gpt = _captured("gpt", "fx")
    assert gpt.input_names == ("idx", "target") and gpt.target_names == ("target",)
    assert gpt.module.attrs.batch == 4


def test_auto_uses_fx_and_falls_back_to_export() -> None:
    assert capture_loaded(_load("mlp"), annotate_costs=False).method == "fx"
    captured = capture_loaded(_load("control_flow"), annotate_costs=False)
    assert captured.method == "export"
    assert any("fx failed" in note and "control_flow.py" in note for note in captured.notes)


def test_leaf_policy_is_configurable() -> None:
    gpt = _load("gpt")
    block_type = type(gpt.model.blocks[0])
    coarse = capture(
        gpt.model,
        gpt.example_inputs,
        loss_fn=gpt.loss_fn,
        example_targets=gpt.example_targets,
        method="fx",
        leaf_modules=(block_type,),
        annotate_costs=False,
    )
    blocks = [op for op in coarse.module.ops if op.kind is OpKind.CALL_MODULE and op.target.startswith("blocks.")]
    assert [op.target for op in blocks] == [f"blocks.{i}" for i in range(4)]
    assert len(blocks[0].attrs.params or ()) == 12
    mlp = _load("mlp")
    flat = capture(
        mlp.model,
        mlp.example_inputs,
        loss_fn=mlp.loss_fn,
        example_targets=mlp.example_targets,
        method="fx",
        leaf_modules=lambda module, path: False,
        annotate_costs=False,
    )
    assert not any(op.kind is OpKind.CALL_MODULE for op in flat.module.ops)
    assert [op.target for op in flat.module.ops if op.kind is OpKind.GET_ATTR][:2] == ["0.weight", "0.bias"]
    torch.testing.assert_close(flat.graph_module(*flat.example_inputs), _reference_loss(mlp))


def test_meta_capture_holds_no_weights() -> None:
    loaded = load_model_spec(str(ROOT / "examples" / "gpt.py") + ":factory", device="meta")
    assert isinstance(loaded, FactoryResult)
    captured = capture_loaded(loaded, method="fx", annotate_costs=False)
    assert all(p.is_meta for p in captured.graph_module.parameters())
    cpu = capture_loaded(_load("gpt"), method="fx", annotate_costs=False)
    assert print_module(captured.module) == print_module(cpu.module)
    assert structure_hash(captured.module) == structure_hash(cpu.module)


def test_structure_hash_ties_to_the_model_not_to_locations() -> None:
    first = capture_loaded(_load("mlp"), method="fx", annotate_costs=False).module
    second = capture_loaded(_load("mlp", seed=5), method="fx", annotate_costs=False).module
    assert structure_hash(first) == structure_hash(second)  # weights do not matter, structure does
    second.ops[3].attrs.loc = "elsewhere.py:1"
    second.ops[3].attrs.fwd_s = 1.5
    second.attrs.source = "another/path.py:factory"
    assert structure_hash(first) == structure_hash(second)
    assert second.ops[3].attrs.loc == "elsewhere.py:1"  # hashing leaves the module as it was
    import importlib.util

    spec = importlib.util.spec_from_file_location("_mlp_for_hash", ROOT / "examples" / "mlp.py")
    assert spec is not None and spec.loader is not None
    mlp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mlp)
    model, inputs, loss_fn, targets = mlp.build(depth=5)
    deeper = capture(model, inputs, loss_fn=loss_fn, example_targets=targets, method="fx", annotate_costs=False)
    assert structure_hash(deeper.module) != structure_hash(first)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_loss_module_is_part_of_the_graph(method: str) -> None:
    mlp = _load("mlp")
    loss_module = torch.nn.MSELoss()
    captured = capture(
        mlp.model,
        mlp.example_inputs,
        loss_fn=loss_module,
        example_targets=mlp.example_targets,
        method=method,
        annotate_costs=False,
    )
    loss_ops = [op for op in captured.module.ops if op.attrs.module_path == "loss_fn"]
    assert loss_ops and loss_ops[-1].type == TensorType("f32", ())
    assert captured.module.ops[-1].operands == [loss_ops[-1]]
    expected = loss_module(_load("mlp").model(*mlp.example_inputs), *mlp.example_targets)
    torch.testing.assert_close(captured.graph_module(*captured.example_inputs), expected)


class _SizedBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 8)

    def forward(self, x: torch.Tensor, batch: int) -> torch.Tensor:
        return self.fc(x).view(batch, 2, 4).mean(1)


class _SizeReadOnce(torch.nn.Module):
    """Reads the batch size once at the top and hands it to every block, as transformers models do."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_SizedBlock() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.size(0)
        for block in self.blocks:
            x = block(x, batch)
        return x


@pytest.mark.parametrize("method", ["fx", "export"])
def test_a_size_read_once_is_read_again_by_each_block_so_blocks_can_be_cut_apart(method: str) -> None:
    from dapple_ir.ir import OpaqueType
    from dapple_ir.pass_manager import PassManager, build_pipeline

    torch.manual_seed(0)
    model = _SizeReadOnce()
    mse = torch.nn.functional.mse_loss
    captured = capture(model, (torch.randn(4, 4),), loss_fn=mse, example_targets=(torch.randn(4, 4),), method=method)
    module = captured.module
    sizes = [op for op in module.ops if isinstance(op.type, OpaqueType) and op.operands]
    users = module.users()
    assert len(sizes) == 3  # one per view, each read from the input, never one shared by all blocks
    assert all(op.operands[0].kind is OpKind.INPUT and len(users[op]) == 1 for op in sizes)
    PassManager(build_pipeline("coarsen{max-layers=1000}")).run(module)
    for layer in module.layers:
        paths = [op.attrs.module_path or "" for op in layer.ops]
        blocks = {path.split(".")[1] for path in paths if path.startswith("blocks.")}
        assert len(blocks) <= 1, f"layer {layer.name} spans blocks {sorted(blocks)}: no cut between them"
    # The copies read the size of the input they are given, so the graph runs at any batch.
    x, target = torch.randn(6, 4), torch.randn(6, 4)
    torch.testing.assert_close(captured.graph_module(x, target), mse(model(x), target))


def test_one_tensor_given_as_two_inputs_becomes_two_graph_inputs() -> None:
    # Hugging Face examples pass {"input_ids": ids, "labels": ids}; merged, training would feed the
    # input's data as the labels too.
    class TwoInputs(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return ((self.fc(x) - y) ** 2).mean()

    same = torch.randn(2, 4)
    for method in ("fx", "export"):
        captured = capture(TwoInputs(), {"x": same, "y": same}, method=method)
        inputs = [op for op in captured.module.ops if op.kind is OpKind.INPUT]
        assert [op.name for op in inputs] == ["x", "y"], method
        read = {operand for op in captured.module.ops for operand in op.operands}
        assert all(op in read for op in inputs), method  # both feed the computation
