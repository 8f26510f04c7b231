"""families/__init__.py and base.py: the registry (built-ins by module, plug-ins by entry point),
problem options in the contract, and what a family shares through the base class."""
from __future__ import annotations

import math
from importlib.metadata import EntryPoint

import pytest

import autosoft.families as registry
from autosoft.errors import UserError
from autosoft.families.base import Family, Problem, ProblemOption
from fault_family import FAULTY


@pytest.fixture
def plug_ins(monkeypatch):
    """Entry points of our choosing, read afresh; the registry as it was afterwards."""
    saved = dict(registry._registry)
    points: list[EntryPoint] = []
    monkeypatch.setattr(registry, "entry_points", lambda group: [p for p in points if p.group == group])
    monkeypatch.setattr(registry, "_plugged_in", False)
    yield points
    registry._registry.clear()
    registry._registry.update(saved)


def test_built_in_families_register_themselves():
    assert {"softmax", "attention"} <= set(registry.families())
    assert registry.get_family("softmax").name == "softmax"
    with pytest.raises(UserError, match="unknown family 'nope'.*softmax"):
        registry.get_family("nope")


def test_a_plug_in_family_comes_in_through_the_entry_point_group(plug_ins):
    plug_ins.append(EntryPoint("faulty", "fault_family:FAULTY", registry.ENTRY_POINT_GROUP))
    assert registry.get_family("faulty") is FAULTY  # not built in: the entry points are read
    assert "faulty" in registry.families()


def test_a_broken_plug_in_is_skipped_with_a_warning(plug_ins):
    plug_ins.append(EntryPoint("broken", "no_such_module_here:FAMILY", registry.ENTRY_POINT_GROUP))
    with pytest.warns(RuntimeWarning, match="'broken'.*not loaded"):
        names = registry.families()
    assert "softmax" in names and "broken" not in names


def test_two_different_families_cannot_share_a_name(plug_ins):
    class Impostor(type(FAULTY)):
        pass

    registry.register(FAULTY)
    assert registry.register(FAULTY) is FAULTY  # the same family again is fine
    with pytest.raises(ValueError, match="two families are named 'faulty'"):
        registry.register(Impostor())
    with pytest.raises(TypeError):
        registry.register(object())


def test_a_family_must_implement_the_contract():
    class Half(Family):
        name = "half"

    with pytest.raises(TypeError, match="abstract"):
        Half()


class _WithOptions(type(FAULTY)):
    name = "with_options"
    options = (ProblemOption("causal", "a flag"),
               ProblemOption("split", "a position", kind="int", required=True),
               ProblemOption("cap", "a number", kind="float"))


def test_problem_options_are_checked_typed_sorted_and_written_into_the_key():
    family = _WithOptions()
    problem = family.problem("100", "float32", {"split": 7, "causal": True})
    assert problem.options == (("causal", True), ("split", 7))
    assert problem.shape_text == "100+causal+split=7"
    assert family.parse_problem(problem.shape_text, "float32") == problem
    assert family.problem("100", None, {"split": 7, "cap": 2.5}).shape_text == "100+cap=2.5+split=7"
    assert family.problem("100", None, {"split": 7, "causal": False}).options == (("split", 7),)
    with pytest.raises(UserError, match="needs --split"):
        family.problem("100", "float32", {})
    with pytest.raises(UserError, match="--window.*its options: --causal, --split, --cap"):
        family.problem("100", "float32", {"split": 1, "window": 3})
    with pytest.raises(UserError, match="integer"):
        family.problem("100", "float32", {"split": 1.5})
    with pytest.raises(UserError, match="unknown option 'bogus'"):
        family.parse_problem("100+split=3+bogus", "float32")


def test_distance_is_infinite_across_options_by_default():
    family = _WithOptions()
    a = family.problem("100", None, {"split": 7})
    b = family.problem("400", None, {"split": 7})
    assert family.problem_distance(a, b) == pytest.approx(2.0)
    assert family.problem_distance(a, family.problem("100", None, {"split": 8})) == math.inf
    assert Problem("faulty", "float32", (3,)).flags == ()


@pytest.mark.parametrize("name", ["attention", "attention_backward", "attention_varlen"])
def test_valid_points_leave_out_engines_built_for_another_architecture(name):
    """What a tune may propose on an A100 holds no Hopper-only (wgmma) point, whatever the space's
    constraints say; on sm_90 both engines' points are there."""
    from autosoft.families.base import Target, space_of, valid_points
    from autosoft.tune import valid_points as search_points

    family = registry.get_family(name)
    shape, dtype, options = family.examples[-1]
    problem = family.problem(shape, dtype, options)
    for arch, engines in (("80", {"mma"}), ("90", {"mma", "wgmma"})):
        target = Target.for_arch(arch)
        points = valid_points(family, problem, target)
        assert {p["engine"] for p in points} == engines
        assert search_points(family, problem, target, None) == points
        assert all(family.is_valid(problem, target, p) for p in points[::97])
    everything = space_of(family).valid_points(family.problem_values(problem, Target.for_arch("80")))
    assert search_points(family, problem, Target.for_arch("80"), everything) == valid_points(
        family, problem, Target.for_arch("80")), "a replay's candidates are filtered the same way"
