"""A discrete-event simulator over the per-rank programs of a lowered plan.

Each rank runs its program in order on one compute stream; its transfers run on a separate comm
track so that communication overlaps compute wherever the instruction order allows.

Instruction costs (b = microbatch size, see `memory.batch_scale`):
- `forward` / `backward`: the sum of the stage's ops' times at b samples, or a split replica's rows of b
  (`pricing.ops.OpPrices`, the prices the planner reads: an op the roofline priced priced again at those rows,
  any other's fixed part (`DeviceKind.op_overhead`) as it is and the rest scaled from `cost_batch`,
  `roofline.rescaled_s`); a split replica's activations are its rows' share;
- a recomputing stage (`recompute` on the stage) reruns its forward before the backward: `backward`
  (or `backward_input` when split) takes the forward time on top;
- zero-bubble split: `backward_input` takes `f` of the stage's backward time and `backward_weight`
  the remaining `1 - f`; `f = BACKWARD_INPUT_FRACTION` (0.5) unless the caller passes another value
  (one for every stage, or one per stage name). A stage that hands no gradient back (the first: its
  inputs are data, or whatever it receives needs none) has `f = 0` unless given by name: the runtime's
  `backward_input` has nothing to compute there, and its `backward_weight` runs the whole backward.
  The split is not free: `backward_weight` also takes the device kind's `split_backward_overhead` per op
  whose parameters get a weight pass of their own (`peak_memory.weight_ops`; none on a stage that hands
  no gradient back) and `split_backward_per_byte` per byte of their parameters, so the two passes cost
  more than the whole backward where the host pays per pass.
- `send` is an isend: its bytes start to flow over the path between the two devices
  (`dapple_ir.cluster.topology`) once the send has issued and the receiver has posted the matching
  receive, and arrive the path's latency after the last byte is through; the sender does not wait.
  A receive is posted at its `recv`, or earlier where `peak_memory.recv_posts` moves it (the rank
  file's `post_recv`). Both transports rendezvous: gloo holds a send until the receiver's ready
  notice comes back, NCCL's send waits for the receiver's credit; so the bytes start at the later
  of the send's issue and the post plus the path's latency (the notice on its way). A receive
  posted a latency or more before its send costs nothing extra (the closed form below); one posted
  after its send costs two latencies and the bytes from where the receiver posts it. Bytes are
  `value.out_bytes * b / module.attrs.batch` (b the send's rows where it moves a piece), the same for a gradient; a
  zero-byte send arrives when it issues (it still orders the two ranks). A recv waits for its own
  sender's data: the gradients of one value coming back from several consumer ranks are awaited
  each on its own.
- a transfer into a device whose `busy_receive_slowdown` s is above 1 (a CPU host whose cores all
  compute, where the transport's socket thread waits for a core) moves s times slower during the
  receiver's compute instructions (forward, backward, optimizer step) between its start and its
  `recv`: it lands when the link's time for it has gone by, counting each second the receiver computed
  as 1/s (`_landing`). Measured (replayed) transfers keep their time. s = 1, the default and every GPU
  preset's, leaves every transfer as above.
- `recv` blocks the rank until the matching send's data has arrived; where it blocked, the rank goes on the
  device kind's `wake_overhead` later (a CPU rank waiting for a core once woken; 0 on every preset).
- `allreduce` starts when every member of its group has reached it. It is a ring over the members
  in device order: each of the n steps sends 2(n-1)/n of the gradient bytes from one member to the
  next, all steps at once; it ends when the last step's bytes are through, plus 2(n-1) times the
  slowest hop's latency. The bytes are the stage's trainable parameter bytes, less parameters tied
  to other stages (those have their own `allreduce param`, costed at the parameter's bytes). It
  blocks its members, as DAPPLE's planner assumes (the reduction is not hidden behind the drain); a member
  goes on `wake_overhead` after the ring ends, as after a receive that blocked.
- `optimizer_step` streams parameters, gradients and optimizer state through device memory once:
  (3 + 2 × state factor) × parameter bytes / memory bandwidth (SGD reads p, g and writes p; Adam
  also reads and writes its two moments).
- `load_microbatch` and `free` take no time, except in a replay (`simulate`'s `durations`): there each takes what
  the measured step spent on it, as host work on the rank's own stream before the receive that follows.
- ranks that share cores (`ClusterSpec.cores_per_node` below a node's ranks: CPU ranks of one thread each on a
  machine with fewer cores) take turns: each compute instruction (forward, backward, input or weight pass,
  optimizer step, its host work included) is its seconds of work on one core, done at min(1, c / k) of a core's
  speed while k of the node's c-core ranks compute, the shares recomputed whenever one starts or ends (the link
  sharing below, with the node's cores as one link of bandwidth c and each rank's thread as one of bandwidth 1).
  A rank computing alone runs at full speed, so a plan whose ranks never compute at once costs what it costs
  unshared. `busy_s` counts the wall time of such instructions, stretched as they were; durations given to
  `simulate` are work on a core of its own and are shared the same way.
- the host's own work (`host_s`): every compute instruction also takes the device kind's
  `instruction_overhead`, and it or the optimizer step, whichever comes next, `message_overhead` for
  each send and receive the rank ran since its previous one (the runtime hands queued sends over at
  the next instruction that is not a send). Both 0 on the GPU presets; `dapple calibrate` measures them.

Sharing rule: transfers and allreduce steps in flight at the same time share the links they cross
(switch ports, a node's bus, network cards). Each link's bandwidth is split equally among the flows
crossing it, and a flow moves at the smallest share along its path; the shares are recomputed
whenever a flow starts or ends (`dapple_ir.sim.link_sharing`). A flow alone gets the path's full
bandwidth, so one transfer at a time costs latency + bytes / bandwidth, the closed form; no link
ever carries more than its bandwidth. Without a cluster (none given and none named by the module)
links and memory are ideal: every transfer, allreduce and optimizer step takes zero time.

Memory per rank: static bytes (parameters, gradients, optimizer state of the hosted stages) plus
the saved activations of each forward until its `free @stage mb`, the gradients a `backward_input`
keeps for its `backward_weight` until the same free, and each received tensor from the instruction its
receive is posted before (its `recv`, or earlier: `peak_memory.recv_posts`) until its `free`
(`peak_memory.memory_changes`). Memory changes when an instruction starts, so the
per-rank peak equals the peak over instruction order that `insert-frees` computes statically.

The engine runs ranks in global time order: a rank computes ahead on its own until it reaches a
send, recv or allreduce at a time when something else (another rank, a flow's end) happens first;
then it waits in an event queue. Compute costs nothing beyond the loop; each transfer costs a few
queue operations and a rate update on the links of its path. Ranks that never wait on one another and
share no link or core (`dapple_ir.sim.parts`: the members of a tensor group, each on its own network card) run
as separate parts, each on its own queue and links; `predict` runs one part of each set of copies.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from itertools import accumulate, compress, count, repeat
from operator import attrgetter, is_
from pathlib import Path
from typing import NamedTuple

from dapple_ir.analysis import memory
from dapple_ir.analysis.peak_memory import (
    Sizes,
    hosted_stages,
    posted_changes,
    replica_rows,
    transfer_bytes,
    weight_ops,
)
from dapple_ir.analysis.stage_graph import crossings, tied_params
from dapple_ir.analysis.tensor_shards import summed_bytes
from dapple_ir.cluster.spec import ClusterSpec, DeviceKind, Link
from dapple_ir.cluster.toml_file import resolve_cluster
from dapple_ir.cluster.topology import Network
from dapple_ir.errors import DappleError
from dapple_ir.ir import COMPUTE_KINDS, Instr, InstrKind, Module, Op, RankProgram, Stage
from dapple_ir.ir.scale import collector_paused
from dapple_ir.plan_dir import read_module
from dapple_ir.pricing.collectives import ring_allreduce
from dapple_ir.pricing.host import host_work_s, optimizer_step_s
from dapple_ir.pricing.ops import OpPrices
from dapple_ir.pricing.tensor import tensor_reduce_s
from dapple_ir.sim.link_sharing import LinkSharing, Reschedule
from dapple_ir.sim.parts import CopyCheck, Meetings, independent_parts, join
from dapple_ir.sim.symmetry import ReplicaQuotient, replica_quotient
from dapple_ir.units import format_bytes, format_seconds

#: Share of a stage's backward time that `backward_input` takes in the zero-bubble split.
BACKWARD_INPUT_FRACTION = 0.5

#: Instructions that occupy the compute stream (drawn on the compute track): the stage's
#: computation and the optimizer step.
COMPUTE_STREAM_KINDS = COMPUTE_KINDS | {InstrKind.OPTIMIZER_STEP}
#: Instructions during which the rank's host is busy with work of its own, so that a transport thread sharing its
#: core waits (`busy_receive_slowdown`): the compute stream's, and the loads and frees where they take time (a
#: replayed step's).
HOST_BUSY_KINDS = COMPUTE_STREAM_KINDS | {InstrKind.LOAD_MICROBATCH, InstrKind.FREE}

#: Instructions whose time is spent on the comm track.
COMM_KINDS = frozenset({InstrKind.SEND, InstrKind.ALLREDUCE, InstrKind.REDUCE_SCATTER, InstrKind.ALL_GATHER})

_INF = float("inf")


@dataclass(frozen=True, slots=True)
class _Transfer:
    """One send's bytes on their way: what `send` issued, waiting for its receive's post or for its links."""

    key: tuple  # type: ignore[type-arg]
    src: int
    index: int
    """The send's position in the sender's program."""
    nbytes: float
    path: tuple[int, ...]
    latency: float
    notice: float
    """How long the receiver's ready notice takes to reach the sender: the path's latency, or 0 for a replayed
    transfer, whose measured time counts from the later of its send and its post (the notice included)."""
    measured: bool = False
    """A replayed transfer: its time is as measured, whatever its receiver did meanwhile."""
    answered: bool = False
    """Its sender's transport has answered the ready notice (`_Simulator.answered_s`): the bytes may move."""


