"""When a capture method fails: what it says about the failure, torch's noise kept out of the way,
and the one error that names the culprit when no method worked."""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator
from typing import Any

from dapple_ir.errors import CaptureError
from dapple_ir.frontend.source_locations import user_frame


class MethodFailed(Exception):
    """One capture method failed; `auto` may try the other."""

    def __init__(self, method: str, exc: BaseException, module_path: str | None, where: str | None = None) -> None:
        super().__init__(method)
        self.method = method
        self.exc = exc
        self.module_path = module_path
        self.where = where or user_frame(exc)

    def describe(self) -> str:
        first = str(self.exc).strip().splitlines()
        text = first[0].rstrip(".") if first else ""
        if len(text) > 240:
            text = text[:240] + "..."
        place = []
        if self.module_path is not None:
            place.append(f"in module `{self.module_path or '(model)'}`")
        if self.where:
            place.append(f"at {self.where}")
        where = " " + " ".join(place) if place else ""
        return f"{self.method} failed{where}: {type(self.exc).__name__}: {text}"


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Torch logs failures (with tracebacks and whole graphs) and prints some; the error we raise says it better."""
    disabled = logging.root.manager.disable
    logging.disable(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logging.disable(disabled)


def combined_error(model: Any, failures: list[MethodFailed]) -> CaptureError:
    first = failures[0]
    culprit = f"module `{first.module_path}`" if first.module_path else "the model's own forward"
    if first.where:
        culprit += f" at {first.where}"
    methods = " and ".join(f.method for f in failures)
    tried = " ".join(f"({i + 1}) {f.describe()}." for i, f in enumerate(failures))
    text = f"cannot capture {type(model).__name__} with {methods}: the first failure is in {culprit}. {tried}"
    if [f.method for f in failures] == ["fx"]:
        text += (
            " Try method export (or auto): it runs the Python code, so it follows branches and loops on "
            "shapes that fx cannot."
        )
    if any(_data_dependent(f.exc) for f in failures if f.method == "export"):
        text += (
            " The model branches or loops on tensor values (data-dependent control flow), which no static "
            "graph can hold: use torch.where, or move the decision out of forward."
        )
    return CaptureError(text)


def _data_dependent(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return "data-dependent" in text or "datadependent" in text or "data dependent" in text
