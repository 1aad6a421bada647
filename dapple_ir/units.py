"""Units and how dapple-ir writes them: byte sizes in binary units (KiB, MiB, GiB), seconds with a
unit chosen for the magnitude, counts with k/M/G/T. Every table, report and log line uses these,
so one figure reads the same wherever it is printed."""

from __future__ import annotations

KB = 1e3
MB = 1e6
GB = 1e9
"""Decimal gigabyte: device memory sizes in presets (`V100-16GB`) and bandwidths (GB/s)."""
KiB = 2**10
MiB = 2**20
GiB = 2**30

_BYTE_UNITS = (("TiB", 2**40), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))
_COUNT_UNITS = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))


def bytes_unit(nbytes: float) -> tuple[str, float]:
    """The binary unit for showing `nbytes` and its size in bytes: `("MiB", 2**20)`."""
    for unit, size in _BYTE_UNITS:
        if abs(nbytes) >= size:
            return unit, float(size)
    return "B", 1.0


def format_bytes(nbytes: float, digits: int = 2) -> str:
    """`1536` -> `1.50 KiB`; below one KiB a whole number of bytes (`512 B`)."""
    unit, size = bytes_unit(nbytes)
    return f"{nbytes:.0f} B" if unit == "B" else f"{nbytes / size:.{digits}f} {unit}"


def seconds_unit(seconds: float, *, threshold: float = 1.0) -> tuple[str, float]:
    """The unit and scale for showing `seconds`: `s` from `threshold` seconds up, then `ms`, then `µs`.
    A threshold of 10 keeps axis labels such as 0.5 s in milliseconds."""
    if seconds >= threshold:
        return "s", 1.0
    if seconds >= threshold * 1e-3:
        return "ms", 1e3
    return "µs", 1e6


def format_seconds(seconds: float, digits: int = 3) -> str:
    """`0.0123` -> `12.300 ms`; `digits` decimals in the chosen unit."""
    unit, scale = seconds_unit(seconds)
    return f"{seconds * scale:.{digits}f} {unit}"


def format_count(n: float) -> str:
    """`1.5e9` -> `1.50G`: FLOPs, parameters, elements."""
    for unit, scale in _COUNT_UNITS:
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"
