"""Measured costs: run each op of a captured model forward and backward on real tensors.

`profile_spec("examples/mlp.py:factory", device="cpu", microbatch=8)` builds the model with real
weights, captures it at the microbatch size (the example inputs are cut or tiled along dimension
0), then walks the graph in order. Each node runs once on the previous nodes' real outputs (which
also warms it up), then is timed: forward under `no_grad`, and backward as `torch.autograd.grad`
of its outputs with respect to its floating inputs and parameters (a fixed graph, replayed with
`retain_graph`). Each figure is the fastest of `repeats` measurements (the least disturbed); one measurement repeats the
call until it lasts about a millisecond, so microsecond ops are not lost in the timer's noise.

The whole step (`step_s`: one forward and backward of the graph, no op timed apart) is the level
`dapple calibrate --fit` scales the op times to, and so what a prediction of a training step rests
on. It is the median of `STEP_REPEATS_FACTOR` x `repeats` measurements, not the fastest: a training
step runs at the machine's typical speed, not its best. On a shared 2-core VM the two differ by a
third (MLP of bench/bench_models.py at microbatch 32: fastest 5.5 ms, median 7.3-7.8 ms, and 8.1 ms
per microbatch in training): a prediction built on the fastest is that much too low. On a quiet
machine (a GPU) the two agree.

Activation bytes come from the capture's estimate (saved tensors on meta, see `dapple_ir.frontend.flops`).
Results are cached under `$DAPPLE_IR_CACHE` (default `~/.cache/dapple-ir`), keyed by the structure
hash of the captured IR, the device, the microbatch, the repeats and the torch version, so that a
second run is instant. The JSON is what `annotate-cost{source=profile.json}` reads.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.fx
from torch.utils._pytree import tree_leaves, tree_map

from dapple_ir.errors import DappleError
from dapple_ir.frontend.model_spec import FactoryResult, capture_loaded, load_model_spec
from dapple_ir.frontend.profile_import import is_profile_spec
from dapple_ir.ir import Module
from dapple_ir.ir.structure import structure_hash

FORMAT = "dapple-ir-profile"
VERSION = 1
#: The whole step's measurements per op measurement (`step_s`): its median needs more than a fastest does.
STEP_REPEATS_FACTOR = 3
#: What `step_s` is, in the cache key: profiles cached when it was the fastest measurement are not reused.
_STEP_STATISTIC = "step median"
#: Shortest stretch of repeated calls one measurement times (the timer's resolution is ~1 µs).
_MIN_MEASURE_S = 1e-3
_MAX_INNER = 1000


def cache_dir() -> Path:
    """Where profiles are cached: `$DAPPLE_IR_CACHE`, else `~/.cache/dapple-ir`."""
    env = os.environ.get("DAPPLE_IR_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "dapple-ir"


def profile_spec(
    spec: str,
    *,
    device: str = "cpu",
    microbatch: int | None = None,
    repeats: int = 5,
    warmup: int = 2,
    use_cache: bool = True,
    progress: TextIO | None = None,
    method: str = "auto",
    threads: int | None = None,
) -> dict[str, Any]:
    """Profile the model a spec names; returns the profile (the JSON `dapple profile` writes).

    `threads` sets torch's CPU threads first: on a busy machine one thread times far more steadily
    (idle OpenMP workers spin for cores that other processes hold).
    """
    if threads is not None:
        torch.set_num_threads(threads)
    if is_profile_spec(spec):
        raise DappleError(f"{spec} is an imported profile: it already has measured times and cannot be run")
    if repeats < 1 or warmup < 0:
        raise DappleError(f"profile: repeats must be at least 1 and warmup at least 0 (got {repeats}, {warmup})")
    torch_device = _torch_device(device)
    loaded = load_model_spec(spec, device="cpu")
    assert isinstance(loaded, FactoryResult)
    if microbatch is not None:
        _resize_examples(loaded, microbatch)
    captured = capture_loaded(loaded, method=method)
    key = cache_key(captured.module, f"{torch_device}/{torch.get_num_threads()} threads", repeats)
    cached = cache_dir() / "profiles" / f"{key}.json"
    if use_cache and cached.is_file():
        return dict(json.loads(cached.read_text()), cached=True)
    result = profile_captured(captured, torch_device, repeats=repeats, warmup=warmup, progress=progress)
    result["model"] = spec
    if use_cache:
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(result, indent=1))
    return dict(result, cached=False)


def cache_key(module: Module, device: str, repeats: int) -> str:
    parts = [structure_hash(module), device, str(module.attrs.batch), str(repeats), torch.__version__, _STEP_STATISTIC]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def _torch_device(device: str) -> Any:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DappleError(f"profile: device {device} was asked for but torch sees no CUDA device; use --device cpu")
    if device != "cpu" and not device.startswith("cuda"):
        raise DappleError(f"profile: device must be cpu or cuda[:N], not {device!r}")
    return torch.device(device)


def _resize_examples(loaded: Any, microbatch: int) -> None:
    """Cut or tile every example tensor along dimension 0 to `microbatch` samples."""
    if microbatch < 1:
        raise DappleError(f"profile: microbatch must be at least 1, not {microbatch}")

    def resize(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        reps = -(-microbatch // t.shape[0])
        return torch.cat([t] * reps)[:microbatch] if reps > 1 else t[:microbatch]

    loaded.example_inputs = tuple(resize(t) for t in loaded.example_inputs)
    loaded.example_targets = tuple(resize(t) for t in loaded.example_targets)
    if loaded.example_kwargs:
        loaded.example_kwargs = {k: resize(v) for k, v in loaded.example_kwargs.items()}


def profile_captured(
    captured: Any, device: Any, *, repeats: int = 5, warmup: int = 2, progress: TextIO | None = None
) -> dict[str, Any]:
    """Time every node of `captured.graph_module` on `device` at the captured batch."""
    gm = captured.graph_module.to(device)
    module: Module = captured.module
    ops = {op.name: op for op in module.ops}
    placeholders = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, captured.example_inputs)
    inputs = iter(placeholders)
    timer = Timer(device, repeats, warmup)
    env: dict[Any, Any] = {}
    entries: dict[str, dict[str, Any]] = {}
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    bar = _ProgressBar(len(nodes), progress)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(inputs)
            continue
        if node.op == "output":
            continue
        env[node], fwd_s, bwd_s = _measure(gm, node, env, timer)
        entries[node.name] = _entry(ops.get(node.name), fwd_s, bwd_s)
        bar.step(node.name)
    bar.close()
    return {
        "format": FORMAT,
        "version": VERSION,
        "device": _device_name(device),
        "torch": torch.__version__,
        "microbatch": module.attrs.batch,
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "total_fwd_s": sum(e["fwd_s"] for e in entries.values()),
        "total_bwd_s": sum(e["bwd_s"] for e in entries.values()),
        "step_s": _step_s(gm, list(placeholders), timer),
        "ops": entries,
    }


def _step_s(gm: Any, inputs: list[Any], timer: Timer) -> float:
    """One whole forward and backward of the graph, no op timed on its own: the level the op times
    (each measured apart, with its own call and synchronisation costs) are scaled to by `calibrate --fit`.
    The median of `STEP_REPEATS_FACTOR` times as many measurements as an op gets (the module docstring says why)."""

    def step() -> None:
        outs = [t for t in _tensors(gm(*inputs)) if t.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

    with torch.enable_grad():
        seconds = step_timer(timer.device, timer.repeats, timer.warmup).time(step)
    gm.zero_grad(set_to_none=True)
    return seconds


def _entry(op: Any, fwd_s: float, bwd_s: float) -> dict[str, Any]:
    entry: dict[str, Any] = {"fwd_s": fwd_s, "bwd_s": bwd_s}
    if op is None:
        return entry
    # The analytic figures ride along so that `dapple calibrate` can fit efficiencies from this file.
    for name in ("act_bytes", "fwd_flops", "bwd_flops", "mem_bytes", "op_class"):
        value = getattr(op.attrs, name)
        if value is not None:
            entry[name] = value
    return entry


def _device_name(device: Any) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return "cpu"


def _tensors(value: Any) -> list[Any]:
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _call(gm: Any, node: Any, args: Any, kwargs: Any) -> Any:
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    if node.op == "call_module":
        return gm.get_submodule(node.target)(*args, **kwargs)
    value = gm
    for part in node.target.split("."):
        value = getattr(value, part)
    return value


def _measure(gm: Any, node: Any, env: dict[Any, Any], timer: Timer) -> tuple[Any, float, float]:
    """The node's output (first real run) and its forward and backward seconds."""
    args, kwargs = tree_map(lambda n: env[n] if isinstance(n, torch.fx.Node) else n, (node.args, node.kwargs))
    with torch.no_grad():
        out = _call(gm, node, args, kwargs)
        fwd_s = timer.time(lambda: _call(gm, node, args, kwargs)) if node.op != "get_attr" else 0.0
    return out, fwd_s, _backward_s(gm, node, args, kwargs, timer)


