"""space.py: parsing a search space, the expression whitelist, the value gate, valid points."""
from __future__ import annotations

import functools
import itertools
import random
import textwrap

import pytest

from autosoft.errors import UserError
from autosoft.families import get_family
from autosoft.families.base import Problem, Target, space_of
from autosoft.resources import search_space_path
from autosoft.space import compile_expression, load_space, parse_space

SOFTMAX = get_family("softmax")

# A small space with the same features as the real one: derived names built on derived names,
# a constraint on problem values alone, string and bool values, every whitelisted function.
SMALL = textwrap.dedent("""\
    family: small
    parameters:
      threads: {values: [32, 64, 128, 256]}
      group:   {values: [1, 4, 32, 64, 256]}
      vec:     {values: [1, 2, 4, 8]}
      mode:    {values: [regs, smem, reread]}
      fast:    {values: [false, true]}
    derived:
      per_block: threads // group
      vec_bytes: vec * itemsize
      seg: "N if not fast else round_up(ceil_div(N, 2), 8)"
      per_thread: ceil_div(seg // vec, group)
      smem: "per_block * round_up(N, 8) * itemsize if mode == 'smem' else 0"
    constraints:
      - require: group <= threads
        why: group fits the block
      - require: vec_bytes <= 16
        why: 16-byte accesses at most
      - require: vec <= N
        why: vector no wider than the row
      - require: "group <= max(32, ceil_div(seg, vec))"
        why: no idle threads
      - require: "mode != 'regs' or per_thread * vec <= 64"
        why: registers
      - require: smem <= smem_limit
        why: shared memory
      - require: "not fast or (is_pow2(group) and log2(threads) >= 6 and min(N, 4) in (4,))"
        why: fast needs a big block
      - require: N >= 1
        why: problem only
    """)


def _problem_values(n: int, itemsize: int = 4, smem_limit: int = 16384, m: int = 3) -> dict:
    return {"M": m, "N": n, "itemsize": itemsize, "smem_limit": smem_limit}


def _brute_force(space, problem: dict) -> list[dict]:
    out = []
    for combo in itertools.product(*(p.values for p in space.parameters)):
        params = dict(zip(space.names, combo))
        if not space.violations(params, problem):
            out.append(params)
    return out


def _key(params: dict, names) -> tuple:
    return tuple((n, type(params[n]).__name__, params[n]) for n in names)


# --- parsing -------------------------------------------------------------------------------

@pytest.mark.parametrize("text, fragment", [
    ("parameters: [unclosed", "not valid YAML"),
    ("- just\n- a list\n", "parameters"),
    ("family: x\n", "parameters"),
    ("family: x\nparameters: [a, b]\n", "parameters"),
    ("family: x\nparameters:\n  a: {doc: no values}\n", "'a'"),
    ("family: x\nparameters:\n  a: {values: []}\n", "'a'"),
    ("family: x\nparameters:\n  a: {values: 4}\n", "'a'"),
    ("family: x\nparameters:\n  a: 7\n", "'a'"),
    ("family: x\nparameters:\n  a: {values: [1, [2]]}\n", "unsupported type"),
    ("family: x\nparameters:\n  a: {values: [1, {b: 2}]}\n", "unsupported type"),
    ("family: x\nparameters:\n  a: {values: [1, null]}\n", "unsupported type"),
    ("family: x\nconstraints:\n  - require: a > 1\nparameters:\n  a: {values: [1, 2]}\n  b: {values: [ok, 'x; y']}\n",
     "identifier"),
    ("family: x\nparameters:\n  s: {values: ['registers; system(\"rm -rf /\")']}\n", "identifier"),
    ("family: x\nparameters:\n  s: {values: ['a b']}\n", "identifier"),
    ("family: x\nparameters:\n  s: {values: ['*/ __global__']}\n", "identifier"),
    ("family: x\nparameters:\n  s: {values: ['']}\n", "identifier"),
    ("family: x\nparameters:\n  a: {values: [1]}\nconstraints:\n  - a > 1\n", "require"),
    ("family: x\nparameters:\n  a: {values: [1]}\nconstraints:\n  - why: no require\n", "require"),
    ("family: x\nparameters:\n  a: {values: [1]}\nconstraints:\n  - require: 'a >'\n", "cannot parse"),
    ("family: x\nparameters:\n  a: {values: [1]}\nderived:\n  b: 'a +* 2'\n", "cannot parse"),
    ("family: x\nparameters:\n  a: {values: [eager, lazy], since: soon}\n", "since='soon' is not one of"),
    ("family: x\nparameters:\n  a: {values: [1, 2], since: '1'}\n", "since='1' is not one of"),
])
def test_parse_space_rejects(text, fragment):
    with pytest.raises(UserError) as info:
        parse_space(text, "spaces/x.yaml")
    message = str(info.value)
    assert "spaces/x.yaml" in message, "the error names the file"
    assert fragment in message


