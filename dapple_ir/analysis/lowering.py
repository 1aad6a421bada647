"""The communication a rank program needs around its compute: `lowered_programs` is what `lower-comm`
writes, and what `schedule` checks a hand-written order's deadlocks on.

What crosses which stage boundary is `dapple_ir.analysis.stage_graph`'s answer; a value goes straight from its
producer to each consumer stage, skipping the stages between. Values of `input` ops are never sent: every
rank whose stage holds or reads an input runs `load_microbatch` before its first forward of that microbatch.

Placement keeps the lowering deadlock-free whenever the compute order is: a recv sits right before the
first compute on the rank that needs it, a send right after the compute that produced it (sends never
block). Gradients travel back only for values that depend on trainable parameters. After the rank's last
backward, `allreduce @stage` sums each replicated stage's gradients over its replicas (latest stage first;
for one stage per rank that is right after its last backward, as in DAPPLE); a parameter read by several
stages is left out of those and summed by one `allreduce param @p` over every rank holding it; then the
single `optimizer_step`. A stage that shards its optimizer state (`zero = 1`, ZeRO-1) has `reduce_scatter @s`
in its allreduce's place, and `all_gather @s` (same group, same order) after the step. Collectives only after
the last compute: an allreduce never waits on a rank that waits on a recv.

A round-robin replica holds the microbatches m with m % R == its index, whole. Every replica of a split
stage (`split = true`) holds its rows of every microbatch (`Stage.rows`), so a boundary where either side
splits re-slices the batch: each consumer replica receives, from each producer replica, the rows both
hold (`send %h mb = m rows = lo:hi`), and sends their gradient back the same way; the receiver joins the
pieces in row order. A crossing value without the batch in dimension 0 is sent whole, from producer
replica k % R_p to consumer replica k, when it does not depend on the data (a mask, a position table);
one that does cannot be sliced, and the lowering refuses the split.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import compress, count
from operator import attrgetter

from dapple_ir.analysis import tensor_shards
from dapple_ir.analysis.stage_graph import (
    Crossing,
    batch_dependent,
    batch_statistics,
    batched,
    crossings,
    tied_params,
    values_needing_grad,
)
from dapple_ir.errors import ScheduleError
from dapple_ir.ir import (
    COLLECTIVE_KINDS,
    COMPUTE_KINDS,
    INPUT_GRAD_KINDS,
    Instr,
    InstrKind,
    Module,
    Op,
    OpKind,
    RankProgram,
    Stage,
)
from dapple_ir.ir.scale import collector_paused


def lowered_programs(module: Module) -> list[RankProgram]:
    """New programs: each rank's compute instructions with communication, allreduces and the step."""
    return lowered_with_leads(module)[0]


def lowered_with_leads(module: Module) -> tuple[list[RankProgram], dict[int, int]]:
    """`lowered_programs`, and the lead of each tensor-group member lowered from its lead's instructions (`as_member`):
    member rank -> lead rank, whose programs differ in peers and groups alone. No program has a free (`insert-frees`
    puts them in)."""
    with collector_paused():
        lowering = _Lowering(module)
        return lowering.run(), lowering.leads


@dataclass(frozen=True, slots=True)
class _Piece:
    """One transfer of a crossing value for one microbatch: from rank `src` to rank `dst`, the `rows` of
    the microbatch both hold (split stages), or the whole value (None)."""

    src: int
    dst: int
    rows: tuple[int, int] | None


