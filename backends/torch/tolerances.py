"""The tolerances of `dapple run --check` (see `check.compare_with_reference` for how they are used).

Torch-free, so that the command line can print them in its help without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass

#: fp32 tolerances of PyTorch's own pipelining tests: losses, parameters and buffers.
RTOL, ATOL = 1e-5, 4e-5
#: Gradients of step 0: a difference is allowed up to RTOL of the element plus GRAD_ATOL times the
#: step's largest reference gradient (summing microbatch gradients in another order moves low bits of
#: every element by about 1e-7 of the magnitudes summed, whatever the element's own size).
GRAD_ATOL = 1e-5
#: Below NOISE_FLOOR times the step's largest gradient, an fp32 gradient element is mostly rounding noise
#: (an attention key bias, analytically zero). Adam and AdamW divide by its root mean square, turning
#: that noise into a full learning-rate step of random sign, so those elements' parameters are
#: compared only within the farthest two runs of Adam can step apart (`adam_reach`); their gradients were compared.
NOISE_FLOOR = 1e-4
#: Optimizers whose step is normalised by the gradient's magnitude.
NORMALISING = ("adam", "adamw")
#: Adam's (AdamW's) moment decay rates: torch's defaults, which the pipeline and the reference both use.
ADAM_BETAS = (0.9, 0.999)


def adam_step_bound(t: int, betas: tuple[float, float] = ADAM_BETAS) -> float:
    """The largest |m_hat / sqrt(v_hat)| Adam's t-th step (from 1) can take, over every gradient sequence, in units of
    the learning rate: by Cauchy-Schwarz on the two moments' sums, (1 - b1) / (1 - b1^t) * sqrt((1 - b2^t) / (1 - b2))
    * sqrt(sum_{j<t} (b1^2 / b2)^j): 1.0 at t = 1, 1.01 at t = 5, 1.16 at t = 20."""
    b1, b2 = betas
    ratio = b1 * b1 / b2
    moments = (1 - ratio**t) / (1 - ratio)
    return (1 - b1) / (1 - b1**t) * ((1 - b2**t) / (1 - b2)) ** 0.5 * moments**0.5


def adam_reach(lr: float, steps: int) -> float:
    """How far apart `steps` Adam steps at `lr` can take one element on two runs, whatever gradients each saw: each
    step moves it by at most `adam_step_bound` learning rates either way (AdamW's decay only shrinks a difference)."""
    return 2.0 * lr * sum(adam_step_bound(t) for t in range(1, steps + 1))


@dataclass(frozen=True)
class Tolerance:
    """How closely `--check` compares a run trained at one precision: losses, parameters and buffers within
    `atol + rtol * |reference|`, step-0 gradients within `rtol` of the element plus `grad_atol` of the step's
    largest gradient. Under a normalising optimizer a parameter element may also drift by `adam_drift` (what the
    gradients' relative rounding moves Adam's steps by), and one whose gradient was below `noise_floor` of the step's
    largest in some step (its sign not determined) by `adam_reach` (the farthest Adam can step two runs apart)."""

    rtol: float
    atol: float
    grad_atol: float
    noise_floor: float

    def adam_drift(self, lr: float, steps: int) -> float:
        """How far `steps` Adam (AdamW) steps at `lr` may move a parameter element apart when every gradient they
        take is known to `rtol` of itself: the step m/sqrt(v) is scale-free, and a relative error e in the gradients
        moves it by at most about 2e (e in the first moment, e in the root of the second), 2 rtol lr a step."""
        return 2.0 * self.rtol * lr * steps


#: Unit roundoff (half the spacing of numbers in [1, 2)) of the 16-bit formats: bf16 keeps 8 significant bits,
#: fp16 11.
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}


def sixteen_bit(precision: str) -> Tolerance:
    """The tolerance of a 16-bit precision, from its unit roundoff u alone.

    Autocast rounds each matmul's output to 16 bits. A split that sums partial results of a matmul (a stage whose
    replicas split each microbatch: each replica's partial weight gradient; a tensor group's row-parallel matmul:
    each member's partial output) rounds each part where one device rounds the whole sum once, and the rounding
    travels on through every later op, so values and gradients part by a few u of their size, and the errors of
    the largest gradient (u of it) reach every element: 2u of the element plus 2u of the step's largest gradient
    (a margin of 2 over one rounding of each). A gradient element within that absolute allowance (2u of the largest)
    of zero has no determined sign, so Adam may step it either way: the noise floor is the allowance itself.
    Measured on the CPU (Adam): an unreplicated split of the MLP agrees bitwise under bf16 and fp16, the GPT example
    within 4e-9 (its tied embedding's gradient sums in another order); the MLP's stage split over 2 replicas differs
    by 2.4e-3 of the largest gradient; the GPT at T = 2 x 2 stages by 3.8e-3 = 0.98 u (its largest gradient's own
    rounding) at step 0, and elements at 1-3 u of themselves (median over each tensor).
    """
    u = UNIT_ROUNDOFF[precision]
    return Tolerance(rtol=2 * u, atol=ATOL, grad_atol=2 * u, noise_floor=2 * u)


#: Per precision. fp32: PyTorch's pipelining tolerances (above); the 16-bit ones from their roundoff (`sixteen_bit`).
TOLERANCES: dict[str, Tolerance] = {
    "fp32": Tolerance(RTOL, ATOL, GRAD_ATOL, NOISE_FLOOR),
    "bf16": sixteen_bit("bf16"),
    "fp16": sixteen_bit("fp16"),
}
