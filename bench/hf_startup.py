"""Time to first result with Hugging Face models: capture, compile, and `dapple run` rank start-up.

Every figure is the median of `--repeats` fresh processes, so none of them profits from caches of
an earlier one in the same process:

- `import torch` (and `import torch, transformers`) in a fresh Python: the floor of any rank's start;
- capture on meta of GPT-2 124M (`GPT2Config()` defaults: 12 layers, hidden 768, vocabulary 50257;
  example batch 4 x sequence 1024) and BERT-base (`BertConfig()` defaults, masked LM; batch 4 x
  sequence 512), timed around the capture call alone (imports and the model build excluded);
- `dapple compile` of the same two models end to end (a fresh `dapple` process: imports, capture,
  planning for 2x8xV100-16GB at global batch 32, writing the plan directory);
- `dapple run` rank start-up: from calling `run` (which launches torchrun) to the first step's start on
  the slowest of its 2 CPU ranks, for a tiny GPT-2 (2 layers, hidden 64) compiled for `2xcpu`.

    .venv/bin/python bench/hf_startup.py [--quick] [--repeats N] [--json PATH]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from tables import Report, Table, bench_parser, median, unavailable  # noqa: E402

SPEC = f"{Path(__file__).resolve()}"
PYTHON = sys.executable
DAPPLE = str(Path(PYTHON).parent / "dapple")


# ------------------------------------------------------------------ the model factories (model specs)


def gpt2_124m() -> tuple[Any, dict[str, Any]]:
    """GPT-2 124M from `GPT2Config()`'s defaults, example batch 4 x sequence 1024, labels = inputs."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    ids = torch.randint(0, 50257, (4, 1024))
    return GPT2LMHeadModel(GPT2Config()), {"input_ids": ids, "labels": ids.clone()}


def bert_base() -> tuple[Any, dict[str, Any]]:
    """BERT-base masked LM from `BertConfig()`'s defaults, batch 4 x sequence 512, a label everywhere."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig()), {
        "input_ids": torch.randint(0, 30522, (4, 512)),
        "labels": torch.randint(0, 30522, (4, 512)),
    }


def gpt2_tiny() -> tuple[Any, dict[str, Any]]:
    """A 2-layer GPT-2 of hidden 64 and vocabulary 128, batch 4 x sequence 16: start-up dominates."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4, bos_token_id=127, eos_token_id=127
    )
    ids = torch.randint(0, 128, (4, 16))
    return GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids.clone()}


# ------------------------------------------------------------------------------------ measurements


def _child(code: str, timeout: float) -> float | str:
    """Run `code` in a fresh Python; it prints one float (seconds). A string says why it failed."""
    try:
        proc = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines() or ["no output"])[-1][:160]
    return float(proc.stdout.strip().splitlines()[-1])


def import_time(modules: str, timeout: float) -> float | str:
    return _child(f"import time; t = time.perf_counter(); import {modules}; print(time.perf_counter() - t)", timeout)


def capture_time(factory: str, timeout: float) -> float | str:
    code = (
        "import time\n"
        "from dapple_ir.frontend.model_spec import capture_loaded, load_model_spec\n"
        f"loaded = load_model_spec({SPEC + ':' + factory!r}, device='meta')\n"
        "t = time.perf_counter()\n"
        "capture_loaded(loaded)\n"
        "print(time.perf_counter() - t)\n"
    )
    return _child(code, timeout)


def compile_time(factory: str, timeout: float) -> float | str:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [DAPPLE, "compile", f"{SPEC}:{factory}", "--cluster", "2x8xV100-16GB", "--global-batch", "32"]
        t = time.perf_counter()
        try:
            proc = subprocess.run(
                [*cmd, "-o", f"{tmp}/plan"], capture_output=True, text=True, timeout=timeout, cwd=ROOT
            )
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout:.0f} s"
        elapsed = time.perf_counter() - t
        if proc.returncode != 0:
            return (proc.stderr.strip().splitlines() or ["no output"])[-1][:160]
        return elapsed


def run_startup(plan: Path, timeout: float) -> tuple[float, float] | str:
    """(launch to the first step on the slowest rank, launch to the end of `run`) in seconds."""
    from dapple_ir.backends.torch.launch import run

    launched = time.time()
    try:
        run(plan, steps=1, transport="torchrun", timeout=timeout, device="cpu")
    except Exception as exc:  # the bench reports what failed instead of stopping
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:140]}"
    ended = time.time()
    firsts = [json.loads(p.read_text())["step_times"]["0"][0] for p in sorted((plan / "run").glob("rank_*.json"))]
    return max(firsts) - launched, ended - launched


def _cell(values: list[float | str]) -> float | str:
    good = [v for v in values if isinstance(v, float)]
    if not good:
        return unavailable(str(values[0]))
    return round(median(good), 2)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "one repeat, and the tiny GPT-2 in place of the 124M one and BERT-base")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per figure (median reported)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per process")
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    started = time.time()
    big = ["gpt2_tiny"] if args.quick else ["gpt2_124m", "bert_base"]
    table = Table("Time to first result (seconds)", ["what", "median (s)", "runs"])

    def row(what: str, measure: Any) -> None:
        values = [measure() for _ in range(repeats)]
        table.add(what, _cell(values), len(values))

    row("python -c 'import torch'", lambda: import_time("torch", args.timeout))
    row("python -c 'import torch, transformers'", lambda: import_time("torch, transformers", args.timeout))
    for factory in big:
        row(f"capture {factory} on meta (capture call only)", lambda f=factory: capture_time(f, args.timeout))
    for factory in big:
        row(f"dapple compile {factory} (whole command)", lambda f=factory: compile_time(f, args.timeout))
    with tempfile.TemporaryDirectory() as tmp:
        plan = Path(tmp) / "plan"
        from dapple_ir.api import compile as compile_plan

        compile_plan(f"{SPEC}:gpt2_tiny", cluster="2xcpu", global_batch=8, stages=2, out_dir=plan)
        runs = [run_startup(plan, args.timeout) for _ in range(repeats)]
        table.add(
            "dapple run gpt2_tiny: launch to first step",
            _cell([r[0] if isinstance(r, tuple) else r for r in runs]),
            len(runs),
        )
        table.add(
            "dapple run gpt2_tiny: launch to end (1 step)",
            _cell([r[1] if isinstance(r, tuple) else r for r in runs]),
            len(runs),
        )
    shapes = (
        "tiny GPT-2 at batch 4 x 16 tokens"
        if args.quick
        else "GPT-2 124M at batch 4 x 1024 tokens, BERT-base at 4 x 512"
    )
    table.notes.append(
        f"median of {repeats} fresh processes each; {shapes}; compile for 2x8xV100-16GB, global batch 32; "
        "run: the tiny GPT-2 on 2 CPU ranks (torchrun, gloo), 2 stages"
    )
    report = Report("hf_startup", "Time to first result with Hugging Face models", tables=[table])
    return report.finish(started, args.json)


if __name__ == "__main__":
    sys.exit(main())