class _Lowering:
    def __init__(self, module: Module) -> None:
        self.module = module
        self.b = module.attrs.microbatch_size or 0
        # Ranks by (stage, replica, tensor rank); the transfers are planned between tensor rank 0 of each replica
        # (the lead) and mapped onto the members by `member`.
        self.rank_of: dict[tuple[str, int, int], int] = {}
        self.replica_of: dict[int, int] = {}
        self.tensor_of: dict[int, int] = {}
        for index, program in enumerate(module.programs):
            k = program.attrs.tensor_rank or 0
            self.replica_of[index], self.tensor_of[index] = program.attrs.replica or 0, k
            for name in program.attrs.stages or ():
                self.rank_of[(name, program.attrs.replica or 0, k)] = index
        self.crossings = crossings(module)
        self.into: dict[Stage, list[Crossing]] = {s: [] for s in module.stages}
        self.out_of: dict[Stage, list[Crossing]] = {s: [] for s in module.stages}
        for c in self.crossings:
            self.into[c.consumer].append(c)
            self.out_of[c.producer].append(c)
        self.grads = values_needing_grad(module)
        # The crossings whose gradients travel back (`grads`), into and out of each stage.
        self.grads_into = {s: [c for c in cs if c.value in self.grads] for s, cs in self.into.items()}
        self.grads_out_of = {s: [c for c in cs if c.value in self.grads] for s, cs in self.out_of.items()}
        self.tied = tied_params(module)
        self.loads = {s for s in module.stages if any(op.kind is OpKind.INPUT for op in s.ops)}
        self.loads |= {s for s in module.stages for op in s.ops for v in op.operands if v.kind is OpKind.INPUT}
        self.split = any(s.split for s in module.stages)
        if self.split and not self.b:
            raise ScheduleError("lower-comm: split stages need the microbatch size; run schedule first")
        self.dependent = batch_dependent(module) if self.split else set()
        for stage in module.stages:
            coupled = batch_statistics(stage.ops) if stage.split else []
            if coupled:
                raise ScheduleError(
                    f"lower-comm: stage @{stage.name} splits each microbatch over its {stage.replicas} replicas, but "
                    f"%{coupled[0].name} normalises over the batch (batch norm): each replica would normalise its "
                    "rows alone, unlike one device on the whole microbatch; replicate this stage round robin"
                )
        self.memo: dict[tuple[int, int, int], list[_Piece]] = {}
        """`pieces` by the crossing's id and the microbatch modulo the producer's and the consumer's replicas."""
        self.members: dict[tuple[Stage, int, int], int] = {}
        """`member` by its arguments."""
        self.groups: dict[tuple[Stage, int], tuple[int, ...]] = {}
        self.tensor_groups: dict[tuple[Stage, int], tuple[int, ...]] = {}
        # Keyed by the kind's text: hashing an enum member runs Python code.
        self.tensor_reduced: dict[tuple[Stage, str, int, int | None], list[Instr]] = {}
        self.reduces: dict[tuple[Stage, str], list[tuple[Op, bool]]] = {}
        self.leads: dict[int, int] = {}
        """Member rank -> the lead whose instructions `run` lowered it from (`as_member`)."""

    def peer(self, stage: Stage, replica: int, k: int = 0) -> int:
        key = (stage.name, replica % stage.replicas, k)
        if key not in self.rank_of:
            member = f" (tensor rank {k})" if stage.tp > 1 else ""
            raise ScheduleError(f"lower-comm: no rank hosts replica {key[1]}{member} of stage @{stage.name}")
        return self.rank_of[key]

    def member(self, stage: Stage, lead: int, k: int) -> int:
        """Tensor rank `k` of the replica of `stage` whose lead (tensor rank 0) is rank `lead`."""
        found = self.members.get((stage, lead, k))
        if found is None:
            found = self.members[(stage, lead, k)] = self.peer(stage, self.replica_of[lead], k)
        return found

    def lead(self, rank: int, stage: Stage) -> int:
        """The lead of `rank`'s replica of `stage`: the rank the transfers are planned for."""
        return self.peer(stage, self.replica_of[rank])

    def holders(self, stage: Stage, mb: int) -> list[tuple[int, int, int]]:
        """(rank, lo, hi) of each replica of `stage` that computes rows [lo, hi) of microbatch `mb`."""
        if not stage.split:
            return [(self.peer(stage, mb), 0, self.b)]
        return [(self.peer(stage, j), *stage.rows(j, self.b)) for j in range(stage.replicas)]

    def pieces(self, c: Crossing, mb: int) -> list[_Piece]:
        """The transfers that bring `c.value` of microbatch `mb` from the producer's replicas to the consumer's."""
        # The replicas holding a microbatch are those of its index modulo their count (all of a split stage's):
        # the transfers are alike for the microbatches alike modulo both counts.
        key = (id(c), mb % c.producer.replicas, mb % c.consumer.replicas)
        found = self.memo.get(key)
        if found is not None:
            return found
        found = []
        if not (c.producer.split or c.consumer.split):
            found.append(_Piece(self.peer(c.producer, mb), self.peer(c.consumer, mb), None))
        elif batched(self.module, c.value):
            # Re-slice the batch: each consumer replica gets the rows it shares with each producer replica.
            for dst, clo, chi in self.holders(c.consumer, mb):
                for src, plo, phi in self.holders(c.producer, mb):
                    lo, hi = max(clo, plo), min(chi, phi)
                    if lo < hi:
                        found.append(_Piece(src, dst, (lo, hi)))
        elif c.value in self.dependent:
            raise ScheduleError(
                f"lower-comm: %{c.value.name} crosses from @{c.producer.name} to @{c.consumer.name} and depends "
                f"on the batch, but its dimension 0 is not the batch ({c.value.type}), so the replicas of a split "
                "stage cannot slice it; replicate these stages round robin (no split = true)"
            )
        else:
            # The same on every replica (it does not depend on the data): each consumer replica takes it whole.
            producers = self.holders(c.producer, mb)
            for k, (dst, _lo, _hi) in enumerate(self.holders(c.consumer, mb)):
                found.append(_Piece(producers[k % len(producers)][0], dst, None))
        self.memo[key] = found
        return found

    def run(self) -> list[RankProgram]:
        members = self.tensor_members()
        programs = self.module.programs
        out: list[RankProgram] = []
        mapped: dict[int, _MemberMapped] = {}
        kth: dict[int, dict[int, int]] = {}  # tensor rank k -> member k of each rank's group
        for rank, p in enumerate(programs):
            lead = members[rank][0] if members is not None else rank
            if lead < rank and programs[lead].instrs == p.instrs:  # the very instructions of its group's lead
                assert members is not None
                found = mapped.get(lead)
                if found is None:
                    found = mapped[lead] = _member_mapped(out[lead].instrs)
                k = self.tensor_of[rank]
                if k not in kth:
                    kth[k] = {r: group[k] for r, group in members.items()}
                instrs = self.as_member(out[lead].instrs, found, kth[k])
                self.leads[rank] = lead
            else:
                instrs = self.lower(rank, p)
            out.append(RankProgram(p.name, instrs, dataclasses.replace(p.attrs)))
        return out

    def tensor_members(self) -> dict[int, tuple[int, ...]] | None:
        """Each rank's tensor group, ranks by tensor rank, where every stage has one tensor-parallel degree T > 1:
        then member k of a group lowers as its lead (member 0) does, with member k of each group it names
        (`as_member`). None where the degrees differ (a member's peers are not then its lead's peers' members)."""
        degrees = {s.tp for s in self.module.stages}
        if len(degrees) != 1 or degrees == {1}:
            return None
        (t,) = degrees
        members = {}
        for rank, program in enumerate(self.module.programs):
            hosted = program.attrs.stages or ()
            group = (
                tuple(self.rank_of.get((hosted[0], self.replica_of[rank], k), -1) for k in range(t)) if hosted else ()
            )
            if len(group) != t or -1 in group or group[self.tensor_of[rank]] != rank:
                return None
            members[rank] = group
        return members

    def as_member(self, lead: list[Instr], mapped: _MemberMapped, kth: dict[int, int]) -> list[Instr]:
        """Member k's lowered instructions from its lead's (`tensor_members`; `mapped`: `_member_mapped(lead)`; `kth`:
        member k of each rank's tensor group): each transfer with member k of the lead's peer group, each collective
        over member k of each group in it (ascending, as `group` lists them); the rest, the lead's very instructions
        (the group's sums included: the whole group runs them)."""
        out = list(lead)
        # Positional, in a plain loop (quicker than `map` over the fields): a thousand ranks' members hold millions.
        for index, (kind, stage, value, grad, mb, peer, rows, group, param) in zip(*mapped.transfers, strict=True):
            out[index] = Instr(kind, stage, value, grad, mb, kth[peer], rows, group, param)
        for index, (kind, stage, value, grad, mb, peer, rows, group, param) in zip(*mapped.collectives, strict=True):
            if group is not None:
                group = tuple(sorted(kth[g] for g in group))
                out[index] = Instr(kind, stage, value, grad, mb, peer, rows, group, param)
        return out

    def lower(self, rank: int, program: RankProgram) -> list[Instr]:
        compute = [i for i in program.instrs if i.kind._value_ in _COMPUTE]
        first_use, last_grad = self.positions(compute)
        k, replica = self.tensor_of[rank], self.replica_of[rank]
        leads: dict[Stage, int] = {}  # the lead of the rank's replica of each stage (`lead`), asked once
        out: list[Instr] = []
        loaded: set[int] = set()
        # Kinds compare by identity and instructions are made positionally: this loop runs millions of times.
        forward, load = InstrKind.FORWARD, InstrKind.LOAD_MICROBATCH
        for index, instr in enumerate(compute):
            stage, mb, kind = instr.stage, instr.mb, instr.kind
            assert stage is not None and mb is not None
            input_grad = kind._value_ in _INPUT_GRAD
            lead = leads.get(stage)
            if lead is None and (kind is forward or input_grad):
                lead = leads[stage] = self.lead(rank, stage)
            if kind is forward:
                if stage in self.loads and mb not in loaded:
                    loaded.add(mb)
                    out.append(Instr(load, None, None, False, mb))
                out += self.recvs(lead, k, index, stage, mb, first_use)  # type: ignore[arg-type]
            if input_grad:
                out += self.grad_recvs(lead, k, stage, mb)  # type: ignore[arg-type]
            out.append(instr)
            out += self.tensor_reduces(replica, instr)
            if kind is forward:
                out += self.sends(lead, k, stage, mb)  # type: ignore[arg-type]
            if input_grad:
                out += self.grad_sends(lead, k, index, stage, mb, last_grad)  # type: ignore[arg-type]
        out += self.stage_allreduces(rank, program)
        out += self.tied_allreduces(rank)
        out.append(Instr(InstrKind.OPTIMIZER_STEP))
        out += [Instr(InstrKind.ALL_GATHER, stage=i.stage, group=i.group) for i in out if i.kind is _SHARD_REDUCE]
        return out

    def positions(self, compute: list[Instr]) -> tuple[dict, dict]:  # type: ignore[type-arg]
        """Index of the first forward needing each (value, mb), and of the last input-backward producing its grad."""
        first_use: dict[tuple[Op, int], int] = {}
        last_grad: dict[tuple[Op, int], int] = {}
        for index, instr in enumerate(compute):
            assert instr.stage is not None and instr.mb is not None
            for c in self.into[instr.stage]:
                if instr.kind is InstrKind.FORWARD:
                    first_use.setdefault((c.value, instr.mb), index)
                if instr.kind._value_ in _INPUT_GRAD:
                    last_grad[(c.value, instr.mb)] = index
        return first_use, last_grad

    # Between tensor groups, receiver member i takes from sender member i % T_sender (a boundary value is whole on
    # every member), for values and gradients alike; a sender member j so serves every receiver i = j mod T_sender.
    # Each takes the lead of the rank's replica of `stage` (`lead`) and the rank's tensor rank `k`.

    def recvs(self, lead: int, k: int, index: int, stage: Stage, mb: int, first_use: dict) -> list[Instr]:  # type: ignore[type-arg]
        out: list[Instr] = []
        for c in self.into[stage]:
            if first_use[(c.value, mb)] != index:
                continue
            for p in self.pieces(c, mb):
                if p.dst == lead and p.src != lead:
                    src = self.member(c.producer, p.src, k % c.producer.tp)
                    _add(out, Instr(_RECV, None, c.value, False, mb, src, p.rows))
        return out

    def sends(self, lead: int, k: int, stage: Stage, mb: int) -> list[Instr]:
        out: list[Instr] = []
        for c in self.out_of[stage]:
            for p in self.pieces(c, mb):
                if p.src == lead and p.dst != lead:
                    for i in range(k, c.consumer.tp, stage.tp):
                        dst = self.member(c.consumer, p.dst, i)
                        _add(out, Instr(_SEND, None, c.value, False, mb, dst, p.rows))
        return out

    def grad_recvs(self, lead: int, k: int, stage: Stage, mb: int) -> list[Instr]:
        out: list[Instr] = []
        for c in self.grads_out_of[stage]:
            for p in self.pieces(c, mb):
                if p.src == lead and p.dst != lead:
                    src = self.member(c.consumer, p.dst, k % c.consumer.tp)
                    _add(out, Instr(_RECV, None, c.value, True, mb, src, p.rows))
        return out

    def grad_sends(self, lead: int, k: int, index: int, stage: Stage, mb: int, last_grad: dict) -> list[Instr]:  # type: ignore[type-arg]
        out: list[Instr] = []
        for c in self.grads_into[stage]:
            if last_grad[(c.value, mb)] != index:
                continue
            for p in self.pieces(c, mb):
                if p.dst == lead and p.src != lead:
                    for i in range(k, c.producer.tp, stage.tp):
                        dst = self.member(c.producer, p.src, i)
                        _add(out, Instr(_SEND, None, c.value, True, mb, dst, p.rows))
        return out

    def tensor_reduces(self, replica: int, instr: Instr) -> list[Instr]:
        """The tensor_allreduces that run inside compute `instr` of a stage with tp > 1 (listed after it)
        (`reduced_values`), over the tensor group of the rank's `replica`."""
        stage, mb = instr.stage, instr.mb
        assert stage is not None
        if stage.tp == 1:
            return []
        # Every member of the group runs these very instructions: made once, for the first member lowered.
        key = (stage, instr.kind._value_, replica, mb)
        found = self.tensor_reduced.get(key)
        if found is not None:
            return found
        values = self.reduced_values(stage, instr.kind)
        group = self.tensor_groups.get((stage, replica))
        if group is None:
            group = self.tensor_groups[(stage, replica)] = tuple(self.peer(stage, replica, i) for i in range(stage.tp))
        # Positional (kind, stage, value, grad, mb, peer, rows, group): keywords cost twice as much, millions of times.
        found = self.tensor_reduced[key] = [Instr(_TENSOR_REDUCE, None, v, g, mb, None, None, group) for v, g in values]
        return found

    def reduced_values(self, stage: Stage, kind: InstrKind) -> list[tuple[Op, bool]]:
        """(value, grad) of each tensor_allreduce inside a compute of `kind` of `stage` (asked once per both): the
        row-parallel results of a forward (and of a backward's re-run forward, recomputing), then the gradients of
        the column-parallel ops' whole inputs of a backward that computes input gradients."""
        found = self.reduces.get((stage, kind._value_))
        if found is not None:
            return found
        found = self.reduces[(stage, kind._value_)] = []
        # A split backward's input pass runs the column inputs' sums where the stage hands gradients back; one that
        # hands none back (the first stage) runs its whole backward, those sums included, in the weight pass.
        hands_back = any(c.value in self.grads for c in self.into[stage])
        if kind is (InstrKind.BACKWARD_WEIGHT if hands_back else InstrKind.BACKWARD_INPUT):
            return found
        if kind is InstrKind.FORWARD or (stage.recompute and kind is not InstrKind.BACKWARD_WEIGHT):
            found += [(op, False) for op in tensor_shards.forward_reduces(stage.ops)]
        if kind in INPUT_GRAD_KINDS or kind is InstrKind.BACKWARD_WEIGHT:
            found += [(op, True) for op in tensor_shards.backward_reduces(stage.ops)]
        return found

    def stage_allreduces(self, rank: int, program: RankProgram) -> list[Instr]:
        # After the last compute, latest stage first: every replica of a device group hosts the same stages,
        # so all members meet the collectives in the same order and no allreduce waits on a pending recv.
        order = {s.name: i for i, s in enumerate(self.module.stages)}
        out: list[Instr] = []
        for name in sorted(program.attrs.stages or (), key=order.__getitem__, reverse=True):
            stage = self.module.stage(name)
            if stage.replicas > 1:
                kind = _SHARD_REDUCE if stage.sharded else InstrKind.ALLREDUCE
                out.append(Instr(kind, stage=stage, group=self.group(stage, self.tensor_of[rank])))
        return out

    def group(self, stage: Stage, k: int) -> tuple[int, ...]:
        """The ranks of a stage's replicas with tensor rank `k`, ascending (asked once per stage and member)."""
        found = self.groups.get((stage, k))
        if found is None:
            found = self.groups[(stage, k)] = tuple(sorted(self.peer(stage, j, k) for j in range(stage.replicas)))
        return found

    def tied_allreduces(self, rank: int) -> list[Instr]:
        out: list[Instr] = []
        k = self.tensor_of[rank]
        for name in sorted(self.tied, key=[p.name for p in self.module.params].index):
            holders = self.tied[name]
            if len({s.tp for s in holders}) > 1:
                listed = ", ".join(f"@{s.name} (tp = {s.tp})" for s in holders)
                raise ScheduleError(
                    f"lower-comm: parameter @{name} is read by stages {listed}; stages sharing a tied parameter "
                    "need one tensor-parallel degree, so that each member sums its copy's gradient with its peers'"
                )
            group = {self.rank_of[(s.name, j, k)] for s in holders for j in range(s.replicas)}
            if rank in group and len(group) > 1:
                out.append(Instr(InstrKind.ALLREDUCE, param=name, group=tuple(sorted(group))))
        return out