@pytest.mark.parametrize("expression", [
    "__import__('os').system('true')",
    "().__class__",
    "().__class__.__bases__[0].__subclasses__()",
    "a.real",
    "(lambda: 1)()",
    "lambda: 1",
    "[1, 2][0]",
    "a[0]",
    "{'k': 1}",
    "{1, 2}",
    "[x for x in (1, 2)]",
    "(x for x in (1, 2))",
    "open('/etc/passwd')",
    "eval('1')",
    "exec('x = 1')",
    "getattr(a, 'real')",
    "min(*[1, 2])",
    "max(a, key=abs)",
    "min(a, b=1)",
    "ceil_div.__globals__",
    "f'{a}'",
    "(b := 1)",
    "a is None",
])
def test_disallowed_expression_syntax(expression):
    yaml_text = f"family: x\nparameters:\n  a: {{values: [1, 2]}}\nconstraints:\n  - require: {expression!r}\n"
    with pytest.raises(UserError):
        parse_space(yaml_text, "x.yaml")
    derived_text = f"family: x\nparameters:\n  a: {{values: [1, 2]}}\nderived:\n  d: {expression!r}\n"
    with pytest.raises(UserError):
        parse_space(derived_text, "x.yaml")


def test_expression_names_and_evaluation():
    expr = compile_expression("round_up(ceil_div(N, split), 8) if split > 1 else N", "here")
    assert expr.names == {"N", "split"}  # functions are not names the expression depends on
    assert expr.evaluate({"N": 1025, "split": 4}) == 264
    assert expr.evaluate({"N": 1025, "split": 1}) == 1025
    assert compile_expression("log2(1024)", "w").evaluate({}) == 10
    assert compile_expression("is_pow2(a) and not is_pow2(b)", "w").evaluate({"a": 64, "b": 0}) is True
    assert compile_expression("is_pow2(a)", "w").evaluate({"a": 96}) is False
    # builtins are out of reach even through a name the whitelist lets through; an unknown name
    # (a typo in a YAML file) is a UserError that names the expression
    with pytest.raises(UserError, match="'len'"):
        compile_expression("len", "w").evaluate({})
    with pytest.raises(UserError):
        compile_expression("2 ** 40", "w")  # no power operator: 2**2**40 would never finish


def test_the_shipped_space_parses_and_names_its_parameters():
    space = load_space("softmax")
    assert space.family == "softmax"
    documented = ("threads", "row_threads", "vec", "unroll", "storage", "normalise", "reduce", "split",
                  "persistent", "streaming")  # the README's list
    assert set(documented) <= set(space.names)
    assert len(set(space.names)) == len(space.names)
    assert all(p.doc for p in space.parameters), "every parameter says what it is"
    assert space.parameter("persistent").values == (False, True)
    assert all(type(v) is bool for v in space.parameter("streaming").values)
    assert all(type(v) is int for v in space.parameter("threads").values)
    with pytest.raises(UserError, match="unknown parameter 'warps'"):
        space.parameter("warps")


def test_digest_follows_the_file_text(tmp_path):
    text = search_space_path("softmax").read_text()
    base = parse_space(text, "a")
    assert base.digest == load_space("softmax").digest
    assert parse_space(text, "b").digest == base.digest, "the digest depends on the text, not the path"
    assert parse_space(text + "\n# a comment\n", "a").digest != base.digest
    edited = text.replace("values: [1, 2, 4, 8]", "values: [1, 2, 4]", 1)
    assert edited != text
    assert parse_space(edited, "a").digest != base.digest
    copy = tmp_path / "softmax.yaml"
    copy.write_text(text + " ")
    assert load_space("softmax", copy).digest != base.digest


# --- the value gate ---------------------------------------------------------------------------

def _good_params() -> dict:
    problem = Problem("softmax", "float32", (4096, 1024))
    return SOFTMAX.default_params(problem, Target.for_arch("90"))


def test_check_values_returns_the_declared_values_in_declaration_order():
    space = space_of(SOFTMAX)
    shuffled = dict(reversed(list(_good_params().items())))
    checked = space.check_values(shuffled)
    assert list(checked) == list(space.names)
    assert checked == _good_params() and list(shuffled) != list(space.names)
    for name, value in checked.items():
        declared = space.parameter(name).values
        assert any(value is v for v in declared), f"{name}: the declared object is returned, not the caller's"


