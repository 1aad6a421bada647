"""Profile import: the six published PipeDream/DAPPLE profiles read into verified, round-tripping IR."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dapple_ir.errors import CaptureError
from dapple_ir.frontend.profile_import import import_profile
from dapple_ir.ir import OpKind
from dapple_ir.ir.parser import parse_module
from dapple_ir.ir.printer import print_module
from dapple_ir.ir.verifier import verify_module
from tests.paths import PROFILES

FILES = sorted(PROFILES.glob("*.txt"))
EXPECTED_BATCH = {
    "pipedream-vgg16.txt": 64,
    "pipedream-resnet18.txt": 64,
    "pipedream-gnmt.txt": 64,
    "dapple-vgg-19-pbs-32.txt": 32,
    "dapple-gnmt-16-pbs-64.txt": 64,
    "dapple-bert-48-pbs-2.txt": 2,
}


def _reference_totals(path: Path) -> tuple[int, float, float, float, int]:
    """Node count, forward ms, parameter bytes, activation bytes and edge count, read by plain regexes."""
    text = path.read_text()
    fwd = [float(x) for x in re.findall(r"forward_compute_time=([0-9.]+)", text)]
    params = [float(x) for x in re.findall(r"parameter_size=([0-9.]+)", text)]
    acts = 0.0
    for field in re.findall(r"activation_size=(\[[^\]]*\]|[0-9.]+)", text):
        acts += sum(float(x) for x in re.findall(r"[0-9.]+", field))
    edges = len(re.findall(r"^\tnode\d+ -- node\d+$", text, flags=re.M))
    return len(fwd), sum(fwd), sum(params), acts, edges


def test_all_six_profiles_are_present() -> None:
    assert sorted(p.name for p in FILES) == sorted(EXPECTED_BATCH)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_profile_imports_verifies_and_round_trips(path: Path) -> None:
    module = import_profile(str(path))
    verify_module(module)
    text = print_module(module)
    assert print_module(parse_module(text)) == text
    count, fwd_ms, param_bytes, act_bytes, edges = _reference_totals(path)
    assert len(module.ops) == count
    assert all(op.kind is OpKind.LAYER for op in module.ops)
    assert sum(op.attrs.fwd_s or 0.0 for op in module.ops) == pytest.approx(fwd_ms / 1e3, rel=1e-9)
    assert sum(op.attrs.param_bytes or 0.0 for op in module.ops) == pytest.approx(param_bytes, rel=1e-12)
    assert sum(op.attrs.act_bytes or 0.0 for op in module.ops) == pytest.approx(act_bytes, rel=1e-12)
    assert module.param_bytes_of(module.ops) == pytest.approx(param_bytes, rel=1e-12)
    assert sum(len(op.operands) for op in module.ops) == edges
    assert module.attrs.batch == module.attrs.cost_batch == EXPECTED_BATCH[path.name]
    assert module.attrs.capture_method == "profile"


def test_edges_become_operands_and_branches_stay() -> None:
    module = import_profile(str(PROFILES / "pipedream-resnet18.txt"))
    by_target = {op.target: op for op in module.ops}
    text = (PROFILES / "pipedream-resnet18.txt").read_text()
    for src, dst in re.findall(r"^\t(node\d+) -- (node\d+)$", text, flags=re.M):
        assert by_target[src] in by_target[dst].operands
    # A residual add reads two values, and some value feeds two ops: a branch, not a chain.
    assert any(len(op.operands) == 2 for op in module.ops)
    assert any(len(users) >= 2 for users in module.users().values())
    position = {op: i for i, op in enumerate(module.ops)}
    assert all(position[x] < position[op] for op in module.ops for x in op.operands)


def test_list_activation_sizes_are_summed_and_batch_override() -> None:
    module = import_profile(str(PROFILES / "dapple-gnmt-16-pbs-64.txt"), batch=128)
    lstm = next(op for op in module.ops if op.target == "node7")
    assert lstm.attrs.out_bytes == 9175040.0 + 262144.0 + 262144.0
    assert lstm.attrs.fwd_s == pytest.approx(4.649e-3)
    assert module.attrs.batch == module.attrs.cost_batch == 128


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("node1 -- A -- forward_compute_time=1, backward_compute_time=1, activation_size=1\n", "lacks parameter_size"),
        ("node1 -- A -- forward_compute_time=x, backward_compute_time=1, activation_size=1, parameter_size=0\n", ":1:"),
        (
            "node1 -- A -- forward_compute_time=1, backward_compute_time=1, activation_size=1, parameter_size=0\n"
            "\tnode1 -- node9\n",
            "node9",
        ),
        (
            "node1 -- A -- forward_compute_time=1, backward_compute_time=1, activation_size=1, parameter_size=0\n"
            "node2 -- B -- forward_compute_time=1, backward_compute_time=1, activation_size=1, parameter_size=0\n"
            "\tnode1 -- node2\n\tnode2 -- node1\n",
            "cycle",
        ),
    ],
)
def test_malformed_profiles_name_the_line(tmp_path: Path, content: str, fragment: str) -> None:
    path = tmp_path / "bad.txt"
    path.write_text(content)
    with pytest.raises(CaptureError, match=re.escape(fragment)):
        import_profile(str(path))


def test_missing_profile_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(CaptureError, match=r"nothere\.txt"):
        import_profile(str(tmp_path / "nothere.txt"))


def test_all_six_shared_profiles_are_found() -> None:
    # Guards the parametrised tests: an empty glob would silently test nothing.
    assert len(FILES) == 6, f"expected the six profiles in {PROFILES}"