#: The kinds of `COMPUTE_KINDS` and `INPUT_GRAD_KINDS` by their text, for the loops over every instruction (hashing an
#: enum member runs Python code).
_COMPUTE = frozenset(kind.value for kind in COMPUTE_KINDS)
_INPUT_GRAD = frozenset(kind.value for kind in INPUT_GRAD_KINDS)
#: A tensor group's sum inside a compute (`tensor_reduces`).
_TENSOR_REDUCE = InstrKind.TENSOR_ALLREDUCE
_SEND, _RECV = InstrKind.SEND, InstrKind.RECV
#: The kinds a tensor group's member holds with peers of its own (`as_member`), by text; `_KIND` reads it.
_TRANSFERS = frozenset(kind.value for kind in (InstrKind.SEND, InstrKind.RECV))
#: The collectives, whose groups a tensor group's member holds of its own (`as_member`), by text.
_COLLECTIVES = frozenset(kind.value for kind in COLLECTIVE_KINDS)
_KIND = attrgetter("kind._value_")
#: A sharded stage's (`Stage.sharded`) allreduce: each replica keeps its shard of the sum, steps it, and the
#: stepped shards are all-gathered after the optimizer step, in the order their reduce-scatters ran.
_SHARD_REDUCE = InstrKind.REDUCE_SCATTER


