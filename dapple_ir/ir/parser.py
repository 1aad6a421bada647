"""Parses the text form (`module` start rule) and pass-pipeline specs (`pipeline` start rule).

Syntax errors and unresolved names raise `ParseError` with `file:line:column`, the offending line
and what was expected there. Semantic checks (SSA order, types, stages) are the verifier's job.

Every input gives either a module or a located `ParseError`: bytes that are not UTF-8
(`read_ir_file`), nesting deeper than `MAX_NESTING`, integers outside 64 bits, numbers that
overflow to infinity and bad escapes in quoted names are errors here, never internal exceptions.
"""

from __future__ import annotations

import functools
import json
import math
import typing
from dataclasses import dataclass, fields
from importlib.resources import files
from pathlib import Path

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from dapple_ir.errors import ParseError
from dapple_ir.ir import (
    DTYPE_BYTES,
    AttrRecord,
    Instr,
    InstrKind,
    Layer,
    LayerAttrs,
    Module,
    ModuleAttrs,
    Op,
    OpaqueType,
    OpAttrs,
    OpKind,
    Param,
    ParamAttrs,
    ProgramAttrs,
    RankProgram,
    Stage,
    StageAttrs,
    TensorType,
    TupleType,
    Type,
)

#: Deepest nesting of lists and tuple types the text form accepts (the printer never goes past a few).
MAX_NESTING = 32
#: Integers are 64-bit signed.
_INT_LIMIT = 2**63
#: The longest IR text read (bytes of a file, characters of a string): parsing takes about 9 bytes of memory per
#: character of it (a 20 MB file: 190 MB, 2 s), so this bounds a parse near 2.5 GB; plans are a few MB.
MAX_IR_SIZE = 256 * 2**20


def read_ir_file(path: str | Path) -> str:
    """The text of an IR file; bytes that are not UTF-8 are a `ParseError` at their line and column."""
    _check_size(Path(path).stat().st_size, str(path), "bytes")
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        before = data[: exc.start]
        line = before.count(b"\n") + 1
        column = exc.start - (before.rfind(b"\n") + 1) + 1
        raise ParseError(
            f"{path}:{line}:{column}: byte 0x{data[exc.start]:02x} is not UTF-8; IR text files are UTF-8 "
            "(was the file written by another tool or truncated?)"
        ) from None


@functools.cache
def _lark() -> Lark:
    grammar = files("dapple_ir.grammars").joinpath("dapple.lark").read_text()
    return Lark(grammar, start=["module", "pipeline"], parser="lalr", maybe_placeholders=False)


@dataclass(frozen=True, slots=True)
class PassSpec:
    """One element of a pipeline string: a pass name and its options, as written."""

    name: str
    options: dict[str, str]
    column: int


def parse_pipeline(text: str) -> list[PassSpec]:
    """`a,b{x=1,y=z}` into pass specs (names and raw option strings, unchecked)."""
    tree = _parse(text, "pipeline", "<pipeline>")
    specs: list[PassSpec] = []
    for spec in tree.children:
        assert isinstance(spec, Tree)
        name_tok = spec.children[0]
        assert isinstance(name_tok, Token)
        options: dict[str, str] = {}
        for opts in spec.children[1:]:
            assert isinstance(opts, Tree)
            for opt in opts.children:
                assert isinstance(opt, Tree)
                key, val = (str(t) for t in opt.children)
                options[key] = _pipeline_string(val, text, opt.children[1]) if val.startswith('"') else val
        specs.append(PassSpec(str(name_tok), options, name_tok.column or 0))
    return specs


def _pipeline_string(quoted: str, text: str, at: Token | Tree) -> str:
    try:
        value = json.loads(quoted)
    except json.JSONDecodeError as exc:
        column = at.column if isinstance(at, Token) and at.column else 1
        raise ParseError(
            f"<pipeline>:1:{column}: bad escape in quoted option {quoted[:40]!r}: {exc.msg}\n"
            + _excerpt(text, 1, column)
        ) from None
    assert isinstance(value, str)
    return value


def parse_module(text: str, filename: str = "<string>") -> Module:
    """Parse IR text into a `Module`."""
    tree = _parse(text, "module", filename)
    return _ModuleBuilder(text, filename).build(tree)


def _check_size(size: int, filename: str, unit: str) -> None:
    if size > MAX_IR_SIZE:
        raise ParseError(
            f"{filename}: {size:,} {unit} of IR text, more than the {MAX_IR_SIZE:,} the parser reads (plans take a "
            "few MB); is it the file you meant?"
        )


def _parse(text: str, start: str, filename: str) -> Tree:
    _check_size(len(text), filename, "characters")
    try:
        return _lark().parse(text, start=start)
    except UnexpectedInput as exc:
        raise ParseError(_syntax_message(exc, text, filename)) from None


