"""The GPU tier's helper pairwise_cover, on the CPU: it picks the variants the "covering" tests
verify (every pair of parameter values held by some point is held by a chosen one, with far fewer
points)."""
from __future__ import annotations

import itertools

from autosoft.families import get_family
from autosoft.families.base import Target, space_of
from helpers import pairwise_cover


def _pairs(point: dict) -> set:
    items = sorted((name, repr(value)) for name, value in point.items())
    return set(itertools.combinations(items, 2))


def test_a_covering_of_the_attention_tail_problem_holds_every_pair_in_few_points():
    family = get_family("attention")
    target = Target.for_arch("90")
    problem = family.problem("1,2,555,64", "bfloat16", ("causal",))  # as tests/test_gpu_attention.py
    valid = space_of(family).valid_points(family.problem_values(problem, target))
    default = family.default_params(problem, target)
    chosen = pairwise_cover(valid, first=[default])
    assert chosen[0] == default
    assert all(p in valid for p in chosen)
    wanted = set().union(*map(_pairs, valid))
    held = set().union(*map(_pairs, chosen))
    assert wanted <= held, sorted(wanted - held)[:5]
    assert len(chosen) * 20 < len(valid), (len(chosen), len(valid))
    assert pairwise_cover(valid, first=[default]) == chosen, "the same points on every run"


def test_greedy_covers_three_binary_parameters_in_four_points():
    """Of the 8 points of {0,1}^3, four hold all twelve pairs (and no three can); greedy, the
    earliest on a tie, finds 000, 011, 101, 110."""
    points = [dict(a=a, b=b, c=c) for a, b, c in itertools.product((0, 1), repeat=3)]
    chosen = pairwise_cover(points)
    assert [(p["a"], p["b"], p["c"]) for p in chosen] == [(0, 0, 0), (0, 1, 1), (1, 0, 1), (1, 1, 0)]


def test_pairs_held_by_the_first_points_are_not_sought_again():
    points = [dict(a=a, b=b) for a, b in itertools.product((0, 1), repeat=2)]
    assert pairwise_cover(points, first=points[::-1]) == points[::-1]
    assert pairwise_cover(points, first=[dict(a=1, b=1)]) == [dict(a=1, b=1), *points[:3]]
    assert len(pairwise_cover([dict(a=True, b=0), dict(a=1, b=0)])) == 2, "True and 1 are two values"
