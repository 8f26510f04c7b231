"""Every registered family, and the test-only fault family, passes the conformance suite.
A new family joins by being registered (or by one line in CASES for a test-only family)."""
from __future__ import annotations

import pytest

from autosoft.families import families
from autosoft.testing.conformance import *  # noqa: F401,F403 - the suite's tests
from autosoft.testing.conformance import Case
from fault_family import FAULTY

CASES = [Case(family) for family in families().values()] + [Case(FAULTY, all_correct=False)]


@pytest.fixture(params=CASES, ids=str)
def conformance_case(request) -> Case:
    return request.param