@pytest.mark.parametrize("name, value", [
    ("threads", 96),               # outside the domain
    ("threads", "128"),            # a string that looks like a value
    ("threads", 128.0),            # a float equal to a declared int
    ("threads", True),             # bool is an int subclass in Python
    ("row_threads", True),         # True == 1 and 1 is declared
    ("split", True),
    ("vec", 4.0),
    ("persistent", 0),             # 0 == False
    ("persistent", 1),
    ("persistent", "false"),
    ("streaming", None),
    ("storage", "Registers"),
    ("storage", "registers; system(\"rm -rf /\")"),
    ("storage", "registers */ __global__ void evil() { /*"),
    ("storage", "smem\n#include </etc/passwd>"),
    ("storage", ["registers"]),
    ("normalise", b"online"),
])
def test_check_values_rejects(name, value):
    space = space_of(SOFTMAX)
    with pytest.raises(UserError) as info:
        space.check_values({**_good_params(), name: value})
    assert name in str(info.value)


def test_check_values_rejects_a_str_subclass_carrying_extra_text():
    class Sneaky(str):
        def __str__(self):  # renders as something else than it compares
            return "registers; system(1)"

    space = space_of(SOFTMAX)
    value = Sneaky("registers")
    with pytest.raises(UserError):
        space.check_values({**_good_params(), "storage": value})


def test_check_values_rejects_unknown_and_missing_names():
    space = space_of(SOFTMAX)
    with pytest.raises(UserError, match="warps"):
        space.check_values({**_good_params(), "warps": 4})
    params = _good_params()
    del params["vec"]
    with pytest.raises(UserError, match="missing parameter.*vec"):
        space.check_values(params)
    with pytest.raises(UserError):
        space.check_values({})


def test_a_point_stored_before_a_parameter_existed_takes_its_since_value():
    """A tuned entry stored before `rescale` was added holds no value of it: it builds as the
    kernel it was (since: eager), while a parameter without `since` stays required."""
    space = parse_space("family: x\nparameters:\n  a: {values: [1, 2]}\n"
                        "  rescale: {values: [eager, lazy], since: eager}\n", "x.yaml")
    assert space.check_values({"a": 2}) == {"a": 2, "rescale": "eager"}
    assert space.check_values({"a": 2, "rescale": "lazy"}) == {"a": 2, "rescale": "lazy"}
    with pytest.raises(UserError, match="missing parameter.*a"):
        space.check_values({"rescale": "lazy"})


@pytest.mark.parametrize("name, text, expected", [
    ("threads", "256", 256),
    ("threads", " 1024 ", 1024),
    ("storage", "smem", "smem"),
    ("storage", "SMEM", "smem"),
    ("persistent", "true", True),
    ("persistent", "False", False),
    ("streaming", "TRUE", True),
    ("split", "1", 1),
])
def test_parse_value(name, text, expected):
    value = space_of(SOFTMAX).parse_value(name, text)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("name, text", [
    ("threads", "96"), ("threads", "0x80"), ("threads", "128.0"), ("threads", "1e2"), ("threads", ""),
    ("persistent", "1"), ("persistent", "yes"), ("storage", "registers; system('id')"),
    ("storage", "regs"), ("split", "True"), ("nonexistent", "1"),
])
def test_parse_value_rejects(name, text):
    with pytest.raises(UserError):
        space_of(SOFTMAX).parse_value(name, text)


# --- valid points -----------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 3, 64, 1025])
@pytest.mark.parametrize("itemsize, smem_limit", [(4, 16384), (2, 2048)])
def test_valid_points_equal_brute_force_small_space(n, itemsize, smem_limit):
    space = parse_space(SMALL, "small.yaml")
    problem = _problem_values(n, itemsize, smem_limit)
    found = space.valid_points(problem)
    expected = _brute_force(space, problem)
    assert expected, "the problem should have valid points, or the comparison says little"
    assert len(expected) < 4 * 5 * 4 * 3 * 2, "the constraints should remove some points"
    assert [_key(p, space.names) for p in found] == [_key(p, space.names) for p in expected]


def test_valid_points_with_an_unsatisfiable_problem_constraint_are_empty():
    space = parse_space(SMALL.replace("require: N >= 1", "require: N >= 100000"), "small.yaml")
    assert space.valid_points(_problem_values(64)) == []


