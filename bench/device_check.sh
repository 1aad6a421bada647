#!/usr/bin/env bash
# The short check to run when a GPU machine is lent (a few minutes; prints one table):
#   1. runtime --check on CUDA: a small GPT plan trained pipelined vs on one device (NCCL through
#      torchrun when there are 2+ GPUs, else every rank as a thread on the one GPU);
#   2. memory on CUDA: allocator peak (torch.cuda.max_memory_allocated) of gpipe and 1f1b plans
#      as M grows, against the IR's static prediction;
#   3. one compile of a large model (GPT-2 XL size, 48 layers, meta device) for 4x8 H100s;
#   4. our runtime vs torch.distributed.pipelining with NCCL (bench/runtime_vs_torch_pipelining.py
#      --device cuda: MLP and GPT, 2 ranks, gpipe/1f1b/zb-h1), when there is one GPU per rank.
# Usage:  bash bench/device_check.sh            (from anywhere; exits 2 at once without CUDA)
#         DEVICE_CHECK_DEVICE=cpu bash bench/device_check.sh   (dry run of the same steps on CPU)
# On a bare GPU machine (python3 with torch, no .venv) the checkout is installed into /tmp first; its
# image lacks lark and ortools, so carry their wheels in .whl/ (see /work/.library/device/README.md):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl lark==1.3.1 ortools==9.15.6755 immutabledict==4.3.1
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
DEVICE=${DEVICE_CHECK_DEVICE:-cuda}

if [ "$DEVICE" = "cuda" ]; then
  if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "device_check: no CUDA device is visible to torch (torch.cuda.is_available() is False)." >&2
    echo "device_check: run it on a GPU machine, or DEVICE_CHECK_DEVICE=cpu for a dry run on CPU." >&2
    exit 2
  fi
fi

