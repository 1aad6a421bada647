"""`run(check=True)`, `dapple run --check`: a run's result against single-device training.

`compare_with_reference` trains the model on one device with the same seed, data, microbatches and
optimizer, and compares losses, the gradients of step 0, the final parameters and buffers within the
tolerances of `tolerances.py`; its docstring states the rule, and why so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dapple_ir.analysis.precision import precision_of
from dapple_ir.backends.torch.results import CheckResult, RunResult
from dapple_ir.backends.torch.tolerances import NORMALISING, TOLERANCES, Tolerance, adam_reach
from dapple_ir.errors import RuntimeFailure
from dapple_ir.plan_dir import Plan


def compare_with_reference(plan: Plan, result: RunResult, optimizer: str, lr: float) -> CheckResult:
    """Train the reference and compare what is meaningful (the rule `dapple run --help` states):

    - the loss of every step run, within ATOL + RTOL of the reference's;
    - every parameter copy's gradient at step 0, where both start from the same parameters (what the
      pipeline computes; the optimizer is the same code on both sides), within RTOL of the element plus
      GRAD_ATOL of the step's largest (later gradients follow the parameters, which the next items check);
    - every parameter copy after the last step, within ATOL + RTOL; under Adam and AdamW, whose steps are
      normalised to the learning rate, plus the drift the gradients' rounding gives their steps
      (`Tolerance.adam_drift`), and for the elements whose reference gradient was at noise level (the
      precision's noise floor) in some step plus the farthest Adam can step two runs apart (`adam_reach`):
      their steps are noise normalised to the learning rate, of either sign (their gradients were compared);
    - buffers of unreplicated stages like parameters; a replicated stage's buffers are averaged over
      its replicas (its microbatches are not run in one sequence), so they must agree across them.

    ATOL, RTOL, GRAD_ATOL and the noise floor are those of the plan's precision (`tolerances.TOLERANCES`).
    """
    from dapple_ir.backends.torch.reference import train_reference

    tol = TOLERANCES[precision_of(plan.module)]
    ref = train_reference(
        plan.model_spec,
        seed=plan.seed,
        steps=result.first_step + len(result.losses),
        microbatches=plan.microbatches,
        microbatch_size=plan.microbatch_size,
        optimizer=optimizer,
        lr=lr,
        sites=result.sites,
        precision=precision_of(plan.module),
    )
    scales = [max((float(g.abs().max()) for g in step.values() if g.numel()), default=0.0) for step in ref.grads]
    failures: list[str] = []
    bad_steps: set[int] = set()
    loss = _Worst()
    for step, (got, want) in enumerate(
        zip(result.losses, ref.losses[result.first_step :], strict=True), result.first_step
    ):
        loss.add(abs(got - want), f"step {step}")
        if abs(got - want) > tol.atol + tol.rtol * abs(want):
            failures.append(f"loss of step {step}: {got:.7g}, the reference {want:.7g}")
            bad_steps.add(step)
    grad = _compare_grads(result, ref.grads, scales, failures, bad_steps, tol)
    normalised = optimizer in NORMALISING
    noisy = _noise_masks(ref.grads, scales, tol.noise_floor) if normalised else {}
    drift = tol.adam_drift(lr, len(ref.grads)) if normalised else 0.0
    reach = adam_reach(lr, len(ref.grads))
    param = _Worst()
    for rank, tensors in result.params.items():
        for key, value in tensors.items():
            name = key.split("/", 1)[1]
            if name not in ref.params:
                raise RuntimeFailure(f"rank {rank} holds parameter {name} that the reference model does not have")
            where = f"parameter {name} on rank {rank}"
            _compare(value, ref.params[name], where, param, failures, tol, drift, noisy.get(name), reach)
    buffer, averaged = _compare_buffers(plan, result, ref.buffers, failures, tol)
    return CheckResult(
        max_loss_diff=loss.diff,
        max_param_diff=param.diff,
        worst_param=param.where,
        ok=not failures,
        max_grad_diff=grad.diff,
        worst_grad=grad.where,
        max_buffer_diff=buffer.diff,
        worst_buffer=buffer.where,
        noise_elements=sum(int(m.sum()) for m in noisy.values()),
        averaged_buffers=averaged,
        failures=failures[:_SHOWN] + ([f"... and {len(failures) - _SHOWN} more"] if len(failures) > _SHOWN else []),
        notes=_notes(result, ref.batch_norm_values, bad_steps) if failures else [],
    )


#: Batch norm over at most this many values per channel is noted as a likely amplifier of rounding.
_FEW_VALUES = 32


def _notes(result: RunResult, batch_norm_values: dict[str, int], bad_steps: set[int]) -> list[str]:
    """Hints for a failed check: whether the first step agreed, and batch norms that amplify rounding."""
    notes = []
    if result.grads and result.first_step == 0 and 0 not in bad_steps:
        notes.append(
            "the first step agrees (its loss and every gradient), the runs part after it: either training "
            "amplifies rounding differences, or something after the first optimizer step differs (optimizer "
            "state, zeroing of gradients)"
        )
    few = sorted((count, name) for name, count in batch_norm_values.items() if count <= _FEW_VALUES)
    if few:
        count, name = few[0]
        notes.append(
            f"batch norm {name} normalises over only {count} value(s) per channel (microbatch size x spatial "
            "size): near ties its gradient grows like 1/sqrt(eps), amplifying rounding (a replicated stage sums "
            "microbatch gradients in another order than one device) into a different training; use larger "
            "microbatches, fewer replicas or GroupNorm where runs must agree exactly"
        )
    return notes


#: Failures listed in a check's report; the rest are counted.
_SHOWN = 5


@dataclass
class _Worst:
    """The largest difference seen so far and where."""

    diff: float = 0.0
    where: str = ""

    def add(self, diff: float, where: str) -> None:
        if diff > self.diff or not self.where:
            self.diff, self.where = diff, where


def _compare_grads(
    result: RunResult,
    ref_grads: list[dict[str, torch.Tensor]],
    scales: list[float],
    failures: list[str],
    bad_steps: set[int],
    tol: Tolerance,
) -> _Worst:
    worst = _Worst()
    for rank, steps in result.grads.items():
        for step, grads in sorted(steps.items()):
            scale = scales[step]
            for key, value in grads.items():
                name = key.split("/", 1)[1]
                if name not in ref_grads[step]:
                    continue  # the parameter comparison names it
                want = ref_grads[step][name]
                diff = (value - want).abs()
                where = f"gradient of {name} on rank {rank} at step {step}"
                worst.add(float(diff.max()) / scale if scale > 0 and diff.numel() else 0.0, where)
                if bool((diff > tol.rtol * want.abs() + tol.grad_atol * scale).any()):
                    bad_steps.add(step)
                    failures.append(
                        f"{where}: max |diff| {float(diff.max()):.3g}, allowed {tol.rtol:g} of the element plus "
                        f"{tol.grad_atol * scale:.3g} ({tol.grad_atol:g} of the step's largest gradient, {scale:.3g})"
                    )
    return worst


def _noise_masks(
    ref_grads: list[dict[str, torch.Tensor]], scales: list[float], floor: float
) -> dict[str, torch.Tensor]:
    """Per parameter, the elements whose reference gradient was at noise level (`floor` of the step's largest) in
    some step."""
    masks: dict[str, torch.Tensor] = {}
    for grads, scale in zip(ref_grads, scales, strict=True):
        for name, g in grads.items():
            low = g.abs() <= floor * scale
            masks[name] = masks[name] | low if name in masks else low
    return masks


def _compare(
    got: torch.Tensor,
    want: torch.Tensor,
    where: str,
    worst: _Worst,
    failures: list[str],
    tol: Tolerance,
    drift: float = 0.0,
    noisy: torch.Tensor | None = None,
    reach: float = 0.0,
) -> None:
    """Elementwise within ATOL + RTOL + `drift` (integers exactly), the elements `noisy` marks within `reach` more;
    `worst` records the largest difference of the others."""
    if got.shape != want.shape:
        failures.append(f"{where}: shape {tuple(got.shape)}, the reference {tuple(want.shape)}")
        return
    if not got.is_floating_point():
        worst.add(0.0 if torch.equal(got, want) else float("inf"), where)
        if not torch.equal(got, want):
            failures.append(f"{where}: {got.tolist()}, the reference {want.tolist()}")
        return
    diff = (got - want).abs()
    allowed = tol.atol + drift + tol.rtol * want.abs()
    if noisy is not None:
        allowed = allowed + reach * noisy
    bad = diff > allowed
    shown = diff if noisy is None else diff.masked_fill(noisy, 0.0)
    worst.add(float(shown.max()) if diff.numel() else 0.0, where)
    if bool(bad.any()):
        failures.append(f"{where}: max |diff| {float(diff.max()):.3g} in {int(bad.sum())} element(s)")


def _compare_buffers(
    plan: Plan, result: RunResult, ref_buffers: dict[str, torch.Tensor], failures: list[str], tol: Tolerance
) -> tuple[_Worst, int]:
    """Unreplicated stages' buffers against the reference; replicated stages' across their replicas."""
    replicas = {stage.name: stage.attrs.replicas or 1 for stage in plan.module.stages}
    worst = _Worst()
    copies: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for rank, tensors in result.buffers.items():
        for key, value in tensors.items():
            stage, name = key.split("/", 1)
            if name not in ref_buffers:
                continue  # a constant of the graph (export lifts some), not state of the model
            if replicas.get(stage, 1) > 1:
                copies.setdefault(key, []).append((rank, value))
            else:
                _compare(value, ref_buffers[name], f"buffer {name} on rank {rank}", worst, failures, tol)
    for key, held in copies.items():
        first_rank, first = held[0]
        for rank, value in held[1:]:
            if not torch.equal(value, first):
                stage, name = key.split("/", 1)
                failures.append(f"buffer {name} differs between replicas of @{stage} (ranks {first_rank} and {rank})")
    return worst, len(copies)