#: Every field of an instruction, in `Instr`'s order.
_INSTR_FIELDS = attrgetter("kind", "stage", "value", "grad", "mb", "peer", "rows", "group", "param")


@dataclass(frozen=True, slots=True)
class _MemberMapped:
    """What of a lead's instructions its tensor group's members hold with peers and groups of their own (`as_member`),
    read once for all the members."""

    transfers: tuple[list[int], list[tuple]]  # type: ignore[type-arg]
    """The index of each transfer (send or recv), and its every field."""
    collectives: tuple[list[int], list[tuple]]  # type: ignore[type-arg]
    """The index of each collective, and its every field."""


def _member_mapped(lead: list[Instr]) -> _MemberMapped:
    """What of `lead` its tensor group's members hold of their own (`as_member`), read once for all the members."""
    # Found without a Python call per instruction (a thousand ranks' programs are millions of them, mostly the group's
    # sums).
    kinds = list(map(_KIND, lead))
    return _MemberMapped(_read(lead, kinds, _TRANSFERS), _read(lead, kinds, _COLLECTIVES))


def _read(instrs: list[Instr], kinds: list[str], read: frozenset[str]) -> tuple[list[int], list[tuple]]:  # type: ignore[type-arg]
    """The index and every field of each instruction whose kind's text (`kinds`) is in `read`."""
    indices = list(compress(count(), map(read.__contains__, kinds)))
    return indices, list(map(_INSTR_FIELDS, map(instrs.__getitem__, indices)))


