"""docs/ir.md: every `dapple` example parses, verifies and round-trips; every op and instruction kind is shown."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dapple_ir.ir import InstrKind, OpKind
from dapple_ir.ir.parser import parse_module, parse_pipeline
from dapple_ir.ir.printer import print_module
from dapple_ir.ir.verifier import verify_module

DOC = Path(__file__).resolve().parent.parent / "docs" / "ir.md"
BLOCKS = re.findall(r"```dapple\n(.*?)```", DOC.read_text(), flags=re.S)


def test_doc_has_examples() -> None:
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("text", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_every_example_parses_verifies_and_round_trips(text: str) -> None:
    module = parse_module(text, str(DOC))
    verify_module(module)
    assert print_module(module) == text


def test_every_op_and_instruction_kind_has_an_example() -> None:
    kinds = {op.kind for text in BLOCKS for op in parse_module(text).ops}
    assert kinds == set(OpKind)
    instrs = {i.kind for text in BLOCKS for p in parse_module(text).programs for i in p.instrs}
    assert instrs == set(InstrKind)


def test_pipeline_example_parses() -> None:
    line = next(ln for ln in DOC.read_text().splitlines() if ln.startswith("annotate-cost,"))
    assert [s.name for s in parse_pipeline(line)][-1] == "verify"
