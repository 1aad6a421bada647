"""The structural verifier: each broken invariant is reported, naming the culprit with its IR."""

from __future__ import annotations

import pytest

from dapple_ir.errors import VerifyError
from dapple_ir.ir import Op, OpKind, TensorType
from dapple_ir.ir.parser import parse_module
from dapple_ir.ir.verifier import verify_module

HEAD = "module @m attributes {microbatches = 2} {\n  param @w : f32[4,4]\n"
CHAIN = """  %x = input : f32[2,4] {index = 0}
  %y = call_module @fc(%x) : f32[2,4] {params = [@w]}
  %l = call_function @torch.sum(%y) : f32[]
  %o = output(%l) : f32[]
"""


def _fails(text: str, *needles: str) -> str:
    module = parse_module(text)
    with pytest.raises(VerifyError) as info:
        verify_module(module)
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    return message


def test_valid_chain_with_stages_and_programs_verifies() -> None:
    text = (
        HEAD
        + CHAIN
        + """  stage @s0 [%x, %y] {replicas = 1, devices = [0]}
  stage @s1 [%l, %o] {replicas = 1, devices = [1]}
  program @rank0 {rank = 0} {
    forward @s0 mb = 1
    send %y mb = 1 to rank 1
  }
  program @rank1 {rank = 1} {
    recv %y mb = 1 from rank 0
  }
}
"""
    )
    verify_module(parse_module(text))


def test_use_before_definition_reprints_neighbourhood() -> None:
    text = HEAD + "  %y = call_module @fc(%x) : f32[2,4]\n  %x = input : f32[2,4]\n}\n"
    message = _fails(text, "op %y", "before its definition")
    assert ">   %y = call_module @fc(%x)" in message
    assert "%x = input" in message  # a neighbour is shown too


def test_op_defined_twice_in_memory() -> None:
    module = parse_module(HEAD + CHAIN + "}\n")
    module.ops.append(module.ops[1])
    with pytest.raises(VerifyError, match="defined twice"):
        verify_module(module)


def test_detached_operand() -> None:
    module = parse_module(HEAD + CHAIN + "}\n")
    module.ops[1].operands = [Op("ghost", OpKind.INPUT, [], TensorType("f32", (2, 4)))]
    with pytest.raises(VerifyError, match="not an op of this module"):
        verify_module(module)


@pytest.mark.parametrize(
    ("body", "needles"),
    [
        ("  %x = input : f32[2]\n  %o = output(%x) : f32[]\n", ("op %o", "output type differs")),
        ("  %x = input : f32[2]\n  %o = output(%x, %x) : f32[2]\n", ("exactly one operand",)),
        ("  %x = input : f32[2]\n  %y = call_module(%x) : f32[2]\n", ("needs a target",)),
        ("  %g = get_attr @nope() : f32[4,4]\n", ("get_attr reads @nope",)),
        ("  %x = input : f32[2] {params = [@v]}\n", ("reads parameter @v",)),
        (
            "  %t = input : (f32[2], f32[3])\n  %e = call_function @operator.getitem(%t) : f32[2] {index = 2}\n",
            ("getitem index 2 is out of range",),
        ),
        (
            "  %t = input : (f32[2], f32[3])\n  %e = call_function @operator.getitem(%t) : f32[2] {index = 1}\n",
            ("getitem result type differs",),
        ),
    ],
)
def test_op_type_rules(body: str, needles: tuple[str, ...]) -> None:
    _fails(HEAD + body + "}\n", *needles)


@pytest.mark.parametrize(
    ("groups", "needles"),
    [
        ("  stage @s0 [%x, %y, %l]\n", ("op %o", "in no stage")),
        ("  stage @s0 [%x, %y, %l, %o]\n  stage @s1 [%o]\n", ("in both stage @s0 and stage @s1",)),
        ("  stage @s0 [%x, %y, %l, %o] {replicas = 2, devices = [0]}\n", ("2 replicas but 1 devices",)),
        ("  stage @s0 [%x, %y, %l, %o]\n  stage @s0 []\n", ("declared twice",)),
        ("  layer @L0 [%x]\n", ("in no layer",)),
    ],
)
def test_group_membership(groups: str, needles: tuple[str, ...]) -> None:
    _fails(HEAD + CHAIN + groups + "}\n", *needles)


@pytest.mark.parametrize(
    ("instr", "needles"),
    [
        ("send %y mb = 0 to rank 5", ("rank0, instruction 0", "peer rank 5")),
        ("send %y mb = 0 to rank 0", ("peer rank 0 is not another rank",)),
        ("forward @s mb = 7", ("microbatch 7 is out of range 0..1",)),
        ("forward @s", ("forward needs a stage and a microbatch",)),
        ("allreduce @s group = [1]", ("does not include this rank (0)",)),
        ("allreduce @s group = [0, 9]", ("names a rank outside",)),
        ("allreduce param @zz group = [0, 1]", ("parameter @zz",)),
        ("free mb = 0", ("exactly one of a stage or a value",)),
    ],
)
def test_program_rules(instr: str, needles: tuple[str, ...]) -> None:
    text = (
        HEAD
        + CHAIN
        + "  stage @s [%x, %y, %l, %o]\n"
        + f"  program @rank0 {{rank = 0}} {{\n    {instr}\n  }}\n  program @rank1 {{rank = 1}} {{\n  }}\n}}\n"
    )
    message = _fails(text, *needles)
    assert f">     {instr}" in message


def test_program_rank_order() -> None:
    _fails(HEAD + CHAIN + "  program @a {rank = 1} {\n  }\n}\n", "rank = 1 but is program number 0")
