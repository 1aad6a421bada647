"""The small runtime that generated rank files call: one method per IR instruction kind.

A `Runtime` holds one rank's stage modules, optimizer, and three stores keyed by `(value, mb)`:
values (computed, received or loaded), gradients of values (accumulated from local consumer
stages and received ones), and per-`(stage, mb)` forward records (input leaves, outputs, the
scaled loss; the autograd graph hangs off them). Stage boundaries cut autograd: every value a stage
reads from outside becomes a fresh leaf, and its gradient is handed on explicitly — by `send grad`
to another rank, or through the gradient store to a stage on this rank.

Random draws (dropout) are seeded per op and microbatch (`random_draws`), so they do not depend on
the split. A replicated stage's buffers (batch-norm running statistics) are averaged over its
replicas by its `allreduce` (or `reduce_scatter`). A stage with sharded optimizer state (`zero`) steps only
this rank's shard of it (`sharded_optimizer`). With `record_grads` it keeps the gradients of step 0 for `--check`.

Communication runs ahead of its use: `post_recv` (called by the rank file where `peak_memory.recv_posts`
marks it) posts a receive that the later `recv` only waits for; a run of sends goes to the transport
together when the next other instruction starts, and a `recv` not posted early goes with the sends just
before it (`Transport.exchange`: one group on NCCL, like torch's batched isend/irecv). The host
does not wait for the device inside a step (only for the first step's message headers): losses are kept
as tensors and read once the step is over (a non-finite one fails the step there), and on CUDA transfers
and allreduces order the stream rather than block the host.

It measures as it goes: a span per instruction (the simulator's trace schema) and the bytes it
holds after each instruction that can add to them (CPU: parameters, gradients, optimizer state, stored values and the
tensors autograd saved for backward, each storage counted once; CUDA: the allocator's peak). On the CPU the
count walks every tensor the rank holds, so it runs on the first `METERED_STEPS` steps of a run only: the
program, its shapes and so what it holds after each instruction are the same every step once the first step
has made the gradients and the optimizer state (`meter_steps`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from dapple_ir.backends.torch.data import microbatch
from dapple_ir.backends.torch.layer_checkpoints import CheckpointedStage
from dapple_ir.backends.torch.mixed_precision import autocast, loss_scaler, step_with_scaler
from dapple_ir.backends.torch.random_draws import StageDraws
from dapple_ir.backends.torch.run_queue import RunQueueClock
from dapple_ir.backends.torch.sharded_optimizer import Shard, shard_stage, zero_grads
from dapple_ir.backends.torch.split_backward import WeightPass, input_pass, weight_passes
from dapple_ir.backends.torch.stage_module import StageModule
from dapple_ir.backends.torch.transport import Pending, PendingRecv, Transport, TransportError
from dapple_ir.errors import DappleError
from dapple_ir.sim.trace import COMM_TRACK, COMPUTE_TRACK, Span

OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw")
#: Learning rate when neither the command line nor plan.json gives one (torch's own defaults; SGD has none).
DEFAULT_LR = {"sgd": 0.01, "sgd-momentum": 0.01, "adam": 1e-3, "adamw": 1e-3}


def make_optimizer(name: str, params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """The optimizer both the pipeline and the reference use (single-tensor code paths, for exactness)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=False)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=False)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, foreach=False)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, foreach=False)
    raise DappleError(f"unknown optimizer '{name}'; choose one of {', '.join(OPTIMIZERS)}")


@dataclass
class _Record:
    """What the forward of one stage on one microbatch left for its backward."""

    leaves: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)
    loss: torch.Tensor | None = None
    saved: dict[int, int] = field(default_factory=dict)
    """Bytes of the tensors autograd saved, by storage address."""
    deferred: list[WeightPass] | None = None
    """What `backward_input` left for `backward_weight`: the passes that produce the parameter gradients."""
    args: list[Any] | None = None
    """A recomputing stage's forward inputs (leaves included), kept to rerun it with grad before its backward."""
    edges: dict[str, GradientEdge] = field(default_factory=dict)
    """A checkpointed stage's outputs as autograd edges (`layer_checkpoints`): its backward starts from them once
    the sends have let go of the output tensors themselves."""


@dataclass
class StepData:
    """Supplies each step's global batch as a flat tuple: model inputs, then targets."""

    batch_of_step: Callable[[int], tuple[Any, ...]]
    input_index: dict[str, int]
    """Position in the flat tuple of each IR input op."""
    microbatch_size: int
    rows: tuple[int, int] | None = None
    """The rows of each microbatch this rank's stages compute (a split stage's replica), None: all."""
    _step: int = -1
    _flat: tuple[Any, ...] = ()

    def value(self, name: str, step: int, mb: int) -> Any:
        if step != self._step:
            self._flat, self._step = self.batch_of_step(step), step
        part = microbatch((self._flat[self.input_index[name]],), mb, self.microbatch_size)[0]
        if self.rows is not None and isinstance(part, torch.Tensor) and part.dim() > 0:
            part = part[self.rows[0] : self.rows[1]]
        # A copy, not a view: a view would keep (and the memory meter would count) the whole global
        # batch alive for as long as the runtime holds this microbatch.
        return part.clone() if isinstance(part, torch.Tensor) else part


#: Steps of a run whose held bytes the CPU meter counts after each instruction: the first makes the gradients and
#: the optimizer state, the second is what every later step holds (`Runtime`'s `meter_steps`).
METERED_STEPS = 2

