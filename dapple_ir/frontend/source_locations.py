"""Source locations: the `file:line` of the user's code behind an op or an error.

A frame is the user's unless it lies in dapple_ir (with its mapped packages `passes` and
`backends`), torch, Python's standard library or the environment's launcher scripts, or is
generated code (`<string>`). An op of a module with no forward of the user's own (the layers of an
`nn.Sequential`) is therefore placed at the user's line that captured the model.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys
import sysconfig
import traceback
import types
from typing import Any

import torch

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
#: Third-party packages can sit below the standard library's directory; their frames can be the user's.
_THIRD_PARTY = ("site-packages", "dist-packages")


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    """Directories whose frames are never the user's (each with a trailing separator)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # dapple_ir/
    dirs = [os.path.dirname(torch.__file__), package, sysconfig.get_paths()["scripts"]]
    for mapped in ("dapple_ir.passes", "dapple_ir.backends"):
        spec = importlib.util.find_spec(mapped)
        dirs += list(spec.submodule_search_locations or ()) if spec else []
    return tuple(os.path.join(d, "") for d in dirs)


@functools.cache
def _stdlib_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple(os.path.join(paths[key], "") for key in ("stdlib", "platstdlib"))


@functools.cache
def is_user_file(filename: str) -> bool:
    if filename.startswith("<") or filename.startswith(_library_dirs()):
        return False
    return not filename.startswith(_stdlib_dirs()) or any(part in filename for part in _THIRD_PARTY)


@functools.cache
def _short(filename: str) -> str:
    rel = os.path.relpath(filename)
    return filename if rel.startswith("..") else rel


def caller_location() -> str | None:
    """`file:line` of the innermost user frame of the running call stack."""
    # Walking frames is far cheaper than fx's own stack-trace recording.
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and not is_user_file(frame.f_code.co_filename):
        frame = frame.f_back
    return None if frame is None else f"{_short(frame.f_code.co_filename)}:{frame.f_lineno}"


def location(node: Any) -> str | None:
    """`file:line` of the innermost user frame in a graph node's recorded location or stack trace."""
    if "loc" in node.meta:
        return str(node.meta["loc"])
    trace = node.stack_trace or node.meta.get("stack_trace") or ""
    frames = [(f, int(line)) for f, line in _FRAME.findall(trace) if is_user_file(f)]
    if not frames:
        return None
    filename, line = frames[-1]
    return f"{_short(filename)}:{line}"


def user_frame(exc: BaseException) -> str | None:
    """`file:line \\`code\\`` of the innermost user frame where an exception passed."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if is_user_file(f.filename)]
    if not frames:
        return None
    frame = frames[-1]
    code = f" `{frame.line.strip()}`" if frame.line else ""
    return f"{_short(frame.filename)}:{frame.lineno}{code}"
