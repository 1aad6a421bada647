"""A plan handed to torch.distributed.pipelining: each stage's module FQNs (torchtitan's
`module_fqns_per_model_part`), the schedule as torch's action CSV (what `_PipelineScheduleRuntime._load_csv`
reads, compute and comms: `0F0`, `0SEND_F0`, `1RECV_F0`, `1B0`, `1SEND_B0`, `0RECV_B0`, `0REDUCE_GRAD`, and `I`/`W`
for a split backward), and the data-parallel degree.

torch runs every stage of a pipeline on the same data-parallel degree, whole microbatches per replica, one
stage per rank or several (its virtual stages), values passed only to the next stage; a plan outside that
is refused naming the dimension. The translation reads the lowered rank programs of replica 0 (every
replica runs the same order on its own microbatches, renumbered from 0), so the CSV is the order our own
runtime runs. It needs no torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from dapple_ir.analysis.module_cuts import stage_modules
from dapple_ir.errors import DappleError
from dapple_ir.ir import Instr, InstrKind, Module, RankProgram

#: Our compute instructions as torch's action letters.
_COMPUTE = {
    InstrKind.FORWARD: "F",
    InstrKind.BACKWARD: "B",
    InstrKind.BACKWARD_INPUT: "I",
    InstrKind.BACKWARD_WEIGHT: "W",
}

#: A compute action: stage, letter, microbatch (`1B3`).
_COMPUTE_ACTION = re.compile(r"\d+[FBIW]\d+")

SCHEDULE_CSV = "schedule.csv"
COMPUTE_CSV = "schedule_compute_only.csv"
MANIFEST = "torch_pipelining.json"


@dataclass(frozen=True)
class TorchPipelining:
    """What torch.distributed.pipelining needs to run the plan."""

    module_fqns_per_model_part: list[list[str]]
    """Per torch stage index (our stage order), the model's modules it holds (the loss runs on the last)."""
    actions: list[list[str]]
    """Per pipeline rank, its actions in order, compute and comms (`_PipelineScheduleRuntime`'s CSV rows)."""
    pp_degree: int
    dp_degree: int
    n_microbatches: int
    """Microbatches per data-parallel replica per step (torch's `n_microbatches`)."""
    microbatch_size: int
    stage_to_rank: list[int]
    """Pipeline rank of each torch stage index."""

    def compute_only(self) -> list[list[str]]:
        """The actions without comms (`PipelineScheduleMulti._load_csv`'s format)."""
        return [[a for a in row if _COMPUTE_ACTION.fullmatch(a)] for row in self.actions]


def translate(module: Module) -> TorchPipelining:
    """The torch.distributed.pipelining form of a lowered plan; a DappleError naming the dimension torch
    cannot express (uneven replication, split rows, recomputation, a value skipping a stage)."""
    _check_expressible(module)
    replicas = module.stages[0].attrs.replicas or 1
    index = {stage.name: k for k, stage in enumerate(module.stages)}
    pipeline = sorted(
        (p for p in module.programs if (p.attrs.replica or 0) == 0), key=lambda p: index[(p.attrs.stages or ("",))[0]]
    )
    stage_to_rank = [0] * len(module.stages)
    for rank, program in enumerate(pipeline):
        for name in program.attrs.stages or ():
            stage_to_rank[index[name]] = rank
    mbs = sorted({i.mb for i in pipeline[0].instrs if i.kind in _COMPUTE and i.mb is not None})
    local = {mb: k for k, mb in enumerate(mbs)}
    producer = {op: index[stage.name] for stage in module.stages for op in stage.ops}
    actions = [_actions(module, program, producer, local) for program in pipeline]
    for program in module.programs:
        if (program.attrs.replica or 0) != 0:
            _check_same_order(module, program, pipeline, producer, actions)
    layer_of = {op: k for k, layer in enumerate(module.layers) for op in layer.ops}
    fqns = []
    for stage in module.stages:
        layers = sorted({layer_of[op] for op in stage.ops if op in layer_of})
        fqns.append(stage_modules(module, layers[0], layers[-1] + 1) if layers else [])
    return TorchPipelining(
        fqns,
        actions,
        len(pipeline),
        replicas,
        len(mbs),
        int(module.attrs.microbatch_size or 0),
        stage_to_rank,
    )