def _syntax_message(exc: UnexpectedInput, text: str, filename: str) -> str:
    line, column = int(exc.line), int(exc.column)
    if isinstance(exc, UnexpectedEOF) or (isinstance(exc, UnexpectedToken) and exc.token.type == "$END"):
        line = text.count("\n") + 1
        column = len(text.rsplit("\n", 1)[-1]) + 1
        what = "the text ends too early"
    elif isinstance(exc, UnexpectedToken):
        what = f"unexpected {exc.token!r}"
    elif isinstance(exc, UnexpectedCharacters):
        what = f"unexpected character {text[exc.pos_in_stream or 0]!r}"
    else:
        what = "syntax error"
    names = getattr(exc, "expected", None) or getattr(exc, "allowed", None) or ()
    expected = sorted({_TOKEN_WORDS.get(n, f"'{n.lower()}'" if n.isalpha() else n) for n in names})
    hint = f"; expected one of: {', '.join(expected)}" if expected else ""
    return f"{filename}:{line}:{column}: {what}{hint}\n" + _excerpt(text, line, column)


_TOKEN_WORDS = {
    "COMMA": "','",
    "RSQB": "']'",
    "LSQB": "'['",
    "LBRACE": "'{'",
    "RBRACE": "'}'",
    "LPAR": "'('",
    "RPAR": "')'",
    "COLON": "':'",
    "EQUAL": "'='",
    "QMARK": "'?'",
    "NAME": "a name",
    "INT": "an integer",
    "FLOAT": "a number",
    "STRING": "a string",
    "SYMBOL": "a @symbol",
    "VALUE": "a %value",
    "OPTION_WORD": "an option value",
}


def _excerpt(text: str, line: int, column: int) -> str:
    # Lines as the lexer counts them: only \n ends a line (splitlines would also split at \f, \v, ...).
    lines = text.split("\n")
    source = lines[line - 1] if 0 < line <= len(lines) else ""
    # A window of the line around the column, so a 5,000-character line quotes readably.
    start = max(column - 1 - _EXCERPT_HALF, 0)
    shown = source[start : column - 1 + _EXCERPT_HALF]
    lead, tail = ("..." if start else ""), ("..." if len(source) > column - 1 + _EXCERPT_HALF else "")
    return f"    {lead}{shown}{tail}\n    {' ' * (len(lead) + max(column - 1 - start, 0))}^"


_EXCERPT_HALF = 60


@functools.cache
def _attr_kinds(record: type[AttrRecord]) -> dict[str, str]:
    """Declared type of each attribute of `record` as text (`int | None`); resolved once per record."""
    return {name: str(hint) for name, hint in typing.get_type_hints(record).items()}


@functools.cache
def _attr_names(record: type[AttrRecord]) -> tuple[str, ...]:
    return tuple(f.name for f in fields(record))  # type: ignore[arg-type]


