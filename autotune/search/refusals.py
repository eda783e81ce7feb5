"""Configurations a trainer refuses by name: learned from a crash's error line, never launched again.

A trainer refuses some settings at start-up with an error that names the knob and its value, in the
knob's own name: Megatron-Core's ``num_attention_heads (28) must be a multiple of
tensor_model_parallel_size (8)``, a rule the user of a space may not know for every model. Such a
crash says nothing of memory, so the planner learned nothing from it, and the candidate pool offered
the same refused value in other settings again and again: nine of thirty trials of one search of a
NeMo-RL-style trainer died so (docs/benchmarks-notes.md, forty-sixth pass).

What is learned is only what the line says: the knobs of the crashed candidate it names, each
followed by the value the candidate had (``name (8)``, ``name=8``, ``name: 8``, ``name 8``,
``name='cpu'``), among the knobs the search varies (a pinned value refused would rule out every
candidate; three crashes alike stop the search with the trainer's line instead). A candidate that
holds all of those values is refused, whatever its other knobs; one that differs in any of them is
not. A refusal that also depends on a knob the line does not name would overreach, so a success
that holds every named value (it ran its steps) contradicts it, and it is dropped. A line naming no
knob of the space teaches nothing here: the same crash twice on one candidate closes that candidate
(``study.record.crashed_alike``), three in a row stop the search (``search/stopping.py``).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from autotune.trial.failure_texts import transient_error

# between a knob's name and its value: ``name (8)``, ``name=8``, ``name: 8``, ``name 8``, a repr's
# ``name='cpu'``; no sign or comparison (``max_steps=-1`` does not name 1, ``size > 8`` not 8)
_BETWEEN = r"(?:\s*[=:(]\s*|\s+)['\"]?"
# after the value: not more of a word, a number or a path (8 is not 80, 8.5, 8-bit; cpu is not cpu/nvme)
_AFTER = r"(?!\w|[-/.]\w)"


def named(
    error_line: str | None, params: dict[str, Any], searched: Collection[str] | None = None
) -> dict[str, Any]:
    """The knobs of ``params`` (those in ``searched``, where given) that ``error_line`` names
    together with the value ``params`` has (a boolean in either case); empty where it names none,
    or where the line is a known transient class (an NCCL timeout that happens to print a rank's
    setting)."""
    if not error_line or transient_error(error_line):
        return {}
    out = {}
    for name, value in params.items():
        text = str(value)
        if not text or (searched is not None and name not in searched):
            continue
        shown = f"(?i:{re.escape(text)})" if isinstance(value, bool) else re.escape(text)
        if re.search(rf"(?<!\w){re.escape(name)}(?!\w){_BETWEEN}{shown}{_AFTER}", error_line):
            out[name] = value
    return out


@dataclass
class Refusals:
    """The refusals learned so far: (trial number, the named knobs and values, the error line)."""

    learned: list[tuple[int, dict[str, Any], str]] = field(default_factory=list)

    def learn(
        self, number: int, params: dict[str, Any], error_line: str | None, searched: Collection[str]
    ) -> None:
        """After a launched trial crashed: keep what its error line names among the knobs the search
        varies, if anything. A pinned knob is left out: refusing its value would refuse every
        candidate, where three crashes alike stop the search with the trainer's own line."""
        culprits = named(error_line, params, searched)
        if culprits:
            self.learned.append((number, culprits, error_line or ""))

    def reason(self, params: dict[str, Any], ran: Iterable[dict[str, Any]] = ()) -> str | None:
        """Why ``params`` is refused (it holds every value a crash named), or None; ``ran``: the
        parameters of the successes, any of which holding those values contradicts the refusal."""
        if not self.learned:
            return None  # asked of every candidate of the grid: nothing is built for none
        ran = list(ran)
        for number, culprits, line in self.learned:
            if not all(params.get(k) == v for k, v in culprits.items()):
                continue
            if any(all(r.get(k) == v for k, v in culprits.items()) for r in ran):
                continue  # it ran with those values: the refusal depends on something else too
            what = " ".join(f"{k}={v}" for k, v in culprits.items())
            return f"the trainer refused {what} in trial {number}: {line}"
        return None
