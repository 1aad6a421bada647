"""Passes and their registry: the `Pass` base class, `PassContext`, typed options and `register_pass`.

A pass is a frozen dataclass with a kebab-case `name`, its options as fields (snake_case fields are
kebab-case options; declare each with `option(default, doc)`) and `apply(ctx, module)`. Where passes
come from (the built-ins, the entry-point group, `--pass-plugin` files) is `dapple_ir.plugins`' job.

An option's text converts by the field's annotation:

- `int`, `float`, `str`; `bool` is `true` or `false` (also `1` or `0`);
- `X | None` is None when the option is left out with a None default, or written `auto`
  (so an `X | None` option cannot hold the text `auto` itself);
- `tuple[X, ...]` is items separated by `;` (`devices=0;1;2`; an empty text is the empty tuple).

Text with a comma, brace, space, quote or `=` goes in double quotes (`path="a b,c.json"`).
"""

from __future__ import annotations

import abc
import dataclasses
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dapple_ir.cluster.spec import ClusterSpec
from dapple_ir.cluster.toml_file import resolve_cluster
from dapple_ir.errors import PassOptionError
from dapple_ir.ir import Module

_KEBAB = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*\Z")
_BARE = re.compile(r'[^,{}\s"=]+')
#: The text an `X | None` option reads as None, and writes None as.
AUTO = "auto"
#: What separates the items of a `tuple[X, ...]` option.
ITEM_SEPARATOR = ";"
_SCALARS: tuple[type, ...] = (bool, int, float, str)

T = typing.TypeVar("T")


def option(default: T, doc: str) -> T:
    """An option field: its default and the one-line doc `dapple passes` and docs/passes.md show."""
    return dataclasses.field(default=default, metadata={"doc": doc})


@dataclass
class PassContext:
    """What passes share beyond the module: the cluster, a log, and reports for the user."""

    cluster: str | None = None
    """Cluster shorthand or TOML path, when the module does not name one."""
    log: Callable[[str], None] = lambda _message: None
    """Progress and diagnostic messages for the user (stderr in the CLI)."""
    reports: dict[str, list[str]] = field(default_factory=dict)
    """Human-readable reports by pass name (the planner's `--explain` lines, ...)."""
    clusters: dict[str, ClusterSpec] = field(default_factory=dict, repr=False)
    """Clusters resolved so far, by shorthand or file: each is read once per compile (`cluster_spec`)."""

    def cluster_spec(self, text: str) -> ClusterSpec:
        """The cluster `text` names (a shorthand or a TOML path), resolved once for every pass that asks."""
        found = self.clusters.get(text)
        if found is None:
            found = self.clusters[text] = resolve_cluster(text)
        return found


@dataclass(frozen=True)
class Pass(abc.ABC):
    """Base of all passes. Subclasses are frozen dataclasses whose fields are the options."""

    name: ClassVar[str] = ""
    verifies: ClassVar[bool] = False
    """True for a pass that runs `verify_module` itself and changes nothing (`verify`): a pass manager that verifies
    after every pass runs its `apply_verified` instead, and verifies nothing after it."""

    @abc.abstractmethod
    def apply(self, ctx: PassContext, module: Module) -> None:
        """Change `module` in place; raise a `DappleError` that names the culprit when it cannot."""

    def apply_verified(self, ctx: PassContext, module: Module) -> None:
        """`apply` on a module `verify_module` has just passed, changed by nothing since; by default `apply`."""
        self.apply(ctx, module)

    @classmethod
    def options(cls) -> list[dataclasses.Field]:  # type: ignore[type-arg]
        return list(dataclasses.fields(cls))

    @classmethod
    def summary(cls) -> str:
        """The first line of the pass's docstring."""
        return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""

    @classmethod
    def option_type(cls, field_name: str) -> Any:
        """The resolved annotation of an option's field (`int | None`, `tuple[str, ...]`, ...)."""
        return typing.get_type_hints(cls)[field_name]

    @classmethod
    def from_options(cls, options: dict[str, str]) -> Pass:
        """Build the pass from option strings (`{"max-layers": "64"}`), converting by field type."""
        by_option = {option_name(f.name): f for f in cls.options()}
        kwargs: dict[str, object] = {}
        for key, raw in options.items():
            if key not in by_option:
                valid = ", ".join(by_option) or "(none)"
                raise PassOptionError(f"pass '{cls.name}' has no option '{key}'; its options are: {valid}")
            f = by_option[key]
            kwargs[f.name] = _convert(cls.name, key, cls.option_type(f.name), raw)
        return cls(**kwargs)

    def spec(self) -> str:
        """The pipeline text that rebuilds this pass: options that differ from their defaults."""
        parts = []
        for f in self.options():
            value = getattr(self, f.name)
            if value == f.default:
                continue
            text = option_text(value)
            if not _BARE.fullmatch(text):
                text = '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
            parts.append(f"{option_name(f.name)}={text}")
        return self.name + ("{" + ",".join(parts) + "}" if parts else "")