#: Instructions that only let go of memory (a send's payload stays with the transport until it completes):
#: the meter skips them, so the peak is unchanged and the curve steps down at the next instruction.
_RELEASING = frozenset({"send", "free"})
#: The instructions drawn on the communication track.
COMM_KINDS = frozenset({"send", "recv", "allreduce", "reduce_scatter", "all_gather", "tensor_allreduce"})
#: The instructions that run a stage's computation.
_COMPUTES = frozenset({"forward", "backward", "backward_input", "backward_weight"})


def _params_on(stages: dict[str, StageModule], device: torch.device) -> list[torch.nn.Parameter]:
    """The stages' parameters moved to `device`, each once (a tied parameter is shared by two stages)."""
    unique: dict[int, torch.nn.Parameter] = {}
    for sm in stages.values():
        sm.graph_module.to(device)
        for p in sm.params.values():
            unique.setdefault(id(p), p)
    return list(unique.values())


class Runtime:
    """One rank's executor. Rank files call its instruction methods in program order, once per step."""

    def __init__(
        self,
        rank: int,
        stages: dict[str, StageModule],
        transport: Transport,
        data: StepData,
        *,
        microbatches: int,
        value_ids: dict[str, int],
        optimizer: str,
        lr: float,
        timeout: float,
        device: torch.device,
        tied: set[str] | None = None,
        seed: int = 0,
        record_grads: bool = False,
        recompute: dict[str, list[set[str]]] | None = None,
        rows: tuple[int, int] | None = None,
        meter_steps: int | None = METERED_STEPS,
        precision: str = "fp32",
        zero: dict[str, tuple[int, ...]] | None = None,
    ) -> None:
        self.rank = rank
        self.stages = stages
        self.transport = transport
        self.data = data
        self.microbatches = microbatches
        self.value_ids = value_ids
        self.timeout = timeout
        self.device = device
        self.tied = tied or set()
        self.seed = seed
        self.record_grads = record_grads
        self.recompute = recompute or {}
        """Recomputing stages, each with its checkpoint segments (IR op names; `activation_checkpoints.segments`).
        A stage of one segment runs its forward without grad, keeping only its inputs, and reruns it whole before
        the backward; one of several runs each segment under `torch.utils.checkpoint` (`layer_checkpoints`)."""
        self.checkpointed: dict[str, CheckpointedStage] = {}
        self.precision = precision
        """fp32, or the autocast dtype of every stage's forward (`mixed_precision`)."""
        self.scaler = loss_scaler(precision)
        """fp16's dynamic loss scale, agreed by all ranks at each optimizer step; None otherwise."""
        self.skipped_steps: list[int] = []
        """Steps whose optimizer step an fp16 overflow (on any rank) skipped."""
        self.rows = rows
        """Rows [lo, hi) of each microbatch this rank's stages compute when they split microbatches over
        their replicas (`StageAttrs.split`); None: whole microbatches."""
        # A split replica's loss is the mean over its rows: weighted by its share of the microbatch, the
        # replicas' losses (and so their summed gradients) add up to the microbatch's.
        self.loss_share = (rows[1] - rows[0]) / data.microbatch_size if rows is not None else 1.0
        self._draw_rows = (*rows, data.microbatch_size) if rows is not None else None
        self.parts: dict[tuple[str, int], list[tuple[int, Any]]] = {}
        """Received pieces (rows lo.., tensor) of values a split boundary re-slices, joined at first use."""
        self.draws = {name: StageDraws(f"stage @{name}") for name in stages}
        self.recorded_grads: dict[int, dict[str, torch.Tensor]] = {}
        """With `record_grads`: the gradients the optimizer saw at step 0 (where a pipeline and one device start
        from the same parameters), keyed `stage/name`, by step."""
        self._start_optimizer(optimizer, lr, zero or {})
        self.step = 0
        self.values: dict[tuple[str, int], Any] = {}
        self.freed: set[tuple[str, int]] = set()
        """This step's values the program freed (`free`)."""
        self.grads: dict[tuple[str, int], torch.Tensor] = {}
        self.records: dict[tuple[str, int], _Record] = {}
        self.pending: list[Pending] = []
        self._sends: list[tuple[Any, int, int]] = []
        self._posts: list[tuple[tuple[str, int, bool, int], int, int]] = []
        """Sends and posts not yet issued: a run of them goes out together (`_issue`) before the next other call."""
        self.posted: dict[tuple[str, int, bool, int], PendingRecv] = {}
        """Receives posted ahead of their `recv` (`post_recv`), by (value, mb, grad, peer)."""
        self.post_log: list[tuple[int, str, int, bool]] = []
        """This step's posts: (index of the instruction they were posted before, value, mb, grad)."""
        self.reduced: set[tuple[int, tuple[int, ...]]] = set()
        self._index = 0
        self._current: tuple[str, int] | None = None
        self._step_losses: list[tuple[str, int, torch.Tensor]] = []
        self._owed_sums: list[tuple[str, int, bool, tuple[int, ...], int]] = []
        """`tensor_allreduce`s whose sum has not run yet: (value, mb, grad, group, instruction index)."""
        self._start_measuring(meter_steps)

    def _start_optimizer(self, optimizer: str, lr: float, zero: dict[str, tuple[int, ...]]) -> None:
        """The parameters on the device, the stages this rank shards (ZeRO-1), and the optimizer over what it steps."""
        self.params = _params_on(self.stages, self.device)
        self.shards = {
            name: shard_stage(name, self._untied(name), group, self.rank) for name, group in sorted(zero.items())
        }
        """The stages whose optimizer state this rank shards with their other replicas (ZeRO-1, `sharded_optimizer`)."""
        in_shards = {id(p) for shard in self.shards.values() for p in shard.params}
        self.stepped = [p for p in self.params if id(p) not in in_shards] + [s.master for s in self.shards.values()]
        """What the optimizer steps: the unsharded parameters and this rank's shard of each sharded stage."""
        # Parameters keep their storage for the whole run (the optimizer and checkpoint loading write in place).
        self._param_storages = {s.data_ptr(): s.nbytes() for s in (p.untyped_storage() for p in self.params)}
        # A stage of parameter-free ops (an activation, the loss) has nothing to step.
        self.optimizer = make_optimizer(optimizer, self.stepped, lr) if self.stepped else None

    def _start_measuring(self, meter_steps: int | None) -> None:
        """What the rank measures as it runs: losses, spans, memory, step times (see the module docstring)."""
        self.losses: dict[int, dict[int, float]] = {}
        self.spans: list[Span] = []
        self.memory: list[tuple[float, int]] = []
        self.peak_bytes = 0
        self.step_times: dict[int, tuple[float, float]] = {}
        self._run_queue = RunQueueClock()
        """The thread's time waiting for a CPU, read around each instruction (`Span.queued_s`)."""
        self.meter_steps = meter_steps
        """CPU: the steps of this run (counted from its first) whose held bytes are counted after each instruction
        (`held_bytes`); a later step takes the last counted step's figure at the same instruction. None: every step."""
        self._steps_run = 0
        self._held_at: dict[int, int] = {}
        """The last counted step's held bytes after each instruction, by its index in the program."""

    # ------------------------------------------------------------------------------ the step loop

    def run_step(self, train_step: Callable[[Runtime], None]) -> None:
        """Run one optimizer step of the rank program, then check nothing was left in flight."""
        start = time.time()
        self._index = 0
        self.reduced.clear()
        self.post_log.clear()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        for sm in self.stages.values():
            if sm.tensor_group is not None:
                sm.tensor_group.ran.clear()
        train_step(self)
        self._record_tensor_sums(final=True)
        self._issue()
        for pending in self.pending:
            pending.wait(self.timeout)
        self.pending.clear()
        if self.posted:
            left = ", ".join(f"%{v} mb = {mb}" + (" (grad)" if g else "") for v, mb, g, _ in self.posted)
            self.posted.clear()
            raise DappleError(f"rank {self.rank}, step {self.step}: receives posted but never received: {left}")
        self._check_losses()
        # Whatever the program did not free (a plan without insert-frees) goes now.
        self.values.clear()
        self.freed.clear()
        self.grads.clear()
        self.records.clear()
        self.parts.clear()
        if self.device.type == "cuda":
            # The one host wait of a step, after it: the step ends when the GPU is done with it.
            torch.cuda.synchronize(self.device)
            self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated(self.device))
        self.step_times[self.step] = (start, time.time())
        self.step += 1
        self._steps_run += 1

    @property
    def metering(self) -> bool:
        """Whether this step counts the bytes held after each instruction (CPU; `meter_steps`)."""
        return self.meter_steps is None or self._steps_run < self.meter_steps

    def _check_losses(self) -> None:
        """Read this step's microbatch losses on the host, once the step is done, and refuse a non-finite one."""
        taken, self._step_losses = self._step_losses, []
        if not taken:
            return
        # One device-to-host copy for the whole step.
        values = torch.stack([loss.reshape(()).to(torch.float64) for _, _, loss in taken]).tolist()
        for (stage, mb, _), value in zip(taken, values, strict=True):
            if not math.isfinite(value):
                raise DappleError(
                    f"rank {self.rank}, step {self.step}, {_describe('forward', stage, mb, None)}: the loss of "
                    f"microbatch {mb} at step {self.step} is {value} (stage @{stage}); training diverged (lower "
                    "the learning rate) or the data holds NaN/inf"
                )
            group = self.stages[stage].tensor_group
            if group is not None and group.member > 0:
                continue  # every member of a tensor group computes the whole loss: member 0 reports it
            # A split replica's share of the microbatch loss: the launcher adds the replicas' shares up.
            self.losses.setdefault(self.step, {})[mb] = value if self.rows is None else value * self.loss_share

    # ------------------------------------------------------------------------------ instructions

    def load_microbatch(self, mb: int) -> None:
        with self._instr("load_microbatch", None, mb, None):
            for sm in self.stages.values():
                for name in sm.data_inputs:
                    self.values[(name, mb)] = self._to_device(self.data.value(name, self.step, mb))

    def forward(self, stage: str, mb: int) -> None:
        with self._instr("forward", stage, mb, None):
            sm = self._stage(stage)
            rec = _Record()
            args = [self._leaf(sm, name, mb, rec) for name in sm.inputs]
            if len(self.recompute.get(stage, ())) > 1:
                results = self._run_checkpointed(stage, sm, args, mb, rec)
            elif stage in self.recompute:
                # Nothing saved for backward: the inputs are kept (the rank holds them until the backward
                # anyway) and the forward reruns with grad right before it (`_rerun`).
                rec.args = args
                with torch.no_grad(), autocast(self.precision, self.device.type):
                    results = self.draws[stage].run(sm.graph_module, args, self.seed, self.step, mb, self._draw_rows)
            else:
                results = self._run_saving(stage, sm, args, mb, rec)
            for name, value in zip(sm.outputs, results, strict=False):
                rec.outputs[name] = value
                self.values[(name, mb)] = value
            if sm.has_loss:
                loss = results[-1]
                # Kept as a tensor and read after the step (`_check_losses`): no host sync mid-pipeline.
                self._step_losses.append((stage, mb, loss.detach()))
                # Scaling each microbatch by 1/M makes the summed gradients those of the global batch.
                rec.loss = self._scaled(loss)
            self.records[(stage, mb)] = rec

    def _run_saving(self, stage: str, sm: StageModule, args: list[Any], mb: int, rec: _Record) -> Any:
        """The stage's forward with grad, counting what autograd saves for the backward in `rec.saved`.

        The hook hands autograd a detached alias: a node that saves its own output (softmax, attention) would
        otherwise hold that output with its `grad_fn`, the node itself. Only a pass that does not retain the graph
        breaks such a cycle, so every graph zb-h1's retaining input pass kept leaked (150 MiB a step on a GPT rank)."""
        saved = rec.saved

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
            return t.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(self.precision, self.device.type):
            return self.draws[stage].run(sm.graph_module, args, self.seed, self.step, mb, self._draw_rows)

    def _run_checkpointed(self, stage: str, sm: StageModule, args: list[Any], mb: int, rec: _Record) -> Any:
        """A checkpointed stage's forward (`layer_checkpoints`): it keeps its segments' inputs (in `rec.saved`) and
        its outputs' autograd edges, so that a send may let go of the outputs as for a stage that reruns whole."""
        runner = self.checkpointed.get(stage)
        if runner is None:
            runner = self.checkpointed[stage] = CheckpointedStage(
                sm.graph_module, self.recompute[stage], f"stage @{stage}"
            )
        meter = self._meter_rerun if self.device.type != "cuda" and self.metering else None
        with autocast(self.precision, self.device.type):
            results = runner.run(args, (self.seed, self.step, mb, self._draw_rows), rec.saved, meter)
        if self.draws[stage].sites is None:
            self.draws[stage].sites = runner.sites
        for name, value in zip(sm.outputs, results, strict=False):
            if isinstance(value, torch.Tensor) and value.requires_grad:
                rec.edges[name] = get_gradient_edge(value)
        return results

    def _meter_rerun(self, saved: dict[int, int]) -> None:
        """A checkpoint segment reran inside a backward: what it saved lives beside what the rank holds."""
        held = self._held_storages()
        held.update(saved)
        self.peak_bytes = max(self.peak_bytes, sum(held.values()))

    def _rerun(self, stage: str, mb: int, rec: _Record) -> None:
        """A recomputing stage's forward again, with grad, on the same inputs and the same random draws
        (`random_draws` seeds each by step, microbatch and op): the outputs and loss the backward starts from."""
        if rec.args is None:
            return
        sm = self._stage(stage)
        # The first forward already updated the buffers (batch norm's running statistics, its batch
        # count) as one device would: the rerun must not update them twice.
        buffers = list(sm.graph_module.buffers())
        kept = [b.clone() for b in buffers]
        results = self._run_saving(stage, sm, rec.args, mb, rec)
        with torch.no_grad():
            for buffer, value in zip(buffers, kept, strict=True):
                buffer.copy_(value)
        rec.args = None
        for name, value in zip(sm.outputs, results, strict=False):
            rec.outputs[name] = value
        if sm.has_loss:
            rec.loss = self._scaled(results[-1])
        if self.device.type != "cuda" and self.metering:
            # The rerun's activations live only inside this backward: count them in the peak here.
            self.peak_bytes = max(self.peak_bytes, self.held_bytes())

    def backward(self, stage: str, mb: int) -> None:
        with self._instr("backward", stage, mb, None):
            rec = self._record(stage, mb)
            self._rerun(stage, mb, rec)
            outs, grads = self._output_grads(stage, mb, rec)
            if outs:
                # Tensors and a checkpointed stage's output edges alike (torch takes either, typed as one or the other).
                torch.autograd.backward(cast(Any, outs), grads)
            for name, leaf in rec.leaves.items():
                self._add_grad(name, mb, leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
            self._release(stage, mb, rec)

    def backward_input(self, stage: str, mb: int) -> None:
        with self._instr("backward_input", stage, mb, None):
            rec = self._record(stage, mb)
            self._rerun(stage, mb, rec)
            outs, grads = self._output_grads(stage, mb, rec)
            params = [p for p in self._stage(stage).params.values() if p.requires_grad]
            leaves = list(rec.leaves.items())
            found, rec.deferred = input_pass(list(outs), list(grads), [leaf for _, leaf in leaves], params)
            for (name, leaf), g in zip(leaves, found, strict=True):
                self._add_grad(name, mb, g if g is not None else torch.zeros_like(leaf))

    def backward_weight(self, stage: str, mb: int) -> None:
        with self._instr("backward_weight", stage, mb, None):
            rec = self._record(stage, mb)
            if rec.deferred is None:
                raise DappleError(f"backward_weight @{stage} mb = {mb} comes before its backward_input")
            weight_passes(rec.deferred)
            self._release(stage, mb, rec)

    def send(
        self,
        value: str,
        mb: int,
        peer: int,
        grad: bool = False,
        rows: tuple[int, int] | None = None,
        release: bool = False,
    ) -> None:
        """Send `value` (or its gradient) of microbatch `mb` to `peer`, only its `rows` of the microbatch
        where given (a split boundary); with `release` (the last send of a recomputing stage's output, or of
        a gradient sent in pieces: `codegen`), the rank lets go of it."""
        with self._instr("send", None, mb, peer):
            payload = self._grad_to_send(value, mb) if grad else self._value(value, mb, "send")
            if isinstance(payload, torch.Tensor):
                payload = payload.detach()
                if rows is not None:
                    payload = payload[self._local(rows, payload, value, mb)]
            self._sends.append((payload, peer, self._tag(value, mb, grad)))
            if release and not grad:
                self.values.pop((value, mb), None)
                for (_stage, m), rec in self.records.items():
                    if m == mb and (rec.args is not None or rec.edges):
                        rec.outputs.pop(value, None)
            if grad and (rows is None or release):
                # A value's gradient goes back to its one producer (its replicas, in pieces: after the
                # last): once sent, this rank is done with it (the transport keeps the payload alive).
                self.grads.pop((value, mb), None)

    def recv(self, value: str, mb: int, peer: int, grad: bool = False, rows: tuple[int, int] | None = None) -> None:
        with self._instr("recv", None, mb, peer):
            key = (value, mb, grad, peer)
            if key in self.posted or any(queued == key for queued, _, _ in self._posts):
                self._issue()  # the sends and posts before it go out before this rank waits
                posted = self.posted.pop(key)
            else:
                # Not posted early: the receive joins the sends just before it (one group on NCCL, as torch's
                # 1F1B pairs them), which is safe on any transport: nothing else is queued between them.
                sends, self._sends = self._sends, []
                pending, (posted,) = self.transport.exchange(sends, [(peer, self._tag(value, mb, grad))])
                self.pending.extend(pending)
            payload = self._to_device(posted.wait(self.timeout))
            if rows is not None and isinstance(payload, torch.Tensor):
                self._piece(value, mb, grad, rows, payload)
            elif not grad:
                self.values[(value, mb)] = payload
            elif payload is not None:  # None: the gradient of a non-tensor (a size), which has none
                self._add_grad(value, mb, payload)

    def post_recv(
        self, value: str, mb: int, peer: int, grad: bool = False, rows: tuple[int, int] | None = None
    ) -> None:
        """Post the receive of a later `recv` now, so the transfer lands while this rank computes.

        Not an instruction of the program (it takes no index and no span): where it goes is
        `peak_memory.recv_posts`'s answer, and the rank file calls it right before that instruction.
        """
        key = (value, mb, grad, peer)
        if key in self.posted or any(key == queued for queued, _, _ in self._posts):
            raise DappleError(f"rank {self.rank}: the receive of %{value} mb = {mb} is posted twice")
        self._posts.append((key, peer, self._tag(value, mb, grad)))
        self.post_log.append((self._index, value, mb, grad))

    def _issue(self) -> None:
        """Hand the queued sends (together: `Transport.exchange`) and then the queued posts to the transport."""
        if not self._sends and not self._posts:
            return
        sends, posts = self._sends, self._posts
        self._sends, self._posts = [], []
        pending, _ = self.transport.exchange(sends, [])
        self.pending.extend(pending)
        # Posted one by one, after the sends: a transport that must not run a receive ahead of later sends to
        # the same peer (NCCL, one stream per pair) defers it to its wait (`DistTransport.irecv`).
        self.posted.update((key, self.transport.irecv(peer, tag)) for key, peer, tag in posts)
        if posts and self.device.type != "cuda" and self.metering:
            # Posted at the start of an instruction, before it lets go of anything: the meter's samples at
            # instruction ends would miss the moment the new buffers sit beside what that instruction releases.
            self.peak_bytes = max(self.peak_bytes, self.held_bytes())

    def free(self, value: str, mb: int, grad: bool = False) -> None:
        with self._instr("free", None, mb, None):
            store: dict[tuple[str, int], Any] = self.grads if grad else self.values
            store.pop((value, mb), None)
            if not grad:
                self.parts.pop((value, mb), None)
                self.freed.add((value, mb))

    def free_stage(self, stage: str, mb: int) -> None:
        with self._instr("free", stage, mb, None):
            self.records.pop((stage, mb), None)

    def tensor_allreduce(self, value: str, mb: int, group: tuple[int, ...], grad: bool = False) -> None:
        """Check that the tensor group's sum of `value` (its gradient with `grad`) of microbatch `mb` ran.

        The sum runs inside the compute before this instruction, at the op (`tensor_parallel`): the call only keeps
        the program's count of instructions and records the sum's span (on the communication track, inside the
        compute's). A gradient's sum may come later in the step: zb-h1's `backward_input` of a stage that receives
        nothing (the first) computes nothing, and its `backward_weight` runs the whole backward. A sum the step
        never ran means the plan and the stage's graph disagree (`_check_tensor_sums`).
        """
        index = self._index
        self._index += 1
        self._owed_sums.append((value, mb, grad, tuple(group), index))
        self._record_tensor_sums(final=False)

    def _record_tensor_sums(self, final: bool) -> None:
        """Draw the owed tensor-group sums that ran; with `final` (the step's end), refuse one that never did."""
        held = [sm.tensor_group for sm in self.stages.values() if sm.tensor_group is not None]
        owed, self._owed_sums = self._owed_sums, []
        for value, mb, grad, group, index in owed:
            ran = next((g.ran[(value, grad, mb)] for g in held if (value, grad, mb) in g.ran), None)
            if ran is not None:
                self.spans.append(
                    Span(self.rank, COMM_TRACK, "tensor_allreduce", ran[0], ran[1], None, mb, None, index)
                )
            elif grad and any(value in g.without_grad for g in held):
                continue  # the column-parallel ops' whole input needed no gradient: nothing to sum
            elif not final:
                self._owed_sums.append((value, mb, grad, group, index))
            else:
                raise DappleError(
                    f"rank {self.rank}, step {self.step}, tensor_allreduce %{value} mb = {mb}"
                    + (" (grad)" if grad else "")
                    + f" over ranks {list(group)}: no computation of the step ran that sum; the plan's "
                    "tensor-parallel ops and the stage's graph disagree"
                )

    def allreduce(self, stage: str, group: tuple[int, ...]) -> None:
        with self._instr("allreduce", stage, None, None):
            # Tied parameters are left to their own `allreduce param` over every rank holding a copy.
            params = [p for name, p in self._stage(stage).params.items() if name not in self.tied]
            self._reduce(params, tuple(group))
            self._average_buffers(stage, tuple(group))

    def reduce_scatter(self, stage: str, group: tuple[int, ...]) -> None:
        with self._instr("reduce_scatter", stage, None, None):
            shard = self._shard(stage, group)
            self.transport.reduce_scatter(shard.flat_grad, shard.group, self.timeout)
            self._average_buffers(stage, shard.group)

    def all_gather(self, stage: str, group: tuple[int, ...]) -> None:
        with self._instr("all_gather", stage, None, None):
            shard = self._shard(stage, group)
            self.transport.all_gather(shard.flat, shard.group, self.timeout)

    def allreduce_param(self, param: str, group: tuple[int, ...]) -> None:
        with self._instr("allreduce", param, None, None):
            held = {id(sm.params[param]): sm.params[param] for sm in self.stages.values() if param in sm.params}
            if not held:
                raise DappleError(f"allreduce param @{param}: no stage on this rank holds that parameter")
            self._reduce(list(held.values()), tuple(group))

    def optimizer_step(self) -> None:
        with self._instr("optimizer_step", None, None, None):
            grads = [p.grad for p in self.stepped if p.grad is not None]
            everyone = tuple(range(self.transport.world))
            skipped = step_with_scaler(
                self.scaler,
                grads,
                lambda flag: self.transport.allreduce(flag, everyone, self.timeout),
                self._step_optimizer,
                self.device,
            )
            if skipped:
                self.skipped_steps.append(self.step)
            if self.optimizer is not None:
                # Zeroed, not freed: gradient buffers live for the whole run, as the IR's static bytes say, so
                # the next step's first backward accumulates in place instead of allocating mid-pipeline.
                self.optimizer.zero_grad(set_to_none=False)
            for shard in self.shards.values():
                zero_grads(shard)

    def _step_optimizer(self) -> None:
        """The optimizer's step on gradients as the optimizer sees them (unscaled under fp16)."""
        if self.record_grads and self.step == 0:
            # --check compares whole gradients: a sharded stage's are gathered for it (this step only).
            for shard in self.shards.values():
                self.transport.all_gather(shard.flat_grad, shard.group, self.timeout)
            self.recorded_grads[self.step] = {
                f"{stage}/{name}": (p.grad if p.grad is not None else torch.zeros_like(p)).detach().cpu().clone()
                for stage, sm in self.stages.items()
                for name, p in sm.params.items()
            }
        if self.optimizer is not None:
            self.optimizer.step()

    # ------------------------------------------------------------------------------ helpers

    @contextmanager
    def _instr(self, kind: str, stage: str | None, mb: int | None, peer: int | None) -> Iterator[None]:
        if kind not in ("send", "recv"):
            self._issue()  # a recv issues them itself, with its own receive
        if kind in _COMPUTES:
            for sm in self.stages.values():
                if sm.tensor_group is not None:  # the microbatch the tensor groups' sums of this compute belong to
                    sm.tensor_group.mb = mb
        start = time.time()
        queued_at = self._run_queue.read()
        index = self._index
        self._index += 1
        try:
            yield
        except TransportError:
            raise
        except DappleError as exc:
            raise DappleError(f"rank {self.rank}, step {self.step}, {_describe(kind, stage, mb, peer)}: {exc}") from exc
        except Exception as exc:
            raise DappleError(
                f"rank {self.rank}, step {self.step}, {_describe(kind, stage, mb, peer)} raised "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        end = time.time()
        queued_end = self._run_queue.read()
        # Clamped to the span: the thread may be descheduled between a clock read and the counter's.
        queued = min(end - start, queued_end - queued_at) if queued_at is not None and queued_end is not None else None
        track = COMM_TRACK if kind in COMM_KINDS else COMPUTE_TRACK
        # Absolute wall-clock seconds; the launcher rebases them to the step's start.
        self.spans.append(Span(self.rank, track, kind, start, end, stage, mb, peer, index, queued_s=queued))
        if self.device.type == "cuda":
            # The allocator's peak is read once per step (run_step); here only the curve for the timeline.
            self.memory.append((end, torch.cuda.memory_allocated(self.device)))
        elif kind not in _RELEASING:
            if self.metering or index not in self._held_at:
                self._held_at[index] = self.held_bytes()
                self.peak_bytes = max(self.peak_bytes, self._held_at[index])
            self.memory.append((end, self._held_at[index]))

    def held_bytes(self) -> int:
        """Bytes of every tensor the runtime holds on the CPU, each storage counted once."""
        return sum(self._held_storages().values())

    def _held_storages(self) -> dict[int, int]:
        """The storages of every tensor the runtime holds: address -> bytes."""
        seen = dict(self._param_storages)

        def add(t: Any) -> None:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()

        for p in self.params:
            add(p.grad)
        for state in self.optimizer.state.values() if self.optimizer is not None else ():
            for t in state.values():
                add(t)
        for v in self.values.values():
            add(v)
        for g in self.grads.values():
            add(g)
        for pending in self.posted.values():
            # A receive posted early holds its buffer from its post, where the memory model counts it.
            add(getattr(pending, "body", None))
        for rec in self.records.values():
            seen.update(rec.saved)
            for leaf in rec.leaves.values():
                add(leaf.grad)
            for wp in rec.deferred or ():
                for held in wp.grads:
                    add(held)
        return seen

    def _untied(self, stage: str) -> list[torch.nn.Parameter]:
        """The parameters of `stage` its own collectives reduce (tied ones have their `allreduce param`)."""
        unique = {id(p): p for name, p in self._stage(stage).params.items() if name not in self.tied}
        return list(unique.values())

    def _shard(self, stage: str, group: tuple[int, ...]) -> Shard:
        shard = self.shards.get(stage)
        if shard is None:
            raise DappleError(f"stage @{stage} does not shard its optimizer state on rank {self.rank} (no zero = 1)")
        if tuple(group) != shard.group:
            raise DappleError(f"stage @{stage}'s shards are over ranks {list(shard.group)}, not {list(group)}")
        return shard

    def _stage(self, stage: str) -> StageModule:
        if stage not in self.stages:
            raise DappleError(f"stage @{stage} is not hosted on rank {self.rank}")
        return self.stages[stage]

    def _record(self, stage: str, mb: int) -> _Record:
        rec = self.records.get((stage, mb))
        if rec is None:
            raise DappleError(f"no forward of @{stage} mb = {mb} to take the backward of (freed or never run)")
        return rec

    def _leaf(self, sm: StageModule, name: str, mb: int, rec: _Record) -> Any:
        if name in sm.data_inputs:
            if (name, mb) not in self.values:
                self.values[(name, mb)] = self._to_device(self.data.value(name, self.step, mb))
            return self.values[(name, mb)]
        value = self._value(name, mb, f"forward @{sm.name}")
        if not isinstance(value, torch.Tensor) or not (value.is_floating_point() or value.is_complex()):
            return value
        leaf = value.detach().requires_grad_(True)
        rec.leaves[name] = leaf
        return leaf

    def _value(self, name: str, mb: int, user: str) -> Any:
        if (name, mb) not in self.values and (name, mb) in self.parts:
            self.values[(name, mb)] = self._joined(name, mb, user)
        if (name, mb) not in self.values:
            raise DappleError(f"{user} needs %{name} of microbatch {mb}, which was neither received nor computed here")
        return self.values[(name, mb)]

    def _output_grads(
        self, stage: str, mb: int, rec: _Record
    ) -> tuple[list[torch.Tensor | GradientEdge], list[torch.Tensor | None]]:
        outs: list[torch.Tensor | GradientEdge] = []
        grads: list[torch.Tensor | None] = []
        if rec.loss is not None:
            outs.append(rec.loss)
            grads.append(None)
        for name, out in rec.outputs.items():
            g = self.grads.get((name, mb))
            if g is None or not isinstance(out, torch.Tensor) or not out.requires_grad:
                continue
            outs.append(out)
            grads.append(g)
        for name, edge in rec.edges.items():
            g = self.grads.get((name, mb))
            if g is not None and name not in rec.outputs:
                outs.append(edge)  # a checkpointed stage's output a send let go of
                grads.append(g)
        return outs, grads

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        scaled = loss / self.microbatches if self.rows is None else loss * (self.loss_share / self.microbatches)
        return scaled if self.scaler is None else self.scaler.scale_loss(scaled)

    def _local(self, rows: tuple[int, int], tensor: torch.Tensor, value: str, mb: int) -> slice:
        """Where microbatch rows [lo, hi) sit in this rank's part of `value` (it holds rows from its own lo)."""
        start = self.rows[0] if self.rows is not None else 0
        lo, hi = rows[0] - start, rows[1] - start
        if lo < 0 or hi > tensor.shape[0]:
            raise DappleError(
                f"rank {self.rank}: rows {rows[0]}:{rows[1]} of %{value} mb = {mb} are not all here: this rank holds "
                f"rows {start}:{start + tensor.shape[0]} (dimension 0 is {tensor.shape[0]})"
            )
        return slice(lo, hi)

    def _piece(self, value: str, mb: int, grad: bool, rows: tuple[int, int], payload: torch.Tensor) -> None:
        """Keep a received piece: a value's, to join at first use; a gradient's, added into its rows here."""
        if not grad:
            self.parts.setdefault((value, mb), []).append((rows[0], payload))
            return
        lo, hi = self.rows or (0, self.data.microbatch_size)
        full = payload.new_zeros((hi - lo, *payload.shape[1:]))
        full[self._local(rows, full, value, mb)] = payload
        self._add_grad(value, mb, full)

    def _joined(self, name: str, mb: int, user: str) -> Any:
        """The pieces of a re-sliced value, joined in row order: this rank's rows of it."""
        pieces = sorted(self.parts.pop((name, mb)), key=lambda piece: piece[0])
        joined = torch.cat([t for _, t in pieces]) if len(pieces) > 1 else pieces[0][1]
        lo, hi = self.rows or (0, self.data.microbatch_size)
        if joined.shape[0] != hi - lo:
            raise DappleError(
                f"{user} needs rows {lo}:{hi} of %{name} mb = {mb}, but the pieces received hold {joined.shape[0]}"
            )
        return joined

    def _add_grad(self, name: str, mb: int, g: torch.Tensor) -> None:
        key = (name, mb)
        self.grads[key] = self.grads[key] + g if key in self.grads else g

    def _grad_to_send(self, name: str, mb: int) -> torch.Tensor | None:
        if (name, mb) in self.grads:
            return self.grads[(name, mb)]
        if (name, mb) in self.freed and (name, mb) not in self.values:
            # Freed before its gradient goes back (a size read off a shape, which no backward adds a gradient to):
            # nothing depended on it differentiably here, and the receiver treats no gradient as a zero one.
            return None
        value = self._value(name, mb, "send grad")
        # No stage here depended on it differentiably: a tensor's gradient is zero; a size has none, and
        # the empty message only keeps the send matched with its receive.
        return torch.zeros_like(value) if isinstance(value, torch.Tensor) else None

    def _release(self, stage: str, mb: int, rec: _Record) -> None:
        # The backward is this microbatch's last use of what the stage produced and loaded: every send
        # of an output followed its forward, and later local consumers hold their own saved tensors.
        # Dropping them here is what makes 1f1b's activation memory flat in M, as the IR predicts.
        for name in rec.outputs:
            self.values.pop((name, mb), None)
        others = {n for other, sm in self.stages.items() if other != stage for n in sm.data_inputs}
        for name in set(self._stage(stage).data_inputs) - others:
            self.values.pop((name, mb), None)
        rec.outputs.clear()
        rec.loss = None
        rec.saved.clear()
        rec.deferred = None
        rec.args = None
        rec.edges.clear()

    def _reduce(self, params: list[torch.nn.Parameter], group: tuple[int, ...]) -> None:
        # A parameter shared by two stages of this rank is reduced once per group and step.
        params = [p for p in params if (id(p), group) not in self.reduced]
        self.reduced.update((id(p), group) for p in params)
        if len(group) < 2 or not params:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        self.transport.allreduce(flat, group, self.timeout)
        offset = 0
        for p in params:
            part = flat[offset : offset + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = part.clone()
            else:
                p.grad.copy_(part)
            offset += p.numel()

    def _average_buffers(self, stage: str, group: tuple[int, ...]) -> None:
        """Replace the stage's floating-point buffers by their mean over the stage's replicas.

        Each replica updated its running statistics with its own microbatches only; the mean keeps the
        replicas equal. Summed in float64, buffers that agree already (constants) keep their exact value.
        """
        held = self._stage(stage).graph_module.buffers()
        buffers = [b for b in held if b.is_floating_point() and (id(b), group) not in self.reduced]
        self.reduced.update((id(b), group) for b in buffers)
        if len(group) < 2 or not buffers:
            return
        flat = torch.cat([b.detach().reshape(-1).to(torch.float64) for b in buffers])
        self.transport.allreduce(flat, group, self.timeout)
        flat /= len(group)
        offset = 0
        with torch.no_grad():
            for b in buffers:
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()

    def _tag(self, value: str, mb: int, grad: bool) -> int:
        if value not in self.value_ids:
            raise DappleError(f"%{value} is not a value of the plan")
        return (self.value_ids[value] * 2 + int(grad)) * self.microbatches + mb

    def _to_device(self, value: Any) -> Any:
        return value.to(self.device) if isinstance(value, torch.Tensor) else value

    # ------------------------------------------------------------------------------ results

    def final_state(self) -> dict[str, Any]:
        """What the rank ends with, on the CPU: `params` and `buffers` keyed `stage/name` (every copy),
        the recorded `grads` by step, and the random-draw `sites` of each stage (what `--check` needs)."""
        params, buffers = {}, {}
        for stage, sm in self.stages.items():
            params.update({f"{stage}/{n}": p.detach().cpu().clone() for n, p in sm.params.items()})
            buffers.update({f"{stage}/{n}": b.detach().cpu().clone() for n, b in sm.graph_module.named_buffers()})
        sites = {stage: [list(site) for site in draws.sites or ()] for stage, draws in self.draws.items()}
        return {
            "params": params,
            "buffers": buffers,
            "grads": dict(self.recorded_grads),
            "sites": sites,
            "skipped_steps": list(self.skipped_steps),
        }

    # ------------------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "rank": self.rank,
            "stages": {name: sm.graph_module.state_dict() for name, sm in self.stages.items()},
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else {},
            **({"loss_scale": self.scaler.state_dict()} if self.scaler is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("rank") != self.rank:
            raise DappleError(f"checkpoint holds rank {state.get('rank')}'s state, not rank {self.rank}'s")
        for name, sm in self.stages.items():
            if name not in state["stages"]:
                raise DappleError(f"checkpoint of rank {self.rank} lacks stage @{name}: it belongs to another plan")
            sm.graph_module.load_state_dict(state["stages"][name])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state.get("loss_scale"), f"the checkpoint of rank {self.rank}")
        self.step = int(state["step"])


def _describe(kind: str, stage: str | None, mb: int | None, peer: int | None) -> str:
    text = kind + (f" @{stage}" if stage else "") + (f" mb = {mb}" if mb is not None else "")
    return text + (f" (peer rank {peer})" if peer is not None else "")
