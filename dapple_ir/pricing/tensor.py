"""Tensor parallelism's prices (Megatron-LM's intra-layer parallelism, `StageAttrs.tp`): what a stage whose replicas
each run on a tensor group of T devices of one node costs, for the planners and the simulator alike.

- An op the `tensor-parallel` pass marks (`tp_role` or `tp_dim`) computes 1/T of its width on each member: 1/T of
  its FLOPs and of the bytes it moves, its weights included, while each call's fixed cost stays whole; its matmuls
  run thinner, so at a lower efficiency where the cluster's device prices GEMMs by shape (`shard_roofline`). The
  other ops run whole on every member.
- The group sums partial results: one allreduce of each row-parallel result per forward (Megatron's g) and one of
  the gradient of each column-parallel input per backward (f), each a ring over the group's devices on the node's
  fabric (`tensor_reduce_s`), serial with the compute as in Megatron-LM without sequence parallelism.
- A member holds 1/T of each split parameter (its gradient and optimizer state too) and of each split value.

The planners search one T for all the stages of a plan on a grouped view of the cluster (`grouped_cluster`): each
node's devices taken T at a time, a tensor group per device of the view, so every DP, ILP, placement and memory
rule applies unchanged; `expand_devices` maps a plan's grouped devices back onto real ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dapple_ir.cluster.roofline import OpRoofline
from dapple_ir.cluster.spec import ClusterSpec
from dapple_ir.cluster.topology import Network
from dapple_ir.pricing.collectives import ring_allreduce


def shard_roofline(model: OpRoofline, t: int) -> OpRoofline:
    """What one member of a tensor group of `t` does of an op the roofline prices: 1/t of its FLOPs and moved bytes."""
    if t == 1:
        return model
    return dataclasses.replace(
        model,
        fwd_flops=model.fwd_flops / t,
        bwd_flops=model.bwd_flops / t,
        act_bytes=model.act_bytes / t,
        weight_bytes=model.weight_bytes / t,
    )


def grouped_cluster(cluster: ClusterSpec, t: int) -> ClusterSpec:
    """`cluster` seen by tensor groups of `t`: each node's devices taken `t` at a time (group g of a node holds its
    devices g t .. g t + t - 1), one device of the view per group. A group's members each send their copy of a cut's
    value over their own card, so a view device keeps one card's bandwidth; where cards are shared, the view keeps
    the node's cards per group (at least one)."""
    if t == 1:
        return cluster
    per = cluster.devices_per_node
    if per % t:
        raise ValueError(f"tensor groups of {t} do not divide the {per} devices of a node of {cluster.name}")
    cards = 0 if cluster.cards in (0, per) else max(1, cluster.cards // t)
    cores = max(1, cluster.cores_per_node // t) if cluster.cores_per_node else 0
    return dataclasses.replace(
        cluster,
        devices_per_node=per // t,
        cards=min(cards, per // t),
        card_devices=(),
        cores_per_node=cores,
        name=f"{cluster.name} (tensor groups of {t})",
    )


def expand_devices(cluster: ClusterSpec, t: int, grouped: Sequence[int]) -> tuple[int, ...]:
    """The real devices of the grouped view's `grouped` devices (`grouped_cluster`), each group's `t` in order."""
    if t == 1:
        return tuple(grouped)
    per = cluster.devices_per_node // t
    found: list[int] = []
    for d in grouped:
        base = (d // per) * cluster.devices_per_node + (d % per) * t
        found.extend(range(base, base + t))
    return tuple(found)


def tensor_reduce_s(network: Network, devices: Sequence[int], nbytes: float) -> float:
    """One tensor-parallel allreduce of `nbytes` over a tensor group's `devices` (a ring on the node's fabric)."""
    return ring_allreduce(network, devices).seconds(nbytes) if len(devices) > 1 and nbytes > 0 else 0.0
