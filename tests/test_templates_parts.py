"""Templates in parts: the shared prelude and PTX helpers under templates/common/, softmax's
storage strategies and combine modes as include files, and a template digest that covers every
file a render reads.

Run as a script, it is the byte-identity check of a template refactor (a one-off, not a test:
it renders about two million variants):

    python tests/test_templates_parts.py snapshot /tmp/render-hashes.json   # before the change
    python tests/test_templates_parts.py compare /tmp/render-hashes.json    # after it

snapshot renders every valid point of a set of softmax and attention problems and saves the
sha256 of each rendered source; compare renders the same points again and reports any variant
whose source changed.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import shutil
import sys
import tomllib
from pathlib import Path
from typing import Any, Iterator

import jinja2
import pytest

REPO = Path(__file__).resolve().parent.parent

# one worker runs the module under `pytest -n 2 --dist loadgroup`: its module fixtures (a point of
# each strategy, the files their renders read) are built once
pytestmark = pytest.mark.xdist_group("templates_parts")

# The problems of the byte-identity check: every valid point of each, on sm_90 and sm_80.
SOFTMAX_SHAPES = ("4096x8192", "7x1025", "32x131072", "1x1048576", "65536x64", "4096x50257",
                  "16384x4000", "1024x32768")
ATTENTION_SHAPES = ("1x32x8192x64", "4x16x4096x128", "3x7x1000x64", "1x2x77x32")
ARCHS = ("90", "80")


def _cases() -> Iterator[tuple[str, str, str, tuple[str, ...], str]]:
    for shape in SOFTMAX_SHAPES:
        for dtype in ("float32", "float16", "bfloat16"):
            for arch in ARCHS:
                yield "softmax", shape, dtype, (), arch
    for shape in ATTENTION_SHAPES:
        for dtype in ("float16", "bfloat16"):
            for flags in ((), ("causal",)):
                for arch in ARCHS:
                    yield "attention", shape, dtype, flags, arch


def _render_case(name: str, shape: str, dtype: str, flags: tuple[str, ...], arch: str) -> dict[str, Any]:
    """Every valid point of one problem: a digest of the point list, and per point (in
    valid_points order) an index into the distinct source hashes."""
    from autosoft.families import get_family
    from autosoft.families.base import Target, build_variant, space_of

    family = get_family(name)
    problem = family.problem(shape, dtype, flags)
    target = Target.for_arch(arch)
    points = space_of(family).valid_points(family.problem_values(problem, target))
    unique: dict[str, int] = {}
    index: list[int] = []
    for params in points:
        digest = hashlib.sha256(build_variant(family, problem, params, target).source.encode()).hexdigest()
        index.append(unique.setdefault(digest, len(unique)))
    points_digest = hashlib.sha256(json.dumps(points, sort_keys=True).encode()).hexdigest()
    return {"points": points_digest, "sources": list(unique), "index": index}


def _label(case: tuple[str, str, str, tuple[str, ...], str]) -> str:
    name, shape, dtype, flags, arch = case
    return f"{name} {shape}{''.join('+' + f for f in flags)} {dtype} sm_{arch}"


def snapshot(path: str) -> None:
    result = {}
    for case in _cases():
        result[_label(case)] = _render_case(*case)
        print(_label(case), len(result[_label(case)]["index"]), "points", flush=True)
    with open(path, "w") as f:
        json.dump(result, f)


def compare(path: str) -> int:
    with open(path) as f:
        before = json.load(f)
    variants = identical = 0
    for case in _cases():
        label = _label(case)
        old, new = before[label], _render_case(*case)
        assert old["points"] == new["points"], f"{label}: the valid points changed; compare needs the same space"
        same = sum(old["sources"][i] == new["sources"][j] for i, j in zip(old["index"], new["index"]))
        variants += len(old["index"])
        identical += same
        print(f"{label}: {same}/{len(old['index'])} identical ({len(new['sources'])} distinct sources)", flush=True)
    print(f"total: {identical}/{variants} variants render byte-identical sources")
    return 0 if identical == variants else 1



# ---- tests --------------------------------------------------------------------------------

def _families():
    from autosoft.families import get_family

    return [get_family("softmax"), get_family("attention"), get_family("attention_colsum"),
            get_family("softmax_backward")]


def _template_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def _edit(path: Path) -> None:
    """A change of the template's text, not of a comment: a line of CUDA at the end of the file."""
    path.write_text(path.read_text() + "// edited\n")


