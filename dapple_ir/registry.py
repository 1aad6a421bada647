"""Passes and their registry.

A pass is a frozen dataclass with a kebab-case `name`, its options as fields (snake_case fields are
kebab-case options) and `apply(ctx, module)`. Register one with `@register_pass`, from a plugin file
(`--pass-plugin file.py`) or through the entry-point group `dapple_ir.passes`.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import re
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from dapple_ir.errors import PassOptionError
from dapple_ir.ir import Module

_KEBAB = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*\Z")
ENTRY_POINT_GROUP = "dapple_ir.passes"


@dataclass
class PassContext:
    """What passes share beyond the module: the cluster, a log, and reports for the user."""

    cluster: str | None = None
    """Cluster shorthand or TOML path, when the module does not name one."""
    log: Callable[[str], None] = lambda _message: None
    """Progress and diagnostic messages for the user (stderr in the CLI)."""
    reports: dict[str, list[str]] = field(default_factory=dict)
    """Human-readable reports by pass name (the planner's `--explain` lines, ...)."""


@dataclass(frozen=True)
class Pass:
    """Base of all passes. Subclasses are frozen dataclasses whose fields are the options."""

    name: ClassVar[str] = ""

    def apply(self, ctx: PassContext, module: Module) -> None:
        raise NotImplementedError

    @classmethod
    def options(cls) -> list[dataclasses.Field]:  # type: ignore[type-arg]
        return list(dataclasses.fields(cls))

    @classmethod
    def summary(cls) -> str:
        """The first line of the pass's docstring."""
        return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""

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
            kwargs[f.name] = _convert(cls.name, key, _field_kind(cls, f.name), raw)
        return cls(**kwargs)  # type: ignore[arg-type]

    def spec(self) -> str:
        """The pipeline text that rebuilds this pass: options that differ from their defaults."""
        parts = []
        for f in self.options():
            value = getattr(self, f.name)
            if value == f.default:
                continue
            text = str(value).lower() if isinstance(value, bool) else str(value)
            if not re.fullmatch(r'[^,{}\s"=]+', text):
                text = '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
            parts.append(f"{option_name(f.name)}={text}")
        return self.name + ("{" + ",".join(parts) + "}" if parts else "")


def option_name(field_name: str) -> str:
    """The option a field is spelled as: kebab-case, a trailing `_` dropped (`from_` is `from`)."""
    return field_name.rstrip("_").replace("_", "-")


def _field_kind(cls: type, name: str) -> str:
    return str(typing.get_type_hints(cls)[name])


def _convert(pass_name: str, key: str, kind: str, raw: str) -> object:
    try:
        if "bool" in kind:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1")
        if "int" in kind:
            return int(raw)
        if "float" in kind:
            return float(raw)
    except ValueError:
        wanted = kind.replace("<class '", "").replace("'>", "")
        raise PassOptionError(f"option '{key}' of pass '{pass_name}' must be {wanted}, not '{raw}'") from None
    return raw


_REGISTRY: dict[str, type[Pass]] = {}
_loaded = {"builtins": False}

P = typing.TypeVar("P", bound=type[Pass])


def register_pass(cls: P) -> P:
    """Class decorator that makes a pass available by its `name`."""
    if not _KEBAB.match(cls.name):
        raise PassOptionError(f"pass class {cls.__qualname__} needs a kebab-case `name`, not {cls.name!r}")
    # Look in the class itself: a plain subclass inherits its base's dataclass parameters.
    params = cls.__dict__.get("__dataclass_params__")
    if params is None or not params.frozen:
        raise PassOptionError(f"pass '{cls.name}' ({cls.__qualname__}) must be a frozen dataclass")
    _REGISTRY[cls.name] = cls
    return cls


def _load_builtins() -> None:
    if _loaded["builtins"]:
        return
    _loaded["builtins"] = True
    importlib.import_module("dapple_ir.passes")
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        entry.load()


def all_passes() -> dict[str, type[Pass]]:
    """Every registered pass by name, built-ins and entry points included, sorted by name."""
    _load_builtins()
    return dict(sorted(_REGISTRY.items()))


def lookup_pass(name: str) -> type[Pass]:
    passes = all_passes()
    if name not in passes:
        raise PassOptionError(f"unknown pass '{name}'; registered passes are: {', '.join(passes)}")
    return passes[name]


def load_plugin(path: str | Path) -> None:
    """Execute a Python file whose `@register_pass` classes then join the registry."""
    path = Path(path)
    if not path.is_file():
        raise PassOptionError(f"pass plugin {path} does not exist")
    module_name = f"dapple_ir_plugin_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
