"""The single Jinja environment that turns (family template, arguments) into CUDA source."""
from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Any, Mapping

import jinja2

from .resources import templates_dir


@lru_cache(maxsize=None)
def environment(root: str | None = None) -> jinja2.Environment:
    """The environment for the shipped templates (or for a family that keeps its own folder)."""
    # StrictUndefined: a template that names a missing argument fails loudly instead of
    # rendering an empty string into CUDA source.
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(root or str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(template: str, args: Mapping[str, Any], root: str | None = None) -> str:
    return environment(root).get_template(template).render(**args)


def template_digest(template: str, root: str | None = None) -> str:
    """sha256 of a template's text: part of every cache key, so editing a template retires old entries."""
    env = environment(root)
    source, _, _ = env.loader.get_source(env, template)
    return hashlib.sha256(source.encode()).hexdigest()