def _edit_comments(path: Path) -> int:
    """Comment-only edits: every Jinja comment's text changed (its whitespace-control signs
    kept), and a comment line added at the end of the file. Returns the comments edited."""
    import re

    text, count = re.subn(r"\{#([-+]?)(.*?)([-+]?)#\}", r"{#\1\2 (edited)\3#}", path.read_text(), flags=re.DOTALL)
    path.write_text(text + "  {# a new comment\n   over two lines #}\n")
    return count


def _recorded_loads(points) -> dict[str, set[str]]:
    """The template files each family's renders of `points` read, through a loader that records
    every file it opens (no template cache: every include and import is loaded again)."""
    from autosoft.families.base import build_variant, template_root
    from autosoft.render import environment, templates_dir

    loaded: set[str] = set()

    class Recording(jinja2.FileSystemLoader):
        def get_source(self, env, name):
            loaded.add(name)
            return super().get_source(env, name)

    recorder = environment().overlay(loader=Recording(str(templates_dir())), cache_size=0)
    reads: dict[str, set[str]] = {}
    for family, problem, target, params in points:
        assert template_root(family) is None
        loaded.clear()
        source = recorder.get_template(_template_of(family, params)).render(**_render_args(family, problem, params, target))
        assert source == build_variant(family, problem, params, target).source
        reads.setdefault(family.template, set()).update(loaded)
    return reads


def _template_of(family, params) -> str:
    """The template build_variant renders a point with: its engine's (a family with engines whose
    kernels have templates of their own, as attention_backward's), else the family's."""
    from autosoft.families.base import engine_of, space_of

    return engine_of(family, space_of(family).check_values(params))[0].template


def _render_args(family, problem, params, target) -> dict[str, Any]:
    """The arguments build_variant renders a point with."""
    from autosoft.families.base import space_of

    space = space_of(family)
    checked = space.check_values(params)
    values = space.evaluate(checked, family.problem_values(problem, target))
    launches, _ = family.launches(problem, values, target)
    return {**family.template_args(problem, values), "name": family.variant_name(problem, checked),
            "kernel_names": [launch.kernel for launch in launches]}