def _add(out: list[Instr], instr: Instr) -> None:
    """Append a transfer unless `out` already has it (a value two stages of the rank read, or send back)."""
    for i in out:  # mostly none or one: a loop costs less than `any` of a generator
        if i.value is instr.value and i.peer == instr.peer and i.rows == instr.rows:
            return
    out.append(instr)


#: What may sit between a compute and the receives posted after it: the compute's own sends and frees go first.
_POST_SKIPS = frozenset({InstrKind.SEND, InstrKind.FREE})


def early_post_points(instrs: list[Instr]) -> dict[int, int]:
    """Where each receive may be posted, if earlier than where it sits: recv index -> instruction index.

    A receive is needed at its `recv` (where the rank waits for the data); its buffer can be posted one
    compute earlier, right after the sends and frees that follow the compute before the one preceding
    the `recv`, so the transfer lands while that compute runs (torch's 1F1B posts its receives together
    with the sends of the step before, the same distance ahead). Posts keep the order of their receives,
    so two ranks still pair their messages in program order. Whether the memory allows the early buffer
    is `peak_memory.recv_posts`'s decision.
    """
    points: dict[int, int] = {}
    computes: list[int] = []
    for index, instr in enumerate(instrs):
        if instr.kind in COMPUTE_KINDS:
            computes.append(index)
            continue
        if instr.kind is not InstrKind.RECV:
            continue
        post = computes[-2] + 1 if len(computes) >= 2 else 0
        while post < index and instrs[post].kind in _POST_SKIPS:
            post += 1
        if post < index:
            points[index] = post
    return points