if ! "$PY" -c 'import dapple_ir.passes, lark' 2>/dev/null; then
  echo "device_check: dapple_ir is not importable by $PY; installing the carried wheels and this checkout into /tmp" >&2
  if [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/dapple-site .
  export PYTHONPATH="/tmp/dapple-site:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" -c 'import dapple_ir.passes, lark' || { echo "device_check: still cannot import dapple_ir (lark missing?)" >&2; exit 3; }
fi

exec timeout 540 "$PY" - "$DEVICE" <<'PYTHON'
import copy
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

import dapple_ir
from dapple_ir.frontend.spec_loader import capture_spec
from dapple_ir.ir.structure import structure_hash
from dapple_ir.plan_dir import write_plan_json
from dapple_ir.analysis.peak_memory import program_peak

device = sys.argv[1]
gpus = torch.cuda.device_count() if device == "cuda" else 0
# NCCL needs a GPU per rank: with one GPU the check runs its 2 ranks as threads sharing it, and the
# memory measurement (one allocator per device) uses a single rank.
multi = device == "cpu" or gpus >= 2
check_transport = "torchrun" if multi else "threads"
ranks = 2 if multi else 1
transport = "torchrun" if multi else "threads"
kind = "H100" if device == "cuda" else "cpu"
rows: list[tuple[str, str, str]] = []
work = Path(tempfile.mkdtemp(prefix="dapple-device-check-"))
name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
nccl = ".".join(map(str, torch.cuda.nccl.version())) if device == "cuda" else "-"
rows.append(("machine", f"{name} x {gpus or 1}", f"torch {torch.__version__}, NCCL {nccl}"))


def step(label: str, setting: str, body) -> None:
    started = time.time()
    try:
        rows.append((label, setting, f"{body()}  [{time.time() - started:.0f} s]"))
    except Exception as exc:  # one failed check must not hide the others
        first = str(exc).splitlines()[0][:150] if str(exc) else type(exc).__name__
        rows.append((label, setting, f"FAILED: {first}"))


# 1. the runtime's --check: pipelined training equals single-device training
def runtime_check() -> str:
    plan = work / "gpt-check"
    dapple_ir.compile("examples/gpt.py:factory", cluster=f"2x{kind}", global_batch=16, stages=2, microbatches=4,
                      schedule="1f1b", optimizer="adam", out_dir=plan)
    result = dapple_ir.run(plan, steps=3, check=True, transport=check_transport, device=device, optimizer="adam",
                           lr=1e-3)
    c = result.check
    assert c is not None
    verdict = "PASS" if c.ok else "FAIL"
    peaks = "/".join(f"{b / 2**20:.1f}" for b in result.peak_bytes)
    return (f"{verdict}: max loss diff {c.max_loss_diff:.2e}, max param diff {c.max_param_diff:.2e}; "
            f"{result.samples_per_s:.0f} samples/s; peak MiB per rank {peaks}")


step("runtime --check", f"GPT small, 2 ranks, 1f1b, {check_transport}, {device}", runtime_check)


# 2. memory: allocator peak vs the IR's static prediction, gpipe vs 1f1b as M grows
def memory_row(schedule: str, m: int, base, model_hash: str) -> str:
    plan = work / f"mem-{schedule}-{m}"
    module = copy.deepcopy(base)
    module.programs = []
    # The split was planned for M = 16: the module's batch attributes must describe this row's (as bench/memory.py).
    module.attrs.microbatches, module.attrs.global_batch = m, 32 * m
    lower = f"schedule{{kind={schedule},microbatches={m}}},lower-comm,insert-frees,verify"
    result = dapple_ir.compile(module, cluster=str(module.attrs.cluster), global_batch=32 * m, pipeline=lower,
                               optimizer="sgd", out_dir=plan)
    meta = json.loads((plan / "plan.json").read_text())
    meta["model_hash"] = model_hash  # the module given to compile was already planned (see bench/memory.py)
    write_plan_json(plan, meta)  # reseals the plan: its digest covers plan.json
    run = dapple_ir.run(plan, steps=2, transport=transport, device=device, optimizer="sgd")
    cells = []
    for rank, program in enumerate(result.module.programs):
        predicted = program_peak(result.module, program).total
        measured = float(run.peak_bytes[rank])
        cells.append(f"r{rank} {measured / 2**20:.1f}/{predicted / 2**20:.1f} MiB ({100 * (measured / predicted - 1):+.0f}%)")
    return "measured/predicted " + ", ".join(cells)


spec = "bench/bench_models.py:mlp_bench"
try:
    captured = capture_spec(spec, device="meta")
    model_hash = structure_hash(captured)
    planned = dapple_ir.compile(copy.deepcopy(captured), cluster=f"{ranks}x{kind}", global_batch=32 * 16, stages=ranks,
                                microbatches=16, schedule="1f1b", optimizer="sgd").module
    for schedule in ("gpipe", "1f1b"):
        for m in (4, 16):
            step("memory", f"MLP 512x8, {ranks} stage(s), {schedule}, M={m}, b=32",
                 lambda s=schedule, m=m: memory_row(s, m, planned, model_hash))
except Exception as exc:
    rows.append(("memory", spec, f"FAILED: {str(exc).splitlines()[0][:150]}"))


# 3. one compile of a large model
def compile_large() -> str:
    result = dapple_ir.compile("examples/gpt.py:factory_large", cluster="4x8xH100", global_batch=512, out_dir=work / "xl")
    plan = result.plan
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return (f"{len(result.module.stages)} stages, {plan['microbatches']} microbatches, {plan['schedule']}, "
            f"predicted {plan['predicted_iteration_s']:.3f} s/iteration; process peak RSS {rss:.0f} MiB")


step("compile", "GPT-2 XL (48 layers) on 4x8xH100, global batch 512", compile_large)


# 4. our runtime vs torch.distributed.pipelining on NCCL (one GPU per rank: NCCL refuses two ranks on one GPU)
def versus_torch() -> str:
    import subprocess

    if device != "cuda":
        return "not run in the CPU dry run (the CPU comparison is bench/runtime_vs_torch_pipelining.py)"
    if gpus < 2:
        return f"not run: NCCL needs one GPU per rank, this machine has {gpus}"
    out = work / "runtime_vs_torch_pipelining.json"
    bench = ["bench/runtime_vs_torch_pipelining.py", "--device", "cuda", "--procs", "2", "--pairs", "1",
             "--budget", "150", "--json", str(out)]
    proc = subprocess.run([sys.executable, *bench], capture_output=True, text=True, timeout=200)
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr or proc.stdout).strip().splitlines()[-1])
    print(proc.stdout)
    heads = [line for line in proc.stdout.splitlines() if line.startswith("headline: median")]
    return heads[0].removeprefix("headline: ") if heads else "no rows (see the table above)"


step("vs torch (NCCL)", "MLP + GPT, 2 ranks, gpipe/1f1b/zb-h1", versus_torch)

widths = [max(len(r[i]) for r in rows) for i in range(2)]
print(f"{'check':<{widths[0]}}  {'setting':<{widths[1]}}  result")
print(f"{'-' * widths[0]}  {'-' * widths[1]}  ------")
for label, setting, result in rows:
    print(f"{label:<{widths[0]}}  {setting:<{widths[1]}}  {result}")
sys.exit(1 if any("FAILED" in r[2] or r[2].startswith("FAIL") for r in rows) else 0)
PYTHON