def _one_point_per_strategy():
    """For softmax, a valid point of each storage with split 1 and of each combine mode with split
    rows, for 32-bit and 16-bit data; for attention, one point of each problem kind."""
    from autosoft.families.base import Target, space_of

    softmax, attention, colsum, backward = _families()
    picks = []
    for dtype in ("float32", "float16"):
        for shape in ("4096x8192", "32x131072"):
            problem = softmax.problem(shape, dtype)
            target = Target.for_arch("90")
            # of each kind, the first point with the widest row group: the compiler unrolls a few
            # elements per thread, where a one-warp group staging a long row takes it seconds
            widest: dict[tuple, dict] = {}
            for params in space_of(softmax).valid_points(softmax.problem_values(problem, target)):
                kind = (params["storage"], params["combine"] if params["split"] > 1 else None)
                if kind not in widest or params["row_threads"] > widest[kind]["row_threads"]:
                    widest[kind] = params
            picks += [(softmax, problem, target, params) for params in widest.values()]
    for flags in ((), ("causal",)):
        problem = attention.problem("1x2x77x32", "bfloat16", flags)
        target = Target.for_arch("80")
        picks.append((attention, problem, target, attention.default_params(problem, target)))
    problem = attention.problem("1x2x300x64", "bfloat16", ("causal",))  # the Hopper engine (wgmma, TMA)
    target = Target.for_arch("90")
    params = attention.default_params(problem, target)
    assert params["engine"] == "wgmma"
    picks.append((attention, problem, target, params))
    # the Hopper engine under each tile scheduler the default did not choose
    schedules = {_wgmma_schedule(params)}
    for params in space_of(attention).valid_points(attention.problem_values(problem, target)):
        if params["engine"] == "wgmma" and _wgmma_schedule(params) not in schedules:
            schedules.add(_wgmma_schedule(params))
            picks.append((attention, problem, target, params))
    for way in ("fused", "key_major"):  # the mma engine's kernel: the wgmma one has no fused pass
        problem = colsum.problem("1x2x77x64", "float16", {"split": 40})
        target = Target.for_arch("80")
        picks.append((colsum, problem, target, {**colsum.default_params(problem, target), "colsum": way, "km_split": 1}))
    for shape in ("4096x8192", "32x131072"):  # rows held in registers, and split over a cluster
        problem = backward.problem(shape, "float16", {"log": True})
        target = Target.for_arch("90")
        picks.append((backward, problem, target, backward.default_params(problem, target)))
    # every other built-in family: among the default and the seeds of its examples, one point of
    # each combination of its strategies (its parameters with text values), which the seeds cover
    # (a new family then needs no line here)
    from autosoft.families import families
    from autosoft.families.base import template_root

    named = {f.name for f in _families()}
    for family in families().values():
        if family.name in named or template_root(family) is not None:
            continue
        seen = set()
        for shape, dtype, options in family.examples:
            problem = family.problem(shape, dtype, options)
            target = Target.for_arch("90")
            for params in (family.default_params(problem, target), *family.seed_params(problem, target)):
                kind = tuple(sorted((k, v) for k, v in params.items() if isinstance(v, str)))
                if kind not in seen:
                    seen.add(kind)
                    picks.append((family, problem, target, params))
    return picks


def _wgmma_schedule(params: dict[str, Any]) -> str:
    """The tile scheduler a wgmma point chooses (templates/attention/wgmma_schedule_*.cuh.j2)."""
    return "queue" if params["queue"] else "persistent" if params["persistent"] else "single"


@pytest.fixture(scope="module")
def strategy_points():
    return _one_point_per_strategy()


@pytest.fixture(scope="module")
def loads(strategy_points):
    return _recorded_loads(strategy_points)


def test_sample_covers_every_strategy(strategy_points):
    kinds = {(p["storage"], p["combine"] if p["split"] > 1 else None)
             for f, _, _, p in strategy_points if f.name == "softmax"}
    assert kinds == {("registers", None), ("smem", None), ("reread", None),
                     ("registers", "cluster"), ("registers", "grid"), ("reread", "launches")}


def test_every_template_file_is_read_by_some_render_and_covered_by_its_digest(loads):
    """Each file under templates/ is read by a render, and every file a render reads is among
    the files its family's digest hashes (the rule of render.template_digest)."""
    from autosoft.render import _covered_folders, _templates_in, templates_dir

    root = templates_dir()
    assert set().union(*loads.values()) == set(_template_files(root))
    from autosoft.families import families

    also = {f.template: f.template_folders for f in families().values()}
    for template, read in loads.items():
        covered = {n for folder in _covered_folders(template, root, also[template]) for n in _templates_in(root, folder)}
        assert read <= covered, read - covered


def test_both_templates_include_common_files(loads):
    for template in ("softmax/softmax.cu.j2", "attention/attention.cu.j2"):
        assert {"common/dtype.cuh.j2", "common/ptx.cuh.j2"} <= loads[template]


ROW_PARTS = {"common/row_vector.cuh.j2", "common/row_reduce.cuh.j2", "common/row_combine.cuh.j2"}


def test_row_families_read_the_shared_row_parts(loads):
    for template in ("softmax/softmax.cu.j2", "softmax_backward/softmax_backward.cu.j2"):
        assert ROW_PARTS <= loads[template], template


