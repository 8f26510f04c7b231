"""The single Jinja environment that turns (family template, arguments) into CUDA source, and the
digest of the template files a render reads (part of every cache key)."""
from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Mapping

import jinja2
from jinja2 import nodes

from .resources import templates_dir

# The folder of include files every family's template may use, beside the families' folders.
COMMON = "common"


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
    """sha256 of every template file a render of `template` can read: editing any of them retires
    the cache entries made with the old text.

    The rule: the template and the files `*.j2` directly in its own folder and directly in the
    root's `common/` folder (where there is one), sorted by their path under the root, each fed to the
    hash as its path, its length and its bytes. Folders rather than the names a template names,
    because includes choose files by parameter at render time ("softmax/storage_" ~ storage),
    which no reading of the template resolves.

    That this covers every file a render reads is checked here, not assumed: every include,
    import or extends in the covered files must name a covered file, or be computed from a
    constant prefix "folder/..." whose folder is covered (the computed rest is a search-space
    value, which holds no "/"). Anything else raises jinja2.TemplateError naming the reference.
    """
    base = Path(root) if root else templates_dir()
    folders = _covered_folders(template, base)
    found = {name for folder in folders for name in _templates_in(base, folder)}
    if template not in found:  # a template not named *.j2 is hashed too; a missing one fails as in render
        environment(root).get_template(template)
        found.add(template)
    names = sorted(found)
    digest = hashlib.sha256()
    for name in names:
        data = (base / name).read_bytes()
        digest.update(f"{name}\0{len(data)}\0".encode() + data)
    _check_references(root, folders, tuple(names), digest.hexdigest())
    return digest.hexdigest()


def _covered_folders(template: str, base: Path) -> tuple[str, ...]:
    """The template's own folder ("" for the root itself), then common/ where the root has one."""
    own = template.rpartition("/")[0]
    return (own, COMMON) if own != COMMON and (base / COMMON).is_dir() else (own,)


def _templates_in(base: Path, folder: str) -> Iterator[str]:
    """Names (as the loader spells them) of the *.j2 files directly in a folder under the root."""
    for entry in (base / folder).iterdir():
        if entry.is_file() and entry.name.endswith(".j2"):
            yield f"{folder}/{entry.name}" if folder else entry.name


@lru_cache(maxsize=64)
def _check_references(root: str | None, folders: tuple[str, ...], names: tuple[str, ...], digest: str) -> None:
    """Raise unless every template reference in the covered files stays inside them. Cached by
    digest (the dispatcher computes the digest per lookup): a file changes, the digest changes,
    the check runs again."""
    env = environment(root)
    base = Path(root) if root else templates_dir()
    for name in names:
        for target, exact in _references(env, name, (base / name).read_text(encoding="utf-8")):
            if (target not in names) if exact else (target.rpartition("/")[0] not in folders):
                spelled = repr(target) if exact else f"a name computed from {target!r}"
                raise jinja2.TemplateError(
                    f"{name} reads {spelled}, which the template digest would not cover: "
                    f"templates may include only files of their own folder and of {COMMON}/")


def _references(env: jinja2.Environment, name: str, source: str) -> Iterator[tuple[str, bool]]:
    """(name, True) for each template named outright, (constant prefix, False) for each computed name."""
    for node in env.parse(source, name=name).find_all((nodes.Extends, nodes.Include, nodes.Import, nodes.FromImport)):
        expr = node.template
        if isinstance(expr, (nodes.Tuple, nodes.List)):  # {% include [a, b] %}: the first that exists
            for item in expr.items:
                yield _constant(item, name), True
        elif isinstance(expr, nodes.Const):
            yield _constant(expr, name), True
        else:  # "folder/stem_" ~ value ~ ".cuh.j2": the leftmost operand is the folder
            while isinstance(expr, (nodes.Add, nodes.Concat)):
                expr = expr.left if isinstance(expr, nodes.Add) else expr.nodes[0]
            yield _constant(expr, name), False


def _constant(expr: nodes.Node, name: str) -> str:
    if isinstance(expr, nodes.Const) and isinstance(expr.value, str):
        return expr.value
    raise jinja2.TemplateError(f"{name}: a template name that does not start with a constant string "
                               f"({type(expr).__name__}); the template digest could not tell which files it reads")
