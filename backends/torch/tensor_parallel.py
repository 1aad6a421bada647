"""Tensor parallelism at run time (Megatron-LM's intra-layer parallelism, `StageAttrs.tp`): shards and collectives.

A stage with `tp` = T > 1 runs each replica on a tensor group of T ranks. Every member builds the model
exactly as the single-device reference does (the same seeded factory), then keeps of each parameter the
`tensor-parallel` pass marked (`ParamAttrs.tp_dim`, `tp_parts`) its own slice (`shard_of`): for each of the
`parts` equal parts of dimension `tp_dim`, the member-th contiguous 1/T of it. Parameters without the mark
stay whole on every member.
The stage's fx graph is then rewritten to compute with the slices (`tensor_graph.shard_graph`), with two
collectives over the group as autograd functions, where Megatron-LM puts them:

- f, before the column-parallel ops on their whole input (once per distinct input): the identity in the
  forward; in the backward the sum over the group of the members' partial gradients of that input.
- g, after a row-parallel op's matmul and before its bias: the sum over the group of the partial results in
  the forward; the identity in the backward.

Both are sums through the rank's transport (`Transport.allreduce`), over a process group of the tensor group's
own on torch.distributed (`DistTransport` makes one per group every rank names, in the same order on every rank)
with the run's timeout, or the threads transport's in-order sum. Every member gets the very same bits of a sum,
so the values a tensor group holds whole stay equal on all its members, and so do the gradients of its whole
(replicated) parameters: no collective over the tensor group is needed for those. 16-bit partial results are
summed in fp32 and rounded once.

Each sum is logged (`TensorGroup.ran`) with its microbatch, start and end, for the rank program's
`tensor_allreduce` instruction, which follows the compute that runs the collective: it checks that the sum ran
and draws it (`Runtime.tensor_allreduce`).
`gather_shards` puts the members' slices back together (for `--check` and a run's final parameters).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from dapple_ir.backends.torch.transport import Transport
from dapple_ir.errors import DappleError
from dapple_ir.ir import Module, Param


@dataclass
class TensorGroup:
    """One rank's membership in the tensor group of one stage replica, and the collectives it ran."""

    stage: str
    ranks: tuple[int, ...]
    """The group's ranks in member order (member k is `ranks[k]`)."""
    member: int
    """This rank's index in `ranks` (`ProgramAttrs.tensor_rank`)."""
    transport: Transport
    timeout: float
    mb: int | None = None
    """The microbatch of the compute running (the runtime sets it as each compute instruction starts)."""
    ran: dict[tuple[str, bool, int | None], tuple[float, float]] = field(default_factory=dict)
    """The step's sums so far (the runtime clears it as a step starts): (value, grad, mb) -> (start, end)."""
    without_grad: set[str] = field(default_factory=set)
    """Whole inputs of column-parallel ops that did not need a gradient: their backward sum never runs."""

    @property
    def size(self) -> int:
        return len(self.ranks)

    def sum(self, tensor: torch.Tensor, value: str, grad: bool) -> torch.Tensor:
        """A new tensor holding `tensor` summed over the group (fp32 for 16-bit tensors, rounded back once)."""
        start = time.time()
        total = tensor.to(torch.float32) if tensor.dtype in (torch.float16, torch.bfloat16) else tensor
        total = total.clone(memory_format=torch.contiguous_format)
        self.transport.allreduce(total, self.ranks, self.timeout)
        self.ran[(value, grad, self.mb)] = (start, time.time())
        return total.to(tensor.dtype)


class _SumForward(torch.autograd.Function):
    """Megatron's g: the forward sums the partial results over the group; the backward passes the gradient on."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: TensorGroup, value: str) -> torch.Tensor:
        return group.sum(partial, value, grad=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class _SumBackward(torch.autograd.Function):
    """Megatron's f: the forward passes the whole input on; the backward sums its partial gradients over the group."""

    @staticmethod
    def forward(ctx: Any, whole: torch.Tensor, group: TensorGroup, value: str) -> torch.Tensor:
        ctx.group, ctx.value = group, value
        return whole.view_as(whole)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.group.sum(grad, ctx.value, grad=True), None, None


class GroupSum(torch.nn.Module):
    """g as a submodule of a stage's graph: the row-parallel op `value`'s partial result summed over the group."""

    def __init__(self, group: TensorGroup, value: str) -> None:
        super().__init__()
        self.group, self.value = group, value

    def forward(self, partial: torch.Tensor) -> torch.Tensor:
        return _SumForward.apply(partial, self.group, self.value)  # type: ignore[no-any-return]


