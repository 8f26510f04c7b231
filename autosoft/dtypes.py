"""The one place that knows the element types: names, sizes, how each is held on the GPU, and how
the frameworks (torch, CuPy, DLPack) spell them.

CuPy has no bfloat16, so a bfloat16 array travels through CuPy as uint16 bits; every conversion
between fp32 values, those stored bits and float64 for checking lives here.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from .errors import UserError

DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}  # in variant names

# Quiet NaN bit patterns: output buffers are filled with them before a verification run, so an
# element the kernel never writes is caught.
# An int32 output (an index) gets the same bits: 2143289344, outside any index range.
POISON_BITS = {"float32": 0x7FC00000, "float16": 0x7E00, "bfloat16": 0x7FC0, "int32": 0x7FC00000}
_BITS_TYPE = {"float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16, "int32": np.uint32}
# What a kernel may write besides the element types it reads: int32 (a router's expert indices).
OUTPUT_DTYPES: tuple[str, ...] = DTYPES + ("int32",)

# What an input a family declares a dtype of its own for (Family.input_dtypes) may hold besides:
# class indices (a loss's targets).
INPUT_DTYPES: tuple[str, ...] = DTYPES + ("int64", "int32")

# How each framework names the dtypes we take (str(dtype) of a torch tensor, of a CuPy array).
TORCH_NAMES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16"}
CUPY_NAMES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}
# The same for every input dtype (Family.input_dtypes): the problem's dtype is only ever a DTYPES one.
TORCH_INPUT_NAMES = {**TORCH_NAMES, "torch.int64": "int64", "torch.int32": "int32"}
CUPY_INPUT_NAMES = {**CUPY_NAMES, "int64": "int64", "int32": "int32"}


def check_dtype(dtype: str, allowed: Sequence[str] = DTYPES, family: str = "") -> str:
    """dtype if it is one of `allowed`, else a UserError that lists them."""
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}: choose one of {', '.join(allowed)}")
    if dtype not in allowed:
        choices = ", ".join(allowed[:-1]) + " or " + allowed[-1] if len(allowed) > 1 else allowed[0]
        raise UserError(f"{family or 'this family'} runs on {choices}, not {dtype}")
    return dtype


def check_input_dtypes(who: str, given: Sequence[tuple[str, str, str | None]], takes: Sequence[str],
                       own: Mapping[str, Sequence[str]]) -> str:
    """The call's dtype, the first input's, once it is one of `takes` and every other input's is
    its own declared one (`own`, by input name: a family's input_dtypes) or else the first's; a
    TypeError naming the first input that is not. given: (input name, the dtype as its framework
    writes it, its name here or None) per input, in the family's order."""
    (first, shown, dtype), *rest = given
    if dtype not in takes:
        raise TypeError(f"{who}: {first} must be {' or '.join(takes)}, got {shown}")
    for name, shown, theirs in rest:
        allowed = own.get(name, (dtype,))
        if theirs not in allowed:
            whose = "" if name in own else f" ({first}'s dtype)"
            raise TypeError(f"{who}: {name} must be {' or '.join(allowed)}{whose}, got {shown}")
    return dtype  # type: ignore[return-value]  # one of takes


def storage_dtype(dtype: str) -> str:
    """How a dtype is held in a CuPy array (bfloat16's bits ride in uint16)."""
    return "uint16" if dtype == "bfloat16" else dtype


def poisoned(shape: tuple[int, ...], dtype: str, xp: Any) -> Any:
    """An array of `shape` full of NaN bits in `dtype`'s storage type."""
    return xp.full(shape, POISON_BITS[dtype], dtype=_BITS_TYPE[dtype]).view(storage_dtype(dtype))


def to_storage(x32: Any, dtype: str, xp: Any) -> Any:
    """fp32 values -> the array the kernel reads (bf16 as uint16 bits, rounded to nearest even)."""
    if dtype == "float32":
        return x32
    if dtype == "float16":
        return x32.astype(np.float16)
    u = x32.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def to_float64(a: Any, dtype: str, xp: Any) -> Any:
    """Stored values (bf16 as uint16 bits) -> float64, for checking against a reference."""
    if dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)
