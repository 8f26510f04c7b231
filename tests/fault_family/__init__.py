"""A test-only kernel family whose search space holds a fault, a hang, a syntax error, a wrong
result and good variants: the tuner must survive all of them and pick a good one."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from autosoft.errors import UserError
from autosoft.families.base import Family, Launch, Problem, Target

HERE = Path(__file__).resolve().parent


class FaultyFamily(Family):
    """y = 2x, with variants that fault, hang, fail to compile or compute the wrong thing."""
    name = "faulty"
    template = "faulty.cu.j2"
    template_root = HERE
    space_file = HERE / "faulty.yaml"
    inputs = ("x",)
    outputs = ("y",)
    input_kinds = ("normal",)
    dtypes = ("float32",)
    shape_help = "N: an element count, e.g. 4096"
    examples = (("1", "float32", {}), ("4096", "float32", {}), ("100001", "float32", {}))

    def parse_shape(self, text: str) -> tuple[int]:
        if not str(text).isdigit() or int(text) < 1:
            raise UserError(f"faulty wants a positive element count, got {text!r}")
        return (int(text),)

    def check_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(shape) != 1 or shape[0] < 1:
            raise UserError(f"faulty wants one positive element count, got {shape}")
        return tuple(int(s) for s in shape)

    def problem_values(self, problem: Problem, target: Target) -> dict[str, Any]:
        return {"n": problem.shape[0]}

    def variant_name(self, problem: Problem, params: Mapping[str, Any]) -> str:
        return f"faulty_{params['behaviour']}_t{params['threads']}"

    def template_args(self, problem: Problem, values: Mapping[str, Any]) -> dict[str, Any]:
        return dict(values)

    def launches(self, problem: Problem, values: Mapping[str, Any], target: Target):
        n, threads = problem.shape[0], values["threads"]
        return (Launch("faulty", (-(-n // threads), 1, 1), (threads, 1, 1), 0, ("x", "y", np.int64(n))),), 0

    def default_params(self, problem: Problem, target: Target) -> dict[str, Any]:
        return {"behaviour": "good", "threads": 128}

    def seed_params(self, problem: Problem, target: Target) -> list[dict[str, Any]]:
        return []

    def bytes_moved(self, problem: Problem) -> int:
        return 8 * problem.shape[0]

    def flops(self, problem: Problem) -> float:
        return float(problem.shape[0])

    def output_specs(self, problem: Problem):
        return {"y": (problem.shape, "float32")}

    def caller_outputs(self, shapes, dtype, options):
        return {"y": (tuple(shapes["x"]), "float32")}

    def make_inputs(self, problem: Problem, kind: str, xp: Any, rng: Any) -> dict[str, Any]:
        return {"x": rng.standard_normal(problem.shape, dtype=np.float32)}

    def check(self, problem: Problem, inputs: Mapping[str, Any], outputs: Mapping[str, Any], xp: Any) -> str | None:
        bad = int((~(xp.abs(outputs["y"] - 2 * inputs["x"]) <= 1e-6)).sum())
        return f"{bad} elements differ from 2x" if bad else None


FAULTY = FaultyFamily()
