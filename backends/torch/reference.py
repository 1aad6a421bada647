"""Single-device reference training, the oracle that `dapple run --check` compares a pipeline against.

It shares nothing with the pipelined path but the model spec, the seed, the data convention, the
optimizer choice and the rule that seeds random draws: the original `nn.Module` (not the captured
graph) runs each of the M microbatches of the global batch, each loss is scaled by 1/M, gradients
accumulate, and the optimizer steps. Its k-th random draw in a microbatch takes the k-th of `sites`
(the pipeline's draws in graph order), so dropout masks equal the pipeline's. Under a 16-bit precision the
model and its loss run under the same autocast and, for fp16, the same loss scale and overflow rule as the
pipeline's (`mixed_precision`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dapple_ir.backends.torch.data import check_batch, data_function, microbatch, synthetic_batch
from dapple_ir.backends.torch.mixed_precision import LossScaler, autocast, loss_scaler, step_with_scaler
from dapple_ir.backends.torch.random_draws import Site, drawing_in_order
from dapple_ir.backends.torch.runtime import make_optimizer
from dapple_ir.errors import DappleError
from dapple_ir.frontend.model_spec import FactoryResult, load_model_spec


@dataclass
class ReferenceResult:
    losses: list[float]
    """Mean microbatch loss of each step, from step 0."""
    params: dict[str, torch.Tensor]
    """Trainable parameters after the last step, by model name."""
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    """Buffers (running statistics) after the last step, by model name."""
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """The gradient of every trainable parameter the optimizer saw at each step (zeros where none)."""
    batch_norm_values: dict[str, int] = field(default_factory=dict)
    """Per batch-norm module, the fewest values per channel it normalised over (batch x spatial)."""
    skipped_steps: list[int] = field(default_factory=list)
    """fp16: the steps an overflow skipped."""


#: Batch-norm module types whose per-channel statistics the reference watches.
_BATCH_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)


def train_reference(
    spec: str,
    *,
    seed: int,
    steps: int,
    microbatches: int,
    microbatch_size: int,
    optimizer: str,
    lr: float,
    sites: list[Site] | tuple[Site, ...] = (),
    precision: str = "fp32",
) -> ReferenceResult:
    """Train `spec`'s model for `steps` steps on one CPU device, microbatched like the plan.

    `sites` are the random draws of one microbatch's forward in order (`random_draws`); a model that
    draws more or fewer is an error, since its dropout masks could not be matched.
    """
    loaded = load_model_spec(spec, device="cpu", seed=seed)
    if not isinstance(loaded, FactoryResult):
        raise DappleError(f"model spec {spec} is an imported profile: there is no model to train")
    model = loaded.model
    model.train()
    kw_names = list((loaded.example_kwargs or {}).keys())
    examples = (*loaded.example_inputs, *(loaded.example_kwargs or {}).values())
    data_fn = data_function(spec)
    global_batch = microbatches * microbatch_size
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = make_optimizer(optimizer, list(trainable.values()), lr)
    losses: list[float] = []
    grads: list[dict[str, torch.Tensor]] = []
    values = _watch_batch_norms(model)
    scaler = loss_scaler(precision)
    skipped: list[int] = []
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
            with (
                drawing_in_order(seed, step, mb, list(sites), f"the model of {spec} (the reference)"),
                autocast(precision, "cpu"),
            ):
                loss = _loss(model(*positional, **keywords), loaded.loss_fn, ts)
            scaled = loss / microbatches
            (scaled if scaler is None else scaler.scale_loss(scaled)).backward()
            total += float(loss.detach())
        if _optimizer_step(opt, trainable, scaler, grads):
            skipped.append(step)
        opt.zero_grad(set_to_none=True)
        losses.append(total / microbatches)
    return ReferenceResult(
        losses,
        {n: p.detach().clone() for n, p in model.named_parameters()},
        {n: b.detach().clone() for n, b in model.named_buffers()},
        grads,
        values,
        skipped,
    )


def _optimizer_step(
    opt: torch.optim.Optimizer,
    trainable: dict[str, torch.nn.Parameter],
    scaler: LossScaler | None,
    grads: list[dict[str, torch.Tensor]],
) -> bool:
    """Step (recording the gradients the optimizer sees in `grads`) unless fp16 overflowed; True if skipped."""

    def step() -> None:
        grads.append({n: (p.grad if p.grad is not None else torch.zeros_like(p)).clone() for n, p in trainable.items()})
        opt.step()

    held = [p.grad for p in trainable.values() if p.grad is not None]
    if not step_with_scaler(scaler, held, lambda _flag: None, step, torch.device("cpu")):
        return False
    grads.append({n: torch.zeros_like(p) for n, p in trainable.items()})
    return True


def _watch_batch_norms(model: torch.nn.Module) -> dict[str, int]:
    """Record, per batch norm, the fewest values per channel it normalises over (few values amplify rounding)."""
    seen: dict[str, int] = {}
    for name, module in model.named_modules():
        if isinstance(module, _BATCH_NORMS):

            def record(m: torch.nn.Module, args: tuple[Any, ...], name: str = name) -> None:
                x = args[0] if args else None
                if m.training and isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1]:
                    count = x.numel() // x.shape[1]
                    seen[name] = min(seen.get(name, count), count)

            module.register_forward_pre_hook(record)
    return seen


def _loss(output: Any, loss_fn: Any, targets: tuple[Any, ...]) -> torch.Tensor:
    if loss_fn is not None:
        return loss_fn(output, *targets)  # type: ignore[no-any-return]
    if isinstance(output, dict):
        return output["loss"]  # type: ignore[no-any-return]
    return output  # type: ignore[no-any-return]