class GroupGradSum(torch.nn.Module):
    """f as a submodule of a stage's graph: the whole input `value` of column-parallel ops, its gradient summed."""

    def __init__(self, group: TensorGroup, value: str) -> None:
        super().__init__()
        self.group, self.value = group, value

    def forward(self, whole: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and not whole.requires_grad:
            self.group.without_grad.add(self.value)
        return _SumBackward.apply(whole, self.group, self.value)  # type: ignore[no-any-return]


class VocabLookup(torch.nn.Module):
    """Megatron's `VocabParallelEmbedding` as a submodule of a stage's graph: this member's rows of the weight (the
    `member`-th contiguous 1/T of the vocabulary) looked up for the indices in its range, zeros for the others, and
    the rows summed over the group (g): every index finds its row on exactly one member, so the sum is exact. A
    `padding_idx` (whose row takes no gradient) is the member's own where it falls in its range."""

    def __init__(self, group: TensorGroup, value: str, padding_idx: int | None = None) -> None:
        super().__init__()
        self.group, self.value, self.padding_idx = group, value, padding_idx

    def forward(self, indices: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        first = self.group.member * weight.shape[0]
        local = indices - first
        outside = (local < 0) | (local >= weight.shape[0])
        pad = None if self.padding_idx is None else self.padding_idx - first
        pad = pad if pad is not None and 0 <= pad < weight.shape[0] else None
        rows = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight, padding_idx=pad)
        return _SumForward.apply(rows.masked_fill(outside.unsqueeze(-1), 0), self.group, self.value)  # type: ignore[no-any-return]


class _VocabCrossEntropy(torch.autograd.Function):
    """Cross-entropy of logits whose classes are split over the group (Megatron's `vocab_parallel_cross_entropy`).

    Forward, in fp32: each member's log-sum-exp of its classes goes into its row of a [T + 1, N] table and the
    target's logit (where the target is one of its classes) into the last row; one sum over the group gives every
    member the whole table (sums with zeros: exact), from which each takes the log-sum-exp over the T rows, in the
    same order on every member. Backward: the member's slice of softmax minus the target's one-hot, no sum."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: TensorGroup, value: str, options: tuple[str, int]
    ) -> torch.Tensor:
        reduction, ignore_index = options
        x = logits.float()
        local = target - group.member * x.shape[1]
        mine = (local >= 0) & (local < x.shape[1])
        picked = x.gather(1, local.clamp(0, x.shape[1] - 1).unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0)
        table = torch.zeros(group.size + 1, x.shape[0], dtype=torch.float32, device=x.device)
        table[group.member] = torch.logsumexp(x, dim=1)
        table[group.size] = picked
        table = group.sum(table, value, grad=False)
        lse = torch.logsumexp(table[: group.size], dim=0)
        valid = target != ignore_index
        losses = (lse - table[group.size]).masked_fill(~valid, 0.0)
        count = valid.sum()
        ctx.save_for_backward(x, lse, local, mine & valid, valid, count)
        ctx.reduction, ctx.dtype = reduction, logits.dtype
        if reduction == "none":
            return losses
        return losses.sum() / count if reduction == "mean" else losses.sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        x, lse, local, hit, valid, count = ctx.saved_tensors
        probs = torch.exp(x - lse.unsqueeze(1))
        rows = torch.nonzero(hit).squeeze(1)
        probs[rows, local[rows]] -= 1.0
        # Rows whose target is ignored take no gradient, as in torch's cross-entropy.
        if ctx.reduction == "none":
            per_row = grad.float()
        else:
            per_row = (grad.float() / count if ctx.reduction == "mean" else grad.float()).expand(x.shape[0])
        scaled = probs * per_row.masked_fill(~valid, 0.0).unsqueeze(1)
        return scaled.to(ctx.dtype), None, None, None, None


class VocabCrossEntropy(torch.nn.Module):
    """`_VocabCrossEntropy` as a submodule of a stage's graph, with the loss's reduction and ignored index."""

    def __init__(self, group: TensorGroup, value: str, reduction: str, ignore_index: int) -> None:
        super().__init__()
        self.group, self.value, self.options = group, value, (reduction, ignore_index)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return _VocabCrossEntropy.apply(logits, target, self.group, self.value, self.options)  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------ parameter slices


def shard_of(tensor: torch.Tensor, dim: int, parts: int, member: int, size: int, what: str) -> torch.Tensor:
    """Member `member` of `size`'s slice of `tensor`: of each of `parts` equal parts of `dim`, its contiguous 1/size."""
    if not -tensor.dim() <= dim < tensor.dim():
        raise DappleError(f"{what} has {tensor.dim()} dimension(s): it cannot be split on dimension {dim}")
    extent = tensor.shape[dim]
    if parts < 1 or extent % (parts * size):
        raise DappleError(
            f"{what}: dimension {dim} ({extent}) does not divide into {parts} part(s) of {size} equal slices "
            "(tensor-parallel degree); choose a degree that divides it"
        )
    pieces = [part.chunk(size, dim)[member] for part in tensor.chunk(parts, dim)]
    return torch.cat(pieces, dim).clone()


def whole_of(slices: list[torch.Tensor], dim: int, parts: int) -> torch.Tensor:
    """The tensor whose member slices (`shard_of`, in member order) are `slices`."""
    per_member = [s.chunk(parts, dim) for s in slices]
    return torch.cat([piece[p] for p in range(parts) for piece in per_member], dim)


def split_param(param: Param) -> tuple[int, int] | None:
    """(dimension, parts) a tensor group splits `param` on, None where it stays whole."""
    if param.attrs.tp_dim is None:
        return None
    return param.attrs.tp_dim, param.attrs.tp_parts or 1


def slice_params(
    graph_module: torch.nn.Module, params: dict[str, torch.nn.Parameter], module: Module, group: TensorGroup
) -> dict[str, torch.nn.Parameter]:
    """Replace, wherever `graph_module` holds them, the parameters the IR splits by this member's slices.

    Returns the stage's parameters by name again (the split ones now the slices)."""
    replaced: dict[int, torch.nn.Parameter] = {}
    result: dict[str, torch.nn.Parameter] = {}
    splits = {p.name: split for p in module.params if (split := split_param(p)) is not None}
    for name, p in params.items():
        split = splits.get(name)
        if split is None:
            result[name] = p
            continue
        dim, parts = split
        sliced = shard_of(p.detach(), dim, parts, group.member, group.size, f"parameter {name} of @{group.stage}")
        replaced[id(p)] = result[name] = torch.nn.Parameter(sliced, requires_grad=p.requires_grad)
    for sub in graph_module.modules():
        for attr, held in list(sub._parameters.items()):
            if held is not None and id(held) in replaced:
                sub._parameters[attr] = replaced[id(held)]
    _refuse_split_buffers(module, graph_module, group.stage)
    return result


def _refuse_split_buffers(module: Module, graph_module: torch.nn.Module, stage: str) -> None:
    held = {name for name, _ in graph_module.named_buffers()}
    split = [p.name for p in module.params if p.attrs.buffer and p.attrs.tp_dim is not None and p.name in held]
    if split:
        raise DappleError(
            f"stage @{stage} splits buffer(s) {', '.join('@' + n for n in split)} over its tensor group: the runtime "
            "splits trainable parameters only (a buffer's running statistics stay whole on every member)"
        )


# ------------------------------------------------------------------------------ groups and gathering


def tensor_groups(module: Module, hosted: Callable[[int], Iterable[str]]) -> dict[tuple[str, int], tuple[int, ...]]:
    """The ranks of every tensor group, member order, by (stage, replica), for the stages with `tp` > 1.

    `hosted(rank)` names the stages rank `rank` runs; a rank's replica and member index are its program's."""
    found: dict[tuple[str, int], dict[int, int]] = {}
    wide = {s.name: s.tp for s in module.stages if s.tp > 1}
    for rank, program in enumerate(module.programs):
        for stage in hosted(rank):
            if stage in wide:
                members = found.setdefault((stage, program.attrs.replica or 0), {})
                member = program.attrs.tensor_rank or 0
                if member in members:
                    raise DappleError(
                        f"ranks {members[member]} and {rank} are both member {member} of @{stage}'s tensor group "
                        f"of replica {program.attrs.replica or 0}"
                    )
                members[member] = rank
    groups = {}
    for (stage, replica), members in sorted(found.items()):
        if sorted(members) != list(range(wide[stage])):
            raise DappleError(
                f"@{stage} has tp = {wide[stage]} but its replica {replica} runs on tensor rank(s) "
                f"{sorted(members)}: every member 0..{wide[stage] - 1} needs a program"
            )
        groups[(stage, replica)] = tuple(members[k] for k in range(wide[stage]))
    return groups


def gather_shards(
    module: Module, per_rank: dict[int, dict[str, torch.Tensor]], groups: dict[tuple[str, int], tuple[int, ...]]
) -> dict[int, dict[str, torch.Tensor]]:
    """`stage/name` tensors by rank, each split parameter whole again on its group's member 0 (and only there).

    A group not all of whose members reported (a multi-node run's other node) is left as it is."""
    result = {rank: dict(tensors) for rank, tensors in per_rank.items()}
    splits = {p.name: split for p in module.params if (split := split_param(p)) is not None}
    for (stage, _), ranks in groups.items():
        if not all(r in result for r in ranks):
            continue
        for key in [k for k in result[ranks[0]] if k.startswith(f"{stage}/") and k.split("/", 1)[1] in splits]:
            dim, parts = splits[key.split("/", 1)[1]]
            slices = [result[r].pop(key) for r in ranks]
            result[ranks[0]][key] = whole_of(slices, dim, parts)
    return result
