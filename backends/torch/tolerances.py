"""The tolerances of `dapple run --check` (see `check.compare_with_reference` for how they are used).

Torch-free, so that the command line can print them in its help without loading torch.
"""

from __future__ import annotations

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