def _backward_s(gm: Any, node: Any, args: Any, kwargs: Any, timer: Timer) -> float:
    leaves: list[Any] = []

    def leaf(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return t
        t = t.detach().requires_grad_(True)
        leaves.append(t)
        return t.clone()  # so that in-place ops (ReLU(inplace)) do not write into a leaf

    grad_args, grad_kwargs = tree_map(leaf, (args, kwargs))
    if node.op == "call_module":
        leaves += [p for p in gm.get_submodule(node.target).parameters() if p.requires_grad]
    if node.op == "get_attr":
        return 0.0
    with torch.enable_grad():
        out = _call(gm, node, grad_args, grad_kwargs)
    outs = [t for t in _tensors(out) if t.requires_grad]
    if not outs or not leaves:
        return 0.0
    grads = [torch.ones_like(t) for t in outs]

    def backward() -> None:
        torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True)

    return timer.time(backward)


class Timer:
    """Fastest of `repeats` measurements, each long enough for the timer to resolve; with `typical`, their median."""

    def __init__(self, device: Any, repeats: int, warmup: int, *, typical: bool = False) -> None:
        self.device = device
        self.repeats = repeats
        self.warmup = warmup
        self.typical = typical

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time(self, fn: Callable[[], Any]) -> float:
        for _ in range(self.warmup):
            fn()
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        once = max(time.perf_counter() - start, 1e-7)
        inner = max(1, min(_MAX_INNER, int(_MIN_MEASURE_S / once)))
        samples = []
        for _ in range(self.repeats):
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            self.sync()
            samples.append((time.perf_counter() - start) / inner)
        if self.typical:
            return statistics.median(samples)
        # The minimum: the least disturbed run, which matters on a shared machine.
        return min(samples)


