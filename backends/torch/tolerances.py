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
#: Below NOISE_FLOOR times the step's largest gradient, a gradient element is mostly rounding noise
#: (an attention key bias, analytically zero). Adam and AdamW divide by its root mean square, turning
#: that noise into a full learning-rate step of random sign, so those elements' parameters are
#: compared through their gradients only.
NOISE_FLOOR = 1e-4
#: Optimizers whose step is normalised by the gradient's magnitude.
NORMALISING = ("adam", "adamw")


@dataclass(frozen=True)
class Tolerance:
    """How closely `--check` compares a run trained at one precision: losses, parameters and buffers within
    `atol + rtol * |reference|`, step-0 gradients within `rtol` of the element plus `grad_atol` of the step's
    largest gradient."""

    rtol: float
    atol: float
    grad_atol: float


#: Per precision. fp32: PyTorch's pipelining tolerances (above). bf16 (8 significant bits, about 3 decimal
#: digits) and fp16 (11 bits): autocast rounds each matmul's output to 16 bits, so a replicated stage that
#: splits a microbatch rounds each replica's partial weight gradient to 16 bits before the fp32 sum, where one
#: device rounds the whole sum once: gradients part by up to a few units of the 16-bit roundoff (2^-8 for bf16,
#: 2^-11 for fp16) of their size. Measured on the CPU (3 Adam steps): an unreplicated split of the MLP agrees
#: bitwise under bf16 and fp16, the GPT example within 4e-9 (its tied embedding's gradient sums in another
#: order); the MLP's stage split over 2 replicas differs by 4.2e-5 in a gradient element (2.4e-3 of the step's
#: largest, 0.128) and 2.2e-5 in a parameter: within 2^-7 (bf16) of the element plus 2^-7 of the largest gradient,
#: a margin of 3.
TOLERANCES: dict[str, Tolerance] = {
    "fp32": Tolerance(RTOL, ATOL, GRAD_ATOL),
    "bf16": Tolerance(2.0**-7, ATOL, 2.0**-7),
    "fp16": Tolerance(2.0**-10, ATOL, 2.0**-10),
}
