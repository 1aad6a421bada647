"""Prints a `Module` in the text form of `grammars/dapple.lark`.

Names are assigned at print time: each op's name hint, made unique within the module. The output is
canonical, so `print_module(parse_module(text)) == text` for anything this printer wrote.
"""

from __future__ import annotations

import json
import re

from dapple_ir.ir import (
    AttrRecord,
    Instr,
    InstrKind,
    Module,
    Op,
    OpaqueType,
    OpKind,
    RankProgram,
    TensorType,
    TupleType,
    Type,
)

_PLAIN_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*\Z")
_VALUE_CHARS = re.compile(r"[^A-Za-z0-9_.]")


def format_symbol(name: str) -> str:
    """`@name`, quoted when the name holds characters a bare symbol cannot."""
    if _PLAIN_SYMBOL.match(name):
        return "@" + name
    return "@" + json.dumps(name)


def format_type(t: Type) -> str:
    if isinstance(t, TensorType):
        return f"{t.dtype}[{','.join(str(d) for d in t.shape)}]"
    if isinstance(t, TupleType):
        return "(" + ", ".join(format_type(e) for e in t.elements) + ")"
    assert isinstance(t, OpaqueType)
    return "?"


def format_attr_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple):
        # Tuples of strings name parameters or stages: they print as symbols.
        items = [format_symbol(v) if isinstance(v, str) else format_attr_value(v) for v in value]
        return "[" + ", ".join(items) + "]"
    raise TypeError(f"cannot print attribute value {value!r}")


def format_attrs(record: AttrRecord) -> str:
    """` {k = v, ...}` for the set attributes, or the empty string when none is set."""
    parts = [f"{key} = {format_attr_value(value)}" for key, value in record.items()]
    return " {" + ", ".join(parts) + "}" if parts else ""


class Namer:
    """Assigns each op a unique printable name, derived from its hint."""

    def __init__(self, ops: list[Op]) -> None:
        self.names: dict[Op, str] = {}
        taken: set[str] = set()
        for op in ops:
            base = _VALUE_CHARS.sub("_", op.name) or "v"
            name, n = base, 0
            while name in taken:
                n += 1
                name = f"{base}_{n}"
            taken.add(name)
            self.names[op] = name

    def __call__(self, op: Op) -> str:
        # An op outside the module (broken IR) still prints, marked, so the verifier can show it.
        return "%" + self.names.get(op, f"<detached:{op.name}>")


def format_op(op: Op, namer: Namer) -> str:
    text = f"{namer(op)} = {op.kind.value}"
    if op.target is not None:
        text += " " + format_symbol(op.target)
    if op.operands or op.kind is not OpKind.INPUT:
        text += "(" + ", ".join(namer(v) for v in op.operands) + ")"
    return text + f" : {format_type(op.type)}" + format_attrs(op.attrs)


_PEER_WORD = {InstrKind.SEND: "to", InstrKind.RECV: "from"}


def format_instr(instr: Instr, namer: Namer) -> str:
    parts = [instr.kind.value]
    if instr.grad:
        parts.append("grad")
    if instr.stage is not None:
        parts.append(format_symbol(instr.stage.name))
    if instr.value is not None:
        parts.append(namer(instr.value))
    if instr.param is not None:
        parts.append("param " + format_symbol(instr.param))
    if instr.mb is not None:
        parts.append(f"mb = {instr.mb}")
    if instr.rows is not None:
        parts.append(f"rows = {instr.rows[0]}:{instr.rows[1]}")
    if instr.peer is not None:
        parts.append(f"{_PEER_WORD.get(instr.kind, 'to')} rank {instr.peer}")
    if instr.group is not None:
        parts.append(f"group = {format_attr_value(instr.group)}")
    return " ".join(parts)


def format_program(program: RankProgram, namer: Namer, indent: str = "  ") -> list[str]:
    lines = [f"{indent}program {format_symbol(program.name)}{format_attrs(program.attrs)} {{"]
    lines += [f"{indent}  {format_instr(i, namer)}" for i in program.instrs]
    lines.append(f"{indent}}}")
    return lines


def print_module(module: Module) -> str:
    """The module's text form, ending in a newline."""
    namer = Namer(module.ops)
    header = f"module {format_symbol(module.name)}"
    attrs = format_attrs(module.attrs)
    if attrs:
        header += " attributes" + attrs
    sections: list[list[str]] = [
        [f"  param {format_symbol(p.name)} : {format_type(p.type)}{format_attrs(p.attrs)}" for p in module.params],
        [f"  {format_op(op, namer)}" for op in module.ops],
        [_format_group("layer", g.name, g.ops, g.attrs, namer) for g in module.layers],
        [_format_group("stage", s.name, s.ops, s.attrs, namer) for s in module.stages],
        [line for p in module.programs for line in format_program(p, namer)],
    ]
    body: list[str] = []
    for section in sections:
        if section and body:
            body.append("")
        body += section
    return "\n".join([header + " {", *body, "}"]) + "\n"


def _format_group(keyword: str, name: str, ops: list[Op], attrs: AttrRecord, namer: Namer) -> str:
    members = ", ".join(namer(op) for op in ops)
    return f"  {keyword} {format_symbol(name)} [{members}]{format_attrs(attrs)}"