def step_timer(device: Any, repeats: int, warmup: int) -> Timer:
    """How a whole step is timed: the median of `STEP_REPEATS_FACTOR` x `repeats` measurements (module docstring)."""
    return Timer(device, repeats * STEP_REPEATS_FACTOR, warmup, typical=True)


class _ProgressBar:
    """`profile [#######.....] 12/40 fc2` on one line of stderr."""

    def __init__(self, total: int, out: TextIO | None) -> None:
        self.total, self.done, self.out = total, 0, out

    def step(self, name: str) -> None:
        self.done += 1
        if self.out is None:
            return
        width = 30
        filled = width * self.done // max(self.total, 1)
        self.out.write(f"\rprofile [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {name[:30]:<30}")
        self.out.flush()

    def close(self) -> None:
        if self.out is not None:
            self.out.write("\n")
            self.out.flush()


def write_profile(result: dict[str, Any], path: str) -> None:
    """Write a profile JSON (without the `cached` flag, which describes one run, not the data)."""
    data = {k: v for k, v in result.items() if k != "cached"}
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def direct_step_s(
    spec: str, *, microbatch: int | None = None, repeats: int = 5, warmup: int = 2, threads: int | None = None
) -> float:
    """Seconds of one whole forward + loss + backward, the median of `STEP_REPEATS_FACTOR` x `repeats` measurements
    (as the profile's `step_s`): the reference timing."""
    if threads is not None:
        torch.set_num_threads(threads)
    loaded = load_model_spec(spec, device="cpu")
    assert isinstance(loaded, FactoryResult)
    if microbatch is not None:
        _resize_examples(loaded, microbatch)
    model, loss_fn = loaded.model, loaded.loss_fn

    def step() -> None:
        out = model(*loaded.example_inputs, **(loaded.example_kwargs or {}))
        loss = loss_fn(out, *loaded.example_targets) if loss_fn is not None else out
        loss = loss["loss"] if isinstance(loss, dict) else loss
        loss.backward()

    return step_timer(torch.device("cpu"), repeats, warmup).time(step)