@pytest.mark.long
def test_valid_points_equal_brute_force_real_space():
    """The depth-first search with early constraint checks finds exactly the points that satisfy
    every constraint, in the order of the full product. That product (about 15M points) is too
    large to enumerate here, so every found point, every point one parameter away from a seeded
    sample of 4,000 found ones, and a random sample of the product are checked against all
    constraints directly."""
    space = space_of(SOFTMAX)
    problem = Problem("softmax", "float16", (7, 1025))  # split, smem and register variants all occur
    values = SOFTMAX.problem_values(problem, Target.for_arch("80"))
    names = space.names
    found_list = [tuple(p[n] for n in names) for p in space.valid_points(values)]
    found = set(found_list)

    def valid(combo: tuple) -> bool:
        scope = space.evaluate(dict(zip(names, combo)), values)
        return all(c.expression.evaluate(scope) for c in space.constraints)

    position = [{v: i for i, v in enumerate(p.values)} for p in space.parameters]
    assert found_list == sorted(found, key=lambda combo: [position[i][v] for i, v in enumerate(combo)])
    assert len(found) > 1000 and all(valid(combo) for combo in found)
    sample = random.Random(0).sample(found_list, 4000)  # the neighbours of every found point take half a minute
    neighbours = {combo[:i] + (v,) + combo[i + 1:] for combo in sample
                  for i, p in enumerate(space.parameters) for v in p.values} - found
    assert len(neighbours) > 10000
    assert not [combo for combo in neighbours if valid(combo)]
    rng = random.Random(5)
    sample = {tuple(rng.choice(p.values) for p in space.parameters) for _ in range(100_000)}
    assert [c for c in sample if valid(c)] == [c for c in sample if c in found]


SHAPES = [(1, 1), (1, 3), (5, 3), (3, 64), (1, 1000), (7, 1025), (33, 50257), (1, 131072), (4096, 8192),
          (2, 1048576)]


@functools.lru_cache(maxsize=1)  # a problem's points are many: the cases of one shape run one after another
def _checked_valid_points(values: tuple[tuple[str, object], ...]) -> tuple[list[dict], set[tuple]]:
    """The valid points of one problem's values, each checked (no violations, values the space's
    own, no duplicates), and their keys. float16 and bfloat16 rows give the space the same values,
    so a process checks those points once (their cases share an xdist group)."""
    space = space_of(SOFTMAX)
    problem = dict(values)
    valid = space.valid_points(problem)
    assert valid
    keys = set()
    for params in valid:
        assert space.violations(params, problem) == []
        assert space.check_values(params) == params
        keys.add(tuple(params[n] for n in space.names))
    assert len(keys) == len(valid), "no duplicates"
    return valid, keys


@pytest.mark.xdist_group("real_space")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_real_space_valid_points_have_no_violations_and_sampled_invalid_points_do(shape, dtype):
    space = space_of(SOFTMAX)
    problem = Problem("softmax", dtype, shape)
    target = Target.for_arch("90")
    values = SOFTMAX.problem_values(problem, target)
    valid, keys = _checked_valid_points(tuple(sorted(values.items())))
    assert SOFTMAX.default_params(problem, target) in valid
    rng = random.Random(shape[0] * 1_000_003 + shape[1] * 7 + len(dtype))
    invalid_seen = 0
    for _ in range(400):
        combo = tuple(rng.choice(p.values) for p in space.parameters)
        params = dict(zip(space.names, combo))
        if combo in keys:
            assert space.violations(params, values) == []
        else:
            invalid_seen += 1
            assert space.violations(params, values), f"{params} is missing from valid_points but breaks nothing"
    assert invalid_seen > 100  # most of the product is invalid


def test_smem_limit_of_the_target_changes_the_valid_set():
    space = space_of(SOFTMAX)
    problem = Problem("softmax", "float32", (64, 16384))
    big = space.valid_points(SOFTMAX.problem_values(problem, Target.for_arch("90")))
    small = space.valid_points(SOFTMAX.problem_values(problem, Target("90", smem_optin=99 * 1024)))
    small_keys = {tuple(p.values()) for p in small}
    assert small_keys < {tuple(p.values()) for p in big}
    assert all(p["storage"] == "smem" for p in big if tuple(p.values()) not in small_keys)


@pytest.mark.parametrize("n, dtype, extra", [(32768, "float16", 0), (4000, "float32", 0), (50257, "float16", 128),
                                             (4000, "float16", 128), (4001, "float32", 128)])
def test_a_staged_slot_has_a_spare_line_when_rows_do_not_start_line_aligned(n, dtype, extra):
    """The body of a row that starts mid-line is placed from the start of its 128-byte line
    (Segment in the template), so its shared-memory slot holds one line more."""
    space = space_of(SOFTMAX)
    problem = Problem("softmax", dtype, (64, n))
    params = {**SOFTMAX.default_params(problem, Target.for_arch("90")), "storage": "smem", "threads": 256,
              "row_threads": 256, "vec": 16 // (4 if dtype == "float32" else 2), "unroll": 1, "split": 1,
              "persistent": False, "prefetch": False, "chunks": 1, "normalise": "three_pass"}
    values = space.evaluate(space.check_values(params), SOFTMAX.problem_values(problem, Target.for_arch("90")))
    itemsize = 4 if dtype == "float32" else 2
    assert values["smem_bytes"] == -(-n // 8) * 8 * itemsize + extra
