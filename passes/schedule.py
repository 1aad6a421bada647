"""`schedule`: one compute-only program per rank, ordered by a registered schedule or a CSV file.

Ranks are the devices the stages use, numbered by ascending device id. With `virtual=V` (interleaved),
stage k sits on the devices of stage k % P, P = stages / V; stages left without devices get them from
that rule, and a module whose stages name no devices at all gets devices 0, 1, ... in pipeline order.
Left at 0, an interleaved schedule reads V off the stages (the plan of an interleaved candidate puts
stage P on stage 0's devices), so `plan,schedule` lowers what the planner chose. Where `plan` handed on the
lowering it simulated (`ir.scale.TrialLowering`) and this pass's inputs are that trial's, the programs are made of
the trial's compute instructions (the same as this pass makes, and checked there).
"""

from __future__ import annotations

from dataclasses import dataclass

from dapple_ir import schedules
from dapple_ir.analysis.lowering import lowered_programs
from dapple_ir.analysis.peak_memory import stage_memory
from dapple_ir.analysis.plan_checks import check_compute_order, find_deadlock
from dapple_ir.errors import ScheduleError
from dapple_ir.ir import Instr, Module, ProgramAttrs, RankProgram, Stage, scale
from dapple_ir.ir.scale import collector_paused
from dapple_ir.registry import Pass, PassContext, option, register_pass


@register_pass
@dataclass(frozen=True)
class Schedule(Pass):
    """Order each rank's forward and backward work (gpipe, 1f1b, interleaved, zb-h1, or a CSV order)."""

    name = "schedule"

    kind: str = option("", f"schedule name: {', '.join(schedules.SCHEDULES)}; empty: the plan's choice, else 1f1b")
    microbatches: int = option(0, "microbatches per step; 0 keeps the module's")
    virtual: int = option(0, "virtual stages per device group (interleaved); 0: read off the stages' devices")
    from_: str = option("", "CSV file with the per-rank order (rank,kind,stage,mb)")

    def apply(self, ctx: PassContext, module: Module) -> None:
        if not module.stages:
            raise ScheduleError("schedule: the module has no stages; run a planner (or write stages) first")
        m = self.microbatches or module.attrs.microbatches
        if not m or m < 1:
            raise ScheduleError("schedule: no microbatch count; give schedule{microbatches=M} or set the module's")
        widest = max(module.stages, key=lambda s: 0 if s.split else s.replicas)
        if m < widest.replicas and not widest.split:
            raise ScheduleError(
                f"schedule: stage @{widest.name} has {widest.replicas} replicas but there are only {m} microbatches; "
                "each replica needs at least one (replica j runs microbatches m with m % replicas == j); "
                "or split each microbatch over the replicas (split = true on the stage)"
            )
        # Left unset, the kind is what `plan` chose for this module, so one pipeline string plans and lowers.
        kind = self.kind or (module.attrs.schedule if module.attrs.schedule in schedules.SCHEDULES else "1f1b")
        virtual = self.virtual or (_virtual_of(module.stages) if kind == "interleaved" else 1)
        _check_virtual(module.stages, virtual, m if kind == "interleaved" and not self.from_ else None)
        _set_batch_attrs(module, m)
        _check_split(module)
        groups = len(module.stages) // virtual
        _place(module.stages, groups)
        device_slots = _device_slots(module.stages, groups)
        # Every replica of a split stage runs every microbatch (on its rows): the schedule sees one.
        replicas = tuple(1 if s.split else s.replicas for s in module.stages)
        # Weighed in the bytes the static peak counts, so zb-h1 defers weight passes only as far as 1f1b's peak.
        request = schedules.ScheduleRequest(replicas, m, virtual, stage_memory(module))
        # All the programs are made from, besides the stages themselves (a CSV file is read afresh each time).
        inputs = (kind, request, device_slots, tuple((s.name, s.split) for s in module.stages))
        handed = scale.handed(module)
        taken = handed.scheduled(module, inputs) if handed is not None and not self.from_ else None
        with collector_paused():  # a thousand ranks' programs are millions of instructions
            if taken is not None:  # the trial's, made from these very inputs and checked there
                module.attrs.schedule = kind
                module.programs = [
                    _program(rank, where, groups, module.stages, instrs)
                    for rank, (where, instrs) in enumerate(zip(device_slots, taken, strict=True))
                ]
                return
            self._make_programs(module, kind, request, device_slots, groups)
        if not self.from_ and scale.is_trial(module):
            scale.note(module, "schedule", (inputs, [list(p.instrs) for p in module.programs]))

    def _make_programs(
        self,
        module: Module,
        kind: str,
        request: schedules.ScheduleRequest,
        device_slots: list[tuple[int, schedules.Slot, int]],
        groups: int,
    ) -> None:
        """Order each rank's work by `kind` (or the CSV file), write the programs and check the order."""
        if self.from_:
            orders = schedules.load_order_csv(self.from_, [s.name for s in module.stages])
            module.attrs.schedule = f"from:{self.from_}"
        else:
            by_slot = schedules.build_schedule(kind, request)
            orders = {
                rank: by_slot.get((slot[0], 0) if module.stages[slot[0]].split else slot, [])
                for rank, (_device, slot, _k) in enumerate(device_slots)
            }
            module.attrs.schedule = kind
        if set(orders) - set(range(len(device_slots))):
            extra = sorted(set(orders) - set(range(len(device_slots))))
            raise ScheduleError(f"schedule: the order names ranks {extra}, but the stages use {len(device_slots)}")
        # The members of a tensor group (and the replicas of a split stage) follow one order: they share its
        # instructions, made once (a thousand ranks' programs are millions of them).
        made: dict[int, list[Instr]] = {}
        module.programs = [
            _program(rank, (device, slot, k), groups, module.stages, _instrs(module.stages, orders.get(rank), made))
            for rank, (device, slot, k) in enumerate(device_slots)
        ]
        check_compute_order(module)
        # The built-in schedules are deadlock-free by construction (and `verify` checks their lowering);
        # a hand-written or user-registered order is checked here, where the error can say whose it is.
        if self.from_ or not schedules.is_builtin(kind):
            _refuse_deadlock(module, self.spec())


