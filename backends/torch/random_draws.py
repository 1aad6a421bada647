"""Random numbers that depend on what is drawn, not on where it runs: exact dropout under any split.

The rule, shared by the pipelined runtime and the single-device reference and nothing else: every
ATen call that consumes random numbers (those torch tags `nondeterministic_seeded`: the
`bernoulli_` of dropout, `rand`, `randn`, `normal_`, ...) draws from a fresh generator seeded with
a hash of `(seed, step, microbatch, op, index)`, where `op` is the name of the graph op (the IR op)
that makes the call and `index` counts the draws of that op in one forward. So the numbers a draw
gets do not depend on which stage, replica, rank or schedule runs it, nor on what ran before: a
pipeline with any split draws the same dropout masks as one device running the whole model, and a
recomputed forward draws the same masks again. The global generator is neither read nor advanced.

A site is `(op, index)`. A stage learns its sites on its first forward, run node by node through an
`fx.Interpreter` that knows the current op; later forwards run the compiled graph and take the
sites in that order. The eager reference has no op names: it takes the sites of every stage, in
graph order, and hands the k-th draw of a microbatch the k-th site.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx
from torch.utils._python_dispatch import TorchDispatchMode

from dapple_ir.errors import DappleError

Site = tuple[str, int]
"""(name of the op that draws, index of the draw among that op's draws in one forward)."""

#: Ops without a `generator` argument draw from the device's default generator, seeded and restored
#: around the call; threads running ranks share that generator, so one such draw at a time.
_DEFAULT_GENERATOR_LOCK = threading.Lock()


def draw_seed(seed: int, step: int, mb: int, site: Site) -> int:
    """The seed of one draw: a hash of the run's seed, the step, the microbatch and the site."""
    op, index = site
    digest = hashlib.blake2b(f"{seed}/{step}/{mb}/{op}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class SeededDraws(TorchDispatchMode):
    """Runs every random ATen call with the generator of its site; other calls pass through."""

    def __init__(self, seed: int, step: int, mb: int, next_site: Callable[[], Site], rows: Rows | None = None) -> None:
        super().__init__()
        self.seed, self.step, self.mb = seed, step, mb
        self.next_site = next_site
        self.rows = rows

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not _draws(func, args, kwargs):
            return func(*args, **kwargs)
        seed = draw_seed(self.seed, self.step, self.mb, self.next_site())
        if self.rows is not None:
            return _rows_of_call(func, args, kwargs, seed, self.rows)
        return _seeded_call(func, args, kwargs, seed)


Rows = tuple[int, int, int]
"""(lo, hi, b): a split stage's replica runs rows [lo, hi) of a microbatch of b samples."""


def _rows_of_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], seed: int, rows: Rows) -> Any:
    """A draw on rows [lo, hi) of the microbatch: the draw of the whole microbatch (b rows), cut to them.

    Random numbers fill a tensor in order, so rows lo..hi of a draw over all b rows are what one device
    running the whole microbatch draws there: a split replica's dropout masks equal the single device's.
    Tensors and sizes whose dimension 0 is the replica's hi - lo rows are widened to b (zeros elsewhere);
    results with b rows are cut back, and a tensor drawn into in place gets its rows of the wide draw.
    """
    lo, hi, b = rows
    n = hi - lo
    if n == b:
        return _seeded_call(func, args, kwargs, seed)
    wide: dict[int, torch.Tensor] = {}

    def widen(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == n:
            full = value.new_zeros((b, *value.shape[1:]))
            full[lo:hi] = value
            wide[id(full)] = value
            return full
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value) and value[0] == n:
            return type(value)([b, *value[1:]])
        return value

    result = _seeded_call(func, tuple(widen(a) for a in args), {k: widen(v) for k, v in kwargs.items()}, seed)

    def narrow(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and id(value) in wide:
            # Drawn into in place: the caller's tensor gets its rows of the wide draw.
            original = wide[id(value)]
            original.copy_(value[lo:hi])
            return original
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == b:
            return value[lo:hi].clone()
        if isinstance(value, tuple):
            return tuple(narrow(v) for v in value)
        return value

    return narrow(result)


def _draws(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the call consumes random numbers: tagged so, and not an attention kernel run without dropout."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "dropout_p":
            value = kwargs.get("dropout_p", args[i] if i < len(args) else arg.default_value)
            return bool(value)
    return True


def _seeded_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], seed: int) -> Any:
    device = _device_of(args, kwargs)
    if any(arg.name == "generator" for arg in func._schema.arguments):
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        return func(*args, **{**kwargs, "generator": generator})
    default = torch.cuda.default_generators[device.index or 0] if device.type == "cuda" else torch.default_generator
    with _DEFAULT_GENERATOR_LOCK:
        state = default.get_state()
        default.manual_seed(seed)
        try:
            return func(*args, **kwargs)
        finally:
            default.set_state(state)


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    if kwargs.get("device") is not None:
        return torch.device(kwargs["device"])
    for value in args:
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


@contextmanager
def drawing_in_order(
    seed: int, step: int, mb: int, sites: list[Site], what: str, rows: Rows | None = None
) -> Iterator[None]:
    """Seed the draws of one forward with `sites`, in order; all of them and no more must be drawn.

    `what` names the forward in the error (a stage, or the reference model).
    """
    taken = 0

    def next_site() -> Site:
        nonlocal taken
        if taken == len(sites):
            raise DappleError(
                f"{what} drew more random numbers in microbatch {mb} of step {step} than the {len(sites)} "
                "draw(s) of its graph; the model draws outside the captured graph, or differently each call"
            )
        taken += 1
        return sites[taken - 1]

    with SeededDraws(seed, step, mb, next_site, rows):
        yield
    if taken != len(sites):
        raise DappleError(
            f"{what} drew {taken} random number(s) in microbatch {mb} of step {step} where its graph draws "
            f"{len(sites)} (at {', '.join(f'%{op}' for op, _ in sites[taken : taken + 3])}); the model's "
            "random ops differ from the captured graph's"
        )


class StageDraws:
    """The sites of one stage, learnt on its first forward; `run` runs the stage with seeded draws."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.sites: list[Site] | None = None
        """None until the first forward; then its draws in order (empty for a stage that draws nothing)."""

    def run(
        self,
        graph_module: torch.fx.GraphModule,
        args: list[Any],
        seed: int,
        step: int,
        mb: int,
        rows: Rows | None = None,
    ) -> Any:
        """The stage's forward on `args` with seeded draws (on `rows` of the microbatch: `_rows_of_call`)."""
        if self.sites is None:
            recorder = _SiteRecorder(graph_module)
            with SeededDraws(seed, step, mb, recorder.next_site, rows):
                results = recorder.run(*args)
            self.sites = recorder.sites
            return results
        if not self.sites:
            return graph_module(*args)
        with drawing_in_order(seed, step, mb, self.sites, self.what, rows):
            return graph_module(*args)


class _SiteRecorder(torch.fx.Interpreter):
    """Runs a graph node by node, naming each draw by the node that makes it."""

    def __init__(self, graph_module: torch.fx.GraphModule) -> None:
        super().__init__(graph_module)
        self.sites: list[Site] = []
        self._op = ""
        self._count = 0

    def run_node(self, n: torch.fx.Node) -> Any:
        self._op, self._count = n.name, 0
        return super().run_node(n)

    def next_site(self) -> Site:
        site = (self._op, self._count)
        self._count += 1
        self.sites.append(site)
        return site
