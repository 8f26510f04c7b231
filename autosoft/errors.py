"""Errors a user can cause. The CLI prints their message on one line and exits 2; warnings on one line too."""
from __future__ import annotations


class UserError(Exception):
    """Bad input or environment: the message says what is wrong and what to do."""


class NoDeviceError(UserError):
    """No usable CUDA device (or CuPy is missing)."""


class CacheWarning(UserWarning):
    """A cache file row that was skipped (malformed or tampered); the message names the file and the row."""


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (driver messages span several), for logs and outcomes."""
    return " ".join(str(exc).split()) or type(exc).__name__
