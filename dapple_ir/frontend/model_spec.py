"""Model specs: how the command line names a model.

A spec is `path/to/file.py:factory` or `package.module:factory`. `factory()` takes no arguments
and returns `(model, example_inputs)`, optionally followed by a loss function
`loss_fn(output, *targets)` and then the example targets:

    def factory():
        model = MyModel()
        return model, (torch.randn(8, 16),), F.mse_loss, (torch.randn(8, 4),)

`example_inputs` is a tuple of positional tensors, or a dict of keyword arguments; a single tensor
stands for a one-tuple. A model whose forward returns a scalar loss, or a dict with a `"loss"`
entry, needs no loss function. `hf:path/config.json` names a Hugging Face config that `hf_config`
builds with its task head and example inputs. `profile:path/graph.txt` names an imported per-layer profile
instead of a model; `spec_loader.capture_spec` reads those without this module, which needs torch.

Under `device="meta"` the factory runs inside `with torch.device("meta")`, so no weights take real
memory; under `device="cpu"` it runs after `torch.manual_seed(seed)`, so that every process that
loads the spec (the pipeline ranks and the single-device reference) gets the same initial weights.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from dapple_ir.errors import CaptureError
from dapple_ir.frontend.capture import Captured, capture
from dapple_ir.frontend.hf_config import build_from_config
from dapple_ir.frontend.hf_spec import is_hf_spec, parse_hf_spec
from dapple_ir.frontend.profile_import import import_profile_spec, is_profile_spec
from dapple_ir.ir import Module


@dataclass
class FactoryResult:
    """What a model spec's factory returned, checked and normalised."""

    model: Any
    """The `torch.nn.Module` to train."""
    example_inputs: tuple[Any, ...]
    """Positional example inputs (empty when the model takes keyword arguments only)."""
    example_kwargs: dict[str, Any] | None
    """Keyword example inputs, when the factory returned a dict."""
    loss_fn: Any | None
    """`loss_fn(output, *targets)`, or None when the model returns its loss."""
    example_targets: tuple[Any, ...]
    """Example targets passed to `loss_fn` after the model output."""
    source: str
    """The spec it came from."""


def load_model_spec(
    spec: str, *, device: str = "cpu", seed: int = 0, profile_batch: int | None = None
) -> FactoryResult | Module:
    """Resolve `spec` and call its factory; a `profile:` spec returns the imported `Module`."""
    if is_profile_spec(spec):
        return import_profile_spec(spec, profile_batch)
    if device not in ("cpu", "meta"):
        raise CaptureError(f"model spec {spec}: device must be 'cpu' or 'meta', not {device!r}")
    with _hard_exits_refused(spec):
        return _call_factory(spec, device, seed)


def _call_factory(spec: str, device: str, seed: int) -> FactoryResult:
    factory = _resolve_factory(spec)
    try:
        if device == "meta":
            with torch.device("meta"):
                result = factory()
        else:
            torch.manual_seed(seed)
            result = factory()
    except CaptureError:
        raise
    except SystemExit as exc:
        raise CaptureError(f"model spec {spec}: the factory {_exited(exc)}; {_SHAPE_HINT}, it must not exit") from None
    except Exception as exc:
        raise CaptureError(f"model spec {spec}: the factory raised {type(exc).__name__}: {exc}") from exc
    return _check_result(spec, result)


class _HardExit(BaseException):
    """`os._exit` called by the model spec's code (a BaseException, as SystemExit: `except Exception` passes it)."""

    def __init__(self, status: object, where: str) -> None:
        super().__init__(status, where)
        self.status, self.where = status, where


@contextmanager
def _hard_exits_refused(spec: str) -> Iterator[None]:
    """While the spec's file is imported and its factory runs, `os._exit` raises instead of ending the process:
    it skips every handler, so `dapple compile` would end with status 0, no plan and no word (`sys.exit` is a
    `SystemExit`, caught where the code runs). A signal the code sends itself is not caught."""

    def refuse(status: object = 0) -> NoReturn:
        caller = sys._getframe(1)
        raise _HardExit(status, f"{caller.f_code.co_filename}:{caller.f_lineno}")

    hard_exit = os._exit
    os._exit = refuse
    try:
        yield
    except _HardExit as exc:
        raise CaptureError(
            f"model spec {spec}: {exc.where} called os._exit({exc.status!r}), which would end the process at once "
            f"with no message; {_SHAPE_HINT}, it must not exit"
        ) from None
    finally:
        os._exit = hard_exit


def _exited(exc: SystemExit) -> str:
    """What a `SystemExit` says, for a message: the process would have ended, silently, with that status."""
    return f"called sys.exit({exc.code!r}), which would end the process with no message"