def option_name(field_name: str) -> str:
    """The option a field is spelled as: kebab-case, a trailing `_` dropped (`from_` is `from`)."""
    return field_name.rstrip("_").replace("_", "-")


def option_text(value: object) -> str:
    """How a value is written in a pipeline string (before quoting): the inverse of the conversion."""
    if value is None:
        return AUTO
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ITEM_SEPARATOR.join(option_text(item) for item in value)
    return str(value)


def type_text(hint: Any) -> str:
    """An option type as the docs write it: `int`, `int | None`, `tuple[str, ...]`."""
    if isinstance(hint, type) and hint in _SCALARS:
        return hint.__name__
    optional = _optional_of(hint)
    if optional is not None:
        return f"{type_text(optional)} | None"
    item = _tuple_item(hint)
    if item is not None:
        return f"tuple[{type_text(item)}, ...]"
    return str(hint)


def _optional_of(hint: Any) -> Any | None:
    """X for `X | None` (or `Optional[X]`), else None."""
    if typing.get_origin(hint) not in (types.UnionType, typing.Union):
        return None
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if len(args) == 1 and len(typing.get_args(hint)) == 2 else None


def _tuple_item(hint: Any) -> Any | None:
    """X for `tuple[X, ...]`, else None."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return args[0]
    return None


def _supported(hint: Any) -> bool:
    inner = _optional_of(hint)
    inner = hint if inner is None else inner
    item = _tuple_item(inner)
    return (item if item is not None else inner) in _SCALARS


def _convert(pass_name: str, key: str, hint: Any, raw: str) -> object:
    """`raw` as a value of `hint`, or a PassOptionError naming the pass, option, type and text."""
    try:
        return _value(hint, raw)
    except ValueError:
        optional = _optional_of(hint)
        inner = hint if optional is None else optional
        item = _tuple_item(inner)
        wanted = type_text(inner) if item is None else f"{type_text(item)} values separated by '{ITEM_SEPARATOR}'"
        if optional is not None:
            wanted += f" or {AUTO}"
        raise PassOptionError(f"option '{key}' of pass '{pass_name}' must be {wanted}, not '{raw}'") from None


def _value(hint: Any, raw: str) -> object:
    optional = _optional_of(hint)
    if optional is not None:
        return None if raw == AUTO else _value(optional, raw)
    item = _tuple_item(hint)
    if item is not None:
        return tuple(_value(item, part) for part in raw.split(ITEM_SEPARATOR)) if raw else ()
    if hint is bool:
        if raw.lower() not in ("true", "false", "1", "0"):
            raise ValueError(raw)
        return raw.lower() in ("true", "1")
    if hint is int:
        return int(raw)
    if hint is float:
        return float(raw)
    return raw


_REGISTRY: dict[str, type[Pass]] = {}

P = typing.TypeVar("P", bound=type[Pass])


def register_pass(cls: P) -> P:
    """Class decorator that makes a pass available by its `name`."""
    if not _KEBAB.match(cls.name):
        raise PassOptionError(f"pass class {cls.__qualname__} needs a kebab-case `name`, not {cls.name!r}")
    # Look in the class itself: a plain subclass inherits its base's dataclass parameters.
    params = cls.__dict__.get("__dataclass_params__")
    if params is None or not params.frozen:
        raise PassOptionError(f"pass '{cls.name}' ({cls.__qualname__}) must be a frozen dataclass")
    if getattr(cls, "__abstractmethods__", None):
        raise PassOptionError(f"pass '{cls.name}' ({cls.__qualname__}) must define apply(self, ctx, module)")
    try:
        hints = typing.get_type_hints(cls)
    except Exception as exc:
        raise PassOptionError(f"pass '{cls.name}': its option annotations do not resolve ({exc})") from None
    for f in dataclasses.fields(cls):
        if not _supported(hints[f.name]):
            raise PassOptionError(
                f"option '{option_name(f.name)}' of pass '{cls.name}' has type {type_text(hints[f.name])}; "
                "options are int, float, bool, str, X | None or tuple[X, ...] of those"
            )
    _REGISTRY[cls.name] = cls
    return cls


def registered_passes() -> dict[str, type[Pass]]:
    """The passes registered so far, sorted by name (`dapple_ir.plugins.all_passes` loads the rest first)."""
    return dict(sorted(_REGISTRY.items()))


def lookup_pass(name: str) -> type[Pass]:
    """The registered pass called `name` (the pass manager loads built-ins and entry points first)."""
    if name not in _REGISTRY:
        raise PassOptionError(f"unknown pass '{name}'; registered passes are: {', '.join(registered_passes())}")
    return _REGISTRY[name]
