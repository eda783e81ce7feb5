"""What is computed of a candidate, kept while what it was computed under stays the same.

The planner judges each candidate against every trial it has seen, and its walks over the grid (the
open candidates, the convergence test) ask for the same few hundred candidates thousands of times a
search: recomputing their memory estimate and vector took most of a simulated search's CPU time.
The planner empties its memo at every trial it learns from, and a table that reaches ``LIMIT``
entries starts again: a walk over a large grid (30,000 candidates) would otherwise leave megabytes of
keys the controller's heap keeps (test_report_rewrites_do_not_grow_the_controller saw 12 MiB).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
LIMIT = 1024  # entries per table


def candidate_key(params: dict[str, Any]) -> tuple[tuple[str, Any], ...] | None:
    """A candidate as a dictionary key (None when a value cannot be one)."""
    try:
        key = tuple(sorted(params.items()))
        hash(key)
    except TypeError:
        return None
    return key


class Memo:
    """One table per kind of value, emptied when any object it was computed under (``owners``: the
    model, the recipe, what is known of the knobs) is replaced by another."""

    def __init__(self) -> None:
        self._tables: dict[str, tuple[tuple[Any, ...], dict[Any, Any]]] = {}

    def clear(self) -> None:
        self._tables.clear()

    def get(self, name: str, owners: tuple[Any, ...], params: dict[str, Any], compute: Callable[[], T]) -> T:
        key, held = candidate_key(params), self._tables.get(name)
        if held is None or len(held[0]) != len(owners) or any(a is not b for a, b in zip(held[0], owners)):
            held = self._tables[name] = (owners, {})
        if key is None:
            return compute()
        table = held[1]
        if key not in table:
            if len(table) >= LIMIT:
                table.clear()
            table[key] = compute()
        return table[key]