@dataclass(frozen=True, slots=True)
class InstrEvent:
    """When one instruction of one rank started and ended."""

    rank: int
    index: int
    """Position in the rank's program."""
    instr: Instr
    start_s: float
    end_s: float
    """For a send: when its data arrives; for a recv: when the rank could go on."""


@dataclass(frozen=True, slots=True)
class LinkLoad:
    """What one link carried in the iteration."""

    name: str
    bandwidth: float
    """Bytes/s."""
    nbytes: float

    @property
    def busy_s(self) -> float:
        """The least time the link needs for its bytes: no iteration is shorter."""
        return self.nbytes / self.bandwidth


@dataclass(slots=True)
class SimulationResult:
    """Predicted timing and memory of one training iteration of a plan."""

    module: Module
    """The simulated module (its programs give the instructions the indices refer to)."""
    cluster_name: str
    """Cluster the costs came from (`ideal` for zero-cost communication)."""
    iteration_s: float
    """Time from the first instruction to the last one ending, over all ranks."""
    busy_s: list[float]
    """Per rank: time its compute stream spent in compute instructions."""
    peak_bytes: list[float]
    """Per rank: the highest memory the rank holds at any instruction."""
    critical_path: list[tuple[int, int]]
    """(rank, instruction index) from the first to the last instruction of the longest chain."""
    starts: list[list[float]]
    """starts[rank][index]: when the instruction started."""
    ends: list[list[float]]
    """ends[rank][index]: when it ended (a send: when its data arrived)."""
    memory: list[list[tuple[float, float]]] = field(default_factory=list)
    """Per rank: (time, bytes) after each change, starting with the static bytes at time 0."""
    links: list[LinkLoad] = field(default_factory=list)
    """Every link that carried bytes, busiest first."""

    @property
    def ranks(self) -> int:
        return len(self.busy_s)

    @property
    def bubble_fraction(self) -> list[float]:
        """Per rank: share of the iteration its compute stream sat idle."""
        if self.iteration_s <= 0:
            return [0.0] * self.ranks
        return [1.0 - b / self.iteration_s for b in self.busy_s]

    def events(self) -> Iterator[InstrEvent]:
        """Every instruction's start and end, rank by rank in program order."""
        for r, program in enumerate(self.module.programs):
            starts, ends = self.starts[r], self.ends[r]
            for i, instr in enumerate(program.instrs):
                yield InstrEvent(r, i, instr, starts[i], ends[i])

    def summary(self) -> str:
        """A table: per rank busy %, bubble %, peak memory; the iteration time underneath."""
        lines = [f"{'rank':>4}  {'device':>6}  {'busy %':>7}  {'bubble %':>8}  {'peak memory':>12}"]
        bubbles = self.bubble_fraction
        for r, program in enumerate(self.module.programs):
            busy, bubble = 100.0 * (1.0 - bubbles[r]), 100.0 * bubbles[r]
            device = _device_of(self.module, program, r)
            peak = format_bytes(self.peak_bytes[r])
            lines.append(f"{r:>4}  {device:>6}  {busy:>7.1f}  {bubble:>8.1f}  {peak:>12}")
        mean_bubble = 100.0 * sum(bubbles) / max(1, len(bubbles))
        if self.links and self.iteration_s > 0:
            busiest = self.links[0]
            lines.append(
                f"busiest link: {busiest.name}, {format_bytes(busiest.nbytes)} in "
                f"{format_seconds(busiest.busy_s)} at full bandwidth "
                f"({100.0 * busiest.busy_s / self.iteration_s:.0f} % of the iteration)"
            )
        lines.append(
            f"iteration {format_seconds(self.iteration_s)} on {self.cluster_name}; mean bubble {mean_bubble:.1f} %; "
            f"peak memory {format_bytes(max(self.peak_bytes, default=0.0))}"
        )
        return "\n".join(lines)


def simulate(
    module_or_path: Module | str | Path,
    *,
    cluster: ClusterSpec | str | None = None,
    backward_input_fraction: float | Mapping[str, float] = BACKWARD_INPUT_FRACTION,
    durations: Mapping[tuple[int, int], float] | None = None,
    steady: bool = False,
    prices: OpPrices | None = None,
) -> SimulationResult:
    """Simulate one iteration of the plan's rank programs.

    `module_or_path`: a lowered module, an IR file, or a plan directory holding `plan.dapple`.
    `cluster`: a spec, a shorthand (`2x8xV100-16GB`) or TOML path; defaults to the module's
    `cluster` attribute, else ideal links (communication free).
    `backward_input_fraction`: the share of a stage's backward its `backward_input` takes, for every stage that
    hands a gradient back, or by stage name (a stage not named gets `BACKWARD_INPUT_FRACTION`, or 0 where it
    hands none back).
    `durations`: seconds by (rank, instruction index) that replace the modelled time of those forward,
    backward (whole, input or weight) and optimizer-step instructions, or give loads and frees the host time
    they took (busy, on the rank's stream): a measured step replayed on the plan's dependencies
    (`bench/runtime_vs_torch_pipelining.py`). A send's entry is its transfer's time,
    from the later of the send and its receive's post to the data's arrival (the ready notice and any link
    sharing included: the transfer takes no link). Other kinds keep their own timing.
    `steady`: the iteration as a long run repeats it, not the first one. By default every rank starts at 0, as
    in a run's first step (and as the planner compares plans); a run's later steps each start where the rank
    ended the step before, so a rank that ends early starts early, and the next step's first work overlaps the
    tail of the ranks that end late. Then `iteration_s` is the period, from one step's end to the next's on the
    last rank (what a run's steps measure), and `bubble_fraction` each rank's share of it spent waiting.
    `prices`: what each op costs at any rows (`pricing.ops.OpPrices`); by default the module's recorded costs on the
    cluster. The planner passes its own, built once per plan.
    """
    (result,) = simulate_each(
        module_or_path,
        [durations or {}],
        cluster=cluster,
        backward_input_fraction=backward_input_fraction,
        steady=steady,
        prices=prices,
    )
    return result


def simulate_each(
    module_or_path: Module | str | Path,
    durations: Iterable[Mapping[tuple[int, int], float]],
    *,
    cluster: ClusterSpec | str | None = None,
    backward_input_fraction: float | Mapping[str, float] = BACKWARD_INPUT_FRACTION,
    steady: bool = False,
    prices: OpPrices | None = None,
) -> Iterator[SimulationResult]:
    """`simulate` once per mapping of `durations`, in order; what does not depend on them (the modelled costs,
    the routes, where each receive is posted) is worked out once (`dapple_ir.sim.spread` runs many). `steady`:
    the steps back to back, as a run takes them: the first in the steady state of steps like it
    (`simulate(steady=True)`), each later one starting where each rank ended the one before it, its
    `iteration_s` the period from the last rank's end of that step to its end of this one."""
    module = _load(module_or_path)
    if not module.programs:
        raise DappleError(
            f"module @{module.name} has no rank programs to simulate; lower it first "
            "(pipeline 'schedule{kind=1f1b},lower-comm,insert-frees')"
        )
    fractions = _fractions(module, backward_input_fraction)
    spec = _resolve(cluster if cluster is not None else module.attrs.cluster, module)
    with collector_paused():
        simulator = _Simulator(module, spec, fractions, prices or OpPrices(module, spec))
    ends: list[float] | None = None  # steady: when each rank ended the step before
    for replay in durations:
        for (rank, index), seconds in replay.items():
            if not (0 <= rank < len(module.programs) and 0 <= index < len(module.programs[rank].instrs)) or seconds < 0:
                raise DappleError(f"durations: rank {rank} has no instruction {index} to take {seconds} s")
        with collector_paused():
            if steady:
                result, ends = simulator.settle(replay) if ends is None else simulator.follow(replay, ends)
            else:
                result = simulator.run(replay)
        yield result


