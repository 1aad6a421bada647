"""The text form: golden files round-trip, random modules round-trip, and syntax errors point."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings

from dapple_ir.errors import ParseError
from dapple_ir.ir import Module, OpaqueType, TensorType
from dapple_ir.ir.parser import parse_module
from dapple_ir.ir.printer import print_module
from dapple_ir.ir.verifier import verify_module
from tests.ir_strategies import modules

GOLDEN = sorted((Path(__file__).parent / "golden" / "ir").glob("*.dapple"))


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_golden_round_trip(path: Path) -> None:
    text = path.read_text()
    module = parse_module(text, str(path))
    verify_module(module)
    assert print_module(module) == text


def test_golden_parses_to_expected_structure() -> None:
    module = parse_module((Path(__file__).parent / "golden" / "ir" / "all_shapes.dapple").read_text())
    assert [p.name for p in module.params] == ["emb.weight", "bn.running_mean", "odd name-with dash"]
    assert module.params[0].type == TensorType("f32", (100, 16))
    assert module.params[0].attrs.shared is True
    ops = {op.name: op for op in module.ops}
    assert ops["s"].operands == [ops["a"], ops["b"]]
    assert ops["s"].target == "<built-in function add>"
    assert ops["node7"].type == OpaqueType()
    assert ops["h"].attrs.fwd_s == 1.5e-06
    assert ops["parts"].type.elements[2] == OpaqueType()  # type: ignore[union-attr]
    assert module.stages[0].attrs.devices == (0, 2)
    send = module.programs[0].instrs[2]
    assert (send.kind.value, send.value, send.mb, send.peer) == ("send", ops["n"], 0, 1)
    assert module.programs[0].instrs[3].grad is True
    assert module.programs[0].instrs[8].param == "emb.weight"
    assert module.attrs.predicted_iteration_s == 0.0125


def _shape(module: Module) -> tuple[object, ...]:
    """Everything semantic in a module, as plain data, with values named by position."""
    pos = {op: i for i, op in enumerate(module.ops)}
    ops = tuple(
        (op.kind, op.type, op.target, tuple(pos[o] for o in op.operands), tuple(op.attrs.items())) for op in module.ops
    )
    groups = tuple(
        (g.name, tuple(pos[o] for o in g.ops), tuple(g.attrs.items())) for g in [*module.layers, *module.stages]
    )
    programs = tuple(
        (
            p.name,
            tuple(p.attrs.items()),
            tuple(
                (
                    i.kind,
                    i.stage.name if i.stage else None,
                    pos.get(i.value) if i.value else None,
                    i.grad,
                    i.mb,
                    i.peer,
                    i.group,
                    i.param,
                )  # type: ignore[arg-type]
                for i in p.instrs
            ),
        )
        for p in module.programs
    )
    params = tuple((p.name, p.type, tuple(p.attrs.items())) for p in module.params)
    return (module.name, tuple(module.attrs.items()), params, ops, groups, programs)


@settings(max_examples=150, deadline=None)
@given(modules())
def test_random_modules_round_trip(module: Module) -> None:
    text = print_module(module)
    reparsed = parse_module(text)
    assert _shape(reparsed) == _shape(module)
    assert print_module(reparsed) == text


@pytest.mark.parametrize(
    ("text", "where", "says"),
    [
        ("module @a {\n  %x = input : f32[3\n}\n", "bad.dapple:3:1", "expected one of"),
        ("module @a {\n  %x = inptu : f32[3]\n}\n", "bad.dapple:2:8", "unknown op kind 'inptu'"),
        ("module @a {\n  %y = call_function @f(%z) : f32[3]\n}\n", "bad.dapple:2:25", "%z is not defined"),
        ("module @a {\n  %x = input : f33[3]\n}\n", "bad.dapple:2:16", "unknown element type 'f33'"),
        ('module @a {\n  %x = input : f32[3] {fwd_s = "slow"}\n}\n', "bad.dapple:2:24", "'fwd_s' must be float"),
        ("module @a {\n  %x = input : f32[3] {colour = 1}\n}\n", "bad.dapple:2:24", "unknown attribute 'colour'"),
        ("module @a {\n  %x = input : f32[3]\n  %x = input : f32[3]\n}\n", "bad.dapple:3:3", "defined twice"),
        (
            "module @a {\n  program @r {\n    forward @nope mb = 0\n  }\n}\n",
            "bad.dapple:3:13",
            "stage @nope is not defined",
        ),
        ("module @a {\n  program @r {\n    jump mb = 0\n  }\n}\n", "bad.dapple:3:5", "unknown instruction 'jump'"),
        (
            "module @a {\n  %x = input : f32[3]\n  program @r {\n    recv %x mb = 0 to rank 1\n  }\n}\n",
            "bad.dapple:4:5",
            "recv takes 'from rank N'",
        ),
        ("module @a {\n  %x = input : f32[3]\n", "bad.dapple:3:1", "ends too early"),
    ],
)
def test_syntax_errors_point_at_the_culprit(text: str, where: str, says: str) -> None:
    with pytest.raises(ParseError) as info:
        parse_module(text, "bad.dapple")
    message = str(info.value)
    assert message.startswith(where), message
    assert says in message
    assert "^" in message  # the excerpt marks the column
