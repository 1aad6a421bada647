"""Names inside the capture wrapper, as the user knows them.

Capture wraps the model (as `model`) and a module loss function (as `loss_fn`) into one module, so
every name a trace records starts with one of the two; the IR drops the `model.` prefix.
"""

from __future__ import annotations

from typing import Any

#: Attribute names of the model and of a module loss function in the capture wrapper.
MODEL = "model"
LOSS = "loss_fn"
#: `node.meta` key of a `get_attr` or `call_module` node: the attribute's path in the wrapper
#: (`model.blocks.0.weight`), absent for constants that only the traced graph holds.
WRAPPER_PATH = "dapple_wrapper_path"


def scope(node: Any) -> tuple[str | None, str]:
    """(module path within the model, key of the module call) of the op.

    Ops outside the model are the loss computation (`loss_fn`); ops in the model's own forward
    have no path. The call key tells two calls of one module apart (a block applied twice).
    """
    if node.op == "call_module" and node.target == LOSS:
        return LOSS, LOSS
    stack = node.meta.get("nn_module_stack") or {}
    calls = [(key, value[0]) for key, value in stack.items() if value[0]]
    if not calls:
        return LOSS, LOSS
    key, path = calls[-1]
    if path == LOSS or path.startswith(LOSS + "."):
        return path, str(key)
    return model_path(path), str(key)


def op_path(node: Any) -> str | None:
    return scope(node)[0]


def strip_model(dotted: str) -> str:
    """A wrapper-level attribute name as the user knows it: `model.tok.weight` -> `tok.weight`."""
    return dotted.removeprefix(MODEL + ".")


def model_path(qualname: str) -> str | None:
    """A wrapper-level module name as the user knows it: `model.blocks.0` -> `blocks.0`."""
    if qualname == MODEL:
        return None
    return qualname.removeprefix(MODEL + ".")


def fetch(obj: Any, dotted: str) -> Any:
    """The attribute a dotted path names (`blocks.0.weight`)."""
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj
