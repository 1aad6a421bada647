"""Mixed precision as the runtime and the reference both run it: torch.autocast and fp16's dynamic loss scale.

A plan's precision (`ModuleAttrs.precision`, `dapple_ir.analysis.precision`) decides:

- fp32: nothing changes;
- bf16, fp16: each stage's forward (and a recomputing stage's rerun) runs under
  `torch.autocast(device_type, dtype)`; parameters stay fp32 (autocast casts them per op, never in place),
  so gradients accumulate in fp32 and the optimizer steps fp32 state. Values cross stages in whatever dtype
  autocast gave them (the transport's header carries it): a matmul's output travels 16-bit, a value a norm or
  an add with fp32 produced travels fp32;
- fp16 adds a dynamic loss scale (`LossScaler`, torch's GradScaler rule): the loss each microbatch's backward
  starts from is multiplied by the scale; before the optimizer step every rank flags a non-finite gradient of
  its own, the flags are summed over all ranks (so a skipped step is skipped everywhere), and then either all
  ranks divide their gradients by the scale (a power of two: exact) and step, or all skip the step and halve
  the scale. After `growth_interval` good steps in a row the scale doubles. The scale is saved in checkpoints.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from dapple_ir.errors import DappleError

#: The autocast dtype of each 16-bit precision.
AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device_type: str) -> AbstractContextManager[Any]:
    """The context a stage's forward runs in under `precision` (nothing for fp32)."""
    dtype = AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type, dtype=dtype)


@dataclass
class LossScaler:
    """fp16's dynamic loss scale (the module docstring gives the rule)."""

    scale: float = 2.0**16
    """What each microbatch's loss is multiplied by before its backward."""
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    """Good steps in a row after which the scale grows."""
    good_steps: int = 0
    """Steps since the last overflow (or growth)."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    @staticmethod
    def overflow_flag(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """1.0 where any of `grads` holds an inf or a NaN, else 0.0: a tensor to sum over the ranks."""
        flag = torch.zeros(1, device=device)
        for g in grads:
            if not bool(torch.isfinite(g).all()):
                flag.fill_(1.0)
                break
        return flag

    def unscale(self, grads: list[torch.Tensor]) -> None:
        for g in grads:
            g.div_(self.scale)

    def update(self, overflow: bool) -> None:
        """The scale after a step that overflowed (backs off) or did not (grows after `growth_interval`)."""
        if overflow:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: object, where: str) -> None:
        if not isinstance(state, dict) or not isinstance(state.get("scale"), float | int):
            raise DappleError(
                f"{where} holds no fp16 loss scale (a dict with its scale): it was saved by a plan at another "
                "precision, or forged"
            )
        self.scale = float(state["scale"])
        self.good_steps = int(state.get("good_steps", 0))


def loss_scaler(precision: str) -> LossScaler | None:
    """The loss scale fp16 needs; None for the other precisions (bf16 has fp32's exponent range)."""
    return LossScaler() if precision == "fp16" else None


def step_with_scaler(
    scaler: LossScaler | None, grads: list[torch.Tensor], agree: Any, step: Any, device: torch.device
) -> bool:
    """Step (calling `step()`) unless fp16 overflowed on some rank; `agree(flag)` sums the flag over all ranks
    (in place). The scale is updated either way. Returns whether the step was skipped."""
    if scaler is None:
        step()
        return False
    flag = scaler.overflow_flag(grads, device)
    agree(flag)
    overflow = bool(flag.item() > 0)
    if not overflow:
        scaler.unscale(grads)
        step()
    scaler.update(overflow)
    return overflow
