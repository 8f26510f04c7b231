"""Search spaces: load and validate search_spaces/<family>.yaml, check a variant's constraints.

A search space is data: parameters with their allowed values, derived quantities and
constraints written as small expressions over the parameters and the problem (N, itemsize,
the device's shared-memory limit...). Expressions are parsed once and only a whitelist of
syntax is accepted (names, literals, arithmetic, comparisons, boolean logic, `a if c else b`
and a few pure functions), so a YAML file can never run arbitrary Python.
"""
from __future__ import annotations

import ast
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from types import CodeType
from typing import Any, Mapping

import yaml

from .errors import UserError
from .resources import search_space_path

ParamValue = int | float | str | bool
# libyaml's safe loader where PyYAML was built with it: the same documents, ten times faster to
# parse, and a search space is parsed on the first call of every process
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

_FUNCTIONS = {
    "ceil_div": lambda a, b: -(-a // b),
    "round_up": lambda a, b: -(-a // b) * b,
    "min": min,
    "max": max,
    "log2": lambda a: int(math.log2(a)),
    "is_pow2": lambda a: a > 0 and (a & (a - 1)) == 0,
}

_ALLOWED_NODES = (
    ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub,
    ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod,  # no ** : 2**2**40 would never end
    ast.Compare, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.In, ast.NotIn,
    ast.IfExp, ast.Call, ast.Name, ast.Load, ast.Constant, ast.Tuple, ast.List,
)


@dataclass(frozen=True)
class Expression:
    text: str
    code: CodeType
    names: frozenset[str]

    def evaluate(self, names: Mapping[str, Any]) -> Any:
        try:
            return eval(self.code, {"__builtins__": {}}, {**_FUNCTIONS, **names})  # noqa: S307 - whitelisted AST
        except NameError as exc:
            raise UserError(f"search space expression {self.text!r}: {exc}") from None


def compile_expression(text: str, where: str) -> Expression:
    """Parse `text` and refuse any syntax outside the whitelist."""
    try:
        tree = ast.parse(str(text), mode="eval")
    except SyntaxError as exc:
        raise UserError(f"{where}: cannot parse expression {text!r}: {exc.msg}") from None
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            raise UserError(f"{where}: {type(node).__name__} is not allowed in expression {text!r}")
        if isinstance(node, ast.Call) and not (
            isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS and not node.keywords
        ):
            raise UserError(f"{where}: only {sorted(_FUNCTIONS)} may be called in {text!r}")
    names = frozenset(n.id for n in ast.walk(tree) if isinstance(n, ast.Name)) - frozenset(_FUNCTIONS)
    return Expression(str(text), compile(tree, where, "eval"), names)


@dataclass(frozen=True)
class Parameter:
    """A tuned choice. `since`: for a parameter added after points were stored without it (tuned
    cache entries), the value those points had, which check_values gives them; None: required."""
    name: str
    values: tuple[ParamValue, ...]
    doc: str
    since: ParamValue | None = None


@dataclass(frozen=True)
class Constraint:
    expression: Expression
    why: str


@dataclass(frozen=True)
class SearchSpace:
    family: str
    parameters: tuple[Parameter, ...]
    derived: tuple[tuple[str, Expression], ...]
    constraints: tuple[Constraint, ...]
    digest: str

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.parameters)

    def parameter(self, name: str) -> Parameter:
        for p in self.parameters:
            if p.name == name:
                return p
        raise UserError(f"unknown parameter {name!r} for {self.family}; known: {', '.join(self.names)}")

    def check_values(self, params: Mapping[str, Any]) -> dict[str, ParamValue]:
        """Return params if every name is known and every value is one of its domain, else raise.

        This is the gate between untrusted input (cache files, --param) and a template: only
        values that compare equal to a declared value pass, and the declared value is returned,
        so no foreign object or text ever reaches the renderer.
        """
        older = {p.name: p.since for p in self.parameters if p.name not in params and p.since is not None}
        params = {**params, **older}
        missing = [n for n in self.names if n not in params]
        if missing:
            raise UserError(f"{self.family}: missing parameter(s) {', '.join(missing)}")
        checked: dict[str, ParamValue] = {}
        for name, value in params.items():
            param = self.parameter(name)
            match = [v for v in param.values if type(v) is type(value) and v == value]
            if not match:
                allowed = ", ".join(map(str, param.values))
                raise UserError(f"{self.family}: {name}={value!r} is not allowed; choose one of {allowed}")
            checked[name] = match[0]
        return {n: checked[n] for n in self.names}

    def evaluate(self, params: Mapping[str, ParamValue], problem: Mapping[str, Any]) -> dict[str, Any]:
        """Parameters, problem values and derived quantities together, in declaration order."""
        names: dict[str, Any] = {**problem, **params}
        for name, expr in self.derived:
            names[name] = expr.evaluate(names)
        return names

    def violations(self, params: Mapping[str, ParamValue], problem: Mapping[str, Any]) -> list[str]:
        """The reasons a (value-checked) variant is invalid for this problem; empty when valid."""
        names = self.evaluate(params, problem)
        return [c.why for c in self.constraints if not c.expression.evaluate(names)]

    def problem_violations(self, problem: Mapping[str, Any]) -> list[str]:
        """The reasons no point can be valid for this problem: the constraints on problem values
        alone (through derived names that use no parameter) that fail."""
        depends = self._parameter_dependencies()
        names: dict[str, Any] = dict(problem)
        for name, expr in self.derived:
            if not depends(expr):
                names[name] = expr.evaluate(names)
        return [c.why for c in self.constraints if not depends(c.expression) and not c.expression.evaluate(names)]

    def valid_points(self, problem: Mapping[str, Any]) -> list[dict[str, ParamValue]]:
        """Every valid variant for a problem, by depth-first search over the parameters in
        declaration order, checking each constraint as soon as the parameters it uses are set."""
        params = self.names
        depends = self._parameter_dependencies()
        position = {n: i for i, n in enumerate(params)}
        # constraints and derived names become checkable at the depth of their last parameter
        ready_at = lambda deps: max((position[d] for d in deps), default=-1)  # noqa: E731
        constraints_at: list[list[Expression]] = [[] for _ in params]
        derived_at: list[list[tuple[str, Expression]]] = [[] for _ in params]
        for c in self.constraints:
            constraints_at[max(0, ready_at(depends(c.expression)))].append(c.expression)
        for name, expr in self.derived:
            derived_at[max(0, ready_at(depends(expr)))].append((name, expr))
        found: list[dict[str, ParamValue]] = []

        def visit(depth: int, names: dict[str, Any]) -> None:
            if depth == len(params):
                found.append({n: names[n] for n in params})
                return
            for value in self.parameters[depth].values:
                scope = {**names, params[depth]: value}
                for name, expr in derived_at[depth]:
                    scope[name] = expr.evaluate(scope)
                if all(expr.evaluate(scope) for expr in constraints_at[depth]):
                    visit(depth + 1, scope)

        visit(0, dict(problem))
        return found

    def _parameter_dependencies(self):
        """A function: expression -> the parameter names it depends on, through derived names."""
        derived = dict(self.derived)
        params = set(self.names)
        memo: dict[str, frozenset[str]] = {}

        def of_name(name: str) -> frozenset[str]:
            if name in params:
                return frozenset([name])
            if name not in derived:
                return frozenset()  # a problem value
            if name not in memo:
                memo[name] = frozenset().union(*(of_name(n) for n in derived[name].names))
            return memo[name]

        return lambda expr: frozenset().union(*(of_name(n) for n in expr.names))

    def parse_value(self, name: str, text: str) -> ParamValue:
        """Turn a command-line string into the declared value it names."""
        for v in self.parameter(name).values:
            if str(v).lower() == text.strip().lower():
                return v
        allowed = ", ".join(map(str, self.parameter(name).values))
        raise UserError(f"{self.family}: {name}={text!r} is not allowed; choose one of {allowed}")


@dataclass(frozen=True)
class EngineSpaces:
    """The search space of a family with several kernels (engines): each engine's own space. A
    point names its engine as params["engine"] and holds that engine's parameters only, so no
    constraint of one engine ever names another, and two engines may declare one name with
    different values. Offers what callers use of a SearchSpace (check_values, evaluate,
    violations, valid_points, names, parameters, digest) for such points."""
    family: str
    spaces: tuple[tuple[str, SearchSpace], ...]

    @property
    def engines(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.spaces)

    @property
    def digest(self) -> str:
        return hashlib.sha256("\0".join(f"{n}\0{s.digest}" for n, s in self.spaces).encode()).hexdigest()

    @property
    def names(self) -> tuple[str, ...]:
        """"engine", then every engine's parameter names, each once."""
        return tuple(dict.fromkeys(["engine", *(n for _, s in self.spaces for n in s.names)]))

    @property
    def parameters(self) -> tuple[Parameter, ...]:
        """The engine, then each engine's parameters, their doc saying whose they are."""
        return (self.parameter("engine"),) + tuple(
            Parameter(p.name, p.values, f"({engine}) {p.doc}".strip(), p.since)
            for engine, s in self.spaces for p in s.parameters)

    @property
    def constraints(self) -> tuple[Constraint, ...]:
        """Every engine's constraints (each holds for its engine's points only)."""
        return tuple(c for _, s in self.spaces for c in s.constraints)

    def parameter(self, name: str) -> Parameter:
        if name == "engine":
            return Parameter("engine", self.engines, "the kernel: " + ", ".join(self.engines))
        for _, space in self.spaces:
            if name in space.names:
                return space.parameter(name)
        raise UserError(f"unknown parameter {name!r} for {self.family}; known: {', '.join(self.names)}")

    def engine(self, value: Any) -> str:
        """The declared engine name equal to `value`; UserError naming the engines otherwise."""
        for name in self.engines:
            if type(value) is str and name == value:
                return name
        raise UserError(f"{self.family}: engine={value!r} is not allowed; choose one of {', '.join(self.engines)}")

    def space(self, engine: Any) -> SearchSpace:
        """The space of the engine named `engine`."""
        return dict(self.spaces)[self.engine(engine)]

    def owners(self, name: str) -> tuple[str, ...]:
        """The engines that declare parameter `name`."""
        return tuple(engine for engine, space in self.spaces if name in space.names)

    def split(self, params: Mapping[str, Any]) -> tuple[str, SearchSpace, dict[str, Any]]:
        """(engine, its space, the params without "engine"); UserError when no engine is named."""
        if "engine" not in params:
            raise UserError(f"{self.family}: missing parameter engine (one of {', '.join(self.engines)})")
        engine = self.engine(params["engine"])
        return engine, self.space(engine), {n: v for n, v in params.items() if n != "engine"}

    def check_values(self, params: Mapping[str, Any]) -> dict[str, ParamValue]:
        """The engine's checked point (its own parameters, and "engine"), as SearchSpace.check_values.
        A parameter only other engines declare is dropped: it never reaches this engine's template,
        and points stored when every point held every engine's parameters still build."""
        engine, space, rest = self.split(params)
        unknown = [n for n in rest if not self.owners(n)]
        if unknown:
            space.parameter(unknown[0])  # raises, naming the known ones
        return {"engine": engine, **space.check_values({n: v for n, v in rest.items() if n in space.names})}

    def evaluate(self, params: Mapping[str, ParamValue], problem: Mapping[str, Any]) -> dict[str, Any]:
        """The engine's values, with "engine" (its name) among them."""
        engine, space, own = self.split(params)
        return {**space.evaluate({n: v for n, v in own.items() if n in space.names}, problem), "engine": engine}

    def violations(self, params: Mapping[str, ParamValue], problem: Mapping[str, Any]) -> list[str]:
        _, space, own = self.split(params)
        return space.violations({n: v for n, v in own.items() if n in space.names}, problem)

    def valid_points(self, problem: Mapping[str, Any]) -> list[dict[str, ParamValue]]:
        """Every engine's valid points, engine by engine."""
        return [{"engine": engine, **p} for engine, space in self.spaces for p in space.valid_points(problem)]

    def parse_value(self, name: str, text: str, engine: str | None = None) -> ParamValue:
        """A command-line string as the declared value it names, of `engine`'s parameter (of the
        engines' choice for name "engine")."""
        if name == "engine":
            for e in self.engines:
                if e == text.strip().lower():
                    return e
            raise UserError(f"{self.family}: engine={text!r} is not allowed; choose one of {', '.join(self.engines)}")
        return self.space(engine if engine is not None else self.owners(name)[0] if self.owners(name)
                          else self.engines[0]).parse_value(name, text)


def _read_yaml(text: str, where: str) -> dict:
    try:
        data = yaml.load(text, Loader=_YAML_LOADER)
    except yaml.YAMLError as exc:
        raise UserError(f"{where}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"{where}: needs a 'family' and a 'parameters' mapping")
    return data


def _parameters(data: dict, where: str) -> list[Parameter]:
    params = []
    for name, spec in (data.get("parameters") or {}).items():
        if not isinstance(spec, dict) or not isinstance(spec.get("values"), list) or not spec["values"]:
            raise UserError(f"{where}: parameter {name!r} needs a non-empty 'values' list")
        for v in spec["values"]:
            if not isinstance(v, (int, float, str, bool)):
                raise UserError(f"{where}: parameter {name!r} has a value of unsupported type: {v!r}")
            if isinstance(v, str) and not v.isidentifier():
                raise UserError(f"{where}: parameter {name!r} value {v!r} must be an identifier")
        since = spec.get("since")
        if since is not None and not any(type(since) is type(v) and since == v for v in spec["values"]):
            raise UserError(f"{where}: parameter {name!r}: since={since!r} is not one of its values")
        params.append(Parameter(str(name), tuple(spec["values"]), str(spec.get("doc", "")), since))
    return params


def _build(data: dict, where: str, bases: tuple[SearchSpace, ...], digest: str) -> SearchSpace:
    """The space a file describes on top of the spaces it extends (none for a plain file):
    theirs, then its own parameters (a name a base declares takes the new values, and the
    base's doc where it gives none), `fixed` (a base's parameters held at one value: constants of
    the expressions, absent from the points), derived names (a name a base derives is replaced)
    and constraints (added to the bases')."""
    if not bases and not isinstance(data.get("parameters"), dict):
        raise UserError(f"{where}: needs a 'family' and a 'parameters' mapping")
    params: dict[str, Parameter] = {}
    derived: dict[str, Expression] = {}
    constraints: list[Constraint] = []
    for base in bases:
        params.update({p.name: p for p in base.parameters})
        derived.update(dict(base.derived))
        constraints += base.constraints
    for p in _parameters(data, where):
        params[p.name] = Parameter(p.name, p.values, p.doc or (params[p.name].doc if p.name in params else ""), p.since)
    fixed = data.get("fixed") or {}
    if not isinstance(fixed, dict):
        raise UserError(f"{where}: 'fixed' must map parameters to one value each")
    constants: dict[str, Expression] = {}
    for name, value in fixed.items():
        if name not in params or value not in params[name].values:
            raise UserError(f"{where}: fixed {name}={value!r} is not a value of a parameter it extends")
        del params[name]
        constants[str(name)] = compile_expression(repr(value), f"{where}: fixed {name}")
    derived = {**constants, **derived}
    for name, expr in (data.get("derived") or {}).items():
        derived[str(name)] = compile_expression(expr, f"{where}: derived {name}")
    for i, item in enumerate(data.get("constraints") or []):
        if not isinstance(item, dict) or "require" not in item:
            raise UserError(f"{where}: constraint {i} needs 'require' (and 'why')")
        expr = compile_expression(item["require"], f"{where}: constraint {i}")
        constraints.append(Constraint(expr, str(item.get("why", item["require"]))))
    return SearchSpace(str(data.get("family", "")), tuple(params.values()), _in_dependency_order(derived, where),
                       tuple(constraints), digest)


def _in_dependency_order(derived: Mapping[str, Expression], where: str) -> tuple[tuple[str, Expression], ...]:
    """The derived names, each after the derived names it uses (declaration order otherwise):
    a file that extends others may derive a name that theirs use."""
    ordered: dict[str, Expression] = {}
    visiting: set[str] = set()

    def place(name: str) -> None:
        if name in ordered:
            return
        if name in visiting:
            raise UserError(f"{where}: derived {name!r} depends on itself")
        visiting.add(name)
        for used in sorted(derived[name].names & derived.keys()):
            place(used)
        ordered[name] = derived[name]

    for name in derived:
        place(name)
    return tuple(ordered.items())


def parse_space(text: str, where: str) -> SearchSpace:
    """A space from one file's text (no `extends`: load_space reads the files it names)."""
    data = _read_yaml(text, where)
    if data.get("extends"):
        raise UserError(f"{where}: 'extends' needs the file's folder; load it with load_space")
    return _build(data, where, (), hashlib.sha256(text.encode()).hexdigest())


def load_space(family: str, path: Path | None = None) -> SearchSpace:
    """The space of search_spaces/<family>.yaml (or `path`), with the files it `extends` (names
    relative to its folder, a name or a list, later ones on top of earlier ones). Its digest
    covers every file read."""
    return _load(path or search_space_path(family), ())


def _load(path: Path, seen: tuple[Path, ...]) -> SearchSpace:
    where = str(path)
    if path.resolve() in seen:
        raise UserError(f"{where}: extends itself")
    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"search space {where}: {exc.strerror or exc}") from None
    data = _read_yaml(text, where)
    names = data.get("extends") or []
    names = [names] if isinstance(names, str) else names
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise UserError(f"{where}: 'extends' must name a file or list files")
    bases = tuple(_load(path.parent / name, (*seen, path.resolve())) for name in names)
    digest = hashlib.sha256("\0".join([*(b.digest for b in bases), text]).encode()).hexdigest() if bases \
        else hashlib.sha256(text.encode()).hexdigest()
    return _build(data, where, bases, digest)
