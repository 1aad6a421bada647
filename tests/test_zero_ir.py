"""ZeRO-1 in the IR: `zero = 1` on a stage and its `reduce_scatter`/`all_gather`, printed, parsed and verified."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapple_ir.errors import VerifyError
from dapple_ir.ir.parser import parse_module
from dapple_ir.ir.printer import print_module
from dapple_ir.ir.verifier import verify_module
from dapple_ir.pass_manager import PassManager, build_pipeline

GOLDEN = Path(__file__).resolve().parent / "golden" / "lower_comm" / "sharded.expected"


def _lowered() -> str:
    return GOLDEN.read_text()


def test_a_sharded_plan_round_trips_and_verifies() -> None:
    text = _lowered()
    module = parse_module(text)
    assert print_module(module) == text
    verify_module(module)
    assert module.stage("s1").sharded and not module.stage("s0").sharded


def test_lowering_without_zero_keeps_the_allreduce() -> None:
    module = parse_module(_lowered().replace(", zero = 1}", "}"))
    for program in module.programs:
        program.instrs = [i for i in program.instrs if i.kind.value in ("forward", "backward")]
    PassManager(build_pipeline("lower-comm")).run(module)
    text = print_module(module)
    assert "allreduce @s1 group = [1, 2]" in text and "reduce_scatter" not in text and "all_gather" not in text


@pytest.mark.parametrize(
    ("old", "new", "needle"),
    [
        (", zero = 1}", ", zero = 2}", "zero = 2 must be 1"),
        (", zero = 1}", "}", "does not shard its optimizer state"),
        (
            "all_gather @s1 group = [1, 2]\n  }\n  program @rank2",
            "all_gather @s1 group = [1]\n  }\n  program @rank2",
            "must be this rank",
        ),
        ("reduce_scatter @s1 group = [1, 2]", "reduce_scatter param @w1 group = [1, 2]", "needs a stage and a group"),
    ],
)
def test_bad_sharding_is_refused_with_its_culprit(old: str, new: str, needle: str) -> None:
    text = _lowered()
    assert old in text
    with pytest.raises(VerifyError, match=needle):
        verify_module(parse_module(text.replace(old, new, 1)))