@pytest.mark.parametrize("definition", [
    "union vec_t", "void unpack(const vec_t", "vec_t pack(const float", "vec_t {{ name }}(const raw_t* p)",
    "void store_vec(", "float group_reduce(", "float group_sum(", "void reduce_pair(",
    "float load_from_block(const float*", "float2 load_pair_from_block(", "struct RowExchange"])
def test_row_helpers_are_defined_once_in_common(definition):
    """The vector access and the reductions of row-wise families live in common/ only: a family
    that copied one into its own folder would find this test."""
    from autosoft.render import templates_dir

    root = templates_dir()
    holders = [name for name in _template_files(root) if definition in (root / name).read_text()]
    assert len(holders) == 1 and holders[0] in ROW_PARTS, holders


def test_softmax_reads_one_include_per_chosen_strategy(strategy_points):
    softmax = strategy_points[0][0]
    for family, problem, target, params in strategy_points:
        if family is not softmax:
            continue
        read = _recorded_loads([(family, problem, target, params)])[family.template]
        strategies = sorted(n for n in read if n.startswith(("softmax/storage_", "softmax/combine_")))
        assert strategies == sorted([f"softmax/combine_{params['combine']}.cuh.j2",
                                     f"softmax/storage_{params['storage']}.cuh.j2"])


def test_sample_covers_every_wgmma_schedule(strategy_points):
    schedules = {_wgmma_schedule(p) for f, _, _, p in strategy_points
                 if f.name == "attention" and p["engine"] == "wgmma"}
    assert schedules == {"single", "persistent", "queue"}


def test_wgmma_reads_one_scheduler_per_chosen_schedule(strategy_points):
    """A wgmma render reads the scheduler its point chooses and no other; an mma render none."""
    for family, problem, target, params in strategy_points:
        if family.name != "attention":
            continue
        read = _recorded_loads([(family, problem, target, params)])[family.template]
        schedulers = sorted(n for n in read if n.startswith("attention/wgmma_schedule_"))
        want = [f"attention/wgmma_schedule_{_wgmma_schedule(params)}.cuh.j2"] if params["engine"] == "wgmma" else []
        assert schedulers == want, params


def test_both_attention_engines_read_the_variant(strategy_points):
    """The scores' variant (scale, softcap, masks) is one file that both engines render."""
    engines = set()
    for family, problem, target, params in strategy_points:
        if family.name == "attention":
            assert "attention/variant.cuh.j2" in _recorded_loads([(family, problem, target, params)])[family.template]
            engines.add(params["engine"])
    assert engines == {"mma", "wgmma"}


def test_template_digest_is_the_documented_rule():
    """sha256 over the *.j2 files of the template's folder, of common/ and of the folders the
    family declares it reads, sorted by path under the root, each as path, NUL, length, NUL and
    its text without comments (render.without_comments), in UTF-8."""
    from autosoft.families.base import family_template_digest
    from autosoft.render import templates_dir, without_comments

    root = templates_dir()
    for family in _families():
        folders = (family.template.rpartition("/")[0], "common", *family.template_folders)
        digest = hashlib.sha256()
        for name in sorted(n for n in _template_files(root)
                           if n.rpartition("/")[0] in folders and n.endswith(".j2")):
            data = without_comments((root / name).read_text()).encode()
            digest.update(f"{name}\0{len(data)}\0".encode() + data)
        assert family_template_digest(family) == digest.hexdigest()


