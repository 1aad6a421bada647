"""Single-device reference training, the oracle that `dapple run --check` compares a pipeline against.

It shares nothing with the pipelined path but the model spec, the seed, the data convention and the
optimizer choice: the original `nn.Module` (not the captured graph) runs each of the M microbatches
of the global batch, each loss is scaled by 1/M, gradients accumulate, and the optimizer steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dapple_ir.backends.torch.data import check_batch, data_function, microbatch, synthetic_batch
from dapple_ir.backends.torch.runtime import make_optimizer
from dapple_ir.errors import DappleError
from dapple_ir.frontend.model_spec import FactoryResult, load_model_spec


@dataclass
class ReferenceResult:
    losses: list[float]
    """Mean microbatch loss of each step, from step 0."""
    params: dict[str, torch.Tensor]
    """Trainable parameters after the last step, by model name."""


def train_reference(
    spec: str,
    *,
    seed: int,
    steps: int,
    microbatches: int,
    microbatch_size: int,
    optimizer: str,
    lr: float,
) -> ReferenceResult:
    """Train `spec`'s model for `steps` steps on one CPU device, microbatched like the plan."""
    loaded = load_model_spec(spec, device="cpu", seed=seed)
    if not isinstance(loaded, FactoryResult):
        raise DappleError(f"model spec {spec} is an imported profile: there is no model to train")
    model = loaded.model
    model.train()
    kw_names = list((loaded.example_kwargs or {}).keys())
    examples = (*loaded.example_inputs, *(loaded.example_kwargs or {}).values())
    data_fn = data_function(spec)
    global_batch = microbatches * microbatch_size
    opt = make_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad], lr)
    losses: list[float] = []
    for step in range(steps):
        if data_fn is not None:
            inputs, targets = data_fn(step, global_batch, seed)
            inputs, targets = tuple(inputs), tuple(targets)
            check_batch(inputs, targets, global_batch, f"{spec} dapple_data")
        else:
            inputs, targets = synthetic_batch(examples, loaded.example_targets, global_batch, seed, step)
        total = 0.0
        for mb in range(microbatches):
            xs = microbatch(inputs, mb, microbatch_size)
            ts = microbatch(targets, mb, microbatch_size)
            positional = xs[: len(xs) - len(kw_names)]
            keywords = dict(zip(kw_names, xs[len(xs) - len(kw_names) :], strict=True))
            loss = _loss(model(*positional, **keywords), loaded.loss_fn, ts)
            (loss / microbatches).backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / microbatches)
    return ReferenceResult(losses, {n: p.detach().clone() for n, p in model.named_parameters()})


def _loss(output: Any, loss_fn: Any, targets: tuple[Any, ...]) -> torch.Tensor:
    if loss_fn is not None:
        return loss_fn(output, *targets)  # type: ignore[no-any-return]
    if isinstance(output, dict):
        return output["loss"]  # type: ignore[no-any-return]
    return output  # type: ignore[no-any-return]
