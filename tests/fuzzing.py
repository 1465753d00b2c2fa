"""Schemathesis operations as plain pytest parameters (`from tests.fuzzing import operations, cases`).

`schema.parametrize()` gives every operation of a schema the same node id under pytest 9, so pytest-xdist, which
schedules by node id, ran one of the 24 and dropped the rest. Parametrizing over the operations with their labels as
ids ("POST /v1/chat/completions") gives each its own stable id; a test draws its cases with hypothesis' `data()`
from the same per-mode strategies schemathesis' own test builder joins with `one_of`.
"""

from __future__ import annotations

from hypothesis import strategies as st
from schemathesis import GenerationMode


def operations(schema) -> list:
    """Every operation of a schemathesis schema, to parametrize a test over (ids: `label`)."""
    return [result.ok() for result in schema.get_all_operations()]


def label(operation) -> str:
    """An operation's test id: its method and path, e.g. "POST /v1/chat/completions"."""
    return operation.label


def cases(operation) -> st.SearchStrategy:
    """Schemathesis cases for one operation in both its modes (schemathesis' default): what the description allows
    (positive) and what it does not (negative)."""
    return st.one_of([operation.as_strategy(generation_mode=mode) for mode in GenerationMode])
