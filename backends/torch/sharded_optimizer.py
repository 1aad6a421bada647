"""Sharded optimizer state (ZeRO-1, Megatron's distributed optimizer) for a stage whose `zero = 1`.

The stage's parameters (tied ones left out: they are allreduced and stepped whole) move into one flat
buffer, padded to n equal chunks for the n replicas, and become views of it; their gradients likewise
become views of one flat gradient buffer, so autograd accumulates straight into it. Replica k's shard is
chunk k: a parameter (`Shard.master`) that is a view of the flat parameters, whose gradient is chunk k of
the flat gradients. The optimizer steps only the shard, so its state is 1/n of the stage's; stepping the
view writes the parameters in place, and the all-gather brings the other replicas' chunks.

The optimizer's update is elementwise (SGD, momentum, Adam, AdamW), so stepping a flat chunk gives the very
bits stepping each parameter gives on the same gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dapple_ir.errors import DappleError


@dataclass
class Shard:
    """One sharded stage on one rank: the flat buffers and this replica's chunk of them."""

    stage: str
    group: tuple[int, ...]
    """The ranks of the stage's replicas, ascending; chunk k belongs to group[k]."""
    flat: torch.Tensor
    """The stage's (untied) parameters, flattened and zero-padded to n equal chunks."""
    flat_grad: torch.Tensor
    """Their gradients, laid out alike."""
    master: torch.nn.Parameter
    """This replica's chunk of `flat`: what the optimizer steps."""
    params: list[torch.nn.Parameter]
    """The parameters `flat` holds, in order."""


def shard_stage(stage: str, params: list[torch.nn.Parameter], group: tuple[int, ...], rank: int) -> Shard:
    """Make `params` views of one flat buffer and return this rank's shard of it."""
    if not params:
        raise DappleError(f"stage @{stage} has zero = 1 but no parameters of its own to shard")
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        raise DappleError(
            f"stage @{stage} has zero = 1 but parameters of several dtypes ({sorted(map(str, dtypes))}); one flat "
            "buffer needs one dtype: compile without --zero for this model"
        )
    n = len(group)
    numel = sum(p.numel() for p in params)
    chunk = -(-numel // n)
    flat = params[0].new_zeros(n * chunk)
    flat_grad = params[0].new_zeros(n * chunk)
    offset = 0
    with torch.no_grad():
        for p in params:
            view = flat[offset : offset + p.numel()].view_as(p)
            view.copy_(p)
            p.data = view
            p.grad = flat_grad[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
    k = group.index(rank)
    master = torch.nn.Parameter(flat[k * chunk : (k + 1) * chunk], requires_grad=True)
    master.grad = flat_grad[k * chunk : (k + 1) * chunk]
    return Shard(stage, group, flat, flat_grad, master, params)


def zero_grads(shard: Shard) -> None:
    """Clear the stage's gradients for the next step (the buffer stays: the memory model counts it)."""
    shard.flat_grad.zero_()
