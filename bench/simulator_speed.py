"""How fast `dapple_ir.sim.simulator.simulate` runs on large plans (the issue asks: 64 ranks x 256 microbatches
well under a second).

Programs come from the real passes (`schedule`, `lower-comm`, `insert-frees`) over a synthetic chain of
equal stages on 8-GPU V100 servers; only `simulate` is timed. Prints the median wall and CPU time over
repeats (on a shared machine the wall clock also counts other processes). `--picture PATH` also draws
the README's example timeline: 8 ranks on two 4-GPU servers, 16 microbatches, 1f1b.

    .venv/bin/python bench/simulator_speed.py [--repeats 5] [--picture docs/img/timeline-example.png]
"""

from __future__ import annotations

import argparse
import statistics
import time

from dapple_ir.ir import Module, ModuleAttrs, Op, OpAttrs, OpKind, Param, Stage, StageAttrs, TensorType
from dapple_ir.pass_manager import PassManager, build_pipeline
from dapple_ir.registry import PassContext
from dapple_ir.sim.simulator import simulate

CASES = [("1f1b", 8, 16), ("1f1b", 16, 64), ("gpipe", 64, 256), ("1f1b", 64, 256), ("zb-h1", 64, 256)]


def chain(
    stages: int,
    shape: tuple[int, ...] = (32, 1024),
    fwd_s: float = 1e-3,
    act_bytes: float = 4e6,
    param_shape: tuple[int, ...] = (1024, 1024),
) -> Module:
    """`stages` equal single-op stages of a linear chain, each with a parameter, on devices 0..stages-1.

    Backward takes twice the forward time; `shape` is the value passed between stages (batch first).
    """
    t = TensorType("f32", shape)
    x = Op("x", OpKind.INPUT, [], t)
    ops, params = [x], []
    for k in range(stages):
        params.append(Param(f"w{k}", TensorType("f32", param_shape)))
        attrs = OpAttrs(fwd_s=fwd_s, bwd_s=2 * fwd_s, act_bytes=act_bytes, params=(f"w{k}",))
        ops.append(Op(f"h{k}", OpKind.CALL_MODULE, [ops[-1]], t, f"l{k}", attrs))
    loss = Op("loss", OpKind.OUTPUT, [ops[-1]], t)
    groups = [[op] for op in ops[1:]]
    groups[0].insert(0, x)
    groups[-1].append(loss)
    stage_list = [Stage(f"s{k}", g, StageAttrs(replicas=1, devices=(k,))) for k, g in enumerate(groups)]
    attrs = ModuleAttrs(batch=shape[0], cost_batch=shape[0], microbatch_size=shape[0], optimizer="adam")
    return Module("chain", params, [*ops, loss], stages=stage_list, attrs=attrs)


def lower(module: Module, kind: str, microbatches: int) -> Module:
    spec = f"schedule{{kind={kind},microbatches={microbatches}}},lower-comm,insert-frees"
    PassManager(build_pipeline(spec), verify=False).run(module, PassContext())
    return module


def example_picture(path: str) -> None:
    """8 GPT-sized stages (4 x 1024 x 1600 activations) on 2 servers of 4 V100s, 16 microbatches, 1f1b."""
    from dapple_ir.sim.drawing import draw_timeline
    from dapple_ir.sim.trace import from_simulation

    module = lower(chain(8, (4, 1024, 1600), 0.04, 1.5e9, (1600, 6400)), "1f1b", 16)
    module.name = "gpt-like"
    result = simulate(module, cluster="2x4xV100-16GB")
    draw_timeline(from_simulation(result), path)
    print(result.summary())
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--picture", metavar="PATH", help="also draw the example timeline (8 ranks, 16 mb) here")
    args = parser.parse_args()
    if args.picture:
        example_picture(args.picture)
    header = f"{'schedule':>9} {'ranks':>6} {'microbatches':>13} {'instructions':>13} {'wall s':>8} {'cpu s':>8}"
    print(header + f" {'Minstr/s':>9}")
    for kind, ranks, microbatches in CASES:
        module = lower(chain(ranks), kind, microbatches)
        cluster = f"{max(1, ranks // 8)}x{min(ranks, 8)}xV100-16GB"
        wall, cpu = [], []
        for _ in range(args.repeats):
            start, start_cpu = time.perf_counter(), time.process_time()
            simulate(module, cluster=cluster)
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        median, median_cpu = statistics.median(wall), statistics.median(cpu)
        count = sum(len(p.instrs) for p in module.programs)
        rate = count / median_cpu / 1e6
        print(f"{kind:>9} {ranks:>6} {microbatches:>13} {count:>13} {median:>8.3f} {median_cpu:>8.3f} {rate:>9.2f}")


if __name__ == "__main__":
    main()
