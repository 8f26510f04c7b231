"""Where the templates and search spaces are: inside the installed package, or beside it in a checkout."""
from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _data_dir(name: str) -> Path:
    installed = _PACKAGE / name  # a non-editable install copies the folder into the package
    return installed if installed.is_dir() else _PACKAGE.parent / name


def templates_dir() -> Path:
    return _data_dir("templates")


def search_space_path(family: str) -> Path:
    return _data_dir("search_spaces") / f"{family}.yaml"