@pytest.mark.parametrize("source, kept", [
    ("a\n  {# why #}\nb\n", "a\nb\n"),                       # alone on its line: the line goes
    ("{# one\n   and two #}\nb", "b"),                          # over several lines, at the start
    ("a;  {# why #}\nb\n", "a;  {# #}\nb\n"),                  # after code: trim_blocks eats the newline
    ("a\n{#- why #}\nb\n", "a\n{#- #}\nb\n"),                # signs strip around it: they stay
    ("a\n{# why -#}\n  b", "a\n{# -#}\n  b"),
    ("a\n{#+ why #}\nb\n", "a\n{#+ #}\nb\n"),
    ("{{ x }} {% if x %}#{% endif %}\n", "{{ x }} {% if x %}#{% endif %}\n"),  # no comment: as it was
])
def test_without_comments_keeps_what_renders(source, kept):
    from autosoft.render import environment, without_comments

    assert without_comments(source) == kept
    env = environment()
    for x in (0, 1):
        assert env.from_string(kept).render(x=x) == env.from_string(source).render(x=x)


def test_a_comment_edit_keeps_every_digest_and_every_render(tmp_path, strategy_points):
    """Every comment of every template file edited, and a comment added to each: no family's
    digest changes (the tuned entries stay), and every strategy point renders the same bytes."""
    from autosoft.families.base import build_variant
    from autosoft.render import render, template_digest, templates_dir

    copy = tmp_path / "templates"
    shutil.copytree(templates_dir(), copy)
    names = [name for name in _template_files(copy) if name.endswith(".j2")]
    comments = sum((copy / name).read_text().count("{#") for name in names)
    assert sum(_edit_comments(copy / name) for name in names) == comments > 0
    for family in _families():
        assert (template_digest(family.template, str(copy), family.template_folders)
                == template_digest(family.template, None, family.template_folders)), family.name
    for family, problem, target, params in strategy_points:
        source = render(_template_of(family, params), _render_args(family, problem, params, target), str(copy))
        assert source == build_variant(family, problem, params, target).source


def test_a_comment_that_strips_text_changes_the_digest_and_the_render(tmp_path, strategy_points):
    """A comment whose "-" takes the newline before it is a change of the render, so of the digest."""
    from autosoft.families.base import build_variant
    from autosoft.render import render, template_digest, templates_dir

    copy = tmp_path / "templates"
    shutil.copytree(templates_dir(), copy)
    path = copy / "softmax_backward" / "softmax_backward.cu.j2"
    text = path.read_text()
    assert text.count("\nconstexpr int N = ") == 1
    path.write_text(text.replace("\nconstexpr int N = ", "\n{#- joined to the line above #}constexpr int N = "))
    family = _families()[3]
    assert (template_digest(family.template, str(copy), family.template_folders)
            != template_digest(family.template, None, family.template_folders))
    family, problem, target, params = next(p for p in strategy_points if p[0] is family)
    source = render(_template_of(family, params), _render_args(family, problem, params, target), str(copy))
    assert source != build_variant(family, problem, params, target).source


def test_digest_changes_when_any_file_a_render_reads_changes(tmp_path):
    """Edit each template file in turn in a copy of templates/ (a line of code, not a comment):
    the digest of every family whose renders read it changes, and no other family's does."""
    from autosoft.render import template_digest, templates_dir

    def digest(family, root):
        return template_digest(family.template, str(root), family.template_folders)

    for i, name in enumerate(_template_files(templates_dir())):
        copy = tmp_path / f"t{i}"  # a root per edit: render.environment is cached per root
        shutil.copytree(templates_dir(), copy)
        before = {f.name: digest(f, copy) for f in _families()}
        _edit(copy / name)
        for family in _families():
            folders = ("common", family.template.rpartition("/")[0], *family.template_folders)
            reads = name.startswith(tuple(f + "/" for f in folders))
            changed = digest(family, copy) != before[family.name]
            assert changed == reads, (name, family.template)


