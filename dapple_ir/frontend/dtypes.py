"""Torch dtypes and the IR's short dtype names (`dapple_ir.ir.DTYPE_BYTES`), both ways."""

from __future__ import annotations

import torch

#: The torch dtypes the IR can hold, by their IR name.
IR_DTYPE_OF: dict[torch.dtype, str] = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
    torch.complex64: "c64",
}
TORCH_DTYPE_OF: dict[str, torch.dtype] = {name: dtype for dtype, name in IR_DTYPE_OF.items()}
