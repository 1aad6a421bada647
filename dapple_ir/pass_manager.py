"""Runs a pipeline of passes over a module: verify after each, print, dump and time them."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from dapple_ir.errors import DappleError, PassError
from dapple_ir.ir import Module
from dapple_ir.ir.parser import parse_pipeline
from dapple_ir.ir.printer import print_module
from dapple_ir.ir.scale import collector_paused
from dapple_ir.ir.verifier import verify_module
from dapple_ir.plugins import load_builtins
from dapple_ir.registry import Pass, PassContext, lookup_pass


def build_pipeline(text: str) -> list[Pass]:
    """Passes from a pipeline string such as `annotate-cost,coarsen{max-layers=64}`."""
    load_builtins()
    return [lookup_pass(spec.name).from_options(spec.options) for spec in parse_pipeline(text)]


def pipeline_spec(passes: list[Pass]) -> str:
    """The pipeline string of `passes` (round-trips through `build_pipeline`)."""
    return ",".join(p.spec() for p in passes)


@dataclass
class PassManager:
    """Runs passes in order. Options mirror the `dapple opt` flags."""

    passes: list[Pass]
    verify: bool = True
    print_ir_after: set[str] = field(default_factory=set)
    print_ir_after_all: bool = False
    dump_dir: Path | None = None
    time_passes: bool = False
    out: TextIO = field(default_factory=lambda: sys.stderr)
    timings: list[tuple[str, float]] = field(default_factory=list)

    def run(self, module: Module, ctx: PassContext | None = None) -> Module:
        ctx = ctx or PassContext()
        if self.dump_dir is not None:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            self.dump(0, "input", module)
        if self.verify:
            self.verify_after(module, "the input")
        done: list[str] = []
        for number, p in enumerate(self.passes, start=1):
            start = time.perf_counter()
            try:
                self.apply(p, ctx, module)
            except DappleError as exc:
                raise PassError(f"pass '{p.spec()}' failed{_after(done)}: {exc}") from exc
            except Exception as exc:
                raise PassError(
                    f"pass '{p.spec()}' crashed{_after(done)} with {type(exc).__name__}: {exc} "
                    "(this is a bug in the pass; rerun with --debug for the traceback)"
                ) from exc
            seconds = time.perf_counter() - start
            self.timings.append((p.spec(), seconds))
            ctx.log(f"{p.name}: done in {seconds:.2f} s")
            done.append(p.spec())
            if self.verify and not p.verifies:  # it leaves unchanged what the manager verified before it
                self.verify_after(module, f"pass '{p.spec()}'")
            if self.print_ir_after_all or p.name in self.print_ir_after:
                self.out.write(f"// ----- IR after {p.spec()} -----\n{print_module(module)}")
            if self.dump_dir is not None:
                self.dump(number, p.name, module)
        if self.time_passes:
            self.report_times()
        return module

    def apply(self, p: Pass, ctx: PassContext, module: Module) -> None:
        """Run `p`. Where the manager verifies, it has verified the module right before (the input, or what the
        pass before left: a pass that `verifies` leaves it unchanged), so such a pass (`verify`) runs
        `apply_verified`."""
        if self.verify and p.verifies:
            p.apply_verified(ctx, module)
        else:
            p.apply(ctx, module)

    def verify_after(self, module: Module, what: str) -> None:
        try:
            with collector_paused():  # a thousand ranks' programs are millions of instructions to walk
                verify_module(module)
        except DappleError as exc:
            raise PassError(f"the IR after {what} does not verify: {exc}") from exc

    def dump(self, number: int, name: str, module: Module) -> None:
        assert self.dump_dir is not None
        (self.dump_dir / f"{number:03d}_{name}.dapple").write_text(print_module(module))

    def report_times(self) -> None:
        total = sum(t for _, t in self.timings) or 1e-12
        self.out.write("// ----- pass timings -----\n")
        for spec, seconds in self.timings:
            self.out.write(f"//  {seconds * 1000:10.2f} ms  {100 * seconds / total:5.1f}%  {spec}\n")
        self.out.write(f"//  {total * 1000:10.2f} ms  total\n")


def _after(done: list[str]) -> str:
    return f" (after {', '.join(done)})" if done else " (it was the first pass)"
