"""Model specs (`file.py:factory`, `package.module:factory`, `profile:path`) and `dapple dump`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dapple_ir.cli import main
from dapple_ir.commands.dump import group_of, summary_table
from dapple_ir.errors import CaptureError
from dapple_ir.frontend import profile_import
from dapple_ir.frontend.model_spec import FactoryResult, load_model_spec
from dapple_ir.frontend.spec_loader import capture_spec
from dapple_ir.ir import Module, Op, OpAttrs, OpKind, TensorType
from dapple_ir.ir.parser import parse_module
from dapple_ir.ir.verifier import verify_module
from tests.paths import PROFILES

ROOT = Path(__file__).resolve().parent.parent

FACTORIES = """
import torch
from torch import nn
import torch.nn.functional as F

def good():
    return nn.Linear(3, 2), (torch.randn(4, 3),), F.mse_loss, (torch.randn(4, 2),)

def single_tensor():
    return nn.Linear(3, 2), torch.randn(4, 3), F.mse_loss, torch.randn(4, 2)

def kwargs():
    return nn.Linear(3, 2), {"input": torch.randn(4, 3)}, F.mse_loss, (torch.randn(4, 2),)

def not_a_tuple():
    return nn.Linear(3, 2)

def too_long():
    return 1, 2, 3, 4, 5

def not_a_module():
    return torch.randn(2), (torch.randn(2),)

def bad_inputs():
    return nn.Linear(3, 2), "text"

def bad_loss():
    return nn.Linear(3, 2), (torch.randn(4, 3),), "mse"

def targets_without_loss():
    return nn.Linear(3, 2), (torch.randn(4, 3),), None, (torch.randn(4, 2),)

def raises():
    raise ValueError("boom")

constant = 3
"""


@pytest.fixture
def factories(tmp_path: Path) -> str:
    path = tmp_path / "factories.py"
    path.write_text(FACTORIES)
    return str(path)


def test_file_spec_loads_and_normalises(factories: str) -> None:
    loaded = load_model_spec(f"{factories}:good")
    assert isinstance(loaded, FactoryResult)
    assert isinstance(loaded.model, torch.nn.Linear)
    assert len(loaded.example_inputs) == 1 and loaded.example_kwargs is None
    assert loaded.source == f"{factories}:good"
    single = load_model_spec(f"{factories}:single_tensor")
    assert isinstance(single, FactoryResult)
    assert len(single.example_inputs) == 1 and len(single.example_targets) == 1
    kw = load_model_spec(f"{factories}:kwargs")
    assert isinstance(kw, FactoryResult)
    assert kw.example_inputs == () and kw.example_kwargs is not None and list(kw.example_kwargs) == ["input"]


def test_seed_gives_identical_weights_and_meta_gives_none(factories: str) -> None:
    a, b, c = (load_model_spec(f"{factories}:good", seed=s) for s in (3, 3, 4))
    assert isinstance(a, FactoryResult) and isinstance(b, FactoryResult) and isinstance(c, FactoryResult)
    assert torch.equal(a.model.weight, b.model.weight)
    assert torch.equal(a.example_inputs[0], b.example_inputs[0])
    assert not torch.equal(a.model.weight, c.model.weight)
    meta = load_model_spec(f"{factories}:good", device="meta")
    assert isinstance(meta, FactoryResult)
    assert meta.model.weight.is_meta and meta.example_inputs[0].is_meta


def test_package_module_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "mymodels"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(FACTORIES)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    module = capture_spec("mymodels.nets:good", device="cpu", method="fx")
    verify_module(module)
    assert module.attrs.source == "mymodels.nets:good"
    assert [p.name for p in module.params] == ["weight", "bias"]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("not_a_tuple", r"returned a Linear; a factory returns \(model, example_inputs"),
        ("too_long", "returned a 5-tuple"),
        ("not_a_module", "first item the factory returned is a Tensor, not a torch.nn.Module"),
        ("bad_inputs", "example_inputs is a str"),
        ("bad_loss", r"third item \(loss_fn\) is a str, not callable"),
        ("targets_without_loss", "example targets but no loss_fn"),
        ("raises", "the factory raised ValueError: boom"),
        ("constant", "is a int, not a function"),
        ("missing", "has no attribute 'missing'; callables it defines: .*good"),
    ],
)
def test_wrong_factories(factories: str, name: str, message: str) -> None:
    with pytest.raises(CaptureError, match=message):
        load_model_spec(f"{factories}:{name}")


def test_specs_that_do_not_resolve(tmp_path: Path) -> None:
    with pytest.raises(CaptureError, match=r"file nowhere/model.py does not exist"):
        load_model_spec("nowhere/model.py:factory")
    with pytest.raises(CaptureError, match=r"is not of the form path/to/file.py:factory"):
        load_model_spec("examples/gpt.py")
    with pytest.raises(CaptureError, match="no module named 'no_such_package_xyz'"):
        load_model_spec("no_such_package_xyz.models:factory")
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('needs transformers')\n")
    with pytest.raises(CaptureError, match=r"importing .*broken.py raised ImportError: needs transformers"):
        load_model_spec(f"{broken}:factory")
    with pytest.raises(CaptureError, match="device must be 'cpu' or 'meta'"):
        load_model_spec(f"{broken}:factory", device="cuda")


def test_profile_specs_go_to_the_profile_importer(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int | None]] = []
    sentinel = Module("imported")

    def import_profile(path: str, batch: int | None = None) -> Module:
        calls.append((path, batch))
        return sentinel

    monkeypatch.setattr(profile_import, "import_profile", import_profile)
    assert load_model_spec("profile:some/graph.txt", profile_batch=32) is sentinel
    assert capture_spec("profile:other.txt") is sentinel
    assert calls == [("some/graph.txt", 32), ("other.txt", None)]


def test_dumping_a_profile_never_imports_torch() -> None:
    profile = PROFILES / "dapple-vgg-19-pbs-32.txt"
    script = (
        "import sys\n"
        "from dapple_ir.cli import main\n"
        f"assert main(['dump', 'profile:{profile}', '--summary', '-o', '/dev/null']) == 0\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_dump_prints_ir_that_parses(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dump", str(ROOT / "examples" / "mlp.py") + ":factory", "--method", "fx"]) == 0
    module = parse_module(capsys.readouterr().out)
    verify_module(module)
    assert module.attrs.capture_method == "fx" and module.attrs.batch == 8


def test_dump_summary_counts_parameters_per_module(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dump", str(ROOT / "examples" / "mlp.py") + ":factory", "--summary"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:] if line and not line.startswith("-")}
    # Linear(16, 64), Linear(64, 64) x 2, Linear(64, 8): weights and biases in closed form.
    assert rows["0"][2] == f"{(16 * 64 + 64) / 1e3:.2f}k"
    assert rows["6"][2] == str(64 * 8 + 8)
    assert rows["total"][2] == f"{(16 * 64 + 64 + 2 * (64 * 64 + 64) + 64 * 8 + 8) / 1e3:.2f}k"
    assert "fwd FLOPs" in out.splitlines()[1]


def test_dump_reports_capture_errors_without_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dump", str(ROOT / "examples" / "control_flow.py") + ":factory", "--method", "fx"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot capture ChunkedMixer with fx")
    assert "Traceback" not in err


def test_summary_groups_containers_by_item_and_writes_only_set_columns() -> None:
    x = Op("x", OpKind.INPUT, [], TensorType("f32", (2, 4)), attrs=OpAttrs(index=0))
    a = Op("a", OpKind.CALL_MODULE, [x], TensorType("f32", (2, 4)), "blocks.0.fc", OpAttrs(module_path="blocks.0.fc"))
    b = Op("b", OpKind.CALL_MODULE, [a], TensorType("f32", (2, 4)), "head", OpAttrs(module_path="head", fwd_s=0.5))
    module = Module("m", ops=[x, a, b])
    assert [group_of(op) for op in module.ops] == ["(inputs)", "blocks.0", "head"]
    table = summary_table(module)
    header = table.splitlines()[1].split()
    assert "out" in header and "time" in header and "FLOPs" not in header
    assert "32 B" in table  # the f32[2,4] result of blocks.0


def test_structure_hash_ignores_the_plan() -> None:
    """Planning adds layers, stages, programs and costs; the model's hash must not change."""
    from dapple_ir.ir import Layer, Stage
    from dapple_ir.ir.structure import structure_hash

    module = capture_spec("examples/mlp.py:factory")
    before = structure_hash(module)
    module.layers = [Layer("L0", list(module.ops))]
    module.stages = [Stage("s0", list(module.ops))]
    module.ops[1].attrs.fwd_s = 1.0
    assert structure_hash(module) == before
    module.ops[1].target = "something_else"
    assert structure_hash(module) != before