def _check_expressible(module: Module) -> None:
    if not module.stages or not module.programs:
        raise DappleError("export: the module has no stages or rank programs; export a lowered plan (dapple compile)")
    counts = {stage.name: stage.attrs.replicas or 1 for stage in module.stages}
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{name} x{count}" for name, count in counts.items())
        raise DappleError(
            f"export --to torch-pipelining: uneven replication ({listed}): torch.distributed.pipelining runs every "
            "stage on the same data-parallel degree; compile with --replication round-robin and stages that divide "
            "the devices evenly, or run the plan with `dapple run`"
        )
    for stage in module.stages:
        if stage.attrs.split and (stage.attrs.replicas or 1) > 1:
            raise DappleError(
                f"export --to torch-pipelining: stage {stage.name} splits the rows of each microbatch over its "
                f"{stage.attrs.replicas} replicas (split rows), which torch's data parallelism does not: it gives each "
                "replica whole microbatches; compile with --replication round-robin"
            )
        if stage.attrs.recompute:
            raise DappleError(
                f"export --to torch-pipelining: stage {stage.name} recomputes its forward, which torch's schedule "
                "has no action for; compile with --recompute none (and wrap modules in activation checkpointing "
                "yourself)"
            )


def _actions(module: Module, program: RankProgram, producer: dict, local: dict[int, int]) -> list[str]:
    # Several values crossing one cut are one torch action per microbatch.
    found = (_action(module, instr, producer, local) for instr in program.instrs)
    actions = list(dict.fromkeys(a for a in found if a is not None))
    # torch scales (and, under data parallelism, reduces) a stage's gradients at its REDUCE_GRAD, which
    # its own lowering puts after the stage's last backward: where our allreduce waits for it too.
    for stage in program.attrs.stages or ():
        k = next(i for i, st in enumerate(module.stages) if st.name == stage)
        last = max(i for i, a in enumerate(actions) if re.fullmatch(rf"{k}[BW]\d+", a))
        actions.insert(last + 1, f"{k}REDUCE_GRAD")
    return actions


def _action(module: Module, instr: Instr, producer: dict, local: dict[int, int]) -> str | None:
    if instr.mb is None or instr.mb not in local:
        return None
    mb = local[instr.mb]
    if instr.kind in _COMPUTE and instr.stage is not None:
        return f"{module.stages.index(instr.stage)}{_COMPUTE[instr.kind]}{mb}"
    if instr.kind not in (InstrKind.SEND, InstrKind.RECV) or instr.value is None:
        return None
    p = producer[instr.value]
    _check_next_stage_only(module, instr, p)
    send = instr.kind is InstrKind.SEND
    if not instr.grad:
        return f"{p}SEND_F{mb}" if send else f"{p + 1}RECV_F{mb}"
    return f"{p + 1}SEND_B{mb}" if send else f"{p}RECV_B{mb}"


def _check_next_stage_only(module: Module, instr: Instr, p: int) -> None:
    readers = {k for k, stage in enumerate(module.stages) if any(instr.value in op.operands for op in stage.ops)}
    if readers - {p, p + 1}:
        far = max(readers)
        raise DappleError(
            f"export --to torch-pipelining: value %{instr.value.name if instr.value else '?'} of stage "
            f"{module.stages[p].name} is read by stage {module.stages[far].name} too (a skip connection over a "
            "stage); torch's stages pass their outputs to the next stage only; pin cuts that keep it inside one "
            "stage (--split-at) or run the plan with `dapple run`"
        )


def _check_same_order(
    module: Module, program: RankProgram, pipeline: list[RankProgram], producer: dict, actions: list[list[str]]
) -> None:
    mbs = sorted({i.mb for i in program.instrs if i.kind in _COMPUTE and i.mb is not None})
    mine = _actions(module, program, producer, {mb: k for k, mb in enumerate(mbs)})
    first = (program.attrs.stages or ("",))[0]
    rank = next(k for k, p in enumerate(pipeline) if first in (p.attrs.stages or ()))
    if mine != actions[rank]:
        raise DappleError(
            f"export --to torch-pipelining: replica {program.attrs.replica} of {first} ({program.name}) runs its "
            f"microbatches in another order than replica 0; torch runs one schedule on every data-parallel replica"
        )


def write(plan: TorchPipelining, out: Path) -> list[Path]:
    """`schedule.csv` (compute and comms), `schedule_compute_only.csv` and `torch_pipelining.json` in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, rows in ((SCHEDULE_CSV, plan.actions), (COMPUTE_CSV, plan.compute_only())):
        path = out / name
        path.write_text("".join(",".join(row) + "\n" for row in rows))
        written.append(path)
    manifest = {**asdict(plan), "schedule_csv": SCHEDULE_CSV, "csv_format": "compute_comms"}
    del manifest["actions"]
    path = out / MANIFEST
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return [*written, path]
