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
    name: str
    values: tuple[ParamValue, ...]
    doc: str


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


def parse_space(text: str, where: str) -> SearchSpace:
    try:
        data = yaml.load(text, Loader=_YAML_LOADER)
    except yaml.YAMLError as exc:
        raise UserError(f"{where}: not valid YAML: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("parameters"), dict):
        raise UserError(f"{where}: needs a 'family' and a 'parameters' mapping")
    params = []
    for name, spec in data["parameters"].items():
        if not isinstance(spec, dict) or not isinstance(spec.get("values"), list) or not spec["values"]:
            raise UserError(f"{where}: parameter {name!r} needs a non-empty 'values' list")
        for v in spec["values"]:
            if not isinstance(v, (int, float, str, bool)):
                raise UserError(f"{where}: parameter {name!r} has a value of unsupported type: {v!r}")
            if isinstance(v, str) and not v.isidentifier():
                raise UserError(f"{where}: parameter {name!r} value {v!r} must be an identifier")
        params.append(Parameter(str(name), tuple(spec["values"]), str(spec.get("doc", ""))))
    derived = tuple(
        (str(name), compile_expression(expr, f"{where}: derived {name}"))
        for name, expr in (data.get("derived") or {}).items()
    )
    constraints = []
    for i, item in enumerate(data.get("constraints") or []):
        if not isinstance(item, dict) or "require" not in item:
            raise UserError(f"{where}: constraint {i} needs 'require' (and 'why')")
        expr = compile_expression(item["require"], f"{where}: constraint {i}")
        constraints.append(Constraint(expr, str(item.get("why", item["require"]))))
    digest = hashlib.sha256(text.encode()).hexdigest()
    return SearchSpace(str(data.get("family", "")), tuple(params), derived, tuple(constraints), digest)


def load_space(family: str, path: Path | None = None) -> SearchSpace:
    path = path or search_space_path(family)
    return parse_space(path.read_text(), str(path))