def test_first_difference_names_the_op_on_each_side() -> None:
    from dapple_ir.ir.structure import first_difference

    planned = capture_spec("examples/mlp.py:factory")
    assert first_difference(planned, capture_spec("examples/mlp.py:factory")) is None
    now = capture_spec("examples/mlp.py:factory")
    now.ops[3].target = "aten.gelu.default"
    text = first_difference(planned, now)
    assert text is not None and text.startswith(f"op #3 is `%{planned.ops[3].name} = ")
    assert f"{planned.ops[3].target}" in text.split(" in the plan but ")[0]
    assert "aten.gelu.default" in text.split(" in the plan but ")[1]
    shorter = capture_spec("examples/mlp.py:factory")
    del shorter.ops[-1]
    assert "the plan has 1 more op(s)" in str(first_difference(planned, shorter))


def test_a_model_that_changed_since_planning_names_its_first_differing_op(tmp_path: Path) -> None:
    """The runtime captures the model again; a drift from the plan says where, and what to do."""
    from dapple_ir.backends.torch.worker import prepare_model
    from dapple_ir.errors import DappleError
    from dapple_ir.ir.structure import structure_hash
    from dapple_ir.plan_dir import Plan

    spec_file = tmp_path / "model.py"
    spec_file.write_text(
        FACTORIES.replace("nn.Linear(3, 2), (torch", "nn.Sequential(nn.Linear(3, 2), nn.ReLU()), (torch")
    )
    spec = f"{spec_file}:good"
    planned = capture_spec(spec)
    plan = Plan(tmp_path, planned, {"model_spec": spec, "model_hash": structure_hash(planned)}, ir_sha256="")
    prepare_model(plan)  # unchanged: the runtime's capture is the planned one
    changed = "nn.Sequential(nn.Linear(3, 2), nn.ReLU(), nn.ReLU()), (torch"
    spec_file.write_text(FACTORIES.replace("nn.Linear(3, 2), (torch", changed))
    os.utime(spec_file, (1e9, 1e9))  # a new modification time: the process's cache of captures must not answer
    first = r"op #\d+ is `%mse_loss = .*` in the plan but `%\w+ = call_module @\"2\"\(.*` in the model now"
    with pytest.raises(DappleError, match=rf"no longer matches the plan in .*: {first}\. .*recompile the plan") as err:
        prepare_model(plan)
    assert "structure hash" not in str(err.value)


def test_a_graph_fixed_to_its_example_batch_is_refused_for_other_microbatches(tmp_path: Path) -> None:
    from dapple_ir.backends.torch.worker import prepare_model
    from dapple_ir.errors import DappleError
    from dapple_ir.frontend.model_spec import capture_loaded
    from dapple_ir.ir.structure import structure_hash
    from dapple_ir.plan_dir import Plan

    spec_file = tmp_path / "fixed.py"
    spec_file.write_text(
        "import torch\n"
        "class Fixed(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(3, 1)\n"
        "    def forward(self, x):\n"
        "        return self.fc(x.reshape(4, 3)).sum()  # the batch of 4 is written into the model\n"
        "def factory():\n"
        "    return Fixed(), (torch.randn(4, 3),)\n"
    )
    loaded = load_model_spec(f"{spec_file}:factory", device="meta")
    assert isinstance(loaded, FactoryResult)
    captured = capture_loaded(loaded, method="export", annotate_costs=False)
    assert not captured.any_batch
    meta = {"model_spec": f"{spec_file}:factory", "model_hash": structure_hash(captured.module)}
    prepare_model(Plan(tmp_path, captured.module, {**meta, "microbatch_size": 4}, ir_sha256=""))
    with pytest.raises(DappleError, match=r"only runs at the batch it was captured at \(4\).* microbatches of 2"):
        prepare_model(Plan(tmp_path, captured.module, {**meta, "microbatch_size": 2}, ir_sha256=""))
