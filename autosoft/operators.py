"""What a family declares to become a torch operator: its schema, how the operator's arguments
become the family's call, and its autograd formula. autosoft.torch_ops registers every declared
operator and names no family; this module imports neither torch nor any family.

A family declares its operators as the class attribute `torch_operators` (a tuple of
TorchOperator), usually set at the bottom of its module, where the functions it names are defined:

    def _along(x, dim):                                  # the operator's arguments -> the family's call
        return OperatorCall((x,), dim=dim)

    def _gradient(ops, saved, grads):                    # dx from the saved output y, and dim
        return ops.softmax_backward(saved["y"], grads[0], saved["dim"], False), None

    SoftmaxFamily.torch_operators = (
        TorchOperator("softmax", "softmax", "(Tensor x, int dim) -> Tensor", _along,
                      backward=Backward(("y", "dim"), _gradient), plan_options={}),
    )

The operator torch.ops.autosoft.<name> then has
- a real implementation (every backend): `call(*arguments)` says what to run (OperatorCall), and
  arrays.call_family runs it, as the family's public function does, naming autosoft.<name> in errors;
- a fake implementation (also the Meta kernel): the same `call`, whose errors need no data, then
  the checks of the array layer that need none, then empty outputs shaped by the family's
  `caller_outputs`: what torch.compile traces with;
- an Autograd kernel: with a `backward`, the declared formula (AOTAutograd traces it into the
  backward graph); without one, inputs that require gradients are refused before anything runs.
The operator returns every output of the family, in the order of `Family.outputs`. A family whose
Python function (`Family.python_call`) has an operator of the family's own name is that operator
while torch.compile traces (api.family_function): the schema's arguments are found by name among
the call's arrays (the family's `inputs`), problem options and run-time scalars.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

OptionValue = bool | int | float  # a problem option's value, as families.base spells it

__all__ = ["Backward", "OperatorCall", "TorchOperator", "declared_operators"]


@dataclass(frozen=True)
class OperatorCall:
    """What one call of an operator runs: the family's arrays (in the order of its inputs), its
    problem options and run-time scalars (as arrays.call_family takes them). dim: the arrays'
    dimension the family works along, for a family that works along the last one (softmax): another
    is moved last (a copy) and the outputs moved back (a view); None: the arrays as they are."""
    arrays: tuple[Any, ...]
    options: Mapping[str, OptionValue] = field(default_factory=dict)
    scalars: Mapping[str, Any] = field(default_factory=dict)
    dim: int | None = None


@dataclass(frozen=True)
class Backward:
    """An operator's autograd formula.

    saves: the names (the schema's arguments, the family's outputs) the formula reads; tensors
    among them are saved for backward, the rest kept as they are. formula(ops, saved, grads):
    `ops` is torch.ops.autosoft (a formula calls other declared operators, such as a family's
    backward kernel, through it), `saved` the saved values by name, `grads` the gradient of each
    output (None for an output that got none); it returns one gradient per schema argument, None
    for arguments that have none."""
    saves: tuple[str, ...]
    formula: Callable[[Any, Mapping[str, Any], tuple[Any, ...]], tuple[Any, ...]]


@dataclass(frozen=True)
class TorchOperator:
    """One torch operator, torch.ops.autosoft.<name>, served by the family `family`.

    schema: the arguments and returns, as torch.library writes them without the name
    ("(Tensor x, int dim) -> Tensor"); it returns the family's outputs, in order.
    call(*arguments): the operator's arguments as the family's call (OperatorCall), raising the
    public function's errors for bad values (the schema already checked the types). It runs on the
    real tensors and, while tracing, on fake ones: it must not read data.
    backward: the autograd formula; None: no backward (gradients are refused, and `instead` names
    the torch function to use where they are needed).
    plan_options: for an operator (Tensor x, int dim) whose call along the last dim is
    call_family(family, (x,), options=plan_options) with no scalars: the call then takes
    call_family's cached plan directly, the operator's only Python on its hot path."""
    name: str
    family: str
    schema: str
    call: Callable[..., OperatorCall]
    backward: Backward | None = None
    instead: str = ""
    plan_options: Mapping[str, OptionValue] | None = None


def declared_operators(families: Mapping[str, Any]) -> Iterator[TorchOperator]:
    """Every operator the families declare for themselves (TorchOperator.family their own name:
    a subclass family inherits its parent's declarations, which stay its parent's), each name once."""
    seen: dict[str, TorchOperator] = {}
    for name, family in families.items():
        for operator in getattr(family, "torch_operators", ()):
            if operator.family != name:
                continue
            if operator.name in seen and seen[operator.name] != operator:
                raise ValueError(f"two torch operators are named {operator.name!r} (families "
                                 f"{seen[operator.name].family} and {name})")
            if operator.name not in seen:
                seen[operator.name] = operator
                yield operator
