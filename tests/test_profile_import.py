"""Profile import: every published PipeDream/DAPPLE profile reads into verified, round-tripping IR, in
every whitespace variant the published files use."""

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
    "dapple-gnmt-32-pbs-64.txt": 64,
    "dapple-gnmt-32-pbs-64-simplified.txt": 64,
    "dapple-bert-24-pbs-6.txt": 6,
    "dapple-bert-48-pbs-2.txt": 2,
    "dapple-amoeba-6-pbs-8-simplified.txt": 8,
    "dapple-amoeba-6-pbs-8-complicated.txt": 8,
    "dapple-amoeba-18-pbs-8.txt": 8,
    "dapple-amoeba-36-pbs-1.txt": 1,
    "dapple-xlnet-24-pbs-1.txt": 1,
    "dapple-xlnet-36-pbs-1.txt": 1,
}


def _reference_totals(path: Path) -> tuple[int, float, float, float, int]:
    """Node count, forward ms, parameter bytes, activation bytes and edge count, read by plain regexes."""
    text = path.read_text()
    fwd = [float(x) for x in re.findall(r"forward_compute_time=([0-9.]+)", text)]
    params = [float(x) for x in re.findall(r"parameter_size=([0-9.]+)", text)]
    acts = 0.0
    for field in re.findall(r"activation_size=(\[[^\]]*\]|[0-9.]+)", text):
        acts += sum(float(x) for x in re.findall(r"[0-9.]+", field))
    edges = len(re.findall(r"^[ \t]+node\d+ -- node\d+[ \t]*$", text, flags=re.M))
    return len(fwd), sum(fwd), sum(params), acts, edges


def test_every_published_profile_is_present() -> None:
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


def test_all_fifteen_shared_profiles_are_found() -> None:
    # Guards the parametrised tests: an empty glob would silently test nothing.
    assert len(FILES) == 15, f"expected the fifteen profiles in {PROFILES}"


_NODES = [
    "node1 -- Input -- forward_compute_time=1.0, backward_compute_time=0.0, activation_size=8.0, parameter_size=0.0",
    "node2 -- Linear(4, 4) -- forward_compute_time=2.5, backward_compute_time=5.0, activation_size=[4.0; 4.0], "
    "parameter_size=80.0",
    "node3 -- Add -- forward_compute_time=0.5, backward_compute_time=1.0, activation_size=8.0, parameter_size=0.0",
]
_EDGES = [("node1", "node2"), ("node1", "node3"), ("node2", "node3")]


def _variant(indent: str, newline: str = "\n", blank: bool = False, trailing: str = "", bom: bool = False) -> str:
    lines = [n + trailing for n in _NODES] + [f"{indent}{a} -- {b}{trailing}" for a, b in _EDGES]
    if blank:
        lines = [x for line in lines for x in (line, "")]
    return ("\ufeff" if bom else "") + newline.join(lines) + newline


@pytest.mark.parametrize(
    "text",
    [
        _variant("  "),  # DAPPLE's bert-24: spaces only
        _variant(" \t"),  # DAPPLE's amoeba-36: a space before the tab
        _variant("\t", newline="\r\n"),
        _variant("\t", blank=True),
        _variant("    ", newline="\r\n", blank=True, trailing="  "),
        _variant("\t\t", trailing="\t"),
        _variant("\t", bom=True),
    ],
    ids=["spaces", "space-tab", "crlf", "blank-lines", "crlf-blank-trailing", "two-tabs", "bom"],
)
def test_whitespace_variants_read_like_the_plain_file(tmp_path: Path, text: str) -> None:
    plain = tmp_path / "plain" / "p.txt"
    variant = tmp_path / "variant" / "p.txt"
    plain.parent.mkdir()
    variant.parent.mkdir()
    plain.write_text(_variant("\t"))
    variant.write_bytes(text.encode())
    want, got = import_profile(str(plain)), import_profile(str(variant))
    assert print_module(got).replace(str(variant), str(plain)) == print_module(want)
    by_target = {op.target: op for op in got.ops}
    assert [(a, b) for a, b in _EDGES if by_target[a] in by_target[b].operands] == _EDGES
    assert by_target["node2"].attrs.out_bytes == 8.0


@pytest.mark.parametrize("name", ["dapple-bert-24-pbs-6.txt", "dapple-amoeba-36-pbs-1.txt"])
def test_the_published_shapes_that_failed_import(name: str) -> None:
    """bert-24's edges are indented by spaces only, amoeba-36's by a space and a tab."""
    path = PROFILES / name
    text = path.read_text()
    assert re.search(r"^(  | \t)node\d+ -- node\d+$", text, flags=re.M)
    module = import_profile(str(path))
    assert sum(len(op.operands) for op in module.ops) == _reference_totals(path)[4] > 0


def test_errors_give_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "bad.txt"
    path.write_text(_NODES[0] + "\n" + _NODES[1].replace("backward_compute_time=5.0", "backward_compute_time=x") + "\n")
    with pytest.raises(CaptureError) as info:
        import_profile(str(path))
    column = _NODES[1].index("backward_compute_time") + 1
    assert f"bad.txt:2:{column}: backward_compute_time=x is not a number" in str(info.value)