def _virtual_of(stages: list[Stage]) -> int:
    """Virtual stages per device group as a plan wrote them: stage k on the devices of stage k % P,
    where P is the first stage that repeats stage 0's devices (1 when none does, or none are set)."""
    first = stages[0].attrs.devices
    repeat = next((k for k, s in enumerate(stages[1:], start=1) if first and s.attrs.devices == first), None)
    if repeat is None or len(stages) % repeat:
        return 1
    return len(stages) // repeat


def _check_virtual(stages: list[Stage], virtual: int, m: int | None) -> None:
    n = len(stages)
    if virtual < 1 or n % virtual:
        raise ScheduleError(
            f"interleaved schedule: virtual={virtual} does not divide the {n} stages into device groups; "
            f"the module needs a multiple of {virtual} stages (stage k runs on device group k % (stages / virtual))"
        )
    groups = n // virtual
    if m is not None and m < groups:
        raise ScheduleError(
            f"interleaved schedule: {m} microbatches are fewer than the {groups} pipeline groups; "
            f"interleaving needs at least one microbatch per group in flight (microbatches >= {groups})"
        )
    for k, stage in enumerate(stages[groups:], start=groups):
        lead = stages[k % groups]
        if stage.replicas != lead.replicas:
            raise ScheduleError(
                f"interleaved schedule: stage @{stage.name} has {stage.replicas} replicas but shares device "
                f"group {k % groups} with @{lead.name}, which has {lead.replicas}"
            )


def _set_batch_attrs(module: Module, m: int) -> None:
    """Keep global_batch = microbatches * microbatch_size: the global batch wins when known."""
    attrs = module.attrs
    if attrs.global_batch:
        if attrs.global_batch % m:
            raise ScheduleError(f"schedule: global batch {attrs.global_batch} does not split into {m} microbatches")
        attrs.microbatch_size = attrs.global_batch // m
    elif attrs.microbatch_size:
        attrs.global_batch = attrs.microbatch_size * m
    attrs.microbatches = m