class _ModuleBuilder:
    """Builds a `Module` from a parse tree, resolving names to objects."""

    def __init__(self, text: str, filename: str) -> None:
        self.text = text
        self.filename = filename
        self.values: dict[str, Op] = {}
        self.stages: dict[str, Stage] = {}

    def error(self, tok: Token, message: str) -> ParseError:
        line, column = tok.line or 0, tok.column or 0
        return ParseError(f"{self.filename}:{line}:{column}: {message}\n" + _excerpt(self.text, line, column))

    def build(self, tree: Tree) -> Module:
        name_tok = tree.children[0]
        assert isinstance(name_tok, Token)
        module = Module(self.symbol_text(name_tok))
        items = tree.children[1:]
        if items and isinstance(items[0], Tree) and items[0].data == "module_attrs":
            module.attrs = self.attrs(ModuleAttrs, items[0].children[0])
            items = items[1:]
        pending: list[tuple[Op, list[Token]]] = []
        for item in items:
            assert isinstance(item, Tree)
            if item.data == "param":
                module.params.append(self.param(item))
            elif item.data == "op":
                op, operand_toks = self.op(item)
                module.ops.append(op)
                pending.append((op, operand_toks))
        # Operands resolve after all definitions, so a use before its definition parses and the
        # verifier reports it with the IR around it.
        for op, toks in pending:
            op.operands = [self.value(t) for t in toks]
        for item in items:
            assert isinstance(item, Tree)
            if item.data == "layer":
                module.layers.append(Layer(*self.group(item, LayerAttrs)))
            elif item.data == "stage":
                stage = Stage(*self.group(item, StageAttrs))
                self.stages[stage.name] = stage
                module.stages.append(stage)
        for item in items:
            assert isinstance(item, Tree)
            if item.data == "rank_program":
                module.programs.append(self.program(item))
        return module

    # -- pieces -----------------------------------------------------------------------------

    def param(self, tree: Tree) -> Param:
        name_tok, type_tree, *rest = tree.children
        assert isinstance(name_tok, Token) and isinstance(type_tree, Tree)
        t = self.ir_type(type_tree, name_tok)
        if not isinstance(t, TensorType):
            raise self.error(name_tok, f"parameter {name_tok} must have a tensor type")
        attrs = self.attrs(ParamAttrs, rest[0]) if rest else ParamAttrs()
        return Param(self.symbol_text(name_tok), t, attrs)

    def op(self, tree: Tree) -> tuple[Op, list[Token]]:
        children = list(tree.children)
        value_tok, kind_tok = children[0], children[1]
        assert isinstance(value_tok, Token) and isinstance(kind_tok, Token)
        try:
            kind = OpKind(str(kind_tok))
        except ValueError:
            valid = ", ".join(k.value for k in OpKind)
            raise self.error(kind_tok, f"unknown op kind {str(kind_tok)!r}; valid kinds: {valid}") from None
        target: str | None = None
        operand_toks: list[Token] = []
        rest = children[2:]
        first = rest[0] if rest else None
        if isinstance(first, Token) and first.type == "SYMBOL":
            target = self.symbol_text(first)
            rest.pop(0)
        if rest and isinstance(rest[0], Tree) and rest[0].data == "operands":
            operand_toks = [t for t in rest.pop(0).children if isinstance(t, Token)]
        type_tree = rest.pop(0)
        assert isinstance(type_tree, Tree)
        attrs = self.attrs(OpAttrs, rest[0]) if rest else OpAttrs()
        name = str(value_tok)[1:]
        if name in self.values:
            raise self.error(value_tok, f"%{name} is defined twice (SSA values have one definition)")
        op = Op(name, kind, [], self.ir_type(type_tree, value_tok), target, attrs)
        self.values[name] = op
        return op, operand_toks

    def group(self, tree: Tree, record: typing.Any) -> tuple[str, list[Op], typing.Any]:
        name_tok, members, *rest = tree.children
        assert isinstance(name_tok, Token) and isinstance(members, Tree)
        ops = [self.value(t) for t in members.children if isinstance(t, Token)]
        attrs = self.attrs(record, rest[0]) if rest else record()
        return self.symbol_text(name_tok), ops, attrs

    def program(self, tree: Tree) -> RankProgram:
        name_tok, *rest = tree.children
        assert isinstance(name_tok, Token)
        attrs = ProgramAttrs()
        if rest and isinstance(rest[0], Tree) and rest[0].data == "attr_dict":
            attrs = self.attrs(ProgramAttrs, rest.pop(0))
        instrs = [self.instr(t) for t in rest if isinstance(t, Tree)]
        return RankProgram(self.symbol_text(name_tok), instrs, attrs)

    def instr(self, tree: Tree) -> Instr:
        kind_tok = tree.children[0]
        assert isinstance(kind_tok, Token)
        try:
            instr = Instr(InstrKind(str(kind_tok)))
        except ValueError:
            valid = ", ".join(k.value for k in InstrKind)
            raise self.error(kind_tok, f"unknown instruction {str(kind_tok)!r}; valid: {valid}") from None
        for part in tree.children[1:]:
            assert isinstance(part, Tree)
            toks = [t for t in part.children if isinstance(t, Token)]
            if part.data == "grad":
                instr.grad = True
            elif part.data == "stage_ref":
                instr.stage = self.stage(toks[0])
            elif part.data == "value_ref":
                instr.value = self.value(toks[0])
            elif part.data == "param_ref":
                instr.param = self.symbol_text(toks[0])
            elif part.data == "mb":
                instr.mb = self.integer(toks[0])
            elif part.data == "rows":
                lo, hi = self.integer(toks[0]), self.integer(toks[1])
                if not 0 <= lo < hi:
                    raise self.error(toks[0], f"rows = {lo}:{hi} is empty or negative: write LO:HI, 0 <= LO < HI")
                instr.rows = (lo, hi)
            elif part.data in ("to_peer", "from_peer"):
                self.check_peer_word(instr.kind, str(part.data)[:-5], kind_tok)
                instr.peer = self.integer(toks[0])
            elif part.data == "group":
                ints = part.children[0]
                assert isinstance(ints, Tree)
                instr.group = tuple(self.integer(t) for t in ints.children if isinstance(t, Token))
        return instr

    def check_peer_word(self, kind: InstrKind, word: str, at: Token) -> None:
        wanted = {InstrKind.SEND: "to", InstrKind.RECV: "from"}.get(kind)
        if wanted != word:
            expect = f"'{wanted} rank N'" if wanted else "no peer"
            raise self.error(at, f"{kind.value} takes {expect}, not '{word} rank'")

    def value(self, tok: Token) -> Op:
        name = str(tok)[1:]
        if name not in self.values:
            raise self.error(tok, f"%{name} is not defined in this module")
        return self.values[name]

    def stage(self, tok: Token) -> Stage:
        name = self.symbol_text(tok)
        if name not in self.stages:
            raise self.error(tok, f"stage @{name} is not defined in this module")
        return self.stages[name]

    def ir_type(self, tree: Tree, at: Token, depth: int = 0) -> Type:
        if tree.data == "opaque_type":
            return OpaqueType()
        if tree.data == "tuple_type":
            self.check_depth(at, depth)
            return TupleType(tuple(self.ir_type(t, at, depth + 1) for t in tree.children if isinstance(t, Tree)))
        dtype_tok, *dims = tree.children
        assert isinstance(dtype_tok, Token)
        if str(dtype_tok) not in DTYPE_BYTES:
            valid = ", ".join(DTYPE_BYTES)
            raise self.error(dtype_tok, f"unknown element type {str(dtype_tok)!r}; valid: {valid}")
        return TensorType(str(dtype_tok), tuple(self.integer(d) for d in dims if isinstance(d, Token)))

    def attrs(self, record: typing.Any, tree: typing.Any) -> typing.Any:
        assert isinstance(tree, Tree)
        values: dict[str, object] = {}
        names = _attr_names(record)
        for attr in tree.children:
            assert isinstance(attr, Tree)
            key_tok, value_tree = attr.children
            assert isinstance(key_tok, Token) and isinstance(value_tree, Tree)
            key = str(key_tok)
            if key not in names:
                raise self.error(key_tok, f"unknown attribute {key!r} here; valid: {', '.join(names)}")
            if key in values:
                raise self.error(key_tok, f"attribute {key!r} is given twice")
            values[key] = self.attr_value(key_tok, _attr_kinds(record).get(key, ""), value_tree)
        return record(**values)

    def attr_value(self, key: Token, kind: str, tree: Tree) -> object:
        raw = self.literal(tree, key)
        ok = True
        if kind.startswith("bool"):
            ok = isinstance(raw, bool)
        elif kind.startswith("int"):
            ok = isinstance(raw, int) and not isinstance(raw, bool)
        elif kind.startswith("float"):
            ok = isinstance(raw, int | float) and not isinstance(raw, bool)
            raw = float(raw) if ok else raw  # type: ignore[arg-type]
        elif kind.startswith("str"):
            ok = isinstance(raw, str) and tree.data == "string_value"
        elif kind.startswith("tuple[str"):
            ok = isinstance(raw, tuple) and all(isinstance(c, Tree) and c.data == "symbol_value" for c in tree.children)
        elif kind.startswith("tuple[int"):
            ok = isinstance(raw, tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in raw)
        if not ok:
            raise self.error(key, f"attribute {str(key)!r} must be {kind.replace(' | None', '')}")
        return raw

    def literal(self, tree: Tree, at: Token, depth: int = 0) -> object:
        if tree.data == "list_value":
            self.check_depth(at, depth)
            return tuple(self.literal(c, at, depth + 1) for c in tree.children if isinstance(c, Tree))
        if tree.data == "true_value":
            return True
        if tree.data == "false_value":
            return False
        tok = tree.children[0]
        assert isinstance(tok, Token)
        if tree.data == "int_value":
            return self.integer(tok)
        if tree.data == "float_value":
            value = float(tok)
            if not math.isfinite(value):
                raise self.error(tok, f"number {str(tok)[:40]} is out of range (it overflows to infinity)")
            return value
        if tree.data == "string_value":
            return self.quoted(tok, str(tok))
        return self.symbol_text(tok)

    def integer(self, tok: Token) -> int:
        text = str(tok)
        # Check the length first: int() refuses very long digit strings with a ValueError of its own.
        if len(text.lstrip("-")) > 19 or not -_INT_LIMIT <= int(text) < _INT_LIMIT:
            raise self.error(tok, f"integer {text[:40]}{'...' if len(text) > 40 else ''} is out of the 64-bit range")
        return int(text)

    def quoted(self, tok: Token, text: str) -> str:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise self.error(tok, f"bad escape in quoted text {text[:40]!r}: {exc.msg}") from None
        assert isinstance(value, str)
        return value

    def symbol_text(self, tok: Token) -> str:
        body = str(tok)[1:]
        return self.quoted(tok, body) if body.startswith('"') else body

    def check_depth(self, at: Token, depth: int) -> None:
        if depth >= MAX_NESTING:
            raise self.error(at, f"the value of {str(at)!r} is nested deeper than {MAX_NESTING} levels")
