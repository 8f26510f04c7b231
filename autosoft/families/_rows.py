"""What the families over the rows of an (M, N) array share (softmax, softmax_backward): the
shape's text and limits, leading dimensions flattened into rows, the distance between two shapes
and the smaller problem a borrowed variant is checked on, the vector types their templates use,
power-of-two helpers for their defaults, and the verdict of their checks. A private module: the
registry imports no family from it."""
from __future__ import annotations

import math
import re
from typing import Any, Mapping

from ..errors import UserError
from .base import Family, OptionValue, Problem

__all__ = ["RowsFamily", "INT32_MAX", "VEC_BITS_TYPE", "pow2_floor", "pow2_ceil", "worst_mismatch"]

INT32_MAX = 2**31 - 1
VEC_BITS_TYPE = {2: "unsigned short", 4: "unsigned int", 8: "uint2", 16: "uint4"}  # a vector's bits, by its bytes
_SHAPE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


class RowsFamily(Family):
    """A family whose problem is M rows of N elements, worked on row by row (leading dimensions
    of a caller's array are rows): the MxN shape text, its limits, shape distance and
    verification shape. Subclasses are the families; this adds no family of its own."""
    shape_help = "MxN: rows x row length, e.g. 4096x8192"

    def parse_shape(self, text: str) -> tuple[int, int]:
        match = _SHAPE.match(str(text))
        if not match:
            raise UserError(f"malformed --shape {text!r}: {self.name} wants MxN with positive integers, "
                            "e.g. 4096x8192")
        return self.check_shape((int(match.group(1)), int(match.group(2))), text)

    def check_shape(self, shape: tuple[int, ...], text: Any = None) -> tuple[int, int]:
        text = text if text is not None else "x".join(map(str, shape))
        if len(shape) != 2 or min(shape) < 1:
            raise UserError(f"malformed --shape {text!r}: M and N must be at least 1, e.g. 4096x8192")
        if shape[1] > INT32_MAX // 8:
            raise UserError(f"shape {text!r}: rows longer than {INT32_MAX // 8} elements are not supported")
        return (int(shape[0]), int(shape[1]))

    def problem_for(self, shapes: Mapping[str, tuple[int, ...]], dtype: str,
                    options: Mapping[str, OptionValue]) -> Problem:
        """Rows are everything but the last dimension: (A, B, N) is the problem (A*B)xN; every
        input has the first one's shape."""
        first, *others = self.inputs
        shape = tuple(shapes[first])
        for name in others:
            if tuple(shapes[name]) != shape:
                raise ValueError(f"autosoft.{self.name}: {first} {shape} and {name} {tuple(shapes[name])} "
                                 "must have the same shape")
        if len(shape) == 0:
            raise ValueError(f"autosoft.{self.name}: {first} is a scalar; it needs at least one dimension")
        return super().problem_for({first: (math.prod(shape[:-1]), shape[-1])}, dtype, options)

    def caller_outputs(self, shapes: Mapping[str, tuple[int, ...]], dtype: str,
                       options: Mapping[str, OptionValue]) -> dict[str, tuple[tuple[int, ...], str]]:
        """Each output shaped like the first input, in its dtype."""
        return {name: (tuple(shapes[self.inputs[0]]), dtype) for name in self.outputs}

    def shape_distance(self, a: tuple[int, ...], b: tuple[int, ...]) -> float:
        """How far apart two shapes are for borrowing a tuned variant: log2 steps, N weighs 4x."""
        return abs(math.log2(a[0]) - math.log2(b[0])) + 4 * abs(math.log2(a[1]) - math.log2(b[1]))

    def verification_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A smaller problem with the same compiled kernel, to check a borrowed variant on."""
        return (min(shape[0], 256), shape[1])


def pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def worst_mismatch(got: Any, ref: Any, err: Any, tol: Any, xp: Any) -> str | None:
    """`check`'s verdict on an (M, N) output: None when every |got - ref| (err) is within tol,
    else how many elements are off and the worst of them. NaN (an unwritten, poisoned element)
    counts as off."""
    bad = ~(err <= tol)
    nbad = int(bad.sum())
    if nbad == 0:
        return None
    flat = int(xp.argmax(xp.where(bad, xp.nan_to_num(err, nan=xp.inf), -1.0)))
    r, c = divmod(flat, got.shape[1])
    return (f"{nbad} of {got.size} elements off; worst at [{r}, {c}]: got {float(got[r, c])!r}, "
            f"expected {float(ref[r, c])!r} (tolerance {float(tol[r, c]):.3g})")
