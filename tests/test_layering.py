"""The architecture, checked: which package may import which, where torch may appear, and that
planning a published profile never loads torch. docs/architecture.md explains the layers."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import PROFILES, ROOT

#: Source folder of each installed package (setup.cfg maps `passes/`, `backends/`, `grammars/`).
SOURCES = {
    "dapple_ir": ROOT / "dapple_ir",
    "dapple_ir.passes": ROOT / "passes",
    "dapple_ir.backends": ROOT / "backends",
}

_BASE = {"errors", "units"}
#: What each part may import from dapple_ir (its own part is always allowed). Read bottom-up: the IR
#: knows nothing above it; analysis knows the IR and the cluster; the planner and the simulator know
#: analysis; passes know them all; api, cli and commands sit on top; frontend and backend bring torch.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "units": set(),
    "ir": _BASE | {"grammars"},
    "plan_dir": _BASE | {"ir"},
    "cluster": _BASE | {"ir"},
    "schedules": _BASE | {"ir"},
    "analysis": _BASE | {"ir", "cluster", "schedules"},
    "pricing": _BASE | {"ir", "cluster", "schedules", "analysis"},
    "planner": _BASE | {"ir", "cluster", "schedules", "analysis", "pricing"},
    "sim": _BASE | {"ir", "cluster", "schedules", "analysis", "plan_dir", "pricing"},
    "registry": _BASE | {"ir", "cluster"},
    "plugins": _BASE | {"ir", "registry"},
    "pass_manager": _BASE | {"ir", "registry", "plugins"},
    "passes": _BASE | {"ir", "cluster", "schedules", "analysis", "pricing", "planner", "sim", "registry"},
    "frontend": _BASE | {"ir", "cluster", "pricing"},
    "backends": _BASE | {"ir", "analysis", "plan_dir", "sim", "frontend"},
}
#: The top: may import anything.
TOP = {"__init__", "api", "cli", "commands"}
#: Where torch may be imported (at module top).
TORCH_PARTS = {"frontend", "backends"}
#: Modules of those parts that must stay torch-free, so profiles plan without torch.
TORCH_FREE = {"dapple_ir.frontend", "dapple_ir.frontend.profile_import", "dapple_ir.frontend.spec_loader"}


def _modules() -> list[tuple[str, Path]]:
    found = []
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found.append((".".join([package, *parts]), path))
    return found


MODULES = _modules()


def part_of(module: str) -> str:
    """`dapple_ir.planner.dp` -> `planner`; `dapple_ir.passes.plan` -> `passes`; `dapple_ir` -> `__init__`."""
    rest = module.split(".")[1:]
    return rest[0] if rest else "__init__"


def imports_of(path: Path, module: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module top) for every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (path.name == "__init__.py")]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" for alias in node.names] if base == "dapple_ir" else [base]
            found += [(name, node.lineno, id(node) in top) for name in names]
    return found


def _in_type_checking(path: Path) -> set[int]:
    """Lines of imports under `if TYPE_CHECKING:` (annotations only, never executed)."""
    tree = ast.parse(path.read_text())
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            lines |= {n.lineno for n in ast.walk(node) if isinstance(n, ast.Import | ast.ImportFrom)}
    return lines


def test_the_layering_table_covers_every_part() -> None:
    parts = {part_of(module) for module, _ in MODULES}
    assert parts <= set(ALLOWED) | TOP, f"parts with no layering rule: {sorted(parts - set(ALLOWED) - TOP)}"


@pytest.mark.parametrize(("module", "path"), MODULES, ids=[m for m, _ in MODULES])
def test_imports_follow_the_layers(module: str, path: Path) -> None:
    part = part_of(module)
    if part in TOP:
        return
    allowed = ALLOWED[part] | {part}
    typing_only = _in_type_checking(path)
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {name} ({part_of(name)} is not below {part})"
        for name, line, _ in imports_of(path, module)
        if name.startswith("dapple_ir.") and part_of(name) not in allowed and line not in typing_only
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(("module", "path"), MODULES, ids=[m for m, _ in MODULES])
def test_torch_only_in_the_frontend_and_the_backend_at_module_top(module: str, path: Path) -> None:
    torch_imports = [(line, top) for name, line, top in imports_of(path, module) if name.split(".")[0] == "torch"]
    where = f"{path.relative_to(ROOT)}"
    if part_of(module) not in TORCH_PARTS or module in TORCH_FREE:
        assert not torch_imports, (
            f"{where}:{torch_imports[0][0]} imports torch, which only the frontend and backend may"
        )
        return
    inner = [line for line, top in torch_imports if not top]
    assert not inner, f"{where}: torch imported inside a function at line(s) {inner}; import it at the top"


def test_no_pass_imports_another_pass() -> None:
    for module, path in MODULES:
        if part_of(module) != "passes":
            continue
        others = [n for n, _, _ in imports_of(path, module) if n.startswith("dapple_ir.passes.") and n != module]
        assert not others, f"{path.relative_to(ROOT)} imports another pass: {others}"


def test_planning_and_simulating_a_profile_never_imports_torch(tmp_path: Path) -> None:
    script = f"""
import sys
from dapple_ir.api import compile
from dapple_ir.sim.simulator import simulate
compile("profile:{PROFILES / "dapple-vgg-19-pbs-32.txt"}", cluster="2x8xV100-16GB", global_batch=256,
        out_dir="{tmp_path / "plan"}")
simulate("{tmp_path / "plan"}")
from dapple_ir.cli import main
assert main(["simulate", "{tmp_path / "plan"}", "--no-picture"]) == 0
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout
