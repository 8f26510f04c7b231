"""Serving shapes nobody tuned: a few configurations and a small decision tree over the shape.

A selector is fitted per family on one GPU from what was tuned there (autosoft/generalize.py):
a handful of configurations that together come close to the best on every tuned shape (chosen
greedily, the one within reach of the best on the most shapes first, as Helion's ahead-of-time
mode chooses its configurations), each timed on every tuned shape, and a decision tree (CART,
depth at most four) over the shape's features whose leaves rank the configurations. Dispatch
asks it for a shape with no exact entry (dispatch.py) and verifies its pick like a borrowed one.

Everything here is plain values and arithmetic: no GPU, no file. The tree is deterministic: the
same samples give the same tree, ties going to the earlier feature, threshold and configuration.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

from .space import ParamValue

MAX_DEPTH = 4
# the cover stops once every tuned shape has a configuration within WITHIN of its best; this only
# bounds it (a float32 and a 16-bit row of one length need different vector widths, so a family's
# dtypes together need more configurations than one dtype's)
MAX_CONFIGS = 16
WITHIN = 0.05  # a configuration covers a shape when it is at most this much slower than its best there
# what a configuration that cannot serve a shape (invalid there, or failed) costs in a leaf: as if it
# were this many times slower than the best, so a leaf never ranks it first where another serves
MISSING_RATIO = 16.0


# --- features ------------------------------------------------------------------------------------

# --- the tree ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Leaf:
    ranking: tuple[int, ...]  # configuration indices, the one to try first first


@dataclass(frozen=True)
class Split:
    feature: str
    threshold: float  # a shape with feature <= threshold goes below, else above
    below: "Node"
    above: "Node"


Node = Union[Leaf, Split]


@dataclass(frozen=True)
class Sample:
    """One tuned shape: its features and each configuration's time there (None: cannot serve it)."""
    label: str
    features: Mapping[str, float]
    times: tuple[float | None, ...]


def _costs(samples: Sequence[Sample], n_configs: int) -> list[float]:
    """Per configuration: the sum over the samples of log(its time / the sample's best)."""
    out = [0.0] * n_configs
    for s in samples:
        best = min((t for t in s.times if t is not None), default=None)
        for c in range(n_configs):
            t = s.times[c]
            out[c] += math.log(MISSING_RATIO) if t is None or best is None else math.log(t / best)
    return out


def _leaf(samples: Sequence[Sample], n_configs: int) -> tuple[Leaf, float]:
    costs = _costs(samples, n_configs)
    ranking = tuple(sorted(range(n_configs), key=lambda c: (costs[c], c)))
    return Leaf(ranking), costs[ranking[0]]


def _threshold(a: float, b: float) -> float:
    """Between two neighbouring values: the geometric mean for sizes, so that a split generalises
    in ratios (rows 1000 and 4000 split at 2000), the arithmetic one otherwise (a flag's 0 and 1)."""
    return math.sqrt(a * b) if a > 0 and b > 0 else (a + b) / 2


def fit_tree(samples: Sequence[Sample], features: Sequence[str], n_configs: int,
             max_depth: int = MAX_DEPTH) -> Node:
    """A CART over the features: each node takes the split (feature, threshold between two
    neighbouring values) that lowers the summed cost of its two leaves most, where a leaf's cost
    is that of the configuration best for all its samples together (the sum of log time ratios to
    each sample's best); no split that lowers nothing, none below depth `max_depth`."""
    if not samples:
        raise ValueError("a tree needs at least one sample")
    leaf, cost = _leaf(samples, n_configs)
    if max_depth <= 0 or cost <= 1e-12:
        return leaf
    best: tuple[float, str, float] | None = None
    for name in features:
        values = sorted({s.features[name] for s in samples})
        for a, b in zip(values, values[1:]):
            threshold = _threshold(a, b)
            below = [s for s in samples if s.features[name] <= threshold]
            above = [s for s in samples if s.features[name] > threshold]
            total = _leaf(below, n_configs)[1] + _leaf(above, n_configs)[1]
            if total < cost - 1e-9 and (best is None or total < best[0] - 1e-12):
                best = (total, name, threshold)
    if best is None:
        return leaf
    _, name, threshold = best
    return Split(name, threshold,
                 fit_tree([s for s in samples if s.features[name] <= threshold], features, n_configs, max_depth - 1),
                 fit_tree([s for s in samples if s.features[name] > threshold], features, n_configs, max_depth - 1))


def predict(node: Node, features: Mapping[str, float]) -> tuple[int, ...]:
    """The leaf's ranking for a shape's features (a feature it lacks counts as 0)."""
    while isinstance(node, Split):
        node = node.below if features.get(node.feature, 0.0) <= node.threshold else node.above
    return node.ranking


def depth(node: Node) -> int:
    return 0 if isinstance(node, Leaf) else 1 + max(depth(node.below), depth(node.above))


def tree_text(node: Node, indent: str = "") -> str:
    """The tree as nested if/else lines, configurations by index (for `autosoft list` and docs)."""
    if isinstance(node, Leaf):
        return f"{indent}config {node.ranking[0]}\n"
    return (f"{indent}if {node.feature} <= {node.threshold:.6g}:\n" + tree_text(node.below, indent + "    ")
            + f"{indent}else:\n" + tree_text(node.above, indent + "    "))


def node_to_json(node: Node) -> Any:
    if isinstance(node, Leaf):
        return {"ranking": list(node.ranking)}
    return {"feature": node.feature, "threshold": node.threshold,
            "below": node_to_json(node.below), "above": node_to_json(node.above)}


def node_from_json(data: Any, n_configs: int, level: int = 0) -> Node:
    """A tree from its JSON form; ValueError for anything malformed (a tampered cache row)."""
    if level > 32 or not isinstance(data, dict):
        raise ValueError("tree node is not a mapping")
    if "ranking" in data:
        ranking = data["ranking"]
        if not isinstance(ranking, list) or not ranking or \
                not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_configs for i in ranking):
            raise ValueError("leaf ranking is not a list of configuration indices")
        return Leaf(tuple(ranking))
    feature, threshold = data.get("feature"), data.get("threshold")
    if not isinstance(feature, str) or isinstance(threshold, bool) or not isinstance(threshold, (int, float)) \
            or not math.isfinite(threshold):
        raise ValueError("split has no feature name or finite threshold")
    return Split(feature, float(threshold), node_from_json(data.get("below"), n_configs, level + 1),
                 node_from_json(data.get("above"), n_configs, level + 1))


# --- choosing the configurations -----------------------------------------------------------------

def params_key(params: Mapping[str, Any]) -> str:
    """A configuration as text (sorted JSON): how configurations are compared and deduplicated."""
    return json.dumps(dict(params), sort_keys=True)


def choose_configs(times: Mapping[str, Mapping[str, float]], max_configs: int = MAX_CONFIGS,
                   within: float = WITHIN) -> list[str]:
    """Greedy cover of the shapes: `times` maps each shape to the times measured there per
    configuration (params_key -> us; a configuration not measured on a shape is absent). First
    the configuration within `within` of the best on the most shapes not yet covered, then the
    next on those left, until every shape is covered or `max_configs` are chosen. Ties: the one
    covering more shapes in all, then the lower geometric-mean ratio to the best over the shapes
    it was measured on, then the key (so the choice is deterministic)."""
    best = {shape: min(row.values()) for shape, row in times.items() if row}
    covers: dict[str, set[str]] = {}
    ratios: dict[str, list[float]] = {}
    for shape, row in times.items():
        for key, t in row.items():
            ratios.setdefault(key, []).append(math.log(t / best[shape]))
            if t <= (1 + within) * best[shape]:
                covers.setdefault(key, set()).add(shape)
    left = set(best)
    chosen: list[str] = []
    while left and len(chosen) < max_configs:
        ranked = sorted((k for k in covers if k not in chosen and covers[k] & left),
                        key=lambda k: (-len(covers[k] & left), -len(covers[k]),
                                       sum(ratios[k]) / len(ratios[k]), k))
        if not ranked:
            break
        chosen.append(ranked[0])
        left -= covers[ranked[0]]
    return chosen


# --- the selector --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Selector:
    """A fitted selector, as the cache stores it: where it was fitted (a selector serves only the
    GPU, NVRTC major version and template and search-space digests it was fitted with), its
    configurations, the features it splits on, its tree and the shapes it was fitted on."""
    family: str
    gpu_name: str
    compute_capability: str
    cuda_version: str  # the NVRTC that timed it; serves its whole major version
    template_digest: str
    space_digest: str
    configs: tuple[Mapping[str, ParamValue], ...]
    features: tuple[str, ...]
    tree: Node
    shapes: tuple[str, ...]  # "dtype shape" of each fitted shape
    autosoft_version: str
    created: float

    @property
    def cuda_major(self) -> str:
        return self.cuda_version.split(".")[0]

    @property
    def depth(self) -> int:
        return depth(self.tree)

    def ranking(self, features: Mapping[str, float]) -> tuple[int, ...]:
        return predict(self.tree, features)

    def summary(self) -> str:
        """One line: what `autosoft list` and `autosoft report` show per selector."""
        return (f"selector {self.family} on {self.gpu_name} (sm_{self.compute_capability}, NVRTC "
                f"{self.cuda_major}.x): {len(self.configs)} configurations, {len(self.shapes)} shapes fitted, "
                f"tree depth {self.depth}")
