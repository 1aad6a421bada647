"""Planner benchmark: a 96-layer GPT-style model on 8, 64 and 1,024 V100s.

Prints, per cluster, the planning time (DP search, baselines, lowering + simulation of the best few)
and the iteration-time ratio of every baseline to our plan (> 1: our plan is faster). Times come
from the simulator where the cluster is small enough to simulate quickly, else from the cost model.

    .venv/bin/python bench/planner.py [--layers 96] [--simulate-up-to 64]
"""

from __future__ import annotations

import argparse
import functools
import time

from dapple_ir.cluster.toml_file import resolve_cluster
from dapple_ir.ir import Module, ModuleAttrs, Op, OpaqueType, OpAttrs, OpKind
from dapple_ir.pass_manager import PassManager, build_pipeline
from dapple_ir.passes.plan import lower_and_simulate
from dapple_ir.planner.baselines import BASELINES
from dapple_ir.planner.cost_model import problem_from_module
from dapple_ir.planner.search import Request, search

CLUSTERS = [("1x8xV100-16GB", 512), ("8x8xV100-16GB", 512), ("128x8xV100-16GB", 2048)]


def gpt_module(layers: int, hidden: int = 1024, seq: int = 512, vocab: int = 50257, batch: int = 1) -> Module:
    """A chain of `layers` transformer blocks between an embedding and an LM head, costed for one
    V100 at 50% of fp32 peak (a synthetic stand-in for a captured GPT: same shape of costs)."""
    flops_per_s = 0.5 * 15.7e12
    block_flops = batch * (24 * seq * hidden**2 + 4 * seq**2 * hidden)
    block_act = batch * (34 * seq * hidden * 2 + 5 * 16 * seq**2 * 2)
    hidden_bytes = batch * seq * hidden * 4

    def layer(name: str, prev: Op | None, flops: float, params: float, act: float, out: float) -> Op:
        attrs = OpAttrs(
            fwd_s=flops / flops_per_s, bwd_s=2 * flops / flops_per_s, act_bytes=act, out_bytes=out, param_bytes=params
        )
        return Op(name, OpKind.LAYER, [prev] if prev else [], OpaqueType(), target=name, attrs=attrs)

    ops = [layer("embed", None, 2 * batch * seq * hidden, vocab * hidden * 4, hidden_bytes, hidden_bytes)]
    for k in range(layers):
        ops.append(layer(f"block{k}", ops[-1], block_flops, 12 * hidden**2 * 4, block_act, hidden_bytes))
    head_flops = 2 * batch * seq * hidden * vocab
    ops.append(layer("lm_head", ops[-1], head_flops, vocab * hidden * 4, batch * seq * vocab * 4, 4.0))
    attrs = ModuleAttrs(batch=batch, cost_batch=batch, capture_method="profile", optimizer="adam")
    return Module(f"gpt{layers}", ops=ops, attrs=attrs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=96)
    parser.add_argument("--simulate-up-to", type=int, default=64, help="simulate plans on at most this many devices")
    args = parser.parse_args()
    names = list(BASELINES)
    header = f"{'cluster':<16} {'devices':>7} {'batch':>6} {'plan s':>7} {'ours ms':>9} {'by':<5} " + " ".join(
        f"{n[:12]:>12}" for n in names
    )
    print(f"96-layer GPT-style model ({args.layers} blocks + embedding + head), ratios = baseline time / ours")
    print(header)
    for cluster_name, global_batch in CLUSTERS:
        module = gpt_module(args.layers)
        PassManager(build_pipeline("coarsen{max-layers=128}")).run(module)
        cluster = resolve_cluster(cluster_name)
        problem = problem_from_module(module, cluster, global_batch)
        simulate = cluster.num_devices <= args.simulate_up_to
        start = time.perf_counter()
        score = functools.partial(lower_and_simulate, module) if simulate else None
        outcome = search(problem, Request(method="dp"), score)
        planning = time.perf_counter() - start
        ours = outcome.chosen.time_s
        ratios = []
        for name in names:
            found = BASELINES[name](problem)
            if found is None or not found[1].fits:
                ratios.append(f"{'no fit':>12}")
                continue
            theirs = lower_and_simulate(module, problem, found[0])[0] if simulate else found[1].iteration_s
            ratios.append(f"{theirs / ours:>12.2f}")
        by = "sim" if outcome.chosen.simulated_s is not None else "model"
        print(
            f"{cluster_name:<16} {cluster.num_devices:>7} {global_batch:>6} {planning:>7.2f} {ours * 1e3:>9.1f} "
            f"{by:<5} " + " ".join(ratios)
        )
        print(f"{'':<16} chosen: {outcome.chosen.cand.describe()[:200]}")


if __name__ == "__main__":
    main()