def predict(
    module: Module,
    *,
    cluster: ClusterSpec,
    prices: OpPrices,
    shapes: list[tuple[object, ...]] | None = None,
    leads: Mapping[int, int] | None = None,
) -> tuple[float, float]:
    """(`iteration_s`, the most of `peak_bytes`) of `simulate(module, cluster=cluster, prices=prices)`, what the planner
    ranks a candidate by, without the rest of the result (the timeline's curves, the critical path, the links).
    Where the caller has them (`plan`, from what a trial's passes noted): `shapes`, each program's
    `peak_memory.program_shape`; `leads`, rank -> the rank whose transfers it has but for their peers
    (`lowering.as_member`)."""
    if not module.programs:
        result = simulate(module, cluster=cluster, prices=prices)  # says what is missing
        return result.iteration_s, max(result.peak_bytes, default=0.0)
    fractions = _fractions(module, BACKWARD_INPUT_FRACTION, leads or {})
    with collector_paused():
        return _Simulator(module, cluster, fractions, prices, shapes).iteration_and_peak()


def _fractions(
    module: Module, given: float | Mapping[str, float], leads: Mapping[int, int] | None = None
) -> dict[Stage, float]:
    """Each stage's `backward_input` share of its backward (see `simulate`; `leads`: see `predict`)."""
    named = dict(given) if isinstance(given, Mapping) else {}
    default = BACKWARD_INPUT_FRACTION if isinstance(given, Mapping) else given
    if not 0.0 <= default <= 1.0:
        raise DappleError(f"backward_input_fraction must lie in [0, 1], got {default}")
    stages = {stage.name for stage in module.stages}
    for name, f in named.items():
        if name not in stages:
            raise DappleError(f"backward_input_fraction names stage @{name}, which module @{module.name} has not")
        if not 0.0 <= f <= 1.0:
            raise DappleError(f"backward_input_fraction of @{name} must lie in [0, 1], got {f}")
    # A gradient goes back for a value where a program sends it: `lower-comm` sends what the runtime computes. A
    # program with its lead's transfers sends the values its lead sends.
    leads = leads or {}
    programs = [p for k, p in enumerate(module.programs) if k not in leads]
    sent = {i.value for p in programs for i in p.instrs if i.kind is _SEND and i.grad}
    hands_back = {c.consumer for c in crossings(module) if c.value in sent}
    return {s: named.get(s.name, default if s in hands_back else 0.0) for s in module.stages}


# ------------------------------------------------------------------------------ loading, cluster


def _load(module_or_path: Module | str | Path) -> Module:
    if isinstance(module_or_path, Module):
        return module_or_path
    return read_module(module_or_path)


def ideal_cluster(devices: int = 1) -> ClusterSpec:
    """A cluster of `devices` whose links and memory cost nothing: only compute takes time."""
    free = Link(_INF, 0.0)
    kind = DeviceKind("ideal", _INF, {"f32": _INF}, _INF)
    return ClusterSpec((kind,), max(1, devices), free, free, name="ideal")


def _resolve(cluster: ClusterSpec | str | None, module: Module) -> ClusterSpec:
    if cluster is None:
        devices = [_device_of(module, p, r) for r, p in enumerate(module.programs)]
        return ideal_cluster(max(devices, default=0) + 1)
    if isinstance(cluster, ClusterSpec):
        return cluster
    return resolve_cluster(cluster)


def _device_of(module: Module, program: RankProgram, rank: int) -> int:
    """The program's device, else its stage replica's device, else the rank number."""
    if program.attrs.device is not None:
        return program.attrs.device
    replica = program.attrs.replica or 0
    for name in program.attrs.stages or ():
        group = module.stage(name).group_devices(replica)
        k = program.attrs.tensor_rank or 0
        if k < len(group):
            return group[k]
    return rank


# ------------------------------------------------------------------------------------ the engine


#: What the engine's event queue holds: a rank to run on, the first end in a bundle of flows, a transfer
#: whose receive is posted and whose receiver's notice reaches the sender then, or the first end in a bundle of
#: computations on shared cores.
_RESUME, _FLOW_END, _FLOW_START, _CORE_END = 0, 1, 2, 3
#: Runs after the first that `simulate(steady=True)` takes at most to reach the steady state.
STEADY_RUNS = 12


#: Instruction kinds as module constants: the hot loop compares kinds by identity.
_FORWARD, _BACKWARD, _BACKWARD_INPUT, _BACKWARD_WEIGHT = (
    InstrKind.FORWARD,
    InstrKind.BACKWARD,
    InstrKind.BACKWARD_INPUT,
    InstrKind.BACKWARD_WEIGHT,
)
_SEND, _RECV, _ALLREDUCE, _OPTIMIZER_STEP, _FREE, _LOAD = (
    InstrKind.SEND,
    InstrKind.RECV,
    InstrKind.ALLREDUCE,
    InstrKind.OPTIMIZER_STEP,
    InstrKind.FREE,
    InstrKind.LOAD_MICROBATCH,
)
_TENSOR = InstrKind.TENSOR_ALLREDUCE
_KIND_OF = attrgetter("kind")
#: Group collectives besides `allreduce`: each blocks its members until its ring ends (ZeRO-1's two halves).
_REDUCE_SCATTER, _ALL_GATHER = InstrKind.REDUCE_SCATTER, InstrKind.ALL_GATHER


class _RankCosts(NamedTuple):
    """What `_Simulator.advance` reads of one rank, in one lookup per call."""

    instrs: list[Instr]
    fwd: dict[Stage, float]
    """Seconds of a forward of each stage on the rank's device at its replica's rows; the same for the next three."""
    bwd: dict[Stage, float]
    bwd_input: dict[Stage, float]
    bwd_weight: dict[Stage, float]
    step_s: float
    """Its optimizer step's seconds."""
    host: list[float] | None
    """Per instruction, the host's own seconds (`host_s`); None where no device prices them."""
    core_path: tuple[int, int] | None
    """Its (node's cores, own thread) links where ranks share cores (`_core_paths`), else None."""
    posts: list[list[tuple] | None] | None  # type: ignore[type-arg]
    """Per instruction, the receives (transfer keys) posted right before it (None: none): each recv at its own index, or
    earlier where `peak_memory.recv_posts` moves it. Worked out for a rank once its part runs (`_Simulator.prepare`):
    None before."""


def _posts(
    module: Module, rank: int, sizes: Sizes, shape_key: tuple[object, ...] | None
) -> tuple[list[list[tuple] | None], list[tuple[int, float]]]:  # type: ignore[type-arg]
    """Of `rank`'s program (of shape `shape_key`, where given): the receives posted before each instruction
    (`_RankCosts.posts`), and (instruction index, bytes) of each change of its live memory under those posts."""
    program = module.programs[rank]
    early, changes = posted_changes(module, program, sizes, shape_key)
    # By index, not a dict: the engine looks at every instruction, and a list index is the cheapest look.
    here: list[list[tuple] | None] = [None] * len(program.instrs)  # type: ignore[type-arg]
    instrs = program.instrs
    # The receives found without a Python call per instruction: a thousand ranks' programs are millions of them.
    for index in compress(count(), map(is_, map(_KIND_OF, instrs), repeat(_RECV))):
        instr = instrs[index]
        post = early.get(index, index)
        recv_key = (instr.value, instr.grad, instr.mb, instr.peer, rank)
        at = here[post]
        if at is None:
            here[post] = [recv_key]
        else:
            at.append(recv_key)
    return here, changes


