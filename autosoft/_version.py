"""The version of autosoft, in a module of its own so that the modules inside the package (tune,
export, cli) import it without importing the package's public face."""
from __future__ import annotations

__version__ = "0.1.0"
