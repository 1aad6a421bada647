"""Captures and planner searches that several test modules check, made once per test process: each costs
seconds, and the modules only read them (`lower_and_simulate` restores the ops it prices)."""

from __future__ import annotations

import functools

from dapple_ir.cluster.toml_file import resolve_cluster
from dapple_ir.frontend.profile_import import import_profile
from dapple_ir.ir import Module
from dapple_ir.pass_manager import PassManager, build_pipeline
from dapple_ir.passes.plan import lower_and_simulate
from dapple_ir.planner.cost_model import Problem, problem_from_module
from dapple_ir.planner.search import Outcome, Request, search
from tests.paths import PROFILES

VGG19 = PROFILES / "dapple-vgg-19-pbs-32.txt"


@functools.cache
def captured(spec: str) -> Module:
    """`spec` captured on the meta device (callers that change it deep-copy it first)."""
    from dapple_ir.frontend.spec_loader import capture_spec

    return capture_spec(spec, device="meta")


@functools.cache
def vgg19_search(global_batch: int) -> tuple[Module, Problem, Outcome]:
    """DAPPLE's VGG-19 profile (Adam, coarsened) on its 2x8 V100 servers, searched as `dapple compile`
    does: every request default, the best candidates ranked by the simulator."""
    module = import_profile(str(VGG19))
    module.attrs.optimizer = "adam"
    PassManager(build_pipeline("coarsen")).run(module)
    problem = problem_from_module(module, resolve_cluster("2x8xV100-16GB"), global_batch)
    return module, problem, search(problem, Request(), functools.partial(lower_and_simulate, module))