@dataclass(slots=True)
class _RunState:
    """What one run of `_Simulator` changes as it goes; the simulator itself holds what every run shares."""

    sharing: LinkSharing
    """The links' flows: transfers and ring steps."""
    cores: LinkSharing | None
    """Work on shared cores (`_core_paths`), None where no ranks share them."""
    replayed: Mapping[tuple[int, int], float] | None
    """Measured seconds by (rank, instruction index), None when none are given (the hot loop skips the lookup)."""
    starts: list[list[float]]
    ends: list[list[float]]
    clock: list[float]
    """Per rank: its own time, where it stopped."""
    busy: list[float]
    pc: list[int]
    """Per rank: the instruction it stopped at."""
    reduce_seen: list[dict[tuple, int]]  # type: ignore[type-arg]
    """Per rank: how many allreduces of each (group, target) it has reached."""
    parked_key: list[tuple | None]  # type: ignore[type-arg]
    """Per rank: the allreduce it waits in, else None."""
    heap: list[tuple[float, int, int, int, int]] = field(default_factory=list)
    """The event queue: (time, ticket, event, subject, version)."""
    ticket: int = 0
    now: float = 0.0
    """The global clock: the time of the event running, or later where a rank acted on it (`on_global_clock`)."""
    computing: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Work on shared cores in flight: its flow -> (rank, instruction index)."""
    waited_on: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    """(rank, index) -> (rank, index) whose completion the instruction waited for."""
    held_by: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    """(rank, send index) -> (rank, index) the receiver ran before posting the receive that held the bytes back."""
    arrivals: dict[tuple, tuple[float, int, int]] = field(default_factory=dict)  # type: ignore[type-arg]
    """(value, grad, mb, sending rank, receiving rank) -> (arrival time, sending rank, send index)."""
    recv_waiters: dict[tuple, int] = field(default_factory=dict)  # type: ignore[type-arg]
    posted: dict[tuple, tuple[float, int]] = field(default_factory=dict)  # type: ignore[type-arg]
    """Transfer key -> (when its receive was posted, the instruction it was posted before)."""
    unposted: dict[tuple, _Transfer] = field(default_factory=dict)  # type: ignore[type-arg]
    """Sends issued before their receive's post, by transfer key."""
    deferred: dict[int, _Transfer] = field(default_factory=dict)
    """Transfers waiting in the queue for the ready notice, by ticket."""
    began: dict[tuple, float] = field(default_factory=dict)  # type: ignore[type-arg]
    """Transfer key -> when its bytes started to move, for receivers whose computing slows them (`landing`)."""
    reduce_members: dict[tuple, list[tuple[float, int, int]]] = field(default_factory=dict)  # type: ignore[type-arg]
    reduce_done: dict[tuple, tuple[float, float, int, int]] = field(default_factory=dict)  # type: ignore[type-arg]
    owners: dict[int, tuple] = field(default_factory=dict)  # type: ignore[type-arg]
    """flow -> (transfer key, sending rank, send index, latency) or (allreduce key,)."""
    pending: dict[tuple, list[float]] = field(default_factory=dict)  # type: ignore[type-arg]
    """Allreduce key -> [its ring's steps still moving, the latency after the last]."""
    quotient: ReplicaQuotient | None = None
    """Where replica 0 of the part runs for all its replicas (`dapple_ir.sim.symmetry`): its rings' flows."""


