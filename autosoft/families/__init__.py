"""Kernel families, registered by name."""
from __future__ import annotations

from ..errors import UserError
from .attention import ATTENTION
from .base import Family
from .softmax import SOFTMAX

FAMILIES: dict[str, Family] = {SOFTMAX.name: SOFTMAX, ATTENTION.name: ATTENTION}


def get_family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise UserError(f"unknown family {name!r}: choose one of {', '.join(sorted(FAMILIES))}") from None