def _check_split(module: Module) -> None:
    """A split stage needs a row per replica; stages sharing devices (virtual stages) must slice alike."""
    b = module.attrs.microbatch_size
    for stage in module.stages:
        if stage.split and b is not None and b < stage.replicas:
            raise ScheduleError(
                f"schedule: stage @{stage.name} splits each microbatch over {stage.replicas} replicas, but a "
                f"microbatch has {b} samples; use at most {b} replicas, fewer microbatches (bigger ones), "
                "or round robin (no split = true)"
            )
    groups: dict[tuple[int, ...], Stage] = {}
    for stage in module.stages:
        devices = stage.attrs.devices
        lead = groups.setdefault(devices, stage) if devices is not None else stage
        if lead.split != stage.split:
            raise ScheduleError(
                f"schedule: @{stage.name} and @{lead.name} share devices {list(devices or ())} but only one "
                "splits its microbatches (split = true); stages on the same devices must replicate alike"
            )


def _place(stages: list[Stage], groups: int) -> None:
    """Fill in devices: all unplaced means devices 0.. in pipeline order; stage k >= P copies stage k % P."""
    if all(s.attrs.devices is None for s in stages):
        next_device = 0
        for stage in stages[:groups]:
            width = stage.replicas * stage.tp
            stage.attrs.devices = tuple(range(next_device, next_device + width))
            next_device += width
    for k, stage in enumerate(stages):
        lead = stages[k % groups]
        if lead.attrs.devices is None:
            raise ScheduleError(f"schedule: stage @{lead.name} has no devices while other stages do; place all")
        if stage.attrs.devices is None:
            stage.attrs.devices = lead.attrs.devices
        if k >= groups and stage.attrs.devices != lead.attrs.devices:
            raise ScheduleError(
                f"schedule: virtual stage @{stage.name} must sit on the devices of @{lead.name} "
                f"{list(lead.attrs.devices)}, not {list(stage.attrs.devices)}"
            )


def _device_slots(stages: list[Stage], groups: int) -> list[tuple[int, schedules.Slot, int]]:
    """(device, slot, tensor rank) for each rank, ranks in ascending device order: a replica of a stage with
    tp = T has T ranks, members 0..T-1 of its tensor group, which all follow the replica's order."""
    owner: dict[int, tuple[schedules.Slot, int]] = {}
    for g, stage in enumerate(stages[:groups]):
        for index, device in enumerate(stage.attrs.devices or ()):
            if device in owner:
                other = stages[owner[device][0][0]].name
                raise ScheduleError(
                    f"schedule: device {device} holds both @{other} and @{stage.name}; only virtual stages of "
                    "an interleaved schedule (virtual=V) share devices"
                )
            owner[device] = ((g, index // stage.tp), index % stage.tp)
    return [(device, slot, k) for device, (slot, k) in sorted(owner.items())]


def _instrs(stages: list[Stage], order: list[schedules.Work] | None, made: dict[int, list[Instr]]) -> list[Instr]:
    """The instructions of `order` (a list of their own, the instructions shared with the ranks that follow the same
    order object: `made` by its id, each order alive while the programs are made)."""
    if order is None:
        return []
    found = made.get(id(order))
    if found is None:
        # Positional (kind, stage, value, grad, mb): keywords cost twice as much, for a thousand ranks' orders.
        found = made[id(order)] = [Instr(w.kind, stages[w.stage], None, False, w.mb) for w in order]
    return list(found)


def _program(
    rank: int, where: tuple[int, schedules.Slot, int], groups: int, stages: list[Stage], instrs: list[Instr]
) -> RankProgram:
    device, (g, replica), k = where
    hosted = tuple(s.name for s in stages[g::groups])
    attrs = ProgramAttrs(rank=rank, device=device, replica=replica, tensor_rank=k or None, stages=hosted)
    return RankProgram(f"rank{rank}", instrs, attrs)


def _refuse_deadlock(module: Module, spec: str) -> None:
    # Sends go right after the compute that produced them and recvs right before the compute that
    # needs them, so the compute order deadlocks exactly when its lowering does: check the lowering.
    cycle = find_deadlock(lowered_programs(module), module)
    if cycle is not None:
        raise ScheduleError(f"{spec}: the order deadlocks: {cycle}")