class _Simulator:
    def __init__(
        self,
        module: Module,
        cluster: ClusterSpec,
        fractions: dict[Stage, float],
        prices: OpPrices,
        shapes: list[tuple[object, ...]] | None = None,
    ) -> None:
        self.module = module
        self.cluster = cluster
        self.devices = [_device_of(module, p, r) for r, p in enumerate(module.programs)]
        for r, d in enumerate(self.devices):
            if not 0 <= d < cluster.num_devices:
                raise DappleError(
                    f"rank {r} runs on device {d}, but cluster {cluster.name} has devices 0..{cluster.num_devices - 1}"
                )
        self.hosted = [hosted_stages(module, p) for p in module.programs]
        kinds = self.kinds = [cluster.device(d) for d in self.devices]
        # Per rank, what going on after a wait that blocked costs it (`wake_overhead`); None where nothing does.
        wakes = [kind.wake_overhead for kind in kinds]
        self.wake = wakes if any(wakes) else None
        # Per receiving rank, how much slower a transfer into it moves while it computes; None where none is.
        slowdowns = [kind.busy_receive_slowdown for kind in kinds]
        self.slowdowns = slowdowns if any(s != 1.0 for s in slowdowns) else None
        self.core_paths, self.core_capacity = _core_paths(cluster, self.devices)
        self.sizes = Sizes(module)
        # Each program's `peak_memory.program_shape`, where the caller has them (`predict`): else worked out here.
        self.shapes = shapes
        self.network = Network(cluster)
        self.bandwidth = [link.bandwidth for link in self.network.links]
        # The links with no flows on them: whether a path takes time at all.
        self.idle = LinkSharing(self.bandwidth)
        self.reduce_bytes: dict[Stage, float] = {}
        self.routes: dict[tuple[Op, int, int, tuple[int, int] | None], tuple[float, tuple[int, ...], float]] = {}
        self.tied: set[str] | None = None
        # Per rank, the seconds of each value's tensor_allreduce (`tensor_s`), priced once.
        self.tensor: list[dict[Op, float]] = [{} for _ in module.programs]
        # Per rank, (instruction index, bytes) of each change of its live memory under its receives' posts, once its
        # part runs (`prepare`): a copy of another part needs none of its own.
        self.changes: list[list[tuple[int, float]] | None] = [None] * len(module.programs)
        # Per rank and instruction, the host's own seconds (`host_s`); None where no device prices them.
        priced = any(kind.prices_host for kind in kinds)
        host = [host_s(p, kind) for p, kind in zip(module.programs, kinds, strict=True)] if priced else None
        compute = self.compute_s(fractions, prices)
        self.of_rank = [
            _RankCosts(
                program.instrs,
                *compute[r],
                self.optimizer_s(r),
                host[r] if host is not None else None,
                self.core_paths[r] if self.core_paths is not None else None,
                None,
            )
            for r, program in enumerate(module.programs)
        ]
        # What the look at the programs for their parts finds, kept for the copy check (the programs do not change
        # while a simulator holds them: each rank's costs hold its instructions).
        self.meetings = Meetings(module.programs)
        self.parts = self.find_parts()

    def compute_s(
        self, fractions: dict[Stage, float], prices: OpPrices
    ) -> list[tuple[dict[Stage, float], dict[Stage, float], dict[Stage, float], dict[Stage, float]]]:
        """Per rank, the seconds of a forward, backward, input pass and weight pass of each stage on its device at its
        replica's rows (`_durations`), worked out once per distinct (stage, rows, device kind)."""
        module = self.module
        durations: dict[tuple[Stage, int, int, str], tuple[float, float, float, float]] = {}
        tables = []
        for rank, program in enumerate(module.programs):
            kind = self.cluster.device(self.devices[rank])
            rows = replica_rows(module, program.attrs.replica or 0)
            fwd, bwd, bwd_input, bwd_weight = {}, {}, {}, {}
            for stage in module.stages:
                lo, hi = rows(stage)
                key = (stage, lo, hi, kind.name)
                if key not in durations:
                    times = prices.stage_times(stage.ops, hi - lo, kind, stage.tp)
                    durations[key] = _durations(module, stage, times, kind, fractions[stage])
                fwd[stage], bwd[stage], bwd_input[stage], bwd_weight[stage] = durations[key]
            tables.append((fwd, bwd, bwd_input, bwd_weight))
        return tables

    # ----------------------------------------------------------------------- instruction costs

    def route(
        self, state: _RunState, value: Op, src: int, dst: int, rows: tuple[int, int] | None
    ) -> tuple[float, tuple[int, ...], float]:
        """(bytes, links, latency) of `send value` (its `rows`, where given) from rank src to rank dst; no
        links when the path costs nothing (ideal links)."""
        a, b = self.devices[src], self.devices[dst]
        path = self.network.path(a, b)
        found = self.routes[(value, src, dst, rows)] = (
            transfer_bytes(self.module, value, rows),
            () if state.sharing.is_free(path) else path,
            self.network.latency(a, b),
        )
        return found

    def tensor_s(self, rank: int, instr: Instr) -> float:
        """Seconds of a tensor_allreduce on `rank`: a ring over its tensor group on the node's fabric, of the value's
        bytes at the rows the rank's replica computes (`pricing.tensor.tensor_reduce_s`). The group's members run
        alike, so it is priced as the rank's own time; it does not share the links with other traffic here."""
        value = instr.value
        assert value is not None and instr.group is not None
        found = self.tensor[rank].get(value)
        if found is None:
            nbytes = transfer_bytes(self.module, value, whole=summed_bytes(value, len(instr.group)))
            b = self.module.attrs.microbatch_size
            stage = next((s for s in self.hosted[rank] if s.split), None)
            if stage is not None and b:
                lo, hi = replica_rows(self.module, self.module.programs[rank].attrs.replica or 0)(stage)
                nbytes *= (hi - lo) / b
            devices = [self.devices[g] for g in instr.group]
            found = self.tensor[rank][value] = tensor_reduce_s(self.network, devices, nbytes)
        return found

    def optimizer_s(self, rank: int) -> float:
        kind = self.cluster.device(self.devices[rank])
        # Replicas host the same stages: `sizes` reads each distinct set once, not once per rank.
        param_bytes = self.sizes.param_bytes(self.hosted[rank])
        # A sharded stage's replica steps 1/R of the parameters it shards (ZeRO-1), the tied ones whole.
        for stage in self.hosted[rank]:
            if stage.sharded:
                param_bytes -= memory.shardable_param_bytes(self.module, stage) * (1.0 - 1.0 / stage.replicas)
        return optimizer_step_s(kind, param_bytes, memory.optimizer_state_factor(self.module.attrs.optimizer))

    def reduced(self, instr: Instr) -> tuple[tuple, float]:  # type: ignore[type-arg]
        """(what is reduced over which group, and how, bytes) of an allreduce, reduce-scatter or all-gather."""
        assert instr.group is not None
        if instr.param is not None:
            target, nbytes = "param " + instr.param, float(self.module.param(instr.param).nbytes)
        else:
            assert instr.stage is not None
            target, nbytes = "stage " + instr.stage.name, self.stage_reduce_bytes(instr.stage)
        return (tuple(sorted(instr.group)), f"{instr.kind.value} {target}"), nbytes

    def stage_reduce_bytes(self, stage: Stage) -> float:
        """Gradient bytes a stage's replicas sum: its trainable parameters less the tied ones, which
        `lower-comm` reduces separately with `allreduce param`."""
        if stage in self.reduce_bytes:
            return self.reduce_bytes[stage]  # every replica of the stage asks
        if self.tied is None:
            self.tied = set(tied_params(self.module))
        table = {p.name: p for p in self.module.params}
        read = {name for op in stage.ops for name in op.attrs.params or ()}
        tied = sum(table[name].nbytes for name in read & self.tied if not table[name].attrs.buffer)
        self.reduce_bytes[stage] = self.sizes.param_bytes((stage,)) - tied
        return self.reduce_bytes[stage]

    # ---------------------------------------------------------------------------- the main loop

    def settle(self, replay: Mapping[tuple[int, int], float]) -> tuple[SimulationResult, list[float]]:
        """The iteration in the steady state of back-to-back steps that all take `replay`'s times: `follow` again
        and again from every rank at 0, until every rank's step takes what it took the run before (at most
        `STEADY_RUNS` runs after the first); the last run, and when each rank ended it."""
        result, ends = self.follow(replay, [0.0] * len(self.module.programs))
        took = ends
        for _ in range(STEADY_RUNS):
            result, after = self.follow(replay, ends)
            now_took = [b - a for a, b in zip(ends, after, strict=True)]
            tolerance = 1e-9 * max(result.iteration_s, 1e-12)
            settled = all(abs(a - b) <= tolerance for a, b in zip(now_took, took, strict=True))
            ends, took = after, now_took
            if settled:
                break
        return result, ends

    def follow(
        self, replay: Mapping[tuple[int, int], float], begin: list[float]
    ) -> tuple[SimulationResult, list[float]]:
        """One step after a step that each rank ended at its time in `begin`: the run from there, its times from
        its first instruction's start and its `iteration_s` the period (from the last rank's end of the step
        before to its end of this one); and when each rank ended it."""
        result = self.run(replay, begin)
        ends = [max(e, default=b) for e, b in zip(result.ends, begin, strict=True)]
        origin = min(min(s, default=b) for s, b in zip(result.starts, begin, strict=True))
        result.starts = [[t - origin for t in s] for s in result.starts]
        result.ends = [[t - origin for t in e] for e in result.ends]
        result.memory = [[(max(0.0, t - origin), b) for t, b in curve] for curve in result.memory]
        result.iteration_s = max(ends) - max(begin)
        return result, ends

    def run(self, replay: Mapping[tuple[int, int], float], begin: list[float] | None = None) -> SimulationResult:
        """One iteration, the instructions in `replay` taking its seconds; each rank from its time in `begin`
        (default 0). Each run starts with idle links."""
        state = self.engine(replay, begin)
        return self.result(state)

    def engine(self, replay: Mapping[tuple[int, int], float], begin: list[float] | None = None) -> _RunState:
        """`run`'s events, run out (every rank to its last instruction): each independent part on its own
        (`dapple_ir.sim.parts`), their timelines put together."""
        states = [self.run_part(part, replay, begin) for part in self.parts]
        state = states[0] if len(states) == 1 else self.merged(states)
        self.check_finished(state.pc)
        return state

    def run_part(
        self,
        part: list[int],
        replay: Mapping[tuple[int, int], float],
        begin: list[float] | None,
        quotient: ReplicaQuotient | None = None,
    ) -> _RunState:
        """The events of the ranks of one part (ascending), run out; the other ranks' entries stay empty. `quotient`:
        where `part` is replica 0 of a part whose replicas it runs for (`dapple_ir.sim.symmetry`)."""
        programs = self.module.programs
        n = len(programs)
        self.prepare(part)
        starts: list[list[float]] = [[] for _ in range(n)]
        ends: list[list[float]] = [[] for _ in range(n)]
        for r in part:
            starts[r] = [0.0] * len(programs[r].instrs)
            ends[r] = [0.0] * len(programs[r].instrs)
        state = _RunState(
            # Under a quotient each link counts its flows for every replica (`sim.link_sharing`'s weights).
            sharing=LinkSharing([b * quotient.replicas for b in self.bandwidth] if quotient else self.bandwidth),
            cores=LinkSharing(self.core_capacity) if self.core_paths is not None else None,
            replayed=replay or None,
            starts=starts,
            ends=ends,
            clock=list(begin) if begin is not None else [0.0] * n,
            busy=[0.0] * n,
            pc=[0] * n,
            reduce_seen=[{} for _ in range(n)],
            parked_key=[None] * n,
            quotient=quotient,
        )
        for r in part:
            self.push(state, state.clock[r], _RESUME, r)
        heap, heappop, advance, flow_end = state.heap, heapq.heappop, self.advance, self.flow_end
        while heap:
            now, _, event, subject, version = heappop(heap)
            if event == _RESUME:
                state.now = now
                advance(state, subject)
            elif event == _FLOW_END:
                flow_end(state, now, subject, version)
            elif event == _FLOW_START:
                self.flow_start(state, now, subject)
            else:
                self.core_end(state, now, subject, version)
        return state

    def merged(self, states: list[_RunState]) -> _RunState:
        """One state of the parts' runs: each rank's timeline from its part's; parts cross no common link."""
        merged = states[0]
        carried = merged.sharing.carried
        for state, part in zip(states[1:], self.parts[1:], strict=True):
            for r in part:
                merged.starts[r], merged.ends[r] = state.starts[r], state.ends[r]
                merged.busy[r], merged.pc[r] = state.busy[r], state.pc[r]
            merged.waited_on.update(state.waited_on)
            merged.held_by.update(state.held_by)
            for k, nbytes in enumerate(state.sharing.carried):
                if nbytes:
                    carried[k] += nbytes
        return merged

    def iteration_and_peak(self) -> tuple[float, float]:
        """(`iteration_s`, the most of `peak_bytes`) of `run` without replay, the rest of its result left out. A part
        that is a copy of another (`dapple_ir.sim.parts`) is not run again: its timeline is the other's; a part whose
        data-parallel replicas are images of its first runs as that replica alone (`dapple_ir.sim.symmetry`)."""
        programs = self.module.programs
        iteration = 0.0
        distinct = self.distinct_parts()
        for part in distinct:
            quotient = self.replica_quotient(part)
            ranks = quotient.ranks if quotient is not None else part
            state = self.run_part(ranks, {}, None, quotient)
            if any(state.pc[r] < len(programs[r].instrs) for r in ranks):
                self.engine({})  # says which ranks of every part are stuck
            iteration = max(iteration, max((max(state.ends[r], default=0.0) for r in ranks), default=0.0))
            if quotient is not None:
                self.prepare(quotient.others)  # their memory's changes, for the peaks
        # Ranks of one program shape share their changes (`peak_memory.posted_changes`): each peak walked once. A
        # copy's ranks hold their counterparts' stages and programs of their shape: their peaks are those.
        peaks: dict[tuple[int, float], float] = {}
        for part in distinct:
            for r in part:
                changes = self.changes[r]
                assert changes is not None
                static = self.sizes.static_of(self.hosted[r])
                key = (id(changes), static)
                if key not in peaks:
                    peaks[key] = max(accumulate((change for _i, change in changes), initial=static))
        return iteration, max(peaks.values(), default=0.0)

    def prepare(self, ranks: list[int]) -> None:
        """Work out where the receives of `ranks` are posted, and their memory's changes (`_posts`), once."""
        for r in ranks:
            if self.changes[r] is None:
                key = self.shapes[r] if self.shapes is not None else None
                posts, self.changes[r] = _posts(self.module, r, self.sizes, key)
                self.of_rank[r] = self.of_rank[r]._replace(posts=posts)

    # ------------------------------------------------------------------------------ independent parts

    def find_parts(self) -> list[list[int]]:
        """The ranks in independent parts (`dapple_ir.sim.parts.independent_parts`); ranks on one node's shared cores
        in one."""
        parts = independent_parts(
            self.module.programs, self.route_links, lambda instr: self.ring_of(instr)[0], self.meetings
        )
        if self.core_paths is None:
            return parts
        by_node: dict[int, list[int]] = {}
        for r, path in enumerate(self.core_paths):
            if path is not None:
                by_node.setdefault(path[0], []).append(r)
        return join(parts, list(by_node.values()))

    def distinct_parts(self) -> list[list[int]]:
        """The parts that are no copy of an earlier one (`dapple_ir.sim.parts.CopyCheck`)."""
        programs = self.module.programs
        check = CopyCheck(
            programs,
            self.same_rank,
            self.route_links,
            lambda src, dst: self.network.latency(self.devices[src], self.devices[dst]),
            lambda instr, _rank: self.ring_of(instr),
            self.bandwidth,
            self.meetings,
        )
        return check.distinct(self.parts)

    def replica_quotient(self, part: list[int]) -> ReplicaQuotient | None:
        """Replica 0 of `part` standing for all its replicas, where they are its images (`sim.symmetry`)."""
        if self.core_paths is not None or self.slowdowns is not None:
            return None
        return replica_quotient(
            part,
            self.module.programs,
            self.costs_alike,
            lambda src, dst: (self.route_links(src, dst), self.network.latency(self.devices[src], self.devices[dst])),
            self.ring_paths,
            self.tensor_s,
            self.bandwidth,
            self.meetings.of,
        )

    def route_links(self, src: int, dst: int) -> tuple[int, ...]:
        """The links a send from rank `src` to rank `dst` takes time on: none where its path is free."""
        path = self.network.path(self.devices[src], self.devices[dst])
        return () if self.idle.is_free(path) else path

    def ring_of(self, instr: Instr) -> tuple[list[tuple[int, ...]], tuple[float, ...]]:
        """The links each step of a collective's ring takes time on (as `arrive` starts them), and its price."""
        assert instr.group is not None
        ring = ring_allreduce(self.network, [self.devices[m] for m in instr.group])
        price = (ring.members, ring.link_per_byte_s, ring.host_per_byte_s, ring.fixed_s)
        return (self.ring_paths(instr.group) if self.reduced(instr)[1] > 0 else []), price

    def ring_paths(self, group: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The links of each step of a ring over `group` that takes time on any (as `arrive` starts them)."""
        ring = ring_allreduce(self.network, [self.devices[m] for m in group])
        paths = [self.network.path(a, b) for a, b in ring.steps]
        return [p for p in paths if not self.idle.is_free(p)]

    def same_rank(self, r: int, s: int) -> bool:
        """Whether ranks `r` and `s` run on devices of one kind, with one replica, stages and costs, alone on their
        cores (the rest of `dapple_ir.sim.parts.CopyCheck`'s conditions on a rank)."""
        return self.module.programs[r].attrs.replica == self.module.programs[s].attrs.replica and self.costs_alike(r, s)

    def costs_alike(self, r: int, s: int) -> bool:
        """Whether ranks `r` and `s` run on devices of one kind, with the same stages and costs, alone on their
        cores."""
        a, b = self.of_rank[r], self.of_rank[s]
        return (
            self.kinds[r] == self.kinds[s]
            and self.hosted[r] == self.hosted[s]
            and a.core_path is None
            and b.core_path is None
            and (a.fwd, a.bwd, a.bwd_input, a.bwd_weight, a.step_s, a.host)
            == (b.fwd, b.bwd, b.bwd_input, b.bwd_weight, b.step_s, b.host)
        )

    def advance(self, state: _RunState, r: int) -> None:
        """Run rank `r` from where it stopped until it must wait: for a receive's data, for its allreduce's ring, for
        its work on shared cores, or for the global clock where it would act on it (start a flow, a ring or shared
        work) at a time when something else happens first. Compute needs no clock: the rank runs ahead on its own."""
        instrs, fwd, bwd, bwd_input, bwd_weight, step_s, own_host, core_path, posts_of = self.of_rank[r]
        assert posts_of is not None  # its part was prepared
        tensor_of = self.tensor[r]
        st, en, replayed = state.starts[r], state.ends[r], state.replayed
        i, t, limit, worked = state.pc[r], state.clock[r], len(instrs), 0.0
        while i < limit:
            instr = instrs[i]
            kind = instr.kind
            posts = posts_of[i]
            if posts is not None:
                self.post(state, r, i, t, posts)
            # Compute kinds fall through to the common tail; the others finish their own entry. Kinds compare by
            # identity: hashing an enum member runs Python code, too slow per instruction.
            if kind is _TENSOR:  # the most frequent kind under tensor parallelism: tried first
                priced = tensor_of.get(instr.value)  # type: ignore[arg-type]
                d = self.tensor_s(r, instr) if priced is None else priced
            elif kind is _FORWARD:
                d = fwd[instr.stage]  # type: ignore[index]
            elif kind is _BACKWARD:
                d = bwd[instr.stage]  # type: ignore[index]
            elif kind is _FREE or kind is _LOAD:
                # Host work of the rank's own: timed only in a replay (a measured step's loads and frees).
                d = replayed.get((r, i), 0.0) if replayed is not None else 0.0
                if d <= 0.0:
                    st[i] = en[i] = t
                    i += 1
                    continue
            elif kind is _SEND:
                if not self.on_global_clock(state, r, t):
                    break
                self.send(state, r, i, instr, t)
                i += 1
                continue
            elif kind is _RECV or kind is _ALLREDUCE or kind is _REDUCE_SCATTER or kind is _ALL_GATHER:
                # Both may block the rank: until the data is in, or the ring has ended; each sets its own end.
                if not (self.receive if kind is _RECV else self.allreduce)(state, r, i, instr, t):
                    break
                t = en[i]
                i += 1
                continue
            elif kind is _BACKWARD_INPUT:
                d = bwd_input[instr.stage]  # type: ignore[index]
            elif kind is _BACKWARD_WEIGHT:
                d = bwd_weight[instr.stage]  # type: ignore[index]
            elif kind is _OPTIMIZER_STEP:
                d = step_s
            else:
                st[i] = en[i] = t
                i += 1
                continue
            if own_host is not None:
                d += own_host[i]
            if replayed is not None:
                d = replayed.get((r, i), d)
            if core_path is not None and d > 0:
                if self.on_global_clock(state, r, t):
                    self.share_cores(state, r, i, t, d, core_path)
                break
            st[i] = t
            t += d
            en[i] = t
            worked += d
            i += 1
        state.pc[r], state.clock[r] = i, t
        state.busy[r] += worked

    def on_global_clock(self, state: _RunState, r: int, t: float) -> bool:
        """Whether rank `r` may act on the global clock at its own time `t` (a flow, a ring or work on shared cores
        starts there): yes, the clock moved on to `t`, where nothing else happens first; else it waits in the queue
        for `t`."""
        if t <= state.now:
            return True
        heap = state.heap
        if heap and heap[0][0] < t:
            self.push(state, t, _RESUME, r)
            return False
        state.now = t
        return True

    def post(self, state: _RunState, r: int, i: int, t: float, posts: list[tuple]) -> None:  # type: ignore[type-arg]
        """Post the receives of rank `r` that go before its instruction `i`, at `t` (once: a rank parked there comes
        back to it). A send already issued for one starts its bytes when the ready notice reaches it."""
        posted = state.posted
        for post in posts:
            if post in posted:
                continue
            posted[post] = (t, i)
            waiting = state.unposted.pop(post, None)
            if waiting is not None:
                self.defer(state, t + waiting.notice, waiting)
                if i > 0:  # the transfer waited for what this rank ran before posting
                    state.held_by[(waiting.src, waiting.index)] = (r, i - 1)

    def send(self, state: _RunState, r: int, i: int, instr: Instr, t: float) -> None:
        """Issue instruction `i` of rank `r`, a send, at `t` (the global clock): its bytes flow once the receive is
        posted and the ready notice is back."""
        value, peer = instr.value, instr.peer
        route = self.routes.get((value, r, peer, instr.rows))  # type: ignore[arg-type]
        if route is None:
            route = self.route(state, value, r, peer, instr.rows)  # type: ignore[arg-type]
        nbytes, path, latency = route
        # Pieces of one value (split stages) reach one rank from several: the sender is in the key.
        key: tuple = (value, instr.grad, instr.mb, r, peer)  # type: ignore[type-arg]
        state.starts[r][i] = t
        replayed = state.replayed
        timed = replayed.get((r, i)) if replayed is not None else None
        if timed is None:
            transfer = _Transfer(key, r, i, nbytes, path, latency, latency)
        else:  # measured: arrives `timed` after the later of now and the post, on no link
            transfer = _Transfer(key, r, i, nbytes, (), timed, 0.0, measured=True)
        posted = state.posted.get(key)
        if nbytes <= 0:
            self.start_transfer(state, t, transfer)  # nothing moves, nothing to wait for
        elif posted is None:
            state.unposted[key] = transfer
        elif posted[0] + transfer.notice > t:
            self.defer(state, posted[0] + transfer.notice, transfer)
            if posted[1] > 0:
                state.held_by[(r, i)] = (peer, posted[1] - 1)  # type: ignore[assignment]
        else:
            self.start_transfer(state, t, transfer)

    def receive(self, state: _RunState, r: int, i: int, instr: Instr, t: float) -> bool:
        """Instruction `i` of rank `r`, a receive, reached at `t`: False where its data has not arrived (the rank
        waits for it), else True and its start and end are set."""
        key = (instr.value, instr.grad, instr.mb, instr.peer, r)
        got = state.arrivals.get(key)
        if got is None:
            state.recv_waiters[key] = r
            return False
        state.starts[r][i] = t
        arrival = got[0]
        slowdowns, began = self.slowdowns, state.began
        if slowdowns is not None and slowdowns[r] != 1.0 and key in began:
            arrival = self.landing(state, r, i, began.pop(key), arrival, got)
        if arrival > t:
            t = arrival + (self.wake[r] if self.wake is not None else 0.0)
            state.waited_on[(r, i)] = (got[1], got[2])
        state.ends[r][i] = t
        return True

    def allreduce(self, state: _RunState, r: int, i: int, instr: Instr, t: float) -> bool:
        """Instruction `i` of rank `r`, an allreduce, reached at `t`: False where its ring has not ended (the rank
        waits for it; the last member to arrive starts it), else True and its start and end are set."""
        reduced = state.parked_key[r]
        if reduced is None:
            if not self.on_global_clock(state, r, t):
                return False
            reduced = self.arrive(state, r, i, t, instr)
        done = state.reduce_done.get(reduced)
        if done is None:
            state.parked_key[r] = reduced
            return False
        state.parked_key[r] = None
        if (done[2], done[3]) != (r, i):
            state.waited_on[(r, i)] = (done[2], done[3])
        end = done[1]
        if end > t and self.wake is not None:
            end += self.wake[r]  # the rank blocked in the ring: it waits for a core to go on
        state.starts[r][i], state.ends[r][i] = t, end
        return True

    def share_cores(self, state: _RunState, r: int, i: int, t: float, d: float, core_path: tuple[int, int]) -> None:
        """Start instruction `i` of rank `r`, `d` seconds of work on shared cores, at `t` (the global clock): it ends
        when its share has done it (`core_end`)."""
        assert state.cores is not None
        state.starts[r][i] = t
        flow, moved = state.cores.start(t, core_path, d)
        state.computing[flow] = (r, i)
        for bundle, end, current in moved:
            self.push(state, end, _CORE_END, bundle, current)

    # ------------------------------------------------------------------------------------ events

    def flow_end(self, state: _RunState, now: float, bundle: int, version: int) -> None:
        """The first flows of a bundle over one path may be through at `now` (unless the bundle's rates changed)."""
        sharing = state.sharing
        if not sharing.is_current(bundle, version):
            return
        through, moved = sharing.finish(now, bundle)
        self.reschedule(state, moved)
        owners = state.owners
        for flow in through:
            self.flow_ended(state, owners.pop(flow), now)

    def flow_start(self, state: _RunState, now: float, ticket: int) -> None:
        """A deferred transfer's ready notice reaches its sender at `now`: its bytes start once the sender answers."""
        transfer = state.deferred.pop(ticket)
        answered = self.answered_s(state, transfer, now)
        if answered > now:
            self.defer(state, answered, replace(transfer, answered=True))
        else:
            self.start_transfer(state, now, transfer)

    def core_end(self, state: _RunState, now: float, bundle: int, version: int) -> None:
        """The first computations of a bundle on shared cores may be done at `now`: their ranks go on from there."""
        cores = state.cores
        assert cores is not None
        if not cores.is_current(bundle, version):
            return
        through, moved = cores.finish(now, bundle)
        for moved_bundle, end, current in moved:
            self.push(state, end, _CORE_END, moved_bundle, current)
        for flow in through:
            rank, index = state.computing.pop(flow)
            state.ends[rank][index] = now
            state.busy[rank] += now - state.starts[rank][index]
            state.pc[rank], state.clock[rank] = index + 1, now
            self.push(state, now, _RESUME, rank)

    def push(self, state: _RunState, time: float, event: int, subject: int, version: int = 0) -> None:
        """Queue an event; a ticket breaks ties between events at the same time: first pushed, first run."""
        state.ticket += 1
        heapq.heappush(state.heap, (time, state.ticket, event, subject, version))

    def reschedule(self, state: _RunState, moved: list[Reschedule]) -> None:
        for bundle, end, version in moved:
            self.push(state, end, _FLOW_END, bundle, version)

    def defer(self, state: _RunState, start: float, transfer: _Transfer) -> None:
        """Start `transfer` at `start`, when the receiver's ready notice reaches its sender."""
        state.ticket += 1
        state.deferred[state.ticket] = transfer
        heapq.heappush(state.heap, (start, state.ticket, _FLOW_START, state.ticket, 0))

    def answered_s(self, state: _RunState, transfer: _Transfer, now: float) -> float:
        """When the sender's transport answers the ready notice of a transfer whose send was issued before its
        receive was posted, the notice reaching the sender at `now`. Where the sender's device slows a busy rank's
        transfers (`busy_receive_slowdown` above 1: the transport's thread shares the rank's core), once the
        instruction of the sender's own work (`HOST_BUSY_KINDS`) running then is done; else, and for a replayed
        transfer, at once. (A send issued to a posted receive is written by the rank itself as it issues it: no
        answer to wait for.) The sender's instructions up to `now` are all known here: a rank that computes runs
        ahead of the global clock, and one that is parked waits. Under shared cores (`cores_per_node`) the
        instruction in flight has no end yet, and the notice is answered at once."""
        slowdowns = self.slowdowns
        if slowdowns is None or slowdowns[transfer.src] == 1.0 or transfer.answered or transfer.measured:
            return now
        src, instrs = transfer.src, self.module.programs[transfer.src].instrs
        st, en = state.starts[src], state.ends[src]
        for j in range(transfer.index + 1, state.pc[src]):
            if st[j] > now:
                break
            if en[j] > now and instrs[j].kind in HOST_BUSY_KINDS:
                return en[j]
        return now

    def start_transfer(self, state: _RunState, now: float, transfer: _Transfer) -> None:
        """Its send has issued and its receive is posted: the bytes flow from `now` (nothing when there are none)."""
        if self.slowdowns is not None and transfer.nbytes > 0 and not transfer.measured:
            state.began[transfer.key] = now
        if transfer.nbytes > 0 and transfer.path:
            quotient = state.quotient
            flow, moved = state.sharing.start(now, transfer.path, transfer.nbytes, quotient.replicas if quotient else 1)
            state.owners[flow] = (transfer.key, transfer.src, transfer.index, transfer.latency)
            self.reschedule(state, moved)
        else:
            arrival = now + transfer.latency if transfer.nbytes > 0 else now
            self.arrive_at(state, arrival, transfer.key, transfer.src, transfer.index)

    def landing(self, state: _RunState, rank: int, index: int, began: float, arrival: float, got: tuple) -> float:  # type: ignore[type-arg]
        """When a transfer into `rank`, which has reached its receive (instruction `index`), lands: its
        bytes took `arrival - began` on the links, and move `busy_receive_slowdown` times slower during the
        receiver's own work since `began` (`HOST_BUSY_KINDS`, `_landing`). The send's end moves with it."""
        instrs, st, en = self.module.programs[rank].instrs, state.starts[rank], state.ends[rank]
        busy = []
        for j in range(index - 1, -1, -1):
            if instrs[j].kind in HOST_BUSY_KINDS and en[j] > began:
                busy.append((max(st[j], began), en[j]))
            if st[j] <= began:
                break
        busy.reverse()
        landed = _landing(began, arrival - began, busy, self.slowdowns[rank])  # type: ignore[index]
        state.ends[got[1]][got[2]] = landed
        return landed

    def arrive_at(self, state: _RunState, arrival: float, key: tuple, src: int, index: int) -> None:  # type: ignore[type-arg]
        state.arrivals[key] = (arrival, src, index)
        state.ends[src][index] = arrival
        waiter = state.recv_waiters.pop(key, None)
        if waiter is not None:
            self.push(state, arrival, _RESUME, waiter)

    def flow_ended(self, state: _RunState, owner: tuple, now: float) -> None:  # type: ignore[type-arg]
        """A send's bytes are through (its data arrives a latency later), or one step of a ring is."""
        if len(owner) == 1:
            key = owner[0]
            left = state.pending[key]
            left[0] -= 1
            if left[0] == 0:
                self.finish_reduce(state, key, now + left[1])
            return
        key, src, index, latency = owner
        self.arrive_at(state, now + latency, key, src, index)

    def arrive(self, state: _RunState, rank: int, index: int, t: float, instr: Instr) -> tuple:  # type: ignore[type-arg]
        """Register `rank` at an allreduce; the last member to arrive starts the ring."""
        what, nbytes = self.reduced(instr)
        seen = state.reduce_seen[rank]
        occurrence = seen.get(what, 0)
        seen[what] = occurrence + 1
        key = (what, occurrence)
        present = state.reduce_members.setdefault(key, [])
        present.append((t, rank, index))
        quotient = state.quotient
        # Under a quotient the group's members of replica 0 stand for all: each replica's reach it at one time.
        if len(present) < (len(what[0]) if quotient is None else quotient.present[what[0]]):
            return key
        ring = ring_allreduce(self.network, [self.devices[m] for m in what[0]])
        # The ring's steps as flows on their links (`pricing.collectives`); the hosts' reduction after the links. A
        # reduce-scatter or an all-gather is one half of the ring: half its rounds, (n-1)/n of the bytes a step.
        latency = ring.beyond_links_s(instr.kind.value, nbytes)
        per_step = ring.collective_step_bytes(instr.kind.value, nbytes)
        if quotient is not None:
            paths = quotient.rings[what[0]] if nbytes > 0 else []  # every replica's steps, on replica 0's links
        else:
            paths = [self.network.path(a, b) for a, b in ring.steps] if nbytes > 0 else []
            paths = [p for p in paths if not state.sharing.is_free(p)]
        if not paths:
            self.finish_reduce(state, key, t + latency)
            return key
        state.pending[key] = [len(paths), latency]
        for path in paths:
            flow, moved = state.sharing.start(t, path, per_step)
            state.owners[flow] = (key,)
            self.reschedule(state, moved)
        return key

    def finish_reduce(self, state: _RunState, key: tuple, end: float) -> None:  # type: ignore[type-arg]
        present = state.reduce_members.pop(key)
        last = max(present)
        state.reduce_done[key] = (last[0], end, last[1], last[2])
        for _t, member, _i in present:
            self.push(state, end, _RESUME, member)

    def check_finished(self, pc: list[int]) -> None:
        programs = self.module.programs
        stuck = [r for r, p in enumerate(programs) if pc[r] < len(p.instrs)]
        if not stuck:
            return
        from dapple_ir.ir.printer import Namer, format_instr

        namer = Namer(self.module.ops)
        lines = [
            f"rank {r} waits at instruction {pc[r]}: {format_instr(programs[r].instrs[pc[r]], namer)}" for r in stuck
        ]
        raise DappleError(
            "simulate: the programs deadlock; no rank can go on:\n  "
            + "\n  ".join(lines[:16])
            + ("\n  ..." if len(lines) > 16 else "")
        )

    def result(self, state: _RunState) -> SimulationResult:
        starts, ends = state.starts, state.ends
        curves = [self.memory_curve(r, starts[r]) for r in range(len(starts))]
        iteration = max((max(e, default=0.0) for e in ends), default=0.0)
        info = self.network.links
        loads = [
            LinkLoad(info[k].name, info[k].bandwidth, carried)
            for k, carried in enumerate(state.sharing.carried)
            if carried > 0 and info[k].bandwidth < _INF
        ]
        loads.sort(key=lambda load: -load.busy_s)
        return SimulationResult(
            module=self.module,
            cluster_name=self.cluster.name,
            iteration_s=iteration,
            busy_s=state.busy,
            peak_bytes=[max(b for _, b in curve) for curve in curves],
            critical_path=_critical_path(ends, state.waited_on, state.held_by),
            starts=starts,
            ends=ends,
            memory=curves,
            links=loads,
        )

    def memory_curve(self, rank: int, starts: list[float]) -> list[tuple[float, float]]:
        """(time, bytes) after each allocation or release, as `peak_memory.memory_changes` counts them."""
        level = self.sizes.static_of(self.hosted[rank])
        curve = [(0.0, level)]
        for i, change in self.changes[rank] or ():
            level += change
            curve.append((starts[i], level))
        return curve


def _core_paths(cluster: ClusterSpec, devices: list[int]) -> tuple[list[tuple[int, int] | None] | None, list[float]]:
    """Where ranks share cores: per rank, its (node's cores, own thread) links in a `LinkSharing` of the returned
    capacities (None for a rank with a core of its own); (None, []) where no node has more ranks than cores."""
    if not cluster.shares_cores:
        return None, []
    ranks_on: dict[int, int] = {}
    for d in devices:
        ranks_on[cluster.node_of(d)] = ranks_on.get(cluster.node_of(d), 0) + 1
    # The shared nodes' cores are the first links, one per node; each rank's thread follows.
    shared = {
        node: k for k, node in enumerate(n for n, count in sorted(ranks_on.items()) if count > cluster.cores_per_node)
    }
    if not shared:
        return None, []
    capacity = [float(cluster.cores_per_node)] * len(shared)
    paths: list[tuple[int, int] | None] = []
    for d in devices:
        node = shared.get(cluster.node_of(d))
        paths.append(None if node is None else (node, len(capacity)))
        if node is not None:
            capacity.append(1.0)
    return paths, capacity


def _durations(
    module: Module, stage: Stage, times: tuple[float, float], kind: DeviceKind, backward_input_fraction: float
) -> tuple[float, float, float, float]:
    """(forward, backward, backward_input, backward_weight) seconds of `stage` whose ops take `times` (forward,
    backward) on a replica's rows (`pricing.ops.OpPrices.stage_times`: a split replica's rows keep each op call's fixed
    part). A recomputing stage reruns its forward right before the backward (or its input pass). The weight pass
    carries the split's price (`DeviceKind.split_s` of `peak_memory.weight_ops` and their parameter bytes)."""
    fwd, bwd = times
    rerun = fwd if stage.recompute else 0.0
    f = backward_input_fraction
    # The split's own price: one more autograd pass per weight op (none where the stage hands nothing back).
    split = 0.0
    if kind.prices_split:
        ops = weight_ops(module, stage)
        split = kind.split_s(len(ops), module.param_bytes_of(ops))
    return fwd, bwd + rerun, bwd * f + rerun, bwd * (1.0 - f) + split


def host_s(program: RankProgram, kind: DeviceKind) -> list[float]:
    """Per instruction of `program`, the host's own seconds the runtime spends before its work on `kind`: a compute
    instruction's `instruction_overhead`, and on it or on the optimizer step, whichever comes next, `message_overhead`
    for each send and receive since the previous one (the runtime hands sends over at the next instruction that is
    not a send; a receive whose data is there still costs its finish). 0 for every other kind."""
    seconds = [0.0] * len(program.instrs)
    messages = 0
    for i, instr in enumerate(program.instrs):
        if instr.kind in (InstrKind.SEND, InstrKind.RECV):
            messages += 1
        elif instr.kind in COMPUTE_STREAM_KINDS:
            own = instr.kind is not InstrKind.OPTIMIZER_STEP
            seconds[i], messages = host_work_s(kind, own, messages), 0
    return seconds


def _landing(began: float, work: float, busy: list[tuple[float, float]], slowdown: float) -> float:
    """When `work` seconds of transfer, started at `began`, are through if it moves at full speed outside the
    `busy` intervals (ascending, disjoint, none before `began`) and `slowdown` times slower inside them."""
    clock, left = began, work
    for start, end in busy:
        if left <= start - clock:
            return clock + left
        left -= start - clock
        if left <= (end - start) / slowdown:
            return start + left * slowdown
        left -= (end - start) / slowdown
        clock = end
    return clock + left


def _critical_path(
    ends: list[list[float]],
    waited_on: dict[tuple[int, int], tuple[int, int]],
    held_by: dict[tuple[int, int], tuple[int, int]],
) -> list[tuple[int, int]]:
    """Walk back from the instruction that ends last, following each binding wait to its cause.

    A wait on a send whose bytes its receive held back (`held_by`) continues on the receiver, where it posted;
    walking past a send in program order does not (the sender never waits for its own send)."""
    best: tuple[float, int, int] | None = None
    for r, e in enumerate(ends):
        for i in range(len(e) - 1, -1, -1):
            if best is None or e[i] > best[0]:
                best = (e[i], r, i)
    if best is None:
        return []
    path: list[tuple[int, int]] = []
    seen: set[tuple[int, int]] = set()
    r, i = best[1], best[2]
    # End times never rise along the walk; where they tie (free links, zero-time instructions) the walk could come
    # back to an instruction, and stops there.
    while i >= 0 and (r, i) not in seen:
        seen.add((r, i))
        path.append((r, i))
        cause = waited_on.get((r, i))
        if cause is None:
            i -= 1
            continue
        r, i = cause
        held = held_by.get(cause)
        if held is not None:
            path.append(cause)
            r, i = held
    path.reverse()
    return path