def capture_loaded(
    loaded: FactoryResult, *, method: str = "auto", annotate_costs: bool = True, trace_device: str | None = None
) -> Captured:
    """Capture what a factory returned (`capture` with the spec recorded as the source)."""
    return capture(
        loaded.model,
        loaded.example_inputs,
        example_kwargs=loaded.example_kwargs,
        loss_fn=loaded.loss_fn,
        example_targets=loaded.example_targets,
        method=method,
        source=loaded.source,
        annotate_costs=annotate_costs,
        trace_device=trace_device,
    )


# ------------------------------------------------------------------------------------- resolve


def _resolve_factory(spec: str) -> Any:
    if is_hf_spec(spec):
        hf = parse_hf_spec(spec)
        return lambda: build_from_config(hf, spec)
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise CaptureError(
            f"model spec {spec!r} is not of the form path/to/file.py:factory or package.module:factory "
            "(the part after the last ':' names a function returning (model, example_inputs[, loss_fn[, targets]]))"
        )
    module = _load_file(spec, where) if where.endswith(".py") or "/" in where else _import(spec, where)
    if not hasattr(module, attr):
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise CaptureError(
            f"model spec {spec}: {where} has no attribute {attr!r}; callables it defines: {', '.join(public) or 'none'}"
        )
    factory = getattr(module, attr)
    if not callable(factory):
        raise CaptureError(f"model spec {spec}: {where}:{attr} is a {type(factory).__name__}, not a function")
    return factory


#: Attribute of a loaded spec file's module: the file's modification time when it was loaded.
_STAMP = "__dapple_mtime_ns__"


def _load_file(spec: str, where: str) -> Any:
    path = Path(where)
    if not path.is_file():
        raise CaptureError(f"model spec {spec}: file {where} does not exist (relative to {Path.cwd()})")
    name = f"_dapple_spec_{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]}"
    # A file edited since this process loaded it is loaded again (a long-lived process sees the edit).
    stamp = path.stat().st_mtime_ns
    if name in sys.modules and getattr(sys.modules[name], _STAMP, None) == stamp:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise CaptureError(f"model spec {spec}: cannot load {where} as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    setattr(module, _STAMP, stamp)
    # Registered before running so that dataclasses and pickling inside the file find their module.
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except SystemExit as exc:
        del sys.modules[name]
        raise CaptureError(f"model spec {spec}: importing {where} {_exited(exc)}") from None
    except Exception as exc:
        del sys.modules[name]
        raise CaptureError(f"model spec {spec}: importing {where} raised {type(exc).__name__}: {exc}") from exc
    return module


def _import(spec: str, where: str) -> Any:
    # Console scripts do not put the current directory on sys.path; `python -m` does. Be like the latter.
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as exc:
        raise CaptureError(
            f"model spec {spec}: no module named {exc.name!r}; give a file path (model.py:factory) or a module "
            "importable from the current directory"
        ) from exc
    except SystemExit as exc:
        raise CaptureError(f"model spec {spec}: importing {where} {_exited(exc)}") from None
    except Exception as exc:
        raise CaptureError(f"model spec {spec}: importing {where} raised {type(exc).__name__}: {exc}") from exc


# --------------------------------------------------------------------------------------- check

_SHAPE_HINT = "a factory returns (model, example_inputs[, loss_fn[, example_targets]])"


def _check_result(spec: str, result: Any) -> FactoryResult:
    if not isinstance(result, tuple) or not 2 <= len(result) <= 4:
        got = f"a {len(result)}-tuple" if isinstance(result, tuple) else f"a {type(result).__name__}"
        raise CaptureError(f"model spec {spec}: the factory returned {got}; {_SHAPE_HINT}")
    model, inputs = result[0], result[1]
    loss_fn = result[2] if len(result) > 2 else None
    targets = result[3] if len(result) > 3 else ()
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(
            f"model spec {spec}: the first item the factory returned is a {type(model).__name__}, not a "
            f"torch.nn.Module; {_SHAPE_HINT}"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise CaptureError(
            f"model spec {spec}: the third item (loss_fn) is a {type(loss_fn).__name__}, not callable; {_SHAPE_HINT}"
        )
    kwargs: dict[str, Any] | None = None
    if isinstance(inputs, dict):
        kwargs, inputs = dict(inputs), ()
    elif isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    elif isinstance(inputs, list):
        inputs = tuple(inputs)
    if not isinstance(inputs, tuple):
        raise CaptureError(
            f"model spec {spec}: example_inputs is a {type(inputs).__name__}; give a tuple of tensors "
            "(positional arguments) or a dict (keyword arguments)"
        )
    if isinstance(targets, torch.Tensor):
        targets = (targets,)
    if not isinstance(targets, tuple | list):
        raise CaptureError(f"model spec {spec}: example_targets is a {type(targets).__name__}; give a tuple of tensors")
    if targets and loss_fn is None:
        raise CaptureError(f"model spec {spec}: the factory gives example targets but no loss_fn to use them")
    return FactoryResult(model, inputs, kwargs, loss_fn, tuple(targets), spec)
