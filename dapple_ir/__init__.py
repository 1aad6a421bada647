"""dapple-ir: a compiler for synchronous pipeline-parallel training (after DAPPLE).

The public API is small; each entry is imported on first use so that `import dapple_ir` stays
free of torch:

    capture(model, example_inputs, ...)  -> Captured           (dapple_ir.frontend.capture)
    compile(model_spec, cluster=..., global_batch=..., ...)    (dapple_ir.api)
    simulate(module_or_plan_dir, ...)    -> SimulationResult   (dapple_ir.sim.simulator)
    run(plan_dir, steps=..., ...)                              (dapple_ir.backends.torch.launch)
    parse_module(text), print_module(module), verify_module(module)
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "capture": "dapple_ir.frontend.capture",
    "compile": "dapple_ir.api",
    "simulate": "dapple_ir.sim.simulator",
    "run": "dapple_ir.backends.torch.launch",
    "parse_module": "dapple_ir.ir.parser",
    "print_module": "dapple_ir.ir.printer",
    "verify_module": "dapple_ir.ir.verifier",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dapple_ir' has no attribute {name!r}")