def test_check_references_refuses_an_include_the_digest_would_not_cover(tmp_path):
    from autosoft.render import check_references, template_digest, templates_dir

    for line in ('{% include "attention/attention.cu.j2" %}',              # another family's folder
                 '{% include "attention/x_" ~ storage ~ ".cuh.j2" %}',     # computed, outside
                 '{% include storage ~ ".cuh.j2" %}',                      # computed, no constant folder
                 '{% include "common/sub/x.cuh.j2" %}'):                   # below common/
        copy = tmp_path / hashlib.sha256(line.encode()).hexdigest()[:12]
        shutil.copytree(templates_dir(), copy)
        path = copy / "softmax" / "storage_smem.cuh.j2"
        path.write_text(path.read_text() + line + "\n")
        with pytest.raises(jinja2.TemplateError, match="would not cover|could not tell"):
            check_references("softmax/softmax.cu.j2", root=str(copy))
        check_references("attention/attention.cu.j2", root=str(copy))  # attention reads none of it
        assert template_digest("softmax/softmax.cu.j2", root=str(copy))  # the digest itself only hashes


def test_check_references_refuses_a_comment_start_jinja_does_not_read(tmp_path):
    """A "{#" inside a tag's string is no comment: the digest must not drop what follows it."""
    from autosoft.render import check_references, templates_dir

    shutil.copytree(templates_dir(), tmp_path / "t")
    path = tmp_path / "t" / "softmax" / "storage_smem.cuh.j2"
    path.write_text('{% set brace = "{#" %}\n' + path.read_text())
    with pytest.raises(jinja2.TemplateError, match="not the start of a Jinja comment"):
        check_references("softmax/softmax.cu.j2", root=str(tmp_path / "t"))


def test_digest_of_a_family_with_its_own_root_and_no_common_folder(tmp_path):
    """tests/fault_family keeps its template at the top of its own root, beside Python files."""
    from autosoft.render import template_digest

    source = REPO / "tests" / "fault_family"
    copy = tmp_path / "fault_family"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__"))
    digest = template_digest("faulty.cu.j2", root=str(copy))
    assert digest == template_digest("faulty.cu.j2", root=str(source))  # __pycache__ is not hashed
    data = (copy / "faulty.cu.j2").read_bytes()  # it holds no Jinja comment
    assert b"{#" not in data
    assert digest == hashlib.sha256(f"faulty.cu.j2\0{len(data)}\0".encode() + data).hexdigest()
    (copy / "faulty.yaml").write_text((copy / "faulty.yaml").read_text() + "\n# not a template\n")
    assert template_digest("faulty.cu.j2", root=str(copy)) == digest
    _edit_comments(copy / "faulty.cu.j2")
    assert template_digest("faulty.cu.j2", root=str(copy)) == digest
    _edit(copy / "faulty.cu.j2")
    assert template_digest("faulty.cu.j2", root=str(copy)) != digest


def test_package_data_ships_every_template_file():
    """pyproject's package-data globs for autosoft.templates match every file under templates/."""
    from autosoft.render import templates_dir

    with open(REPO / "pyproject.toml", "rb") as f:
        globs = tomllib.load(f)["tool"]["setuptools"]["package-data"]["autosoft.templates"]
    for name in _template_files(templates_dir()):
        assert any(fnmatch.fnmatch(name, g) for g in globs), name


@pytest.mark.parametrize("arch", ["90", "80"])
def test_one_variant_per_strategy_compiles_with_nvrtc(strategy_points, arch):
    """Every include file in use, compiled: the cluster kernels only where sm_90 allows them."""
    from autosoft.compile import compile_source
    from autosoft.families.base import Target, build_variant, is_valid

    target = Target.for_arch(arch)
    built = 0
    for family, problem, _, params in strategy_points:
        if not is_valid(family, problem, target, params):
            continue
        variant = build_variant(family, problem, params, target)
        result = compile_source(variant.source, arch)
        assert result.ok, f"{variant.name} on sm_{arch}:\n{result.log[-2000:]}"
        built += 1
    assert built >= (8 if arch == "90" else 6)

if __name__ == "__main__":
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's autosoft
    if len(sys.argv) != 3 or sys.argv[1] not in ("snapshot", "compare"):
        sys.exit(__doc__)
    sys.exit(snapshot(sys.argv[2]) if sys.argv[1] == "snapshot" else compare(sys.argv[2]))
