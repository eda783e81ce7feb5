"""What every step of the search's walk reads, gathered once per proposal.

Each step of the local walk (:mod:`~autotune.search.momentum`, :mod:`~autotune.search.trade`,
:mod:`~autotune.search.coverage`, :mod:`~autotune.search.cures`) and each measured-optimum test
(:mod:`~autotune.search.prior_check`) asks the same things: what the planner measured and rules out,
which knobs the space has and which the user pinned, the rules a candidate must pass, which
candidates were already tried and how a candidate's key is made. The policy builds one :class:`Walk`
for a proposal, and the convergence test one for each time it asks, and hands it to every step, so
a step's signature says only what is its own (the trial it steps from, the bar it must beat).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from autotune.candidate import constraints
from autotune.candidate.space import Space
from autotune.search.planner import Planner

Rule = Callable[[dict[str, Any]], "str | None"]


@dataclass(frozen=True, eq=False)
class Walk:
    """The ground a walk step stands on (see the module). Frozen only against reassigning a field:
    ``tried`` is the caller's own set, read and never copied, so a caller that adds to it between two
    asks is seen by the next."""

    planner: Planner
    space: Space
    fixed: dict[str, Any]  # the user's pins: never moved
    rules: tuple[Rule, ...]  # the space's and the user's rules
    tried: set[str]  # keys the caller counts as tried (the policy: measured or running; the stop: measured)
    key: Callable[[dict[str, Any]], str]

    @classmethod
    def of(
        cls,
        planner: Planner,
        space: Space,
        fixed: dict[str, Any],
        rules: Iterable[Rule],
        tried: set[str],
        key: Callable[[dict[str, Any]], str],
    ) -> Walk:
        return cls(planner, space, fixed, tuple(rules), tried, key)

    @property
    def names(self) -> list[str]:
        """The knobs the search moves: the space's, less the pinned ones."""
        return [n for n in self.space.params if n not in self.fixed]

    def candidate(self, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` derived and normalized as a candidate of the space."""
        return self.space.normalize(constraints.derive(params, self.planner.recipe))

    def open(self, cand: dict[str, Any]) -> bool:
        """Whether ``cand`` is untried, passes the rules and nothing the planner knows rules it out."""
        return (
            self.key(cand) not in self.tried
            and not constraints.violations(cand, self.planner.recipe, self.rules)
            and not self.planner.verdict(cand).skip
        )
