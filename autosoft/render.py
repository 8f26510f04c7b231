"""The single Jinja environment that turns (family template, arguments) into CUDA source, and the
digest of the template files a render reads (part of every cache key)."""
from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Mapping

import jinja2
from jinja2 import lexer, nodes

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
        bytecode_cache=_bytecode_cache(),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


class _QuietBytecodeCache(jinja2.FileSystemBytecodeCache):
    """Compiled templates in the kernel store's folder (templates/ inside it), so a fresh process
    renders without parsing the templates again (tens of milliseconds of its first call). Jinja
    keys each entry by template name and a checksum of its source, so an edited template is
    compiled afresh. Written only where the kernel store exists already (dispatch made it): a
    render alone (`autosoft render`) creates nothing. A folder that cannot be written only costs
    the parse."""

    def dump_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        folder = Path(self.directory)
        if not folder.parent.is_dir():
            return
        try:
            folder.mkdir(exist_ok=True)
            super().dump_bytecode(bucket)
        except OSError:
            pass

    def load_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        try:
            super().load_bytecode(bucket)
        except (OSError, EOFError, ValueError):  # unreadable or damaged: parse instead
            bucket.reset()


def _bytecode_cache() -> jinja2.BytecodeCache | None:
    from .cache import default_store_folder
    from .errors import UserError

    try:
        return _QuietBytecodeCache(str(default_store_folder() / "templates"))
    except UserError:  # $AUTOSOFT_CACHE_DIR names a file: the commands say so; parse every time
        return None


def render(template: str, args: Mapping[str, Any], root: str | None = None) -> str:
    return environment(root).get_template(template).render(**args)


def template_digest(template: str, root: str | None = None, also: tuple[str, ...] = ()) -> str:
    """sha256 of every template file a render of `template` can read, Jinja comments aside:
    editing the code or text of any of them retires the cache entries made with the old text;
    editing, adding or removing a comment keeps them.

    The rule: the template and the files `*.j2` directly in its own folder, directly in the
    root's `common/` folder (where there is one) and directly in the folders `also` names (a
    family that extends another family's kernel names that family's folder), sorted by their
    path under the root, each fed to the hash as its path, NUL, the length of its text without
    comments (`without_comments`, in UTF-8), NUL, that text. Folders rather than the names a
    template names, because includes choose files by parameter at render time
    ("softmax/storage_" ~ storage), which no reading of the template resolves.

    That this covers every file a render reads, and that every comment `without_comments` finds
    is one Jinja reads, is what `check_references` proves (the conformance suite runs it for
    every family); the digest itself only scans text, since it is computed on the first call of
    every process.
    """
    base = Path(root) if root else templates_dir()
    folders = _covered_folders(template, base, also)
    found = {name for folder in folders for name in _templates_in(base, folder)}
    if template not in found:  # a template not named *.j2 is hashed too; a missing one fails as in render
        environment(root).get_template(template)
        found.add(template)
    names = sorted(found)
    digest = hashlib.sha256()
    for name in names:
        data = without_comments((base / name).read_text(encoding="utf-8")).encode()
        digest.update(f"{name}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()


# A Jinja comment: {# ... #}, with the whitespace-control signs ("-" strips the whitespace
# beside it, "+" keeps what lstrip_blocks / trim_blocks would take). Comments do not nest.
_COMMENT = re.compile(r"\{#([-+]?)(.*?)([-+]?)#\}", re.DOTALL)


def without_comments(source: str) -> str:
    """A template's text as the digest reads it, which renders as the template does: a comment
    alone on its line, without signs, goes with its line (lstrip_blocks takes the indentation
    before it and trim_blocks the newline after it: the line renders nothing); any other comment
    keeps only its signs, as `{#<sign> <sign>#}` (what it strips around it depends on them and
    on where it stands, never on what it says)."""
    out: list[str] = []
    at = 0
    for match in _COMMENT.finditer(source):
        start, end = match.span()
        line_start = source.rfind("\n", 0, start) + 1
        alone = (not match[1] and not match[3] and source[line_start:start].strip(" \t") == ""
                 and source[end:end + 1] in ("\n", ""))
        if alone:
            out.append(source[at:line_start])
            at = end + 1
        else:
            out.append(source[at:start] + "{#" + match[1] + " " + match[3] + "#}")
            at = end
    out.append(source[at:])
    return "".join(out)


def check_references(template: str, root: str | None = None, also: tuple[str, ...] = ()) -> None:
    """Raise jinja2.TemplateError unless every include, import or extends in the files that
    template_digest covers names a covered file, or is computed from a constant prefix
    "folder/..." whose folder is covered (the computed rest is a search-space value, which holds
    no "/"): then the digest covers every file a render can read."""
    base = Path(root) if root else templates_dir()
    folders = _covered_folders(template, base, also)
    names = tuple(sorted({name for folder in folders for name in _templates_in(base, folder)} | {template}))
    _check_references(root, folders, names)


def _covered_folders(template: str, base: Path, also: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The template's own folder ("" for the root itself), common/ where the root has one, then
    the folders in `also`, each once."""
    own = template.rpartition("/")[0]
    folders = [own]
    for folder in ((COMMON,) if (base / COMMON).is_dir() else ()) + tuple(also):
        if folder not in folders:
            if not (base / folder).is_dir():
                raise jinja2.TemplateNotFound(f"{folder}/ (a template folder {template} reads)")
            folders.append(folder)
    return tuple(folders)


def _templates_in(base: Path, folder: str) -> Iterator[str]:
    """Names (as the loader spells them) of the *.j2 files directly in a folder under the root."""
    for entry in (base / folder).iterdir():
        if entry.is_file() and entry.name.endswith(".j2"):
            yield f"{folder}/{entry.name}" if folder else entry.name


def _check_references(root: str | None, folders: tuple[str, ...], names: tuple[str, ...]) -> None:
    """Raise unless every template reference in the covered files stays inside them."""
    env = environment(root)
    base = Path(root) if root else templates_dir()
    for name in names:
        source = (base / name).read_text(encoding="utf-8")
        _check_comments(env, name, source)
        for target, exact in _references(env, name, source):
            if (target not in names) if exact else (target.rpartition("/")[0] not in folders):
                spelled = repr(target) if exact else f"a name computed from {target!r}"
                raise jinja2.TemplateError(
                    f"{name} reads {spelled}, which the template digest would not cover: "
                    f"templates may include only files of their own folder, of {COMMON}/ and of the "
                    "folders their family declares in template_folders")


def _check_comments(env: jinja2.Environment, name: str, source: str) -> None:
    """Raise unless the comments `without_comments` finds are the ones Jinja's lexer reads, in
    order (a "{#" inside a string of a tag or in a raw block is none): then the text it removes
    never renders, and the digest sees every edit that changes a render."""
    found = [match[2] for match in _COMMENT.finditer(source)]
    read = [value for _, kind, value in env.lex(source, name) if kind == lexer.TOKEN_COMMENT]
    if found != read:
        raise jinja2.TemplateError(
            f"{name}: a \"{{#\" that is not the start of a Jinja comment (in a string or a raw block); "
            "the template digest, which drops comments, would misread it")


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
